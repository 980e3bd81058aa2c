"""Decode-time eviction (METHOD.md §7) holds memory to its budget: an answer reserves rows only up
to the next eviction, an eviction compacts inside the storage it has and leaves room for the next
128-token buffer, and only memory moves: the rows kept and the logits are those of an exact
re-layout after every eviction. Also: the budget groups of each level, the baselines' decode-time
scores against the authors' formulas, and budgets the protected rows fill."""
import math

import pytest
import torch
import torch.nn.functional as F

import cache as C
import gate
import model as M
from cache import Budget, DecodeBudgetError, EvictingCache, keep_within_budget
from generate import Compression, begin_answer, decode_one, make_cache, prefill, prefill_request
from kernels import ArgumentError
from tests.helpers import tiny_checkpoint
from tests.test_cache import random_gate_scorer

PROMPT, QUESTION = 100, 5


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    """Llama: every layer compressed; Gemma3: one compressed global layer beside sliding rings."""
    folder = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return M.load_model(folder, "cpu", torch.float32)


def stream(model, cache, n_tokens, max_new_tokens, seed=0, each=None):
    """Prefill PROMPT random ids (nothing evicted), ask a QUESTION-token question reserving
    max_new_tokens, then decode n_tokens random ids one by one; each(step, logits) after every
    forward."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (PROMPT + QUESTION + n_tokens,), generator=g)
    with torch.no_grad():
        prefill(model, cache, ids[:PROMPT].tolist(), 0, Budget(1.0))
        logits = begin_answer(model, cache, ids[PROMPT:PROMPT + QUESTION].tolist(),
                              max_new_tokens=max_new_tokens)
        if each:
            each(-1, logits)
        for step, token in enumerate(ids[PROMPT + QUESTION:].tolist()):
            logits = decode_one(model, cache, token)
            if each:
                each(step, logits)


def compressed_bytes(cache):
    return sum(cache.layers[i].nbytes for i in cache.compressed)


def test_memory_follows_the_budget_not_the_answer(tiny):
    """2,000 decoded tokens at B = 172 per head with max_new_tokens 2,100 (> 12 B): the compressed
    layers never hold more than the bound (B + 128 rows per head, the 1/8 an in-place compaction
    may keep spare, or the prompt and question with one buffer before the first eviction), and their
    storage is allocated at most once per 128 decoded tokens."""
    cfg = tiny.config
    B, buf, n = 172, 128, 2000  # the gate keeps the first 4 tokens and a 128-token window: 132
    cache = EvictingCache(cfg, random_gate_scorer(cfg), decode_tokens_per_head=B)
    L, H = len(cache.compressed), cfg.num_key_value_heads
    row = 2 * cfg.head_dim * 4  # fp32 K and V
    bound = max(math.ceil((B + buf) * 9 / 8), PROMPT + QUESTION + buf) * L * H * row
    storage = {i: None for i in cache.compressed}
    allocations, most = [0], [0]

    def each(step, logits):
        most[0] = max(most[0], compressed_bytes(cache))
        for i in cache.compressed:
            ptr = cache.layers[i].k.data_ptr()
            allocations[0] += storage[i] is not None and ptr != storage[i]
            storage[i] = ptr

    stream(tiny, cache, n, max_new_tokens=2100, each=each)
    kept = sum(cache.layers[i].n_rows for i in cache.compressed)
    assert kept <= (B + buf) * L * H < cache.n_seen * L * H, "the budget was not enforced"
    assert most[0] <= bound, f"{most[0]} bytes held, bound {bound}"
    per_128 = allocations[0] / L / (n / buf)
    print(f"\n{cfg.arch}: {per_128:.2f} re-allocations per compressed layer per 128 "
          f"tokens; at most {most[0] / bound:.2f} of the bound held")
    assert per_128 <= 1.0


class ExactCache(EvictingCache):
    """Decode-time eviction as it was before: the whole answer reserved, every eviction an exact
    re-layout of the kept rows (no room left)."""

    def reserve(self, n_question, n_answer=0):
        C.KVCache.reserve(self, n_question, n_answer)

    def keep_in_layer(self, li, mask, room=0):
        super().keep_in_layer(li, mask, 0)


@pytest.mark.parametrize("method, level", [("fastkvzip", "global"), ("random", "head"),
                                           ("snapkv", "head"), ("rkv", "layer")])
def test_only_memory_moves(tiny, method, level):
    """The same stream through the compacting cache and through exact re-layouts: the same rows kept
    after every step and bit-identical logits, for the gate and the baselines at every level."""
    cfg = tiny.config
    B = 160

    def new(cls):
        made = make_cache(method, tiny, 0, gates=random_gate_scorer(cfg).gates, level=level,
                          decode_tokens_per_head=B)
        return cls(cfg, made.scorer, n_protected=0, level=level, decode_tokens_per_head=B)

    runs = []
    for cls in (EvictingCache, ExactCache):
        cache, seen = new(cls), []

        def each(step, logits, cache=cache, seen=seen):
            rows = [[kv.head_pos(h).tolist() for h in range(kv.n_heads)]
                    for kv in (cache.layers[i] for i in cache.compressed)]
            seen.append((rows, logits.clone()))

        stream(tiny, cache, 600, max_new_tokens=700, seed=3, each=each)
        runs.append((cache, seen))
    (new_cache, a), (_, b) = runs
    assert len(a) == len(b)
    for (rows_a, logits_a), (rows_b, logits_b) in zip(a, b):
        assert rows_a == rows_b
        assert torch.equal(logits_a, logits_b)
    assert sum(kv.n_rows for kv in new_cache.layers) < new_cache.n_seen * cfg.num_hidden_layers \
        * cfg.num_key_value_heads, "nothing was evicted"


def test_a_budget_above_the_length_is_the_full_cache(tiny):
    """Nothing to evict (B above everything the stream holds): the logits of every step equal the
    full cache's, and the cache holds one buffer of room, not the whole answer."""
    cfg = tiny.config
    runs = []
    for cache in (C.KVCache(cfg), EvictingCache(cfg, random_gate_scorer(cfg),
                                                decode_tokens_per_head=4000)):
        logits = []
        stream(tiny, cache, 300, max_new_tokens=3000, seed=5,
               each=lambda step, x, logits=logits: logits.append(x.clone()))
        runs.append((cache, logits))
    (full, a), (evicting, b) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert compressed_bytes(evicting) * 4 < sum(full.layers[i].nbytes
                                                for i in evicting.compressed)


def test_decode_level_is_the_structure_at_decode_and_its_default_follows_the_model(tiny):
    """EvictingCache(decode_level=L): decode-time eviction keeps exactly what a cache of level L
    keeps (the prefill evicts nothing here, so its level plays no part). make_cache's default: a
    level named applies at decode too, else the scorer's own on this model: the gate's one pool
    where every layer is compressed (Llama), calibrated beside sliding layers (Gemma 3); the
    baselines per head. Its window: the gate's 128, the baselines' 8."""
    cfg = tiny.config
    held = []
    for level, decode_level in (("global", "head"), ("head", None), ("global", None)):
        cache = EvictingCache(cfg, random_gate_scorer(cfg), level=level, decode_level=decode_level,
                              decode_tokens_per_head=150)
        assert cache.decode_level == decode_level or level
        stream(tiny, cache, 400, max_new_tokens=8)
        held.append([cache.layers[i].head_pos(h).tolist() for i in cache.compressed
                     for h in range(cfg.num_key_value_heads)])
    assert held[0] == held[1]
    if len(held[0]) > 1:  # several heads: one pool keeps another set than per head
        assert held[2] != held[1]
    gates = random_gate_scorer(cfg).gates
    hybrid = len(cfg.compressed_layers) < cfg.num_hidden_layers
    assert hybrid == (cfg.arch == "gemma3")
    made = lambda method, **kw: make_cache(method, tiny, 0, gates=gates, decode_tokens_per_head=150,
                                           **kw)
    assert (made("fastkvzip").level, made("fastkvzip").decode_level) == \
        ("global", "calibrated" if hybrid else "global")
    assert made("fastkvzip", level="layer").decode_level == "layer"
    assert made("fastkvzip", level="layer", decode_level="head").decode_level == "head"
    assert made("snapkv").decode_level == "head"
    # the window: the gate's 128, as the authors', on every model
    assert made("fastkvzip").decode_window == 128
    assert made("fastkvzip", decode_window=64).decode_window == 64
    assert made("snapkv").decode_window == 8
    req = dict(ids=list(range(10, 60)), n_protected=0, questions=[], budget=Budget(1.0),
               max_new_tokens=1)  # the command line's --decode-window reaches the cache
    how = Compression("random", decode_tokens_per_head=150, decode_window=64)
    assert prefill_request(tiny, req, how).cache.decode_window == 64
    # the gate's redundancy factor: λ = 4 beside sliding layers, none elsewhere; --decode-redundancy
    assert made("fastkvzip").scorer.redundancy == (4.0 if hybrid else 0.0)
    assert made("fastkvzip", decode_redundancy=0).scorer.redundancy == 0.0
    how = Compression("fastkvzip", gates, decode_tokens_per_head=150, decode_redundancy=2)
    assert prefill_request(tiny, req, how).cache.scorer.redundancy == 2.0
    with pytest.raises(ArgumentError, match="decode_level 'pool' is not one of"):
        EvictingCache(cfg, random_gate_scorer(cfg), decode_level="pool")


def test_levels_keep_their_budget_groups():
    """keep_within_budget against sorting by hand: B per head ("head"), B·H per layer ("layer"),
    B·L·H over all ("global"), +inf rows always kept, groups within their budget untouched."""
    g = torch.Generator().manual_seed(0)
    lengths = [[30, 5, 12], [20, 9, 40]]  # (layers, heads) rows
    scores = [[torch.rand(n, generator=g) for n in layer] for layer in lengths]
    scores[0][0][:3] = math.inf
    B = 10

    def top(values, k):
        flat = torch.cat(values)
        order = sorted(range(len(flat)), key=lambda i: (-float(flat[i]), i))
        chosen = set(order[:k])
        return torch.tensor([i in chosen for i in range(len(flat))])

    head = keep_within_budget(scores, B, "head")
    for li, layer in enumerate(scores):
        for h, s in enumerate(layer):
            assert torch.equal(head[li][h], top([s], min(B, len(s))))
    layer = keep_within_budget(scores, B, "layer")
    for li, ss in enumerate(scores):
        assert torch.equal(torch.cat(layer[li]), top(ss, min(B * 3, sum(map(len, ss)))))
    every = keep_within_budget(scores, B, "global")
    flat = [s for ss in scores for s in ss]
    assert torch.equal(torch.cat([m for ms in every for m in ms]), top(flat, B * 6))
    assert all(bool(m.all()) for ms in keep_within_budget(scores, 100, "global") for m in ms)


# -- the baselines at decode time, against the authors' code written out (Janghyun1230/FastKVzip:
# math/method/compression/snapkv.py, r1_kv.py, math/method/utils.py) on (1, H, T, d) tensors --

def authors_attention(q, k, w=8, kernel=7):
    """compute_attention_scores (max over the group) / √d, fp32 softmax of the last w queries over
    all but the last w keys, mean over queries, max_pool1d -> (H, T - w)."""
    _, Hq, _, d = q.shape
    H = k.shape[1]
    logits = (q.view(1, H, Hq // H, w, d) @ k.unsqueeze(2).transpose(3, 4)) / math.sqrt(d)
    logits = logits.max(dim=2).values  # (1, H, w, T)
    attn = torch.softmax(logits[:, :, -w:, :-w], dim=-1, dtype=torch.float32).mean(dim=-2)
    return F.max_pool1d(attn, kernel_size=kernel, padding=kernel // 2, stride=1)


def authors_redundancy(k, threshold=0.5):
    k = k[0]
    k_norm = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k_norm @ k_norm.transpose(-1, -2)
    for h in range(k.shape[0]):
        sim[h].fill_diagonal_(0.0)
    mask = sim > threshold
    idx = torch.where(mask, torch.arange(mask.size(-1)), torch.zeros_like(mask, dtype=torch.long))
    last = idx.max(dim=-1)[0]
    heads = torch.arange(k.shape[0]).unsqueeze(1).repeat(1, last.size(1))
    rows = torch.arange(last.size(1)).unsqueeze(0).repeat(k.shape[0], 1)
    sim[heads, rows, last] = 0
    return sim.mean(dim=1).softmax(dim=-1)


@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_decode_baselines_keep_the_authors_rows(method):
    """One layer of 3 KV heads × 2 query heads, 300 rows: our rescore gives the authors' scores
    (first 4 set to the max, the last 8 kept), and per-head top B keeps the authors' set: the last 8
    and the B − 8 best of the others (max-pooled scores tie: any of the tied rows may be kept)."""
    g = torch.Generator().manual_seed(7)
    H, G, T, d, w, B = 3, 2, 300, 16, 8, 100
    k = torch.randn(1, H, T, d, generator=g)
    k[:, :, 50:60] = k[:, :, 40:50] + 0.1 * torch.randn(1, H, 10, d, generator=g)  # redundancy
    q = torch.randn(1, H * G, w, d, generator=g)
    want = authors_attention(q, k)
    if method == "rkv":
        want = want * 0.1 - authors_redundancy(k)[:, :-w] * 0.9
    want[..., :4] = want.max()
    scorer = gate.SnapKVScorer() if method == "snapkv" else gate.RKVScorer()
    queries = q[0].view(H, G, w, d).permute(2, 0, 1, 3)  # (w, H, G, d), as the cache keeps them
    for h in range(H):
        s = scorer.rescore(0, k[0, h], queries[:, h])
        assert torch.allclose(s[4:T - w], want[0, h, 4:], atol=1e-6, rtol=1e-5)
        assert bool(s[T - w:].isinf().all())
        s[:4] = math.inf  # the cache protects the first 4 tokens itself
        got = keep_within_budget([[s]], B, "head")[0][0]
        assert int(got.sum()) == B and bool(got[:4].all()) and bool(got[T - w:].all())
        kept, dropped = want[0, h][got[:T - w]], want[0, h][~got[:T - w]]
        assert float(kept.min()) >= float(dropped.max())  # the top B − 8 of the authors' scores


def test_budgets_the_protected_rows_fill_are_refused(tiny):
    """A budget of no more than the rows decode-time eviction always keeps (system prompt or first
    4, and the window) leaves nothing to the scorer: DecodeBudgetError naming the smallest that
    does, for the gate (window 128) and a baseline (window 8)."""
    cfg = tiny.config
    gates = random_gate_scorer(cfg).gates
    for method, n_protected, least in [("fastkvzip", 29, 158), ("fastkvzip", 0, 133),
                                       ("streaming", 29, 38), ("snapkv", 2, 13)]:
        with pytest.raises(DecodeBudgetError, match=f"use at least {least}"):
            make_cache(method, tiny, n_protected, gates=gates, decode_tokens_per_head=least - 1)
        make_cache(method, tiny, n_protected, gates=gates, decode_tokens_per_head=least)
    with pytest.raises(ArgumentError, match="decode_tokens_per_head"):
        make_cache("random", tiny, 0, decode_tokens_per_head=200.5)
