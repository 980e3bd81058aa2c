"""
What one row of the decode suite runs (bench.py --suite decode --methods): a method, the level its
budget is kept at and its local window, named

    METHOD[@LEVEL][/wN]

METHOD  full, cut, a scorer of gate.METHODS that evicts while decoding (fastkvzip, snapkv, rkv,
        streaming, random, knorm), or split / split-self (below)
LEVEL   cache.LEVELS: global (one pool of B·L·H rows over every compressed layer and head), layer
        (B·H rows per layer), head (B per head), calibrated (global, each layer's scores divided by
        their mean first)
wN      the last N decoded tokens always kept (EvictingCache's decode_window; for SnapKV and R-KV
        also the queries that rescore the held rows)
Left out, each is the method's own (gate.METHODS: the gate global with 128, the baselines head with
8, as the authors run them), and a name is written with only what differs from it: the row
`fastkvzip@global/w128` is `fastkvzip`, `rkv@head/w128` is `rkv/w128`. A scorer made for one head at
a time (R-KV, SnapKV: their scores are not comparable across heads) runs at a pooled level if asked,
and the report says so under its table.

split: the static split of heads that DuoAttention and RazorAttention make by hand ("retrieval
heads" kept whole, the others only their attention sinks and recent tokens), with the bytes of the
gate's pool. The heads are ranked by how many rows the gate's pool at the same budget and window
(fastkvzip@global/wN) held in them, on average over a teacher-forced stream: for `split` another
document (the run's next Austen chapter, never evaluated: harness/decode.py), for `split-self` the
evaluated stream itself (an oracle: it has seen the stream's future). At each eviction every head
keeps what the cache protects (the first tokens or the system prompt, and the last N), then whole
heads in that order while they fit in the pool's B·L·H rows, then the first that does not fit keeps
its most recent rows up to what is left, and no other row: after every eviction the split holds as
many rows as the pool (SplitScorer). No token is chosen by its content, so split against the pool
is what the gate's token-by-token choice adds beyond finding the heads it fills.

fastkvzip+attn[λ] and fastkvzip+red[λ]: ours, terms that move the gate's scores at every
decode-time eviction, g a held row's gate score (computed once, when the row arrived):
    +attn  g·(1 + λ·a/ā), a the attention the last N queries give the row (SnapKV's decode-time
           attention, as R-KV and SnapKV rescore), ā its mean over the head's rows: rows the current
           text attends to are lifted (RescoredGateScorer, here);
    +red   g·(r̄/r)^λ, r the row's redundancy (R-KV's: gate.key_redundancy), r̄ its mean over the
           head: rows whose keys repeat others' are lowered. The method's own (gate.GateScorer
           .at_decode, METHOD.md §13.18): λ = 4 is the gate's decode default on a hybrid model.
Each factor is 1 on the head's average row, so the gate's scale across heads and layers is kept. λ
is 1 when left out (`fastkvzip+attn0.1@calibrated/w8`: λ = 0.1); the level and window are the
gate's own. A row named `fastkvzip...` runs the gate without either term (λ = 0), whatever the
model's default.
"""
from dataclasses import dataclass

import torch

import generate
from cache import LEVELS, EvictingCache
from gate import METHODS as SCORERS
from gate import GateScorer, Scorer, SnapKVScorer
from kernels import ArgumentError

# the scorers that evict while decoding; "full" and "cut" evict nothing (harness/decode.py)
SCORED = tuple(m for m, kind in SCORERS.items() if kind and kind.decode)
# the static split, by where its heads are ranked
SPLIT = {"split": "another document", "split-self": "the evaluated stream itself"}
# ours beside the paper's gate: its scores rescored at every eviction, by term
RESCORED = {"fastkvzip+attn": "attention", "fastkvzip+red": "redundancy"}
NAMES = ("full",) + SCORED + tuple(m + "[λ]" for m in RESCORED) + ("cut",) + tuple(SPLIT)


@dataclass(frozen=True)
class Config:
    name: str           # the row label, with only what differs from the method's own
    method: str         # one of NAMES
    level: str = None   # cache.LEVELS (None: full, cut)
    window: int = None  # decoded tokens always kept (None: full, cut)


def mix_of(method):
    """fastkvzip+attn[λ] or fastkvzip+red[λ] -> (its term, λ), λ 1 when left out; None for any
    other name (or a λ that is not a finite number >= 0)."""
    for base, term in RESCORED.items():
        tail = method[len(base):]
        if method.startswith(base) and (tail == "" or tail.replace(".", "", 1).isdigit()):
            return term, float(tail) if tail else 1.0
    return None


def own(method):
    """A method's own level and window: its scorer's (split: the gate's pool's)."""
    kind = GateScorer if method in SPLIT or mix_of(method) is not None else SCORERS[method]
    return kind.level, kind.decode_window


def parse(text):
    """METHOD[@LEVEL][/wN] -> Config, else a ValueError saying what is wrong (one line)."""
    rest, _, window = text.partition("/")
    method, at, level = rest.partition("@")
    if method not in NAMES and mix_of(method) is None:
        why = ("scores the context once and cannot evict while decoding" if method in SCORERS
               else "is no method")
        raise ValueError(f"{text!r}: {method!r} {why}: methods are {','.join(NAMES)}")
    if method in ("full", "cut"):
        if at or window or "/" in text:
            raise ValueError(f"{text!r}: {method} evicts nothing: it takes no @level or /wN")
        return Config(method, method)
    if at and method in SPLIT:
        raise ValueError(f"{text!r}: {method} keeps whole heads in one pool by its own rule: it "
                         "takes no @level (a window /wN only)")
    if at and level not in LEVELS:
        raise ValueError(f"{text!r}: unknown level {level!r}: levels are {','.join(LEVELS)}")
    n = window[1:]
    if "/" in text and not (window[:1] == "w" and n.isascii() and n.isdigit() and int(n) >= 1):
        raise ValueError(f"{text!r}: the window is /wN with N >= 1 decoded tokens, e.g. "
                         f"{rest}/w8")
    own_level, own_window = own(method)
    level, window = level or own_level, int(window[1:]) if window else own_window
    name = (method + (f"@{level}" if level != own_level else "")
            + (f"/w{window}" if window != own_window else ""))
    return Config(name, method, level, window)


def describe(config):
    """One line of the report: what a row named config.name ran."""
    c = parse(config) if isinstance(config, str) else config
    if c.method in SPLIT:
        return (f"`{c.name}`: the static split, heads ranked by the gate's pool "
                f"(fastkvzip@global/w{c.window}) on {SPLIT[c.method]}, window {c.window}")
    if c.method in ("full", "cut"):
        return f"`{c.name}`: {'every token' if c.method == 'full' else 'the full cache cut at B'}"
    if mix_of(c.method) is not None:
        term, mix = mix_of(c.method)
        factor = (f"1 + λ·(attention of the last {c.window} queries over its head's mean)"
                  if term == "attention" else "(the head's mean redundancy over the row's)^λ")
        return f"`{c.name}`: the gate's scores times {factor}, λ = {mix:g}, level {c.level}"
    note = ("; its scorer ranks rows within a head (its own level: head), pooled here as asked"
            if SCORERS[c.method].level == "head" and c.level != "head" else "")
    return f"`{c.name}`: {c.method} at level {c.level}, window {c.window}{note}"


def pool(window):
    """The gate's pool a split with this window is ranked by: fastkvzip@global/w{window}."""
    return parse(f"fastkvzip@global/w{window}")


def needs_gate(name):
    """Whether a configuration scores with the gate (a split: to rank its heads)."""
    method = parse(name).method
    return method in ("fastkvzip",) + tuple(SPLIT) or mix_of(method) is not None


class SplitScorer(Scorer):
    """The static split (module docstring) as scores for one global cut: a row of head (li, h)
    scores rank·span + its position, where rank is L·H for the head the pool filled most (`fill`
    (L_c, H): the rows it held, most first; ties to the earlier layer and head) down to 1, and span
    is above every position: a whole head outranks every row of the next, and inside the head
    that does not fit whole the most recent rows win. Exact in float32 (the cache's scores) while
    (L·H + 1)·span <= 2^24."""
    level = "global"
    decode_window = GateScorer.decode_window

    def __init__(self, fill, span):
        super().__init__(fill.shape[1])
        L, H = fill.shape
        order = torch.argsort(-fill.flatten().double(), stable=True)
        rank = torch.empty(L * H)
        rank[order] = torch.arange(L * H, 0, -1, dtype=torch.float32)
        self.rank, self.span = rank.view(L, H), span

    def score(self, li, hidden, q, k, pos):
        return self.rank[li].to(pos.device)[:, None] * self.span + pos.float()[None]  # (H, T)


class RescoredGateScorer(GateScorer):
    """fastkvzip+attn (module docstring): the gate scores every token once, as it arrives (score:
    kept by position); at every decode-time eviction RescoringGateCache asks `mixed` for each held
    row's g·(1 + λ·a/ā)."""
    rescores = True  # the cache keeps the last decode_window queries of each compressed layer

    def __init__(self, gates, scale, mix=1.0):
        super().__init__(gates)
        self.attention, self.mix = SnapKVScorer(scale).attention, mix
        self.by_pos = {}  # compressed layer -> (H, positions seen) the gate's scores

    @torch.no_grad()
    def score(self, li, hidden, q, k, pos):
        s = super().score(li, hidden, q, k, pos)
        old = self.by_pos.get(li, s.new_zeros(s.shape[0], 0))
        if old.shape[1] <= int(pos[-1]):
            old = torch.cat([old, old.new_zeros(old.shape[0], int(pos[-1]) + 1 - old.shape[1])], 1)
        old[:, pos] = s
        self.by_pos[li] = old
        return s

    @torch.no_grad()
    def mixed(self, li, h, pos, keys, queries):
        """Head h of compressed layer li: its held rows' positions (n,) and keys (n, d), its group's
        last w queries (w, G, d) -> (n,) the rescored gate score of the rows before the last w,
        +inf for those (the cache keeps the last w anyway)."""
        n, w = keys.shape[0], queries.shape[0]
        g = self.by_pos[li][h, pos[:n - w]]
        a = self.attention(keys, queries)                               # (n - w,)
        moved = g * (1 + self.mix * a / a.mean().clamp_min(1e-30))
        return torch.cat([moved, moved.new_full((w,), float("inf"))])


class RescoringGateCache(EvictingCache):
    """The evicting cache for fastkvzip+attn: at every decode-time eviction the gate scores the
    buffered tokens (as EvictingCache.after_step does for the gate), then every held row of every
    compressed head is rescored by RescoredGateScorer.mixed from the last decode_window queries."""

    def after_step(self):
        if self.decode_tokens_per_head is None:
            return
        if sum(h.shape[0] for h in self.buffer[self.compressed[0]]) < self.decode_buffer:
            return
        for li, layer in enumerate(self.compressed):
            hidden, self.buffer[layer] = torch.cat(self.buffer[layer]), []
            kv, t = self.layers[layer], hidden.shape[0]
            pos = torch.arange(self.n_seen - t, self.n_seen, device=self.device)
            kv.set_tail_scores(self.scorer.score(li, hidden, None, None, pos).float())
            q = self.queries[layer]
            q = q.view(q.shape[0], kv.n_heads, -1, kv.head_dim)  # (w, H, G, d): query head h·G + g
            for h in range(kv.n_heads):
                kv.head_score(h)[:] = self.scorer.mixed(li, h, kv.head_pos(h), kv.head_keys(h),
                                                        q[:, h])
        self._evict_to_budget()


def make_cache(model, config, n_protected, budget, gates, seed, fill=None):
    """An empty cache for a configuration (a Config or its name); budget: decode tokens per KV
    head; fill: a split's ranking, the rows the gate's pool held per head (L_c, H)."""
    c = parse(config) if isinstance(config, str) else config
    if c.method in ("full", "cut"):
        return generate.make_cache("full", model, n_protected)
    cfg, weight = model.config, model.model.embed_tokens.weight
    term, mix = mix_of(c.method) or (None, 0.0)
    if term == "attention":
        return RescoringGateCache(cfg, RescoredGateScorer(gates, cfg.attn_scale, mix), weight.dtype,
                                  weight.device, n_protected=n_protected, level=c.level,
                                  decode_tokens_per_head=budget, decode_window=c.window)
    if c.method not in SPLIT:
        method = "fastkvzip" if term else c.method
        cache = generate.make_cache(method, model, n_protected, gates=gates, level=c.level,
                                    decode_tokens_per_head=budget, seed=seed,
                                    decode_window=c.window)
        if method == "fastkvzip":  # the gate's redundancy factor: the row's λ, else none
            cache.scorer.redundancy = mix
        return cache
    shape = (len(cfg.compressed_layers), cfg.num_key_value_heads)
    span = cfg.max_position_embeddings
    if fill is None or tuple(fill.shape) != shape or (shape[0] * shape[1] + 1) * span > 2 ** 24:
        raise ArgumentError(f"make_cache: {c.name} needs its heads' fill, (compressed layers, KV "
                            f"heads) = {shape} rows the pool held (harness/decode.py: head_fill), "
                            f"and (L·H + 1)·positions <= 2^24, got "
                            f"{None if fill is None else tuple(fill.shape)}")
    return EvictingCache(cfg, SplitScorer(fill, span), weight.dtype, weight.device,
                         n_protected=n_protected, level="global", decode_tokens_per_head=budget,
                         decode_window=c.window)
