"""Attention over a ragged, per-KV-head key/value cache (METHOD.md §8).

After gated eviction every KV head of a layer keeps a different number of rows, so a layer's cache
is not a (H, T, d) tensor any more. We store it the way FastKVzip does: each KV head is its own
varlen "sequence" in one flat (rows, d) key tensor and one value tensor, and attention is one
FlashAttention-varlen call in which the G query heads of a KV head are the heads of an MQA call.

This file holds, top to bottom:
  attention_reference  the plain-PyTorch spec: a loop over sequences and query blocks with
                       explicit masks, fp32 softmax.
  sdpa_attention       the CPU path: the same blocks and masks through PyTorch's fused attention.
  varlen_attention     the single entry point; backend= "torch" | "reference" | "triton", or the
                       environment variable FASTKVZIP_ATTN_BACKEND, else Triton on CUDA tensors,
                       torch otherwise.
  the Triton kernel    FlashAttention-style forward: online softmax in fp32, the G query heads of
                       a KV head packed into the rows of one tile (each key block is read once for
                       all of them), keys split across programs for decode (flash-decoding).
  RaggedKV             one layer's storage: per-head regions with slack; append, keep_rows and
                       attend (one new token on the torch path: per head softmax(q k^T) v,
                       no masks). A sliding window's ring of <= W rows per head is a RaggedKV
                       too: cache.WindowKV.
The micro-benchmarks are harness/kernel_bench.py (python -m harness.kernel_bench).

The varlen contract (flash_attn_varlen_func convention, plus FlashAttention-3's seqused_k):
  q (total_q, Hq, d), k and v (total_k, Hk, d), Hq % Hk == 0; query head j reads KV head
  j // (Hq // Hk) (GQA). cu_seqlens_q / cu_seqlens_k are int32 (B+1,) prefix offsets: sequence b
  owns query rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] and the key region cu_seqlens_k[b] ..
  cu_seqlens_k[b+1]. seqused_k (int32 (B,), optional): only the first seqused_k[b] rows of that
  region are keys; the rest is slack and never read. With M query rows and N used keys, query
  row i ends at the "diagonal" key i + N - M (bottom-right alignment: the queries are the newest
  M tokens of the sequence).
  causal=True: row i sees keys j <= i + N - M.
  window=W: row i sees only keys i + N - M - W < j <= i + N - M, the last W keys up to and
  including its diagonal (Gemma3 sliding layers). A window always implies the diagonal bound.
  Softmax in fp32; output (total_q, Hq, d) in q's dtype; a row that sees no key (empty sequence,
  or N < M under causal) is zeros, never NaN.

Swapping in for flash-attn: varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True,
window=W) equals flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
causal=True, window_size=(W - 1, 0)); window=None is window_size=(-1, -1). seqused_k exists only in
FlashAttention-3; with flash-attn 2 pass a RaggedKV right after keep_rows() (no slack: cu_seqlens_k
exact).
"""
import functools
import os

import torch
import torch.nn.functional as F


class ArgumentError(ValueError):
    """A library call given an argument it cannot use (a value, a type, a shape): one sentence that
    names the call and the argument. The method's own invariants stay asserts; this is for what a
    caller passes, and holds under `python -O`."""


# -----------------------------------------------------------------------------------------------
# The reference: the readable spec of the varlen contract above; and the CPU path, the same blocks
# through PyTorch's fused attention.

APPEND_EXACT = 2    # appends of this many tokens or more (prefill chunks, questions): no slack
MAX_SLACK = 1024    # at most this many spare rows per head after a token-by-token append
# query rows per step of the reference: memory (Hq, 1024, N) instead of (Hq, M, N)
QUERY_BLOCK = 1024
# query rows per SDPA call: a window layer's block reads W + 255 keys, not W + 1023
SDPA_BLOCK = 256
# without a window, rows per SDPA call up to a 16 MB fp32 mask (a 2K chunk: one call)
MASK_ELEMENTS = 1 << 22


def _blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, causal, window, block):
    """Yield (q0, r0, r1, k0, j0, j1, M, N) for each block of at most `block` query rows of each
    sequence: its rows q0+r0 .. q0+r1, and the keys k0+j0 .. k0+j1 that its rows can see at all.
    Rows that see no key (an empty sequence; rows before the first diagonal when N < M) are never
    yielded: they stay zero."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    bounded = causal or window is not None
    for b in range(len(cu_q) - 1):
        q0, k0 = cu_q[b], cu_k[b]
        M = cu_q[b + 1] - q0
        N = cu_k[b + 1] - k0 if used is None else used[b]  # rows past seqused_k are slack
        if N == 0:
            continue
        # row i's diagonal key is i + N - M >= 0
        for r0 in range(max(0, M - N) if bounded else 0, M, block):
            r1 = min(M, r0 + block)
            # its first row's window start, its last row's diagonal
            j0 = max(0, r0 + N - M - window + 1) if window is not None else 0
            j1 = min(N, r1 + N - M) if bounded else N
            yield q0, r0, r1, k0, j0, j1, M, N


def _visible(r0, r1, j0, j1, M, N, causal, window, device):
    """(r1 - r0, j1 - j0) bool: query row i may see key j, by the contract
    (bottom-right alignment)."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    diag = i + (N - M)  # the last query row sees the last key
    allowed = torch.ones(r1 - r0, j1 - j0, dtype=torch.bool, device=device)
    if causal or window is not None:
        allowed &= j <= diag
    if window is not None:
        allowed &= j > diag - window  # W keys, the diagonal one included
    return allowed


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale=None, causal=True, window=None, seqused_k=None):
    """Plain-PyTorch varlen attention; see the module docstring for the contract.
    max_seqlen_q / max_seqlen_k are accepted for signature parity and not needed here."""
    total_q, n_q_heads, d = q.shape
    n_kv_heads = k.shape[1]
    assert n_q_heads % n_kv_heads == 0, "Hq must be a multiple of Hk (GQA)"
    group = n_q_heads // n_kv_heads
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(total_q, n_q_heads, d, dtype=torch.float32, device=q.device)
    # query blocks bound memory: a 16K prefill is not (Hq, 16K, 16K)
    blocks = _blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, causal, window, QUERY_BLOCK)
    for q0, r0, r1, k0, j0, j1, M, N in blocks:
        m = r1 - r0
        kb = k[k0 + j0:k0 + j1].float().transpose(0, 1)                 # (Hk, n, d), a view in fp32
        vb = v[k0 + j0:k0 + j1].float().transpose(0, 1)                 # (Hk, n, d)
        # GQA: the G query heads of a KV head are G*m rows of ONE matmul with that head's keys,
        # so K and V are read once per KV head and never repeated G times
        qb = q[q0 + r0:q0 + r1].float().view(m, n_kv_heads, group, d)
        qb = qb.permute(1, 2, 0, 3).reshape(n_kv_heads, group * m, d)  # (Hk, G*m, d), row g*m + i
        s = (qb @ kb.transpose(1, 2)) * scale                           # (Hk, G*m, n)
        # (m, n), the same for every head
        allowed = _visible(r0, r1, j0, j1, M, N, causal, window, q.device)
        s = s.view(n_kv_heads, group, m, -1).masked_fill(~allowed, float("-inf")).view_as(s)
        ob = torch.softmax(s, dim=-1) @ vb  # (Hk, G*m, d); each row sees a key
        ob = ob.view(n_kv_heads, group, m, d).permute(2, 0, 1, 3)       # (m, Hk, G, d)
        out[q0 + r0:q0 + r1] = ob.reshape(m, n_q_heads, d)
    return out.to(q.dtype)


def sdpa_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale=None, causal=True, window=None, seqused_k=None):
    """The "torch" backend (the CPU path): the reference's blocks and masks, each block one call
    of PyTorch's fused scaled_dot_product_attention (flash attention on CPUs: no (n_heads, m, n)
    score tensor written and re-read four times), with smaller blocks so that a window layer reads
    fewer keys (heads that all hold alike regions take dense_attention instead). Masks are built
    once per block shape (_block_mask), none where the block is plainly causal. In fp32, as the
    reference; tests/test_kernels.py holds the two equal."""
    total_q, n_q_heads, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(total_q, n_q_heads, d, dtype=q.dtype, device=q.device)
    # a window layer's block reads only its own keys; otherwise fewer, larger calls (each has a
    # fixed cost)
    block = (SDPA_BLOCK if window is not None
             else max(SDPA_BLOCK, MASK_ELEMENTS // max(1, max_seqlen_k)))
    views = [x[None] for x in (q, k, v)]
    for q0, r0, r1, k0, j0, j1, M, N in _blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, causal,
                                                window, block):
        qb, kb, vb = (x[:, a:b].float().transpose(1, 2) for x, a, b in zip(  # (1, heads, rows, d)
            views, (q0 + r0, k0 + j0, k0 + j0), (q0 + r1, k0 + j1, k0 + j1)))
        mask, is_causal = _block_mask(r1 - r0, j1 - j0, r0 + N - M - j0, causal, window,
                                      str(q.device))
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=is_causal,
                                            scale=scale, enable_gqa=True)
        out[q0 + r0:q0 + r1] = ob[0].transpose(0, 1)
    return out


def dense_attention(q, k, v, scale, window=None):
    """Causal attention of the last t of n positions over n keys in every KV head: q (t, Hq, d), k /
    v (H, n, d) (strided views of alike regions: a full cache, a prefill before eviction) -> (t, Hq,
    d). sdpa_attention's blocks and masks, one SDPA call per block over every head (GQA) in the
    projections' layout: no copy into varlen order or out of it (one block: SDPA's own output)."""
    (t, n_q_heads, d), n, out = q.shape, k.shape[1], None
    block = SDPA_BLOCK if window is not None else max(SDPA_BLOCK, MASK_ELEMENTS // max(1, n))
    cu, dev = [torch.tensor([0, x], dtype=torch.int32) for x in (t, n)], str(q.device)
    qs, ks, vs = q.transpose(0, 1)[None], k[None], v[None]  # (1, Hq, t, d), (1, H, n, d)
    for _, r0, r1, _, j0, j1, M, N in _blocks(*cu, None, True, window, block):
        mask, is_causal = _block_mask(r1 - r0, j1 - j0, r0 + N - M - j0, True, window, dev)
        ob = F.scaled_dot_product_attention(
            qs[:, :, r0:r1].float(), ks[:, :, j0:j1].float(), vs[:, :, j0:j1].float(),
            attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)[0]  # (Hq, m, d)
        if r1 - r0 == t:  # one block: every row
            return ob.transpose(0, 1).to(q.dtype)
        out = q.new_empty(t, n_q_heads, d) if out is None else out  # blocks cover every row
        out[r0:r1] = ob.transpose(0, 1)
    return out


@functools.lru_cache(maxsize=8)  # <= 8 masks of <= 16 MB
def _block_mask(m, n, offset, causal, window, device):
    """-> (additive fp32 mask (m, n) or None, is_causal) for a block whose row i may see key j iff
    j <= i + offset (causal) and j > i + offset - window: _visible's rule in block coordinates.
    Cached: every layer and head of a chunk repeats the same few block shapes. A plainly causal
    square block (offset 0, no window) needs no mask at all: SDPA's own causal flag, which also
    skips the masked tiles."""
    if not (causal or window is not None):
        return None, False
    if offset == 0 and window is None:
        return None, True
    # diagonal of row i at i + offset
    allowed = _visible(0, m, 0, n, m, m + offset, True, window, device)
    return torch.zeros(m, n, device=device).masked_fill_(~allowed, float("-inf")), False


# -----------------------------------------------------------------------------------------------
# The entry point.

BACKENDS = ("torch", "reference", "triton")


def resolve_backend(q, backend=None):
    """backend, else env FASTKVZIP_ATTN_BACKEND,
    else "triton" for CUDA tensors and "torch" otherwise."""
    backend = (backend or os.environ.get("FASTKVZIP_ATTN_BACKEND")
               or ("triton" if q.is_cuda else "torch"))
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (expected one of "
                         f"{', '.join(BACKENDS)})")
    return backend


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, causal=True, window=None, seqused_k=None, backend=None,
                     check=True):
    """Varlen attention (contract in the module docstring). backend: "torch" (sdpa_attention),
    "reference" (attention_reference, the spec) or "triton"; None -> resolve_backend. check: the
    arguments against the contract (check_varlen: it reads the offsets, a host sync on a GPU);
    RaggedKV, which builds them itself, skips it."""
    if check:
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    backend = resolve_backend(q, backend)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window, seqused_k)
    fn = {"torch": sdpa_attention, "reference": attention_reference,
          "triton": triton_varlen_attention}[backend]
    return fn(*args)


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 seqused_k=None):
    """The contract's shapes and offsets, else an ArgumentError naming the first argument that
    breaks it (offsets outside q's or k's rows read other memory, or nothing, without an error)."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] or \
            k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ArgumentError(f"varlen_attention: expected q (total_q, Hq, d), k and v (total_k, "
                            f"Hk, d) with Hq a multiple of Hk, got {shapes}")
    offsets = [cu_seqlens_q, cu_seqlens_k] + ([] if seqused_k is None else [seqused_k])
    if not all(torch.is_tensor(x) and x.dim() == 1 and x.dtype in (torch.int32, torch.int64)
               for x in offsets) or not 1 <= len(cu_seqlens_q) == len(cu_seqlens_k) or \
            seqused_k is not None and len(seqused_k) != len(cu_seqlens_q) - 1:
        raise ArgumentError("varlen_attention: cu_seqlens_q and cu_seqlens_k must be integer "
                            "tensors (B+1,), seqused_k one (B,)")
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = [b - a for a, b in zip(cu_k, cu_k[1:])] if seqused_k is None else seqused_k.tolist()
    if cu_q[0] != 0 or cu_q[-1] != q.shape[0] or any(a > b for a, b in zip(cu_q, cu_q[1:])):
        raise ArgumentError(f"varlen_attention: cu_seqlens_q must rise from 0 to q's "
                            f"{q.shape[0]} rows (it runs {cu_q[0]}..{cu_q[-1]})")
    if cu_k[0] < 0 or cu_k[-1] > k.shape[0] or not all(
            0 <= n <= b - a for a, b, n in zip(cu_k, cu_k[1:], used)):
        raise ArgumentError(f"varlen_attention: cu_seqlens_k must rise within k's {k.shape[0]} "
                            f"rows (it runs {cu_k[0]}..{cu_k[-1]}), each seqused_k within its "
                            f"region")
    longest = (max(b - a for a, b in zip(cu_q, cu_q[1:])) if len(cu_q) > 1 else 0, max(used or [0]))
    if not (max_seqlen_q >= longest[0] and max_seqlen_k >= longest[1]):  # Triton's grid: rows lost
        raise ArgumentError(f"varlen_attention: max_seqlen_q, max_seqlen_k ({max_seqlen_q}, "
                            f"{max_seqlen_k}) must be at least the longest sequence's {longest}")


# -----------------------------------------------------------------------------------------------
# The Triton kernel. Triton is optional: without it the module imports and the torch path works.

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = None

if triton is not None:
    @triton.jit
    def _varlen_attn_kernel(
            Q, K, V, O, LSE, cu_q, cu_k, used_k, qk_scale, window, group, n_splits,
            s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_os, s_ot, s_oh, s_ls, s_lt,
            BOUNDED: tl.constexpr, WINDOWED: tl.constexpr, HAS_USED: tl.constexpr,
            SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program = BLOCK_M packed (query row, query head) pairs of one KV head of one
        sequence, over one split of the keys. Packing the G query heads of a KV head into the rows
        ("pack GQA") makes decode (1 query row) read each key block once for all G heads."""
        pid_m, kv_head, pid_bs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq, split = pid_bs // n_splits, pid_bs % n_splits
        q_start = tl.load(cu_q + seq)
        M = tl.load(cu_q + seq + 1) - q_start
        if pid_m * BLOCK_M >= M * group:
            return
        k_start = tl.load(cu_k + seq)
        if HAS_USED:
            N = tl.load(used_k + seq)  # rows past seqused_k are slack
        else:
            N = tl.load(cu_k + seq + 1) - k_start

        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed row: query row r // G, head r % G
        row, head = r // group, kv_head * group + r % group
        row_ok = r < M * group
        diag = row + (N - M)  # bottom-right alignment: last key this row may see
        d = tl.arange(0, D)
        q_off = (q_start + row).to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :]
        q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot
            q = q.to(tl.float32)

        # key range of this block: [lo, hi), trimmed by the causal diagonal and the window
        lo, hi = 0, N
        if BOUNDED:
            hi = tl.minimum(N, (pid_m * BLOCK_M + BLOCK_M - 1) // group + (N - M) + 1)
        if WINDOWED:
            lo = tl.maximum((pid_m * BLOCK_M) // group + (N - M) - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        # this split's share, whole blocks (flash-decoding: more programs when there are few rows)
        per_split = (tl.maximum(hi - lo, 0) + n_splits - 1) // n_splits
        per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2)
        l_i = tl.zeros([BLOCK_M], tl.float32)                # running softmax denominator
        acc = tl.zeros([BLOCK_M, D], tl.float32)             # running unnormalised output
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            key_row = (k_start + n).to(tl.int64)[:, None]
            k = tl.load(K + key_row * s_kt + kv_head * s_kh + d[None, :],
                        mask=(n < hi)[:, None], other=0.0)
            v = tl.load(V + key_row * s_vt + kv_head * s_vh + d[None, :],
                        mask=(n < hi)[:, None], other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            # -- scores, in log2 units so that exp2 can be used --
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            ok = (n < hi)[None, :]
            if BOUNDED:
                ok = ok & (n[None, :] <= diag[:, None])
            if WINDOWED:
                ok = ok & (n[None, :] > diag[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            # -- update the running max; a row with nothing seen yet keeps -inf, shift by 0 then --
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_shift[:, None])
            alpha = tl.math.exp2(m_i - m_shift)  # rescales what was accumulated under the old max
            # -- update the normaliser and the output accumulator --
            l_i = l_i * alpha + tl.sum(p, 1)
            p_v = p.to(V.dtype.element_ty)  # P @ V in the input dtype, as FlashAttention does
            if UPCAST:
                p_v = p_v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
            m_i = m_new

        # -- normalise; rows that saw no key have l_i == 0 and acc == 0 -> zeros, not NaN --
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_off = (split.to(tl.int64) * s_os + (q_start + row).to(tl.int64)[:, None] * s_ot
                 + head[:, None] * s_oh + d[None, :])
        if SPLIT:  # partial result + its log2-sum-exp, merged by _merge_splits
            tl.store(O + o_off, out, mask=row_ok[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            l_off = split.to(tl.int64) * s_ls + (q_start + row).to(tl.int64) * s_lt + head
            tl.store(LSE + l_off, lse, mask=row_ok)
        else:
            tl.store(O + o_off, out.to(O.dtype.element_ty), mask=row_ok[:, None])


def _merge_splits(o, lse):
    """o (S, T, H, d) fp32 partial outputs, lse (S, T, H) log2-sum-exp of each -> (T, H, d)."""
    top = lse.amax(0)
    # all splits empty -> weights 0
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(lse - top)  # (S, T, H)
    return (w[..., None] * o).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]


@functools.lru_cache(maxsize=None)
def _n_sms(device_index):  # asked at the first call, never at import time
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_config(rows, d, itemsize, interpret=False):
    """-> BLOCK_M, BLOCK_N, num_warps, num_stages. Fixed configs, no autotuning:
    decode (<= 16 packed query rows): BLOCK_M = 16, the smallest tl.dot tile, and long key blocks
    to stream the cache; prefill: 128 x 64 with 8 warps, the Triton tutorial's choice for d <= 128;
    d = 256 halves the key block so the pipelined K/V tiles fit shared memory (METHOD.md §8;
    tests/test_kernels.py compiles every config for sm_90 and checks that it fits). fp32 inputs (a
    correctness path, not a fast one) get small tiles, else they do not fit."""
    if interpret:  # the interpreter's cost is per program step, not per FLOP: use big blocks
        return (16 if rows <= 16 else 128), 256, 4, 1
    if itemsize == 4:
        return (16, 32, 4, 2) if rows <= 16 else (64, 32 if d <= 128 else 16, 4, 2)
    bm, bn, warps, stages = (16, 128, 4, 3) if rows <= 16 else (128, 64, 8, 3)
    return bm, (bn if d <= 128 else bn // 2), warps, stages


def triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale=None, causal=True, window=None, seqused_k=None,
                            block_m=None, block_n=None, num_splits=None):
    """The Triton backend of varlen_attention (same contract). block_m / block_n / num_splits
    override the fixed configs below (tests use them to cover the split path on CPU)."""
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    total_q, Hq, d = q.shape
    Hk = k.shape[1]
    assert Hq % Hk == 0, "Hq must be a multiple of Hk (GQA)"
    assert d in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]"
    group, n_seqs = Hq // Hk, cu_seqlens_q.numel() - 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    rows = max_seqlen_q * group  # packed (query row, head) pairs per sequence and KV head
    bm, bn, warps, stages = _block_config(rows, d, q.element_size(), interpret)
    bm, bn = block_m or bm, block_n or bn
    grid_m = triton.cdiv(rows, bm)
    if num_splits is None:  # flash-decoding: split the keys when there are too few programs
        num_splits = 1
        if q.is_cuda and not interpret:
            programs, sms = grid_m * Hk * n_seqs, _n_sms(q.device.index or 0)
            if programs < sms:  # >= 512 keys per split keeps the merge cheap
                num_splits = max(1, min(triton.cdiv(2 * sms, programs),
                                        triton.cdiv(max_seqlen_k, 512), 64))
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if num_splits > 1:
        o = torch.zeros(num_splits, total_q, Hq, d, dtype=torch.float32, device=q.device)
        lse = torch.full((num_splits, total_q, Hq), float("-inf"), device=q.device)
    else:
        o, lse = torch.zeros(1, total_q, Hq, d, dtype=q.dtype, device=q.device), None
    used = seqused_k if seqused_k is not None else cu_seqlens_k  # dummy pointer when unused
    _varlen_attn_kernel[(grid_m, Hk, n_seqs * num_splits)](
        q, k, v, o, lse if lse is not None else o, cu_seqlens_q, cu_seqlens_k, used,
        # 1.44.. = log2(e): exp -> exp2
        scale * 1.4426950408889634, window or 0, group, num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        BOUNDED=causal or window is not None, WINDOWED=window is not None,
        HAS_USED=seqused_k is not None, SPLIT=num_splits > 1,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        # fp32 inputs: 3xTF32 keeps ~fp32 accuracy on tensor cores (plain TF32 errs ~1e-3; "ieee"
        # lowers to FMAs that spill registers); the default for 16-bit inputs
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        D=d, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    if num_splits > 1:
        return _merge_splits(o, lse).to(q.dtype)
    return o[0]


# -----------------------------------------------------------------------------------------------
# RaggedKV: one layer's kept keys/values, one region per KV head (METHOD.md §8).

def _head_pos(pos, H):
    """Positions (t,) shared by H heads, or (H, t) per head
    -> the (H*t,) row order of an append."""
    pos = pos.to(torch.long)
    return pos.repeat(H) if pos.dim() == 1 else pos.reshape(-1)


def _ranges(starts, lens):
    """Concatenation of arange(s, s + n) for each (s, n):
    the flat row indices of every head's rows."""
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    offsets = torch.cumsum(lens, 0) - lens  # where each head's run begins in the output
    return (torch.repeat_interleave(starts - offsets, lens, output_size=total)
            + torch.arange(total, device=starts.device))


class RaggedKV:
    """Keys and values of one layer, head h's rows at k[starts[h] : starts[h] + lens[h]].

    Each region has capacity caps[h] >= lens[h]; the rows between are slack, so appending a decode
    token writes H rows and copies nothing. reserve(n) makes room for what an answer will append;
    a single-token append that finds no room re-lays every region out with headroom (half the
    length, at most MAX_SLACK rows per head); a chunk is allocated exactly. keep_rows / drop_last
    compact to exactly the kept rows: eviction frees memory, and nbytes reports what is held. Row
    companions pos (absolute position, int64) and score (importance, float32, +inf = never evict)
    live in flat tensors aligned with k's rows and move with them.
    """

    def __init__(self, n_heads, head_dim, dtype, device):
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self.lens = torch.zeros(n_heads, dtype=torch.long)    # rows used per head (CPU)
        self.caps = torch.zeros(n_heads, dtype=torch.long)    # rows allocated per head (CPU)
        self.starts = torch.zeros(n_heads, dtype=torch.long)  # first row of each region (CPU)
        # K/V bytes of the old layout alive beside the new one during the last re-layout
        self.transient = 0
        self._alloc(0)

    def _alloc(self, rows):
        self.k = torch.empty(rows, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.empty(rows, self.head_dim, dtype=self.dtype, device=self.device)
        self.pos = torch.empty(rows, dtype=torch.long, device=self.device)
        self.score = torch.empty(rows, dtype=torch.float32, device=self.device)

    @property
    def n_rows(self):
        return int(self.lens.sum())

    @property
    def nbytes(self):
        """K/V bytes held: every region's rows, slack included."""
        return self.k.nbytes + self.v.nbytes

    @property
    def kept_nbytes(self):
        """K/V bytes of the rows kept (no slack): what nbytes would be with none."""
        return self.n_rows * 2 * self.head_dim * self.k.element_size()

    def head_pos(self, h):
        s = int(self.starts[h])
        return self.pos[s:s + int(self.lens[h])]

    def head_score(self, h):
        s = int(self.starts[h])
        return self.score[s:s + int(self.lens[h])]

    def head_keys(self, h):
        s = int(self.starts[h])
        return self.k[s:s + int(self.lens[h])]

    def uniform(self):
        """(n, cap) if every head holds n rows in a cap-row region (a full cache), else None."""
        n, cap = (int(self.lens[0]), int(self.caps[0])) if self.n_heads else (0, 0)
        alike = self.n_heads and bool((self.lens == n).all() and (self.caps == cap).all())
        return (n, cap) if alike else None

    def heads(self, x, cap):
        """x (rows, ...) as (H, cap, ...): every region of alike regions of cap rows (a view)."""
        return x[:self.n_heads * cap].view(self.n_heads, cap, *x.shape[1:])

    def rows(self):
        """Flat row indices of every head's used rows, head after head (no slack rows)."""
        return _ranges(self.starts, self.lens).to(self.device)

    def _relayout(self, src_rows, new_lens, new_caps):
        """Move the rows src_rows (flat indices, head-major; or an int s: every head's used rows
        from its s-th on, in order) into fresh regions of sizes new_caps."""
        new_starts = torch.cumsum(new_caps, 0) - new_caps
        old = (self.k, self.v, self.pos, self.score)
        self.transient = max(self.transient, old[0].nbytes + old[1].nbytes)  # until the copy ends
        alike, s = self.uniform(), src_rows
        strided = isinstance(s, int) and alike and bool((new_caps == new_caps[0]).all())
        if not strided:  # row indices: those given, or every head's from the s-th on
            src_rows = (_ranges(self.starts + s, self.lens - s) if isinstance(s, int) else s).to(
                self.device)
        if strided:  # alike into alike (a prefill's next chunk, a window's wrap): no indices
            (n, cap), new_cap = alike, int(new_caps[0])
            self._alloc(self.n_heads * new_cap)
            for new, o in zip((self.k, self.v, self.pos, self.score), old):
                self.heads(new, new_cap)[:, :n - s] = self.heads(o, cap)[:, s:n]
        elif torch.equal(new_lens, new_caps):  # no slack (eviction): the gathered rows are all
            self.k, self.v, self.pos, self.score = (o.index_select(0, src_rows) for o in old)
        else:
            dst_rows = _ranges(new_starts, new_lens).to(self.device)
            self._alloc(int(new_caps.sum()))  # the old tensors are freed with `old`
            for new, o in zip((self.k, self.v, self.pos, self.score), old):
                new.index_copy_(0, dst_rows, o.index_select(0, src_rows))
        self.lens, self.caps, self.starts = new_lens.clone(), new_caps.clone(), new_starts

    def reserve(self, n):
        """Room for n more rows in every head (n: an int, or (H,) per head), so that appends write
        into slack and copy nothing; a region already that large is left alone."""
        need = self.lens + n
        if bool((need > self.caps).any()):
            self._relayout(0, self.lens, torch.maximum(self.caps, need))

    def append(self, k, v, pos, score=None):
        """k, v (t, H, d); pos (t,) absolute positions, the same for every head, or (H, t) per head
        (a batch's sequences are at different positions); score (H, t) float32 or None (+inf)."""
        t, H, d = k.shape
        assert H == self.n_heads and d == self.head_dim, \
            f"expected (t, {self.n_heads}, {self.head_dim})"
        need = self.lens + t
        if bool((need > self.caps).any()):
            # token-by-token appends (decoding with no reserve()) grow by 1.5x, between 16 and
            # MAX_SLACK rows: a long cache is copied once every 1,024 tokens (a few ms even at
            # 128K), not left holding 50% unused rows (a prefill whose last chunk is one token
            # would otherwise end 1.5x its size). A prefill chunk or a question is allocated
            # exactly: slack there would be counted as KV held, and an answer reserves its rows.
            if t < APPEND_EXACT:
                slack = torch.clamp(need // 2, min=16, max=MAX_SLACK)
            else:
                slack = torch.zeros_like(need)
            caps = torch.maximum(self.caps, need + slack)
            self._relayout(0, self.lens, caps)
        # new rows into each head's slack: a chunk into alike regions by a strided copy per tensor, a token by index
        score = (float("inf") if score is None
                 else score.to(self.device, torch.float32).reshape(H, t))
        new = (k.transpose(0, 1), v.transpose(0, 1), _head_pos(pos, H).view(H, t), score)
        rows, alike = (self.starts + self.lens)[:, None] + torch.arange(t), t > 1 and self.uniform()
        for x, y in zip((self.k, self.v, self.pos, self.score), new):
            if alike:
                self.heads(x, alike[1])[:, alike[0]:alike[0] + t] = y
            else:
                x[rows.to(self.device)] = y if isinstance(y, float) else y.to(x.device, x.dtype)
        self.lens = need

    def keys_values(self):
        """-> k (cap_total, 1, d), v, cu_seqlens_k int32 (H+1,), seqused_k int32 (H,), max_len."""
        cu = torch.cat([self.starts, self.caps.sum().view(1)]).to(self.device, torch.int32)
        used = self.lens.to(self.device, torch.int32)
        max_len = int(self.lens.max()) if self.n_heads else 0
        return self.k.unsqueeze(1), self.v.unsqueeze(1), cu, used, max_len

    def attend(self, q, scale, window=None, backend=None):
        """q (t, H*G, d): the newest t tokens' queries (their keys already appended) ->
        (t, H*G, d)."""
        t, n_q_heads, d = q.shape
        H = self.n_heads
        G = n_q_heads // H
        if resolve_backend(q, backend) == "torch":
            if t == 1:
                return self._attend_one(q, scale, window)
            alike = self.uniform()
            if alike is not None:  # every head alike: one strided (H, n, d) view of the keys
                k, v = (self.heads(x, alike[1])[:, :alike[0]] for x in (self.k, self.v))
                return dense_attention(q, k, v, scale, window)
        # METHOD.md §8: each KV head is one sequence of t query rows,
        # whose G query heads are the heads of an MQA call
        qv = q.view(t, H, G, d).transpose(0, 1).reshape(H * t, G, d)      # (H*t, G, d)
        k, v, cu_k, used, max_len = self.keys_values()
        cu_q = torch.arange(H + 1, dtype=torch.int32, device=q.device) * t
        out = varlen_attention(qv, k, v, cu_q, cu_k, t, max_len, scale, causal=True,
                               window=window, seqused_k=used, backend=backend,
                               check=False)  # (H*t, G, d)
        return out.view(H, t, G, d).transpose(0, 1).reshape(t, H * G, d)  # head index h*G + g

    def _attend_one(self, q, scale, window):
        """One new token on the torch path (decoding on a CPU). A single query row sees all of its
        head's rows, or the last W with a window, so each KV head is softmax(q k^T) v over a slice
        of its rows: the reference's result for one row (tests/test_kernels.py holds them equal)
        without building varlen offsets and masks. The regions lie in head order, each followed by
        its slack, so one split gives every head's rows as views: three ops per head in all (a
        batch's B x H heads included)."""
        H, d = self.n_heads, self.head_dim
        qh = q.view(H, -1, d).float() * scale                      # (H, G, d): query head h*G + g
        alike = self.uniform()
        if alike is not None:  # (a full cache, a full ring): the heads one batched matmul
            n, cap = alike
            first = 0 if window is None else max(0, n - window)
            ks, vs = (self.heads(x, cap)[:, first:n].float() for x in (self.k, self.v))
            out = torch.softmax(qh @ ks.transpose(1, 2), dim=-1) @ vs  # (H, G, d)
            return out.view(1, H * qh.shape[1], d).to(q.dtype)
        sizes = torch.stack([self.lens, self.caps - self.lens], 1).reshape(-1).tolist()
        ks, vs = self.k.split(sizes)[::2], self.v.split(sizes)[::2]  # head h's used rows
        if window is not None:
            ks, vs = [x[-window:] for x in ks], [x[-window:] for x in vs]
        if self.dtype != torch.float32:
            ks, vs = [x.float() for x in ks], [x.float() for x in vs]
        # a head with no rows: softmax of (G, 0) scores @ (0, d) values = zeros,
        # as the contract says
        out = torch.stack([torch.softmax(qh[h] @ ks[h].T, dim=-1) @ vs[h]
                           for h in range(H)])                      # (H, G, d)
        return out.view(1, H * qh.shape[1], d).to(q.dtype)

    def keep_rows(self, mask, room=0):
        """mask (n_rows,) bool over the used rows in rows()' order (head after head) -> keep those
        rows, freeing the rest. room 0: every region shrinks to its rows (one re-layout). room > 0
        (decoding): a head that lost rows gets `room` free rows for the next buffer, the others keep
        their regions; if these fit the storage held with at most 1/8 to spare, the rows move down
        inside it and nothing is allocated (steady state: the budget plus one buffer per head)."""
        mask = mask.to(self.device, torch.bool)
        assert mask.numel() == self.n_rows, "one mask entry per used row of every head"
        head = torch.repeat_interleave(torch.arange(self.n_heads), self.lens)  # each row's head
        new_lens = torch.zeros(self.n_heads, dtype=torch.long)
        new_lens.index_add_(0, head, mask.cpu().long())  # rows kept per head
        src = self.rows()[mask]
        if room == 0:
            return self._relayout(src, new_lens, new_lens)
        caps = torch.where(new_lens < self.lens, new_lens + room,
                           torch.maximum(self.caps, new_lens + room))
        need, held = int(caps.sum()), self.k.shape[0]
        if not need <= held <= need + need // 8:
            return self._relayout(src, new_lens, caps)
        caps[-1] += held - need  # the spare rows join the last region: the regions tile k
        starts = torch.cumsum(caps, 0) - caps
        dst = _ranges(starts, new_lens).to(self.device)
        moved = src != dst  # x[src] is gathered before x[dst] is written: overlaps are safe
        src, dst = src[moved], dst[moved]
        for x in (self.k, self.v, self.pos, self.score):
            x.index_copy_(0, dst, x.index_select(0, src))
        self.transient = max(self.transient, 2 * len(src) * self.head_dim * self.k.element_size())
        self.lens, self.caps, self.starts = new_lens, caps, starts

    def drop_last(self, n):
        """Drop the last n rows of every head (a question's tokens, after its answer)."""
        self.keep_rows(torch.cat([torch.arange(int(m)) < int(m) - n for m in self.lens]))

    def set_tail_scores(self, score, h0=0):
        """score (H', t): overwrite the scores of the last t rows of heads h0 .. h0 + H' - 1 (all
        heads by default; a batch member's own heads: serving.batch.HeadSlice)."""
        H, t = score.shape
        ends = (self.starts + self.lens)[h0:h0 + H]
        rows = (ends - t)[:, None] + torch.arange(t)  # (H', t)
        rows = rows.reshape(-1).to(self.device)
        self.score[rows] = score.to(self.device, torch.float32).reshape(-1)
