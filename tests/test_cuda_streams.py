"""Which stream the shim orders its CUDA work on, run on a CPU against a recording stand-in for torch.cuda
(tests/_fake_cuda.py): the core's work, its scratch memory and torch's fallback copies on each device's current
stream, peer access opened through PyTorch from the accessing device, parallel_apply's workers on the caller's
streams and autocast, a CPU batch copied to CUDA replicas without a host wait, comm.scatter with explicit streams,
and every call fastdp.comm makes into the core.

Tensors stay on the host; the code under test is told its devices are CUDA devices (conftest's ``cuda``
and ``cuda3`` fixtures install the fake, and fail a test that misused it). Every numeric result is compared with
torch's own on the bare model.
"""

import importlib
import threading
import types

import pytest
import torch
import torch.nn as nn

from fastdp import _C, comm
from fastdp._native import core as _core, fallback as _fallback
from fastdp._step import functions as _functions

pa = importlib.import_module("fastdp.parallel_apply")

pytestmark = pytest.mark.sim

_GRANT_PEER = _core._grant_peer  # the fixture stands in for it; one test checks the real one


def _on(device):
    """A stand-in for a CUDA tensor of `device` where only its device is read."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", device), get_device=lambda: device)


# ---- stream selection: the caller's current stream of every device ---------------------------------------------


def test_core_work_is_ordered_on_each_devices_current_stream(cuda):
    s0, s1 = cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")
    with cuda.stream(s0), cuda.stream(s1):
        pairs = _core.streams_for([_on(1), _on(0), _on(1), torch.empty(1)])
    assert pairs == [(1, s1.cuda_stream), (0, s0.cuda_stream)]
    assert _core.streams_for([torch.empty(1)]) is None


def test_peer_access_is_opened_through_pytorch_once_per_device_set(cuda, monkeypatch):
    """Under expandable segments or cudaMallocAsync only PyTorch's allocator can let a device read another's memory:
    the pairs are opened through torch (a copy between the two devices) before the core first works over them."""
    cuda.peers.discard((1, 0))  # hardware without that direction: nothing asked of torch for it
    _core.streams_for([_on(0), _on(1)])
    assert cuda.log == [("grant_peer", 0, 1)]
    _core.streams_for([_on(1), _on(0)])  # the same set: nothing more
    assert cuda.log == [("grant_peer", 0, 1)]
    monkeypatch.setattr(_C, "broadcast", lambda src, dsts, streams: cuda.record("core_broadcast", sorted(streams)))
    monkeypatch.setattr(_core, "_PEERS_OPEN", set())
    cuda.log.clear()
    comm._C.broadcast(torch.ones(3), [torch.empty(3)], _core.streams_for([_on(0), _on(1)]))
    assert cuda.log == [("grant_peer", 0, 1), ("core_broadcast", [(0, 0), (1, 0)])]  # opened before the core runs


def test_scratch_memory_is_allocated_on_the_cores_stream(cuda, monkeypatch):
    """The core's scratch block belongs to the stream the core uses it on (PyTorch's allocator ties blocks to the
    stream current at allocation), on the device it asks for, whatever this thread's current device and streams
    are; the core's legacy default stream is the device's default stream."""
    work = cuda.stream_on(1, "core@1")
    seen = []
    real_empty = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        seen.append((device, cuda.current_stream(device).name))
        return real_empty(*size, dtype=dtype)

    monkeypatch.setattr(torch, "empty", empty)
    with cuda.stream(cuda.stream_on(1, "caller@1")), cuda.stream(cuda.stream_on(0, "caller@0")):
        assert cuda.current_device() == 0
        _core._scratch(1, 64, work.cuda_stream)
        _core._scratch(1, 64, 0)  # the legacy default stream: the device's default stream
    assert seen == [(1, "core@1"), (1, "default@1")]


def test_torch_fallback_copies_run_on_the_listed_streams(cuda):
    """Where the core cannot run, torch copies each destination on the stream the core would have used."""
    work = cuda.stream_on(1, "core@1")
    seen = []

    class Dst:
        is_cuda = True
        device = torch.device("cuda", 1)

        def get_device(self):
            return 1

        def copy_(self, src):
            seen.append(cuda.current_stream(1).name)

    _fallback.copy([Dst(), Dst()], [None, None], [(1, work.cuda_stream)])
    _fallback.copy([Dst()], [None], None)
    assert seen == ["core@1", "core@1", "default@1"]
    # the core's legacy default stream of device 1 is its default stream, while this thread has other streams
    # current there and a device whose current stream has the same handle (0) is the current device
    seen.clear()
    with cuda.stream(cuda.stream_on(1, "caller@1")), cuda.device(0):
        _fallback.copy([Dst()], [None], [(0, 0), (1, 0)])
    assert seen == ["default@1"]


def test_peer_access_is_granted_from_the_accessing_device(cuda, monkeypatch):
    """torch asks its allocator for peer access on the source device of a copy, towards the destination: to let
    `device` read `peer`'s memory, the copy's source is on `device` and its destination on `peer`."""
    made = []

    class Probe:
        def __init__(self, device):
            self.device = device

        def copy_(self, src):
            made.append(("copy", src.device, self.device))

    monkeypatch.setattr(torch, "empty", lambda *size, device=None, **kw: Probe(device))
    _GRANT_PEER(1, 0)
    assert made == [("copy", torch.device("cuda", 1), torch.device("cuda", 0))]


# ---- parallel_apply: every worker enters the caller's device, stream and autocast ------------------------------


class _Probe(nn.Module):
    def __init__(self, cuda, device, seen):
        super().__init__()
        self.cuda, self.device, self.seen = cuda, device, seen

    def forward(self, x):
        self.seen[self.device] = (self.cuda.current_device(), self.cuda.current_stream(self.device).name,
                                  threading.current_thread() is threading.main_thread(),
                                  torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return x * 2


def test_parallel_apply_workers_run_on_the_callers_streams(cuda, monkeypatch):
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    seen = {}
    autocast = []
    real_autocast = torch.autocast

    def fake_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        autocast.append((device_type, dtype, threading.current_thread() is threading.main_thread()))
        return real_autocast("cpu", enabled=False)  # the worker's state is what is recorded

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    monkeypatch.setattr(torch, "autocast", fake_autocast)
    modules = [_Probe(cuda, d, seen) for d in (0, 1)]
    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        out = pa.parallel_apply(modules, [(torch.ones(2),), (torch.ones(2),)], None, [0, 1])
    assert [o.tolist() for o in out] == [[2.0, 2.0], [2.0, 2.0]]
    # replica 0 in the caller's thread, replica 1 on a worker: each on its device and the caller's stream there
    assert seen[0][:3] == (0, "caller@0", True)
    assert seen[1][:3] == (1, "caller@1", False)
    # the caller's CUDA autocast dtype reaches the worker (bf16 stays bf16)
    assert ("cuda", torch.bfloat16, False) in autocast
    assert cuda.host_syncs() == []


# ---- a CPU batch sent to CUDA replicas ---------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [64, 4 << 20])
def test_cpu_batch_to_cuda_replicas_never_waits_on_the_host(cuda, monkeypatch, nbytes):
    """Each chunk is its own host-to-device copy, asynchronous: from pinned staging for large batches (torch's
    pinned allocator keeps the block until the copy ran), straight from pageable memory for small ones (the
    driver has read the source when the call returns). A blocking copy would synchronise the host every step."""
    copies, pinned = [], []
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            copies.append((device.index, kwargs.get("non_blocking", False), t.data_ptr() in pinned_ptrs))
            return t.clone()
        return real_to(t, *args, **kwargs)

    pinned_ptrs = set()

    def pin_memory(t):
        p = t.clone()
        pinned.append(t.numel())
        pinned_ptrs.add(p.data_ptr())
        return p

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: t.untyped_storage().data_ptr() in pinned_ptrs)
    x = torch.arange(nbytes // 4, dtype=torch.float32).view(2, -1)
    chunks = _functions._scatter_host_to_cuda(x, [0, 1], None, 0)
    assert torch.equal(torch.cat(chunks), x)
    large = nbytes >= _functions._PIN_MIN_BYTES
    assert pinned == ([x.numel()] if large else [])
    assert [(d, nb) for d, nb, _ in copies] == [(0, True), (1, True)]


# ---- comm.scatter with explicit streams ---------------------------------------------------------------------------


def test_scatter_hands_each_chunk_to_its_given_stream(cuda, monkeypatch):
    """A device listed twice is written on its first entry's stream (the core orders one stream per device): the
    later entry's stream waits for that copy, and the chunk's block is recorded as used on it."""
    a1, b2, c1 = cuda.stream_on(1, "a@1"), cuda.stream_on(0, "b@0"), cuda.stream_on(1, "c@1")
    monkeypatch.setattr(comm, "_empty_like", lambda t, device: torch.empty_like(t))
    monkeypatch.setattr(_C, "scatter", lambda src, outs, dim, sizes, streams: cuda.record(
        "core_scatter", sorted(streams)))
    x = torch.arange(12.0).view(6, 2)
    out = comm.scatter(x, [1, 0, 1], dim=0, streams=[a1, b2, c1])
    assert len(out) == 3
    assert [e for e in cuda.log if e[0] != "grant_peer"] == [
        ("core_scatter", [(0, b2.cuda_stream), (1, a1.cuda_stream)]),
        ("wait", "c@1", "a@1"),
        ("record_stream", out[2].data_ptr(), "c@1"),
    ]


def test_scatter_of_a_cuda_source_with_streams(cuda3, monkeypatch):
    """With explicit streams: the source's device keeps the stream that produced the source (its current one, not
    the one given for its entry), a None entry means that device's current stream, and every chunk is allocated
    with the stream that writes it current, so that PyTorch's allocator ties its block to that stream."""
    cuda = cuda3
    cuda.install_memory(monkeypatch)
    a1, c1, g2 = cuda.stream_on(1, "a@1"), cuda.stream_on(1, "c@1"), cuda.stream_on(2, "g@2")
    made = []

    def empty_like(t, device):
        made.append((device.index, cuda.current_stream(device).name))
        return torch.empty_like(t, device=device)

    monkeypatch.setattr(comm, "_empty_like", empty_like)
    monkeypatch.setattr(_C, "scatter", lambda src, outs, dim, sizes, streams: cuda.record(
        "core_scatter", sorted(streams)))
    x = cuda.tensor(torch.arange(16.0).view(8, 2), 2)
    with cuda.stream(cuda.stream_on(0, "caller@0")), cuda.stream(cuda.stream_on(2, "producer@2")), cuda.device(1):
        out = comm.scatter(x, [1, 0, 1, 2], dim=0, streams=[a1, None, c1, g2])
    assert [o.get_device() for o in out] == [1, 0, 1, 2] and out[3].data_ptr() == x[6:].data_ptr()
    assert made == [(1, "a@1"), (0, "caller@0"), (1, "a@1")]
    handles = {"producer@2": None, "caller@0": None}
    for s in cuda.by_handle.values():
        handles[s.name] = s.cuda_stream
    assert [e for e in cuda.log if e[0] != "grant_peer"] == [
        ("core_scatter", [(0, handles["caller@0"]), (1, a1.cuda_stream), (2, handles["producer@2"])]),
        ("wait", "c@1", "a@1"), ("record_stream", out[2].data_ptr(), "c@1"),
        ("wait", "g@2", "producer@2"), ("record_stream", out[3].data_ptr(), "g@2"),
    ]


class _HostCore:
    """fastdp._C's data moves, each checked, then run on the host: every CUDA device among a call's tensors must be
    listed with this thread's current stream there (where the caller's work on them is ordered)."""

    def __init__(self, cuda, monkeypatch, route):
        self.cuda, self.calls, self.problems = cuda, [], []
        for name in ("copy", "broadcast", "scatter", "gather", "reduce_many"):
            monkeypatch.setattr(_C, name, self._checked(name, getattr(self, "_" + name)))
        monkeypatch.setattr(_C, "route", lambda op, key: route)
        monkeypatch.setattr(comm, "_ROUTES", {})

    def _checked(self, name, run):
        def call(*args):
            *rest, streams = args
            devices = sorted({t.get_device() for t in _tensors(rest) if t.is_cuda})
            listed = dict(streams or [])
            want = {d: self.cuda.current_stream(d).cuda_stream for d in devices}
            if {d: listed.get(d) for d in devices} != want:
                self.problems.append(f"{name}: streams {streams}, want the current ones {sorted(want.items())}")
            self.calls.append(name)
            return run(*rest)

        return call

    @staticmethod
    def _copy(dsts, srcs):
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def _broadcast(self, src, dsts):
        self._copy(dsts, [src] * len(dsts))

    @staticmethod
    def _scatter(src, outs, dim, sizes):
        for o, piece in zip(outs, src.split(list(sizes), dim)):
            if o.data_ptr() != piece.data_ptr():
                o.copy_(piece)

    @staticmethod
    def _gather(inputs, out, dim):
        out.copy_(torch.cat(inputs, dim))

    @staticmethod
    def _reduce_many(columns, outs):
        for column, out in zip(columns, outs):
            out.copy_(sum(column[1:], column[0].clone()))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _on_device(cuda, t, d):
    """A copy of t in fake memory of device d."""
    return cuda.tensor(t.clone(), d)


@pytest.mark.parametrize("route", ["nccl", "cuda"])
@pytest.mark.parametrize("case", ["broadcast", "broadcast_out", "broadcast_coalesced", "reduce_add",
                                  "reduce_add_coalesced", "scatter", "scatter_out", "gather"])
def test_comm_orders_core_work_on_each_devices_current_stream(cuda, monkeypatch, case, route):
    """Every call fastdp.comm makes into the core (packing, NCCL broadcasts of packed buckets, copies, sums, the
    copies back) lists the caller's current stream of every device it touches, a non-default one here on both
    devices; results equal torch's on the host. A sum's and a gather's default destination is the current device."""
    cuda.install_memory(monkeypatch)
    core = _HostCore(cuda, monkeypatch, route)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(6, 4, generator=g) for _ in range(3))
    ints = torch.randint(0, 9, (5,), generator=g)
    with cuda.stream(cuda.stream_on(0, "caller@0")), cuda.stream(cuda.stream_on(1, "caller@1")):
        if case == "broadcast":
            out = comm.broadcast(_on_device(cuda, a, 0), [0, 1])
            want = [a, a]
        elif case == "broadcast_out":
            out = comm.broadcast(_on_device(cuda, a, 1), out=[_on_device(cuda, b, 0), _on_device(cuda, c, 1)])
            want = [a, a]
        elif case == "broadcast_coalesced":
            srcs = [_on_device(cuda, t, 0) for t in (a, b[:, 1], ints, c)]  # a strided member: packed first
            out = [t for row in comm.broadcast_coalesced(srcs, [0, 1], buffer_size=64) for t in row]
            want = [a, b[:, 1], ints, c] * 2
        elif case == "reduce_add":
            with cuda.device(1):  # the default destination: the current device
                out = [comm.reduce_add([_on_device(cuda, a, 0), _on_device(cuda, b, 1)])]
            want = [a + b]
        elif case == "reduce_add_coalesced":
            rows = [[_on_device(cuda, a, d), _on_device(cuda, ints, d)] for d in (0, 1)]
            out = list(comm.reduce_add_coalesced(rows, destination=0, buffer_size=64))
            want = [a + a, ints + ints]
        elif case == "scatter":
            out = comm.scatter(_on_device(cuda, a, 0), [0, 1], dim=1)
            want = list(a.chunk(2, 1))
        elif case == "scatter_out":
            outs = [_on_device(cuda, b[:2], 1), _on_device(cuda, b[2:], 0)]
            out = comm.scatter(_on_device(cuda, a, 1), out=outs)
            want = [a[:2], a[2:]]
        else:
            with cuda.device(1):  # the default destination: the current device
                out = [comm.gather([_on_device(cuda, a, 0), _on_device(cuda, b, 1)])]
            want = [torch.cat([a, b])]
    assert core.calls and core.problems == [], core.problems
    assert len(out) == len(want)
    for o, w in zip(out, want):
        assert o.is_cuda and torch.equal(o, w)
    if case in ("gather", "reduce_add"):
        assert out[0].get_device() == 1
