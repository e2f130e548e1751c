"""The shim's CUDA-only branches, run on a CPU against a recording stand-in for torch.cuda (tests/_fake_cuda.py):
which stream each piece of work is ordered on, which stream waits for which, which blocks are recorded as used on
another stream, and that a training step never stalls the host. Tensors stay on the host; the code under test is
told its devices are CUDA devices 0 and 1. Every numeric result is compared with torch's own on the bare model."""

import copy
import importlib
import threading
import types
import warnings

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import _C, comm
from fastdp._native import core as _core, fallback as _fallback
from fastdp._platform import devices as _devices
from fastdp._step import functions as _functions, replicas as _replicas
from fastdp._reduction import reducer as _reducer, host as _host, sums as _sums, cuda as _rcuda
from fastdp._balance import split as _split
from fastdp import sync_batchnorm as sbn

pa = importlib.import_module("fastdp.parallel_apply")
dp_module = importlib.import_module("fastdp.data_parallel")

from _fake_cuda import FakeCuda

pytestmark = pytest.mark.sim

_GRANT_PEER = _core._grant_peer  # the fixture stands in for it; one test checks the real one


def _fake(monkeypatch, ndev):
    fake = FakeCuda(ndev).install(monkeypatch)
    # CUDA device entries pass the normaliser although this torch has no CUDA
    monkeypatch.setattr(_devices, "_require_cuda", lambda d, what: d)
    monkeypatch.setattr(_core, "_PEERS_OPEN", set())
    monkeypatch.setattr(_core, "_grant_peer", lambda device, peer: fake.record("grant_peer", device, peer))
    return fake


@pytest.fixture
def cuda(monkeypatch):
    fake = _fake(monkeypatch, 2)
    yield fake
    assert fake.misuse == [], fake.misuse  # a device that does not exist, a stream told the wrong device


@pytest.fixture
def cuda3(monkeypatch):
    fake = _fake(monkeypatch, 3)
    yield fake
    assert fake.misuse == [], fake.misuse


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


# ---- SyncBatchNorm on CUDA -----------------------------------------------------------------------------------------


class _HostComm:
    """fastdp.comm's three calls of the synced layers, computed on the host, noting the current stream of every
    device at each call (what the core would order the exchange on)."""

    def __init__(self, cuda):
        self.cuda, self.calls = cuda, []

    def _note(self, what):
        self.calls.append((what, tuple(self.cuda.current_stream(d).name for d in range(self.cuda.ndev))))

    def gather(self, parts, dim, dest):
        self._note("gather")
        return torch.cat(parts, dim)

    def broadcast(self, t, devices):
        self._note("broadcast")
        return [t.clone() for _ in devices]

    def reduce_add(self, ts, dest):
        self._note("reduce_add")
        return sum(ts[1:], ts[0].clone())


def test_syncbn_exchange_runs_on_the_callers_streams(cuda, monkeypatch):
    """The exchange runs in whichever replica thread arrives last and its backward in autograd's thread; both must
    order their work on the caller's stream of every device, where the replicas' inputs and gradients are."""
    host = _HostComm(cuda)
    monkeypatch.setattr(sbn, "comm", host)
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    master = nn.Sequential(nn.SyncBatchNorm(3))
    replicas = [master, copy.deepcopy(master)]
    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        session = sbn.begin(master, replicas, [0, 1])  # in the caller's thread, as the wrapper's forward opens it
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 5, generator=g, requires_grad=True) for _ in range(2)]
    outs = [None, None]

    def replica(r):  # a worker: its own device's caller stream only, as parallel_apply enters it
        with cuda.device(r), cuda.stream(caller[r]):
            stats = sbn._chunk_stats(xs[r])  # the chunk's statistics, in the replica's own thread
            outs[r] = session.meet(0, r, xs[r], stats, replicas[r][0])[0]

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cat(outs).square().sum().backward()  # this thread: default streams, as autograd's own threads have
    assert [w for w, _ in host.calls] == ["gather", "broadcast", "reduce_add", "broadcast"]
    assert all(streams == ("caller@0", "caller@1") for _, streams in host.calls), host.calls
    assert cuda.host_syncs() == []
    ref_x = torch.cat([x.detach() for x in xs]).requires_grad_()
    ref = torch.nn.functional.batch_norm(ref_x, None, None, training=True, eps=1e-5)
    torch.testing.assert_close(torch.cat(outs), ref)
    ref.square().sum().backward()
    torch.testing.assert_close(torch.cat([x.grad for x in xs]), ref_x.grad)


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.SyncBatchNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_syncbn_backward_gives_the_kernel_saved_statistics(monkeypatch, dtype):
    """torch's CUDA batch-norm backward asserts unless given save_mean and save_invstd (float32 for float16 and
    bfloat16 inputs) in training form; the gradients still equal BatchNorm's on the full batch."""
    calls = []
    real = torch.ops.aten.native_batch_norm_backward

    def spy(g, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
        calls.append((x.dtype, running_mean, running_var, None if save_mean is None else save_mean.dtype,
                      None if save_invstd is None else save_invstd.dtype, train))
        return real(g, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask)

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", spy)
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)).double()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare)).to(dtype)
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    dp = fastdp.DataParallel(synced, device_ids=["cpu"] * 2)
    w = torch.randn(8, 4, 5, 5, dtype=torch.float64)
    (dp(x.to(dtype)).double() * w).sum().backward()
    (bare(x) * w).sum().backward()  # the reference: float64, the whole batch in one BatchNorm
    stats = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    assert calls and all(c == (dtype, None, None, stats, stats, True) for c in calls), calls
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for p, q in zip(synced.parameters(), bare.parameters()):
        err = (p.grad.double() - q.grad).abs().max().item()
        assert err <= tol * q.grad.abs().max().item(), (tuple(q.shape), err)


# ---- no host synchronisation in a training step -------------------------------------------------------------------


def test_training_step_makes_no_tensor_from_host_data_on_a_device(monkeypatch):
    """``torch.tensor(values, device=d)`` copies host data to the device and, on CUDA, waits for the copy: a step
    (per-replica loss with the "mean" rule, a SyncBatchNorm layer) makes none, nor reads a value back."""
    made, read = [], []
    real_tensor, real_item = torch.tensor, torch.Tensor.item

    def tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            made.append(kwargs["device"])
        return real_tensor(data, *args, **kwargs)

    torch.manual_seed(0)
    net = _BNNet()
    bare = copy.deepcopy(net)
    dp = fastdp.DataParallel(net, device_ids=["cpu"] * 2, criterion=nn.MSELoss())
    x, y = torch.randn(6, 3, 4, 4), torch.randn(6, 3)
    dp(x, target=y).backward()  # the first step builds what is kept
    for p in net.parameters():
        p.grad = None
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "item", lambda t: read.append(t.shape) or real_item(t))
    loss = dp(x, target=y)
    loss.backward()
    monkeypatch.undo()
    assert made == [] and read == []
    ref = nn.MSELoss()(bare(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for p, q in zip(net.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ---- kept replicas and the reduction's own streams (NOTE [reduction streams] in fastdp/_reducer.py) ---------------


def _cuda_replica_set(net, bucket_bytes=1 << 20):
    """A ReplicaSet built over host tensors whose state then says CUDA devices 0 and 1 (the tensors stay on the
    host; every torch.cuda call goes to the fake)."""
    rs = _replicas.ReplicaSet(net, [_devices.CPU] * 2, bucket_bytes)
    rs.state.devices = [0, 1]
    rs.state.host = False
    reducer = _reducer.Reducer([0, 1], rs.state.tdevs, net)
    reducer.host, reducer.runner = False, _rcuda.CudaStreams([0, 1])  # the devices the fake says
    rs.reducer, rs.reduced = reducer, [reducer.bucket(b) for b in rs.layout[0]]
    return rs


def _step_and_backward(cuda, rs, x, forward_streams, backward_streams):
    """One forward of the two replicas on `forward_streams`, then backward with `backward_streams` current in this
    thread (as autograd's engine makes a node's canonical stream current on its device while it runs)."""
    with cuda.stream(forward_streams[0]), cuda.stream(forward_streams[1]):
        roots = rs.step()
        out = roots[0](x[:2]).sum() + roots[1](x[2:]).sum()
    with cuda.stream(backward_streams[0]), cuda.stream(backward_streams[1]):
        out.backward()
    return roots


@pytest.mark.parametrize("legacy", [False, True], ids=["torch>=2.8", "torch<2.8"])
def test_reduction_runs_on_its_own_streams_with_exactly_the_waits_it_needs(cuda, monkeypatch, legacy):
    """Each reduction stream waits for the stream where autograd guarantees the gradients are ready (torch 2.8 and
    newer: the bucket node's canonical stream for every device; before: that stream for the first device, each other
    device's default stream), the sum runs on the reduction's streams, and the delivery node's stream waits for a
    fence behind the first device's reduction stream; the tensors it used are held until a fence behind every
    reduction stream has passed. Nothing else orders anything, and nothing waits on the host."""
    monkeypatch.setattr(_rcuda, "_LEGACY_STREAMS", legacy)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    bare = copy.deepcopy(net)
    rs = _cuda_replica_set(net)
    on = []
    real_sum = _sums.bucket_sum

    def spy_sum(bucket, grads, kept, out):
        on.append(tuple(cuda.current_stream(d).name for d in (0, 1)))
        return real_sum(bucket, grads, kept, out)

    monkeypatch.setattr(_sums, "bucket_sum", spy_sum)
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    x = torch.randn(4, 4)
    _step_and_backward(cuda, rs, x, caller, caller)
    own = [_rcuda.own_stream(0).name, _rcuda.own_stream(1).name]
    assert on == [tuple(own)]
    ready1 = "default@1" if legacy else "caller@0"
    ordering = [e for e in cuda.log if e[0] in ("wait", "wait_event", "wait_fence", "fence", "record_stream")]
    fences = [e[1] for e in ordering if e[0] == "fence"]
    assert ordering == [("wait", own[0], "caller@0"), ("wait", own[1], ready1),
                        ("fence", fences[0], own[0]), ("fence", fences[0], own[1]),
                        ("fence", fences[2], own[0]),
                        ("wait_fence", "caller@0", fences[2])]
    assert cuda.host_syncs() == []
    net.bias.grad, net.weight.grad = net.bias.grad.clone(), net.weight.grad.clone()
    (bare(x[:2]).sum() + bare(x[2:]).sum()).backward()
    torch.testing.assert_close(net.weight.grad, bare.weight.grad)


@pytest.mark.parametrize("legacy", [False, True], ids=["torch>=2.8", "torch<2.8"])
def test_no_sync_shares_handed_over_at_once_are_ordered_before_the_nodes_stream(cuda, monkeypatch, legacy):
    """Where the bucket node hands its result to autograd at once (no_sync keeps the other replicas' shares and
    returns replica 0's; create_graph's differentiable sum takes the same path), the work still runs on the
    reduction's streams after the ready streams (autograd's rule of either side of torch 2.8), and the node's
    stream waits for it before autograd takes it."""
    monkeypatch.setattr(_rcuda, "_LEGACY_STREAMS", legacy)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    bare = copy.deepcopy(net)
    rs = _cuda_replica_set(net)
    rs.reducer.set_sync(False)
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    x = torch.randn(4, 4)
    own = [_rcuda.own_stream(0).name, _rcuda.own_stream(1).name]
    _step_and_backward(cuda, rs, x, caller, caller)
    ordering = [e for e in cuda.log if e[0] in ("wait", "wait_event", "wait_fence", "fence")]
    fences = [e[1] for e in ordering if e[0] == "fence"]
    assert ordering == [("wait", own[0], "caller@0"), ("wait", own[1], "default@1" if legacy else "caller@0"),
                        ("fence", fences[0], own[0]), ("fence", fences[0], own[1]), ("fence", fences[2], own[0]),
                        ("wait_fence", "caller@0", fences[2])]
    bare(x[:2]).sum().backward()
    torch.testing.assert_close(net.weight.grad, bare.weight.grad)  # replica 0's share, as a DDP rank's .grad
    assert cuda.host_syncs() == []


def test_reduction_holds_what_it_used_until_its_fence_has_passed(cuda, monkeypatch):
    """The gradients the reduction reads stay alive (the caching allocator cannot hand out their memory) until the
    host sees the fence behind the reduction's streams pass; the next forward sweeps them away once it has."""
    import weakref

    net = nn.Linear(4, 3)
    rs = _cuda_replica_set(net)
    seen = []
    real_sum = _sums.bucket_sum

    def spy_sum(bucket, grads, kept, out):
        seen.extend(weakref.ref(g) for g in grads if g is not None)
        return real_sum(bucket, grads, kept, out)

    monkeypatch.setattr(_sums, "bucket_sum", spy_sum)
    caller = [cuda.default_stream(0), cuda.default_stream(1)]
    cuda.fences_done = False
    _step_and_backward(cuda, rs, torch.randn(4, 4), caller, caller)
    assert seen and all(r() is not None for r in seen)
    with cuda.stream(caller[0]):
        rs.step()  # the fence has not passed: still held
    assert all(r() is not None for r in seen)
    cuda.fences_done = True
    with cuda.stream(caller[0]):
        rs.step()
    assert all(r() is None for r in seen)


def test_kept_nodes_are_remade_for_a_forward_on_other_streams(cuda, monkeypatch):
    """Autograd orders a node's backward on the streams current when the node was made: a step on other streams
    gets new nodes, and the reduction waits for the stream autograd then makes current."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    rs = _cuda_replica_set(net)
    first = [cuda.stream_on(0, "first@0"), cuda.stream_on(1, "first@1")]
    second = [cuda.stream_on(0, "second@0"), cuda.stream_on(1, "second@1")]
    x = torch.randn(4, 4)
    with cuda.stream(first[0]), cuda.stream(first[1]):
        roots = rs.step()
        node = roots[1].weight.grad_fn
        again = rs.step()
    assert again[1].weight.grad_fn is node  # same streams: the kept node
    cuda.log.clear()
    roots = _step_and_backward(cuda, rs, x, second, second)
    assert roots[1].weight.grad_fn is not node
    assert ("wait", _rcuda.own_stream(0).name, "second@0") in cuda.log
    assert cuda.host_syncs() == []
    torch.testing.assert_close(net.weight.grad, 2 * x.sum(0).expand(3, 4) / 2)


# ---- what each device reports: memory, properties ----------------------------------------------------------------


def test_memory_report_reads_and_resets_each_device(cuda):
    """memory_report's figures are each listed device's own, and reset_peak resets the peaks of those devices."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.device_ids = [1, 0]

    cuda.allocated, cuda.peak = [10, 20], [100, 200]
    report = fastdp.memory_report(Wrapper(), reset_peak=True)
    assert [(d.device, d.allocated, d.peak) for d in report.devices] == [("cuda:1", 20, 200), ("cuda:0", 10, 100)]
    assert sorted(cuda.entries("reset_peak")) == [("reset_peak", 0), ("reset_peak", 1)]


@pytest.mark.parametrize("ids, warned", [([0, 1], (1, 0)), ([1, 0], (1, 0)), ([0, 0], None)])
def test_imbalance_warning_names_the_weaker_gpu(cuda, ids, warned):
    """Upstream's warning compares each listed GPU's own properties and names the one with less memory."""
    cuda.props[1].total_memory = 40 << 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp_module._checks.check_balance(ids)
    texts = [str(w.message) for w in caught]
    if warned is None:
        assert texts == []
    else:
        assert texts == [dp_module._checks.IMBALANCE_WARNING.format(*warned)]


@pytest.mark.parametrize("local_rank, device_ids, want", [("1", None, 1), ("1", [0, 1], 1), ("0", [1], 1)])
def test_distributed_rank_makes_its_gpu_current(cuda, monkeypatch, local_rank, device_ids, want):
    """Each process of fastdp.DistributedDataParallel makes its own GPU current before the process group (and the
    user's own .cuda() calls) use it: LOCAL_RANK's, or the one device_ids names for it."""
    from fastdp import distributed

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert distributed._bind_device(device_ids) == torch.device("cuda", want)
    assert cuda.entries("set_device") == [("set_device", want)] and cuda.current_device() == want


# ---- the benchmarks: timings wait for every GPU they use, peaks per device ----------------------------------------


def test_benchmarks_wait_for_and_measure_every_device(cuda):
    """A timing of work over several GPUs ends when the last of them is done (torch.cuda.synchronize() waits for the
    current device only), and peak memory is reset and read on each device a configuration uses."""
    from fastdp.bench import comm as bench_comm, phases, syncbn

    def synced(fn):
        cuda.log.clear()
        fn()
        return sorted(e[1] for e in cuda.entries("device_sync"))

    assert synced(phases.synchronize_all([1, 0, 1])) == [0, 1]
    config = types.SimpleNamespace(device_ids=[1, 1])
    assert synced(phases.device_sync("cuda", [config, types.SimpleNamespace(device_ids=None)])) == [0, 1]
    assert synced(syncbn._step_sync("cuda", [0, 1])) == [0, 1]
    targets = {name: sync for name, _, sync, _ in bench_comm._targets(2)}
    assert synced(targets["cuda"]) == [0] and synced(targets["nccl"]) == [0, 1]
    cuda.peak = [7 << 20, 9 << 20]
    assert phases.peak_read("cuda", config) == {"cuda:1": 9.0}
    phases.peak_reset("cuda", config)
    assert cuda.entries("reset_peak") == [("reset_peak", 1)]


# ---- CUDA-graph capture ------------------------------------------------------------------------------------------


def test_capture_is_refused_with_a_clear_error(cuda, monkeypatch):
    """A multi-device forward and the gradient reduction hop threads and order work across devices: under graph
    capture they raise an error that names the capture instead of recording a broken graph."""
    net = nn.Linear(4, 3)
    dp = fastdp.DataParallel(net, device_ids=["cpu"] * 2)
    out = dp(torch.randn(4, 4))  # the graph to differentiate, made before the capture starts
    dp.src_device_obj = torch.device("cuda", 0)  # as for CUDA replicas; the module check is for real devices only
    monkeypatch.setattr(dp_module._checks, "check_module_device", lambda module, device: None)
    cuda.capturing = True
    with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
        dp(torch.randn(4, 4))
    dp._replica_set.reducer.host = False  # a reduction over CUDA devices
    with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
        out.sum().backward()
    cuda.capturing = False
    dp.src_device_obj = torch.device("cpu")
    dp._replica_set.reducer.host = True
    dp(torch.randn(4, 4)).sum().backward()  # outside the capture: runs


# ---- chunk_sizes="auto": the user's peak counters stay whole ------------------------------------------------------


def test_auto_split_reads_peaks_without_resetting_them(cuda):
    """The default reader samples the allocator's current figure (end of each training forward, and when read)
    and never resets the process-wide peak counters, which the user may be reading too."""
    rule = _split.AutoSplit(warmup=0, probes=2).bind([0, 1])
    reader = rule.reader
    assert isinstance(reader.__self__, fastdp._balance.memory.PeakWindow)
    cuda.peak = [10**9, 10**9]  # the user's own high-water marks: never moved here, so the samples tell
    cuda.allocated = [50, 40]
    reader.__self__.sample()
    cuda.allocated = [20, 45]
    assert reader() == [50, 45]  # the highest of the samples and the reading
    cuda.allocated = [5, 5]
    assert reader() == [20, 45]  # a new interval starts at each reading, with what was allocated then
    assert reader() == [5, 5]
    for a0, a1 in [(50, 40), (80, 40), (70, 60), (30, 30)]:
        rule.observe()
        rule.split(8, 0, 2)
        cuda.allocated = [a0, a1]
        rule.sample()  # the end of the training forward
        cuda.allocated = [5, 5]
    assert [round(r, 3) for _, r in rule.history] == [1.25, 2.0, 1.167]  # each judged step its own peaks
    assert cuda.entries("reset_peak") == []
    assert cuda.peak == [10**9, 10**9]
