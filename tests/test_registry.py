"""gate.METHODS, the one registry of scorers: a scorer is one class and one line there, and it runs
wherever a method runs. A throwaway scorer registered inside the test ("keep the oldest tokens",
whose kept rows are known exactly) goes through the chunked prefill, decode-time eviction and a
saved cache; the key-norm scorer (knorm) is checked against its literal formula, -||k||_2, and
its prefill and decode-time evictions keep the keys of smallest norm (comparing scores, never
orders of near-ties)."""
import inspect
import math
import re
from pathlib import Path

import pytest
import torch

import gate
import model as M
from cache import Budget, EvictingCache, decode_protected
from formats.cache_file import load_cache, read_header, save_cache
from generate import begin_answer, decode_one, make_cache, prefill, sample
from tests.helpers import tiny_checkpoint

N_CONTEXT, N_PROTECTED, QUESTION = 90, 6, [40, 41, 42, 43]
EXTRA = 16  # decode-time budget: the protected rows per head and this many more


class OldestScorer(gate.Scorer):
    """The throwaway: score = -position, so the oldest tokens are kept. Per head, and a decode
    window of its own (16, not the baselines' 8) to show that the cache reads it from the class."""
    level = "head"
    decode_window = 16

    def score(self, li, hidden, q, k, pos):
        return -pos.float().unsqueeze(0).expand(self._heads(k), -1).contiguous()


@pytest.fixture
def oldest(monkeypatch):
    monkeypatch.setitem(gate.METHODS, "oldest", OldestScorer)  # the one registration
    return "oldest"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), max_position_embeddings=1024)
    return M.load_model(folder, "cpu", torch.float32)


def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(40, 200, (N_PROTECTED + N_CONTEXT,), generator=g).tolist()


def held(cache):
    """{(layer, head): sorted positions} of the compressed layers."""
    return {(layer, h): sorted(cache.layers[layer].head_pos(h).tolist())
            for layer in cache.compressed for h in range(cache.layers[layer].n_heads)}


def decode_until_eviction(model, cache, logits):
    """Greedy decode steps until decode-time eviction runs -> (rows held just before that step,
    with the token it added, the keys they held {(layer, head): {pos: key}}, the logits after)."""
    first = cache.compressed[0]
    while True:
        before = held(cache)
        keys = {(layer, h): dict(zip(cache.layers[layer].head_pos(h).tolist(),
                                     cache.layers[layer].head_keys(h).clone()))
                for (layer, h) in before}
        n = cache.n_seen
        logits = decode_one(model, cache, sample(logits))
        if not cache.buffer[first]:  # scored and evicted at this step
            for layer, h in before:  # the token just added: its key as held now
                at = cache.layers[layer].head_pos(h).tolist().index(n)
                keys[(layer, h)][n] = cache.layers[layer].head_keys(h)[at].clone()
            return {k: sorted(v + [n]) for k, v in before.items()}, keys, logits


def prefilled(model, method, ratio, decode_extra=None):
    """make_cache(method), its chunked prefill of prompt() at `ratio`, the question begun."""
    window = (gate.METHODS[method] or gate.Scorer).window_at_decode(model.config)
    budget = None if decode_extra is None else decode_protected(N_PROTECTED, window) + decode_extra
    cache = make_cache(method, model, N_PROTECTED, decode_tokens_per_head=budget)
    with torch.no_grad():
        logits = prefill(model, cache, prompt(), N_PROTECTED, Budget(ratio))
    return cache, logits


# ---- a scorer added in one class and one registration ----------------------------------------

def test_a_registered_scorer_is_made_by_make_cache(tiny, oldest):
    cache = make_cache(oldest, tiny, N_PROTECTED, decode_tokens_per_head=64)
    assert isinstance(cache, EvictingCache) and type(cache.scorer) is OldestScorer
    assert cache.level == "head" and cache.decode_window == 16
    assert make_cache(oldest, tiny, 0, level="global").level == "global"  # a level asked for wins


def test_a_registered_scorer_evicts_at_prefill(tiny, oldest):
    """One prefill chunk at budget 0.3: in every head the evaluated segment keeps a prefix of
    itself (the oldest), the system prompt and the window stay whole."""
    cache, _ = prefilled(tiny, oldest, 0.3)
    n = cache.n_seen
    end = n - Budget(0.3).plan(N_CONTEXT).window  # the segment evaluated: [N_PROTECTED, end)
    for rows in held(cache).values():
        segment = [p for p in rows if N_PROTECTED <= p < end]
        assert rows == list(range(N_PROTECTED)) + segment + list(range(end, n))
        assert 0 < len(segment) < end - N_PROTECTED  # evicted, not emptied
        assert segment == list(range(N_PROTECTED, N_PROTECTED + len(segment)))


def test_a_registered_scorer_evicts_while_decoding(tiny, oldest):
    """Decode-time eviction keeps per head exactly B rows: the protected ones (the system prompt,
    the class's window of 16) and the oldest of the others."""
    cache, logits = prefilled(tiny, oldest, 1.0, EXTRA)
    with torch.no_grad():
        logits = begin_answer(tiny, cache, QUESTION, logits)
        before, _, _ = decode_until_eviction(tiny, cache, logits)
    recent = cache.n_seen - 16
    for key, rows in held(cache).items():
        assert len(rows) == cache.decode_tokens_per_head
        free = [p for p in before[key] if 4 <= p < recent and p >= N_PROTECTED]
        kept_free = [p for p in rows if p in free]
        assert [p for p in rows if p not in free] == [p for p in before[key] if p not in free]
        assert kept_free == free[:len(kept_free)] and len(kept_free) < len(free)


def test_a_registered_scorer_saves_and_loads(tiny, oldest, tmp_path):
    """Saved mid-answer (the decode buffer half full), loaded with the scorer make_cache gives:
    the file names the method and the class; both caches go on past an eviction alike."""
    path = tmp_path / "doc.kv"
    cache, logits = prefilled(tiny, oldest, 0.3, EXTRA)
    with torch.no_grad():
        logits = begin_answer(tiny, cache, QUESTION, logits)
        for _ in range(60):
            logits = decode_one(tiny, cache, sample(logits))
    save_cache(path, cache, tiny, prompt(), logits)  # no method given: read from the registry
    state = read_header(path)[1]
    assert (state["method"], state["scorer"]) == ("oldest", "OldestScorer")
    scorer = make_cache(oldest, tiny, N_PROTECTED, decode_tokens_per_head=64).scorer
    loaded, info = load_cache(path, tiny, scorer)
    assert info["method"] == "oldest" and held(loaded) == held(cache)
    a, b = logits, info["last_logits"]
    with torch.no_grad():
        for _ in range(100):  # past the 128th buffered token: both evict
            assert sample(a) == sample(b)
            a, b = decode_one(tiny, cache, sample(a)), decode_one(tiny, loaded, sample(b))
    assert torch.equal(a, b) and held(loaded) == held(cache)


# ---- knorm: -||k||_2 per KV head (Devoto et al. 2024; NVIDIA/kvpress's KnormPress) ------------

def test_knorm_is_in_the_registry_per_head():
    kind = gate.METHODS["knorm"]
    assert kind is gate.KnormScorer and kind.level == "head" and kind.decode_window == 8
    assert kind.prefill and kind.decode


def test_knorm_scores_are_minus_the_key_norm():
    """The literal formula, element by element: score[h, t] = -sqrt(sum_i k[t, h, i]^2)."""
    g = torch.Generator().manual_seed(0)
    T, H, G, d = 7, 3, 2, 16
    q, k = torch.randn(T, H * G, d, generator=g), torch.randn(T, H, d, generator=g) * 3
    got = gate.KnormScorer().score(0, torch.randn(T, 32, generator=g), q, k, torch.arange(T))
    want = [[-math.sqrt(sum(x * x for x in k[t, h].tolist())) for t in range(T)] for h in range(H)]
    assert got.shape == (H, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-5)
    rescored = gate.KnormScorer().rescore(0, k[:, 1], q[-4:].view(4, H, G, d)[:, 1])
    torch.testing.assert_close(rescored, torch.tensor(want[1]), rtol=1e-6, atol=1e-5)


def norm_score(key):
    return -math.sqrt(sum(x * x for x in key.tolist()))


def test_knorm_prefill_keeps_the_smallest_norms(tiny):
    """One chunk at budget 0.3: in each head, every evicted key of the evaluated segment has a
    norm at least that of every kept one (the keys read from a full cache of the same prompt)."""
    full = make_cache("full", tiny, N_PROTECTED)
    with torch.no_grad():
        prefill(tiny, full, prompt(), N_PROTECTED)
    cache, _ = prefilled(tiny, "knorm", 0.3)
    end = cache.n_seen - Budget(0.3).plan(N_CONTEXT).window
    for (layer, h), rows in held(cache).items():
        kv = full.layers[layer]
        score = dict(zip(kv.head_pos(h).tolist(), map(norm_score, kv.head_keys(h))))
        segment = range(N_PROTECTED, end)
        kept = [score[p] for p in segment if p in rows]
        gone = [score[p] for p in segment if p not in rows]
        assert kept and gone and set(rows) >= set(range(N_PROTECTED)) | set(range(end, full.n_seen))
        assert min(kept) >= max(gone) - 1e-5


def test_knorm_evicts_the_largest_norms_while_decoding(tiny):
    cache, logits = prefilled(tiny, "knorm", 1.0, EXTRA)
    with torch.no_grad():
        logits = begin_answer(tiny, cache, QUESTION, logits)
        before, keys, _ = decode_until_eviction(tiny, cache, logits)
    recent = cache.n_seen - 8
    for key, rows in held(cache).items():
        assert len(rows) == cache.decode_tokens_per_head
        free = [p for p in before[key] if max(N_PROTECTED, 4) <= p < recent]
        assert set(before[key]) - set(free) <= set(rows)  # the protected rows stay
        kept = [norm_score(keys[key][p]) for p in free if p in rows]
        gone = [norm_score(keys[key][p]) for p in free if p not in rows]
        assert kept and gone and min(kept) >= max(gone) - 1e-5


def test_the_usage_page_shows_the_knorm_class_as_it_is():
    """docs/usage.md's "Add a scorer" shows gate.KnormScorer whole: the code, not a copy that
    drifts."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("## Add a scorer", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert snippet.strip() == inspect.getsource(gate.KnormScorer).strip()
    assert '"knorm": KnormScorer,' in inspect.getsource(gate)
