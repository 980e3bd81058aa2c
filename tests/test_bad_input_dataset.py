"""bench.py --dataset / --suite ruler on bad input: every row of a
kvpress-layout file is checked before the model loads and before --out is created; a bad one is one
line naming the file's line (or parquet row), exit 2, nothing left behind; a generated suite of any
--ruler-samples reaches its first context at once."""
import json
import signal

import pytest
import torch

import bench
import cli
import gate
from formats.gate_file import save_gate
from harness import ruler
from model import ModelConfig, load_tokenizer
from tests.helpers import tiny_checkpoint, tiny_tokenizer

GOOD = dict(context="The door code is 4711.\n", question="What is the door code?",
            answer_prefix=" The door code is", answer=["4711"], max_new_tokens=4, task="code")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Gemma3 of 2,048 positions with a byte tokenizer (one token a byte) and a random
    gate."""
    folder = tiny_checkpoint("gemma3", tmp_path_factory.mktemp("tiny"),
                             max_position_embeddings=2048)
    tiny_tokenizer(folder)
    cfg = ModelConfig.from_json(folder)
    torch.manual_seed(0)
    gates = gate.Gates(len(cfg.compressed_layers), cfg.hidden_size, cfg.num_key_value_heads,
                       cfg.group_size)
    path = folder.parent / "gate.safetensors"
    save_gate(path, gates, {"note": "random, tests only"})
    return folder, path


@pytest.fixture
def no_model(monkeypatch):
    """bench.run must stop before the weights load."""
    def refuse(*a, **kw):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(bench, "load_checked", refuse)


def run_cli(capsys, *argv):
    """bench.py's command line (cli.main, as __main__ runs it) -> (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.main(bench.run, bench.parse_args(["--no-gpu", *argv]), *bench.ERRORS)
    return e.value.code, capsys.readouterr().err


def jsonl(path, *lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def with_(**kw):
    return json.dumps(dict(GOOD, **kw))


@pytest.mark.parametrize("lines,words", [
    # each was a traceback (or litter: config.json, results.json) after the model ran
    ([], "holds no rows"),
    (["", "   ", "\t"], "holds no rows"),
    ([json.dumps(GOOD), with_(answer=[])], "line 2: 'answer' must be a non-empty string or a "
     "non-empty list of them"),
    ([with_(answer=4711)], "line 1: 'answer' must be"),
    ([with_(answer=None)], "got null"),
    ([with_(answer=[4711])], "got a list holding an int"),
    ([with_(max_new_tokens=None)], "line 1: 'max_new_tokens' must be an integer >= 1"),
    ([with_(context=5)], "line 1: 'context' must be a non-empty string, got an int"),
    ([json.dumps(GOOD), "5"], "line 2: a JSON int, not an object"),
    ([with_(question="What is \ud800?")], "line 1: 'question' holds a lone surrogate"),
    (["{not json"], "line 1: not JSON"),
    (['{"context": "a", "context": "b"}'], "key 'context' given twice"),
    # a RecursionError's traceback; Python's advice to raise sys.set_int_max_str_digits()
    (["[" * 100_000 + "]" * 100_000], "line 1: JSON nested too deep to read"),
    ([with_(context={"a": [[[[[["deep"]]]]]]})], "'context' must be a non-empty string"),
    ([with_(max_new_tokens=0).replace(": 0", ": " + "9" * 5000)], "line 1: an integer of 5000 digits (at most 4300"),
    # accepted and scored wrong
    ([with_(max_new_tokens=-5)], "'max_new_tokens' must be an integer >= 1"),
    ([with_(max_new_tokens=2.9)], "'max_new_tokens' must be an integer >= 1"),
    ([with_(question=None)], "line 1: 'question' must be a non-empty string, got null"),
    ([with_(max_new_tokens=True)], "got a bool"),
    ([with_(max_new_tokens=-5)], "got an integer below 1"),
    ([with_(max_new_tokens=2.9)], "got a float"),
    ([with_(answer=[""])], "a list holding an empty string"),
])
def test_bad_rows_are_one_line_before_anything(tmp_path, capsys, no_model, lines, words):
    path = jsonl(tmp_path / "d.jsonl", *lines)
    code, err = run_cli(capsys, "--dataset", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and words in err, err
    assert err.count("\n") == 1 and err.startswith("error: --dataset") and "Traceback" not in err
    assert "4711" not in err  # never the file's text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("answers,words", [
    ([[1, 2]], "row 1: 'answer' must be a non-empty string or a non-empty list of them, got a list "
     "holding an int"),
    ([4711], "row 1: 'answer' must be"),  # a column of integers
    ([["4711"], None], "row 2: 'answer' must be a non-empty string or a non-empty list of them, got "
     "null"),
])
def test_bad_parquet_rows(tmp_path, capsys, no_model, answers, words):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([dict(GOOD, answer=a) for a in answers]), path)
    code, err = run_cli(capsys, "--dataset", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and f"{path} {words}" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    pq.write_table(pa.Table.from_pylist([GOOD])[:0], path)  # no rows
    code, err = run_cli(capsys, "--dataset", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and "holds no rows" in err and not (tmp_path / "out").exists()


def test_context_longer_than_the_model_is_refused_naming_the_line(tiny, tmp_path, capsys,
                                                                  no_model):
    """A context past the model's positions was once scored; generate.py refuses it."""
    folder, gate_file = tiny
    path = jsonl(tmp_path / "d.jsonl", json.dumps(GOOD), "",
                 with_(context="x" * 2100 + "\n"))
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--dataset",
                        str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and f"{path} line 3: template + context + question + max_new_tokens" \
        in err and "exceeds the model's maximum of 2048" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    # max_new_tokens alone can push a short context past the end
    jsonl(path, with_(max_new_tokens=2000))
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--dataset",
                        str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and "line 1: template + context" in err and not (tmp_path / "out").exists()
    # the harness's layout counts its system prompt instead
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--dataset",
                        str(path), "--ruler-prompt", "harness", "--out", str(tmp_path / "out"))
    assert code == 2 and "line 1: system prompt + context" in err


def test_shard_past_the_datasets_contexts(tiny, tmp_path, capsys, no_model):
    folder, gate_file = tiny
    path = jsonl(tmp_path / "d.jsonl", json.dumps(GOOD), with_(question="Again?"))
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--dataset",
                        str(path), "--shard", "1/2", "--out", str(tmp_path / "out"))
    assert code == 2 and "has 1 contexts, shard 1 holds none" in err
    assert not (tmp_path / "out").exists()


def test_dataset_folder_and_non_files(tmp_path, capsys):
    """A folder once said 'no such file'."""
    for path, words in ((tmp_path, "is a folder; give a JSONL or parquet file"),
                        (tmp_path / "none.jsonl", "no such file"),
                        ("/dev/null", "is not a regular file")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--dataset", str(path)])
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_library_reader_raises_value_error_naming_the_line(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", json.dumps(GOOD), with_(answer=[]))
    with pytest.raises(ValueError, match="line 2: 'answer'"):
        ruler.read_dataset(path)
    assert ruler.read_dataset(jsonl(path, json.dumps(GOOD))) == [GOOD]


class Reached(Exception):
    pass


def test_huge_ruler_samples_reach_the_first_context_at_once(tiny, tmp_path, monkeypatch):
    """--ruler-samples 10**20 once made every sample before the first context ran (forever).
    Samples are made one at a time as the run reaches them: the first context's prefill starts
    within seconds. (Sized in the tiny model's own tokens: RULER's Llama-3.1 sizing makes more of
    its byte tokens than its 2,048 positions hold, which check_generated refuses.)"""
    from harness import quality
    folder, gate_file = tiny

    def first_prefill(model, ids, *a, **kw):
        raise Reached(len(ids))
    monkeypatch.setattr(quality, "capture_prefill", first_prefill)

    def too_late(*_):
        raise TimeoutError("no context reached in 60 s")
    old = signal.signal(signal.SIGALRM, too_late)
    signal.alarm(60)
    try:
        with pytest.raises(Reached):
            bench.main(["--no-gpu", "--model", str(folder), "--gate", str(gate_file), "--suite",
                        "ruler", "--ruler-samples", str(10**20), "--ruler-tasks", "niah_single_1,fwe",
                        "--lengths", "1500", "--methods", "streaming", "--budgets", "0.5",
                        "--ruler-sizing", "model", "--out", str(tmp_path / "out")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_generated_contexts_are_the_eager_rows(tiny):
    """The c-th context made alone (sample_at) is the c-th row of the whole list, any length,
    sample and task."""
    tok = load_tokenizer(tiny[0])
    rows = ruler.load_rows(tok, None, [1500, 1600], 2, 3, ["niah_single_1", "fwe"])
    assert [ruler.sample_at(tok, [1500, 1600], 2, 3, ["niah_single_1", "fwe"], c) for c in range(8)] == rows


def test_length_too_short_for_a_task_before_out(tiny, tmp_path, capsys, no_model):
    folder, gate_file = tiny
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--suite",
                        "ruler", "--ruler-tasks", "vt", "--lengths", "200",
                        "--out", str(tmp_path / "out"))
    assert code == 2 and "too few for its smallest sample" in err and \
        not (tmp_path / "out").exists()
    # it said how many are too few, not how many are enough: the length it names makes vt's
    # sample 0 (what a run checks before it starts), in RULER's sizing and the model's
    import re
    tok = load_tokenizer(folder)
    for sizing, task in (("ruler", "vt"), ("ruler", "cwe"), ("model", "niah_single_1")):
        code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--suite",
                            "ruler", "--ruler-tasks", task, "--lengths", "200", "--ruler-sizing",
                            sizing, "--out", str(tmp_path / "out"))
        least = re.search(rf"RULER {task}: 200 tokens are too few for its smallest sample; use "
                          r"--lengths (\d+) or more\n$", err)
        assert code == 2 and least, err
        row = ruler.sample_at(tok, [int(least[1])], 1, 0, [task], 0, sizing)
        assert row["task"] == task and row["length"] <= int(least[1])
    # several tasks too long: one length that makes every one
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--suite",
                        "ruler", "--ruler-tasks", "niah_single_1,vt,cwe", "--lengths", "300",
                        "--out", str(tmp_path / "out"))
    least = re.search(r"RULER niah_single_1, vt, cwe: 300 tokens are too few for their smallest "
                      r"samples; use --lengths (\d+) or more\n$", err)
    assert code == 2 and least, err
    for task in ("niah_single_1", "vt", "cwe"):
        assert ruler.sample_at(tok, [int(least[1])], 1, 0, [task], 0)["task"] == task
    # vt's solved example is RULER's 500 tokens: the byte tokenizer's 500 bytes hold none (it was
    # "Sample larger than population")
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--suite",
                        "ruler", "--ruler-tasks", "vt", "--ruler-sizing", "model", "--lengths",
                        "1500", "--out", str(tmp_path / "out"))
    assert code == 2 and "RULER vt's example: RULER's 500 tokens are too few" in err
    assert "use --ruler-sizing ruler" in err
    assert err.count("\n") == 1, err


def test_generator_flags_with_a_dataset_are_refused(tmp_path, capsys, no_model):
    """--dataset with --ruler-tasks ran every row and ignored the flag (--ruler-only is
    refused); so did --lengths, --ruler-samples and --ruler-sizing."""
    path = jsonl(tmp_path / "d.jsonl", json.dumps(GOOD))
    for flag, value in (("--ruler-tasks", "vt"), ("--lengths", "1024"), ("--ruler-samples", "3"),
                        ("--ruler-sizing", "model")):
        code, err = run_cli(capsys, "--dataset", str(path), flag, value, "--out",
                            str(tmp_path / "out"))
        assert code == 2 and f"its rows are the samples, run whole; leave out {flag}" in \
            err.strip().splitlines()[-1], err
        assert not (tmp_path / "out").exists()


def test_generated_ruler_without_the_offline_assets_is_one_line(tiny, tmp_path, capsys,
                                                               monkeypatch, no_model):
    """RULER's generator reads offline assets (Llama-3.1's tokenizer, Austen): not built, the run
    says how to build them in one line, before --out is written."""
    from harness import ruler_tasks
    folder, gate_file = tiny
    monkeypatch.setenv("FASTKVZIP_ASSETS", str(tmp_path / "none"))
    for f in (ruler_tasks.llama_tokenizer, ruler_tasks.essay_words):  # read once per process
        monkeypatch.setattr(f, "__defaults__", ([],))
    code, err = run_cli(capsys, "--model", str(folder), "--gate", str(gate_file), "--suite",
                        "ruler", "--ruler-samples", "1", "--methods", "streaming", "--budgets",
                        "0.5", "--lengths", "1500", "--out", str(tmp_path / "out"))
    assert code == 2 and err.startswith("error: missing offline asset ") and \
        "python -m offline.fetch_assets" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_value_repeated_in_a_list_flag_runs_once():
    """--lengths 1024,1024 generated every RULER sample twice and counted both; so would a
    repeated speed length, batch size or GPU length, and layer_swap's budgets and combinations:
    a comma list keeps each value once, in the order given (cli.ints, cli.floats, cli.names)."""
    from harness import layer_swap
    args = bench.parse_args(["--suite", "ruler", "--lengths", "1024,2048,1024", "--ruler-samples",
                             "2", "--ruler-tasks", "vt,cwe,vt", "--ruler-only", "cwe,cwe",
                             "--methods", "kvzip,kvzip", "--budgets", "0.5,0.50,0.5",
                             "--speed-lengths", "256,256", "--batch-sizes", "2,4,2",
                             "--gpu-lengths", "8192,8192"])
    assert args.lengths == [1024, 2048] and args.ruler_tasks == ["vt", "cwe"]
    assert args.ruler_only == ["cwe"] and args.methods == ["full", "kvzip"]
    assert args.budgets == [0.5] and args.speed_lengths == [256] and args.batch_sizes == [2, 4]
    assert args.gpu_lengths == [8192]
    exp = bench.experiment(args)  # 2 lengths x 2 samples x 2 tasks: the run's contexts
    assert len(exp.lengths) * exp.ruler_samples * len(exp.ruler_tasks) == 8
    swap = layer_swap.parse_args(["--out", "x", "--budgets", "0.5,0.4,0.5", "--combos",
                                  "TTG,ttg,GGG"])
    assert swap.budgets == [0.5, 0.4] and swap.combos == ["TTG", "GGG"]
    assert cli.names("a,,b,a") == ["a", "b"] and cli.ints("0") == []


def test_ruler_without_quality_contexts_writes_its_results(tiny, tmp_path, capsys):
    """--suite ruler --no-quality ended in KeyError 'tasks' once the run was done (results.md of a
    RULER run without contexts)."""
    folder, gate_file = tiny
    out = tmp_path / "out"
    code = bench.main(["--model", str(folder), "--gate", str(gate_file), "--suite", "ruler",
                       "--no-quality", "--no-gpu", "--out", str(out)])
    assert code is None
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["rows"] == []
    assert "No quality section" in (out / "results.md").read_text()


def test_a_shard_without_a_context_of_ruler_only_is_refused(tmp_path, capsys, no_model):
    """--shard 1/2 --ruler-only vt of one sample per task (vt's one context is 8, shard 0's) ran
    nothing and ended in KeyError 'tasks'; refused before anything loads."""
    code, err = run_cli(capsys, "--suite", "ruler", "--ruler-samples", "1", "--shard", "1/2",
                        "--ruler-only", "vt", "--out", str(tmp_path / "out"))
    last = err.strip().splitlines()[-1]  # argparse's usage, then the line
    assert code == 2 and "--shard 1/2 holds no context of --ruler-only vt" in last, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    tasks = list(ruler.TASKS)
    for shard, only, total in (((0, 2), {"vt"}, 11), ((1, 3), {"vt", "cwe"}, 11 * 7),
                               ((2, 4), None, 11 * 5 + 3)):  # against a count of every context
        assert ruler.n_runs(total, shard, tasks, only) == sum(
            c % shard[1] == shard[0] and (only is None or tasks[c % 11] in only)
            for c in range(total))


def test_task_and_file_names_are_escaped_in_results_md(tiny, tmp_path):
    """A task named "a|b<newline>c" was written raw into results.md: its `|` split the table's
    header and its line break ended the row. What a user chose (task names, the file's name, the
    model's path) is escaped for Markdown; each table still has one cell per column, reading back
    as the name."""
    import itertools
    import re
    folder, gate_file = tiny
    odd = "a|b\nc `x` *y*"
    path = jsonl(tmp_path / "d|`1`.jsonl", with_(task=odd), with_(task="plain"))
    out = tmp_path / "out"
    bench.main(["--model", str(folder), "--gate", str(gate_file), "--dataset", str(path),
                "--methods", "full", "--bootstrap", "10", "--no-gpu", "--out", str(out)])
    lines = (out / "results.md").read_text().splitlines()
    # GFM: a cell ends at a bare |; a backslash escapes ASCII punctuation only
    cells = lambda line: [re.sub(r"\\([!-/:-@[-`{-~])", r"\1", c).strip()
                          for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    starts = [i for i, line in enumerate(lines) if line.startswith("| method")]
    tables = [[cells(line) for line in itertools.takewhile(lambda x: x.startswith("|"),
                                                          lines[i:])] for i in starts]
    assert tables and all(len({len(row) for row in t}) == 1 for t in tables), tables
    per_task = next(t for t in tables if "compression ratio" == t[0][1])
    assert per_task[0][2:] == [odd.replace("\n", "\\n"), "plain"]
    assert lines[0].startswith("# Fast KVzip on d|`1`.jsonl, 2 tasks".replace("|", "\\|")
                               .replace("`", "\\`"))
