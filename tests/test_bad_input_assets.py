"""Bad input to the asset builder (python -m offline.fetch_assets) and the GPU check's output folder
(python -m harness.gpu_check --out): damaged parts, unusable output folders, relative and empty paths.

The builder's parts are replaced by small fakes (two files each), so each test builds in a temporary
folder in well under a second; ~/.cache/fastkvzip/assets is never touched. Every bad input is one
line `error: ...`, exit code 2, no traceback, and nothing left behind."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import offline.fetch_assets as A
from harness import gpu_check
from tests.helpers import no_access

REPO = Path(__file__).resolve().parent.parent


def fetch(monkeypatch, capsys, *argv):
    """`python -m offline.fetch_assets ARGV` in this process -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fetch_assets", *argv])
    code = 0
    try:
        A.main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err, *words):
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def fake_parts(monkeypatch):
    """Each part built by a fake that writes two small files; returns the parts built, in order."""
    built = []

    def builder(part):
        def build(out, dl):
            built.append(part)
            (out / "doc.txt").write_text(f"{part}\n")
            (out / "sub").mkdir()
            (out / "sub" / "more.txt").write_text("more\n")
        return build

    monkeypatch.setattr(A, "BUILDERS", {part: builder(part) for part in A.PARTS})
    monkeypatch.delenv("FASTKVZIP_ASSETS", raising=False)
    monkeypatch.delenv("FASTKVZIP_CACHE", raising=False)
    return built


def built_folder(root):
    return sorted(p.name for p in root.iterdir()) == sorted(
        ["MANIFEST.txt", "austen", "austen_parts", "corpus", "pydoc", "tokenizers"])


# ---- a damaged part present is checked against its recorded hash and rebuilt --------------------

def test_a_damaged_part_present_is_rebuilt_in_one_line(tmp_path, monkeypatch, capsys, fake_parts):
    root = tmp_path / "assets"
    code, out, err = fetch(monkeypatch, capsys, "--out", str(root))
    assert code == 0 and fake_parts == list(A.PARTS) and built_folder(root), err
    manifest = (root / "MANIFEST.txt").read_text()

    # an intact build: every part checked and skipped, nothing rebuilt, MANIFEST.txt untouched
    fake_parts.clear()
    mtime = (root / "MANIFEST.txt").stat().st_mtime_ns
    code, out, err = fetch(monkeypatch, capsys, "--out", str(root))
    assert code == 0 and fake_parts == [] and out.count(", skipped") == len(A.PARTS), out
    assert (root / "MANIFEST.txt").stat().st_mtime_ns == mtime

    # a file changed, a file gone: those parts rebuilt, one line each naming the files
    (root / "austen" / "doc.txt").write_text("damaged\n")
    (root / "corpus" / "sub" / "more.txt").unlink()
    code, out, err = fetch(monkeypatch, capsys, "--out", str(root))
    assert code == 0 and sorted(fake_parts) == ["austen", "corpus"], out
    lines = out.splitlines()
    for line in ("austen: damaged: 1 file(s) differ from MANIFEST.txt (austen/doc.txt); "
                 "rebuilding it",
                 "corpus: damaged: 1 file(s) differ from MANIFEST.txt (corpus/sub/more.txt); "
                 "rebuilding it",
                 "tokenizers/gemma3: present and intact, skipped"):
        assert f"[fetch_assets] {line}" in lines, out
    assert (root / "austen" / "doc.txt").read_text() == "austen\n"
    assert (root / "corpus" / "sub" / "more.txt").is_file()
    assert (root / "MANIFEST.txt").read_text() == manifest and built_folder(root)

    # a SOURCE.json unreadable, a part's folder replaced by a file
    fake_parts.clear()
    (root / "pydoc" / "SOURCE.json").write_text("{")
    shutil.rmtree(root / "tokenizers" / "qwen3")
    (root / "tokenizers" / "qwen3").write_text("not a part")
    code, out, err = fetch(monkeypatch, capsys, "--out", str(root))
    assert code == 0 and sorted(fake_parts) == ["pydoc", "tokenizers/qwen3"], out
    assert "[fetch_assets] pydoc: its SOURCE.json is unreadable; rebuilding it" in out
    assert "[fetch_assets] tokenizers/qwen3: not a folder; rebuilding it" in out
    assert (root / "MANIFEST.txt").read_text() == manifest and built_folder(root)

    # a damaged MANIFEST.txt alone: rewritten, no part rebuilt
    fake_parts.clear()
    (root / "MANIFEST.txt").write_text("# nothing\n")
    code, out, err = fetch(monkeypatch, capsys, "--out", str(root))
    assert code == 0 and fake_parts == [] and (root / "MANIFEST.txt").read_text() == manifest


# ---- --out a file, a read-only folder, FASTKVZIP_CACHE a file, run by its path ------------------

def test_out_a_file_is_a_one_line_error(tmp_path, monkeypatch, capsys, fake_parts):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for out in (f, f / "assets"):
        code, _, err = fetch(monkeypatch, capsys, "--out", str(out))
        one_line_error(code, err, f"{f} is a file, not a folder", "give --out a folder")
    assert f.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert fake_parts == []


def test_fastkvzip_cache_a_file_is_a_one_line_error(tmp_path, monkeypatch, capsys, fake_parts):
    f = tmp_path / "cache"
    f.write_text("mine")
    monkeypatch.setenv("FASTKVZIP_CACHE", str(f))
    code, _, err = fetch(monkeypatch, capsys)
    one_line_error(code, err, f"FASTKVZIP_CACHE={f} is a file, not a folder",
                   "point FASTKVZIP_CACHE at a folder, or give --out")
    assert f.read_text() == "mine" and fake_parts == []


def test_a_read_only_folder_is_a_one_line_error(tmp_path, monkeypatch, capsys, fake_parts):
    with no_access(tmp_path, 0o555):
        for out in (tmp_path / "assets" / "deeper", tmp_path):  # to be made in it; it
            code, _, err = fetch(monkeypatch, capsys, "--out", str(out))
            one_line_error(code, err, "cannot write in", "Permission denied",
                           "give --out a folder you can write to")
    assert list(tmp_path.iterdir()) == [] and fake_parts == []


def test_run_by_its_path_from_another_folder(tmp_path):
    """`python offline/fetch_assets.py` (not -m) from elsewhere: the project's modules are not on
    the path, and no committed file edits the import path; one line says how to run it (it was
    ModuleNotFoundError: cli), and nothing is touched."""
    f = tmp_path / "f"
    f.write_text("mine")
    r = subprocess.run([sys.executable, str(REPO / "offline" / "fetch_assets.py"), "--out", str(f)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    one_line_error(r.returncode, r.stderr, "python -m offline.fetch_assets", "project's folder")
    assert f.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["f"]


# ---- a relative --out, an empty --out, staging folders of runs that are gone ---------------------

def test_a_relative_out_builds_every_part(tmp_path, monkeypatch, capsys, fake_parts):
    """The builders run commands in the download folder and hand them paths in it (apt-get download,
    then `dpkg -x DEB ROOT`): with a relative --out those paths pointed nowhere, after the parts
    before pydoc were built."""
    def unpack(out, dl):  # as Downloads.deb does
        A.run([sys.executable, "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).mkdir()",
               str(dl.tmp / "unpacked")], dl.tmp)
        (out / "doc.txt").write_text(str((dl.tmp / "unpacked").is_dir()))

    monkeypatch.setitem(A.BUILDERS, "pydoc", unpack)
    monkeypatch.chdir(tmp_path)
    code, out, err = fetch(monkeypatch, capsys, "--out", "rel/assets")
    assert code == 0, err
    assert (tmp_path / "rel" / "assets" / "pydoc" / "doc.txt").read_text() == "True"
    assert built_folder(tmp_path / "rel" / "assets")  # and no staging folder left
    assert out.strip().endswith(f"-> {tmp_path / 'rel' / 'assets'}"), out


def test_an_empty_out_is_refused(tmp_path, monkeypatch, capsys, fake_parts):
    monkeypatch.chdir(tmp_path)
    for out in ("", " "):
        code, _, err = fetch(monkeypatch, capsys, "--out", out)
        one_line_error(code, err, "--out is empty")
    assert list(tmp_path.iterdir()) == [] and fake_parts == []


def test_staging_folders_of_runs_that_are_gone_are_removed(tmp_path, monkeypatch, capsys,
                                                           fake_parts):
    """A run killed (SIGKILL, a reboot) leaves its .fetch-PID folder (and an earlier version's
    .fetch-XXXXXXXX): the next run removes them, but not the one of a run still going."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead, old, live = (tmp_path / f".fetch-{x}" for x in ("999999999", "k3j_x9ab", alive.pid))
        for d in (dead, old, live):
            d.mkdir()
            (d / "half.deb").write_bytes(b"half")
        code, out, err = fetch(monkeypatch, capsys, "--out", str(tmp_path))
        assert code == 0, err
        assert not dead.exists() and not old.exists() and (live / "half.deb").exists()
        assert ("[fetch_assets] removing .fetch-999999999: the staging folder of a run that is "
                "gone") in out.splitlines()
        assert sorted(p.name for p in tmp_path.glob(".fetch-*")) == [live.name]
    finally:
        alive.kill()
        alive.wait()


# ---- harness.gpu_check --out: a file, a read-only parent, "", and only this run's files ---------

@pytest.fixture
def quick_env(monkeypatch):
    """The env part, as a stub that measures nothing (the point here is the folder)."""
    monkeypatch.setitem(gpu_check.PARTS, "env", lambda S, run, res: res.update(stub=True))


def gpu_check_main(capsys, *argv):
    code = 0
    try:
        gpu_check.main(["--dry-run", "--parts", "env", *argv])
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gpu_check_out_a_file_or_empty_is_a_one_line_error(tmp_path, monkeypatch, capsys,
                                                           quick_env):
    f = tmp_path / "f"
    f.write_text("mine")
    for out in (f, f / "sub"):
        code, _, err = gpu_check_main(capsys, "--out", str(out))
        one_line_error(code, err, f"{f} is a file, not a folder", "give --out a folder")
    monkeypatch.chdir(tmp_path)
    code, _, err = gpu_check_main(capsys, "--out", "")
    one_line_error(code, err, "--out is empty")
    assert f.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_gpu_check_read_only_parent_is_a_one_line_error(tmp_path, capsys, quick_env):
    (tmp_path / "ro").mkdir()
    with no_access(tmp_path / "ro", 0o555):
        for out in (tmp_path / "ro" / "gpu" / "run1", tmp_path / "ro"):
            code, _, err = gpu_check_main(capsys, "--out", str(out))
            one_line_error(code, err, "cannot write in", "Permission denied")
    assert list((tmp_path / "ro").iterdir()) == []


def test_gpu_check_lists_only_the_files_it_wrote(tmp_path, capsys, quick_env):
    (tmp_path / "kernel.json").write_text("{}")  # an earlier run's
    code, out, err = gpu_check_main(capsys, "--out", str(tmp_path))
    assert code == 0, err
    assert out.strip().splitlines()[-1] == f"[gpu_check] wrote env.json, summary.md in {tmp_path}"
