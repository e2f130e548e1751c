"""The torch fallback: when the C core cannot run an operation (BackendUnavailableError), fastdp.comm and
DataParallel still give torch's results, warn once naming the reason and the fix, and FASTDP_STRICT=1 turns that
into the error. The core is made unavailable by replacing its data-moving functions with ones that raise (as the
cuda backend does without a driver or kernels), and results are compared with torch on CPU tensors."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import fastdp
from fastdp import _C, comm
from fastdp._native import fallback as _fallback

OPS = ("copy", "broadcast", "scatter", "gather", "reduce", "reduce_many")
REASON = "the cuda backend is not usable: no fastdp kernels for device 0 (sm_90): no fatbin; NVRTC was not found"
CPU3 = ["cpu"] * 3

pytestmark = pytest.mark.filterwarnings("ignore::fastdp._native.fallback.FallbackWarning")


@pytest.fixture
def unavailable(monkeypatch):
    """Every data-moving core call raises BackendUnavailableError; the process has not fallen back yet."""
    calls = []

    def make(name):
        def raiser(*args):
            calls.append(name)
            raise _C.BackendUnavailableError(REASON)

        return raiser

    for name in OPS:
        monkeypatch.setattr(_C, name, make(name))
    monkeypatch.setattr(_fallback, "_reason", None)
    monkeypatch.delenv("FASTDP_STRICT", raising=False)
    return calls


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, _fallback.FallbackWarning)]


def _sum_in_order(ts):
    acc = ts[0]
    for t in ts[1:]:
        acc = torch.add(acc, t)
    return acc


def test_broadcast(unavailable):
    t = torch.randn(4, 5)
    out = comm.broadcast(t, CPU3)
    assert out[0] is t and all(torch.equal(o, t) and o.data_ptr() != t.data_ptr() for o in out[1:])
    assert "broadcast" in unavailable


def test_broadcast_coalesced(unavailable):
    ts = [torch.randn(3, 2), torch.arange(7), torch.randn(5).half()]
    out = comm.broadcast_coalesced(ts, CPU3, buffer_size=64)
    for copies in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(copies, ts))


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter(unavailable, dim):
    t = torch.randn(7, 9)
    out = comm.scatter(t, CPU3, dim=dim)
    ref = t.chunk(3, dim)
    assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref))
    sized = comm.scatter(t, CPU3, chunk_sizes=[1, 0, t.shape[dim] - 1], dim=dim)
    assert all(torch.equal(a, b) for a, b in zip(sized, t.split([1, 0, t.shape[dim] - 1], dim)))


def test_gather(unavailable):
    ts = [torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)]
    assert torch.equal(comm.gather(ts, 0, "cpu"), torch.cat(ts, 0))
    tt = [t.t() for t in ts]
    assert torch.equal(comm.gather(tt, 1, "cpu"), torch.cat(tt, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.bool])
def test_reduce_add_rounds_like_torch(unavailable, dtype):
    g = torch.Generator().manual_seed(3)
    raw = [torch.randn(300, generator=g) * 50 for _ in range(5)]
    ins = [(r > 0) if dtype == torch.bool else r.to(dtype) for r in raw]
    got = comm.reduce_add(ins, "cpu")
    ref = _sum_in_order(ins)
    assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_reduce_add_coalesced(unavailable):
    per_device = [[torch.randn(3, 3), torch.randn(4).half()] for _ in range(3)]
    out = comm.reduce_add_coalesced(per_device, "cpu", buffer_size=32)
    for j, o in enumerate(out):
        assert torch.equal(o, _sum_in_order([d[j] for d in per_device]))


def test_one_warning_per_process_with_reason_and_fix(unavailable):
    t = torch.randn(6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        comm.broadcast(t, CPU3)
        comm.scatter(t, CPU3)
        comm.reduce_add([t, t], "cpu")
    (w,) = _fallback_warnings(record)
    assert str(w.message) == (
        f"fastdp: the C core cannot run fastdp.comm's broadcast here ({REASON}); torch's own implementation is "
        "used instead, for this and every later call that needs it. Fix: pip install nvidia-cuda-nvrtc matching "
        "the driver (PyTorch's CUDA wheels bring it), or reinstall fastdp on a machine where nvcc is found. Set "
        "FASTDP_STRICT=1 to make this an error. (Shown once per process.)"
    )
    assert w.filename == __file__  # it names the user's call of fastdp.comm
    assert _fallback.reason() == REASON
    assert fastdp.info()["fallback"] == REASON


def test_strict_raises_instead(unavailable, monkeypatch):
    monkeypatch.setenv("FASTDP_STRICT", "1")
    with pytest.raises(fastdp.BackendUnavailableError) as e:
        comm.broadcast(torch.randn(3), CPU3)
    assert str(e.value) == f"{REASON} (FASTDP_STRICT is set, so fastdp does not fall back to torch)"
    assert _fallback.reason() is None


def test_other_errors_do_not_fall_back(monkeypatch):
    """A CUDA failure is an error to report, never a reason to run something else."""

    def fail(*args):
        raise _C.CudaError("cuMemcpyAsync on device 0: out of memory")

    monkeypatch.setattr(_C, "broadcast", fail)
    monkeypatch.setattr(_fallback, "_reason", None)
    with pytest.raises(fastdp.CudaError):
        comm.broadcast(torch.randn(3), CPU3)
    assert _fallback.reason() is None


def test_core_paths_do_not_fall_back(monkeypatch):
    monkeypatch.setattr(_fallback, "_reason", None)
    t = torch.randn(9, 3)
    comm.broadcast(t, CPU3)
    comm.reduce_add(list(comm.scatter(t, CPU3)), "cpu")
    assert _fallback.reason() is None


def test_data_parallel_falls_back(unavailable):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(10, 6)
    dp = fastdp.DataParallel(model, device_ids=CPU3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = dp(x)
        out.square().sum().backward()
    expect = ref(x)
    expect.square().sum().backward()
    torch.testing.assert_close(out, expect)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    (w,) = _fallback_warnings(record)
    assert unavailable and w.filename == __file__  # the user's line, through autograd's Functions and Module.__call__


def test_fix_for_a_disabled_driver():
    """In a process where FASTDP_DISABLE_CUDA is set, the reason the core gives maps to its fix."""
    code = (
        "import fastdp; from fastdp._native import fallback as _fallback; why = fastdp.info()['backends']['cuda']['why']; "
        "print(why); print(_fallback._fix(why))"
    )
    env = {**os.environ, "FASTDP_DISABLE_CUDA": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    why, fix = res.stdout.strip().splitlines()[-2:]
    assert "FASTDP_DISABLE_CUDA" in why and fix == "unset FASTDP_DISABLE_CUDA"


# ---- the route: which implementation serves a sum over several devices ----------------------------------------


class OnDevice:
    """A tensor standing on a named device: ``to`` moves it (recorded), the values stay a host tensor."""

    moves = []

    def __init__(self, values, device):
        self.values, self.device = values, device

    def to(self, device):
        OnDevice.moves.append((self.device, device))
        return OnDevice(self.values, device)


def _sum_core(can_span):
    """A core that sums columns whose tensors share their output's device, and across devices only when
    ``can_span`` (as with NCCL); otherwise it raises BackendUnavailableError, as the cuda backend does."""
    calls = []

    def reduce_many(columns, outs, streams):
        calls.append([[t.device for t in c] for c in columns])
        if not can_span and any(t.device != o.device for c, o in zip(columns, outs) for t in c):
            raise _C.BackendUnavailableError("no backend can sum across devices here: NCCL is disabled")
        for c, o in zip(columns, outs):
            o.values.copy_(_sum_in_order([t.values for t in c]))

    return reduce_many, calls


@pytest.mark.parametrize("can_span", [True, False])
def test_a_sum_across_devices_is_staged_on_the_outputs_device_when_the_core_cannot_span_them(monkeypatch, can_span):
    from fastdp._native import route as _route

    reduce_many, calls = _sum_core(can_span)
    monkeypatch.setattr(_C, "reduce_many", reduce_many)
    monkeypatch.setattr(_fallback, "_reason", None)
    OnDevice.moves = []
    ins = [OnDevice(torch.randn(5), f"cuda:{d}") for d in range(3)]
    out = OnDevice(torch.empty(5), "cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _fallback.FallbackWarning)  # staging is the core's route: no warning
        _route.reduce_many([ins], [out], None)
    assert torch.equal(out.values, _sum_in_order([t.values for t in ins]))
    if can_span:
        assert calls == [[["cuda:0", "cuda:1", "cuda:2"]]] and OnDevice.moves == []
    else:
        assert calls == [[["cuda:0", "cuda:1", "cuda:2"]], [["cuda:0"] * 3]]
        assert OnDevice.moves == [("cuda:1", "cuda:0"), ("cuda:2", "cuda:0")]
    assert _fallback.reason() is None


def test_a_sum_the_core_cannot_run_on_one_device_goes_to_torch_without_a_second_try(unavailable):
    from fastdp._native import route as _route

    ins, out = [torch.randn(4) for _ in range(3)], torch.empty(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _route.reduce_many([ins], [out], None)
    assert unavailable == ["reduce_many"]  # nothing to stage: asked once, then torch
    assert torch.equal(out, _sum_in_order(ins))
    (w,) = _fallback_warnings(record)
    assert w.filename == __file__  # the warning names the caller's line, not fastdp's
