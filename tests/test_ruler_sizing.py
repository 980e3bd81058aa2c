"""harness/ruler.py's RULER sizing: samples sized as NVIDIA/RULER@e40fae1 sized kvpress's RULER
files (Llama-3.1-8B tokens, fixed haystack steps, a first draw then a step back, fwe without a
reservation, vt's example made once), the text split as kvpress splits it, and the sizing part of
what names and keys a run."""
import re

import pytest

from harness import quality, ruler, ruler_tasks
from tests.assets import require_asset


@pytest.fixture(autouse=True)
def assets():
    require_asset("austen")
    require_asset("tokenizers", "llama3_1", "tokenizer.json")


@pytest.fixture
def fresh():
    """Sizes and vt's example found again, and forgotten after (a test may change the rules)."""
    ruler_tasks.haystack_size.cache_clear(), ruler_tasks.vt_example.cache_clear()
    yield
    ruler_tasks.haystack_size.cache_clear(), ruler_tasks.vt_example.cache_clear()


def model_tok(name):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(require_asset("tokenizers", name, "tokenizer.json")))


def text(r):
    return r["context"] + r["question"] + r["answer_prefix"]


def test_counted_in_llama_tokens_for_every_model():
    """The sample is the same whatever the model's tokenizer, and its length is RULER's: the input's
    Llama-3.1 tokens (no special ones) plus the generation length, within the target."""
    tok = ruler_tasks.llama_tokenizer()
    assert tok.get_vocab_size() == 128256  # Llama 3's vocabulary
    assert ruler_tasks.ruler_count("Hello world") == len(tok.encode("Hello world").ids) - 1  # no BOS
    for task in ("niah_single_1", "niah_multikey_1", "cwe"):
        rows = [ruler_tasks.make_sample(t, task, 4096, 5, 1) for t in
                (None, model_tok("qwen3"), model_tok("gemma3"))]
        assert rows[0] == rows[1] == rows[2]
        r = rows[0]
        assert r["length"] == ruler_tasks.ruler_count(text(r)) + r["max_new_tokens"] <= 4096


@pytest.mark.parametrize("target", [4096, 2048])
def test_haystacks_move_by_rulers_fixed_steps(target):
    """Every sample's haystack is the run's first-draw size, or that less whole steps: essay 500
    words, noise and needle lines 25 (5 below 4K), vt 10 lines, cwe 10 words, fwe target // 32
    coded words from target // 6. The haystack is what the text holds."""
    for task in ruler_tasks.TASKS:
        first, step = ruler_tasks.steps(task, target)
        size = ruler_tasks.haystack_size(task, target, 1)
        assert (size - first) % step == 0 and size >= first
        r = ruler_tasks.make_sample(None, task, target, 1, 0)
        assert r["haystack"] <= size and (size - r["haystack"]) % step == 0, task
        body = r["context"].split("\n\n\n\n")[-1]  # vt: after its example
        if task == "niah_single_1":
            assert body.count(ruler_tasks.NOISE) == r["haystack"]
        if task == "vt":
            assert body.count("again.\n") == r["haystack"]
        if task == "cwe":
            items = re.findall(r"\d+\. (\S+)", body.split(ruler_tasks.CWE_HEAD)[-1])
            assert len(set(items)) == r["haystack"]
    assert ruler_tasks.steps("niah_single_2", 4096) == (500, 500)
    assert ruler_tasks.steps("niah_single_1", 4096) == ruler_tasks.steps("niah_multikey_2", 4096) == (25, 25)
    assert ruler_tasks.steps("niah_single_1", 2048) == (5, 5)
    assert ruler_tasks.steps("vt", 4096) == ruler_tasks.steps("cwe", 4096) == (10, 10)
    assert ruler_tasks.steps("fwe", 4096) == (4096 // 6, 4096 // 32)


def test_grow_then_step_back_and_shrink():
    """RULER's rules on a text whose every haystack item is 10 tokens: grow by steps until the text
    with the reserved tokens exceeds the target, then one back; a sample too long shrinks by
    steps; a sample too long at the smallest step is an error."""
    count = len
    size = ruler_tasks.grow(lambda n: "x" * 10 * n, count, 1000, 25, 128)
    assert 10 * size + 128 <= 1000 < 10 * (size + 25) + 128 and size % 25 == 0
    draws = []

    def draw(n):
        draws.append(n)
        return "x" * 10 * n, ["answer"]
    text, answer, length, n = ruler_tasks.shrink(draw, count, 800, 100, 25, 128, "test")
    assert draws == [100, 75, 50] and n == 50 and length == 500 + 128
    with pytest.raises(ValueError, match="too few"):
        ruler_tasks.shrink(draw, count, 100, 100, 25, 128, "test")


def test_vt_example_once_per_run_with_its_line_breaks():
    """vt's solved example: one for all samples of a run, before each, joined as RULER joins it
    (' ' + example + ' ' + answer + 4 line breaks); its noise lines kept, whole steps of 5, sized
    to 500 tokens with vt's generation; its template's last word ("above.") dropped."""
    rows = [ruler_tasks.make_sample(None, "vt", 4096, 9, i) for i in range(3)]
    example = ruler_tasks.vt_example(9)
    assert example.endswith("\n\n") and example != ruler_tasks.vt_example(10)
    for r in rows:
        assert r["context"].startswith(" " + example + "\n\n" + ruler_tasks.VT_HEAD)
        # RULER's length: the input's tokens, vt's generation and the example's tokens
        main = text(r)[len(" " + example + "\n\n"):]
        assert r["length"] == ruler_tasks.ruler_count(main) + 30 + ruler_tasks.ruler_count(example)
    lines = example.count("again.\n")
    assert lines > 0 and lines % 5 == 0
    head, names = example[:-2].split(":  ")  # the prefix's space, then the answer's
    assert len(names.split(" ")) == 5 and "in the text Answer: According" in head
    assert ruler_tasks.ruler_count(head + ": ") + ruler_tasks.MAX_NEW["vt"] <= 500


def test_fwe_reserves_nothing_for_its_generation(fresh, monkeypatch):
    """fwe's input alone fills the target (RULER's freq_words_extraction): its generation length
    changes nothing in its size; cwe's does."""
    fwe, cwe = (ruler_tasks.make_sample(None, t, 4096, 2, 0) for t in ("fwe", "cwe"))
    assert ruler_tasks.ruler_count(text(fwe)) <= 4096
    assert fwe["length"] == ruler_tasks.ruler_count(text(fwe)) + ruler_tasks.MAX_NEW["fwe"]
    ruler_tasks.haystack_size.cache_clear()
    monkeypatch.setitem(ruler_tasks.MAX_NEW, "fwe", 3000)
    monkeypatch.setitem(ruler_tasks.MAX_NEW, "cwe", 620)
    assert ruler_tasks.make_sample(None, "fwe", 4096, 2, 0)["haystack"] == fwe["haystack"]
    assert ruler_tasks.make_sample(None, "cwe", 4096, 2, 0)["haystack"] < cwe["haystack"]


def test_determined_by_task_seed_and_index(fresh):
    """A sample depends on (task, target, seed, index) only: not on the run's size, the samples
    made before it, or the cached sizes."""
    tasks = ["niah_multikey_2", "vt", "fwe"]
    rows = ruler.load_rows(None, None, [2048], 2, 4, tasks)
    assert [ruler.sample_at(None, [2048], 5, 4, tasks, c) for c in range(6)] == rows
    ruler_tasks.haystack_size.cache_clear(), ruler_tasks.vt_example.cache_clear()
    assert ruler_tasks.make_sample(None, "vt", 2048, 4, 1) == rows[4]
    assert ruler_tasks.make_sample(None, "vt", 2048, 4, 0)["context"] != rows[4]["context"]


def test_split_as_kvpress_splits_rulers_text():
    """context + question + answer prefix is RULER's text; the cut is kvpress's: before the last
    question, then before the answer prefix's first word (the space stays with the question)."""
    for task in ruler_tasks.TASKS:
        r = ruler_tasks.make_sample(None, task, 2048, 3, 0)
        assert ruler_tasks.to_row(task, text(r), r["answer"]) == {k: r[k] for k in ruler.COLUMNS}
        assert r["question"].endswith(". " if task == "vt" else "? ")
        assert r["answer_prefix"].startswith("The special magic" if task.startswith("niah")
                                             else "Answer:")
    cwe = ruler_tasks.make_sample(None, "cwe", 4096, 3, 0)
    assert "are:1. " in cwe["context"]  # the example's answer follows its prefix directly


def test_sizing_names_and_keys_the_run():
    assert ruler_tasks.suite_name(4096, ruler_tasks.TASKS) == "RULER-4K, 11 tasks"
    assert ruler_tasks.suite_name(4096, ruler_tasks.TASKS, "model") == "RULER-4K (model-token sizing), 11 tasks"
    exp = dict(methods=["full"], budgets=[1.0], extra_levels=[], lengths=[4096], contexts=1,
               passkeys=0, kv_pairs=0, kv_questions=0, probe_tokens=0, continue_tokens=0,
               chunk_size=512, window=0, seed=0, suite="ruler", ruler_tasks=("vt",))
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    keys = [ruler.run_key(quality.Experiment(**exp, ruler_sizing=s), config) for s in ruler_tasks.SIZINGS]
    assert keys[0] != keys[1] and keys[0]["ruler_sizing"] == "ruler"
    import bench
    assert bench.parse_args(["--suite", "ruler"]).ruler_sizing == "ruler"
    assert bench.experiment(bench.parse_args(["--suite", "ruler", "--ruler-sizing", "model"])) \
        .ruler_sizing == "model"


def test_fwe_budget_is_rulers_first_draw_whatever_the_seed(fresh):
    """RULER draws fwe's coded-word budget once, from the first vocabulary of its global `random`
    seeded 42 (RULER@e40fae1: scripts/data/synthetic/freq_words_extraction.py, sys_kwext), and
    every sample of kvpress's RULER-4K file holds that budget: 2,218 coded words. It was redrawn
    from the run's seed (2,090 at seed 0, 1,962 at 42). A run key records the budget, so that a
    folder of the older fwe samples is never resumed or merged with the new ones."""
    assert {ruler_tasks.haystack_size("fwe", 4096, s) for s in (0, 3, 42)} == {2218}
    assert ruler_tasks.make_sample(None, "fwe", 4096, 0, 0)["haystack"] <= 2218
    exp = dict(methods=["full"], budgets=[1.0], extra_levels=[], lengths=[4096], contexts=1,
               passkeys=0, kv_pairs=0, kv_questions=0, probe_tokens=0, continue_tokens=0,
               chunk_size=512, window=0, seed=0, suite="ruler")
    config = dict(model=dict(sha256="m"), gate=dict(sha256="g"))
    key = lambda tasks, sizing="ruler": ruler.run_key(quality.Experiment(
        **exp, ruler_tasks=tasks, ruler_sizing=sizing), config)
    assert key(("vt", "fwe"))["fwe_budget"] == "RULER's first draw, seed 42"
    # fwe's samples of the model's sizing, and runs without fwe, are what they were: resumable
    assert "fwe_budget" not in key(("vt", "fwe"), "model") and "fwe_budget" not in key(("vt",))
