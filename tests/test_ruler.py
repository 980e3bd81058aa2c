"""harness/ruler.py: RULER's tasks generated offline (answers where they claim, lengths in the real
tokenizers' tokens, seeded), kvpress's string_match, kvpress's dataset layout written and read
back."""
import json
import re
from collections import Counter

import pytest

from cli import UsageError
from harness import ruler, ruler_tasks
from tests.assets import require_asset


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def tok(request):
    from tokenizers import Tokenizer
    require_asset("austen")
    path = require_asset("tokenizers", request.param, "tokenizer.json")
    return Tokenizer.from_file(str(path))


NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


def check_answers(row):
    """The answer is what the context says, found by reading it (an oracle per task family)."""
    task, ctx, answer = row["task"], row["context"], row["answer"]
    if task.startswith("niah"):
        haystack, _, v_type, n_keys, n_values, n_queries = ruler_tasks.NIAH[task]
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
            assert ctx.count(ruler_tasks.NOISE) > 30
    elif task == "vt":
        body = ctx.split("\n\n" + ruler_tasks.VT_HEAD)[-1]  # after the solved example
        value = re.search(r"assigned the value (\d+)", row["question"]).group(1)
        assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", body))
        resolve = lambda x: resolve(assign[x[4:]]) if x.startswith("VAR ") else x
        assert sorted(answer) == sorted(k for k in assign if resolve(assign[k]) == value)
        assert len(answer) == 5
        assert body.count(ruler_tasks.NOISE) > 30
    elif task == "cwe":
        items = re.findall(r"\d+\. (\S+)", ctx.split(ruler_tasks.CWE_HEAD)[-1])
        counts = Counter(items).most_common()
        assert sorted(answer) == sorted(w for w, _ in counts[:10]) and counts[9][1] > counts[10][1]
    elif task == "fwe":
        counts = Counter(ctx.split("coded words. ")[-1].split()).most_common()
        assert counts[0][0] == "..." and [w for w, _ in counts[1:4]] == answer
        assert counts[3][1] > counts[4][1]


@pytest.mark.parametrize("target", [4096, 1500])
def test_every_task_holds_its_answers_and_fills_the_target(tok, target):
    rows = ruler_tasks.make_samples(tok, target, 2, seed=3, sizing="model")
    assert [r["task"] for r in rows] == list(ruler_tasks.TASKS) * 2
    for r in rows:
        check_answers(r)
        assert r["max_new_tokens"] == ruler_tasks.MAX_NEW[ruler_tasks.family(r["task"])]
        assert r["length"] == ruler_tasks.n_tokens(tok, r)
        assert 0.95 * target <= r["length"] <= target, (r["task"], r["length"])


def test_suite_name():
    assert ruler_tasks.suite_name(4096, ruler_tasks.TASKS) == "RULER-4K, 11 tasks"
    assert ruler_tasks.suite_name(1500, ["vt"]) == "RULER-1500, 1 task"


def test_singular_and_plural_wording():
    one = ruler_tasks.make_row("niah_single_3", 0, 0, 50, 4096)
    many = ruler_tasks.make_row("niah_multivalue", 0, 0, 50, 4096)
    assert one["context"].startswith("A special magic uuid is hidden")
    assert one["question"].startswith("What is the special magic uuid for")
    assert one["answer_prefix"].endswith("provided text is")
    assert many["context"].startswith("Some special magic numbers are hidden") and \
        many["answer_prefix"].endswith("provided text are") and len(many["answer"]) == 4
    q = ruler_tasks.make_row("niah_multiquery", 0, 0, 50, 4096)["question"]
    assert q.count(", ") == 3 and ", and " in q


def test_seeded():
    from tokenizers import Tokenizer
    path = require_asset("tokenizers", "gemma3", "tokenizer.json")
    require_asset("austen")
    tok = Tokenizer.from_file(str(path))
    a = ruler_tasks.make_samples(tok, 1024, 2, seed=7, sizing="model")
    assert a == ruler_tasks.make_samples(tok, 1024, 2, seed=7, sizing="model")
    b = ruler_tasks.make_samples(tok, 1024, 2, seed=8, sizing="model")
    assert all(x["context"] != y["context"] for x, y in zip(a, b))
    one = a[len(ruler_tasks.TASKS) + 1]  # sample 1 of the second task: made alone, as a shard makes it
    assert one == ruler_tasks.make_sample(tok, ruler_tasks.TASKS[1], 1024, seed=7, index=1, sizing="model")
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
    rows = [ruler_tasks.make_row(t, 0, i, 20, 4096) for t in ruler_tasks.TASKS for i in range(2)]
    path = tmp_path / f"ruler{suffix}"
    ruler.write_dataset(rows, path)
    assert ruler.read_dataset(path) == rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        assert pq.read_table(path).column_names == list(ruler.COLUMNS)


def test_kvpress_layout_variants_and_errors(tmp_path):
    path = tmp_path / "longbench.jsonl"
    rows = [dict(context="c", question="q", answers=["x", "y"], max_new_tokens=5, task="t", _id=1),
            dict(context="c", question="q2", answer_prefix=None, answer="z", max_new_tokens=5,
                 task="t")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = ruler.read_dataset(path)
    assert [g["answer"] for g in got] == [["x", "y"], ["z"]]
    assert [g["answer_prefix"] for g in got] == ["", ""]
    path.write_text(json.dumps(dict(context="c", answer=["x"], task="t")) + "\n")
    with pytest.raises(ValueError, match="line 1 lacks question, max_new_tokens"):
        ruler.read_dataset(path)


# ------------------------------------------------------------------- through bench.py, real model

def bench_run(tmp_path, out, *flags):
    import bench
    bench.main(["--no-gpu", "--extra-levels", "", "--bootstrap", "200",
                "--out", str(tmp_path / out), *flags])
    return json.loads((tmp_path / out / "results.json").read_text())


@pytest.mark.slow
def test_ruler_suite_end_to_end(tmp_path):
    """--suite ruler through bench.main on the offline Gemma: every configuration scored on every
    sample, scores as kvpress computes them from the recorded answers, compression ratio = 1 -
    budget, the files written; rerun, it resumes with nothing left to do."""
    require_asset("austen")
    flags = ["--suite", "ruler", "--lengths", "400", "--ruler-samples", "1", "--ruler-tasks",
             "niah_single_1,fwe", "--methods", "streaming", "--budgets", "0.5", "--plot"]
    res = bench_run(tmp_path, "r", *flags)
    assert res["complete"] and res["n_contexts"] == 2 and res["suite"] == "RULER-400, 2 tasks"
    assert res["tasks"] == ["niah_single_1", "fwe"]
    rows = {(r["method"], r["budget"], r["task"]): r for r in res["rows"]}
    tasks = ["niah_single_1", "fwe", "average"] + ["average_capable"] * bool(res["capable"])
    assert set(rows) == {(m, b, t) for m, b in (("full", 1.0), ("streaming", 0.5)) for t in tasks}
    for sample in res["answers"]:  # the full cache's score, recomputed from its recorded answer
        (q,) = sample["questions"]
        expected = 100 * ruler.match_all(q["full"], q["expected"])
        assert rows[("full", 1.0, q["task"])]["score"] == expected
        assert sample["n_tokens"] <= 400
    for r in res["rows"]:
        assert r["compression_ratio"] == pytest.approx(1 - r["budget"])
        assert 0 <= r["score"] <= 100 and r["ci"][0] <= r["score"] <= r["ci"][1]
    avg = rows[("streaming", 0.5, "average")]["score"]
    assert avg == pytest.approx(sum(rows[("streaming", 0.5, t)]["score"] for t in res["tasks"]) / 2)
    md = (tmp_path / "r" / "results.md").read_text()
    assert "RULER-400, 2 tasks: string_match" in md and "| full | 0 |" in md
    assert (tmp_path / "r" / "ruler.png").read_bytes()[:4] == b"\x89PNG"
    before = sorted(p.stat().st_mtime_ns for p in (tmp_path / "r" / "contexts").iterdir())
    assert bench_run(tmp_path, "r", *flags)["rows"] == res["rows"]  # resumed: nothing rerun
    assert sorted(p.stat().st_mtime_ns for p in (tmp_path / "r" / "contexts").iterdir()) == before


@pytest.mark.slow
def test_kvpress_file_runs_sharded_and_merged(tmp_path):
    """A file in kvpress's layout (written here, parquet) runs as it is: questions sharing a context
    are asked of one compressed cache; two shards merged give the one run's rows."""
    import bench
    note = "Note: the door code is 4711. The weather was fine all week.\n"
    rows = [dict(context=note, question="What is the door code?", answer_prefix=" The door code is",
                 answer=["4711"], max_new_tokens=6, task="code"),
            dict(context=note, question="How was the weather?", answer_prefix=" The weather was",
                 answer=["fine"], max_new_tokens=4, task="weather"),
            dict(context="The river is called Wend. It runs north.\n", question="Name the river.",
                 answer_prefix=" The river is called", answer=["Wend"], max_new_tokens=4,
                 task="code")]
    path = tmp_path / "tiny.parquet"
    ruler.write_dataset(rows, path)
    flags = ["--dataset", str(path), "--methods", "streaming", "--budgets", "0.5"]
    one = bench_run(tmp_path, "one", *flags)
    assert one["n_contexts"] == 2 and one["suite"] == "tiny.parquet, 2 tasks"
    assert [len(a["questions"]) for a in one["answers"]] == [2, 1]
    full = {r["task"]: r for r in one["rows"] if r["method"] == "full"}
    assert full["code"]["n"] == 2 and full["weather"]["n"] == 1
    bench_run(tmp_path, "s0", *flags, "--shard", "0/2")
    bench_run(tmp_path, "s1", *flags, "--shard", "1/2")
    bench.main(["--merge", f"{tmp_path / 's0'},{tmp_path / 's1'}", "--bootstrap", "200",
                "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    untimed = lambda rs: [{k: v for k, v in r.items() if k != "decode_tok_s"} for r in rs]
    assert merged["complete"] and untimed(merged["rows"]) == untimed(one["rows"])


@pytest.mark.parametrize("flags,words", [
    (["--dataset", "x.jsonl", "--suite", "needle"], "it runs as --suite ruler"),
    (["--suite", "ruler", "--ruler-tasks", "qa_1"], "need SQuAD and HotpotQA"),
    (["--suite", "ruler", "--ruler-samples", "0"], "--ruler-samples must be >= 1"),
    (["--dataset", "no-such-file.jsonl"], "no such file"),
])
def test_bad_ruler_flags_exit_2(capsys, flags, words):
    import bench
    with pytest.raises(SystemExit) as e:
        bench.parse_args(flags)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_ruler_defaults():
    import bench
    args = bench.parse_args(["--suite", "ruler"])
    assert args.lengths == [4096] and args.speed_lengths == []
    assert args.ruler_tasks == list(ruler_tasks.TASKS)
    assert bench.parse_args(["--suite", "ruler", "--lengths", "2048"]).lengths == [2048]
    assert bench.parse_args([]).suite == "needle"


def test_unreadable_dataset_is_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "c", "question": "q"}\n')
    with pytest.raises(UsageError, match="line 1 lacks answer, max_new_tokens, task"):
        ruler.load_rows(None, path, [], 0, 0)
    path.write_text("not json\n")
    with pytest.raises(UsageError, match="--dataset"):
        ruler.load_rows(None, path, [], 0, 0)


def test_device_flag(capsys):
    import bench
    assert bench.parse_args([]).device == "cpu"
    assert bench.parse_args(["--device", "cuda:1"]).device == "cuda:1"
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "tpu"])
    assert e.value.code == 2 and "--device tpu" in capsys.readouterr().err
