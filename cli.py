"""What the command-line scripts (generate.py, train_gate.py, bench.py) share: one-line errors with exit
code 2, Ctrl-C as one line with exit code 130, outputs written atomically, and matplotlib for --plot."""
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path


class UsageError(Exception):
    """Bad input (flags, files, folders): printed by `main` as one line, exit code 2."""


def main(run, args, *errors, interrupted=lambda args: "interrupted"):
    """run(args), with a UsageError or any of `errors` (model.ModelError, gate.GateError, ...) reported as
    one line `error: message` and exit code 2 instead of a traceback, and Ctrl-C as the line
    interrupted(args) (what was kept, how to resume) and exit code 130."""
    try:
        return run(args)
    except (UsageError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"\n{interrupted(args)}", file=sys.stderr)
        sys.exit(130)


@contextmanager
def atomic_path(path):
    """A temporary name beside `path` to write to; it replaces `path` when the block ends without error
    (os.replace), so a killed run never leaves half a file, and is removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text):
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path, obj, indent=2):
    """obj as UTF-8 JSON text (non-ASCII characters as they are) ending in a newline, written atomically."""
    write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install -r requirements.txt); no plot written", file=sys.stderr)
        return None
    return plt


def save_figure(fig, path, dpi=120):
    """Write a figure as PNG atomically and free it."""
    import matplotlib.pyplot as plt
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    return path
