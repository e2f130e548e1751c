"""The map in docs/gpu-verification.md ("CUDA-only branches and the step that runs them") covers every CUDA-only
branch of the shim and every function of the C core's CUDA backend, and names only steps that scripts/gpu_check.sh
has: a branch added without a GPU check to run it fails here, on any machine. Also checks the tracer that tells,
on the GPU machine, which entries ran."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "gpu-verification.md")
SHIM = os.path.join(ROOT, "python", "fastdp")
CUDA_BACKEND = os.path.join(ROOT, "csrc", "backend", "cuda")
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _helper():
    spec = importlib.util.spec_from_file_location("cuda_branches", os.path.join(ROOT, "scripts", "gpu",
                                                                                "cuda_branches.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _is_cuda_only(node):
    """``x.is_cuda``, ``x.type == "cuda"`` / ``!= "cuda"``, or any ``torch.cuda.<name>``."""
    if isinstance(node, ast.Attribute):
        if node.attr == "is_cuda":
            return True
        v = node.value
        return isinstance(v, ast.Attribute) and v.attr == "cuda" and isinstance(v.value, ast.Name) and (
            v.value.id == "torch")
    if isinstance(node, ast.Compare) and len(node.comparators) == 1:
        left, right = node.left, node.comparators[0]
        sides = [(left, right), (right, left)]
        return any(isinstance(a, ast.Attribute) and a.attr == "type" and isinstance(b, ast.Constant)
                   and b.value == "cuda" for a, b in sides)
    return False


def cuda_only_sites(source):
    """{qualified name of the innermost function (as code objects name it; "<module>" outside any): the lines of
    its CUDA-only expressions} for one module's source."""
    tree = ast.parse(source)
    sites = {}

    def walk(node, qual, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{qual}.<locals>.{child.name}" if in_function else (
                    f"{qual}.{child.name}" if qual != "<module>" else child.name)
                walk(child, name, not isinstance(child, ast.ClassDef) or in_function)
                continue
            if _is_cuda_only(child):
                sites.setdefault(qual, []).append(child.lineno)
            walk(child, qual, in_function)

    walk(tree, "<module>", False)
    return sites


def scanned_python():
    found = {}
    for dirpath, _, files in os.walk(SHIM):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                with open(path) as fh:
                    for function, lines in cuda_only_sites(fh.read()).items():
                        found[(rel, function)] = lines
    return found


# A definition starts in column 0 with its return type (one or more words, pointers) and has no ';' on that line.
_C_DEF = re.compile(r"^(?:[A-Za-z_]\w*[\s*]+)+([A-Za-z_]\w*)\s*\([^;]*$", re.M)


def scanned_c():
    found = set()
    for f in sorted(os.listdir(CUDA_BACKEND)):
        if f.endswith(".c"):
            with open(os.path.join(CUDA_BACKEND, f)) as fh:
                text = fh.read()
            for name in _C_DEF.findall(text):
                if name not in ("if", "for", "while", "switch", "return", "sizeof"):
                    found.add((f"csrc/backend/cuda/{f}", name))
    return found


def gpu_check_steps():
    with open(GPU_CHECK) as f:
        return set(re.findall(r"^\s*step ([a-z0-9-]+) \d+ ", f.read(), re.M))


@pytest.fixture(scope="module")
def rows():
    return _helper().read_map(DOC)


def test_every_cuda_only_python_branch_is_mapped(rows):
    mapped = {(r["file"], r["function"]) for r in rows}
    missing = {k: v for k, v in scanned_python().items() if k not in mapped}
    assert not missing, "CUDA-only branches missing from the map in docs/gpu-verification.md:\n" + "\n".join(
        f"| `{f}` | `{fn}` | lines {lines} | ? |" for (f, fn), lines in sorted(missing.items()))


def test_every_cuda_backend_function_is_mapped(rows):
    mapped = {(r["file"], r["function"]) for r in rows}
    missing = sorted(scanned_c() - mapped)
    assert not missing, "C functions of the CUDA backend missing from the map:\n" + "\n".join(
        f"| `{f}` | `{fn}` | ? | ? |" for f, fn in missing)


def test_map_entries_exist_and_name_real_steps(rows):
    """No stale rows: each names a function that exists (where the scan finds CUDA-only code, or, for rows added
    by hand, a function defined in that file) and steps that gpu_check.sh runs."""
    steps = gpu_check_steps()
    assert {"sync-debug", "alloc-expandable", "alloc-async", "caller-stream", "cpu-batch", "output-cpu",
            "syncbn-dtypes", "graph-capture", "c-memcheck", "c-racecheck", "map-report"} <= steps
    python = scanned_python()
    c = scanned_c()
    for r in rows:
        key = (r["file"], r["function"])
        assert os.path.exists(os.path.join(ROOT, r["file"])), r
        if r["file"].endswith(".c"):
            assert key in c, f"no function {r['function']} in {r['file']}"
        elif key not in python:
            with open(os.path.join(ROOT, r["file"])) as f:
                tree = ast.parse(f.read())
            names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert r["function"].split(".")[-1] in names, f"no function {r['function']} in {r['file']}"
        named = {s.strip() for s in r["step"].split(",")}
        assert named and named <= steps, f"{key}: unknown gpu_check.sh step(s) {sorted(named - steps)}"
    assert len({(r["file"], r["function"]) for r in rows}) == len(rows), "a function is mapped twice"


def test_the_scan_finds_each_kind_of_branch():
    src = (
        "import torch\n"
        "def a(t):\n    return t.is_cuda\n"
        "def b(t):\n    if t.device.type == 'cuda':\n        pass\n"
        "class C:\n    def m(self):\n        def inner():\n            torch.cuda.synchronize()\n        return inner\n"
        "def d(t):\n    return 'cuda' != t.type\n"
        "def e():\n    '''torch.cuda.synchronize() in a docstring is no branch'''\n"
        "X = torch.cuda.OutOfMemoryError\n"
    )
    assert sorted(cuda_only_sites(src)) == ["<module>", "C.m.<locals>.inner", "a", "b", "d"]


def test_tracer_notes_the_mapped_functions_that_ran(tmp_path):
    """The GPU check's tracer, run here on a host model: it records mapped functions by their qualified names from
    every thread, nothing else, and map-report lists them as run."""
    helper = _helper()
    rows = [dict(file="python/fastdp/_platform/streams.py", function="current", branch="", step="caller-stream"),
            dict(file="python/fastdp/parallel_apply.py", function="_run", branch="", step="caller-stream"),
            dict(file="python/fastdp/_native/core.py", function="_scratch", branch="", step="c-gpu-ops")]
    doc = tmp_path / "map.md"
    doc.write_text(helper.MAP_HEADING + "\n\n| file | function | branch | step |\n|---|---|---|---|\n" + "".join(
        f"| `{r['file']}` | `{r['function']}` | x | {r['step']} |\n" for r in rows))
    assert helper.read_map(str(doc)) == [dict(r, branch="x") for r in rows]
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch, fastdp\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'scripts', 'gpu')!r})\n"
        "import cuda_branches as cb\n"
        f"t = cb.Tracer(cb.read_map({str(doc)!r})); t.start()\n"
        "from fastdp import parallel_apply as pa\n"
        "import importlib; pa = importlib.import_module('fastdp.parallel_apply'); pa._CPU_THREADS = True\n"
        "dp = fastdp.DataParallel(torch.nn.Linear(3, 2), device_ids=['cpu'] * 2)\n"
        "dp(torch.randn(4, 3)).sum().backward()\n"
        f"t.stop({str(tmp_path / 'trace' / 'host.txt')!r})\n")
    (tmp_path / "trace").mkdir()
    subprocess.run([sys.executable, str(script)], check=True, timeout=300)
    seen = (tmp_path / "trace" / "host.txt").read_text().split("\n")
    assert "python/fastdp/parallel_apply.py _run" in seen  # on the worker thread too
    assert "python/fastdp/_native/core.py _scratch" not in seen
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu", "cuda_branches.py"), "map-report",
                          "--trace", str(tmp_path / "trace"), "--map", str(doc)], capture_output=True, text=True,
                         check=True)
    assert re.search(r"yes\s+python/fastdp/parallel_apply.py _run\s+host", out.stdout), out.stdout
    assert re.search(r"NO\s+python/fastdp/_native/core.py _scratch\s+c-gpu-ops", out.stdout), out.stdout


def test_gpu_checks_compare_on_host_and_catch_a_wrong_gradient(monkeypatch, capsys):
    """The GPU checks' comparison with the bare model, run on emulated replicas: they pass, and fail once
    SyncBatchNorm's backward is off by 10%."""
    helper = _helper()
    assert helper.main(["syncbn-dtypes", "--device", "cpu"]) == 0
    assert helper.main(["output-cpu", "--device", "cpu"]) == 0
    from fastdp import sync_batchnorm

    real = sync_batchnorm._grad_sums
    monkeypatch.setattr(sync_batchnorm, "_grad_sums", lambda *a: tuple(t * 1.1 for t in real(*a)))
    assert helper.main(["syncbn-dtypes", "--device", "cpu"]) == 1
    assert "gradient of" in capsys.readouterr().out
