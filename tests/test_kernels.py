"""kernels.py: the reference against SDPA, the Triton kernel against the reference, RaggedKV."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from cache import WindowKV
from kernels import RaggedKV, attention_reference, varlen_attention
from serving.batch import extend
from tests.helpers import assert_close

torch.set_num_threads(1)


def sdpa_dense(q, k, v, scale, causal, window):
    """Dense oracle for one sequence: q (M, Hq, d), k/v (N, Hk, d), bottom-right mask built by
    hand."""
    M, Hq, d = q.shape
    N, Hk, _ = k.shape
    G = Hq // Hk
    diag = torch.arange(M)[:, None] + (N - M)
    j = torch.arange(N)[None, :]
    allowed = torch.ones(M, N, dtype=torch.bool)
    if causal or window is not None:
        allowed &= j <= diag
    if window is not None:
        allowed &= j > diag - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(G, 0),
        v.float().transpose(0, 1).repeat_interleave(G, 0), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def varlen_case(q_lens, k_lens, Hq, Hk, d, dtype=torch.float32, slack=0, seed=0):
    """Random packed inputs; with slack > 0 every key region gets `slack` junk rows after its
    keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), Hq, d, generator=g).to(dtype)
    regions = [n + slack for n in k_lens]
    k = torch.randn(sum(regions), Hk, d, generator=g).to(dtype)
    v = torch.randn(sum(regions), Hk, d, generator=g).to(dtype)
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + regions, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    used = torch.tensor(k_lens, dtype=torch.int32) if slack else None
    return q, k, v, cu_q, cu_k, used


# -----------------------------------------------------------------------------------------------
# reference vs SDPA

@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 3)])
@pytest.mark.parametrize("M,N", [(1, 1), (7, 7), (7, 40), (64, 64), (1, 300)])
@pytest.mark.parametrize("G", [1, 4])
def test_reference_matches_sdpa_dense(M, N, G, causal, window):
    d, Hk = 64, 2
    q, k, v, cu_q, cu_k, _ = varlen_case([M], [N], Hk * G, Hk, d, seed=M * N + G)
    out = attention_reference(q, k, v, cu_q, cu_k, M, N, 0.1, causal, window)
    assert_close(out, sdpa_dense(q, k, v, 0.1, causal, window), 1e-5, name="reference vs sdpa")


@pytest.mark.parametrize("causal,window", [(True, None), (True, 9), (False, None)])
def test_reference_query_blocks(monkeypatch, causal, window):
    """The reference walks long query runs in blocks; block edges must not change the result."""
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 16)
    # (50, 20): the first blocks see no key under causal alignment
    for M, N in [(50, 70), (50, 20)]:
        q, k, v, cu_q, cu_k, _ = varlen_case([M], [N], 4, 2, 64, seed=3)
        out = attention_reference(q, k, v, cu_q, cu_k, M, N, 0.1, causal, window)
        # SDPA: NaN rows where we give 0
        expected = sdpa_dense(q, k, v, 0.1, causal, window).nan_to_num()
        assert_close(out, expected, 1e-5, name="blocked reference vs sdpa")


def test_reference_varlen_is_per_sequence_and_ignores_slack():
    # several sequences, slack rows full of junk, one empty key set, one N < M (rows without keys)
    q_lens, k_lens = [3, 1, 5, 4], [10, 0, 20, 2]
    q, k, v, cu_q, cu_k, used = varlen_case(q_lens, k_lens, 8, 2, 32, slack=3)
    for b, n in enumerate(k_lens):  # slack rows: huge values that would dominate if they leaked in
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = 1e4
    out = attention_reference(q, k, v, cu_q, cu_k, 5, 20, None, True, None, used)
    for b in range(4):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        M, N = q_lens[b], k_lens[b]
        if N == 0:
            assert (out[q0:q1] == 0).all()
            continue
        ref = sdpa_dense(q[q0:q1], k[k0:k0 + N], v[k0:k0 + N], 32 ** -0.5, True, None)
        ok = (torch.arange(M) + N - M >= 0)  # rows that see at least one key
        assert_close(out[q0:q1][ok], ref[ok], 1e-5, name=f"sequence {b}")
        assert (out[q0:q1][~ok] == 0).all()


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 300)])
@pytest.mark.parametrize("G", [1, 4])
def test_torch_path_matches_reference(monkeypatch, G, causal, window):
    """sdpa_attention (the CPU path: PyTorch's fused attention on the reference's blocks) against
    the reference: ragged sequences with slack, an empty one, one row, N < M, several blocks per
    sequence."""
    monkeypatch.setattr(kernels, "SDPA_BLOCK", 16)
    monkeypatch.setattr(kernels, "MASK_ELEMENTS", 64)  # several blocks without a window too
    q_lens, k_lens = [3, 1, 5, 40, 30, 1], [10, 0, 20, 70, 12, 300]
    q, k, v, cu_q, cu_k, used = varlen_case(q_lens, k_lens, 2 * G, 2, 32, slack=3, seed=G)
    args = (q, k, v, cu_q, cu_k, 40, 300, 0.2, causal, window, used)
    out = kernels.sdpa_attention(*args)
    assert_close(out, attention_reference(*args), 1e-5,
                 name=f"torch path causal={causal} window={window}")


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 30)])
@pytest.mark.parametrize("M,N", [(40, 40), (40, 70), (1, 70), (30, 12)])
def test_torch_path_one_shape_batched(monkeypatch, M, N, causal, window):
    """Sequences of one shape (a layer's heads before eviction, with slack) go through SDPA
    together, as the batch dimension: the same result as the reference, sequence by sequence; block
    shapes repeat (mask cache)."""
    monkeypatch.setattr(kernels, "SDPA_BLOCK", 16)
    monkeypatch.setattr(kernels, "MASK_ELEMENTS", 64)  # several blocks without a window too
    q, k, v, cu_q, cu_k, used = varlen_case([M] * 3, [N] * 3, 8, 2, 32, slack=3, seed=M + N)
    for b in range(3):  # junk in the slack rows: they must never be read
        k[int(cu_k[b]) + N:int(cu_k[b + 1])] = 1e4
    args = (q, k, v, cu_q, cu_k, M, N, 0.2, causal, window, used)
    assert_close(kernels.sdpa_attention(*args), attention_reference(*args), 1e-5,
                 name="one-shape batch")


def test_backend_selection(monkeypatch):
    q, k, v, cu_q, cu_k, _ = varlen_case([4], [9], 4, 2, 16)
    ref = attention_reference(q, k, v, cu_q, cu_k, 4, 9)
    fast = kernels.sdpa_attention(q, k, v, cu_q, cu_k, 4, 9)
    monkeypatch.setenv("FASTKVZIP_ATTN_BACKEND", "reference")
    assert torch.equal(varlen_attention(q, k, v, cu_q, cu_k, 4, 9), ref)
    monkeypatch.delenv("FASTKVZIP_ATTN_BACKEND")
    assert torch.equal(varlen_attention(q, k, v, cu_q, cu_k, 4, 9), fast)  # CPU tensors -> torch
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, cu_q, cu_k, 4, 9, backend="nope")


# -----------------------------------------------------------------------------------------------
# RaggedKV

def test_ragged_append_attend_matches_dense_causal():
    H, G, d, T = 2, 3, 16, 11
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, H * G, d, generator=g), torch.randn(T, H, d, generator=g),
               torch.randn(T, H, d, generator=g))
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(k[:7], v[:7], torch.arange(7))              # a 7-token prefill ...
    out_prefill = kv.attend(q[:7], 0.25)
    outs = [out_prefill]
    for t in range(7, T):                                 # ... then decode one token at a time
        kv.append(k[t:t + 1], v[t:t + 1], torch.tensor([t]))
        outs.append(kv.attend(q[t:t + 1], 0.25))
    ref = sdpa_dense(q, k, v, 0.25, True, None)
    assert_close(torch.cat(outs), ref, 1e-5, name="ragged causal")
    assert kv.n_rows == H * T and kv.lens.tolist() == [T] * H
    assert torch.equal(kv.head_pos(1), torch.arange(T))
    assert torch.isinf(kv.head_score(0)).all()


def test_ragged_keep_rows_window_and_companions():
    H, G, d, T = 3, 2, 16, 20
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(T, H, d, generator=g), torch.randn(T, H, d, generator=g)
    score = torch.rand(H, T, generator=g)
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(k, v, torch.arange(100, 100 + T), score)
    keep = [score[h] > 0.5 for h in range(H)]
    kv.keep_rows(torch.cat(keep))
    for h in range(H):
        assert torch.equal(kv.head_pos(h), torch.arange(100, 100 + T)[keep[h]])
        assert torch.equal(kv.head_score(h), score[h][keep[h]])
    assert kv.nbytes == kv.n_rows * 2 * d * 4, "keep_rows must free the evicted rows and the slack"
    # attention over the kept rows equals dense attention over the same rows, head by head
    q = torch.randn(1, H * G, d, generator=g)
    out = kv.attend(q, 0.3)
    for h in range(H):
        kh, vh = k[:, h][keep[h]], v[:, h][keep[h]]
        ref = sdpa_dense(q[:, h * G:(h + 1) * G], kh[:, None], vh[:, None], 0.3, True, None)
        assert_close(out[:, h * G:(h + 1) * G], ref, 1e-5, name=f"head {h}")
    kv.set_tail_scores(torch.zeros(H, 2))
    assert all((kv.head_score(h)[-2:] == 0).all() for h in range(H))
    lens = kv.lens.clone()
    kv.drop_last(1)
    assert torch.equal(kv.lens, lens - 1) and kv.nbytes == kv.n_rows * 2 * d * 4
    # the last 3 rows of every head
    kv.keep_rows(torch.cat([torch.arange(int(n)) >= int(n) - 3 for n in kv.lens]))
    assert kv.lens.tolist() == [3] * H and kv.nbytes == kv.n_rows * 2 * d * 4
    assert torch.equal(kv.head_pos(0), torch.arange(100, 100 + T)[keep[0]][-4:-1])


@pytest.mark.parametrize("G", [1, 4])
def test_one_token_path_matches_reference(G):
    """RaggedKV.attend of one token on the torch path (per head softmax(q k^T) v, no masks) against
    the reference on the same rows: ragged heads after eviction, an empty head, slack, windows < and
    > n."""
    H, d = 3, 32
    g = torch.Generator().manual_seed(G)
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(torch.randn(60, H, d, generator=g), torch.randn(60, H, d, generator=g),
              torch.arange(60))
    kv.keep_rows(torch.cat([torch.rand(60, generator=g) > 0.3, torch.zeros(60, dtype=torch.bool),
                            torch.rand(60, generator=g) > 0.8]))
    kv.append(torch.randn(1, H, d, generator=g), torch.randn(1, H, d, generator=g),
              torch.tensor([60]))  # slack now
    kv.lens[1] = 0  # head 1 keeps nothing at all
    q = torch.randn(1, H * G, d, generator=g)
    k, v, cu_k, used, max_len = kv.keys_values()
    cu_q = torch.arange(H + 1, dtype=torch.int32)
    for window in (None, 5, 1000):
        ref = attention_reference(q.view(H, G, d), k, v, cu_q, cu_k, 1, max_len, 0.2, True, window,
                                  used)
        assert_close(kv.attend(q, 0.2, window, backend="torch"), ref.view(1, H * G, d), 1e-5,
                     name=f"window={window}")


def test_ragged_window_attend():
    H, G, d, T, W = 2, 2, 16, 12, 4
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, H * G, d, generator=g), torch.randn(T, H, d, generator=g),
               torch.randn(T, H, d, generator=g))
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(k, v, torch.arange(T))
    assert_close(kv.attend(q, 0.25, window=W), sdpa_dense(q, k, v, 0.25, True, W), 1e-5,
                 name="window")


@pytest.mark.parametrize("window", [None, 100])
def test_alike_heads_path_matches_reference(window):
    """Heads holding equal regions (a prefill before eviction) take the torch path's dense_attention
    (one SDPA call per block over all heads, no varlen copies): a second chunk after a first, with
    several query blocks (window blocks of SDPA_BLOCK rows), equals the reference on the same rows."""
    H, G, d = 2, 3, 16
    g = torch.Generator().manual_seed(7)
    kv = RaggedKV(H, d, torch.float32, "cpu")
    for n, t in ((0, 300), (300, 400)):
        q = torch.randn(t, H * G, d, generator=g)
        kv.append(torch.randn(t, H, d, generator=g), torch.randn(t, H, d, generator=g),
                  torch.arange(n, n + t))
        assert kv.uniform() == (n + t, n + t)
        assert_close(kv.attend(q, 0.25, window, backend="torch"),
                     kv.attend(q, 0.25, window, backend="reference"), 1e-5,
                     name=f"chunk at {n}, window={window}")


def test_ragged_append_into_slack_does_not_reallocate():
    H, d = 4, 8
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(torch.randn(99, H, d), torch.randn(99, H, d), torch.arange(99))
    assert kv.k.shape[0] == H * 99, "a prefill-sized append is allocated exactly"
    kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([99]))
    ptr, cap = kv.k.data_ptr(), kv.k.shape[0]
    assert cap > H * 100, "a token-by-token append must leave slack"
    n = 0
    while H * (100 + n + 1) <= cap and (kv.caps - kv.lens).min() > 0:  # every head still has room
        kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([100 + n]))
        n += 1
    assert n > 10 and kv.k.data_ptr() == ptr and kv.v.shape[0] == cap, (
        "append into slack reallocated")
    # growth is geometric: appending 10x more tokens reallocates only a handful of times
    reallocs, last = 0, kv.k.data_ptr()
    for i in range(1000):
        kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([1000 + i]))
        reallocs += kv.k.data_ptr() != last
        last = kv.k.data_ptr()
    assert reallocs <= 8, f"{reallocs} reallocations for 1000 appends"
    assert kv.lens.tolist() == [1100 + n] * H and kv.n_rows == H * (1100 + n)


def test_slack_is_bounded_after_a_long_prefill():
    """A prefill whose last chunk is one token must not leave the cache holding 50% unused rows."""
    from kernels import MAX_SLACK
    H, d = 2, 8
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(torch.randn(6000, H, d), torch.randn(6000, H, d), torch.arange(6000))
    kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([6000]))
    assert kv.caps.tolist() == [6001 + MAX_SLACK] * H and kv.k.shape[0] == H * (6001 + MAX_SLACK)


# The Triton kernel on CPU tensors runs only under the interpreter (conftest.py sets it without
# CUDA); with CUDA the kernel is compiled, and the `gpu` tests below run it on CUDA tensors instead.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernel on CPU tensors needs the interpreter")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_window_ring_matches_dense_window(backend):
    """WindowKV, fed prefill chunks and single tokens in any mix, gives what dense attention with
    the window mask over every token gives, holds exactly the last min(n, W) tokens in at most W
    rows, and writes a decode token into a full ring in place (no re-layout)."""
    if backend == "triton":
        pytest.importorskip("triton")
    H, G, d, W = 2, 2, 16, 6
    steps = [4, 1, 1, 3, 1, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 2, 1]  # tokens per forward
    T = sum(steps)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, H * G, d, generator=g), torch.randn(T, H, d, generator=g),
               torch.randn(T, H, d, generator=g))
    kv, outs, n = WindowKV(H, d, W, torch.float32, "cpu"), [], 0
    for t in steps:
        ptr = kv.k.data_ptr()
        kv.append(k[n:n + t], v[n:n + t], torch.arange(n, n + t))
        outs.append(kv.attend(q[n:n + t], 0.25, window=W, backend=backend))
        kv.wrap()
        if t == 1 and n >= W:  # a full ring: the token went over the oldest row, in place
            assert kv.k.data_ptr() == ptr, "a decode token re-laid out the ring"
        n += t
        assert kv.lens.tolist() == [min(n, W)] * H and kv.k.shape[0] <= H * W
        assert n < W or kv.k.shape[0] == H * W
        for h in range(H):
            assert sorted(kv.head_pos(h).tolist()) == list(range(max(0, n - W), n))
    assert_close(torch.cat(outs), sdpa_dense(q, k, v, 0.25, True, W), 1e-5,
                 name=f"window ring ({backend})")
    with pytest.raises(NotImplementedError):
        kv.keep_rows(torch.ones(kv.n_rows, dtype=torch.bool))
    # a context shorter than the window holds only itself
    short = WindowKV(H, d, 512, torch.float32, "cpu")
    short.append(torch.randn(100, H, d), torch.randn(100, H, d), torch.arange(100))
    short.wrap()
    assert short.k.shape[0] == H * 100


def test_imports_and_runs_without_triton():
    # triton is a test/GPU extra: the module must import and the torch path work without it
    code = ("import sys; sys.modules['triton'] = None; import torch, kernels; "
            "kv = kernels.RaggedKV(2, 16, torch.float32, 'cpu'); "
            "kv.append(torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.arange(3)); "
            "assert kv.attend(torch.randn(3, 4, 16), 0.25).shape == (3, 4, 16); print('ok')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


# -----------------------------------------------------------------------------------------------
# Triton kernel vs the reference (on CPU through TRITON_INTERPRET=1, set in conftest.py)

triton = pytest.importorskip("triton")
# output rounding dominates: fp16 has 11 mantissa bits, bf16 8 (and P is rounded before P @ V)
TOL = {torch.float32: (1e-5, 0.0), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
MODES = [(True, None), (False, None), (True, 37)]  # causal, window


@interpreted
@pytest.mark.parametrize("q_len,G,d,dtype,k_lens", [
    (1, 4, 128, torch.bfloat16, [0, 1, 3000, 513]),   # decode, Qwen3-8B head shape
    (1, 8, 64, torch.float32, [2100, 0, 1, 64]),
    (7, 2, 256, torch.float16, [0, 1, 7, 1800]),      # Gemma3 head_dim
    (64, 1, 64, torch.float32, [64, 0, 1, 1100]),
    (300, 2, 64, torch.float32, [300, 1, 0, 700]),    # chunked prefill, rows without keys (N < M)
])
def test_triton_matches_reference_ragged(q_len, G, d, dtype, k_lens):
    # Hk = 2 KV heads per sequence (GQA through the head axis), slack rows after every key region
    q, k, v, cu_q, cu_k, used = varlen_case([q_len] * len(k_lens), k_lens, 2 * G, 2, d, dtype,
                                            slack=5)
    atol, rtol = TOL[dtype]
    for causal, window in MODES:
        args = (q, k, v, cu_q, cu_k, q_len, max(k_lens), 0.1, causal, window, used)
        out = varlen_attention(*args, backend="triton")
        assert out.dtype == dtype
        assert_close(out, attention_reference(*args), atol=atol, rtol=rtol,
                     name=f"causal={causal} window={window}")


@interpreted
@pytest.mark.parametrize("q_len,num_splits", [(1, 4), (7, 3)])
def test_triton_split_keys_matches_reference(q_len, num_splits):
    # flash-decoding path: each split writes a partial output + log-sum-exp, merged afterwards;
    # with 4 splits of whole 256-key blocks the short sequences leave some splits empty
    q, k, v, cu_q, cu_k, used = varlen_case([q_len] * 4, [1500, 0, 1, 300], 8, 2, 64, slack=2)
    for causal, window in MODES:
        args = (q, k, v, cu_q, cu_k, q_len, 1500, None, causal, window, used)
        out = kernels.triton_varlen_attention(*args, num_splits=num_splits)
        assert_close(out, attention_reference(*args), 1e-5,
                     name=f"splits causal={causal} window={window}")


@interpreted
@pytest.mark.parametrize("G,d", [(2, 128), (8, 256)])
def test_triton_dense_matches_sdpa(G, d):
    q, k, v, cu_q, cu_k, _ = varlen_case([33], [90], 2 * G, 2, d)
    for causal, window in [(True, None), (False, None), (True, 16)]:
        out = varlen_attention(q, k, v, cu_q, cu_k, 33, 90, None, causal, window, backend="triton")
        assert_close(out, sdpa_dense(q, k, v, d ** -0.5, causal, window), 1e-5,
                     name=f"causal={causal}")


@interpreted
def test_ragged_attend_triton_backend_and_env(monkeypatch):
    H, G, d = 2, 4, 64
    kv = RaggedKV(H, d, torch.float32, "cpu")
    kv.append(torch.randn(40, H, d), torch.randn(40, H, d), torch.arange(40))
    kv.keep_rows(torch.cat([torch.rand(40) > 0.3, torch.rand(40) > 0.7]))
    kv.append(torch.randn(1, H, d), torch.randn(1, H, d), torch.arange(40, 41))  # slack now
    kv.append(torch.randn(2, H, d), torch.randn(2, H, d), torch.arange(41, 43))  # into it
    q = torch.randn(3, H * G, d)
    ref = kv.attend(q, 0.2, window=9, backend="torch")
    monkeypatch.setenv("FASTKVZIP_ATTN_BACKEND", "triton")
    assert_close(kv.attend(q, 0.2, window=9), ref, 1e-5, name="RaggedKV.attend on triton")


# -----------------------------------------------------------------------------------------------
# GPU only: the compiled kernel (not the interpreter) on realistic sizes

gpu = pytest.mark.gpu  # skipped without CUDA (conftest.py)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_len,d", [(1, 128), (1, 256), (300, 128), (1000, 256)])
def test_triton_gpu_matches_reference(q_len, d, dtype):
    k_lens = [0, 1, 20000, q_len, 4097, 333, 70000, 5]
    q, k, v, cu_q, cu_k, used = (x.cuda() if x is not None else None for x in
                                 varlen_case([q_len] * 8, k_lens, 8, 2, d, dtype, slack=7,
                                             seed=q_len))
    # fp32 runs as 3xTF32 on tensor cores (kernels.py): close to, not exactly, IEEE fp32
    atol, rtol = (5e-5, 5e-5) if dtype == torch.float32 else TOL[dtype]
    for causal, window in MODES + [(True, 1024)]:
        args = (q, k, v, cu_q, cu_k, q_len, max(k_lens), None, causal, window, used)
        assert_close(varlen_attention(*args), attention_reference(*args), atol=atol, rtol=rtol,
                     name=f"{causal} {window}")


GPU_TOL = {torch.bfloat16: TOL[torch.bfloat16], torch.float32: (5e-5, 5e-5)}  # fp32: 3xTF32


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gpu_batched_layout(dtype):
    """A batch's layout (serving/batch.py) on the compiled kernel: the heads of B sequences side by
    side in one RaggedKV, each evicted to its own length (one head to nothing), slack after a decode
    token; one decode query per query head gives the reference's result over each sequence's own
    rows, and what each sequence's own RaggedKV gives alone."""
    torch.manual_seed(0)
    H, G, d, dev = 8, 4, 128, "cuda"  # Qwen3-8B's attention shape
    seqs = []
    for n in (3000, 17, 40000, 1, 9000):
        kv = RaggedKV(H, d, dtype, dev)
        kv.append(torch.randn(n, H, d, device=dev).to(dtype),
                  torch.randn(n, H, d, device=dev).to(dtype), torch.arange(n))
        # every head its own length
        kv.keep_rows(torch.cat([torch.rand(n) < share for share in torch.rand(H)]))
        kv.append(torch.randn(1, H, d, device=dev).to(dtype),
                  torch.randn(1, H, d, device=dev).to(dtype), torch.tensor([n]))
        seqs.append(kv)
    batch = RaggedKV(0, d, dtype, dev)
    for kv in seqs:
        extend(batch, kv)
    B = len(seqs)
    q = torch.randn(1, B * H * G, d, device=dev).to(dtype)
    out = batch.attend(q, d ** -0.5)  # CUDA tensors: the compiled Triton kernel
    k, v, cu_k, used, max_len = batch.keys_values()
    cu_q = torch.arange(B * H + 1, dtype=torch.int32, device=dev)
    ref = attention_reference(q.view(B * H, G, d), k, v, cu_q, cu_k, 1, max_len, d ** -0.5, True,
                              None, used)
    atol, rtol = GPU_TOL[dtype]
    assert_close(out, ref.view(1, B * H * G, d), atol=atol, rtol=rtol, name="batched layout")
    for b, kv in enumerate(seqs):
        heads = slice(b * H * G, (b + 1) * H * G)
        assert_close(out[:, heads], kv.attend(q[:, heads], d ** -0.5), atol=atol, rtol=rtol,
                     name=f"seq {b}")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gpu_window_ring(dtype):
    """Gemma3's sliding layers on the compiled kernel: a WindowKV ring (window 512, head_dim 256, as
    Gemma 3 1B) fed prefill chunks and decode tokens in any mix gives dense windowed attention over
    every token, chunk rows and ring rows alike."""
    H, G, d, W = 1, 4, 256, 512
    steps = [700, 1, 1, 300, 1, 1, 1, 1000, 1, 1, 64, 1]  # tokens per forward
    T = sum(steps)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(T, n, d, generator=g).to(dtype) for n in (H * G, H, H))
    kv, outs, n = WindowKV(H, d, W, dtype, "cuda"), [], 0
    for t in steps:
        kv.append(k[n:n + t].cuda(), v[n:n + t].cuda(), torch.arange(n, n + t))
        outs.append(kv.attend(q[n:n + t].cuda(), d ** -0.5, window=W).cpu())
        kv.wrap()
        n += t
        assert kv.lens.tolist() == [min(n, W)] * H
    atol, rtol = GPU_TOL[dtype]
    assert_close(torch.cat(outs), sdpa_dense(q, k, v, d ** -0.5, True, W), atol=atol, rtol=rtol,
                 name="window ring on CUDA")


# -----------------------------------------------------------------------------------------------
# No GPU needed: compile the real kernel (not the interpreter) for sm_90 (H100/H200) with the
# configs triton_varlen_attention uses, and check that it fits: shared memory <= 227 KB, and no
# register spills for the 16-bit inputs that matter (read from ptxas -v).

# rows = packed query rows: 4 is decode (split path), 1024 prefill
SM90_CASES = [(dtype, d, rows) for dtype, d in [("bfloat16", 128), ("bfloat16", 256),
                                                ("float32", 256)]
              for rows in (4, 1024)]


def compile_for_sm90(dtype, d, rows):
    """-> (shared memory bytes, spilled bytes or None). Needs the JIT kernel, not the interpreted
    one: run it in a process without TRITON_INTERPRET (see sm90_report)."""
    import os
    import re
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    dtype = getattr(torch, dtype)
    fn = kernels._varlen_attn_kernel
    names = fn.arg_names
    bm, bn, warps, stages = kernels._block_config(rows, d, dtype.itemsize)
    split = rows <= 16  # decode uses the split-keys path, prefill the direct one
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sig = {n: "constexpr" for n in names}
    sig.update({n: elem for n in ("Q", "K", "V")}, O="*fp32" if split else elem, LSE="*fp32",
               cu_q="*i32", cu_k="*i32", used_k="*i32", qk_scale="fp32", window="i32", group="i32",
               n_splits="i32", **{n: "i32" for n in names if n.startswith("s_")})
    consts = dict(BOUNDED=True, WINDOWED=not split, HAS_USED=True, SPLIT=split, UPCAST=False,
                  PRECISION="tf32x3" if dtype == torch.float32 else "tf32", D=d, BLOCK_M=bm,
                  BLOCK_N=bn)
    # what the JIT infers at launch: 16-byte aligned tensors, row/head strides multiple of 16
    aligned = [n for n in names if sig[n].startswith("*") or n in
               ("s_qt", "s_qh", "s_kt", "s_kh", "s_vt", "s_vh", "s_os", "s_ot", "s_oh")]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    spills = None
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(ptxas):
        ptx = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fastkvzip_attn_{os.getpid()}.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        os.remove(ptx)
        spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info))
    return compiled.metadata.shared, spills


@functools.lru_cache(maxsize=None)
def sm90_report():
    """Compile every SM90_CASES config in one child process (TRITON_INTERPRET unset)."""
    # python -c imports from its cwd
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json; import tests.test_kernels as t; "
            "print(json.dumps([t.compile_for_sm90(*c) for c in t.SM90_CASES]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return dict(zip(SM90_CASES, json.loads(res.stdout.splitlines()[-1])))


@pytest.mark.parametrize("case", SM90_CASES, ids=[f"{t}-d{d}-rows{r}" for t, d, r in SM90_CASES])
def test_kernel_compiles_for_sm90(case):
    shared, spills = sm90_report()[case]
    assert shared <= 227 * 1024, (f"{case}: {shared} bytes of shared memory, the launch would "
                                  "fail on sm_90")
    if case[0] != "float32" and spills is not None:  # fp32 is the slow correctness path
        assert spills == 0, f"{case}: {spills} bytes of register spills"
