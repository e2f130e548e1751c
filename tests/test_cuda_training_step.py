"""A training step over CUDA devices, run on a CPU against a recording stand-in for torch.cuda
(tests/_fake_cuda.py): SyncBatchNorm's exchange on the caller's streams and its backward given the kernel's saved
statistics, no tensor made from host data on a device, the gradient reduction on its own streams with exactly the
waits it needs (either side of torch 2.8), what it used held until its fence has passed, kept nodes remade for a
forward on other streams, and CUDA-graph capture refused with a clear error.

Tensors stay on the host; the code under test is told its devices are CUDA devices (conftest's ``cuda``
and ``cuda3`` fixtures install the fake, and fail a test that misused it). Every numeric result is compared with
torch's own on the bare model.
"""

import copy
import importlib
import threading

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._platform import devices as _devices
from fastdp._reduction import reducer as _reducer, host as _host, sums as _sums, cuda as _rcuda
from fastdp._step import replicas as _replicas
from fastdp import sync_batchnorm as sbn
from fastdp._syncbn import chunk as _syncbn_chunk

dp_module = importlib.import_module("fastdp.data_parallel")

pytestmark = pytest.mark.sim


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
            stats = _syncbn_chunk.statistics(xs[r])  # the chunk's statistics, in the replica's own thread
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


# ---- kept replicas and the reduction's own streams (NOTE [reduction streams] in fastdp/_reduction/cuda.py) ---------------


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
        roots = rs.refresh()
        out = roots[0](x[:2]).sum() + roots[1](x[2:]).sum()
    with cuda.stream(backward_streams[0]), cuda.stream(backward_streams[1]):
        out.backward()
    return roots


@pytest.mark.parametrize("version, rule", [
    ("2.8.0", "canonical"), ("2.8.1+cu128", "canonical"), ("2.9.0.dev20250901+cu129", "canonical"),
    ("2.8.0rc3", "canonical"), ("2.13.0+cpu", "canonical"), ("10.0.0", "canonical"),
    ("2.7.1+cu126", "default"), ("2.4.0", "default"), ("1.13.1", "default"), ("2.7.0a0+git1234abc", "default"),
    ("2.8.0a0+git5678def", "both"), ("2.8.0a0+5d9b0c3.nv25.06", "both"), ("2.8.0.dev20250501+cu126", "both"),
    ("weird", "both")])
def test_the_stream_rule_follows_what_the_version_can_tell(version, rule):
    """Autograd's stream rule changed during torch 2.8's development: a build whose version cannot tell which side
    it is on (a pre-release 2.8, as NGC containers and nightlies are) gets both waits."""
    assert _rcuda.stream_rule(version) == rule


def _engine(cuda, monkeypatch, rule, producers):
    """autograd's engine on a GPU (tests/_fake_cuda.py) runs the bucket nodes: replica r's gradients come from
    ``producers[r]``, on device r."""

    def devices(ctx, n):
        k = len(ctx.bucket.members)
        return [ctx.bucket.reducer.devices[i // k] for i in range(n)]

    cuda.engine(monkeypatch, _reducer.BucketNode, rule, producers, devices)


def _engine_waits(own0, engine):
    """What autograd's engine orders before a bucket node of Linear(4, 3) (two members per replica) runs: torch 2.8
    and newer, the node's canonical stream (the reduction's own on device 0) waits for every gradient; before, it
    waits for device 0's, and device 1's default stream for device 1's."""
    other = own0 if engine == "canonical" else "default@1"
    return [("wait_event", own0, "ready@caller@0")] * 2 + [("wait_event", other, "ready@caller@1")] * 2


def _ready_waits(own0, own1, rule):
    """What device 1's reduction stream waits for under each rule fastdp may choose (own0: the node's canonical
    stream)."""
    ready = {"canonical": [own0], "default": ["default@1"], "both": [own0, "default@1"]}[rule]
    return [("wait", own1, r) for r in ready]


_RULES = [("canonical", "canonical"), ("default", "default"), ("both", "canonical"), ("both", "default")]
_RULE_IDS = ["torch>=2.8", "torch<2.8", "unknown-new-engine", "unknown-old-engine"]


@pytest.mark.parametrize("rule, engine", _RULES, ids=_RULE_IDS)
def test_reduction_runs_on_its_own_streams_with_exactly_the_waits_it_needs(cuda, monkeypatch, rule, engine):
    """The bucket node runs on device 0's reduction stream (its canonical stream), where autograd's engine orders the
    gradients (by its rule); each other reduction stream waits for the stream where the rule fastdp chose guarantees
    them, the sum runs on the reduction's streams, and the delivery node's stream waits for a fence behind the first
    device's reduction stream. The sum's buffer and each gradient read are recorded as used by the reduction stream
    of their device, and nothing is held by the host: no fence is ever asked, nothing else orders anything, and
    nothing waits on the host."""
    monkeypatch.setattr(_rcuda, "_STREAM_RULE", rule)
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
    _engine(cuda, monkeypatch, engine, caller)
    x = torch.randn(4, 4)
    _step_and_backward(cuda, rs, x, caller, caller)
    own = [_rcuda.own_stream(0).name, _rcuda.own_stream(1).name]
    assert on == [tuple(own)]
    ordering = [e for e in cuda.log if e[0] in ("wait", "wait_event", "wait_fence", "fence")]
    fences = [e[1] for e in ordering if e[0] == "fence"]
    assert ordering == _engine_waits(own[0], engine) + _ready_waits(own[0], own[1], rule) + [
                        ("fence", fences[0], own[0]), ("wait_fence", "caller@0", fences[0])]
    assert [e[2] for e in cuda.entries("record_stream")] == [own[0]] * 3 + [own[1]] * 2  # the sum, then the grads
    assert cuda.host_syncs() == [] and cuda.entries("query") == []
    net.bias.grad, net.weight.grad = net.bias.grad.clone(), net.weight.grad.clone()
    (bare(x[:2]).sum() + bare(x[2:]).sum()).backward()
    torch.testing.assert_close(net.weight.grad, bare.weight.grad)


@pytest.mark.parametrize("rule, engine", _RULES, ids=_RULE_IDS)
def test_no_sync_shares_handed_over_at_once_are_ordered_before_the_nodes_stream(cuda, monkeypatch, rule, engine):
    """Where the bucket node hands its result to autograd at once (no_sync keeps the other replicas' shares and
    returns replica 0's; create_graph's differentiable sum takes the same path), the work still runs on the
    reduction's streams after the ready streams (autograd's rule of either side of torch 2.8), the gradients it read
    are recorded as used there, and the delivery node's stream waits for it before autograd takes it."""
    monkeypatch.setattr(_rcuda, "_STREAM_RULE", rule)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    bare = copy.deepcopy(net)
    rs = _cuda_replica_set(net)
    rs.reducer.set_sync(False)
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _engine(cuda, monkeypatch, engine, caller)
    x = torch.randn(4, 4)
    own = [_rcuda.own_stream(0).name, _rcuda.own_stream(1).name]
    _step_and_backward(cuda, rs, x, caller, caller)
    ordering = [e for e in cuda.log if e[0] in ("wait", "wait_event", "wait_fence", "fence")]
    fences = [e[1] for e in ordering if e[0] == "fence"]
    assert ordering == _engine_waits(own[0], engine) + _ready_waits(own[0], own[1], rule) + [
                        ("fence", fences[0], own[0]), ("wait_fence", "caller@0", fences[0])]
    assert [e[2] for e in cuda.entries("record_stream")] == [own[0]] * 2 + [own[1]] * 2 + ["caller@0"] * 2
    bare(x[:2]).sum().backward()
    torch.testing.assert_close(net.weight.grad, bare.weight.grad)  # replica 0's share, as a DDP rank's .grad
    assert cuda.host_syncs() == []


def test_before_a_step_runs_again_the_reductions_in_flight_are_waited_for(cuda, monkeypatch):
    """The out-of-memory rescue runs the step again at once: what the failed attempt's reductions still use on the
    late devices must be the allocator's again first, so the reducer waits for its devices."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    rs = _cuda_replica_set(net, bucket_bytes=1)
    caller = [cuda.default_stream(0), cuda.default_stream(1)]
    _engine(cuda, monkeypatch, "canonical", caller)
    cuda.late()
    _step_and_backward(cuda, rs, torch.randn(4, 4), caller, caller)
    pending = [s for s in (_rcuda.own_stream(0), _rcuda.own_stream(1)) if not s.query()]
    assert len(pending) == 2
    cuda.log.clear()
    rs.reducer.settle()
    assert {e[1] for e in cuda.log if e[0] == "device_sync"} == {0, 1} and all(s.query() for s in pending)


def test_unsynced_sums_given_back_are_added_on_the_reductions_streams(cuda, monkeypatch):
    """A synchronising backward that failed gives no_sync's sums back; holding them again adds them to what is held,
    and the next reduction reads the result on its own streams: so the addition runs there too, after the streams
    autograd names ready (on the thread's current stream the reduction would read it unordered)."""
    from fastdp._reduction import unsynced as _unsynced

    net = nn.Linear(4, 3)
    rs = _cuda_replica_set(net)
    rs.reducer.set_sync(False)
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    for _ in range(2):
        _step_and_backward(cuda, rs, torch.randn(4, 4), caller, caller)
    bucket = rs.reduced[0]
    bucket.unsynced.give_back(bucket.unsynced.take(bucket))  # as a synchronising backward that failed does
    _step_and_backward(cuda, rs, torch.randn(4, 4), caller, caller)  # a third no_sync backward holds more
    bucket.unsynced.give_back(bucket.unsynced.take(bucket))
    seen, real = [], _unsynced.UnsyncedSums.take_back

    def take_back(sums, b, nosync):
        seen.append(tuple(cuda.current_stream(d).name for d in (0, 1)))
        return real(sums, b, nosync)

    monkeypatch.setattr(_unsynced.UnsyncedSums, "take_back", take_back)
    own = (_rcuda.own_stream(0).name, _rcuda.own_stream(1).name)
    cuda.log.clear()
    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        rs.reducer.flush()
    assert seen == [own] and ("wait", own[0], "caller@0") in cuda.log


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
        roots = rs.refresh()
        node = roots[1].weight.grad_fn
        again = rs.refresh()
    assert again[1].weight.grad_fn is node  # same streams: the kept node
    cuda.log.clear()
    roots = _step_and_backward(cuda, rs, x, second, second)
    assert roots[1].weight.grad_fn is not node
    assert ("wait", _rcuda.own_stream(0).name, "second@0") in cuda.log
    assert cuda.host_syncs() == []
    torch.testing.assert_close(net.weight.grad, 2 * x.sum(0).expand(3, 4) / 2)


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
