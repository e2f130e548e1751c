"""fastdp.comm on host devices, against references computed with plain torch. The value tests run a second time on
simulated CUDA devices through the C core (tests/test_sim_contract.py; tests/_places.py says where tensors go)."""

import functools
import os
import re
import subprocess
import sys
import textwrap

import warnings

import pytest
import torch
import torch.nn.parallel.comm as upstream

import fastdp
from fastdp import comm
from _places import dest, devices, on

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def _whole(text):
    """A match= pattern for exactly `text` (the whole message)."""
    return "^" + re.escape(text) + "$"


def _upstream_text(call):
    """What upstream torch.nn.parallel.comm raises for a call that its Python-side checks refuse (on any machine)."""
    with pytest.raises(RuntimeError) as info:
        call()
    return str(info.value)


def make(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def same(a, b):
    """Bit-for-bit equal values, shape and dtype (NaN-safe)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.is_floating_point:
        assert torch.equal(a.view(torch.uint8 if a.element_size() == 1 else _int_of(a)), b.view(_int_of(b)))
    else:
        assert torch.equal(a, b)


def _int_of(t):
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


# Shapes: 0-d, empty, odd sizes, and views that are not contiguous.
SHAPES = {
    "0d": lambda dt: make((), dt),
    "empty": lambda dt: make((0, 3), dt),
    "odd": lambda dt: make((7, 5, 3), dt),
    "transposed": lambda dt: make((5, 7), dt).t(),
    "strided": lambda dt: make((9, 8), dt)[::2, 1::3],
    "strided3d": lambda dt: make((6, 5, 8), dt)[::2, 1:, ::3],  # a GPU copies it with the strided-copy kernel
    "channels_last": lambda dt: make((2, 3, 4, 5), dt).contiguous(memory_format=torch.channels_last),
}


# ---------------------------------------------------------------- broadcast


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_broadcast(dtype, shape, ndev):
    ref = SHAPES[shape](dtype)
    x = on(ref)
    outs = comm.broadcast(x, devices(ndev))
    assert len(outs) == ndev
    assert outs[0] is x
    for o in outs[1:]:
        same(o, ref)
        assert o.numel() == 0 or o.data_ptr() != x.data_ptr()
        if shape == "channels_last":
            assert o.is_contiguous(memory_format=torch.channels_last)
    ptrs = {o.data_ptr() for o in outs[1:] if o.numel()}
    assert len(ptrs) == len([o for o in outs[1:] if o.numel()])


def test_broadcast_device_forms():
    x = torch.arange(6.0)
    for devices in (["cpu", torch.device("cpu")], ("cpu", "cpu"), iter(["cpu", "cpu"])):
        outs = comm.broadcast(x, devices)
        assert outs[0] is x and torch.equal(outs[1], x)


def test_broadcast_out():
    ref = make((4, 3), torch.float32)
    x = on(ref)
    out = [on(torch.empty(4, 3), 1), on(torch.empty(3, 4).t(), 2)]
    res = comm.broadcast(x, out=out)
    assert res[0] is out[0] and res[1] is out[1]
    for o in res:
        same(o, ref)


def test_broadcast_errors():
    x = torch.ones(3)
    out = [torch.empty(3)]  # one object for both sides: its repr is part of the message
    with pytest.raises(RuntimeError, match=_whole(_upstream_text(lambda: upstream.broadcast(x)))):
        comm.broadcast(x)
    with pytest.raises(RuntimeError, match=_whole(_upstream_text(lambda: upstream.broadcast(x, ["cpu"], out=out)))):
        comm.broadcast(x, ["cpu"], out=out)
    with pytest.raises(RuntimeError, match=_whole(
            "Expected all output tensors to have same shape as the source (shape [3]) in order to broadcast, but "
            "output tensor at index 1 has shape [4]")):
        comm.broadcast(x, out=[torch.empty(3), torch.empty(4)])
    with pytest.raises(ValueError, match=_whole(
            "'devices' mixes CPU and CUDA devices (['cpu', 0]); use \"cpu\" entries only (emulated devices)")):
        comm.broadcast(x, ["cpu", 0])
    with pytest.raises(ValueError, match=_whole("'devices' must name at least one device")):
        comm.broadcast(x, [])
    with pytest.raises(TypeError, match=_whole("'tensor' must be a torch.Tensor, got list")):
        comm.broadcast([1, 2], ["cpu"])
    with pytest.raises(TypeError, match=_whole("'devices' must be an iterable of devices, got a single int")):
        comm.broadcast(x, 5)
    with pytest.raises(ValueError, match=_whole(
            "devices: unknown device string 'gpu0' (Invalid device string: 'gpu0'); use \"cpu\", \"cuda\" or "
            "\"cuda:K\"")):
        comm.broadcast(x, ["gpu0"])


# ---------------------------------------------------------------- broadcast_coalesced


def mixed_tensors():
    return [
        make((3, 4), torch.float32, 1),
        make((5,), torch.int64, 2),
        make((0,), torch.uint8, 3),
        make((2, 2), torch.float32, 4),
        make((7,), torch.float16, 5),
        make((3, 3), torch.float64, 6).t(),
        make((), torch.float32, 7),
        make((9,), torch.int16, 8),
        make((4,), torch.bool, 9),
        torch.randn(3, 2, dtype=torch.complex64),
    ]


@pytest.mark.parametrize("buffer_size", [1, 7, 100, 10485760])
@pytest.mark.parametrize("ndev", [1, 2, 4])
def test_broadcast_coalesced(buffer_size, ndev):
    refs = mixed_tensors()
    ts = [on(t) for t in refs]
    outs = comm.broadcast_coalesced(ts, devices(ndev), buffer_size=buffer_size)
    assert len(outs) == ndev
    for a, b in zip(outs[0], ts):
        assert a is b
    for k in range(1, ndev):
        assert len(outs[k]) == len(ts)
        for o, t in zip(outs[k], refs):
            assert o.dtype == t.dtype and torch.equal(o, t)
            assert not o.requires_grad
    if ndev > 1:
        # Each output has its own version counter although several share one flat buffer.
        before = [o._version for o in outs[1]]
        outs[1][0].zero_()
        assert outs[1][0]._version == before[0] + 1
        assert [o._version for o in outs[1][1:]] == before[1:]
        assert torch.equal(ts[0], make((3, 4), torch.float32, 1))


def test_broadcast_coalesced_sparse():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    ts = [torch.ones(3), s, torch.arange(4)]
    outs = comm.broadcast_coalesced(ts, ["cpu", "cpu"], buffer_size=8)
    assert outs[1][1].is_sparse and torch.equal(outs[1][1].to_dense(), s.to_dense())
    assert torch.equal(outs[1][2], ts[2])


def test_broadcast_coalesced_errors():
    with pytest.raises(ValueError, match=_whole("'buffer_size' must be a positive int (bytes), got 0")):
        comm.broadcast_coalesced([torch.ones(2)], ["cpu", "cpu"], buffer_size=0)
    with pytest.raises(TypeError, match=_whole("'tensors'[1] must be a torch.Tensor, got str")):
        comm.broadcast_coalesced([torch.ones(2), "x"], ["cpu", "cpu"])
    with pytest.raises(ValueError, match=_whole(
            "'devices' mixes CPU and CUDA devices (['cpu', 1]); use \"cpu\" entries only (emulated devices)")):
        comm.broadcast_coalesced([torch.ones(2)], ["cpu", 1])


# ---------------------------------------------------------------- reduce_add


def reference_sum(inputs):
    return functools.reduce(torch.add, inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(), (0,), (17,), (5, 7, 3)])
def test_reduce_add(dtype, n, shape):
    refs = [make(shape, dtype, seed=k) for k in range(n)]
    inputs = [on(t, k) for k, t in enumerate(refs)]
    out = comm.reduce_add(inputs, destination=dest())
    if n == 1:
        assert out is inputs[0]
        return
    same(out, reference_sum(refs))
    assert all(out.data_ptr() != t.data_ptr() for t in inputs if t.numel())


def test_reduce_add_noncontiguous_and_complex():
    a = make((6, 4), torch.float32, 1).t()
    b = make((4, 6), torch.float32, 2)
    same(comm.reduce_add([a, b]), a + b)
    c = [torch.randn(5, dtype=torch.complex128) for _ in range(3)]
    out = comm.reduce_add(c)
    assert out.dtype == torch.complex128 and torch.equal(out, c[0] + c[1] + c[2])


def test_reduce_add_errors():
    with pytest.raises(ValueError, match=_whole("input 1 has invalid size: got 4, but expected 3")):
        comm.reduce_add([torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match=_whole(
            "input 1 has dtype torch.int64, but input 0 has torch.float32; cast them first")):
        comm.reduce_add([torch.ones(3), torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=_whole("reduce_add expects at least one input tensor")):
        comm.reduce_add([])
    with pytest.raises(TypeError, match=_whole("'inputs'[0] must be a torch.Tensor, got int")):
        comm.reduce_add([3, 4])
    with pytest.raises(ValueError, match=_whole(
            "reduce_add: input 1 is on meta but input 0 is on cpu; CPU and CUDA inputs cannot be mixed")):
        comm.reduce_add([torch.ones(3), torch.ones(3, device="meta")])


@pytest.mark.parametrize("buffer_size", [1, 50, 10485760])
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_reduce_add_coalesced(buffer_size, ndev):
    refs = [[t.clone() if k == 0 else make(t.shape, t.dtype, 100 + k * 10 + j) for j, t in enumerate(mixed_tensors())]
            for k in range(ndev)]
    per_dev = [[on(t, k) for t in ts] for k, ts in enumerate(refs)]
    out = comm.reduce_add_coalesced(per_dev, destination=dest(), buffer_size=buffer_size)
    assert len(out) == len(per_dev[0])
    for j, o in enumerate(out):
        ref = comm.reduce_add([ts[j] for ts in refs], destination="cpu")
        assert o.dtype == ref.dtype and o.shape == ref.shape
        if o.dtype.is_complex:
            assert torch.equal(o, ref)
        else:
            same(o, ref)
    if ndev > 1:
        before = [o._version for o in out]
        out[0].zero_()
        assert [o._version for o in out[1:]] == before[1:]


def test_reduce_add_coalesced_errors():
    with pytest.raises(ValueError, match=_whole("inputs[1] holds 1 tensors, but inputs[0] holds 2")):
        comm.reduce_add_coalesced([[torch.ones(2), torch.ones(2)], [torch.ones(2)]])
    with pytest.raises(ValueError, match=_whole("input 1 has invalid size: got 3, but expected 2")):
        comm.reduce_add_coalesced([[torch.ones(2)], [torch.ones(3)]])
    with pytest.raises(TypeError):
        comm.reduce_add_coalesced(torch.ones(2))


# ---------------------------------------------------------------- scatter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1, -2])
@pytest.mark.parametrize("ndev", [1, 2, 3, 5])
def test_scatter(dtype, dim, ndev):
    host = make((7, 5, 3), dtype)
    x = on(host)
    outs = comm.scatter(x, devices(ndev), dim=dim)
    ref = torch.chunk(host, ndev, dim=dim)
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        same(o.contiguous(), r.contiguous())
    assert outs[0].data_ptr() == x.data_ptr()  # the source's own chunk is a view
    for o in outs[1:]:
        assert o.numel() == 0 or o.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("shape", ["transposed", "strided", "channels_last", "empty"])
def test_scatter_layouts(shape):
    host = SHAPES[shape](torch.float32)
    outs = comm.scatter(on(host), devices(3), dim=0)
    for o, r in zip(outs, torch.chunk(host, 3, 0)):
        same(o.contiguous(), r.contiguous())
    if shape == "channels_last":
        assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs)
        back = comm.gather(outs, 0, dest())
        assert back.is_contiguous(memory_format=torch.channels_last) and torch.equal(back, host)


@pytest.mark.parametrize("chunk_sizes", [(2, 5), (0, 7), (7, 0), (3, 0, 4), (1, 1, 1, 4)])
def test_scatter_chunk_sizes(chunk_sizes):
    x = make((7, 3), torch.float64)
    outs = comm.scatter(on(x), devices(len(chunk_sizes)), chunk_sizes=chunk_sizes)
    for o, r in zip(outs, torch.split(x, list(chunk_sizes))):
        same(o, r)


@pytest.mark.parametrize("batch,ndev,expect", [(0, 4, [0, 0, 0, 0]), (1, 8, [1]), (9, 8, [2, 2, 2, 2, 1]),
                                                (10, 8, [2, 2, 2, 2, 2]), (17, 8, [3, 3, 3, 3, 3, 2])])
def test_scatter_chunk_rule(batch, ndev, expect):
    outs = comm.scatter(on(torch.arange(batch)), devices(ndev))
    assert [o.shape[0] for o in outs] == [c.shape[0] for c in torch.arange(batch).chunk(ndev)] or batch == 0
    assert [o.shape[0] for o in outs] == expect


def test_scatter_out():
    host = make((6, 4), torch.float32)
    x = on(host)
    out = [on(torch.empty(2, 4), 1), on(torch.empty(4, 4), 2)]
    res = comm.scatter(x, out=out)
    assert res[0] is out[0] and res[1] is out[1]
    same(res[0], host[:2])
    same(res[1], host[2:])
    res = comm.scatter(x, dim=1, out=[on(torch.empty(6, 1), 0), on(torch.empty(6, 3), 3)])
    same(res[1], host[:, 1:])


def test_scatter_errors():
    x = torch.ones(6, 4)
    with pytest.raises(RuntimeError, match=_whole(
            "Expected devices and chunk_sizes to be of same length, but got len(chunk_sizes) == 1 and "
            "len(devices) == 2")):
        comm.scatter(x, ["cpu", "cpu"], chunk_sizes=(6,))
    out = [torch.empty(6, 4)]
    with pytest.raises(RuntimeError, match=_whole(_upstream_text(lambda: upstream.scatter(x, ["cpu"], out=out)))):
        comm.scatter(x, ["cpu"], out=out)
    with pytest.raises(RuntimeError, match=_whole(_upstream_text(lambda: upstream.scatter(x, chunk_sizes=(6,),
                                                                                           out=out)))):
        comm.scatter(x, chunk_sizes=(6,), out=out)
    with pytest.raises(RuntimeError, match=_whole("Expected at least one device to scatter to")):
        comm.scatter(x, [])
    with pytest.raises(RuntimeError, match=_whole("Expected at least one output tensor to scatter to")):
        comm.scatter(x, out=[])
    with pytest.raises(RuntimeError, match=_whole(
            "Output tensor at index 0 has incorrect shape: [3, 5] (torch.float32). Expected same shape except for "
            "scatter dim 0 as the source tensor: [6, 4] (torch.float32).")):
        comm.scatter(x, out=[torch.empty(3, 5), torch.empty(3, 4)])
    with pytest.raises(RuntimeError, match="^" + re.escape(
            "Total size for output tensors along scatter dim 0 does not match the source tensor size at dim 0. "
            "Expected 6, but got total size 5.") + "$"):
        comm.scatter(x, out=[torch.empty(3, 4), torch.empty(2, 4)])
    with pytest.raises(RuntimeError, match="^" + re.escape(
            "Total size for output tensors along scatter dim 1 does not match the source tensor size at dim 1. "
            "Expected 4, but got total size 3.") + "$"):
        comm.scatter(x, dim=1, out=[torch.empty(6, 2), torch.empty(6, 1)])
    with pytest.raises(RuntimeError, match=_whole(
            "chunk_sizes [2, 3] add up to 5, but the tensor has 6 elements along dim 0; they must add up exactly")):
        comm.scatter(x, ["cpu", "cpu"], chunk_sizes=(2, 3))
    with pytest.raises(RuntimeError, match=_whole("'chunk_sizes'[0] is -1; chunk sizes must be non-negative")):
        comm.scatter(x, ["cpu", "cpu"], chunk_sizes=(-1, 7))
    with pytest.raises(TypeError, match=_whole("'chunk_sizes'[0] must be an int, got float")):
        comm.scatter(x, ["cpu", "cpu"], chunk_sizes=(2.5, 3.5))
    with pytest.raises(IndexError) as torch_own:  # torch's text for the same dim
        x.size(2)
    with pytest.raises(IndexError, match=_whole(str(torch_own.value))):
        comm.scatter(x, ["cpu", "cpu"], dim=2)
    with pytest.raises(RuntimeError, match=_whole(
            "dim: cannot split or join a 0-dimensional tensor (it has no dim 0)")):
        comm.scatter(torch.tensor(1.0), ["cpu", "cpu"])
    with pytest.raises(TypeError, match=_whole("'dim' must be an int, got str")):
        comm.scatter(x, ["cpu"], dim="0")


# ---------------------------------------------------------------- gather


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, 1, -1, -3])
def test_gather(dtype, dim):
    parts = []
    for k, size in enumerate([1, 0, 3]):
        shape = [2, 3, 4]
        shape[dim] = size
        parts.append(make(tuple(shape), dtype, k))
    out = comm.gather([on(p, k + 1) for k, p in enumerate(parts)], dim=dim, destination=dest())
    same(out, torch.cat(parts, dim=dim))


def test_gather_destinations_and_out():
    hosts = [make((2, 3), torch.float32, 1), make((4, 3), torch.float32, 2).t().contiguous().t()]
    ref = torch.cat(hosts)
    parts = [on(p, k + 1) for k, p in enumerate(hosts)]
    for dest in (None, "cpu", torch.device("cpu")):
        same(comm.gather(parts, destination=dest), ref)
    with warnings.catch_warnings(record=True) as theirs:  # upstream's warning, on the same call
        warnings.simplefilter("always")
        try:
            upstream.gather(hosts, destination=-1)
        except (AttributeError, RuntimeError):  # it warns first, then fails on host tensors: a CPU build has no
            pass  # torch._C._gather (AttributeError), a CUDA build's wants CUDA tensors (RuntimeError)
    (text,) = [str(w.message) for w in theirs if w.category is FutureWarning]
    with pytest.warns(FutureWarning, match=_whole(text)):
        same(comm.gather(parts, destination=-1), ref)
    out = on(torch.empty(6, 3))
    assert comm.gather(parts, out=out) is out
    same(out, ref)


def test_gather_errors():
    a = torch.ones(2, 3)
    out = torch.empty(2, 3)
    with pytest.raises(RuntimeError, match=_whole(_upstream_text(lambda: upstream.gather([a], destination="cpu",
                                                                                          out=out)))):
        comm.gather([a], destination="cpu", out=out)
    with pytest.raises(RuntimeError, match=_whole("Expected at least one tensor to gather from")):
        comm.gather([])
    with pytest.raises(RuntimeError, match=_whole(
            "Expected all input tensors to have the same number of dimensions, but input tensor at index 1 has 3 "
            "dimensions, (expected 2)")):
        comm.gather([a, torch.ones(2, 3, 1)])
    with pytest.raises(RuntimeError, match=_whole(
            "Input tensor at index 1 has invalid shape [2, 4], but expected [2, 3] (all dimensions but 0 must match "
            "input 0)")):
        comm.gather([a, torch.ones(2, 4)])
    with pytest.raises(RuntimeError, match=_whole(
            "Input tensor at index 1 has dtype torch.float64, but input 0 has torch.float32")):
        comm.gather([a, torch.ones(2, 3, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=_whole(
            "Expected out tensor to have shape [4, 3] and dtype torch.float32, but got [3, 3] and torch.float32")):
        comm.gather([a, a], out=torch.empty(3, 3))
    with pytest.raises(RuntimeError, match=_whole(
            "Expected all input tensors to be CUDA tensors, but input tensor at index 1 has device 'meta' (fastdp also "
            "accepts all-CPU inputs, not a mix)")):
        comm.gather([a, torch.ones(2, 3, device="meta")])
    with pytest.raises(ValueError, match=_whole(
            "destination: device index must be non-negative, got -2; use \"cpu\" for the host")):
        comm.gather([a], destination=-2)


# ---------------------------------------------------------------- the core directly


def test_core_errors_become_exceptions():
    from fastdp import _C

    with pytest.raises(ValueError, match=_whole(
            "copy 0: destination [3] (element size 4) does not match source [4] (4)")):
        _C.copy([torch.empty(3)], [torch.empty(4)])
    with pytest.raises(ValueError, match=_whole("reduce: the output must be contiguous")):
        _C.reduce([torch.ones(3, 2)], torch.empty(2, 3).t())
    with pytest.raises(TypeError, match=_whole(
            "reduce: dtype not supported (supported: bool, uint8, int8, int16, int32, int64, float16, bfloat16, "
            "float32, float64)")):
        _C.reduce([torch.ones(3, dtype=torch.complex64)], torch.empty(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=_whole("src[0] must be a torch.Tensor, got object")):
        _C.copy([torch.empty(3)], [object()])
    with pytest.raises(ValueError, match=_whole("src[0] is on a meta device; fastdp moves CPU and CUDA tensors only")):
        _C.copy([torch.empty(3)], [torch.empty(3, device="meta")])
    with pytest.raises(ValueError, match=_whole(
            "Total size for output tensors along scatter dim 0 does not match the source tensor size at dim 0. "
            "Expected 4, but got total size 2.")):
        _C.scatter(torch.ones(4), [torch.empty(1), torch.empty(1)], 0, [1, 1])
    assert issubclass(fastdp.FastDPError, RuntimeError)
    assert issubclass(fastdp.CudaError, fastdp.FastDPError) and issubclass(fastdp.NcclError, fastdp.FastDPError)


def test_uninitialized_parameter_raises_upstream_error():
    params = list(torch.nn.LazyLinear(3).parameters())
    with pytest.raises(ValueError) as torch_own:  # torch's text, naming the first torch function used on it
        params[0].is_conj()
    with pytest.raises(ValueError, match=_whole(str(torch_own.value))):
        comm.broadcast_coalesced(params, ["cpu", "cpu"])


def run_python(code, env=None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_threaded_host_paths_match_reference():
    """Large buffers split across threads (threshold lowered) still give the reference results."""
    code = """
        import torch, functools
        from fastdp import comm
        torch.manual_seed(0)
        x = torch.randn(513, 1031)
        outs = comm.broadcast(x, ["cpu"] * 3)
        assert all(torch.equal(o, x) for o in outs)
        outs = comm.scatter(x.t(), ["cpu"] * 3, dim=0)
        assert all(torch.equal(o, r) for o, r in zip(outs, torch.chunk(x.t(), 3, 0)))
        assert torch.equal(comm.gather(outs, 0, "cpu"), x.t())
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32):
            ins = [(torch.randn(300001) * 50).to(dt) for _ in range(4)]
            assert torch.equal(comm.reduce_add(ins, "cpu"), functools.reduce(torch.add, ins)), dt
        print("ok")
    """
    r = run_python(code, {"FASTDP_HOST_PARALLEL_MIN": "4096", "FASTDP_HOST_THREADS": "3"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


GARBAGE_CODE = """
import itertools, torch
from fastdp import comm, _C
junk = [None, 0, -1, 2**70, 1.5, "x", "cpu:banana", b"\\x00", [], [None], {}, object(), [[1]],
        torch.empty(0), torch.ones(2, 2, device="meta"), torch.ones(3).to_sparse(),
        [torch.ones(2), "a"], [torch.ones(2), torch.ones(3, dtype=torch.int8)], (torch.ones(2, 3),),
        [torch.ones(2, 3), torch.ones(3, 2).t()], torch.ones(1, dtype=torch.complex64),
        (torch.ones(3) * k for k in range(3)), iter([torch.ones(2)]), [[torch.ones(2)], [torch.ones(2)]],
        [({}, {}), ({}, 5)], [torch.ones(2, 2).t().contiguous()]]
fns = [comm.broadcast, comm.broadcast_coalesced, comm.reduce_add, comm.reduce_add_coalesced, comm.scatter,
       comm.gather, _C.copy, _C.broadcast, _C.reduce, _C.scatter, _C.gather, _C.plan, _C.reduce_many,
       _C.refresh, _C.rebind]
raised = 0
for fn in fns:
    for args in itertools.chain(((a,) for a in junk), itertools.product(junk, repeat=2)):
        try:
            fn(*args)
        except Exception:
            raised += 1
    for a in junk:
        try:
            fn(torch.ones(4), ["cpu"], a, a)
        except Exception:
            raised += 1
x = torch.arange(12.0).view(4, 3)
assert torch.equal(comm.gather(comm.scatter(x, ["cpu"] * 3), 0, "cpu"), x)
print("survived", raised)
"""


def test_garbage_arguments_leave_the_process_usable():
    """Every function, fed garbage, raises a Python exception; the process survives and the next call works."""
    r = run_python(GARBAGE_CODE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("survived"), r.stdout
    assert r.stderr == "" or "Traceback" not in r.stderr
