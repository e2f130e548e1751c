"""Structure of the Python package: no import cycle between fastdp's modules.

The imports are read from the source tree with ``ast`` (not by importing it): module-level and function-level
``import fastdp.x``, ``from fastdp.x import y``, ``from . import x`` and ``from .x import y``. An edge goes to the
module that the statement runs: ``from . import x`` names submodule ``x`` when there is one, and the package's
``__init__`` otherwise (``from . import __version__``). The implicit import of a module's parent packages is not
an edge: Python runs a package's ``__init__`` before any of its submodules whatever the submodule's code says.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python"
PACKAGE = "fastdp"


def _modules(root=ROOT, package=PACKAGE):
    """{dotted name: (source path, is a package)} for every .py file under the package; compiled extensions
    (their C sources build them, e.g. ``fastdp._C``) are added as leaves without source."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


EXTENSIONS = {f"{PACKAGE}._C"}  # built from csrc/python/module.c; it imports no Python module of fastdp


def _resolve_base(name, is_package, level, module):
    if level == 0:
        return module
    base = name.split(".") if is_package else name.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _edges(name, path, is_package, known):
    """The fastdp modules that module `name` imports (anywhere in its code), with the line of each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {}

    def add(target, line):
        if target in known and target != name:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(name, is_package, node.level, node.module)
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
    return found


def import_graph(root=ROOT, package=PACKAGE):
    modules = _modules(root, package)
    known = set(modules) | EXTENSIONS
    return {name: _edges(name, path, is_pkg, known) for name, (path, is_pkg) in modules.items()}


def find_cycles(graph):
    """Every elementary cycle's smallest witness per strongly connected component, as lists of module names
    (first module repeated at the end); empty when the graph is acyclic."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):  # Tarjan's algorithm (the graph has a few dozen nodes: recursion is fine)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in comps:
        if len(comp) < 2:
            continue
        members = set(comp)
        start = min(comp)
        # Shortest path back to start inside the component (breadth-first): a concrete cycle to name.
        prev, frontier, last = {start: None}, [start], None
        while last is None:
            last = next((v for v in frontier if start in graph[v]), None)
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        cycles.append(list(reversed(path)) + [start])
    return cycles


def _describe(graph, cycle):
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return " ; ".join(steps)


def test_no_import_cycle():
    graph = import_graph()
    assert f"{PACKAGE}.data_parallel" in graph  # the tree was found
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in python/fastdp:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_cycle_finder_names_a_cycle(tmp_path):
    """The checker on a made-up package: a function-level import closes a cycle, and it is named."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n__version__ = '0'\n")
    (pkg / "a.py").write_text("from . import b\n\ndef f():\n    return b.g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text("from . import __version__\n")
    graph = import_graph(tmp_path)
    assert graph[f"{PACKAGE}.c"] == {PACKAGE: 1}  # a name of the package's __init__, not a submodule
    assert find_cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]]
    (pkg / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycles(import_graph(tmp_path)) == []


@pytest.mark.parametrize("statement, target", [
    ("import fastdp.comm", "fastdp.comm"),
    ("from fastdp import comm", "fastdp.comm"),
    ("from fastdp.comm import gather", "fastdp.comm"),
    ("from .. import comm", "fastdp.comm"),
    ("from .._core import x", "fastdp._core"),
    ("from . import train", "fastdp.bench.train"),
])
def test_edges_of_each_import_form(tmp_path, statement, target):
    pkg = tmp_path / PACKAGE
    (pkg / "bench").mkdir(parents=True)
    for f in ("__init__.py", "comm.py", "_core.py", "bench/__init__.py", "bench/train.py"):
        (pkg / f).write_text("")
    (pkg / "bench" / "x.py").write_text(f"def f():\n    {statement}\n")
    assert import_graph(tmp_path)[f"{PACKAGE}.bench.x"] == {target: 2}


def test_public_balance_names_come_from_their_modules():
    """``fastdp.balance`` (in fastdp.__all__) stays the namespace of balancing device 0; its names are the split
    and memory modules' own objects, as are the package-level ones."""
    import fastdp
    from fastdp._balance import memory
    from fastdp._balance import split
    from fastdp import balance

    for name in balance.__all__:
        home = split if hasattr(split, name) else memory
        assert getattr(balance, name) is getattr(home, name), name
    assert (fastdp.AutoSplit, fastdp.MemoryReport, fastdp.memory_report) == (
        split.AutoSplit, memory.MemoryReport, memory.memory_report)
