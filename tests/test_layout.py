"""The house: the method at the top level, everything else in wings, imports running downhill.

Read from the source with `ast` (nothing is imported): every `import` of a project module, at module
level or inside a function, is an edge of the graph; but those in an
`if __name__ == "__main__":` block. A program's main imports its command line (PROGRAMS);
tests/test_imports.py counts every import, those blocks included, and finds no cycle."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINGS = ("harness", "offline", "formats", "commands", "serving")
# the method: what a forker reads (README's "read in this order" walks it)
METHOD = ("model", "kernels", "cache", "gate", "prompts", "teacher", "generate", "train_gate")
# the modules that lift out of the project with only what they import (tests/test_lift_out.py)
LIFT_OUT = {"kernels": set(), "gate": set(), "cache": {"kernels"}}
# the one import from a top-level module into a wing: cli.resolve_model converts an offline model
# on first use
ALLOWED_UP = {("cli", "offline.models")}
# a program's main imports its command line (flags, checks, files, printing); never the reverse
# (tests/test_imports.py)
PROGRAMS = {"generate": "commands.generate", "train_gate": "commands.train_gate"}


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


def _is_main_block(node):
    """`if __name__ == "__main__":`"""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and getattr(t.comparators[0], "value", None) == "__main__")


def _nodes(tree):
    """Every node of the tree, but those under a program's `if __name__ == "__main__":`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_main_block(c))


def imports(path, known, main_blocks=False):
    """The project modules `path` imports, anywhere in the file but its `__main__` block (with
    main_blocks: there too)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree) if main_blocks else _nodes(tree):
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


def lines_of(name):
    return (ROOT / f"{name}.py").read_text(encoding="utf-8").splitlines()


def test_top_level_is_the_method_and_its_programs():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    # eight method modules (METHOD) and two edges: cli.py, bench.py
    assert len(top) <= 10, top
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in ROOT.glob("*.py")}
    assert max(lines.values()) < 800, lines
    for wing in WINGS:
        assert (ROOT / wing / "__init__.py").exists(), wing


def test_the_method_modules_hold_the_method():
    """Together under 4,000 lines, each under 700, so that a forker's first change has room (what
    is not the paper's path lives in wings: batched serving in serving/); checks are short asserts
    or moved to the edges (formats/, commands/, cli.py): at most 64 `raise` in the eight (130
    before the move)."""
    lines = {m: lines_of(m) for m in METHOD}
    assert sum(map(len, lines.values())) < 4000, {m: len(x) for m, x in lines.items()}
    assert max(map(len, lines.values())) < 700, {m: len(x) for m, x in lines.items()}
    raises = {m: sum(isinstance(n, ast.Raise) for n in ast.walk(ast.parse("\n".join(x))))
              for m, x in lines.items()}
    assert sum(raises.values()) <= 64, raises


def test_imports_run_downhill():
    """The method imports no wing and no program's edge (cli.py, bench.py); the
    wings and the edges import no program (bench.py); cli.py no wing but the first-use model
    conversion; the trainer reaches nothing of the benchmark."""
    g = graph()
    wing = lambda x: x.split(".")[0] in WINGS
    for m in METHOD:
        up = {x for x in g[m] if wing(x) or x in ("cli", "bench")} - {PROGRAMS.get(m)}
        assert not up, (m, up)
    for m, allowed in LIFT_OUT.items():
        assert g[m] == allowed, (m, g[m])
    for m in g:
        assert "bench" not in g[m], (m, "imports bench.py")
    assert {x for x in g["cli"] if wing(x)} <= {x for a, x in ALLOWED_UP if a == "cli"}, g["cli"]
    trainer = closure(g, "commands.train_gate")
    assert not {m for m in trainer if m.split(".")[0] == "harness" or m == "bench"}, trainer


def test_no_import_cycle():
    g = graph()
    for m in g:
        assert m not in closure(g, m), f"{m} imports itself through {sorted(closure(g, m) & set(g))}"


def test_lines_read_side_by_side():
    """Each method module: at most 3% of its lines over 100 characters (nanoGPT, nano-vllm,
    gpt-fast: about 3%); the whole project at most 5%; none over 120 (ruff checks that too)."""
    for m in METHOD:
        lines = lines_of(m)
        long = [x for x in lines if len(x) > 100]
        assert len(long) <= 0.03 * len(lines), f"{m}.py: {len(long)} of {len(lines)} lines over 100"
    paths = [p for p in ROOT.rglob("*.py") if not p.relative_to(ROOT).parts[0].startswith(".")]
    lines = [x for p in paths for x in p.read_text(encoding="utf-8").splitlines()]
    long = [x for x in lines if len(x) > 100]
    assert len(long) <= 0.05 * len(lines), f"{len(long)} of {len(lines)} lines over 100 characters"
    assert not [x for x in long if len(x) > 120]
