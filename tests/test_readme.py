"""README.md's library example runs as written and answers the first command's question."""
import importlib
import inspect
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
    assert len(lines) <= 13, lines
    modules = set(re.findall(r"^(?:from|import) (\w+)", code, flags=re.M))
    # the method's modules and the edge that resolves a model name; no file-format wing
    assert modules <= {"torch", "cache", "cli", "gate", "generate", "model", "prompts"}, modules


@pytest.mark.slow
def test_the_example_answers_as_the_first_command():
    """The offline Gemma 3 270M (converted on first use), the shipped chapter at budget 0.3."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", library_example()], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "twenty-nine" in r.stdout, r.stdout


README = ROOT / "README.md"
FIRST_COMMANDS = (
    'pip install -r requirements.txt && python generate.py --context-file '
    'examples/persuasion-chapter-1.txt --question "How old is Elizabeth?"',
    "pip install -q -r requirements-test.txt && python -m offline.fetch_assets && "
    "python -m pytest -q tests")


def test_the_front_door_is_short_and_opens_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 12_000, len(text.encode())
    commands = [x for x in text.split("```bash\n", 1)[1].split("```")[0].splitlines()
                if not x.startswith("#")]
    assert tuple(commands[:2]) == FIRST_COMMANDS, commands


def test_how_it_works_shows_the_code_as_it_is():
    """Every line of the snippet is a line of generate.prefill, comments included."""
    import generate
    section = README.read_text(encoding="utf-8").split("## How it works", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    code = {x.strip() for x in inspect.getsource(generate.prefill).splitlines()}
    missing = [x for x in snippet.splitlines() if x.strip() not in code]
    assert not missing, missing


def test_the_reading_order_names_what_is_there():
    """Each `module.name` or `module.Class.method` the reading order points at exists, in at
    most the seven method modules (model.py for the one line where attention hands the cache its
    input)."""
    section = README.read_text(encoding="utf-8").split("**Read in this order**", 1)[1]
    section = section.split("\n\n", 2)[1]
    files = re.findall(r"^\d+\. `(\w+)\.py`", section, flags=re.M)
    assert 0 < len(files) <= 7, files
    for item in re.split(r"^\d+\. ", section, flags=re.M)[1:]:
        module = importlib.import_module(re.match(r"`(\w+)\.py`", item).group(1))
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", item.split(":", 1)[1]):
            obj = module
            for part in name.split("."):
                obj = getattr(obj, part, None)
            assert obj is not None, f"{module.__name__}.py has no {name}"


def test_links_resolve():
    """Every relative link of the front door and the pages it links to names a file or folder
    of the repository."""
    pages = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "gpu-check.md",
             ROOT / "benchmarks" / "README.md", ROOT / "offline" / "README.md"]
    for page in pages:
        for link in re.findall(r"\]\(([^)#]+)\)", page.read_text(encoding="utf-8")):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name}: {link}"
