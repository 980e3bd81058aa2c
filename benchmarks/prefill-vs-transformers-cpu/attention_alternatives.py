"""
Whether a causal attention of our own beats the CPU flash kernel that both our prefill and
transformers' call (torch's SDPA), on one layer of a 2K chunk: the attention shape of a model
(query heads, KV heads, head dim), random fp32 inputs, one or more threads. Each candidate is
checked against the kernel's output (max abs difference), then timed (the best of 9 calls):

    kernel      SDPA, is_causal, enable_gqa (what both prefills call for a first chunk)
    rectangle   SDPA without the causal mask: every (query, key) pair, the work a causal kernel
                that skipped nothing would do
    masked B    SDPA per block of B query rows over the keys up to the block's diagonal, an additive
                mask on the diagonal square only (fewer masked pairs than the kernel's own tiles)
    merged B    per block of B rows: the keys before the block without a mask and the block's own
                square with the causal flag, two kernel calls merged by their log-sum-exps
    scores B    per block of B rows: the (rows, keys) scores by one matmul, softmax in place, one
                matmul by the values (no flash kernel)

    python -m benchmarks.prefill-vs-transformers-cpu.attention_alternatives smollm2-135m-gguf 1

Run from the repository root; one line per candidate: milliseconds, GFLOP/s of the causal pairs
(4·d per query head and visible pair, as harness/profile_prefill.py counts them), max difference.
"""
import sys
import time

import torch
import torch.nn.functional as F

from cli import resolve_model
from model import ModelConfig

name, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
T = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
torch.set_num_threads(threads)
cfg = ModelConfig.from_json(resolve_model(name))
Hq, H, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
G, scale = Hq // H, d ** -0.5
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, h, T, d, generator=g) for h in (Hq, H, H))
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, logsumexp)


def kernel():
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def rectangle():
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def diagonal_mask(m):
    return torch.zeros(m, m).masked_fill_(torch.ones(m, m, dtype=torch.bool).triu_(1), -torch.inf)


def masked(B):
    out = torch.empty_like(q)
    for r0 in range(0, T, B):
        r1 = min(T, r0 + B)
        mask = torch.zeros(r1 - r0, r1)
        mask[:, r0:] = diagonal_mask(r1 - r0)
        out[:, :, r0:r1] = F.scaled_dot_product_attention(
            q[:, :, r0:r1], k[:, :, :r1], v[:, :, :r1], attn_mask=mask, scale=scale,
            enable_gqa=True)
    return out


def merged(B):
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out = torch.empty_like(q)
    for r0 in range(0, T, B):
        r1 = min(T, r0 + B)
        o2, l2 = flash(q[:, :, r0:r1], ke[:, :, r0:r1], ve[:, :, r0:r1], 0.0, True, scale=scale)
        if r0 == 0:
            out[:, :, r0:r1] = o2
            continue
        o1, l1 = flash(q[:, :, r0:r1], ke[:, :, :r0], ve[:, :, :r0], 0.0, False, scale=scale)
        top = torch.maximum(l1, l2)
        w1, w2 = (l1 - top).exp_(), (l2 - top).exp_()
        out[:, :, r0:r1] = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    return out


def scores(B):
    out = torch.empty_like(q)
    qg, kt = (q[0] * scale).view(H, G, T, d), k[0].transpose(1, 2)
    for r0 in range(0, T, B):
        r1, m = min(T, r0 + B), min(T, r0 + B) - r0
        s = torch.bmm(qg[:, :, r0:r1].reshape(H, G * m, d), kt[:, :, :r1]).view(H, G, m, r1)
        s[..., r0:] += diagonal_mask(m)
        p = torch.softmax(s, -1)
        out[0].view(H, G, T, d)[:, :, r0:r1] = torch.bmm(p.view(H, G * m, r1),
                                                         v[0, :, :r1]).view(H, G, m, d)
    return out


def best_ms(f, n=9):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


with torch.no_grad():
    want = kernel()
    gflop = 4 * d * Hq * T * (T + 1) / 2 / 1e9
    print(f"{name}: {Hq} query heads, {H} KV heads, d {d}, {T} tokens, {threads} thread(s), "
          f"{gflop:.2f} GFLOP of causal pairs")
    runs = [("kernel", kernel), ("rectangle", rectangle)] + [
        (f"{label} {B}", lambda f=f, B=B: f(B)) for B in (128, 256, 512, 1024)
        for label, f in (("masked", masked), ("merged", merged), ("scores", scores))]
    for label, f in runs:
        ms = best_ms(f)
        diff = float((f() - want).abs().max()) if label != "rectangle" else float("nan")
        print(f"  {label:12s} {ms:8.1f} ms  {gflop / ms * 1e3:6.1f} GFLOP/s  max diff {diff:.1e}")
