"""The binding and the core under AddressSanitizer/UBSan inside a real Python process: fastdp._C is rebuilt with
sanitizers (every backend; the GPU ones find no driver here) and the garbage-argument run and a few training steps on emulated replicas are repeated
with it. A use-after-free or overflow anywhere in the C code fails this test."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from test_comm import GARBAGE_CODE

ROOT = Path(__file__).resolve().parent.parent

TRAINING = """
import torch, fastdp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, bucket_cap_mb=1e-4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
hook = model[0].register_forward_hook(lambda m, args, out: out * 1)  # refresh refills the replicas' hook dicts
for step in range(4):
    if step == 2:
        hook.remove()  # ... and empties them
    x = torch.randn(12 - step, 5)
    with dp.no_sync() if step == 1 else torch.enable_grad():
        dp(x).square().mean().backward()
    if step != 1:
        opt.step()
        opt.zero_grad()
    if step == 2:
        model.append(torch.nn.Identity())  # the structure check fails in C, the replicas are rebuilt
def edit(m, args, out):  # a forward changing its replica: undone before the next forward
    m.register_buffer("seen", out.detach())
    m.weight.data = m.weight.data.clone()
model[3].register_forward_hook(edit)
class Grow(torch.nn.Module):  # replicas 1 and 2 grow their buffer past its memory every step
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(1))
    def forward(self, x):
        self.b.resize_(x.shape[0] * 100).fill_(1.0)
        return x
grow = fastdp.DataParallel(Grow(), device_ids=["cpu"] * 3, chunk_sizes=[1, 4, 4])
for step in range(3):
    dp(torch.randn(9, 5)).sum().backward()
    grow(torch.randn(9, 5))
from collections import OrderedDict
odd = torch.nn.Linear(2, 2)
odd._parameters = OrderedDict(odd._parameters)  # read through items() by walk and matches
modules, sig = fastdp._C.walk(odd)
assert fastdp._C.matches(modules, sig) and not fastdp._C.matches(modules, sig[:-1])
odd.bias = None
assert not fastdp._C.matches(modules, sig)
from array import array
views = fastdp._C.views(torch.arange(10.0), array("q", [2, 2, 2, 1, 3, 0]))  # the shim's views, if it has them
assert views is None or [v.tolist() for v in views] == [[[0.0, 1.0], [2.0, 3.0]], [4.0, 5.0, 6.0], 7.0]
for spec in (array("q", [1, 11]), array("q", [3, 1]), b"1234567"):
    try:
        fastdp._C.views(torch.arange(10.0), spec)
    except ValueError:
        pass
out = torch.zeros(6)
plan = fastdp._C.PreparedSum([torch.ones(2, 3)], 3)
assert plan.run([torch.ones(2, 3)] * 3, out) in (True, False)  # False on the Python path
assert not plan.run([torch.ones(3, 2).t()] * 3, out) and not plan.run([None] * 3, out)
for bad in ([torch.ones(2, 3)] * 2, 3):
    try:
        plan.run(bad, out)
    except (ValueError, TypeError):
        pass
del plan
print("trained")
"""


def _runtime(name):
    out = subprocess.run([os.environ.get("CC", "cc"), f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_binding_under_sanitizers(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc"))
    asan, stdcxx = _runtime("libasan.so"), _runtime("libstdc++.so.6")
    if cc is None or asan is None or stdcxx is None:
        pytest.skip("needs a C compiler with libasan and libstdc++ (gcc)")
    import fastdp

    pkg = tmp_path / "fastdp"
    shutil.copytree(Path(fastdp.__file__).parent, pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    ext = pkg / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    dirs = ("csrc/base", "csrc/core", "csrc/backend/host", "csrc/backend/cuda", "csrc/dl", "csrc/python")
    sources = [str(p) for d in dirs for p in sorted((ROOT / d).glob("*.c"))]
    sys.path.insert(0, str(ROOT / "cuda"))
    try:
        from build_kernels import build_blob  # the blob a build without nvcc gets
    finally:
        sys.path.pop(0)
    build_blob(ROOT / "cuda", None, tmp_path / "fdp_kernels_blob.c")
    sources.append(str(tmp_path / "fdp_kernels_blob.c"))
    build = subprocess.run(
        [cc, "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE", "-O1", "-g", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", f"-I{ROOT / 'csrc'}",
         f"-I{sysconfig.get_paths()['include']}", *sources, "-o", str(ext), "-lpthread", "-ldl"],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(tmp_path), LD_PRELOAD=f"{asan} {stdcxx}",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
    # The garbage run on both tensor paths (libtorch's C shim, the Python API: see test_tensor_path.py).
    for code, expect, path in ((GARBAGE_CODE, "survived", "aoti"), (GARBAGE_CODE, "survived", "python"),
                               (TRAINING, "trained", "aoti")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(env, FASTDP_TENSOR_PATH=path), timeout=600, cwd=tempfile.gettempdir())
        assert "AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]
        assert r.returncode == 0 and r.stdout.strip().startswith(expect), (r.stdout, r.stderr[-3000:])
