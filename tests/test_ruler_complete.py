"""What `complete` means in a RULER run's results.json: every context the runs meant to run is
done. A --ruler-only run leaves the other tasks on purpose; its results name them, and --merge
counts only the tasks the runs chose (harness/ruler.py planned)."""
import json

import bench
from harness import ruler

TASKS = ["vt", "cwe"]  # 1 length x 2 samples x 2 tasks: contexts 0 vt, 1 cwe, 2 vt, 3 cwe
KEY = dict(suite="ruler", methods=["full"], budgets=[1.0], extra_levels=[], chunk_size=512,
           window=0, seed=0, model="m", gate="g", chat=None, device="cpu", prompt="kvpress",
           lengths=[4096], ruler_samples=2, ruler_tasks=TASKS, ruler_sizing="ruler")


def record(c, score=1.0):
    task = TASKS[c % 2]
    return dict(context=c, n_tokens=100, doc=f"RULER {task} {c // 2}", seconds=1.0, key=KEY,
                entries={"full@1.0": dict(scores=[score], kept=[1.0], nbytes=10,
                                          decode=[1, 0.1])},
                answers=[dict(task=task, expected=["x"], full="x")])


def run_folder(path, contexts, ruler_only):
    """A run's folder as bench.py leaves it: config.json and contexts/context-NNN.json."""
    (path / "contexts").mkdir(parents=True)
    flags = dict(model="m", seed=0, ruler_only=ruler_only)
    config = dict(flags=flags, command="bench.py ...", started="2026-01-01T00:00:00",
                  git_commit="0" * 40, git_dirty=False, quality_key=KEY,
                  gate=dict(source=None, sha256="g"))
    (path / "config.json").write_text(json.dumps(config))
    for c in contexts:
        (path / "contexts" / f"context-{c:03d}.json").write_text(json.dumps(record(c)))
    return str(path)


def merged(tmp_path, *folders):
    bench.merge(folders, tmp_path / "merged", 50, 0, ["passkey"])
    return json.loads((tmp_path / "merged" / "results.json").read_text())


def test_a_ruler_only_run_is_complete_when_its_tasks_are_done(tmp_path):
    """Both committed RULER results said "complete": false while every context of the tasks their
    --ruler-only runs chose had finished (a task left on purpose counted as missing)."""
    a = run_folder(tmp_path / "a", [0, 1, 3], ["cwe"])  # vt's sample 0 finished before
    res = merged(tmp_path, a)
    assert res["complete"] and res["tasks_left_out"] == ["vt"] and res["n_contexts"] == 3
    assert "Left out on purpose (--ruler-only): vt" in (tmp_path / "merged" /
                                                        "results.md").read_text()
    b = run_folder(tmp_path / "b", [1], ["cwe"])  # cwe's sample 1 (context 3) missing
    assert not merged(tmp_path, b)["complete"]
    c = run_folder(tmp_path / "c", [0, 1, 3], None)  # a run of every task: vt's sample 1 missing
    res = merged(tmp_path, c)
    assert not res["complete"] and "tasks_left_out" not in res
    assert ruler.planned(KEY, [dict(ruler_only=["cwe"]), dict(ruler_only=["vt"])],
                         [0, 1, 2, 3, 9]) == (4, 4, [])  # two runs that chose both tasks
    assert ruler.planned(KEY, [dict(ruler_only=["vt"])], [0, 1, 3]) == (2, 1, ["cwe"])


def test_json_nested_too_deep_in_a_run_folder_is_one_line(tmp_path):
    """A run folder's JSON (a context record, results.json) nested 100,000 deep ended in a
    RecursionError's traceback; it is damaged like any unreadable file: one line naming it."""
    import pytest

    from cli import UsageError
    deep = "[" * 100_000 + "]" * 100_000
    a = run_folder(tmp_path / "a", [0, 1], ["cwe"])
    (tmp_path / "a" / "contexts" / "context-001.json").write_text(deep)
    with pytest.raises(UsageError, match="context-001.json is unreadable; delete it"):
        merged(tmp_path, a)
    b = run_folder(tmp_path / "b", [0, 1], ["cwe"])
    (tmp_path / "b" / "results.json").write_text(deep)
    with pytest.raises(UsageError, match="results.json is not valid JSON .RecursionError"):
        merged(tmp_path, b)
