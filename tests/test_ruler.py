"""harness/ruler.py: RULER's tasks generated offline (answers where they claim, lengths in the real
tokenizers' tokens, seeded), kvpress's string_match, kvpress's dataset layout written and read
back."""
import re
from collections import Counter

import pytest

from harness import ruler
from tools import fetch_assets


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def tok(request):
    from tokenizers import Tokenizer
    fetch_assets.require_for_test("austen")
    path = fetch_assets.require_for_test("tokenizers", request.param, "tokenizer.json")
    return Tokenizer.from_file(str(path))


NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


def check_answers(row):
    """The answer is what the context says, found by reading it (an oracle per task family)."""
    task, ctx, answer = row["task"], row["context"], row["answer"]
    if task.startswith("niah"):
        haystack, _, v_type, n_keys, n_values, n_queries = ruler.NIAH[task]
        pairs = NEEDLE.findall(ctx)
        assert {t for t, _, _ in pairs} == {v_type}
        values = {}
        for _, k, v in pairs:
            values.setdefault(k, []).append(v)
        queried = [k for k in values if k in row["question"] and k in row["answer_prefix"]]
        assert len(queried) == n_queries
        assert all(len(values[k]) == n_values for k in queried)
        assert sorted(answer) == sorted(v for k in queried for v in values[k])
        distractors = len(pairs) - max(n_keys, n_queries) * n_values
        assert distractors > 10 if haystack == "needle" else distractors == 0
        if haystack == "repeat":
            assert ctx.count(ruler.NOISE) > 30
    elif task == "vt":
        body = ctx.split("\n\n" + ruler.VT_HEAD)[-1]  # after the solved example
        value = re.search(r"assigned the value (\d+)", row["question"]).group(1)
        assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", body))
        resolve = lambda x: resolve(assign[x[4:]]) if x.startswith("VAR ") else x
        assert sorted(answer) == sorted(k for k in assign if resolve(assign[k]) == value)
        assert len(answer) == 5
        assert body.count(ruler.NOISE) > 30
    elif task == "cwe":
        items = re.findall(r"\d+\. (\S+)", ctx.split(ruler.CWE_HEAD)[-1])
        counts = Counter(items).most_common()
        assert sorted(answer) == sorted(w for w, _ in counts[:10]) and counts[9][1] > counts[10][1]
    elif task == "fwe":
        counts = Counter(ctx.split("coded words. ")[-1].split()).most_common()
        assert counts[0][0] == "..." and [w for w, _ in counts[1:4]] == answer
        assert counts[3][1] > counts[4][1]


@pytest.mark.parametrize("target", [4096, 1500])
def test_every_task_holds_its_answers_and_fills_the_target(tok, target):
    rows = ruler.make_samples(tok, target, 2, seed=3)
    assert [r["task"] for r in rows] == [t for t in ruler.TASKS for _ in range(2)]
    for r in rows:
        check_answers(r)
        assert r["max_new_tokens"] == ruler.MAX_NEW[ruler.family(r["task"])]
        assert r["length"] == ruler.n_tokens(tok, r)
        assert 0.95 * target <= r["length"] <= target, (r["task"], r["length"])


def test_suite_name():
    assert ruler.suite_name(4096, ruler.TASKS) == "RULER-4K, 11 tasks"
    assert ruler.suite_name(1500, ["vt"]) == "RULER-1500, 1 task"


def test_singular_and_plural_wording():
    one = ruler.make_row("niah_single_3", 0, 0, 50, 4096)
    many = ruler.make_row("niah_multivalue", 0, 0, 50, 4096)
    assert one["context"].startswith("A special magic uuid is hidden")
    assert one["question"].startswith("What is the special magic uuid for")
    assert one["answer_prefix"].endswith("provided text is")
    assert many["context"].startswith("Some special magic numbers are hidden") and \
        many["answer_prefix"].endswith("provided text are") and len(many["answer"]) == 4
    q = ruler.make_row("niah_multiquery", 0, 0, 50, 4096)["question"]
    assert q.count(", ") == 3 and ", and " in q


def test_seeded():
    from tokenizers import Tokenizer
    path = fetch_assets.require_for_test("tokenizers", "gemma3", "tokenizer.json")
    fetch_assets.require_for_test("austen")
    tok = Tokenizer.from_file(str(path))
    a = ruler.make_samples(tok, 1024, 2, seed=7)
    assert a == ruler.make_samples(tok, 1024, 2, seed=7)
    b = ruler.make_samples(tok, 1024, 2, seed=8)
    assert all(x["context"] != y["context"] for x, y in zip(a, b))
    assert a[1] == ruler.make_sample(tok, a[1]["task"], 1024, seed=7, index=1)  # alone, as a shard
    assert a[0]["context"] != a[1]["context"]


def test_string_match_as_kvpress():
    assert ruler.match_all("The numbers are 12 and 34.", ["12", "34", "56"]) == pytest.approx(2 / 3)
    assert ruler.match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert ruler.match_all("12\n34", ["1234"]) == 1.0  # control characters removed, as kvpress does
    assert ruler.match_part("only 56 here", ["12", "56"]) == 1.0
    assert ruler.match_part("none", ["12"]) == 0.0
    preds, refs = ["12 and 34", "12"], [["12", "34"], ["12", "34"]]
    assert ruler.string_match("niah_multivalue", preds, refs) == 75.0  # all: (1 + 0.5) / 2
    assert ruler.string_match("qa_1", preds, refs) == 100.0  # part: any
    assert ruler.string_match("vt", ["a b c"], [["A", "B", "D"]]) == 66.67


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_kvpress_layout_round_trip(tmp_path, suffix):
    rows = [ruler.make_row(t, 0, i, 20, 4096) for t in ruler.TASKS for i in range(2)]
    path = tmp_path / f"ruler{suffix}"
    ruler.write_dataset(rows, path)
    assert ruler.read_dataset(path) == rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        assert pq.read_table(path).column_names == list(ruler.COLUMNS)


def test_kvpress_layout_variants_and_errors(tmp_path):
    import json
    path = tmp_path / "longbench.jsonl"
    rows = [dict(context="c", question="q", answers=["x", "y"], max_new_tokens=5, task="t", _id=1),
            dict(context="c", question="q2", answer_prefix=None, answer="z", max_new_tokens=5,
                 task="t")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = ruler.read_dataset(path)
    assert [g["answer"] for g in got] == [["x", "y"], ["z"]]
    assert [g["answer_prefix"] for g in got] == ["", ""]
    path.write_text(json.dumps(dict(context="c", answer=["x"], task="t")) + "\n")
    with pytest.raises(ValueError, match="row 0 lacks question, max_new_tokens"):
        ruler.read_dataset(path)
