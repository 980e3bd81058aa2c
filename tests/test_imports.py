"""No import cycle among the project's modules, counting every import: at module level, inside
functions and inside `if __name__ == "__main__":` blocks. A program (generate.py, train_gate.py)
imports its command line (commands/) in its main; the command line never imports the program back,
so `python generate.py` loads generate.py once, as __main__.

Read from the source with `ast`: nothing is imported."""
import ast

from tests.test_layout import modules


def every_import(path, known):
    """The project modules `path` imports anywhere in the file."""
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


def find_cycle(graph):
    """One cycle of the graph {module: modules it imports} as a list [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the current path, "done" once explored

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n, path + [n])):
                return cycle
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m, [m])):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_counting_main_blocks_and_functions():
    known = modules()
    graph = {name: every_import(path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
