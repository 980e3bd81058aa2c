"""Attention over a ragged, per-KV-head key/value cache (METHOD.md §8).

After gated eviction every KV head of a layer keeps a different number of rows, so a layer's cache is
not a (H, T, d) tensor any more. We store it the way FastKVzip does: each KV head is its own varlen
"sequence" in one flat (rows, d) key tensor and one value tensor, and attention is one
FlashAttention-varlen call in which the G query heads of a KV head are the heads of an MQA call.

This file holds, top to bottom:
  attention_reference  the plain-PyTorch spec (and the CPU path): a loop over sequences with
                       explicit masks, fp32 softmax.
  varlen_attention     the single entry point; picks the backend.
  RaggedKV             one layer's storage: per-head regions with slack, append / select / attend.

The varlen contract (flash_attn_varlen_func convention, plus FlashAttention-3's seqused_k):
  q (total_q, Hq, d), k and v (total_k, Hk, d), Hq % Hk == 0; query head j reads KV head
  j // (Hq // Hk) (GQA). cu_seqlens_q / cu_seqlens_k are int32 (B+1,) prefix offsets: sequence b owns
  query rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] and the key region cu_seqlens_k[b] .. cu_seqlens_k[b+1].
  seqused_k (int32 (B,), optional): only the first seqused_k[b] rows of that region are keys; the rest
  is slack and never read. With M query rows and N used keys, query row i ends at the "diagonal"
  key i + N - M (bottom-right alignment: the queries are the newest M tokens of the sequence).
  causal=True: row i sees keys j <= i + N - M.
  window=W: row i sees only keys i + N - M - W < j <= i + N - M, the last W keys up to and
  including its diagonal (Gemma3 sliding layers). A window always implies the diagonal bound.
  Softmax in fp32; output (total_q, Hq, d) in q's dtype; a row that sees no key (empty sequence,
  or N < M under causal) is zeros, never NaN.

Swapping in for flash-attn: varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True,
window=W) equals flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
causal=True, window_size=(W - 1, 0)); window=None is window_size=(-1, -1).
"""
import os

import torch

# -----------------------------------------------------------------------------------------------
# The reference: the readable spec of the varlen contract above.

def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale=None, causal=True, window=None, seqused_k=None):
    """Plain-PyTorch varlen attention; see the module docstring for the contract.
    max_seqlen_q / max_seqlen_k are accepted for signature parity and not needed here."""
    total_q, n_q_heads, d = q.shape
    n_kv_heads = k.shape[1]
    assert n_q_heads % n_kv_heads == 0, "Hq must be a multiple of Hk (GQA)"
    group = n_q_heads // n_kv_heads
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    out = torch.zeros(total_q, n_q_heads, d, dtype=torch.float32, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = cu_k[b + 1] if used is None else k0 + used[b]  # rows past seqused_k are slack
        M, N = q1 - q0, k1 - k0
        if M == 0 or N == 0:
            continue  # no keys -> the rows stay zero
        qb = q[q0:q1].float().transpose(0, 1)                                 # (Hq, M, d)
        kb = k[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)     # (Hq, N, d)
        vb = v[k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)     # (Hq, N, d)
        s = (qb @ kb.transpose(1, 2)) * scale                                 # (Hq, M, N)
        i = torch.arange(M, device=q.device)[:, None]
        j = torch.arange(N, device=q.device)[None, :]
        diag = i + (N - M)  # bottom-right alignment: the last query row sees the last key
        allowed = torch.ones(M, N, dtype=torch.bool, device=q.device)
        if causal or window is not None:
            allowed &= j <= diag
        if window is not None:
            allowed &= j > diag - window  # W keys, the diagonal one included
        s = s.masked_fill(~allowed, float("-inf"))
        # softmax written out so that a row with no allowed key gives 0 instead of NaN
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        ob = (p @ vb) / torch.where(den == 0, torch.ones_like(den), den)      # (Hq, M, d)
        out[q0:q1] = ob.transpose(0, 1)
    return out.to(q.dtype)


# -----------------------------------------------------------------------------------------------
# The entry point.

def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, causal=True, window=None, seqused_k=None, backend=None):
    """Varlen attention (contract in the module docstring). backend: "triton" | "torch"; None ->
    env FASTKVZIP_ATTN_BACKEND, else "triton" for CUDA tensors and "torch" otherwise."""
    backend = backend or os.environ.get("FASTKVZIP_ATTN_BACKEND") or ("triton" if q.is_cuda else "torch")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window, seqused_k)
    if backend == "torch":
        return attention_reference(*args)
    if backend == "triton":
        return triton_varlen_attention(*args)
    raise ValueError(f"unknown attention backend {backend!r} (expected 'triton' or 'torch')")


def triton_varlen_attention(*args, **kwargs):
    raise NotImplementedError("the Triton kernel is not written yet; use backend='torch'")


# -----------------------------------------------------------------------------------------------
# RaggedKV: one layer's kept keys/values, one region per KV head (METHOD.md §8).

def _ranges(starts, lens):
    """Concatenation of arange(s, s + l) for each (s, l): the flat row indices of every head's rows."""
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    offsets = torch.cumsum(lens, 0) - lens  # where each head's run begins in the output
    return torch.repeat_interleave(starts - offsets, lens, output_size=total) + torch.arange(
        total, device=starts.device)


class RaggedKV:
    """Keys and values of one layer, head h's rows at k[starts[h] : starts[h] + lens[h]].

    Each region has capacity caps[h] >= lens[h]; the rows between are slack, so appending a decode
    token writes H rows and copies nothing. When some head runs out of room, every region is
    re-laid out with geometric headroom (amortised O(t·H) per append). select / keep_last / truncate
    compact to exactly the kept rows: eviction frees memory, and nbytes reports what is held.
    Row companions pos (absolute position, int64) and score (importance, float32, +inf = never
    evict) live in flat tensors aligned with k's rows and move with them.
    """

    def __init__(self, n_heads, head_dim, dtype, device):
        self.n_heads, self.head_dim, self.dtype, self.device = n_heads, head_dim, dtype, device
        self.lens = torch.zeros(n_heads, dtype=torch.long)    # rows used per head (CPU)
        self.caps = torch.zeros(n_heads, dtype=torch.long)    # rows allocated per head (CPU)
        self.starts = torch.zeros(n_heads, dtype=torch.long)  # first row of each region (CPU)
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
        return self.k.nbytes + self.v.nbytes

    def head_pos(self, h):
        s = int(self.starts[h])
        return self.pos[s:s + int(self.lens[h])]

    def head_score(self, h):
        s = int(self.starts[h])
        return self.score[s:s + int(self.lens[h])]

    def _relayout(self, src_rows, new_lens, new_caps):
        """Move the rows src_rows (flat indices, head-major) into fresh regions of sizes new_caps."""
        new_starts = torch.cumsum(new_caps, 0) - new_caps
        dst_rows = _ranges(new_starts, new_lens).to(self.device)
        src_rows = src_rows.to(self.device)
        old = (self.k, self.v, self.pos, self.score)
        self._alloc(int(new_caps.sum()))  # the old tensors are freed when `old` goes out of scope
        for new, o in zip((self.k, self.v, self.pos, self.score), old):
            new[dst_rows] = o[src_rows]
        self.lens, self.caps, self.starts = new_lens.clone(), new_caps.clone(), new_starts

    def append(self, k, v, pos, score=None):
        """k, v (t, H, d); pos (t,) absolute positions; score (H, t) float32 or None (+inf)."""
        t, H, d = k.shape
        assert H == self.n_heads and d == self.head_dim, f"expected (t, {self.n_heads}, {self.head_dim})"
        need = self.lens + t
        if bool((need > self.caps).any()):
            # grow by 1.5x (+16 rows): amortised O(1) copies per row, at most ~50% slack in nbytes
            caps = torch.maximum(self.caps, need + torch.clamp(need // 2, min=16))
            self._relayout(_ranges(self.starts, self.lens), self.lens, caps)
        # write only the t new rows of each head, into its slack
        rows = ((self.starts + self.lens)[:, None] + torch.arange(t)).reshape(-1).to(self.device)
        self.k[rows] = k.transpose(0, 1).reshape(H * t, d).to(self.dtype)
        self.v[rows] = v.transpose(0, 1).reshape(H * t, d).to(self.dtype)
        self.pos[rows] = pos.to(self.device, torch.long).repeat(H)
        self.score[rows] = (torch.full((H * t,), float("inf"), device=self.device) if score is None
                            else score.to(self.device, torch.float32).reshape(H * t))
        self.lens = need

    def keys_values(self):
        """-> k (cap_total, 1, d), v, cu_seqlens_k int32 (H+1,), seqused_k int32 (H,), max_len."""
        cu = torch.cat([self.starts, self.caps.sum().view(1)]).to(self.device, torch.int32)
        used = self.lens.to(self.device, torch.int32)
        max_len = int(self.lens.max()) if self.n_heads else 0
        return self.k.unsqueeze(1), self.v.unsqueeze(1), cu, used, max_len

    def attend(self, q, scale, window=None, backend=None):
        """q (t, H*G, d): the newest t tokens' queries (their keys already appended) -> (t, H*G, d)."""
        t, n_q_heads, d = q.shape
        H = self.n_heads
        G = n_q_heads // H
        # METHOD.md §8: each KV head is one sequence of t query rows whose G query heads are MQA heads
        qv = q.view(t, H, G, d).transpose(0, 1).reshape(H * t, G, d)          # (H*t, G, d)
        k, v, cu_k, used, max_len = self.keys_values()
        cu_q = torch.arange(H + 1, dtype=torch.int32, device=q.device) * t
        out = varlen_attention(qv, k, v, cu_q, cu_k, t, max_len, scale, causal=True, window=window,
                               seqused_k=used, backend=backend)                 # (H*t, G, d)
        return out.view(H, t, G, d).transpose(0, 1).reshape(t, H * G, d)      # head index h*G + g

    def select(self, keep):
        """keep: list of H bool tensors (len_h,) -> keep those rows, freeing everything else."""
        mask = torch.cat([kp.to(self.device, torch.bool).reshape(-1) for kp in keep])
        assert mask.numel() == self.n_rows, "one mask entry per used row of every head"
        new_lens = torch.tensor([int(kp.sum()) for kp in keep], dtype=torch.long)
        self._relayout(_ranges(self.starts, self.lens).to(self.device)[mask], new_lens, new_lens)

    def keep_last(self, n):
        """Keep only the last n rows of every head (sliding-window layers)."""
        self.select([torch.arange(int(l)) >= int(l) - n for l in self.lens])

    def truncate(self, n):
        """Drop the last n rows of every head (e.g. remove a question's tokens)."""
        self.select([torch.arange(int(l)) < int(l) - n for l in self.lens])

    def set_tail_scores(self, score):
        """score (H, t): overwrite the scores of the last t rows of each head."""
        H, t = score.shape
        rows = ((self.starts + self.lens - t)[:, None] + torch.arange(t)).reshape(-1).to(self.device)
        self.score[rows] = score.to(self.device, torch.float32).reshape(-1)
