"""The house: the method at the top level, everything else in wings, imports running downhill.

Read from the source with `ast` (nothing is imported): every `import` of a project module, at module
level or inside a function, is an edge of the graph."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINGS = ("harness", "offline")
METHOD = ("model", "kernels", "cache", "gate", "teacher", "generate", "features", "cli")
# the one import from the method into a wing: cli.resolve_model converts an offline model on first
# use
ALLOWED_UP = {("cli", "offline.models")}


def modules():
    """{'gate': path, 'harness.quality': path, ...}: the project's Python modules, tests
    excluded."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[0].startswith("."):
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path, known):
    """The project modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in known]
            names = subs or [node.module]  # `from pkg import module` imports the module
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph():
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def closure(g, start):
    seen, todo = set(), [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_top_level_is_the_method_and_its_programs():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 10, top
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in ROOT.glob("*.py")}
    assert max(lines.values()) < 800, lines
    for wing in WINGS:
        assert (ROOT / wing / "__init__.py").exists(), wing


def test_imports_run_downhill():
    g = graph()
    for m in METHOD:
        up = {x for x in g[m] if x.split(".")[0] in WINGS or x == "bench" or x == "train_gate"}
        assert up <= {x for a, x in ALLOWED_UP if a == m}, (m, up)
    trainer = closure(g, "train_gate")
    assert not {m for m in trainer if m.split(".")[0] == "harness" or m == "bench"}, trainer
    assert not any(m.startswith("tools") for m in g), ("no tools/ scripts: the wings are harness/ "
                                                       "and offline/")


def test_no_import_cycle():
    """No cycle but through the one lazy first-use import (ALLOWED_UP), which runs after both
    modules have loaded."""
    g = graph()
    for a, b in ALLOWED_UP:
        g[a].discard(b)
    for m in g:
        assert m not in closure(g,
                                m), f"{m} imports itself through {sorted(closure(g, m) & set(g))}"


def test_lines_read_side_by_side():
    """At most 5% of the Python lines over 100 characters (nanoGPT, nano-vllm, gpt-fast: about 3%);
    none over 120 (ruff checks that too, in .ci/run)."""
    paths = [p for p in ROOT.rglob("*.py") if not p.relative_to(ROOT).parts[0].startswith(".")]
    lines = [x for p in paths for x in p.read_text(encoding="utf-8").splitlines()]
    long = [x for x in lines if len(x) > 100]
    assert len(long) <= 0.05 * len(lines), f"{len(long)} of {len(lines)} lines over 100 characters"
    assert not [x for x in long if len(x) > 120]
