"""
Scorers: the one interface the evicting cache calls to ask "how important is each new KV pair?"
(`Scorer.score`), with Fast KVzip's (the gate's output, gate.py) and the baselines' (StreamingLLM, SnapKV,
random). KVzip's teacher, the other scorer, works on a whole context at once: teacher.py.
"""
import math

import torch
import torch.nn.functional as F

from gate import GateError


class Scorer:
    """score(l, hidden, q, k, pos) -> (H, T) float32, higher = more important, for the T new tokens of
    compressed layer l. hidden (T, D) is the attention input; q (T, Hq, d) and k (T, H, d) are post-RoPE;
    pos (T,) absolute positions. During decoding the cache scores its buffered hidden states without q/k
    (q = k = None); scorers that need them say so.

    `level` names the eviction structure the scorer is meant for, in cache.EvictingCache's terms:
    "global" = one threshold over all layers × heads (the authors' "pair"), "head" = per-head top-k
    ("pair-head", uniform budget per head)."""
    level = "global"

    def __init__(self, n_kv_heads=None):
        self.n_kv_heads = n_kv_heads  # needed only by scorers that ignore q/k when q/k are None

    def _heads(self, k):
        if k is not None:
            return k.shape[1]
        assert self.n_kv_heads is not None, f"{type(self).__name__}(n_kv_heads=...) is needed when k is None"
        return self.n_kv_heads

    def score(self, l, hidden, q, k, pos):
        raise NotImplementedError


class GateScorer(Scorer):
    """Fast KVzip: the gate's output. Meant for "global" (one threshold over all layers × heads, §6):
    gate scores are comparable across layers and heads because they are trained to the same targets."""
    level = "global"

    def __init__(self, gates):
        super().__init__(gates.n_kv_heads)
        self.gates = gates

    @torch.no_grad()
    def score(self, l, hidden, q, k, pos):
        return self.gates.score_layer(l, hidden)  # (H, T) fp32


class StreamingScorer(Scorer):
    """StreamingLLM: score = absolute position, so the most recent tokens survive; the first tokens
    (attention sinks, the system prompt) are protected by the cache itself. Identical across layers and
    heads, so every level gives the same result; "head" matches the baseline's per-head budget (§10).
    fp32 holds positions exactly up to 2^24 tokens."""
    level = "head"

    def score(self, l, hidden, q, k, pos):
        return pos.to(torch.float32).unsqueeze(0).expand(self._heads(k), -1).contiguous()


class RandomScorer(Scorer):
    """Uniform random scores from a seeded generator (a floor for every other scorer). Any level."""
    level = "head"

    def __init__(self, seed=0, n_kv_heads=None):
        super().__init__(n_kv_heads)
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, l, hidden, q, k, pos):
        s = torch.rand(self._heads(k), pos.shape[0], generator=self.generator)
        return s.to(pos.device)


class SnapKVScorer(Scorer):
    """SnapKV as the authors run it in chunked prefill (METHOD.md §10,
    Janghyun1230/FastKVzip:prefill/attention/baseline.py:SnapKV), query-agnostic: the chunk's own last
    queries (the observation window) vote for the chunk's keys.

    - window = the last 32 queries of the chunk (16 while the sequence, current chunk included, is
      shorter than 1000 tokens: the authors test the key length of their retain cache, = pos[-1] + 1);
    - keys = the first 4 keys of the sequence (chunks after the first only) ⊕ the chunk's keys. The cache
      hands a scorer only the new keys, so the scorer remembers each layer's first 4 keys when it sees
      the chunk that starts at position 0 (post-RoPE keys never change, so this is exact);
    - logits q·k·scale, MAX over the G query heads of each KV head on the logits, fp32 softmax over the
      keys, mean over the window queries, drop the 4 sink columns, max_pool1d(kernel 7, stride 1, pad 3);
    - as in the authors' code there is no causal mask inside the window (window queries see the whole
      chunk); the window tokens themselves get the head's maximum + 1 so they are always kept.
    Meant for "head" (per-head top-k with k = int(n·r'), the authors' level for SnapKV). Prefill only: it
    needs the chunk's queries, so it refuses the query-less decoding call.
    scale: the model's attention scale (default 1/√d; Gemma3 uses query_pre_attn_scalar^-1/2)."""
    level = "head"

    def __init__(self, scale=None, window=32, short_window=16, short_len=1000, n_sink=4, kernel=7):
        super().__init__()
        self.scale, self.window, self.short_window, self.short_len = scale, window, short_window, short_len
        self.n_sink, self.kernel = n_sink, kernel
        self.sink_keys = {}  # compressed layer -> first n_sink keys of the sequence (n_sink, H, d)

    @torch.no_grad()
    def score(self, l, hidden, q, k, pos):
        if q is None or k is None:
            raise GateError("SnapKVScorer scores prefill chunks from their queries; it has no decoding form here")
        T, Hq, d = q.shape
        H = k.shape[1]
        G = Hq // H
        if int(pos[0]) == 0:  # a new sequence: remember its first keys, no sink keys for this chunk
            self.sink_keys[l] = k[:self.n_sink].clone()
            sinks = k[:0]
        else:
            sinks = self.sink_keys.get(l, k[:0])
        keys = torch.cat([sinks, k]).float()                              # (n_s + T, H, d)
        w = self.window if int(pos[-1]) + 1 >= self.short_len else self.short_window
        w = min(w, T)
        qw = q[-w:].float().view(w, H, G, d)                              # query head = h·G + g
        scale = self.scale if self.scale is not None else 1 / math.sqrt(d)
        logits = torch.einsum("whgd,khd->hgwk", qw, keys) * scale         # (H, G, w, n_s + T)
        logits = logits.amax(dim=1)                                       # max over the group, on logits
        attn = torch.softmax(logits, dim=-1, dtype=torch.float32).mean(dim=1)  # (H, n_s + T)
        attn = attn[:, sinks.shape[0]:]                                   # (H, T): drop the sink columns
        # smooth: a token next to an attended token is kept too (clusters of information)
        score = F.max_pool1d(attn.unsqueeze(0), self.kernel, stride=1, padding=self.kernel // 2)[0]
        score[:, T - w:] = score.amax(dim=-1, keepdim=True) + 1          # the observation window stays
        return score
