"""The two ways tensors become core descriptors: libtorch's C shim ("aoti") and the tensor's Python API
("python"). Both must give the descriptor the tensor's own Python attributes describe, raise the same errors, and
keep nothing alive after a call; FASTDP_TENSOR_PATH=python selects the Python path and `fastdp info` says which
path is in use."""

import concurrent.futures
import gc
import os
import re
import subprocess
import sys

import pytest
import torch

import fastdp
from fastdp import _C
from fastdp._native import core as _core

SHIM = _core.tensor_shim_usable()
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(params=["aoti", "python"])
def path(request):
    """Runs a test on each tensor path, restoring the one in use after it."""
    if request.param == "aoti" and not SHIM:
        pytest.skip("this torch has no usable C shim: " + _C.tensor_path()[1])
    previous = _C.set_tensor_path(request.param)
    yield request.param
    _C.set_tensor_path(previous)


def reference(t):
    """The descriptor from the tensor's Python attributes: what both paths must produce."""
    code = _core._CORE_DTYPES.get(t.dtype, _C.dtype_codes()["other"])
    device = t.get_device() if t.is_cuda else -1
    return (t.data_ptr(), device, code, t.element_size(), tuple(t.shape), tuple(t.stride()))


def views():
    a = torch.arange(60.0).reshape(3, 4, 5)
    return {
        "contiguous": a,
        "strided": a[:, ::2, 1::2],
        "transposed": a.transpose(0, 2),
        "narrow": a.narrow(1, 1, 2),
        "slice_offset": a[1:, 2:, 3:],
        "zero_dim": torch.tensor(3.5),
        "zero_dim_view": a[1, 2, 3],
        "empty": torch.empty(0, 3),
        "empty_view": a[:, 4:4],
        "expanded": torch.ones(3, 1).expand(3, 4),
        "channels_last": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "parameter": torch.nn.Parameter(torch.ones(2, 3)),
        "requires_grad_view": torch.ones(4, 4, requires_grad=True)[1:, :2],
    }


DTYPES = list(_core._CORE_DTYPES) + [torch.complex64, torch.complex128, torch.uint16, torch.uint32,
                                     torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("name", list(views()))
def test_views_match_the_python_attributes(path, name):
    t = views()[name]
    assert _C.describe([t]) == [reference(t)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(path, dtype):
    t = torch.zeros(2, 3).to(dtype)[:, 1:]
    assert _C.describe([t, t.t()]) == [reference(t), reference(t.t())]


def test_both_paths_agree_on_a_mixed_list():
    if not SHIM:
        pytest.skip("no C shim")
    ts = list(views().values()) + [torch.zeros(3).to(d) for d in DTYPES]
    got = {}
    for p in ("aoti", "python"):
        previous = _C.set_tensor_path(p)
        try:
            got[p] = _C.describe(ts)
        finally:
            _C.set_tensor_path(previous)
    assert got["aoti"] == got["python"] == [reference(t) for t in ts]


class Wrapped(torch.Tensor):
    """A tensor subclass: only the Python path honours what a subclass may override, so lists holding one take it."""


def test_subclass_in_a_list(path):
    ts = [torch.ones(3), torch.ones(2, 2).as_subclass(Wrapped)]
    assert _C.describe(ts) == [reference(t) for t in ts]


def _error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return type(info.value), str(info.value)


BAD = {
    "sparse_coo": lambda: torch.ones(2, 2).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "meta": lambda: torch.ones(2, 2, device="meta"),
    "int": lambda: 3,
    "none": lambda: None,
    "too_many_dims": lambda: torch.ones([1] * 17),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("name", list(BAD))
def test_rejections_match_the_python_path(name):
    """The same exception type and message on both paths, for a list element and after a good one."""
    if not SHIM:
        pytest.skip("no C shim")
    bad = BAD[name]()
    results = {}
    for p in ("aoti", "python"):
        previous = _C.set_tensor_path(p)
        try:
            results[p] = (_error(_C.describe, [torch.ones(2), bad]), _error(_C.copy, [bad], [bad]),
                          _error(_C.broadcast, bad, [torch.ones(2)]))
        finally:
            _C.set_tensor_path(previous)
    assert results["aoti"] == results["python"]
    if name in ("meta", "int", "none"):
        assert "tensors[1]" in results["python"][0][1]  # the message names the element
        assert results["python"][2][1].startswith("tensor ")  # a single argument: its name alone


def test_not_a_sequence(path):
    for arg, kind in ((torch.ones(2), "Tensor"), ("ab", "str"), (5, "int")):
        with pytest.raises(TypeError) as info:
            _C.describe(arg)
        assert str(info.value) == f"tensors must be a sequence of tensors, got {kind}"


def test_copy_is_correct_on_strided_views(path):
    """The descriptors drive real work: copies into strided destinations equal torch's copy_."""
    src = [torch.randn(4, 6)[:, ::2], torch.randn(3, 5).t(), torch.randn(7)[2:5], torch.tensor(2.0)]
    dst = [torch.zeros(4, 6)[:, 1::2], torch.zeros(5, 3), torch.zeros(9)[4:7], torch.zeros(())]
    want = [d.clone().copy_(s) for d, s in zip(dst, src)]
    _C.copy(dst, src)
    for d, w in zip(dst, want):
        assert torch.equal(d, w)


def test_single_tensor_arguments(path):
    """broadcast's source and reduce's output (one-tensor converters) as strided views: the result equals torch's."""
    src = torch.randn(6, 4)[::2, 1:]
    outs = [torch.zeros(3, 3), torch.zeros(3, 5)[:, 1:4]]
    _C.broadcast(src, outs)
    assert all(torch.equal(o, src) for o in outs)
    ins = [torch.randn(3, 3) for _ in range(3)]
    out = torch.zeros(3, 3)
    _C.reduce(ins, out)
    assert torch.equal(out, ins[0] + ins[1] + ins[2])


def test_no_reference_kept(path):
    """Each call releases the tensor handles it made: the tensor's storage is freed once the tensor goes."""
    t = torch.ones(100)
    storage = t.untyped_storage()
    for _ in range(50):
        _C.describe([t] * 20)
        _C.copy([t], [t])
    refs = sys.getrefcount(t)
    del t
    gc.collect()
    assert _use_count_of(storage) == 1 and refs == 2


def _use_count_of(storage):
    return torch._C._storage_Use_Count(storage._cdata)


def test_later_argument_failure_releases_the_list(path):
    """copy's stream argument fails after both tensor lists were converted: the converters' cleanup releases the
    kept tensors (Py_CLEANUP_SUPPORTED)."""
    t = torch.ones(3)
    before = sys.getrefcount(t)
    for _ in range(20):
        with pytest.raises(TypeError) as info:
            _C.copy([t], [t], 5)
        assert str(info.value) == "streams must be a sequence of (device, handle) pairs"
        with pytest.raises(ValueError) as info:
            _C.copy([t], [t, t])
        assert str(info.value) == "copy: 1 destinations for 2 sources"
    assert sys.getrefcount(t) == before


def test_set_tensor_path_rejects_unknown_names():
    with pytest.raises(ValueError) as info:
        _C.set_tensor_path("cuda")
    assert str(info.value) == "set_tensor_path: expected \"aoti\" or \"python\", got 'cuda'"


def _run(env_value):
    env = dict(os.environ)
    env.pop("FASTDP_TENSOR_PATH", None)
    if env_value is not None:
        env["FASTDP_TENSOR_PATH"] = env_value
    code = "import fastdp; from fastdp import _C; from fastdp._native import info as _info; print(_C.tensor_path()[0]); print(_info.render(_info.collect()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_environment_selects_the_python_path():
    out = _run("python")
    assert out[0] == "python"
    assert "tensor metadata: the tensors' Python API; FASTDP_TENSOR_PATH=python" in out


def test_default_path_and_info_line():
    out = _run(None)
    assert out[0] == ("aoti" if SHIM else "python")
    line = [ln for ln in out if ln.startswith("tensor metadata: ")]
    assert len(line) == 1 and line[0].startswith("tensor metadata: libtorch's C shim" if SHIM else
                                                  "tensor metadata: the tensors' Python API")


def test_torch_without_the_shim_falls_back():
    """A torch whose _aoti module lacks the batched handle conversion (older than the shim path needs): the Python
    path is used, info says why, and asking for the shim path is a clear error."""
    code = """
import torch
del torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
import fastdp
from fastdp import _C
name, why = _C.tensor_path()
print(name)
print(why)
try:
    _C.set_tensor_path("aoti")
except RuntimeError as e:
    print(e)
d, s = [torch.zeros(2, 3)], [torch.arange(6.0).reshape(3, 2).t()]
_C.copy(d, s)
print(torch.equal(d[0], s[0]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "FASTDP_TENSOR_PATH"})
    assert r.returncode == 0, r.stderr
    name, why, error, copied = r.stdout.splitlines()
    assert name == "python" and copied == "True"
    assert why == "the C shim cannot be used: torch has no torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors"
    assert error == "the C shim path cannot be used here: " + why.split(": ", 1)[1]


def _shim_entry_points():
    """Every aoti_torch_* name the binding looks up (csrc/python/aoti.c): functions, constants and dtype getters."""
    with open(os.path.join(os.path.dirname(HERE), "csrc", "python", "aoti.c")) as f:
        text = f.read()
    names = set(re.findall(r'"(aoti_torch_\w+)"', text))
    table = text[text.index("shim_dtypes[] = {"):]
    names |= {"aoti_torch_dtype_" + d for d in re.findall(r'"(\w+)"', table[:table.index("};")])}
    return sorted(names)


_HIDDEN_CHECK = """
from array import array
import torch, fastdp
from fastdp import _C
name, why = _C.tensor_path()
print(name)
print(why)
for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64):
    src = torch.arange(24).to(dtype).reshape(4, 6).t()
    dst = torch.zeros(6, 4, dtype=dtype)
    _C.copy([dst], [src])
    assert torch.equal(dst, src), dtype
flat = torch.arange(10.0)
views = _C.views(flat, array("q", [1, 4, 2, 2, 3]))
if views is not None:
    assert [torch.equal(v, r) for v, r in zip(views, (flat[:4], flat[4:].view(2, 3)))] == [True, True]
torch.manual_seed(0)
bare = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
dp = fastdp.DataParallel(__import__("copy").deepcopy(bare), device_ids=["cpu"] * 3)
x = torch.randn(7, 4, dtype=torch.float64)
for model in (bare, dp):
    for _ in range(2):
        model(x).pow(2).sum().backward()
for p, q in zip(dp.module.parameters(), bare.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
print("ok")
"""


@pytest.mark.skipif(not SHIM, reason="this torch has no C shim path: nothing to hide")
def test_each_shim_entry_point_hidden_in_turn():
    """A torch without any one of the shim's entry points (FASTDP_SHIM_ABSENT hides it): a required one sends every
    tensor through the Python path and `info` names it; an optional one or a dtype getter keeps the shim path;
    results are torch's either way (copies over every dtype, the reduced-gradient views, training steps)."""
    names = _shim_entry_points()
    assert len(names) > 30, names
    with open(os.path.join(os.path.dirname(HERE), "csrc", "python", "aoti.c")) as f:
        required = set(re.findall(r'\{"(aoti_torch_\w+)", &shim\.\w+, 1\}', f.read()))  # k_functions
    assert len(required) >= 10, required
    env = {k: v for k, v in os.environ.items() if k != "FASTDP_TENSOR_PATH"}

    def run(name):  # one process per name: the knob is read once per process
        return subprocess.run([sys.executable, "-c", _HIDDEN_CHECK], capture_output=True, text=True, timeout=120,
                              env=dict(env, FASTDP_SHIM_ABSENT=f"something_else,{name}"))

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, names))
    for name, r in zip(names, results):
        assert r.returncode == 0 and r.stdout.endswith("ok\n"), (name, r.stdout, r.stderr[-3000:])
        path, why = r.stdout.splitlines()[:2]
        if name in required:
            assert path == "python" and why == f"the C shim cannot be used: libtorch has no {name} (torch too old " \
                                                "for the C shim path)", (name, path, why)
        else:
            assert path == "aoti", (name, path, why)
