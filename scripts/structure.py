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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "fastdp"
COMPLEXITY_LIMIT = 15
LINES_LIMIT = 700


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    """{module name: path} for every module of the package, bench/ included."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(current, is_package, level, name):
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(mods):
    """{module: set of package modules it imports}, module-level and function-level alike."""
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = _resolve(name, is_package, node.level, node.module)
                else:
                    target = node.module or ""
                for alias in node.names:
                    for candidate in (f"{target}.{alias.name}", target):
                        if candidate in mods and candidate != name:
                            found.add(candidate)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != name:
                        found.add(alias.name)
        graph[name] = found
    return graph


def _without_parents(graph):
    """The graph less the edges from a module to the packages above it (importing a package's sibling through
    ``from . import x`` runs the package's ``__init__`` first, which is not a dependency of the module)."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def depth(graph):
    """The longest chain of imports (in modules), for an acyclic graph."""
    memo = {}

    def longest(v, seen=()):
        if v in memo:
            return memo[v]
        if v in seen:
            return 0
        best = 1 + max((longest(w, seen + (v,)) for w in graph.get(v, ())), default=0)
        memo[v] = best
        return best

    return max((longest(v) for v in graph), default=0)


_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.With, ast.AsyncWith,
             ast.Assert, ast.comprehension)


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


def trace_backward():
    """The modules one backward on 2 emulated replicas enters, in order (consecutive calls in one module merged),
    on every thread."""
    import threading

    import torch

    import fastdp

    root = str(Path(fastdp.__file__).parent)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, bucket_cap_mb=1e-4)
    for _ in range(2):  # the second step is the steady state
        loss = dp(torch.randn(8, 8)).sum()
    path = []

    def profile(frame, event, arg):
        if event != "call":
            return
        file = frame.f_code.co_filename
        if file.startswith(root):
            mod = "fastdp" + file[len(root):].replace("/", ".").removesuffix(".py").removesuffix(".__init__")
            if not path or path[-1] != mod:
                path.append(mod)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    left, returns = set(), 0
    for i, mod in enumerate(path):
        if mod in left:
            returns += 1
        if i + 1 < len(path):
            left.add(mod)
    return path, returns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="trace one backward through the reduction")
    args = parser.parse_args(argv)
    mods = modules()
    graph = _without_parents(imports(mods))
    found = cycles(graph)
    print(f"modules: {len(mods)} in {len({p.parent for p in mods.values()})} folders")
    print(f"import cycles: {found or 'none'}")
    print(f"import depth (longest chain of modules): {depth(graph) if not found else 'n/a (cycles)'}")
    widest = max(graph, key=lambda m: len(graph[m]))
    print(f"most imports: {widest} ({len(graph[widest])} package modules)")
    funcs = functions(mods)
    longest = max(funcs, key=lambda f: f[3])
    print(f"longest function: {longest[0]}.{longest[1]} ({longest[3]} lines)")
    over = [f for f in funcs if f[4] > COMPLEXITY_LIMIT and ".bench" not in f[0]]
    print(f"functions over complexity {COMPLEXITY_LIMIT} outside bench/: {len(over)}")
    for mod, qual, line, _, score in sorted(over, key=lambda f: -f[4]):
        print(f"  {score:3d}  {mod}.{qual} (line {line})")
    files = [p for p in ROOT.glob("**/*") if p.suffix in (".py", ".c", ".h", ".cc", ".cu", ".sh")
             and ".venv" not in p.parts and "build" not in p.parts and p.is_file()]
    long_files = sorted((len(p.read_text(errors="replace").splitlines()), p) for p in files)
    long_files = [(n, p) for n, p in long_files if n > LINES_LIMIT]
    print(f"files over {LINES_LIMIT} lines: {len(long_files)}")
    for n, p in long_files:
        print(f"  {n:5d}  {p.relative_to(ROOT)}")
    if args.trace:
        path, returns = trace_backward()
        print(f"one backward enters {len(set(path))} modules, {len(path)} times in all, coming back {returns} "
              "times to a module it had left:")
        print("  " + " > ".join(m.removeprefix("fastdp.") for m in path))


if __name__ == "__main__":
    main()
