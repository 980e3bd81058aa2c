"""
The KV cache: what is kept, and where.

Two classes, one storage. Every layer keeps its keys and values in a `kernels.RaggedKV`: per KV head a
region of rows (METHOD.md §8), so after eviction each head can hold a different number of tokens and
the attention kernel reads exactly what is kept. Nothing is masked: evicted rows are gone from memory.

- `KVCache` is the full cache. Gemma3's sliding-window layers keep only their last W tokens, in a ring
  (`kernels.WindowKV`): a decode token overwrites the one that left the window, nothing is copied.
- `EvictingCache` adds scores: every compressed layer asks a scorer (the gate, or a baseline: gate.py's scorers)
  how important each new KV pair is, stores the score beside the row, and `evict()` drops the least
  important rows of a segment of the context — one threshold over all compressed layers × heads by
  default (the paper's non-uniform structure, METHOD.md §6), or per layer / per head as ablations.
  During decoding it buffers the attention-input hidden states and runs the gate once every 128 tokens
  (METHOD.md §7).

The model only ever calls `cache.positions(T)` (the new tokens' absolute positions), `cache.attend(layer,
q, k, v, hidden, scale, window)` and `cache.advance(T)`. A `Batch` answers the same three calls for B
sequences decoding together, one token each, every layer's KV heads of all of them in one RaggedKV.
Eviction itself is an explicit call in the generation loop (generate.py), never a hidden hook.
"""
import copy
import hashlib
import json
import math
import os
import struct
import time
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from cli import checksum_ok, tensor_bytes, tensors_sha256, write_safetensors
from kernels import RaggedKV, WindowKV, _ranges


def new_layers(cfg, n_heads, dtype, device):
    """Empty storage for every layer: a ring (WindowKV) in sliding-window layers that are not compressed."""
    d, compressed = cfg.head_dim, set(cfg.compressed_layers)
    return [WindowKV(n_heads, d, cfg.window(i), dtype, device) if cfg.window(i) is not None and i not in compressed
            else RaggedKV(n_heads, d, dtype, device) for i in range(cfg.num_hidden_layers)]


class KVCache:
    """Full KV cache for one sequence (batch 1). A sliding-window layer keeps its last W tokens in a ring
    (WindowKV), unless it is a compressed layer: those (all of Qwen3's, whose released checkpoints never
    slide) hold their context until it is evicted, and the window mask limits what they attend to."""

    def __init__(self, cfg, dtype=torch.float32, device="cpu"):
        self.cfg = cfg
        self.dtype, self.device = dtype, torch.device(device)
        self.layers = new_layers(cfg, cfg.num_key_value_heads, dtype, self.device)
        self.n_seen = 0  # absolute position of the next token (evicted tokens still count: RoPE positions)
        self.peak_nbytes = 0

    @property
    def nbytes(self):
        """Bytes of keys and values actually allocated, all layers (slack included)."""
        return sum(kv.nbytes for kv in self.layers)

    def _track_peak(self, kv):
        """After kv changed: the most ever held is what all layers hold now, plus kv's old buffers if it was
        just re-laid out (old and new are both alive while rows are copied)."""
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + kv.transient)
        kv.transient = 0

    def positions(self, T):
        return torch.arange(self.n_seen, self.n_seen + T, device=self.device)

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        """Store the T new tokens' k/v of `layer`, then attend q over everything the layer keeps.
        q (T, Hq, d), k/v (T, H, d) post-RoPE; hidden (T, D) is the attention input (unused here)."""
        kv = self.layers[layer]
        kv.append(k, v, self.positions(q.shape[0]))
        self._track_peak(kv)
        out = kv.attend(q, scale, window)  # (T, Hq, d)
        if isinstance(kv, WindowKV):
            kv.wrap()  # after a chunk: back to a ring of the last W tokens (after one token: nothing to do)
            self._track_peak(kv)
        return out

    def advance(self, T):
        self.n_seen += T

    # -- questions on a shared context: answer, then roll back (METHOD.md §8 slice) --
    def checkpoint(self):
        """State to roll back to after answering a question. Window layers overwrite old rows as new tokens
        arrive, so they are copied (W rows each); other layers only need their lengths."""
        sliding = {i: copy.deepcopy(kv) for i, kv in enumerate(self.layers) if self._is_sliding(i)}
        return dict(n_seen=self.n_seen, lens=[kv.lens.clone() for kv in self.layers], sliding=sliding)

    def rollback(self, state):
        for i, kv in enumerate(self.layers):
            if i in state["sliding"]:
                self.layers[i] = copy.deepcopy(state["sliding"][i])
            else:
                extra = kv.lens - state["lens"][i]
                assert bool((extra == extra[0]).all()) and int(extra[0]) >= 0, "rollback: heads diverged"
                kv.truncate(int(extra[0]))
                self._track_peak(kv)
        self.n_seen = state["n_seen"]

    def _is_sliding(self, layer):
        """True for a sliding-window layer that keeps only its window (a WindowKV ring)."""
        return isinstance(self.layers[layer], WindowKV)

    # -- compress once, answer later: the cache in a file (load_cache reads it back) --
    def save(self, path, model, ids, last_logits, n_protected=None, method=None, budget=None,
             chunk_size=None, window=None, prefill_seconds=None):
        """Write this cache to `path`: one safetensors file, written atomically (a failed write, a
        full disk, leaves no file: cli.WriteError), that load_cache answers from later, in this
        process or another, with the same greedy tokens. model: the model it was built with (its
        identity is recorded); ids: the prompt it prefilled (system prompt ⊕ context), whose first
        n_protected are the system prompt (default: an EvictingCache's own, else 0); last_logits:
        the logits after the newest token (a question-less answer starts there). The other values
        are recorded as given (what made the cache); the budget plan (plan_prefill) is derived."""
        dtype = model.model.embed_tokens.weight.dtype
        if getattr(model, "identity", None) is None:
            raise ValueError("the model has no identity to record: load it with model.load_model")
        if self.dtype != dtype:
            raise ValueError(f"the cache holds {self.dtype}, the model runs in {dtype}")
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        assert len(ids) <= self.n_seen, "ids: the prompt this cache prefilled"
        own = getattr(self, "n_protected", None)
        assert None in (own, n_protected) or own == n_protected, "the cache knows its system prompt"
        n_protected = (n_protected if own is None else own) or 0
        tensors, state = self._saved()
        plan = None
        if None not in (budget, chunk_size, window) and len(ids) > n_protected:
            plan = vars(plan_prefill(len(ids) - n_protected, budget, chunk_size, window))
        state.update(model=model.identity, dtype=str(self.dtype).removeprefix("torch."),
                     n_protected=n_protected, n_prompt=len(ids), n_context=len(ids) - n_protected,
                     ids_sha256=_ids_sha256(ids), method=method, budget=budget,
                     chunk_size=chunk_size, window=window, plan=plan,
                     prefill_seconds=prefill_seconds)
        tensors.update(ids=ids, last_logits=last_logits.detach().reshape(-1))
        write_safetensors(path, tensors, {"format": CACHE_FORMAT, "fastkvzip": json.dumps(state),
                                          "format_version": str(CACHE_VERSION)})

    def _saved(self):
        """(tensors, JSON state): everything the cache needs to go on exactly. Every layer's kept
        rows as they lie (a ring's too), without slack: k, v, pos, score, and rows per head."""
        tensors, layers = {}, []
        for i, kv in enumerate(self.layers):
            if not isinstance(kv, RaggedKV):
                raise ValueError("a member of a batch is not saved: let it leave the batch first")
            rows = _ranges(kv.starts, kv.lens).to(kv.device)
            for name in ("k", "v", "pos", "score"):
                tensors[f"layer.{i}.{name}"] = getattr(kv, name)[rows]
            tensors[f"layer.{i}.lens"] = kv.lens
            if isinstance(kv, WindowKV):
                tensors[f"layer.{i}.first"] = kv.first
                layers.append(dict(window=kv.window, ring=kv.ring))
            else:
                layers.append(dict(window=None))
        return tensors, dict(cache="KVCache", n_seen=self.n_seen, peak_nbytes=self.peak_nbytes,
                             layers=layers)

    def _restore(self, tensors, state):
        """The inverse of _saved, into this empty cache; the rows stay in the tensors given (on the
        device). Regions without slack: the next append re-lays them out, as after an eviction."""
        cfg = self.cfg
        if len(state["layers"]) != cfg.num_hidden_layers:
            raise CacheFileError(f"it holds {len(state['layers'])} layers, the model has "
                                 f"{cfg.num_hidden_layers}")
        for i, spec in enumerate(state["layers"]):
            kv = self.layers[i]
            sliding = isinstance(kv, WindowKV)
            if spec["window"] != (kv.window if sliding else None):
                raise CacheFileError(f"its layer {i} has window {spec['window']}, the model's not")
            k, v, pos, score = (tensors[f"layer.{i}.{n}"] for n in ("k", "v", "pos", "score"))
            lens = tensors[f"layer.{i}.lens"].cpu()
            n = int(lens.sum())
            if (lens.shape != (kv.n_heads,) or bool((lens < 0).any()) or k.shape != (n, kv.head_dim)
                    or v.shape != k.shape or pos.shape != (n,) or score.shape != (n,)):
                raise CacheFileError(f"layer {i}'s tensors do not fit the model's {kv.n_heads} KV "
                                     f"heads of {kv.head_dim}")
            kv.k, kv.v, kv.pos, kv.score = k, v, pos, score
            kv.lens, kv.caps, kv.starts = lens.clone(), lens.clone(), torch.cumsum(lens, 0) - lens
            if sliding:
                kv.first, kv.ring = tensors[f"layer.{i}.first"].cpu(), bool(spec["ring"])
        self.n_seen, self.peak_nbytes = int(state["n_seen"]), self.nbytes  # this process's peak


def full_cache_bytes(cache, n_tokens):
    """What a full cache would hold after prefilling n_tokens: every token in every full-attention
    layer, and the same rolling window as ours in sliding layers."""
    total = 0
    for i, kv in enumerate(cache.layers):
        if cache._is_sliding(i):
            total += kv.nbytes
        else:
            total += n_tokens * kv.n_heads * 2 * kv.head_dim * kv.k.element_size()
    return total


# -------------------------------------------------------------------------------------------------
# Budget arithmetic (METHOD.md §6)

@dataclass
class PrefillPlan:
    window: int        # trailing context tokens kept in full
    segment_ratio: float  # r': fraction kept of every evicted segment, so that the total is r


@dataclass(frozen=True)
class Budget:
    """What travels together from the flags to every eviction of a request (METHOD.md §6): the
    fraction r of the context's KV pairs kept in the compressed layers, window included; the prefill
    chunk (also where a context counts as short); the trailing context tokens always kept."""
    ratio: float = 1.0
    chunk_size: int = 16384
    window: int = 4096

    def plan(self, n_context):
        """The budget rule for a context of n_context tokens (plan_prefill)."""
        return plan_prefill(n_context, self.ratio, self.chunk_size, self.window)


def plan_prefill(n_context, ratio, chunk_size, window):
    """The window and per-segment ratio that keep a fraction `ratio` of the context, window included.

    METHOD.md §6: contexts shorter than one chunk keep their last 2% instead of the window (the authors
    compare with 16000 = their chunk size; we compare with --chunk-size); if the budget is smaller than
    the window, only (a shorter) window survives."""
    if not 0 < ratio <= 1:
        raise ValueError(f"budget must be in (0, 1], got {ratio}")
    if n_context < chunk_size:
        window = int(0.02 * n_context)
    window = min(window, n_context)
    if ratio * n_context < window:
        return PrefillPlan(int(ratio * n_context), 0.0)
    if n_context == window:
        return PrefillPlan(window, 1.0)
    return PrefillPlan(window, (ratio * n_context - window) / (n_context - window))


def top_k_mask(scores, k):
    """Keep exactly the k highest scores; ties go to the earlier entry (stable sort): deterministic."""
    keep = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if k > 0:
        order = torch.sort(scores.flatten(), descending=True, stable=True).indices
        keep[order[:k]] = True
    return keep.view(scores.shape)


# -------------------------------------------------------------------------------------------------

# "global" is the paper's (METHOD.md §6 "pair"); "layer" and "head" are uniform ablations; "calibrated"
# is one step beyond the paper: each layer's scores are divided by their mean over the segment before
# the global threshold, so layers whose raw scores live on a smaller scale are not starved
# (METHOD.md §13.9).
LEVELS = ("global", "layer", "head", "calibrated")


class EvictingCache(KVCache):
    """A KV cache whose compressed layers score every new KV pair and evict on request.

    scorer: gate.Scorer, called as scorer.score(l, hidden, q, k, pos) -> (H, T) for compressed layer l.
    n_protected: the first n_protected positions (the system prompt) are never evicted (METHOD.md §4.4).
    decode_tokens_per_head: average kept tokens per compressed head during decoding (a count, not a fraction;
    None = keep generated tokens).
    """

    def __init__(self, cfg, scorer, dtype=torch.float32, device="cpu", n_protected=0, level="global",
                 decode_tokens_per_head=None, decode_buffer=128, decode_window=128, decode_sinks=4):
        super().__init__(cfg, dtype, device)
        assert level in LEVELS, f"level must be one of {LEVELS}"
        self.scorer, self.level, self.n_protected = scorer, level, n_protected
        self.compressed = list(cfg.compressed_layers)
        self.index = {layer: l for l, layer in enumerate(self.compressed)}  # model layer -> gate index
        self.decode_tokens_per_head, self.decode_buffer = decode_tokens_per_head, decode_buffer
        self.decode_window, self.decode_sinks = decode_window, decode_sinks
        self.decoding = False  # True after prefill: new tokens are buffered, scored every 128 tokens
        self.buffer = {layer: [] for layer in self.compressed}  # hidden states waiting to be scored
        self.gate_seconds = 0.0

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        if layer not in self.index:
            return super().attend(layer, q, k, v, hidden, scale, window)
        pos = self.positions(q.shape[0])
        score = None
        if self.decoding:
            self.buffer_decoded(layer, hidden)
        elif self.scorer is not None:  # None: scores arrive later (KVzip scores the whole context at once)
            score = self._score(self.index[layer], hidden, q, k, pos)
            score[:, pos < self.n_protected] = math.inf  # the system prompt is never evicted
        kv = self.layers[layer]
        kv.append(k, v, pos, score)
        self._track_peak(kv)
        return kv.attend(q, scale, window)

    def buffer_decoded(self, layer, hidden):
        """A decoded token's attention input, scored later, 128 tokens at a time (METHOD.md §7); its row
        scores +inf until then (not evictable)."""
        if self.decode_tokens_per_head is not None and layer in self.index:
            self.buffer[layer].append(hidden)

    def adopt(self, full, scores=None, inputs=None, keep_full=False):
        """Continue from `full`, a cache that prefilled system prompt ⊕ context without evicting: take over
        its KV in every layer (deep copies if keep_full, so that full can be adopted again), its position
        and its peak, and score every row of the compressed layers as attend() would have. The scores are
        either given, (L_c, H, n_context) for the context (KVzip's teacher, generate.prefill_kvzip), or
        computed now by this cache's scorer from the prefill's attention inputs, inputs[layer] =
        (hidden, q, k, pos) (the benchmark's replay, timed as gate_seconds). The system prompt scores
        +inf: never evicted. Then evict() as after any prefill."""
        assert self.n_seen == 0 and (scores is None) != (inputs is None), "adopt: an empty cache; scores or inputs"
        self.layers = [copy.deepcopy(kv) for kv in full.layers] if keep_full else full.layers
        self.n_seen, self.peak_nbytes = full.n_seen, full.peak_nbytes
        for l, layer in enumerate(self.compressed):
            kv = self.layers[layer]
            if inputs is None:
                system = torch.full((kv.n_heads, self.n_protected), math.inf, device=scores[l].device)
                score = torch.cat([system, scores[l]], dim=1)  # the cache holds exactly system ⊕ context
            else:
                hidden, q, k, pos = inputs[layer]
                score = self._score(l, hidden, q, k, pos)  # (H, T)
                score[:, pos < self.n_protected] = math.inf
            kv.set_tail_scores(score)

    def _score(self, l, hidden, q, k, pos):
        cuda = self.device.type == "cuda"
        if cuda:  # the layer's own work may still be queued on the GPU: the clock must not count it
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        score = self.scorer.score(l, hidden, q, k, pos).float()  # (H, T)
        if cuda:
            torch.cuda.synchronize()
        self.gate_seconds += time.perf_counter() - t0
        return score

    # -- prefill: evict a segment of the context (METHOD.md §6) --
    def evict(self, start, end, ratio, level=None):
        """Keep exactly ⌊ratio·n⌋ of the n KV pairs whose positions lie in [start, end), over all
        compressed layers and heads (level "global"), per layer ("layer") or per head ("head").

        The authors keep int(n·r)−1 pairs (strict `>` against the sorted score at index int(n·r)−1,
        METHOD.md §6); we keep exactly ⌊n·r⌋, ties going to the earlier layer, head and position."""
        if end <= start:
            return
        level = level or self.level
        in_seg = [[held_in(kv, h, start, end) for h in range(kv.n_heads)]
                  for kv in (self.layers[i] for i in self.compressed)]
        # every head still holds every position of the segment (nothing there was evaluated yet)
        scores = torch.stack([torch.stack([kv.head_score(h)[m] for h, m in enumerate(rows)])
                              for kv, rows in zip((self.layers[i] for i in self.compressed), in_seg)])
        # context pairs each layer holds outside this segment (older kept ones, and the window)
        others = torch.tensor([sum(int(((kv.head_pos(h) >= self.n_protected) & ~m).sum()) for h, m in enumerate(rows))
                               for kv, rows in zip((self.layers[i] for i in self.compressed), in_seg)],
                              device=scores.device)
        keep = select_segment(scores, ratio, level, others)
        for li in range(len(self.compressed)):
            masks = []
            for h, m in enumerate(in_seg[li]):
                mask = ~m
                mask[m] = keep[li, h]
                masks.append(mask)
            self.keep_rows(li, masks)

    def keep_rows(self, li, masks):
        """Keep, in compressed layer li, the rows masks[h] (bool, one per row held) of each head h; free the rest."""
        kv = self.layers[self.compressed[li]]
        kv.select(masks)
        self._track_peak(kv)

    # -- decoding: score the buffer every 128 tokens, evict back to the budget (METHOD.md §7) --
    def start_decoding(self):
        self.decoding = True

    def after_step(self):
        """Call after every decode forward. Every `decode_buffer` buffered tokens the gate scores them in
        one call; then, if the compressed layers hold more than decode_tokens_per_head·L·H pairs, the least
        important are evicted, always keeping the last `decode_window` tokens and the first 4."""
        if self.decode_tokens_per_head is None:
            return
        first = self.compressed[0]
        if sum(h.shape[0] for h in self.buffer[first]) < self.decode_buffer:
            return
        for layer in self.compressed:
            hidden = torch.cat(self.buffer[layer])
            self.buffer[layer] = []
            t = hidden.shape[0]
            score = self._score(self.index[layer], hidden, None, None,
                                torch.arange(self.n_seen - t, self.n_seen, device=self.device))
            self.layers[layer].set_tail_scores(score)
        self._evict_to_budget()

    def _evict_to_budget(self):
        budget = self.decode_tokens_per_head * len(self.compressed) * self.cfg.num_key_value_heads
        total = sum(int(self.layers[layer].n_rows) for layer in self.compressed)
        if total <= budget:
            return
        recent, sinks = self.n_seen - self.decode_window, self.decode_sinks
        scores, shapes = [], []
        for layer in self.compressed:
            kv = self.layers[layer]
            for h in range(kv.n_heads):
                s = kv.head_score(h).clone()
                p = kv.head_pos(h)
                s[(p >= recent) | (p < sinks)] = math.inf  # local window and attention sinks stay
                scores.append(s)
                shapes.append(s.numel())
        scores = torch.cat(scores)
        # protected rows are kept even when they alone exceed the budget (the authors' ties-kept rule)
        keep = top_k_mask(scores, max(int(budget), int(scores.isinf().sum()))).split(shapes)
        i = 0
        for li, layer in enumerate(self.compressed):
            n_heads = self.layers[layer].n_heads
            self.keep_rows(li, list(keep[i:i + n_heads]))
            i += n_heads

    def checkpoint(self):
        state = super().checkpoint()
        if self.decode_tokens_per_head is not None:  # decode-time eviction may touch the context: copy all
            state["all"] = [copy.deepcopy(kv) for kv in self.layers]
        return state

    def rollback(self, state):
        if "all" in state:
            self.layers = [copy.deepcopy(kv) for kv in state["all"]]
            self.n_seen = state["n_seen"]
        else:
            super().rollback(state)
        self.buffer = {layer: [] for layer in self.compressed}

    def _saved(self):
        """KVCache's, plus what eviction goes on from: the protected length, the level, decode-time
        eviction's settings and its buffer of attention inputs not yet scored, the gate's hash, and
        a random scorer's generator (its next scores)."""
        tensors, state = super()._saved()
        for layer, hidden in self.buffer.items():
            if hidden:
                tensors[f"buffer.{layer}"] = torch.cat(hidden)
        generator = getattr(self.scorer, "generator", None)
        if generator is not None:
            tensors["scorer.generator"] = generator.get_state()
        gates = getattr(self.scorer, "gates", None)
        state.update(cache="EvictingCache", level=self.level, decoding=self.decoding,
                     decode_tokens_per_head=self.decode_tokens_per_head,
                     decode_buffer=self.decode_buffer, decode_window=self.decode_window,
                     decode_sinks=self.decode_sinks,
                     scorer=type(self.scorer).__name__ if self.scorer is not None else None,
                     gate_sha256=tensors_sha256(gates.state_dict()) if gates is not None else None)
        return tensors, state

    def _restore(self, tensors, state):
        super()._restore(tensors, state)
        self.decoding = bool(state["decoding"])
        for layer in self.compressed:
            if f"buffer.{layer}" in tensors:
                self.buffer[layer] = [tensors[f"buffer.{layer}"]]
        if "scorer.generator" in tensors and self.scorer is not None:  # needed to go on scoring
            self.scorer.generator.set_state(tensors["scorer.generator"].cpu())

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
        return torch.tensor([[float(held_in(kv, h, start, end).sum()) / max(1, end - start)
                              for h in range(kv.n_heads)] for kv in (self.layers[i] for i in self.compressed)])


def held_in(kv, h, start, end):
    """(rows of head h,) bool: which of the rows kept by head h of a RaggedKV hold positions in [start, end)."""
    pos = kv.head_pos(h)
    return (pos >= start) & (pos < end)


def select_segment(scores, ratio, level="global", others=None):
    """The eviction rule of one segment: scores (L, H, s) of its KV pairs -> keep mask (L, H, s) with
    exactly ⌊ratio·n⌋ pairs kept over all layers and heads ("global", "calibrated"), per layer ("layer")
    or per head ("head"). others (L,): context pairs each layer holds outside the segment (None: none);
    a layer that would be left with no context pair at all gets its best pair back (_move_one)."""
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
        keep = torch.stack([torch.stack([top_k_mask(y, int(ratio * s)) for y in x]) for x in scores])
    if others is None:
        others = torch.zeros(L, dtype=torch.long, device=scores.device)
    for li in range(L):
        if others[li] == 0 and not keep[li].any():
            keep = _move_one(scores, keep, li, others)
    return keep


def _move_one(scores, keep, li, others):
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


# -------------------------------------------------------------------------------------------------
# Many sequences at once: a batch is more KV heads (METHOD.md §8)

class Batch:
    """B sequences decoding together, one token each per forward.

    Every layer's storage is ONE RaggedKV (a WindowKV ring in sliding layers) holding the KV heads of all
    members: member b owns heads b*H .. b*H + H-1, each with its own rows, positions and length (the
    layout of an engine's per-head block table), so one attention call per layer serves the whole batch.
    Each member is an ordinary cache (KVCache or EvictingCache) that prefilled alone, with its own
    budget plan: join() moves its rows into the shared storage, leave() moves them back out and frees
    them there. While it is a member, a cache's layers are HeadSlice views of its own heads, so its
    decode-time eviction (EvictingCache.after_step) runs unchanged, on its rows only.

    The model calls attend / positions / advance as on a single cache: its T query rows are the B
    members' newest tokens, in join order.
    """

    def __init__(self, cfg, dtype=torch.float32, device="cpu"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.layers = new_layers(cfg, 0, dtype, self.device)
        self.members = []
        self.peak_nbytes = 0

    @property
    def nbytes(self):
        return sum(kv.nbytes for kv in self.layers)

    def _track_peak(self):
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + max(kv.transient for kv in self.layers))
        for kv in self.layers:
            kv.transient = 0

    def join(self, cache):
        """Add a cache that has just run a forward alone (its last logits are the member's next sample)."""
        assert cache.n_seen > 0 and cache not in self.members, "join: a prefilled cache, once"
        for i, kv in enumerate(cache.layers):
            self.layers[i].extend(kv)
        self.members.append(cache)
        cache.layers = [HeadSlice(self, cache, i) for i in range(len(self.layers))]
        self._track_peak()

    def leave(self, cache):
        """Take a member's rows out of the shared storage, back into a cache of its own."""
        H = self.cfg.num_key_value_heads
        h0 = self.members.index(cache) * H
        cache.layers = [kv.pop_heads(h0, H) for kv in self.layers]
        self.members.remove(cache)

    def positions(self, T):
        assert T == len(self.members), f"a batch forward takes one token per member ({len(self.members)}), got {T}"
        return torch.tensor([m.n_seen for m in self.members], device=self.device)

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        """q (B, Hq, d), k/v (B, H, d): one new token per member -> (B, Hq, d), one attention call."""
        B, Hq, d = q.shape
        H = k.shape[1]
        for b, m in enumerate(self.members):
            if isinstance(m, EvictingCache):
                assert m.decoding, "a batch only decodes: prefill each member alone first"
                m.buffer_decoded(layer, hidden[b:b + 1])
        kv = self.layers[layer]
        pos = self.positions(B).repeat_interleave(H)[:, None]  # (B*H, 1): every head of member b at its position
        kv.append(k.reshape(1, B * H, d), v.reshape(1, B * H, d), pos)  # score +inf, as any decoded token
        self._track_peak()
        out = kv.attend(q.reshape(1, B * Hq, d), scale, window)  # query head (b*H + h)*G + g
        if isinstance(kv, WindowKV):
            kv.wrap()
        return out.view(B, Hq, d)

    def advance(self, T):
        for m in self.members:
            m.advance(1)

    def after_step(self):
        """Each member's decode-time eviction (every 128 of its tokens), on its own heads."""
        for m in self.members:
            if isinstance(m, EvictingCache):
                m.after_step()
        self._track_peak()


class HeadSlice:
    """Member `cache`'s heads of a Batch's layer `layer`, seen as a RaggedKV of H heads: what an
    EvictingCache reads and changes during decoding (scores, positions, select) lands on those rows."""

    def __init__(self, batch, cache, layer):
        self.batch, self.cache, self.layer = batch, cache, layer

    @property
    def kv(self):
        return self.batch.layers[self.layer]

    @property
    def heads(self):
        H = self.batch.cfg.num_key_value_heads
        h0 = self.batch.members.index(self.cache) * H
        return slice(h0, h0 + H)

    n_heads = property(lambda self: self.batch.cfg.num_key_value_heads)
    head_dim = property(lambda self: self.kv.head_dim)
    lens = property(lambda self: self.kv.lens[self.heads])
    starts = property(lambda self: self.kv.starts[self.heads])
    n_rows = property(lambda self: int(self.lens.sum()))
    # this member's share of the storage; the shared storage's re-layouts are the batch's to count
    nbytes = property(lambda self: int(self.kv.caps[self.heads].sum()) * 2 * self.head_dim * self.kv.k.element_size())
    transient = property(lambda self: 0, lambda self, value: None)

    def head_pos(self, h):
        return self.kv.head_pos(self.heads.start + h)

    def head_score(self, h):
        return self.kv.head_score(self.heads.start + h)

    def set_tail_scores(self, score):
        H, t = score.shape
        rows = ((self.starts + self.lens - t)[:, None] + torch.arange(t)).reshape(-1).to(self.kv.device)
        self.kv.score[rows] = score.to(self.kv.device, torch.float32).reshape(-1)

    def select(self, keep):
        kv, heads = self.kv, self.heads
        masks = [torch.ones(int(n), dtype=torch.bool) for n in kv.lens]
        masks[heads] = keep
        kv.select(masks)


# -------------------------------------------------------------------------------------------------
# A compressed cache in a file: compress once, with no question in sight, answer later (METHOD.md
# §11's query-agnostic setting, across processes). The file is safetensors (no pickle): its header's
# JSON names every tensor, our state is JSON in its metadata, and its last tensor is the sha256 of
# every byte before it.

CACHE_FORMAT, CACHE_VERSION = "fastkvzip-kv-cache", 1


class CacheFileError(Exception):
    """A saved cache this model cannot answer from (another model, tokenizer or dtype, another
    format version, a truncated or corrupt file): one line, nothing loaded."""


def _ids_sha256(ids):
    return hashlib.sha256(tensor_bytes(ids.to(torch.int64))).hexdigest()


def read_header(path):
    """(header, our JSON state) of a cache file, checked: ours, this format version, every byte
    there. Reads the header only (kilobytes)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CacheFileError(f"cache file {path} is truncated ({size} bytes)")
            n = struct.unpack("<Q", f.read(8))[0]
            if n > min(size - 8, 100 << 20):
                raise CacheFileError(f"cache file {path} is truncated or not safetensors "
                                     f"(a header of {n} bytes in {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CacheFileError(f"cache file {path} is corrupt (its header is not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT:
        raise CacheFileError(f"{path} is not a saved KV cache (no {CACHE_FORMAT!r} metadata)")
    if meta.get("format_version") != str(CACHE_VERSION):
        raise CacheFileError(f"cache file {path} has format version {meta.get('format_version')}; "
                             f"this version reads version {CACHE_VERSION}: save the cache again")
    try:
        state = json.loads(meta["fastkvzip"])
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        checksum = header["checksum"]["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CacheFileError(f"cache file {path} is corrupt (its header lacks what this format "
                             f"writes)") from None
    if 8 + n + end != size:
        raise CacheFileError(f"cache file {path} is truncated ({size} of {8 + n + end} bytes)")
    if checksum != [end - 32, end]:
        raise CacheFileError(f"cache file {path} is corrupt (no checksum in its last 32 bytes)")
    return header, state


def check_cache_file(path, identity, dtype):
    """The state of cache file `path` (read_header), refused unless made by the model of this
    identity (model.model_identity) in `dtype`: what a caller checks before the weights load."""
    _, state = read_header(path)
    for key, what in (("config_sha256", "another model (another config.json)"),
                      ("weights_sha256", "another model (other weights, the same config)"),
                      ("tokenizer_sha256", "another tokenizer")):
        if state["model"].get(key) != identity.get(key):
            raise CacheFileError(f"cache file {path} was made by {what}: not answered from here")
    dtype = str(dtype).removeprefix("torch.")
    if state["dtype"] != dtype:
        raise CacheFileError(f"cache file {path} holds {state['dtype']} keys and values, the model "
                             f"runs in {dtype}: load the model in {state['dtype']}")
    return state


def load_cache(path, model, scorer=None, verify=True):
    """A cache saved by KVCache.save, read straight to the model's device (safetensors maps the
    file), ready to answer as the cache that was saved. Refuses (CacheFileError) a file made by
    another model (config, weights), tokenizer or dtype, of another format version, truncated or
    corrupt (verify: the file's sha256, about a second per GB). scorer: what scores decoded tokens,
    for a cache saved with decode-time eviction: the same kind, and for the gate the same gate.
    -> (cache, info): info holds the prompt ids, n_protected, last_logits, what made the cache
    (method, budget, chunk_size, window, plan, prefill_seconds, prefill_peak_kv_bytes,
    decode_tokens_per_head), kv_bytes, file_bytes and load_seconds."""
    t0 = time.perf_counter()
    weight = model.model.embed_tokens.weight
    state = check_cache_file(path, getattr(model, "identity", None) or {}, weight.dtype)
    evicting = state["cache"] == "EvictingCache"
    if evicting and state["decode_tokens_per_head"] is not None:
        if scorer is None or type(scorer).__name__ != state["scorer"]:
            raise CacheFileError(f"cache file {path} evicts while decoding, scored by "
                                 f"{state['scorer']}: give that scorer, not "
                                 f"{type(scorer).__name__}")
        gates = getattr(scorer, "gates", None)
        if gates is not None and tensors_sha256(gates.state_dict()) != state["gate_sha256"]:
            raise CacheFileError(f"cache file {path} was made with another gate (gate sha256 "
                                 f"{state['gate_sha256'][:12]}): give that gate")
    if verify and not checksum_ok(path):
        raise CacheFileError(f"cache file {path} is corrupt (its checksum does not match)")
    try:
        with safe_open(str(path), framework="pt", device=str(weight.device)) as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CacheFileError(f"cache file {path} is corrupt ({' '.join(str(e).split())})") from None
    ids = tensors["ids"].cpu()
    if len(ids) != state["n_prompt"] or _ids_sha256(ids) != state["ids_sha256"]:
        raise CacheFileError(f"cache file {path} is corrupt (its prompt ids do not match its hash)")
    if evicting:
        cache = EvictingCache(model.config, scorer, weight.dtype, weight.device,
                              n_protected=state["n_protected"], level=state["level"],
                              decode_tokens_per_head=state["decode_tokens_per_head"],
                              decode_buffer=state["decode_buffer"],
                              decode_window=state["decode_window"],
                              decode_sinks=state["decode_sinks"])
    else:
        cache = KVCache(model.config, weight.dtype, weight.device)
    try:
        cache._restore(tensors, state)
    except (KeyError, CacheFileError) as e:
        raise CacheFileError(f"cache file {path} does not fit the model: {e}") from None
    info = {k: state.get(k) for k in ("method", "budget", "chunk_size", "window", "plan",
                                      "n_context", "n_protected", "prefill_seconds",
                                      "decode_tokens_per_head")}
    info["prefill_peak_kv_bytes"] = state["peak_nbytes"]
    info.update(ids=ids.tolist(), last_logits=tensors["last_logits"], kv_bytes=cache.nbytes,
                file_bytes=os.path.getsize(path), load_seconds=time.perf_counter() - t0)
    return cache, info
