"""The Python package's shape, measured: its import graph (cycles, depth), its longest and most branching functions,
its longest files, and the path one backward takes through the reduction (the modules it enters in order, and how
often it comes back to a module it already left).

    python scripts/structure.py            # static measures of python/fastdp (no torch needed)
    python scripts/structure.py --trace    # also one backward on 2 emulated replicas (needs the installed fastdp)

The limits the tests hold the package to (tests/test_python_layers.py) are the same numbers: no function over
cyclomatic complexity 15 outside bench/, no file over 700 lines, no import cycle.
"""

import argparse
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "fastdp"
COMPLEXITY_LIMIT = 15
LINES_LIMIT = 700


def _import_reader():
    """The project's reader of the package's imports (tests/test_structure.py: import_graph, find_cycles)."""
    spec = importlib.util.spec_from_file_location("fastdp_structure", ROOT / "tests" / "test_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules():
    """{module name: path} for every module of the package, bench/ included."""
    return {name: path for name, (path, _) in _import_reader()._modules().items()}


def longest_chain(graph):
    """The longest chain of imports (a list of modules, importer first), for an acyclic graph."""
    memo = {}

    def longest(v):
        if v not in memo:
            memo[v] = [v] + max((longest(w) for w in graph.get(v, ())), key=len, default=[])
        return memo[v]

    return max((longest(v) for v in graph), key=len, default=[])


def complexity(func):
    """Cyclomatic complexity as radon counts it: 1, plus one per branch point (if/elif, loops, except, conditional
    expression, comprehension and its ifs, assert), plus one per extra operand of ``and``/``or``; nested
    functions and classes count on their own."""
    score = 1

    def visit(node):
        nonlocal score
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler)):
                score += 1
            elif isinstance(child, ast.comprehension):
                score += 1 + len(child.ifs)
            elif isinstance(child, ast.BoolOp):
                score += len(child.values) - 1
            elif isinstance(child, (ast.Try,)) and child.orelse:
                score += 1
            elif isinstance(child, (ast.For, ast.While)) and child.orelse:
                score += 1
            visit(child)

    visit(func)
    return score


def functions(mods):
    """(module, qualified name, first line, lines, complexity) for every function and method."""
    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))

        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}{child.name}"
                    out.append((name, qual, child.lineno, child.end_lineno - child.lineno + 1, complexity(child)))
                    walk(child, qual + ".")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

        walk(tree, "")
    return out


def source_files():
    """The project's source files git tracks (Python, C, CUDA, shell)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in out.split() if Path(name).suffix in (".py", ".c", ".h", ".cc", ".cu", ".sh")
            and (ROOT / name).is_file()]


def line_count(path):
    return len(path.read_text(errors="replace").splitlines())


def trace_backward(graph):
    """One backward on 2 emulated replicas, on every thread: the fastdp modules it enters (in the order first
    entered), the distinct calls from one module into another, and the calls that go back up: into a module the
    caller does not import (a callback, or a module handing control back to one above it)."""
    import threading

    import torch

    import fastdp

    root = str(Path(fastdp.__file__).parent)

    def module_of(frame):
        file = frame.f_code.co_filename
        if not file.startswith(root):
            return None
        return "fastdp" + file[len(root):].removesuffix(".py").removesuffix("/__init__").replace("/", ".")

    below = {}

    def imports_of(m):
        if m not in below:
            below[m] = set()
            for t in graph.get(m, ()):
                below[m] |= {t} | imports_of(t)
        return below[m]

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, bucket_cap_mb=1e-4)
    for _ in range(2):  # the second step is the steady state
        loss = dp(torch.randn(8, 8)).sum()
    entered, edges, upward = [], set(), []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None:
            return
        if callee not in entered:
            entered.append(callee)
        caller = module_of(frame.f_back) if frame.f_back is not None else None
        if caller is not None and caller != callee:
            edges.add((caller, callee))
            if callee not in imports_of(caller):
                upward.append((caller, callee))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entered, edges, upward


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="trace one backward through the reduction")
    args = parser.parse_args(argv)
    reader = _import_reader()
    mods = modules()
    graph = reader.import_graph()
    found = reader.find_cycles(graph)
    print(f"modules: {len(mods)} in {len({p.parent for p in mods.values()})} folders")
    print(f"import cycles: {found or 'none'}")
    if not found:  # the library's own chain: the benchmarks and `python -m fastdp` sit on top of it
        chain = longest_chain({m: {t for t in ts if not t.startswith("fastdp.bench")} for m, ts in graph.items()
                               if not (m.startswith("fastdp.bench") or m == "fastdp.__main__")})
        print(f"import depth: {len(chain)} modules ({' > '.join(m.removeprefix('fastdp.') for m in chain)})")
    widest = max(graph, key=lambda m: len(graph[m]))
    print(f"most imports: {widest} ({len(graph[widest])} package modules)")
    funcs = functions(mods)
    for label, pool in (("", funcs), (" outside bench/", [f for f in funcs if ".bench" not in f[0]])):
        longest = max(pool, key=lambda f: f[3])
        print(f"longest function{label}: {longest[0]}.{longest[1]} ({longest[3]} lines)")
    over = [f for f in funcs if f[4] > COMPLEXITY_LIMIT and ".bench" not in f[0]]
    print(f"functions over complexity {COMPLEXITY_LIMIT} outside bench/: {len(over)}")
    for mod, qual, line, _, score in sorted(over, key=lambda f: -f[4]):
        print(f"  {score:3d}  {mod}.{qual} (line {line})")
    long_files = sorted((line_count(p), p) for p in source_files())
    long_files = [(n, p) for n, p in long_files if n > LINES_LIMIT]
    print(f"files over {LINES_LIMIT} lines: {len(long_files)}")
    for n, p in long_files:
        print(f"  {n:5d}  {p.relative_to(ROOT)}")
    if args.trace:
        entered, edges, upward = trace_backward(graph)
        short = lambda m: m.removeprefix("fastdp.")  # noqa: E731
        print(f"one backward enters {len(entered)} modules: {', '.join(map(short, entered))}")
        print(f"  {len(edges)} distinct calls between modules; {len(upward)} calls back up into a module the caller "
              f"does not import: {sorted({f'{short(a)} -> {short(b)}' for a, b in upward})}")


if __name__ == "__main__":
    main()
