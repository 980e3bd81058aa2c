"""No import cycle among the project's modules, counting every import: at module level, inside
functions and inside `if __name__ == "__main__":` blocks. A program (generate.py, train_gate.py)
imports its command line (commands/) in its main; the command line never imports the program back,
so `python generate.py` loads generate.py once, as __main__.

Read from the source with `ast`: nothing is imported."""
from tests.test_layout import imports, modules


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
    graph = {name: imports(path, known, main_blocks=True) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
