"""kernels.py, cache.py and gate.py lift out of the project: each, copied with only what it imports
(cache.py: kernels.py) into an empty folder, runs there in a fresh Python process whose import path
holds that folder alone: attention on a ragged cache against its reference, a prefill through an
EvictingCache and one eviction, a gate scoring hidden states as the literal formula does."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

KERNELS = """
import torch
import kernels
from kernels import RaggedKV, attention_reference, varlen_attention

torch.manual_seed(0)
H, G, d, t = 2, 2, 16, 3
kv = RaggedKV(H, d, torch.float32, "cpu")
kv.append(torch.randn(9, H, d), torch.randn(9, H, d), torch.arange(9))
kv.keep_rows(torch.cat([torch.arange(9) >= 3, torch.arange(9) % 2 == 0]))  # heads: 6, 5 rows
kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.arange(9, 10))  # decode: slack
kv.append(torch.randn(t - 1, H, d), torch.randn(t - 1, H, d), torch.arange(10, 12))  # into it
q = torch.randn(t, H * G, d)
k, v, cu_k, used, max_len = kv.keys_values()
assert bool((used < torch.diff(cu_k)).any()), "slack after a decode-sized append"
qv = q.view(t, H, G, d).transpose(0, 1).reshape(H * t, G, d)  # each KV head one sequence
cu_q = torch.arange(H + 1, dtype=torch.int32) * t
want = attention_reference(qv, k, v, cu_q, cu_k, t, max_len, d ** -0.5, seqused_k=used)
backends = ["torch"] + (["triton"] if kernels.triton is not None else [])
for backend in backends:
    got = varlen_attention(qv, k, v, cu_q, cu_k, t, max_len, d ** -0.5, seqused_k=used,
                           backend=backend)
    err = (got - want).abs().max().item()
    assert err < 1e-4, (backend, err)
got = kv.attend(q, d ** -0.5, backend="torch")  # (t, H*G, d), query head h*G + g
want = want.view(H, t, G, d).transpose(0, 1).reshape(t, H * G, d)
assert (got - want).abs().max().item() < 1e-5
print("ok", backends)
"""

CACHE = """
from types import SimpleNamespace

import torch
from cache import EvictingCache

torch.manual_seed(0)
L, H, G, d, D, W = 3, 2, 2, 8, 16, 4
# what cache.py reads of a model config; layer 1 slides (a ring of W tokens), 0 and 2 compress
cfg = SimpleNamespace(head_dim=d, num_hidden_layers=L, num_key_value_heads=H,
                      compressed_layers=[0, 2], window=lambda i: W if i == 1 else None)


class Scorer:
    def score(self, l, hidden, q, k, pos):
        return torch.rand(H, hidden.shape[0])  # (H, T)


cache = EvictingCache(cfg, Scorer())
for T in (10, 6):  # two prefill chunks
    for layer in range(L):
        q, k, v = torch.randn(T, H * G, d), torch.randn(T, H, d), torch.randn(T, H, d)
        out = cache.attend(layer, q, k, v, torch.randn(T, D), d ** -0.5,
                           W if layer == 1 else None)
        assert out.shape == (T, H * G, d)
    cache.advance(T)
assert cache.n_seen == 16
cache.evict(0, 12, 0.5)  # keep half of positions 0..11 over both compressed layers and heads
kept = sum(cache.layers[i].n_rows for i in cfg.compressed_layers)
assert kept == 2 * H * 4 + (2 * H * 12) // 2, kept  # positions 12..15 stay whole
assert cache.layers[1].n_rows == H * W  # the sliding layer holds its window
print("ok", kept)
"""

GATE = """
import math

import torch
from gate import Gates

torch.manual_seed(0)
L, D, H, G, Dp, S, N = 2, 12, 2, 2, 4, 3, 5
g = Gates(L, D, H, G, Dp, S)
with torch.no_grad():  # spread the scores out (the init's zeros give ties)
    g.k_base.normal_(), g.b.normal_()
    g.q_norm.uniform_(0.5, 1.5), g.k_norm.uniform_(0.5, 1.5)


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean() + 1e-6))


hidden = torch.randn(N, D)
with torch.no_grad():
    for l in range(L):
        got = g.score_layer(l, hidden)
        assert got.shape == (H, N), got.shape
        # the literal formula: score_g = 1 / (1 + sum_r exp(base_r - logit)), mean over G
        want = torch.zeros(H, N, dtype=torch.float64)
        for n in range(N):
            qa = g.q_weight[l] @ hidden[n] + g.q_bias[l]
            ka = g.k_weight[l] @ hidden[n]
            for h in range(H):
                k = rms(ka[h * Dp:(h + 1) * Dp], g.k_norm[l])
                total = 0.0
                for j in range(G):
                    q = rms(qa[(h * G + j) * Dp:(h * G + j + 1) * Dp], g.q_norm[l])
                    logit = float(k @ q) / math.sqrt(Dp) + float(g.b[l, h, j])
                    base = [float(g.k_base[l, h, r] @ q) / math.sqrt(Dp) for r in range(S)]
                    total += 1 / (1 + sum(math.exp(b - logit) for b in base))
                want[h, n] = total / G
        err = (got.double() - want).abs().max().item()
        assert err < 1e-5, (l, err)
    assert g(hidden.expand(L, N, D)).shape == (L, H, N)  # the training form
print("ok")
"""


@pytest.mark.parametrize("files, script", [
    (["kernels.py"], KERNELS),
    (["cache.py", "kernels.py"], CACHE),
    (["gate.py"], GATE),
], ids=["kernels", "cache+kernels", "gate"])
def test_lifts_out(tmp_path, files, script):
    for name in files:
        shutil.copy(ROOT / name, tmp_path / name)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TRITON_INTERPRET": "1",
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{files} do not run alone:\n{res.stderr[-3000:]}"
    assert res.stdout.startswith("ok"), res.stdout
