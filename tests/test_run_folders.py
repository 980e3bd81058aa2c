"""Run folders (bench.py --out, bench.py --merge ... --out, train_gate.py --out): a program writes
only into a folder that is new, empty or its own (cli.claim_folder), one run at a time (a lock the
OS drops when the process dies), and --merge refuses, by name, the folders that cannot be part of
one experiment: damaged ones, runs of another experiment, records of contexts the run lacks.

Most refusals come before any model is read: the CLIs run as subprocesses on folders written
here. The two-process test runs bench.py on a tiny random model (seconds)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench
import cli
from harness import quality, ruler
from tests.test_bad_input_cli import one_line

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def program(*argv, name="bench.py"):
    """python <name> argv, in the repository -> (exit code, stderr)."""
    r = subprocess.run([sys.executable, name, *map(str, argv)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr


def snapshot(folder):
    """Every file under folder with its bytes and modification time: to see that none changed."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def user_folder(folder, *names):
    """A folder of a user's files that no program of this project wrote."""
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text(f"the user's own {name}\n")
    return folder


def run_folder(folder, *flags, contexts=(), results=None, suite="needle"):
    """A bench.py --out folder as a run with these flags leaves it: config.json with the
    experiment's quality key, contexts/context-NNN.json for each context number in `contexts`,
    results.json (`results`, default: none). -> the quality key."""
    extra = ["--suite", "ruler", "--ruler-samples", "1"] if suite == "ruler" else []
    args = bench.parse_args(["--lengths", "512", "--contexts", "2", *extra, *flags])
    config = dict(model=dict(sha256="m"), gate=dict(source="g", sha256="g"))
    exp = bench.experiment(args)
    key = ruler.run_key(exp, config) if suite == "ruler" else quality.quality_key(exp, config)
    config.update(flags=vars(args), command="bench.py " + " ".join(flags), started="t",
                  git_commit="c" * 10, git_dirty=False, quality_key=key)
    (folder / "contexts").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    for c in contexts:
        (folder / "contexts" / f"context-{c:03d}.json").write_text(json.dumps(record(c, key)))
    if results is not None:
        (folder / "results.json").write_text(json.dumps(results))
    return key


def record(c, key):
    """A finished needle context, as harness/quality.py records it (two caches, NLL probes)."""
    nll = [64 * 2.0, 64]
    entry = dict(tally=dict(passkey=[1, 1], kv=[1, 1], nll_next=nll, nll_repeat=nll,
                            agreement=[1, 1]), kept=[1.0], nbytes=1, decode=[0, 0.0])
    return dict(context=c, doc="d", n_tokens=100, answers=[], agreement=None, seconds=1.0,
                entries={"full@1": entry, "streaming@0.5": entry}, key=key)


# -- a folder of someone else's files is never written into -----------------------------------------

def test_bench_out_holding_a_users_files_is_refused_untouched(tmp_path):
    """The user's config.json and results.md were replaced before the run started, even by a run
    that then stopped on a bad --lengths."""
    out = user_folder(tmp_path / "mine", "config.json", "results.md")
    before = snapshot(out)
    for flags in ([], ["--lengths", "60"], ["--quick", "--no-quality"]):
        code, err = program("--out", out, *flags)
        one_line(code, err, f"--out {out} holds files that are not a bench.py run",
                 "config.json, results.md", "pass another --out")
        assert snapshot(out) == before


def test_merge_out_holding_a_users_files_is_refused_untouched(tmp_path):
    run_folder(tmp_path / "a", contexts=[0, 1])
    out = user_folder(tmp_path / "mine", "config.json", "results.md", "notes.txt")
    before = snapshot(out)
    code, err = program("--merge", tmp_path / "a", "--out", out)
    one_line(code, err, "holds files that are not a bench.py run",
             "config.json, notes.txt, results.md")
    assert snapshot(out) == before


def test_train_gate_out_holding_a_users_gate_is_refused_untouched(tmp_path):
    out = user_folder(tmp_path / "mine", "gate.safetensors", "metrics.json")
    before = snapshot(out)
    code, err = program("--out", out, "--data", tmp_path / "none.txt", name="train_gate.py")
    one_line(code, err, f"--out {out} holds files that are not a train_gate.py run",
             "gate.safetensors, metrics.json")
    assert snapshot(out) == before


def test_own_folders_and_empty_ones_are_written_again(tmp_path):
    """What a program may write into: a new folder, one holding only what an interrupted write
    leaves (.NAME.tmpPID), its own run (a merge onto its own earlier merge)."""
    run_folder(tmp_path / "a", contexts=[0, 1])
    out = tmp_path / "merged"
    out.mkdir()
    (out / ".results.json.tmp123").write_text("cut short")
    for _ in range(2):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(out), "--bootstrap", "10"])
        assert json.loads((out / "results.json").read_text())["complete"]
    assert bench.is_run(out) and not bench.is_run(tmp_path)
    other = holder(out)  # the runs above, in this process, left the folder free when they ended
    other.kill(), other.wait()
    from commands.train_gate import is_gate_run
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "metrics.json").write_text(json.dumps(
        {"command": "train_gate.py", "layers": [0], "val_loss": [[0.5]]}))
    assert is_gate_run(tmp_path / "g") and not is_gate_run(out)


# -- one run at a time on a folder ------------------------------------------------------------------

HOLD = ("import sys, cli; cli.claim_folder(sys.argv[1], '--out', lambda p: True, 'x'); "
        "print('held', flush=True); sys.stdin.read()")


def holder(folder):
    """Another process that holds `folder` (cli.claim_folder) until it is killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, env=ENV,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    return p


def test_a_held_folder_is_refused_and_kill_9_leaves_no_stale_lock(tmp_path):
    run_folder(tmp_path / "a", contexts=[0, 1])
    out, gate_out = tmp_path / "merged", tmp_path / "gate"
    out.mkdir(), gate_out.mkdir()
    holders = [holder(out), holder(gate_out)]
    try:
        code, err = program("--merge", tmp_path / "a", "--out", out)
        one_line(code, err, f"--out {out} is in use by another run")
        code, err = program("--out", gate_out, "--data", tmp_path / "none.txt",
                            name="train_gate.py")
        one_line(code, err, f"--out {gate_out} is in use by another run")
    finally:
        for p in holders:
            p.kill()  # SIGKILL: no handler runs, the OS drops the lock
            p.wait()
    assert list(out.iterdir()) == []  # refused before writing
    code, err = program("--merge", tmp_path / "a", "--out", out, "--bootstrap", "10")
    assert code == 0 and (out / "results.json").is_file(), err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.assets import require_asset
    from tests.test_saved_cache import tiny_setup
    require_asset("austen_parts")
    t = tiny_setup("gemma3", tmp_path_factory.mktemp("tiny") / "model")
    return ["--model", t["folder"], "--gate", t["gate_file"], "--quick", "--lengths", "512",
            "--speed-lengths", "0", "--no-gpu", "--methods", "streaming", "--budgets", "0.5",
            "--bootstrap", "10"]


def test_two_bench_runs_on_one_out_and_a_resume_after_kill_9(tiny, tmp_path):
    """Two runs on one --out: the second, of another configuration or the same, is refused while
    the first holds the folder (they both ran, and the first one's contexts were lost); after
    kill -9 the same command resumes and finishes the run."""
    out = tmp_path / "out"
    flags = [*tiny, "--contexts", "10", "--out", out]
    first = subprocess.Popen([sys.executable, "bench.py", *map(str, flags)], cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not list(out.glob("contexts/context-*.json")) and time.time() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.2)
        first.send_signal(signal.SIGSTOP)  # paused mid-run, holding the folder
        done = snapshot(out)
        for other in (["--seed", "1"], []):
            code, err = program(*flags, *other)
            one_line(code, err, f"--out {out} is in use by another run")
        assert snapshot(out) == done
    finally:
        first.kill()
        first.wait()
    n = len(list(out.glob("contexts/context-*.json")))
    assert 0 < n < 10
    r = subprocess.run([sys.executable, "bench.py", *map(str, flags)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"resuming after {n} finished contexts" in r.stderr, r.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and res["n_contexts"] == 10


# -- --merge: only what can be one experiment ------------------------------------------------------

def test_merge_refuses_a_record_of_a_context_the_run_lacks(tmp_path):
    """Context 7 of a 2-context run was counted, and the merge said complete while context 1 was
    missing; a record filed under another context's number would be counted twice."""
    run_folder(tmp_path / "a", contexts=[0])
    key = run_folder(tmp_path / "b")
    (tmp_path / "b" / "contexts" / "context-007.json").write_text(json.dumps(record(7, key)))
    merge = ["--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--out", tmp_path / "merged"]
    code, err = program(*merge)
    one_line(code, err, "b/contexts/context-007.json claims context 7",
             "run of 2 contexts (0-1)")
    (tmp_path / "b" / "contexts" / "context-007.json").unlink()
    (tmp_path / "b" / "contexts" / "context-001.json").write_text(json.dumps(record(0, key)))
    code, err = program(*merge)
    one_line(code, err, "b/contexts/context-001.json claims context 0")
    assert not (tmp_path / "merged").exists()
    (tmp_path / "b" / "contexts" / "context-001.json").unlink()
    bench.main([*map(str, merge), "--bootstrap", "10"])
    res = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert res["n_contexts"] == 1 and res["complete"] is False


def test_merge_refuses_a_folder_of_another_experiment_by_name(tmp_path):
    """A RULER run merged with a needle folder (here one with no context yet) was accepted; two
    configurations were refused with "use a new --out", where the fix is to leave one out."""
    run_folder(tmp_path / "ruler", contexts=[0], suite="ruler")
    run_folder(tmp_path / "needle")
    run_folder(tmp_path / "speed", "--no-quality")
    run_folder(tmp_path / "seed1", "--seed", "1", contexts=[1])
    for other, differ in (("needle", "suite"), ("speed", "suite")):
        code, err = program("--merge", f"{tmp_path / 'ruler'},{tmp_path / other}", "--out",
                            tmp_path / "merged")
        one_line(code, err, f"{tmp_path / other} is a run of another experiment than "
                 f"{tmp_path / 'ruler'}", differ, f"leave {tmp_path / other} out of --merge")
    code, err = program("--merge", f"{tmp_path / 'needle'},{tmp_path / 'seed1'}", "--out",
                        tmp_path / "merged")
    one_line(code, err, "(seed differ)", f"leave {tmp_path / 'seed1'} out of --merge")
    assert not (tmp_path / "merged").exists()


def damage(folder, kind):
    key = json.loads((folder / "config.json").read_text())["quality_key"]
    if kind == "results.json without config":
        (folder / "results.json").write_text(json.dumps({"speed": []}))
    elif kind == "config.json without command":
        config = json.loads((folder / "config.json").read_text())
        del config["command"]
        (folder / "config.json").write_text(json.dumps(config))
    elif kind == "speed rows that are not objects":
        (folder / "results.json").write_text(json.dumps({"config": {}, "speed": [1, 2]}))
    elif kind == "seconds that are not a number":
        (folder / "results.json").write_text(json.dumps({"config": {}, "seconds": "1 h"}))
    elif kind == "a folder where a context file should be":
        (folder / "contexts" / "context-001.json").mkdir()
    elif kind == "a record without context":
        rec = record(1, key)
        del rec["context"]
        (folder / "contexts" / "context-001.json").write_text(json.dumps(rec))
    elif kind == "a quality key without its lengths":
        config = json.loads((folder / "config.json").read_text())
        del config["quality_key"]["lengths"]
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "contexts" / "context-000.json").write_text(
            json.dumps(record(0, config["quality_key"])))


@pytest.mark.parametrize("kind", [
    "results.json without config", "config.json without command", "speed rows that are not objects",
    "seconds that are not a number", "a folder where a context file should be",
    "a record without context", "a quality key without its lengths"])
def test_merge_of_a_damaged_run_folder_is_one_line(tmp_path, kind):
    run_folder(tmp_path / "a", contexts=[0], suite="ruler" if "lengths" in kind else "needle")
    damage(tmp_path / "a", kind)
    code, err = program("--merge", tmp_path / "a", "--out", tmp_path / "merged")
    one_line(code, err, str(tmp_path / "a"))
    assert not (tmp_path / "merged").exists()


def test_merge_onto_a_full_disk_leaves_no_folder(tmp_path, monkeypatch):
    run_folder(tmp_path / "a", contexts=[0, 1])
    real = Path.write_text

    def full(self, *a, **kw):
        if self.name.startswith(".results.md"):  # results.json went in, then the disk was full
            raise OSError(28, "No space left on device")
        return real(self, *a, **kw)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(cli.WriteError, match="results.md: No space left on device"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(tmp_path / "new" / "merged"),
                    "--bootstrap", "10"])
    assert not (tmp_path / "new").exists()


# -- the needle suite checks its lengths before the model and before --out ------------------------

def test_needle_lengths_too_short_are_refused_before_the_model_and_out(tiny, tmp_path,
                                                                       monkeypatch):
    def reached(*a, **k):
        raise AssertionError("the weights were loaded: the refusal came late")
    monkeypatch.setattr(bench, "load_checked", reached)
    out = tmp_path / "out"
    with pytest.raises(cli.UsageError, match="--lengths 60 is too short for its needles"):
        bench.main([*map(str, tiny), "--lengths", "60", "--out", str(out)])
    assert not out.exists()


# -- a folder holds one suite's run, or one merge: another kind is refused, not written over -----

def decode_folder(folder, merged=False):
    """A --suite decode --no-quality folder, as the decode suite leaves it (or its merge)."""
    config = dict(flags=dict(model="m", no_quality=True), command="bench.py --suite decode",
                  started="t", quality_key=dict(suite="decode", contexts=1, model="m", gate="g"),
                  gate=dict(source="g", sha256="g"), git_commit="c" * 10, git_dirty=False)
    if merged:
        config["merged_from"] = ["a"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "results.json").write_text(json.dumps(dict(config=config, decode_speed=[])))
    return folder


def test_another_suites_run_or_a_merge_is_not_written_over(tmp_path):
    """A --no-quality run replaced results.json in any folder whose config.json was a bench.py
    run's: a needle speed folder taken by the decode suite, a decode one by the needle suite, a
    merged folder's quality rows by a speed run, a run's by a merge."""
    needle, decode, merged = tmp_path / "needle", tmp_path / "decode", tmp_path / "merged"
    run_folder(needle, contexts=[0], results=dict(config={}, speed=[]))
    decode_folder(decode)
    run_folder(merged, contexts=[0], results=dict(config={}, rows=[1]))
    config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(json.dumps(dict(config, merged_from=["x"])))
    decode_merge = decode_folder(tmp_path / "decode-merged", merged=True)
    before = {f: snapshot(f) for f in (needle, decode, merged, decode_merge)}
    speed = ["--no-quality", "--speed-lengths", "256", "--model", "none"]
    for argv, words in (
            ([*speed, "--suite", "decode", "--out", needle],
             "holds the results of a --suite needle run: a --suite decode run does not"),
            ([*speed, "--out", decode], "a --suite decode run: a --suite needle run does not"),
            ([*speed, "--suite", "ruler", "--out", decode], "a --suite ruler run does not"),
            ([*speed, "--out", merged], "a --suite needle merge: a --suite needle run does not"),
            ([*speed, "--suite", "decode", "--out", decode_merge], "a --suite decode merge: a "),
            (["--merge", needle, "--out", needle], "a --suite needle merge does not write over"),
            (["--merge", needle, "--out", decode_merge], "a --suite needle merge does not")):
        with pytest.raises(cli.UsageError, match="pass another --out") as e:
            bench.main(list(map(str, argv)))
        assert words in str(e.value)
    assert {f: snapshot(f) for f in before} == before


def test_merge_refuses_needle_speed_rows_of_another_model_or_gate(tmp_path):
    """A speed-only run was compared by suite alone: rows of another checkpoint or gate were filed
    under the first run's model."""
    run_folder(tmp_path / "a", contexts=[0, 1])
    for what in ("model", "gate"):
        s = tmp_path / what
        run_folder(s, "--no-quality", results=dict(config={}, speed=[]))
        config = json.loads((s / "config.json").read_text())
        config["quality_key"][what] = "another"
        (s / "config.json").write_text(json.dumps(config))
        with pytest.raises(cli.UsageError, match=re.escape(f"({what} differ); leave {s} out")):
            bench.main(["--merge", f"{tmp_path / 'a'},{s}", "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("kind", ["a record without entries", "a record with malformed entries",
                                  "a record whose seconds are not a number", "contexts a file",
                                  "config.json without started", "config.json without flags"])
def test_a_damaged_needle_or_ruler_run_is_one_line_naming_the_file(tmp_path, kind):
    """The decode suite's damage in the other suites' folders: a KeyError traceback, or (contexts
    a file) a merge that dropped the run's contexts without a word."""
    for suite in ("needle", "ruler"):
        a = tmp_path / suite
        key = run_folder(a, contexts=[0] if suite == "needle" or "record" in kind else [],
                         suite=suite)
        rec, config = a / "contexts" / "context-000.json", a / "config.json"
        if kind == "contexts a file":
            rec.unlink(missing_ok=True), (a / "contexts").rmdir()
            (a / "contexts").write_text("x")
            bad = a / "contexts"
        elif kind.startswith("config.json"):
            c = json.loads(config.read_text())
            del c[kind.rpartition(" ")[2]]
            config.write_text(json.dumps(c))
            bad = config
        else:
            r = record(0, key)
            if kind == "a record without entries":
                del r["entries"]
            elif kind == "a record with malformed entries":  # no tally, no scores
                r["entries"] = {"full@1": {"kept": [1.0]}}
            else:
                r["seconds"] = "1 h"
            rec.write_text(json.dumps(r))
            bad = rec
        with pytest.raises(cli.UsageError) as e:
            bench.main(["--merge", str(a), "--out", str(tmp_path / "m"), "--bootstrap", "10"])
        assert str(bad) in str(e.value) and any(w in str(e.value) for w in (
            "delete it", "move it away", f"leave {a} out of --merge")), str(e.value)
    assert not (tmp_path / "m").exists()


def test_out_on_a_read_only_mount_a_long_name_a_link_to_nothing_or_empty(tmp_path, monkeypatch,
                                                                        capsys):
    """An empty folder on a read-only mount: the temporary's cleanup raised its own OSError over
    the message; a name over the file system's limit, an OSError traceback; a link to nothing,
    "File exists"; --out '' was taken as no --out (a new results/<timestamp>/)."""
    import errno
    run_folder(tmp_path / "a", contexts=[0, 1])
    with pytest.raises(cli.UsageError, match="File name too long"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(tmp_path / ("x" * 300)),
                    "--bootstrap", "10"])
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for out in (tmp_path / "link", tmp_path / "link" / "sub"):
        with pytest.raises(cli.UsageError, match=f"{tmp_path / 'link'} is a link to nothing"):
            bench.main(["--merge", str(tmp_path / "a"), "--out", str(out), "--bootstrap", "10"])
    assert not (tmp_path / "nowhere").exists()
    for argv in (["--merge", str(tmp_path / "a"), "--out", ""], ["--out", " "]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and "names no folder" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    real_write, real_unlink = Path.write_text, Path.unlink

    def read_only(real):
        def refuse(self, *a, **kw):
            if self.parent == ro:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real(self, *a, **kw)
        return refuse
    monkeypatch.setattr(Path, "write_text", read_only(real_write))
    monkeypatch.setattr(Path, "unlink", read_only(real_unlink))
    with pytest.raises(cli.WriteError, match=f"cannot write {ro}/results.json: Read-only file "
                                             "system"):
        bench.main(["--merge", str(tmp_path / "a"), "--out", str(ro), "--bootstrap", "10"])
