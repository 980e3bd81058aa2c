"""
The KV cache: what is kept, and where.

Two classes, one storage. Every layer keeps its keys and values in a `kernels.RaggedKV`: per KV
head a region of rows (METHOD.md §8), so after eviction each head can hold a different number of
tokens and the attention kernel reads exactly what is kept. Nothing is masked: evicted rows are
gone from memory.

- `KVCache` is the full cache. Gemma3's sliding-window layers keep only their last W tokens, in a
  ring (`WindowKV`, a RaggedKV of at most W rows per head): a decode token overwrites the one that
  left the window, nothing is copied.
- `EvictingCache` adds scores: every compressed layer asks a scorer (the gate, or a baseline:
  gate.py's scorers) how important each new KV pair is, stores the score beside the row, and
  `evict()` drops the least important rows of a segment of the context — one threshold over all
  compressed layers × heads by default (the paper's non-uniform structure, METHOD.md §6), or per
  layer / per head as ablations. During decoding it buffers the attention-input hidden states and
  runs the gate once every 128 tokens (METHOD.md §7).

The model only ever calls `cache.positions(T)` (the new tokens' absolute positions),
`cache.attend(layer, q, k, v, hidden, scale, window)` and `cache.advance(T)`. A batch
(serving/batch.py) answers the same three calls for B sequences decoding together, one token each,
every layer's KV heads of all of them in one RaggedKV. Eviction itself is an explicit call in the
generation loop (generate.py), never a hidden hook. Saving a cache to a file and loading it back is
formats/cache_file.py's.

In the method's modules `layer` is a model layer's index and `li` an index among the compressed
layers (layer = cfg.compressed_layers[li]; the gate's and the teacher's layer axis).
"""
import copy
import math
import numbers
from dataclasses import dataclass

import torch

from kernels import MAX_SLACK, ArgumentError, RaggedKV, _head_pos, _ranges


def new_layers(cfg, n_heads, dtype, device):
    """Empty storage for every layer:
    a ring (WindowKV) in sliding-window layers that are not compressed."""
    d, compressed = cfg.head_dim, set(cfg.compressed_layers)
    return [WindowKV(n_heads, d, cfg.window(layer), dtype, device)
            if cfg.window(layer) is not None and layer not in compressed
            else RaggedKV(n_heads, d, dtype, device)
            for layer in range(cfg.num_hidden_layers)]


class WindowKV(RaggedKV):
    """A sliding-window layer's keys and values: per head a ring of at most W rows, so that a
    decode token costs one row write, not a re-layout of the whole window.

    Between forwards each head holds its last min(n, W) tokens: the W-1 the next token attends to
    and the oldest, whose row that token overwrites. A decode query attends over the ring as it
    lies: attention over a set of keys does not depend on their order, and every key in the ring is
    inside the query's window. A prefill chunk (queries that need the causal order) gets a plain
    RaggedKV layout instead, the window's rows in position order followed by the chunk's, and
    `wrap()` turns it back into a ring of the last W rows (one copy of W rows per chunk). Until the
    ring is full it grows like a RaggedKV (slack), so a short context holds only its own tokens.
    Nothing is evicted from a window layer: keep_rows (and drop_last) raise. pos / score rows are in
    ring order.
    """

    def __init__(self, n_heads, head_dim, window, dtype, device):
        super().__init__(n_heads, head_dim, dtype, device)
        self.window = window
        # True between forwards: rows from 0, the oldest token of head h at row first[h]
        self.ring = False
        # per head: a batch's sequences wrap at different steps
        self.first = torch.zeros(n_heads, dtype=torch.long)

    def append(self, k, v, pos, score=None):
        """k, v (t, H, d); pos (t,) or (H, t). One token into a ring: a row write per head (a ring
        still filling and out of room first regrows, its order kept); a chunk: RaggedKV.append,
        then wrap()."""
        t, H, d = k.shape
        W = self.window
        if self.ring and t == 1:
            full = self.lens == W
            room = full | (self.lens < self.caps)
            if not bool(room.all()):  # slack as RaggedKV's, never past W rows
                need = self.lens + 1
                grown = torch.clamp(need + torch.clamp(need // 2, min=16, max=MAX_SLACK), max=W)
                caps = torch.where(room, self.caps, grown)
                self._relayout(0, self.lens, caps)
            # (H,) the row after each head's newest
            rows = (self.starts + (self.first + self.lens) % W).to(self.device)
            self.k[rows] = k[0].to(self.dtype)
            self.v[rows] = v[0].to(self.dtype)
            self.pos[rows] = _head_pos(pos, H).to(self.device)
            self.score[rows] = (float("inf") if score is None
                                else score.to(self.device, torch.float32).reshape(H))
            # a full ring overwrote its oldest token: the next one is now the oldest;
            # the others grew by one
            self.first = torch.where(full, (self.first + 1) % W, self.first)
            self.lens = self.lens + (~full).long()
            return
        if bool(self.first.any()):
            # the ring went round: the window back in position order, room for the chunk
            i = _ranges(torch.zeros_like(self.lens), self.lens)  # 0 .. lens[h]-1 for every head h
            h = torch.repeat_interleave(torch.arange(H), self.lens)
            self._relayout(self.starts[h] + (self.first[h] + i) % W, self.lens, self.lens + t)
            self.first = torch.zeros_like(self.first)
        self.ring = False
        super().append(k, v, pos, score)

    def reserve(self, n):
        """RaggedKV.reserve, never past W rows: a full ring overwrites its oldest row in place."""
        need = torch.clamp(self.lens + n, max=self.window)
        if bool((need > self.caps).any()):  # a ring not yet full: its rows still from row 0
            self._relayout(0, self.lens, torch.maximum(self.caps, need))

    def wrap(self):
        """After a forward: each head's last min(n, W) rows,
        in order from row 0, in at most W rows."""
        if self.ring:
            return
        keep, caps = torch.clamp(self.lens, max=self.window), torch.clamp(self.caps, max=self.window)
        # past the window: copy once
        if not (torch.equal(keep, self.lens) and torch.equal(caps, self.caps)):
            skip = self.lens - keep  # every head's oldest rows past the window
            alike = self.n_heads > 0 and bool((skip == skip[0]).all())
            self._relayout(int(skip[0]) if alike else _ranges(self.starts + skip, keep), keep,
                           caps)
        self.ring = True

    def keep_rows(self, mask, room=0):
        raise NotImplementedError("a sliding-window layer keeps its last W tokens; nothing is "
                                  "evicted from it")


class HeldBytes:
    """The bytes that the `layers` of a cache, or of a batch, hold."""

    @property
    def nbytes(self):
        """Bytes of keys and values actually allocated, all layers (slack included)."""
        return sum(kv.nbytes for kv in self.layers)

    @property
    def kept_nbytes(self):
        """Bytes of the keys and values kept, all layers (no slack): what nbytes holds them in."""
        return sum(kv.kept_nbytes for kv in self.layers)


class KVCache(HeldBytes):
    """Full KV cache for one sequence (batch 1). A sliding-window layer keeps its last W tokens in
    a ring (WindowKV), unless it is a compressed layer: those (all of Qwen3's, whose released
    checkpoints never slide) hold their context until it is evicted, and the window mask limits
    what they attend to."""

    def __init__(self, cfg, dtype=torch.float32, device="cpu"):
        self.cfg = cfg
        self.dtype, self.device = dtype, torch.device(device)
        self.layers = new_layers(cfg, cfg.num_key_value_heads, dtype, self.device)
        # absolute position of the next token (evicted tokens still count: RoPE positions)
        self.n_seen = 0
        self.peak_nbytes = 0
        # the ids this cache prefilled (a CPU int64 tensor; generate.prefill sets it): what a saved
        # cache records as its prompt (formats/cache_file.save_cache checks the ids it is given)
        self.prefilled_ids = None
        # (n_seen, the logits after the newest token) as generate's steps return them: save_cache
        # refuses other logits for the cache as it is
        self.newest_logits = None

    def reserve(self, n_question, n_answer=0):
        """Room for an answer in every layer: its question's tokens and n_answer decoded ones, so
        that decoding copies nothing and holds no more than it will use."""
        for kv in self.layers:
            kv.reserve(n_question + n_answer)
            self._track_peak(kv)

    def _track_peak(self, kv):
        """After kv changed: the most ever held is what all layers hold now, plus kv's old buffers
        if it was just re-laid out (old and new are both alive while rows are copied)."""
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + kv.transient)
        kv.transient = 0

    def positions(self, T):
        return torch.arange(self.n_seen, self.n_seen + T, device=self.device)

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        """Store the T new tokens' k/v of `layer`, then attend q over everything the layer keeps.
        q (T, Hq, d), k/v (T, H, d) post-RoPE;
        hidden (T, D) is the attention input (unused here)."""
        kv = self.layers[layer]
        kv.append(k, v, self.positions(q.shape[0]))
        self._track_peak(kv)
        out = kv.attend(q, scale, window)  # (T, Hq, d)
        if isinstance(kv, WindowKV):
            # after a chunk: back to a ring of the last W tokens (after one token: nothing to do)
            kv.wrap()
            self._track_peak(kv)
        return out

    def advance(self, T):
        self.n_seen += T

    # -- questions on a shared context: answer, then roll back (METHOD.md §8 slice) --
    def checkpoint(self):
        """State to roll back to after answering a question. Window layers overwrite old rows as
        new tokens arrive, so they are copied (W rows each); other layers only need their
        lengths."""
        sliding = {layer: copy.deepcopy(kv) for layer, kv in enumerate(self.layers)
                   if self._is_sliding(layer)}
        lens = [kv.lens.clone() for kv in self.layers]
        # of: whose checkpoint it is (rollback refuses another cache's)
        return dict(n_seen=self.n_seen, lens=lens, sliding=sliding, of=self)

    def rollback(self, state):
        check_rollback(self, state)
        for layer, kv in enumerate(self.layers):
            if layer in state["sliding"]:
                self.layers[layer] = copy.deepcopy(state["sliding"][layer])
            else:
                kv.drop_last(int((kv.lens - state["lens"][layer])[0]))  # the same for every head
                self._track_peak(kv)
        self.n_seen = state["n_seen"]

    def _is_sliding(self, layer):
        """True for a sliding-window layer that keeps only its window (a WindowKV ring)."""
        return isinstance(self.layers[layer], WindowKV)

def check_answering(call, cache):
    """A cache that can decode, else an ArgumentError naming `call`: prefilled, its answer begun
    (an EvictingCache would score the token as prompt and never evict while decoding)."""
    if cache.n_seen == 0:
        raise ArgumentError(f"{call}: the cache holds no prompt; prefill it first "
                            f"(generate.prefill), then generate.begin_answer")
    if not getattr(cache, "decoding", True):  # an EvictingCache's; a KVCache always decodes
        raise ArgumentError(f"{call}: the answer has not begun; call generate.begin_answer "
                            f"first (it starts decode-time eviction)")


def check_rollback(cache, state):
    """What a rollback needs, else an ArgumentError (not a corrupt cache, with or without -O): a
    checkpoint of this cache, taken after its prefill and not after now; since then every head of
    a layer only gained rows (an answer's), the same number, unless the checkpoint copied them."""
    n_prompt = 0 if cache.prefilled_ids is None else len(cache.prefilled_ids)
    if not isinstance(state, dict) or state.get("of") is not cache:
        raise ArgumentError("rollback: the state is not a checkpoint of this cache; roll a cache "
                            "back only to what its own checkpoint() returned")
    if not max(1, n_prompt) <= state["n_seen"] <= cache.n_seen:
        raise ArgumentError(f"rollback: the checkpoint was taken at position {state['n_seen']}, "
                            f"not between this cache's prompt end ({n_prompt}) and now "
                            f"({cache.n_seen}): take it after the prefill, before the answer")
    for layer, kv in enumerate(cache.layers):
        extra = None if "all" in state or layer in state["sliding"] else \
            kv.lens - state["lens"][layer]
        if extra is not None and not (bool((extra == extra[0]).all()) and int(extra[0]) >= 0):
            raise ArgumentError(f"rollback: layer {layer}'s heads changed unevenly since the "
                                f"checkpoint (rows per head {kv.lens.tolist()}, then "
                                f"{state['lens'][layer].tolist()}): an eviction after it cannot be "
                                f"rolled back; take the checkpoint after evicting")


def check_segment(start, end, n_seen, held, n_heads):
    """EvictingCache.evict's segment, else an ArgumentError (not a reshape error, or a wrong
    eviction): positions [start, end) the cache has seen, every one still held by every head of
    every compressed layer (held: (L,) rows each layer holds in it), i.e. evicted at most once."""
    if not (0 <= start <= end <= n_seen and bool((held == n_heads * (end - start)).all())):
        raise ArgumentError(f"EvictingCache.evict: segment [{start}, {end}) must lie within the "
                            f"{n_seen} positions seen and be held whole by every head (rows held "
                            f"per layer {held.tolist()}, of {n_heads} x {end - start}): evict "
                            f"each segment once")


def is_count(x, low=0):
    """An integer >= low (bool is not one): what the checks of a caller's counts accept."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= low


# -------------------------------------------------------------------------------------------------
# Budget arithmetic (METHOD.md §6)

@dataclass
class PrefillPlan:
    window: int        # trailing context tokens kept in full
    segment_ratio: float  # r': fraction kept of every evicted segment, so that the total is r


@dataclass(frozen=True)
class Budget:
    """What travels together from the flags to every eviction of a request (METHOD.md §6): the
    fraction r of the context's KV pairs kept in the compressed layers, window included; the
    prefill chunk (also where a context counts as short); the trailing context tokens always
    kept."""
    ratio: float = 1.0
    chunk_size: int = 16384
    window: int = 4096

    def __post_init__(self):
        r = self.ratio  # "0.5" is text, not a ratio: refused here, not in a comparison later
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0 < r <= 1:  # and nan
            raise ArgumentError(f"Budget: ratio must be a number in (0, 1], got {r!r}")
        for name, low in (("chunk_size", 1), ("window", 0)):
            value = getattr(self, name)
            if not is_count(value, low):
                raise ArgumentError(f"Budget: {name} must be an integer >= {low}, got {value!r}")

    def plan(self, n_context):
        """The budget rule for a context of n_context tokens (plan_prefill)."""
        return plan_prefill(n_context, self.ratio, self.chunk_size, self.window)


def plan_prefill(n_context, ratio, chunk_size, window):
    """The window and per-segment ratio that keep a fraction `ratio` of the context,
    window included.

    METHOD.md §6: contexts shorter than one chunk keep their last 2% instead of the window (the
    authors compare with 16000 = their chunk size; we compare with --chunk-size); if the budget is
    smaller than the window, only (a shorter) window survives. ratio lies in (0, 1]: Budget checks
    it."""
    if n_context < chunk_size:
        window = int(0.02 * n_context)
    window = min(window, n_context)
    if ratio * n_context < window:
        return PrefillPlan(int(ratio * n_context), 0.0)
    if n_context == window:
        return PrefillPlan(window, 1.0)
    return PrefillPlan(window, (ratio * n_context - window) / (n_context - window))


def top_k_mask(scores, k):
    """Keep exactly the k highest scores; ties go to the earlier entry: deterministic, the set a
    stable descending sort keeps in its first k, found without sorting (the k-th highest value,
    then the ties at it in order; NaN ranks as +inf)."""
    flat = scores.flatten().nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    n = flat.numel()
    if k <= 0 or k >= n:
        return torch.full(scores.shape, k > 0, dtype=torch.bool, device=scores.device)
    cut = flat.kthvalue(n - k + 1).values  # the k-th highest score
    keep = flat > cut
    at_cut = flat == cut
    keep |= at_cut & (at_cut.cumsum(0) <= k - keep.sum())  # the earliest ties fill the rest
    return keep.view(scores.shape)


class DecodeBudgetError(ArgumentError):
    """A decode-time budget too small for the scorer to choose anything."""


def decode_protected(n_protected, window, sinks=4):
    """Rows per head that decode-time eviction always keeps: the system prompt (or the first
    `sinks` positions, the attention sinks, if longer) and the local window."""
    return max(n_protected, sinks) + window


def check_decode_budget(tokens_per_head, protected):
    """Decode-time eviction always keeps `protected` rows per head (system prompt or first 4, and
    the local window) inside the budget: a budget of no more leaves nothing to the scorer, and
    every method would keep the same rows."""
    if tokens_per_head <= protected:  # an integer: check_evicting
        raise DecodeBudgetError(
            f"decode_tokens_per_head {tokens_per_head!r} leaves nothing to the scorer: the system "
            f"prompt or first tokens and the local window ({protected} rows per head) are always "
            f"kept; use at least {protected + 1}")


def keep_within_budget(scores, budget, level):
    """Decode-time eviction's rule: scores[li][h] (rows,) of every compressed layer and head ->
    keep masks of the same shapes: the budget·H·L best rows over all ("global"; "calibrated"
    divides each layer's scores by their finite mean first), budget·H per layer ("layer") or
    budget per head ("head"). A group within its budget keeps everything; +inf rows are kept even
    past it. Ties go to the earlier layer, head and position (top_k_mask)."""
    if level == "calibrated":
        scores = [[s / _finite_mean(per_head) for s in per_head] for per_head in scores]
    if level == "head":
        groups = [[s] for per_head in scores for s in per_head]
    elif level == "layer":
        groups = scores
    else:
        groups = [[s for per_head in scores for s in per_head]]
    keep = []
    for group in groups:
        flat = torch.cat(group)
        k = max(budget * len(group), int(flat.isinf().sum()))
        keep += list(top_k_mask(flat, k).split([s.numel() for s in group]))
    it = iter(keep)
    return [[next(it) for _ in per_head] for per_head in scores]


def _finite_mean(per_head):
    finite = torch.cat(per_head)
    finite = finite[finite.isfinite()]
    return finite.mean().clamp_min(1e-12) if finite.numel() else torch.tensor(1.0)


# -------------------------------------------------------------------------------------------------

# "global" is the paper's (METHOD.md §6 "pair"); "layer" and "head" are uniform ablations;
# "calibrated" is one step beyond the paper: each layer's scores are divided by their mean over the
# segment before the global threshold, so layers whose raw scores live on a smaller scale are not
# starved (METHOD.md §13.9).
LEVELS = ("global", "layer", "head", "calibrated")


def check_evicting(cfg, scorer, n_protected, level, decode_level, decode_tokens_per_head,
                   decode_window=128):
    """What an EvictingCache is built from, else an ArgumentError: levels, a system prompt length,
    a decode budget and window, and a gate shaped for this model (another model's fails later in a
    matmul)."""
    for name, value in (("level", level), ("decode_level", decode_level)):
        if value not in LEVELS:
            raise ArgumentError(f"EvictingCache: {name} {value!r} is not one of {LEVELS}")
    if not is_count(n_protected) or not is_count(decode_window, 1) or not (
            decode_tokens_per_head is None or is_count(decode_tokens_per_head, 1)):
        raise ArgumentError(f"EvictingCache: n_protected must be an integer >= 0, decode_window "
                            f"an integer >= 1 and decode_tokens_per_head None or an integer >= 1, "
                            f"got {n_protected!r}, {decode_window!r} and {decode_tokens_per_head!r}")
    if scorer is None and decode_tokens_per_head is not None:
        raise ArgumentError("EvictingCache: decode-time eviction (decode_tokens_per_head "
                            f"{decode_tokens_per_head}) needs a scorer, got None")
    gates = getattr(scorer, "gates", None)  # GateScorer's; the other scorers fit any model
    if gates is None:
        return
    have = (gates.n_layers, gates.hidden, gates.n_kv_heads, gates.group)
    want = (len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads, cfg.group_size)
    if have != want:
        raise ArgumentError(f"EvictingCache: the gate has (layers, hidden, KV heads, group) "
                            f"{have}, the model {want}: load this model's gate "
                            f"(formats.gate_file.resolve_gate)")


class EvictingCache(KVCache):
    """A KV cache whose compressed layers score every new KV pair and evict on request.

    scorer: gate.Scorer, scorer.score(li, hidden, q, k, pos) -> (H, T) for compressed layer li.
    n_protected: the first n_protected positions (the system prompt) are never evicted (§4.4).
    decode_tokens_per_head: B, the average kept tokens per compressed head during decoding (a
    count, not a fraction; None = keep generated tokens): B·L·H pairs over all compressed layers
    with `level` "global", B·H per layer with "layer", B per head with "head" (METHOD.md §7).
    decode_window: the last tokens decoding always keeps (default: the scorer's, 128 for the gate
    and 8 for the baselines, as the authors run them; generate.make_cache asks the scorer's
    window_at_decode).
    decode_level: the level of decode-time eviction (default: `level`; generate.make_cache gives
    the gate "calibrated" on a hybrid model, gate.GateScorer.level_at_decode).
    """

    def __init__(self, cfg, scorer, dtype=torch.float32, device="cpu", n_protected=0,
                 level="global", decode_tokens_per_head=None, decode_buffer=128,
                 decode_window=None, decode_sinks=4, decode_level=None):
        super().__init__(cfg, dtype, device)
        if decode_window is None:
            decode_window = getattr(scorer, "decode_window", 128)
        decode_level = decode_level or level
        check_evicting(cfg, scorer, n_protected, level, decode_level, decode_tokens_per_head,
                       decode_window)
        self.scorer, self.level, self.n_protected = scorer, level, n_protected
        self.decode_level = decode_level
        self.compressed = list(cfg.compressed_layers)
        # model layer -> gate index
        self.index = {layer: li for li, layer in enumerate(self.compressed)}
        self.decode_tokens_per_head, self.decode_buffer = decode_tokens_per_head, decode_buffer
        self.decode_window, self.decode_sinks = decode_window, decode_sinks
        if decode_tokens_per_head is not None:
            check_decode_budget(decode_tokens_per_head,
                                decode_protected(n_protected, decode_window, decode_sinks))
        # True after prefill: new tokens are buffered, scored every 128 tokens
        self.decoding = False
        self.buffer = {layer: [] for layer in self.compressed}  # hidden states waiting to be scored
        # the last decode_window queries of each compressed layer, kept only for scorers that
        # rescore every held row from them at decode time (SnapKV, R-KV): the gate's path is bare
        self.queries = {}

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        if layer not in self.index:
            return super().attend(layer, q, k, v, hidden, scale, window)
        pos = self.positions(q.shape[0])
        score = None
        if self.decoding:
            self.buffer_decoded(layer, hidden, q)
        elif self.scorer is not None:  # None: KVzip's scores arrive later, all at once
            score = self.scorer.score(self.index[layer], hidden, q, k, pos).float()  # (H, T)
            score[:, pos < self.n_protected] = math.inf  # the system prompt is never evicted
        kv = self.layers[layer]
        kv.append(k, v, pos, score)
        self._track_peak(kv)
        return kv.attend(q, scale, window)

    def buffer_decoded(self, layer, hidden, q):
        """A decoded token's attention input, scored later, 128 tokens at a time (METHOD.md §7);
        its row scores +inf until then (not evictable). q (T, Hq, d): its queries, kept (the last
        decode_window) only for a scorer that rescores from them."""
        if self.decode_tokens_per_head is None or layer not in self.index:
            return
        self.buffer[layer].append(hidden)
        if getattr(self.scorer, "rescores", False):
            old = self.queries.get(layer, q[:0])
            self.queries[layer] = torch.cat([old, q])[-self.decode_window:]

    def reserve(self, n_question, n_answer=0):
        """KVCache.reserve; with decode-time eviction a compressed layer only needs room for what
        arrives before the next eviction (the question and the rest of the 128-token buffer):
        after it, every eviction leaves room for the next buffer (after_step), so the answer's
        length never decides what is allocated."""
        if self.decode_tokens_per_head is None:
            return super().reserve(n_question, n_answer)
        for layer, kv in enumerate(self.layers):
            n = n_answer
            # the eviction comes after the decode step that fills the buffer
            if layer in self.index:
                pending = sum(h.shape[0] for h in self.buffer[layer]) + n_question
                n = min(n_answer, max(1, self.decode_buffer - pending))
            kv.reserve(n_question + n)
            self._track_peak(kv)

    def take_over_prefill(self, full, scores=None, inputs=None, keep_full=False):
        """Continue from `full`, a cache that prefilled system prompt ⊕ context without evicting:
        take over its KV in every layer (deep copies if keep_full, so that full can be taken over
        again), its position and its peak, and score every row of the compressed layers as
        attend() would have. The scores are either given, (L_c, H, n_context) for the context
        (KVzip's teacher, generate.prefill_kvzip), or computed now by this cache's scorer from the
        prefill's attention inputs, inputs[layer] = (hidden, q, k, pos) (the benchmark's replay).
        The system prompt scores +inf: never evicted. Then evict() as after any prefill."""
        assert self.n_seen == 0 and (scores is None) != (inputs is None), \
            "take_over_prefill: an empty cache; scores or inputs"
        self.prefilled_ids = full.prefilled_ids
        self.layers = [copy.deepcopy(kv) for kv in full.layers] if keep_full else full.layers
        self.n_seen, self.peak_nbytes = full.n_seen, full.peak_nbytes
        for li, layer in enumerate(self.compressed):
            kv = self.layers[layer]
            if inputs is None:
                system = torch.full((kv.n_heads, self.n_protected), math.inf,
                                    device=scores[li].device)
                # the cache holds exactly system ⊕ context
                score = torch.cat([system, scores[li]], dim=1)
            else:
                hidden, q, k, pos = inputs[layer]
                score = self.scorer.score(li, hidden, q, k, pos).float()  # (H, T)
                score[:, pos < self.n_protected] = math.inf
            kv.set_tail_scores(score)

    # -- prefill: evict a segment of the context (METHOD.md §6) --
    def evict(self, start, end, ratio, level=None):
        """Keep exactly ⌊ratio·n⌋ of the n KV pairs whose positions lie in [start, end), over all
        compressed layers and heads (level "global"), per layer ("layer") or per head ("head").

        The authors keep int(n·r)−1 pairs (strict `>` against the sorted score at index int(n·r)−1,
        METHOD.md §6); we keep exactly ⌊n·r⌋, ties going to the earlier layer, head and position."""
        if end <= start:
            return
        level = level or self.level
        layers = [self.layers[layer] for layer in self.compressed]
        # per layer, every head's used rows at once, head after head (RaggedKV.rows)
        rows = [kv.rows() for kv in layers]
        pos = [kv.pos.index_select(0, r) for kv, r in zip(layers, rows)]
        in_seg = [(p >= start) & (p < end) for p in pos]
        check_segment(start, end, self.n_seen, torch.stack([m.sum() for m in in_seg]).cpu(),
                      self.cfg.num_key_value_heads)
        # every head still holds every position of the segment, in order (nothing there was
        # evaluated yet): the segment's scores of a layer are an (H, s) block
        scores = torch.stack([kv.score.index_select(0, r)[m].view(kv.n_heads, -1)
                              for kv, r, m in zip(layers, rows, in_seg)])
        # context pairs each layer holds outside this segment (older kept ones, and the window)
        others = torch.stack([((p >= self.n_protected) & ~m).sum() for p, m in zip(pos, in_seg)])
        cut = getattr(self.scorer, "cut_scores", None)  # a Scorer's; KVzip's cache holds none
        if cut is not None:  # a calibrated gate's heads moved at the cut (METHOD.md §13.17)
            scores = cut(scores)
        keep = select_segment(scores, ratio, level, others.to(scores.device))
        for li, m in enumerate(in_seg):
            mask = ~m  # rows outside the segment stay; inside it, what select_segment keeps
            mask[m] = keep[li].reshape(-1)
            self.keep_in_layer(li, mask)

    def keep_in_layer(self, li, mask, room=0):
        """Keep, in compressed layer li, the rows `mask` marks (RaggedKV.keep_rows: one entry per
        used row, head after head), free the rest, and count the peak."""
        kv = self.layers[self.compressed[li]]
        kv.keep_rows(mask, room)
        self._track_peak(kv)

    # -- decoding: score the buffer every 128 tokens, evict back to the budget (METHOD.md §7) --
    def start_decoding(self):
        self.decoding = True

    def after_step(self):
        """Call after every decode forward. Every `decode_buffer` buffered tokens their scores are
        computed in one call per layer (the gate on the buffer; SnapKV and R-KV rescore every held
        row from the last queries); then each budget group of `decode_level` that holds more than
        its budget keeps its best rows, always with the first 4 tokens, the system prompt and the last
        `decode_window` tokens. Every compressed head is left room for the next buffer."""
        if self.decode_tokens_per_head is None:
            return
        first = self.compressed[0]
        if sum(h.shape[0] for h in self.buffer[first]) < self.decode_buffer:
            return
        for li, layer in enumerate(self.compressed):
            hidden, self.buffer[layer] = self.buffer[layer], []
            kv = self.layers[layer]
            if getattr(self.scorer, "rescores", False):
                H, d = kv.n_heads, kv.head_dim
                q = self.queries[layer]
                q = q.view(q.shape[0], H, -1, d)  # (w, H, G, d): query head h·G + g
                for h in range(H):
                    kv.head_score(h)[:] = self.scorer.rescore(li, kv.head_keys(h), q[:, h])
            else:
                hidden = torch.cat(hidden)
                t = hidden.shape[0]
                pos = torch.arange(self.n_seen - t, self.n_seen, device=self.device)
                kv.set_tail_scores(self.scorer.score(li, hidden, None, None, pos).float())
        self._evict_to_budget()

    def _evict_to_budget(self):
        """Keep the best rows of each budget group (all compressed heads, a layer or a head, as
        `decode_level` says) and leave room for the next buffer; a group within its budget is left
        as it is. Protected rows count inside the budget (check_decode_budget keeps them below it)."""
        kvs = [self.layers[layer] for layer in self.compressed]
        first, recent = max(self.n_protected, self.decode_sinks), self.n_seen - self.decode_window
        at_decode = getattr(self.scorer, "at_decode", None)  # METHOD.md §13.18
        scores = []  # [layer][head] (rows,): +inf where the row is protected
        for kv in kvs:
            scores.append([])
            for h in range(kv.n_heads):
                p = kv.head_pos(h)
                s = kv.head_score(h).clone()
                s[(p < first) | (p >= recent)] = math.inf
                scores[-1].append(at_decode(s, kv.head_keys(h)) if at_decode else s)
        keep = keep_within_budget(scores, self.decode_tokens_per_head, self.decode_level)
        for li, kv in enumerate(kvs):
            if all(bool(k.all()) for k in keep[li]):
                kv.reserve(self.decode_buffer)  # nothing evicted: room for the next buffer only
                self._track_peak(kv)
            else:
                self.keep_in_layer(li, torch.cat(keep[li]), room=self.decode_buffer)

    def checkpoint(self):
        state = super().checkpoint()
        # decode-time eviction may touch the context: copy all
        if self.decode_tokens_per_head is not None:
            state["all"] = [copy.deepcopy(kv) for kv in self.layers]
        return state

    def rollback(self, state):
        if "all" in state:
            check_rollback(self, state)
            self.layers = [copy.deepcopy(kv) for kv in state["all"]]
            self.n_seen = state["n_seen"]
        else:
            super().rollback(state)
        self.buffer = {layer: [] for layer in self.compressed}
        self.queries = {}

    # -- what was kept --
    def kept_fraction_per_layer(self, start, end):
        """Fraction of the context positions [start, end) still held, per compressed layer."""
        out = []
        for layer in self.compressed:
            kv = self.layers[layer]
            held = sum(int(held_in(kv, h, start, end).sum()) for h in range(kv.n_heads))
            out.append(held / max(1, (end - start) * kv.n_heads))
        return out

    def retention(self, start, end):
        """(compressed layers, heads) fraction of the context [start, end) kept by each head."""
        layers = [self.layers[layer] for layer in self.compressed]
        return torch.tensor([[float(held_in(kv, h, start, end).sum()) / max(1, end - start)
                              for h in range(kv.n_heads)] for kv in layers])


def held_in(kv, h, start, end):
    """(rows of head h,) bool:
    which of the rows kept by head h of a RaggedKV hold positions in [start, end)."""
    pos = kv.head_pos(h)
    return (pos >= start) & (pos < end)


def select_segment(scores, ratio, level="global", others=None):
    """The eviction rule of one segment: scores (L, H, s) of its KV pairs -> keep mask (L, H, s)
    with exactly ⌊ratio·n⌋ pairs kept over all layers and heads ("global", "calibrated"), per layer
    ("layer") or per head ("head"). others (L,): context pairs each layer holds outside the segment
    (None: none); a layer that would be left with no context pair at all gets its best pair back
    (_refill_empty_layer)."""
    L, H, s = scores.shape  # (compressed layers, heads, segment length)
    if level == "global":
        keep = top_k_mask(scores, int(ratio * L * H * s))
    elif level == "calibrated":
        finite = torch.where(scores.isinf(), torch.zeros_like(scores), scores)
        scale = finite.mean(dim=(1, 2), keepdim=True).clamp_min(1e-12)  # (L, 1, 1)
        keep = top_k_mask(scores / scale, int(ratio * L * H * s))
    elif level == "layer":
        keep = torch.stack([top_k_mask(x, int(ratio * H * s)) for x in scores])
    else:
        keep = torch.stack([torch.stack([top_k_mask(y, int(ratio * s)) for y in x])
                            for x in scores])
    if others is None:
        others = torch.zeros(L, dtype=torch.long, device=scores.device)
    for li in range(L):
        if others[li] == 0 and not keep[li].any():
            keep = _refill_empty_layer(scores, keep, li, others)
    return keep


def _refill_empty_layer(scores, keep, li, others):
    """Never let a whole layer lose every context token without being asked: give layer li its best
    pair of the segment in place of the weakest pair kept in a layer that holds at least two (the
    total stays the same; with fewer kept pairs than layers some layer must stay empty)."""
    held = keep.flatten(1).sum(1) + others  # (L,) context pairs each layer would hold
    donor = keep & (held >= 2)[:, None, None]
    if not donor.any():
        return keep
    keep = keep.clone()
    weakest = torch.where(donor, scores, torch.full_like(scores, math.inf)).flatten().argmin()
    keep.view(-1)[weakest] = False
    keep[li].view(-1)[scores[li].flatten().argmax()] = True
    return keep
