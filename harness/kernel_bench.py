"""
Micro-benchmarks of kernels.py: RaggedKV.attend against SDPA (dense, padded) and flash-attn varlen
on the same ragged layout, and the cost of appending one decode token as the cache grows.

    python -m harness.kernel_bench    # CUDA: Qwen3-8B shapes in bf16; CPU: the torch path, small

(run from the repository root.) On CUDA it times the Triton kernel at full sizes; without CUDA it
times the torch path (SDPA on the reference's blocks; one decode token: per-head matmuls) on small
fp32 shapes with one thread.
"""
import time

import torch
import torch.nn.functional as F

from kernels import RaggedKV

try:
    import triton.testing  # do_bench: the CUDA timer
except ImportError:  # CPU-only install
    triton = None


def _timeit(fn, cuda):
    """Seconds per call: triton's do_bench on CUDA, a plain loop of at least 0.3 s on CPU."""
    if cuda:
        return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < 0.3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def _ragged_cache(lens, d, dtype, device):
    """A compacted RaggedKV whose head h holds lens[h] random keys (what eviction leaves)."""
    H, n = len(lens), max(lens)
    kv = RaggedKV(H, d, dtype, device)
    kv.append(torch.randn(n, H, d, dtype=dtype, device=device),
              torch.randn(n, H, d, dtype=dtype, device=device), torch.arange(n))
    # keep each head's last lens[h] rows, no slack
    kv.keep_rows(torch.cat([torch.arange(n) >= n - m for m in lens]))
    return kv


def _bench_attend(name, kv, t, G, cuda):
    """Time RaggedKV.attend for t new queries per head against SDPA (dense, padded to the longest
    head, masked) and flash-attn varlen on the same ragged layout. GB/s and TFLOP/s count the work
    actually needed (kept K/V bytes, visible query-key pairs), the same for every row; the last
    column is each output's max difference from ours (a parity check on the first GPU run)."""
    H, d, dtype, device = kv.n_heads, kv.head_dim, kv.dtype, kv.device
    q = torch.randn(t, H * G, d, dtype=dtype, device=device)
    scale = d ** -0.5
    lens = kv.lens.tolist()
    # K, V read; q read, out written
    nbytes = (sum(lens) * 2 + 2 * t * H * G) * d * q.element_size()
    pairs = sum(G * sum(min(max(i + n - t + 1, 0), n) for i in range(t)) for n in lens)
    flops = 4 * d * pairs  # QK^T and PV: 2 d multiply-adds per visible (query, key) pair
    L = max(lens)
    print(f"{name}: keys per head {min(lens)}..{L} (sum {sum(lens)}), {t} queries x {H * G} "
          f"heads, d={d}, {str(dtype).split('.')[-1]}")
    k_pad = torch.zeros(1, H, L, d, dtype=dtype, device=device)   # the dense padded equivalent
    v_pad = torch.zeros_like(k_pad)
    for h, n in enumerate(lens):
        s = int(kv.starts[h])
        k_pad[0, h, :n], v_pad[0, h, :n] = kv.k[s:][:n], kv.v[s:][:n]
    if min(lens) == L:  # equal heads: bottom-right causal without materialising a (t, L) mask
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(t, L)
    else:  # padding + bottom-right causal per head, (1, H*G, t, L) in GQA order h*G+g
        n_h = torch.tensor(lens, device=device)[:, None, None]
        mask = torch.arange(L, device=device) <= torch.arange(t, device=device)[:, None] + n_h - t
        mask = mask.repeat_interleave(G, 0)[None]
    qd = q.view(t, H * G, d).transpose(0, 1)[None]                 # (1, H*G, t, d)

    def sdpa(k_, v_, gqa):
        return F.scaled_dot_product_attention(qd, k_, v_, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)[0].transpose(0, 1)
    cands = {"ours (" + ("triton" if cuda else "torch") + ")": lambda: kv.attend(q, scale),
             "sdpa dense padded": lambda: sdpa(k_pad, v_pad, True)}
    try:
        sdpa(k_pad, v_pad, True)
    except RuntimeError:  # some SDPA backends refuse GQA with this mask: repeat K/V as HF's repeat_kv
        k_rep, v_rep = k_pad.repeat_interleave(G, 1), v_pad.repeat_interleave(G, 1)
        cands["sdpa dense padded"] = lambda: sdpa(k_rep, v_rep, False)
    try:
        from flash_attn import flash_attn_varlen_func
        k, v, cu_k, _, max_len = kv.keys_values()                  # compacted: cu_k is exact
        qv = q.view(t, H, G, d).transpose(0, 1).reshape(H * t, G, d)
        cu_q = torch.arange(H + 1, dtype=torch.int32, device=device) * t
        cands["flash-attn varlen"] = lambda: flash_attn_varlen_func(
            qv, k, v, cu_q, cu_k, t, max_len, softmax_scale=scale, causal=True
        ).view(H, t, G, d).transpose(0, 1).reshape(t, H * G, d)
    except ImportError:
        print("  (flash-attn not importable: skipped)")
    ours = None
    for label, fn in cands.items():
        try:
            out = fn().float()
            ours = out if ours is None else ours
            s = _timeit(fn, cuda)
            print(f"  {label:26s} {s * 1e3:9.3f} ms {nbytes / s / 1e9:8.1f} GB/s "
                  f"{flops / s / 1e12:7.2f} TFLOP/s   max|diff| {(out - ours).abs().max().item():.2e}")
        except Exception as e:  # a baseline that does not run here must not stop the others
            print(f"  {label:26s} failed: {type(e).__name__}: {str(e)[:100]}")
        del fn


def _bench_append(sizes, H, d, dtype, device, cuda, n_appends=100):
    """Cost of appending one decode token vs cache size. Into slack it must be flat; a regrow
    copies the cache (O(n)) but leaves n/2 rows of slack per head, so its amortised share is flat
    too."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"RaggedKV.append of 1 token, H={H}, d={d}:")
    for n in sizes:
        kv = _ragged_cache([n] * H, d, dtype, device)  # compacted: the first append has to regrow
        k1, pos = torch.randn(1, H, d, dtype=dtype, device=device), torch.tensor([n])
        sync()
        t0 = time.perf_counter()
        kv.append(k1, k1, pos)
        sync()
        regrow = time.perf_counter() - t0
        slack = int((kv.caps - kv.lens).min())
        ptr = kv.k.data_ptr()
        t0 = time.perf_counter()
        for _ in range(n_appends):
            kv.append(k1, k1, pos)
        sync()
        into_slack = (time.perf_counter() - t0) / n_appends
        assert kv.k.data_ptr() == ptr, "append into slack reallocated"
        print(f"  {n:7d} rows/head: into slack {into_slack * 1e6:7.1f} us | regrow "
              f"{regrow * 1e3:8.2f} ms once per {slack} appends = "
              f"{regrow / slack * 1e6:6.1f} us amortised")


def main():
    cuda = torch.cuda.is_available()
    if triton is None and cuda:
        raise SystemExit("the CUDA benchmark needs triton (pip install triton)")
    torch.manual_seed(0)
    H, G, d = 8, 4, 128  # Qwen3-8B: 32 query heads, 8 KV heads, head_dim 128
    if cuda:
        dev, dtype = "cuda", torch.bfloat16
        print(f"CUDA: {torch.cuda.get_device_name()}, Qwen3-8B attention shapes, bf16")
        for total in (32768, 65536, 131072):  # kept keys per layer, 30% of a context of total / 0.3
            lens = (torch.rand(H) + 0.5)                        # per-head retention varies 3x
            lens = (lens / lens.sum() * total).long().clamp(min=1).tolist()
            _bench_attend(f"decode, {total // 1024}K kept keys/layer (30% of "
                          f"{total / 0.3 / H / 1024:.0f}K tokens)",
                          _ragged_cache(lens, d, dtype, dev), 1, G, cuda)
        _bench_attend("chunked prefill, 16K chunk against a 64K-key cache",
                      _ragged_cache([65536 + 16384] * H, d, dtype, dev), 16384, G, cuda)
        _bench_append([1024, 8192, 65536, 524288], H, d, dtype, dev, cuda)
    else:
        print("No CUDA: timing the torch path (SDPA on the reference's blocks; one decode token: "
              "per-head\nmatmuls) on SMALL shapes (fp32, 1 thread). These numbers describe the CPU "
              "path, not the Triton\nkernel (the interpreter is for tests, not speed).")
        torch.set_num_threads(1)
        for total in (2048, 8192):
            lens = (torch.rand(H) + 0.5)
            lens = (lens / lens.sum() * total).long().clamp(min=1).tolist()
            _bench_attend(f"decode, {total} kept keys/layer",
                          _ragged_cache(lens, d, torch.float32, "cpu"), 1, G, cuda)
        _bench_attend("chunked prefill, 256-token chunk against a 2K-key cache",
                      _ragged_cache([2048 + 256] * H, d, torch.float32, "cpu"), 256, G, cuda)
        _bench_append([1024, 8192, 65536], H, d, torch.float32, "cpu", cuda)


if __name__ == "__main__":
    main()
