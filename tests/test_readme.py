"""README.md's library example runs as written and answers the first command's question."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def library_example():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Use it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_example_is_short_and_uses_the_method_modules_only():
    code = library_example()
    lines = [x for x in code.splitlines() if x.strip() and not x.startswith(("import", "from"))]
    assert len(lines) <= 12, lines
    modules = set(re.findall(r"^(?:from|import) (\w+)", code, flags=re.M))
    assert modules <= {"torch", "cache", "cli", "generate", "model", "teacher"}, modules


@pytest.mark.slow
def test_the_example_answers_as_the_first_command():
    """The offline Gemma 3 270M (converted on first use), the shipped chapter at budget 0.3."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", library_example()], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "twenty-nine" in r.stdout, r.stdout
