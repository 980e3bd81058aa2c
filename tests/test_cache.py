"""The evicting cache against independent oracles: a dense full cache with exactly the evicted
positions masked out, the full cache itself at budget 1.0, and the budget rule's exact counts."""
import math

import pytest
import torch

import model as M
from cache import Budget, EvictingCache, KVCache, plan_prefill, top_k_mask
from gate import Gates, GateScorer
from generate import answer, prefill
from tests.helpers import assert_close, tiny_checkpoint


class DenseMaskedCache:
    """Oracle: keeps every token of every layer and masks the positions the evicting cache dropped.
    Plain dense attention, no RaggedKV, no varlen kernel."""

    def __init__(self, cfg):
        self.cfg, self.n_seen = cfg, 0
        self.k = [None] * cfg.num_hidden_layers
        self.v = [None] * cfg.num_hidden_layers
        self.dropped = [torch.zeros(cfg.num_key_value_heads, 0, dtype=torch.bool)
                        for _ in range(cfg.num_hidden_layers)]

    def positions(self, T):
        return torch.arange(self.n_seen, self.n_seen + T)

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        T, Hq, d = q.shape
        H = k.shape[1]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        self.dropped[layer] = torch.cat([self.dropped[layer], torch.zeros(H, T, dtype=torch.bool)],
                                        1)
        n = self.k[layer].shape[0]
        qpos = torch.arange(n - T, n)[:, None]
        kpos = torch.arange(n)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        out = torch.empty_like(q)
        for j in range(Hq):
            h = j // (Hq // H)
            logits = (q[:, j] @ self.k[layer][:, h].T) * scale
            mask = allowed & ~self.dropped[layer][h][None, :]
            p = torch.softmax(logits.masked_fill(~mask, -math.inf), -1)
            out[:, j] = p @ self.v[layer][:, h]
        return out

    def advance(self, T):
        self.n_seen += T

    def sync(self, ev):
        """Mask everything the evicting cache no longer holds in its compressed layers."""
        for layer in ev.compressed:
            kv = ev.layers[layer]
            for h in range(kv.n_heads):
                held = torch.zeros(self.n_seen, dtype=torch.bool)
                held[kv.head_pos(h).cpu()] = True
                self.dropped[layer][h] = ~held


def random_gate_scorer(cfg, seed=0):
    torch.manual_seed(seed)
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size)
    with torch.no_grad():  # move away from the all-zero init so scores are spread out
        gates.b.normal_()
        gates.k_base.normal_()
    return GateScorer(gates)


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    folder = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return M.load_model(folder, "cpu", torch.float32)


def test_top_k_mask_keeps_what_a_stable_sort_keeps():
    """The eviction's selection against its definition: the first k of a stable descending sort
    (ties to the earlier entry), over few distinct values (many ties), +inf (protected pairs),
    -inf, k from 0 past n, and NaN ranked as +inf."""
    def by_sort(x, k):
        keep = torch.zeros(x.numel(), dtype=torch.bool)
        keep[torch.sort(x.flatten(), descending=True, stable=True).indices[:max(k, 0)]] = True
        return keep.view(x.shape)

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 60, (), generator=g))
        x = torch.randint(0, 4, (n,), generator=g).float()
        x[torch.rand(n, generator=g) < 0.2] = math.inf
        x[torch.rand(n, generator=g) < 0.1] = -math.inf
        shape = (3, n) if trial % 2 else (n,)
        x = x.repeat(3).view(3, n) if trial % 2 else x
        for k in (0, 1, n // 2, x.numel() - 1, x.numel(), x.numel() + 3):
            assert torch.equal(top_k_mask(x, k), by_sort(x, k)), (x, k)
            assert top_k_mask(x, k).shape == shape
    x = torch.tensor([1.0, math.nan, math.inf, 2.0])
    assert torch.equal(top_k_mask(x, 1), by_sort(torch.tensor([1.0, math.inf, math.inf, 2.0]), 1))
    assert top_k_mask(x, 2).tolist() == [False, True, True, False]


def test_eviction_equals_masked_dense_attention(tiny):
    """Prefill in several chunks with eviction after each, then decode with evictions: every logit
    equals a full dense computation in which exactly the evicted positions are masked out."""
    cfg = tiny.config
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (90,))
    n_protected, chunk, window, budget = 5, 32, 8, 0.4
    ev = EvictingCache(cfg, random_gate_scorer(cfg), n_protected=n_protected,
                       decode_tokens_per_head=24, decode_buffer=8, decode_window=6)
    dense = DenseMaskedCache(cfg)
    plan = plan_prefill(len(ids) - n_protected, budget, chunk_size=chunk, window=window)
    start = n_protected
    with torch.no_grad():
        for i in range(0, len(ids), chunk):
            assert_close(tiny(ids[i:i + chunk], ev), tiny(ids[i:i + chunk], dense), atol=1e-4)
            end = ev.n_seen - plan.window
            if end > start:
                ev.evict(start, end, plan.segment_ratio)
                start = end
            dense.sync(ev)
        assert ev.kept_fraction_per_layer(n_protected, len(ids)) != [1.0] * len(ev.compressed)
        ev.start_decoding()
        token = 7
        for step in range(40):  # several 8-token buffers: scoring and eviction during decoding
            a, b = tiny(torch.tensor([token]), ev), tiny(torch.tensor([token]), dense)
            assert_close(a, b, atol=1e-4)
            ev.after_step()
            dense.sync(ev)
            token = int(a[-1].argmax())


@pytest.mark.parametrize("level", ["global", "layer", "head", "calibrated"])
def test_budget_rule_counts_and_invariants(tiny, level):
    cfg = tiny.config
    torch.manual_seed(2)
    n_protected, budget = 4, 0.3
    ids = torch.randint(0, cfg.vocab_size, (120,)).tolist()
    cache = EvictingCache(cfg, random_gate_scorer(cfg), n_protected=n_protected, level=level)
    with torch.no_grad():
        prefill(tiny, cache, ids, n_protected, Budget(budget, chunk_size=40, window=10))
    n_ctx = len(ids) - n_protected
    plan = plan_prefill(n_ctx, budget, 40, 10)
    L, H = len(cache.compressed), cfg.num_key_value_heads
    # exact count: ⌊r'·n⌋ of each evicted segment (segments are known from the chunk boundaries)
    expected, start = 0, n_protected
    for seen in range(40, len(ids) + 40, 40):
        end = min(seen, len(ids)) - plan.window
        if end > start:
            s = end - start
            expected += ((int(plan.segment_ratio * L * H * s) if level in ("global", "calibrated")
                          else L * int(plan.segment_ratio * H * s) if level == "layer"
                          else L * H * int(plan.segment_ratio * s)))
            start = end
    held = 0
    for layer in cache.compressed:
        kv = cache.layers[layer]
        for h in range(H):
            p = kv.head_pos(h)
            assert torch.equal(p, torch.sort(p).values), "rows stay in position order"
            assert set(range(n_protected)) <= set(p.tolist()), "the system prompt is never evicted"
            assert set(range(len(ids) - plan.window,
                             len(ids))) <= set(p.tolist()), "the window is kept"
            held += int(((p >= n_protected) & (p < len(ids) - plan.window)).sum())
        assert int(kv.lens.sum()) == kv.n_rows
        # no hidden full copy: the bytes held are exactly the kept rows
        assert kv.nbytes == kv.n_rows * 2 * cfg.head_dim * kv.k.element_size()
    assert held == expected
    total = sum(cache.kept_fraction_per_layer(n_protected, len(ids))) / L
    assert abs(total - budget) < 0.05, total


def test_budget_one_matches_full_cache_and_chunking_is_exact(tiny):
    cfg = tiny.config
    torch.manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (70,)).tolist()
    stop = set()
    outs = []
    with torch.no_grad():
        for cache, chunk in [(KVCache(cfg), 10_000), (KVCache(cfg), 16),
                             (EvictingCache(cfg, random_gate_scorer(cfg), n_protected=3), 16)]:
            prefill(tiny, cache, ids, 3, Budget(1.0, chunk_size=chunk, window=8))
            outs.append(answer(tiny, cache, [5, 6], 24, stop))
    assert outs[0] == outs[1] == outs[2]


def test_decode_tokens_per_head_and_sliding_window_bounds(tiny):
    """During decoding the compressed layers never hold more than the budget plus one buffer, and
    sliding-window layers exactly their last W tokens between forwards."""
    cfg = tiny.config
    torch.manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (80,)).tolist()
    B, buf = 20, 8
    cache = EvictingCache(cfg, random_gate_scorer(cfg), n_protected=2, decode_tokens_per_head=B,
                          decode_buffer=buf, decode_window=6)
    L, H = len(cache.compressed), cfg.num_key_value_heads
    with torch.no_grad():
        prefill(tiny, cache, ids, 2, Budget(0.5, chunk_size=32, window=8))
        cache.start_decoding()
        sinks = [set(p for p in cache.layers[i].head_pos(h).tolist() if p < 4)
                 for i in cache.compressed for h in range(cfg.num_key_value_heads)]
        token, evicted = 3, False
        for step in range(60):
            logits = tiny(torch.tensor([token]), cache)
            cache.after_step()
            token = int(logits[-1].argmax())
            held = sum(cache.layers[i].n_rows for i in cache.compressed)
            # from the first full buffer on (prefill may leave more than the budget)
            if step >= buf - 1:
                assert held <= (B + buf) * L * H
            evicted |= held <= B * L * H < cache.n_seen * L * H
            for i, kv in enumerate(cache.layers):
                if cfg.layer_types[i] == "sliding_attention":
                    assert kv.lens.tolist() == [cfg.sliding_window] * kv.n_heads  # a full ring of W
                    assert kv.nbytes == kv.n_rows * 2 * cfg.head_dim * kv.k.element_size()
                    assert int(kv.head_pos(0).min()) == cache.n_seen - cfg.sliding_window
        assert evicted, "the decode budget was never enforced"
        heads = [(layer, h) for layer in cache.compressed for h in range(H)]
        # what the first 4 positions kept, and the decode window, survive
        for (layer, h), sink in zip(heads, sinks):
            held = set(cache.layers[layer].head_pos(h).tolist())
            assert sink <= held and set(range(cache.n_seen - 6, cache.n_seen)) <= held


class LayerBiasedScorer:
    """Layer 0 scores everything higher than any later layer: a global threshold would starve
    them."""
    level = "global"

    def score(self, l, hidden, q, k, pos):
        return torch.rand(k.shape[1], len(pos)) + 10.0 * (l == 0)


def test_no_layer_loses_every_context_token(tiny):
    cfg = tiny.config
    if len(cfg.compressed_layers) < 2:
        pytest.skip("needs two compressed layers")
    torch.manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (30,)).tolist()
    cache = EvictingCache(cfg, LayerBiasedScorer(), n_protected=1)
    with torch.no_grad():  # 29 context tokens: no 2% window, so layer 1 would keep nothing
        prefill(tiny, cache, ids, 1, Budget(0.2, chunk_size=64, window=0))
    kept = cache.kept_fraction_per_layer(1, len(ids))
    L, H = len(cache.compressed), cfg.num_key_value_heads
    assert all(k > 0 for k in kept), kept
    total = round(sum(kept) * 29 * H)
    assert total == int(0.2 * 29 * L * H), "the floor moves a pair, it does not add one"


def test_peak_counts_old_buffers_while_a_layer_is_relaid_out():
    """A second prefill chunk re-lays a layer out: old and new buffers are both alive during the
    copy, and the peak says so (the last layer copied: every layer at 200 rows, plus its old
    100)."""
    from types import SimpleNamespace
    H, d, L = 2, 8, 3
    cfg = SimpleNamespace(num_key_value_heads=H, head_dim=d, num_hidden_layers=L,
                          layer_types=["full_attention"] * L, compressed_layers=list(range(L)),
                          window=lambda layer: None)
    cache = KVCache(cfg)
    # prefill-sized appends are allocated exactly, so the second one copies the first
    for T in (100, 100):
        for layer in range(L):
            k = torch.randn(T, H, d)
            cache.attend(layer, torch.randn(T, H, d), k, k, None, 1.0)
        cache.advance(T)
    per_token = H * 2 * d * 4  # K and V rows of every head, fp32
    assert cache.nbytes == L * 200 * per_token
    assert cache.peak_nbytes == L * 200 * per_token + 100 * per_token


class FixedScorer:
    """Precomputed scores (L, H, n) of the context positions, handed to the cache as it asks."""
    level = "global"

    def __init__(self, scores):
        self.scores = scores

    def score(self, l, hidden, q, k, pos):
        return self.scores[l][:, pos]


@pytest.mark.parametrize("budget", [0.5, 0.3, 0.01])
def test_kept_by_rule_is_what_the_cache_keeps(tiny, budget):
    """teacher.kept_by_rule (the agreement metrics' kept sets) against the cache itself: one prefill
    chunk of the same scores keeps exactly the same pairs, window and empty-layer floor included."""
    from teacher import kept_by_rule
    cfg = tiny.config
    torch.manual_seed(6)
    n, L, H = 100, len(cfg.compressed_layers), cfg.num_key_value_heads
    scores = torch.rand(L, H, n)
    cache = EvictingCache(cfg, FixedScorer(scores), n_protected=0)
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
        prefill(tiny, cache, ids, 0, Budget(budget, chunk_size=128, window=16))
    keep, window = kept_by_rule(scores, budget, chunk_size=128, window=16)
    # shorter than one chunk: the last 2% (less if the budget is)
    assert window == min(2, int(budget * n))
    for li, layer in enumerate(cache.compressed):
        for h in range(H):
            assert (cache.layers[layer].head_pos(h).tolist()
                    == keep[li, h].nonzero().squeeze(1).tolist())


def test_a_calibrated_gate_moves_the_prefill_cut_and_leaves_decoding_alone(tiny):
    """Cut offsets (METHOD.md §13.17): the prefill keeps what the cache's rule keeps on the moved
    scores (Gates.cut_scores), which is another set than the plain gate's, while every row keeps the
    gate's own score; decoding after an unevicted prefill is the plain gate's, logits and rows."""
    from teacher import kept_by_rule
    cfg = tiny.config
    n, L, H = 100, len(cfg.compressed_layers), cfg.num_key_value_heads
    plain, calibrated = random_gate_scorer(cfg, seed=7), random_gate_scorer(cfg, seed=7)
    calibrated.gates.cut_offset.copy_(torch.linspace(-3, 3, L * H).view(L, H))
    torch.manual_seed(8)
    ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()

    def run(scorer, budget, steps=0):
        cache = EvictingCache(cfg, scorer, decode_tokens_per_head=20, decode_buffer=8,
                              decode_window=6)
        with torch.no_grad():
            logits = [prefill(tiny, cache, ids, 0, Budget(budget, chunk_size=128, window=16))]
            cache.start_decoding()
            for _ in range(steps):
                logits.append(tiny(torch.tensor([int(logits[-1].argmax())]), cache)[-1])
                cache.after_step()
        return cache, logits

    full, _ = run(plain, 1.0)
    raw = torch.stack([torch.stack([full.layers[layer].head_score(h) for h in range(H)])
                       for layer in full.compressed])  # (L, H, n): the gate's own scores
    held = lambda c: [[c.layers[layer].head_pos(h).tolist() for h in range(H)]
                      for layer in c.compressed]
    kept = {}
    for name, scorer in (("plain", plain), ("calibrated", calibrated)):
        cache, _ = run(scorer, 0.3)
        keep, _ = kept_by_rule(scorer.cut_scores(raw), 0.3, chunk_size=128, window=16)
        kept[name] = held(cache)
        assert kept[name] == [[keep[li, h].nonzero().squeeze(1).tolist() for h in range(H)]
                              for li in range(L)], name
        for li, layer in enumerate(cache.compressed):
            for h in range(H):
                kv = cache.layers[layer]
                assert torch.equal(kv.head_score(h), raw[li, h, kv.head_pos(h)])
    assert kept["plain"] != kept["calibrated"]
    (a, la), (b, lb) = run(plain, 1.0, steps=40), run(calibrated, 1.0, steps=40)
    assert held(a) == held(b) and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert sum(len(p) for row in held(a) for p in row) < a.n_seen * L * H  # decoding did evict


class InputsCache(KVCache):
    """A full cache that also keeps each compressed layer's attention input, q, k and positions."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.inputs = {}

    def attend(self, layer, q, k, v, hidden, scale, window=None):
        if layer in self.cfg.compressed_layers:
            self.inputs[layer] = (hidden, q, k, self.positions(q.shape[0]))
        return super().attend(layer, q, k, v, hidden, scale, window)


@pytest.mark.parametrize("given", [False, True])
def test_taking_over_a_full_prefill_equals_prefilling_the_evicting_cache(tiny, given):
    """Oracle: the evicting cache that prefilled itself. Taking over a full cache of the same prompt,
    scored by the cache's scorer from the prefill's inputs or with the scores given for the context,
    then evicting, keeps the same positions, keys and values; with keep_full the full cache stays as
    it was."""
    cfg = tiny.config
    torch.manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (60,))
    n_protected = 4
    oracle = EvictingCache(cfg, random_gate_scorer(cfg), n_protected=n_protected)
    full = InputsCache(cfg)
    with torch.no_grad():
        tiny(ids, oracle), tiny(ids, full)
    cache = EvictingCache(cfg, random_gate_scorer(cfg), n_protected=n_protected)
    before = [kv.n_rows for kv in full.layers]
    if given:
        scores = torch.stack([torch.stack([oracle.layers[i].head_score(h)[n_protected:]
                                           for h in range(kv.n_heads)])
                              for i, kv in ((i, oracle.layers[i]) for i in oracle.compressed)])
        cache.take_over_prefill(full, scores=scores, keep_full=True)
    else:
        cache.take_over_prefill(full, inputs=full.inputs, keep_full=True)
    assert cache.n_seen == oracle.n_seen and cache.peak_nbytes == full.peak_nbytes
    for c in (cache, oracle):
        c.evict(n_protected, len(ids) - 2, 0.3)
    assert [kv.n_rows for kv in full.layers] == before
    for a, b in zip(cache.layers, oracle.layers):
        for h in range(a.n_heads):
            assert (torch.equal(a.head_pos(h), b.head_pos(h))
                    and torch.equal(a.head_score(h), b.head_score(h)))
        rows = lambda kv: torch.cat([torch.arange(int(s), int(s) + int(n))
                                     for s, n in zip(kv.starts, kv.lens)])
        assert torch.equal(a.k[rows(a)], b.k[rows(b)]) and torch.equal(a.v[rows(a)], b.v[rows(b)])


class PerHeadEvictCache(EvictingCache):
    """evict() written head by head, as plainly as it reads (the method before its
    vectorised version): the reference the cache's own eviction must keep exactly."""

    def evict(self, start, end, ratio, level=None):
        from cache import held_in, select_segment
        if end <= start:
            return
        layers = [self.layers[i] for i in self.compressed]
        in_seg = [[held_in(kv, h, start, end) for h in range(kv.n_heads)] for kv in layers]
        scores = torch.stack([torch.stack([kv.head_score(h)[m] for h, m in enumerate(rows)])
                              for kv, rows in zip(layers, in_seg)])
        others = torch.tensor([sum(int(((kv.head_pos(h) >= self.n_protected) & ~m).sum())
                                   for h, m in enumerate(rows)) for kv, rows in zip(layers, in_seg)])
        keep = select_segment(scores, ratio, level or self.level, others)
        for li, rows in enumerate(in_seg):
            masks = []
            for h, m in enumerate(rows):
                mask = ~m
                mask[m] = keep[li, h]
                masks.append(mask)
            self.keep_in_layer(li, torch.cat(masks))


@pytest.mark.parametrize("level", ["global", "layer", "head", "calibrated"])
def test_evict_keeps_what_a_per_head_reference_keeps(tiny, level):
    """Several chunks, the last of one token (its regions get slack), a protected system prompt,
    ties in the scores: every head keeps the same rows, with the same keys."""
    cfg = tiny.config
    torch.manual_seed(7)
    n, n_protected = 257, 5  # chunks of 64: the last holds one token
    L, H = len(cfg.compressed_layers), cfg.num_key_value_heads
    scores = torch.rand(L, H, n).round(decimals=1)  # many ties
    ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
    caches = [cls(cfg, FixedScorer(scores), n_protected=n_protected, level=level)
              for cls in (EvictingCache, PerHeadEvictCache)]
    with torch.no_grad():
        for cache in caches:
            prefill(tiny, cache, ids, n_protected, Budget(0.3, chunk_size=64, window=24))
    ours, ref = caches
    for layer in ours.compressed:
        a, b = ours.layers[layer], ref.layers[layer]
        assert torch.equal(a.lens, b.lens)
        for h in range(H):
            assert torch.equal(a.head_pos(h), b.head_pos(h)), (layer, h)
            assert torch.equal(a.head_score(h), b.head_score(h))
    assert torch.equal(ours.layers[ours.compressed[0]].k, ref.layers[ref.compressed[0]].k)
