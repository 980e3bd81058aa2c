"""harness/ruler.py answers every cache of a context in one batched decode (ruler.answer): each
cache's greedy answers and scores are the ones it gets alone (ruler.answer_alone, the oracle),
members stopping at different steps (a stop id, the question's length, every expected string in the
text), over several questions; and a whole run gives the same records either way. Tiny random
models, as tests/test_batch.py."""
import json

import pytest
import torch

import model as M
from formats.gate_file import save_gate
from gate import Gates, KVzipScorer
from generate import make_cache
from harness import quality as Q
from harness import ruler
from harness.kvpress_prompt import kvpress_format
from prompts import prompt_format
from teacher import KVzipTeacher
from tests.helpers import tiny_checkpoint, tiny_tokenizer

CHUNK, WINDOW = 1024, 16  # one prefill chunk: every cache is the captured prefill, replayed
# (method, budget): caches that evict differently, a kvzip at two budgets, the full cache
CONFIGS = [("full", 1.0), ("fastkvzip", 0.4), ("streaming", 0.3), ("snapkv", 0.3), ("kvzip", 0.5),
           ("kvzip", 0.2)]


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request, tmp_path_factory):
    """A tiny Gemma3 (sliding layers) and a tiny Llama (every layer compressed), a byte tokenizer,
    a random gate (saved too, for bench's runs)."""
    folder = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                             max_position_embeddings=1024)
    tiny_tokenizer(folder)
    model = M.load_model(folder, "cpu", torch.float32)
    cfg = model.config
    torch.manual_seed(0)
    gates = Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                  cfg.group_size)
    save_gate(folder / "gate.safetensors", gates, {"note": "random, tests only"})
    fmt = prompt_format(cfg, str(folder), chat=True)
    return model, M.load_tokenizer(folder), fmt, gates, folder


def make_sample(n_context=150):
    """A context of random bytes and two questions of different lengths (vt: string_match_all;
    qa_1: string_match_part); expected strings that nothing says, until a test sets them."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(40, 200, (6,), generator=g).tolist()
    ids = system + torch.randint(40, 200, (n_context,), generator=g).tolist()
    questions = [Q.Question("vt", torch.randint(40, 200, (4,), generator=g).tolist(), "", 12),
                 Q.Question("qa_1", torch.randint(40, 200, (6,), generator=g).tolist(), "", 7)]
    sample = Q.Sample(ids, len(system), questions, {}, "random")
    sample.answers = [["\x7fnever"], ["\x7fnever"]]
    return sample


def make_caches(tiny, sample):
    """One fresh cache per CONFIGS entry, each filled from one captured prefill as ruler.run fills
    them."""
    model, tok, fmt, gates, _ = tiny
    teacher = KVzipTeacher(model, tok, fmt)
    with torch.no_grad():
        full, logits, tscores = Q.capture_prefill(model, sample.ids, CHUNK, teacher,
                                                  sample.n_protected)
        caches = {}
        for method, budget in CONFIGS:
            if method == "full":
                caches[(method, budget)] = full
                continue
            cache = make_cache(method, model, sample.n_protected, gates=gates)
            if method == "kvzip":
                cache.scorer = KVzipScorer(tscores)
            Q.prefill_from_capture(model, full, logits, cache, method, sample, budget, CHUNK,
                                   WINDOW)
            assert min(cache.kept_fraction_per_layer(sample.n_protected, len(sample.ids))) < 1
            caches[(method, budget)] = cache
    return caches


def alone(tiny, sample, stop_ids):
    model, tok = tiny[:2]
    with torch.no_grad():
        return {k: ruler.answer_alone(model, tok, c, sample, stop_ids)
                for k, c in make_caches(tiny, sample).items()}


def test_batched_answers_equal_alone(tiny):
    """Six caches answer two questions together; the expected strings and a stop id are chosen from
    the answers given alone so that members end at different steps: the full cache once its text
    holds the expected string, streaming at the stop id, the others at the question's length."""
    model, tok = tiny[:2]
    sample = make_sample()
    free = alone(tiny, sample, set())  # nothing stops them but max_new
    assert all(len(o) == q.max_new for r in free.values()
               for o, q in zip(r["outputs"], sample.questions))
    # the full cache's first 5 tokens (2 of question 1), as text: it ends there, and so does any
    # cache that writes the same; snapkv's second token of question 1 is a stop id
    full_out = free[("full", 1.0)]["outputs"]
    expected = [ruler.clean(tok.decode(full_out[0][:5])), ruler.clean(tok.decode(full_out[1][:2]))]
    assert all(expected), "pick other tokens: these decode to nothing once cleaned"
    sample.answers = [[expected[0]], ["\x7fnever", expected[1]]]
    stop = free[("snapkv", 0.3)]["outputs"][1][1]
    ref = alone(tiny, sample, {stop})
    with torch.no_grad():
        caches = make_caches(tiny, sample)
        got = ruler.answer(model, tok, caches, sample, {stop})
    assert not caches, "answer takes the caches over"
    assert list(got) == list(ref)
    for k in ref:
        assert got[k]["outputs"] == ref[k]["outputs"], f"{k}: answers differ"
        assert got[k]["scores"] == ref[k]["scores"], f"{k}: scores differ"
        assert got[k]["decode"][0] >= sum(max(0, len(o) - 1) for o in got[k]["outputs"])
    lengths = [[len(o) for o in r["outputs"]] for r in ref.values()]
    assert len({n for ns in lengths for n in ns}) > 2, f"members end at the same steps: {lengths}"
    assert ref[("full", 1.0)]["scores"] == [1.0, 1.0] and lengths[0][0] <= 5
    assert lengths[CONFIGS.index(("snapkv", 0.3))][1] <= 1


def test_one_cache_alone_and_one_question(tiny):
    """A batch of one decodes on the cache itself (generate.decode with batch size 1)."""
    model, tok = tiny[:2]
    sample = make_sample(60)
    sample.questions, sample.answers = sample.questions[:1], sample.answers[:1]
    ref = alone(tiny, sample, set())[("snapkv", 0.3)]
    with torch.no_grad():
        cache = make_caches(tiny, sample)[("snapkv", 0.3)]
        got = ruler.answer(model, tok, {"snapkv": cache}, sample, set())["snapkv"]
    assert got["outputs"] == ref["outputs"] and got["scores"] == ref["scores"]


def test_run_records_equal_either_way(tiny, tmp_path):
    """ruler.run on a file of two contexts (one with two questions), batched and one by one: the
    same records (scores, kept fractions, bytes, the full cache's answers), but decode time; budget
    1.0 evicts nothing and takes the full cache's answers."""
    model, tok, fmt, _, folder = tiny
    rows = [dict(context="Note: the door code is 4711. " * 6, question="What is the door code?",
                 answer_prefix=" The door code is", answer=["4711"], max_new_tokens=6,
                 task="code"),
            dict(context="Note: the door code is 4711. " * 6, question="Weather?",
                 answer_prefix=" It was", answer=["fine"], max_new_tokens=4, task="weather"),
            dict(context="The river is called Wend. It runs north. " * 4,
                 question="Name the river.", answer_prefix=" It is", answer=["Wend"],
                 max_new_tokens=5, task="code")]
    path = tmp_path / "tiny.jsonl"
    ruler.write_dataset(rows, path)
    exp = Q.Experiment(methods=["full", "fastkvzip", "kvzip", "streaming"], budgets=[1.0, 0.4],
                       extra_levels=[], lengths=[], contexts=0, passkeys=0, kv_pairs=0,
                       kv_questions=0, probe_tokens=0, continue_tokens=0, chunk_size=CHUNK,
                       window=WINDOW, seed=0, suite="ruler", dataset=str(path))
    fmt = kvpress_format(model.config, "tiny", chat=True)  # the default for RULER rows
    records = {}
    for batched in (True, False):
        got = []
        ruler.run(model, tok, fmt, exp, "tiny", str(folder / "gate.safetensors"),
                  on_context=got.append, batched=batched)
        for r in got:
            r.pop("seconds")
            for e in r["entries"].values():
                e.pop("decode")
        records[batched] = got
    assert len(records[True]) == 2 and [len(r["answers"]) for r in records[True]] == [2, 1]
    assert json.dumps(records[True]) == json.dumps(records[False])
    methods = ("fastkvzip", "kvzip", "streaming")
    keys = {Q.entry_key("full", 1.0)} | {Q.entry_key(m, b) for m in methods for b in (1.0, 0.4)}
    assert all(set(r["entries"]) == keys for r in records[True])
    for r in records[True]:  # nothing evicted at 1.0 here: the full cache's answers stand
        e, full = (r["entries"][Q.entry_key(m, 1.0)] for m in ("streaming", "full"))
        assert min(e["kept"]) == 1.0 and e["scores"] == full["scores"]


def test_run_only_some_tasks_then_the_rest_equals_one_run(tiny, monkeypatch):
    """ruler.run(only=...) runs just those tasks' contexts of a generated run (context c is task
    c % len(tasks)); a later run given them as done runs the others; together they are the records
    of one run of all contexts. The samples are stand-ins for RULER's (ruler.contexts replaced)."""
    model, tok, _, _, folder = tiny
    fmt = kvpress_format(model.config, "tiny", chat=True)
    tasks = ["a", "b", "c"]
    rows = [dict(context=f"Note {c}: the door code is {4700 + c}. " * 5, question="The code?",
                 answer_prefix=" It is", answer=[str(4700 + c)], max_new_tokens=4,
                 task=tasks[c % 3]) for c in range(7)]
    monkeypatch.setattr(ruler, "contexts", lambda *a: (len(rows), lambda c: ruler.to_samples(
        tok, fmt, [rows[c]])[0]))
    exp = Q.Experiment(methods=["full", "streaming"], budgets=[0.4], extra_levels=[], lengths=[4096],
                       contexts=0, passkeys=0, kv_pairs=0, kv_questions=0, probe_tokens=0,
                       continue_tokens=0, chunk_size=CHUNK, window=WINDOW, seed=0, suite="ruler",
                       ruler_tasks=tasks)

    def run(**kw):
        got = []
        ruler.run(model, tok, fmt, exp, "tiny", str(folder / "gate.safetensors"),
                  on_context=got.append, **kw)
        for r in got:
            r.pop("seconds")
            for e in r["entries"].values():
                e.pop("decode")
        return {r["context"]: r for r in got}
    only = run(only={"b"})
    assert sorted(only) == [1, 4]
    rest = run(done=set(only))
    assert sorted(rest) == [0, 2, 3, 5, 6]
    assert sorted(run(shard=(0, 2), only={"a", "c"})) == [0, 2, 6]
    whole = run()
    assert json.dumps({**only, **rest}, sort_keys=True) == json.dumps(whole, sort_keys=True)
