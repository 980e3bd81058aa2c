"""Bad input on generate.py's saved-cache command line: --save-cache never replaces what
is not a cache this project wrote, a --save-cache that cannot be written is refused before
anything loads, a "cache_file" in --batch names its line and never echoes the file,
and --load-cache refuses the flags it would ignore.

The refusals are checked before any model loads: `no_loading` makes reaching the loader a test
failure, and those that need the tokenizer (a batch's cache_file is checked against the model)
stop before the weights (`no_weights`)."""
import json
import os
import shutil
import stat

import pytest

import cli
import commands.generate as G
import generate
from tests.helpers import run_main
from tests.test_saved_cache import tiny_setup


def one_line(code, err, *words):
    """exit 2, one line `error: ...`, no traceback, holding every word."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_loading(monkeypatch):
    """Reaching the model (its folder, tokenizer or weights) fails the test: the refusal came
    late."""
    def reached(*a, **k):
        raise AssertionError("the model was reached: the flags were not refused first")
    monkeypatch.setattr(G, "model_setup", reached)
    monkeypatch.setattr(G, "load_checked", reached)


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the weights fails the test (the tokenizer and config may be read)."""
    def reached(*a, **k):
        raise AssertionError("the weights were loaded: the refusal came late")
    monkeypatch.setattr(G, "load_checked", reached)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Gemma3 folder with a byte tokenizer and a gate file, a document, and a cache of it
    saved by generate.py."""
    folder = tmp_path_factory.mktemp("cli")
    t = tiny_setup("gemma3", folder / "model")
    doc = folder / "doc.txt"
    doc.write_text("Emma lives in Highbury. The code is 4721. " * 8)
    flags = ["--model", str(t["folder"]), "--gate", str(t["gate_file"]), "--window", "8"]
    kv = folder / "doc.kv"
    code, _, err = _run(*flags, "--context-file", str(doc), "--save-cache", str(kv),
                        "--max-new-tokens", "0")
    assert code == 0, err
    return dict(t, doc=doc, kv=kv, flags=flags)


def _run(*argv):
    """main() outside a test's capsys (for the module fixture): (exit code, out, err)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            generate.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


# -- --save-cache replaces only a cache this project saved -----------------------------------------

NOTES = "My notes: Emma lives in Highbury. The code is 4721.\n" * 4


def test_save_cache_onto_the_context_file_is_refused_before_the_model(capsys, tmp_path,
                                                                      no_loading):
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    res = run_main(capsys, "--context-file", str(notes), "--save-cache", str(notes),
                   "--max-new-tokens", "0")
    one_line(*res[::2], "--save-cache", str(notes), "--context-file")
    assert notes.read_text() == NOTES
    link = tmp_path / "link.txt"  # the same file under another name: still refused
    os.link(notes, link)
    res = run_main(capsys, "--context-file", str(link), "--save-cache", str(notes))
    one_line(*res[::2], str(notes), "--context-file")
    assert notes.read_text() == NOTES and sorted(os.listdir(tmp_path)) == ["link.txt", "notes.txt"]


def test_save_cache_onto_a_file_that_is_not_a_cache_is_refused(capsys, tmp_path, no_loading):
    """A text file, an empty file, a safetensors file that is not a cache (a gate): not replaced;
    the line says how to replace it deliberately."""
    files = {"other.txt": NOTES.encode(), "empty.kv": b"",
             "fake.kv": b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a": 1}        '}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "doc.txt").write_text(NOTES)
    for name, data in files.items():
        path = tmp_path / name
        res = run_main(capsys, "--context-file", str(tmp_path / "doc.txt"), "--save-cache",
                       str(path))
        one_line(*res[::2], str(path), "not a cache", "delete it first")
        assert path.read_bytes() == data
    assert sorted(os.listdir(tmp_path)) == sorted([*files, "doc.txt"])  # no temporary left


def test_save_cache_onto_what_is_not_a_regular_file_is_refused(capsys, tmp_path, no_loading):
    """A device node (as /dev/null is), a FIFO, a folder, a symbolic link: refused, left as they
    were."""
    (tmp_path / "doc.txt").write_text(NOTES)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    os.symlink(tmp_path / "doc.txt", tmp_path / "link.kv")
    cases = [("fifo", stat.S_ISFIFO, "pipe"), ("folder", stat.S_ISDIR, "folder"),
             ("link.kv", stat.S_ISLNK, "symbolic link")]
    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        cases.append(("null", stat.S_ISCHR, "device"))
    except PermissionError:  # not root: the FIFO stands for it
        pass
    for name, kind, word in cases:
        path = tmp_path / name
        res = run_main(capsys, "--context-file", str(tmp_path / "doc.txt"), "--save-cache",
                       str(path))
        one_line(*res[::2], str(path), word)
        assert kind(os.lstat(path).st_mode), name
    assert (tmp_path / "doc.txt").read_text() == NOTES
    assert sorted(os.listdir(tmp_path)) == sorted(["doc.txt", "fifo", "folder", "link.kv"]
                                                  + (["null"] if len(cases) == 4 else []))


def test_an_atomic_write_never_replaces_a_device_or_a_pipe(tmp_path):
    """The writers' guard (cli.atomic_path: every output, formats.tensor_file too): os.replace
    would turn a device node or a FIFO into a regular file."""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(cli.WriteError, match="not a regular file"):
        with cli.atomic_path(tmp_path / "fifo") as tmp:
            tmp.write_text("x")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert os.listdir(tmp_path) == ["fifo"]


def test_a_cache_saved_here_is_replaced(capsys, tiny, tmp_path):
    kv = tmp_path / "doc.kv"
    kv.write_bytes(tiny["kv"].read_bytes())
    res = run_main(capsys, *tiny["flags"], "--context-file", str(tiny["doc"]), "--save-cache",
                   str(kv), "--budget", "0.5", "--max-new-tokens", "0", "--json")
    assert res[0] == 0, res[2]
    assert kv.read_bytes() != tiny["kv"].read_bytes()
    assert os.listdir(tmp_path) == ["doc.kv"]


def test_a_killed_writers_temporary_is_swept_by_the_next_save(capsys, tiny, tmp_path):
    """--save-cache killed with -9 mid-write leaves .NAME.tmpPID beside the target, which no later
    --save-cache to that name removed; now the next write of the name removes the temporaries of
    writers that are gone (cli.dead_temporaries, which train_gate's sweep shares), never a live
    writer's."""
    import subprocess
    import sys

    from commands import features
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kv = tmp_path / "doc.kv"
        names = [f".doc.kv.tmp{dead}", f".doc.kv.tmp{live.pid}", f".other.kv.tmp{dead}"]
        for name in names:
            (tmp_path / name).write_bytes(bytes(1000))
        res = run_main(capsys, *tiny["flags"], "--context-file", str(tiny["doc"]),
                       "--save-cache", str(kv), "--max-new-tokens", "0")
        assert res[0] == 0, res[2]
        assert sorted(os.listdir(tmp_path)) == sorted(["doc.kv"] + names[1:])
        # train_gate's sweep of its --out: the dead writer's, not the live one's
        (tmp_path / f".metrics.json.tmp{dead}").write_bytes(bytes(10))
        features.sweep_temporaries(tmp_path, [], 0)
        assert sorted(os.listdir(tmp_path)) == sorted(["doc.kv", names[1]])
    finally:
        live.kill(), live.wait()


# -- a --save-cache that cannot be written: refused before anything loads -------------------------

def test_save_cache_that_cannot_be_written_is_refused_before_the_model(capsys, tmp_path,
                                                                      no_loading, monkeypatch):
    (tmp_path / "doc.txt").write_text(NOTES)
    doc = ["--context-file", str(tmp_path / "doc.txt")]
    res = run_main(capsys, *doc, "--save-cache", "")
    one_line(*res[::2], "--save-cache", "file name")
    res = run_main(capsys, *doc, "--save-cache", str(tmp_path / "new") + "/")
    one_line(*res[::2], "--save-cache", "folder")
    missing = tmp_path / "no-such-folder" / "x.kv"
    res = run_main(capsys, *doc, "--save-cache", str(missing))
    one_line(*res[::2], "cannot write", str(missing), "no-such-folder")
    res = run_main(capsys, *doc, "--save-cache", str(tmp_path / "doc.txt" / "x.kv"))
    one_line(*res[::2], "cannot write", "not a folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access  # root may write anywhere: the folder says it may not
    monkeypatch.setattr(os, "access", lambda p, mode, **k: (os.fspath(p) != str(locked)
                                                            and real_access(p, mode, **k)))
    res = run_main(capsys, *doc, "--save-cache", str(locked / "x.kv"))
    one_line(*res[::2], "cannot write", str(locked), "not writable")
    assert sorted(os.listdir(tmp_path)) == ["doc.txt", "locked"] and not os.listdir(locked)


# -- a "cache_file" in --batch: errors name the line, never echo the file --------------------------

def test_batch_cache_file_errors_name_the_line_and_echo_nothing(capsys, tiny, tmp_path, no_weights):
    passwd = tmp_path / "passwd"  # as /etc/passwd: its first 8 bytes read as a header length
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    truncated = tmp_path / "cut.kv"
    truncated.write_bytes(tiny["kv"].read_bytes()[:-100])
    for path, words in [(passwd, []), (truncated, ["truncated"]),
                        (tmp_path / "none.kv", ["No such file"])]:
        lines = [{"context": "Water boils at 100 degrees.", "questions": ["At what?"]},
                 {"cache_file": str(tiny["kv"]), "questions": ["Q?"]},
                 {"cache_file": str(path), "questions": ["Q?"]}]
        (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        res = run_main(capsys, *tiny["flags"], "--batch", str(tmp_path / "r.jsonl"))
        line = one_line(*res[::2], "r.jsonl line 3", "cache_file", str(path), *words)
        assert str(int.from_bytes(b"root:x:0", "little")) not in line
        assert "header of" not in line, line


def test_batch_cache_file_corrupt_at_load_names_the_line(capsys, tiny, tmp_path):
    """A checksum that fails is found when the cache loads, after the model: still the line."""
    data = bytearray(tiny["kv"].read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "bad.kv").write_bytes(bytes(data))
    lines = [{"cache_file": str(tiny["kv"]), "questions": ["Q?"]},
             {"cache_file": str(tmp_path / "bad.kv"), "questions": ["Q?"]}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = run_main(capsys, *tiny["flags"], "--batch", str(tmp_path / "r.jsonl"),
                   "--max-new-tokens", "2", "--batch-size", "1")
    assert res[0] == 2, res[2]
    err = [x for x in res[2].strip().splitlines() if x.startswith("error: ")]
    assert len(err) == 1 and "r.jsonl line 2" in err[0] and "bad.kv" in err[0], res[2]
    assert "Traceback" not in res[2]


# -- --load-cache refuses what it would ignore; --method full has no level -------------------------

@pytest.mark.parametrize("flags", [["--method", "kvzip"], ["--method", "fastkvzip"],
                                   ["--chunk-size", "512"], ["--window", "8"],
                                   ["--kvzip-softmax", "model"], ["--level", "head"],
                                   ["--decode-level", "head"], ["--decode-window", "8"],
                                   ["--decode-redundancy", "0"]])
def test_load_cache_refuses_what_the_file_decided(capsys, tmp_path, flags, no_loading):
    res = run_main(capsys, "--load-cache", str(tmp_path / "x.kv"), "--question", "q", *flags)
    one_line(*res[::2], "--load-cache", f"drop {flags[0]}")


def test_load_cache_keeps_what_decoding_reads(capsys, tiny):
    """--seed, --temperature, --top-p, --gate, --max-new-tokens act on the answers: allowed."""
    res = run_main(capsys, *[f for f in tiny["flags"] if f not in ("--window", "8")],
                   "--load-cache", str(tiny["kv"]), "--question", "Q?", "--max-new-tokens", "2",
                   "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--json")
    assert res[0] == 0, res[2]


@pytest.mark.parametrize("level", ["calibrated", "global", "head"])
def test_method_full_takes_no_level(capsys, level, no_loading):
    res = run_main(capsys, "--prompt", "hi", "--method", "full", "--level", level)
    one_line(*res[::2], "--method full", "drop --level")


def test_decode_level_needs_decode_time_eviction(capsys, no_loading):
    res = run_main(capsys, "--prompt", "hi", "--decode-level", "head")
    one_line(*res[::2], "--decode-level", "give --decode-tokens-per-head N")
    res = run_main(capsys, "--prompt", "hi", "--decode-window", "8")
    one_line(*res[::2], "--decode-window", "give --decode-tokens-per-head N")


def test_check_save_target_alone(tmp_path):
    """The check is the command line's (commands/generate.py), not the method's or the format's."""
    (tmp_path / "doc.txt").write_text(NOTES)
    with pytest.raises(cli.UsageError, match="not a cache"):
        G.check_save_target(str(tmp_path / "doc.txt"))
    G.check_save_target(str(tmp_path / "new.kv"))  # a new file in a folder that may be written


def test_a_cache_replaced_between_its_check_and_its_load_is_refused(tiny, tmp_path, capsys,
                                                                    monkeypatch):
    """--load-cache checks the file (its model, its system prompt, its length), then loads it:
    a file replaced in between (here: by a cache of another context) is refused in one line
    instead of answered with what was never checked."""
    other = tmp_path / "other.kv"
    doc = tmp_path / "other.txt"
    doc.write_text("Short.")
    code, _, err = _run(*tiny["flags"], "--context-file", str(doc), "--save-cache", str(other),
                        "--max-new-tokens", "0")
    assert code == 0, err
    kv = tmp_path / "doc.kv"
    kv.write_bytes(tiny["kv"].read_bytes())
    load = G.load_cache

    def swapped(path, *a, **k):
        os.replace(other, path)  # after file_request checked it, before the load
        return load(path, *a, **k)

    monkeypatch.setattr(G, "load_cache", swapped)
    flags = [f for f in tiny["flags"] if f not in ("--window", "8")]
    res = run_main(capsys, *flags, "--load-cache", str(kv), "--question", "Q?")
    one_line(res[0], res[2], "changed after it was checked")


# -- a model folder that would load wrongly ---------------------------------------------------------

def test_a_bad_model_folder_is_one_line(capsys, tiny, tmp_path):
    """What the library refuses in a checkpoint (formats/checkpoint.py) reaches generate.py as one
    line, exit 2: a config.json key given twice, RoPE tables that divide by zero or overflow, a
    tensor in two weight files."""
    folder = tmp_path / "m"
    shutil.copytree(tiny["folder"], folder)
    config = folder / "config.json"
    good = config.read_text()
    d = json.loads(good)
    run = lambda: run_main(capsys, "--model", str(folder), "--method", "full", "--prompt", "hi")
    config.write_text(good.replace('"vocab_size":', '"vocab_size": 512, "vocab_size":', 1))
    one_line(*run()[::2], "config.json", "'vocab_size' given twice")
    for rope, words in ((dict(rope_type="yarn", rope_theta=1, factor=4.0), ["rope_theta 1",
                                                                             "divide by zero"]),
                        (dict(rope_type="linear", rope_theta=1e4, factor=1e-300),
                         ["factor 1e-300", "float32"])):
        rp = {**d["rope_parameters"], "full_attention": rope}
        config.write_text(json.dumps({**d, "rope_parameters": rp}))
        one_line(*run()[::2], "rope_parameters.full_attention.", *words)
    config.write_text(good)
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")
    one_line(*run()[::2], "in both model-copy.safetensors and model.safetensors")
