"""What a real GPU shows of the gradient reduction that a recorder of calls cannot, run on a CPU against the model of
tests/_fake_cuda.py: queues that run behind the host by a different amount per stream, a caching allocator that
hands a freed block to the next allocation on its stream, autograd's engine with its stream waits on either side of
torch 2.8 (and builds whose version string misleads), and poisoned fresh memory.

Tensors stay on the host; the code under test is told its devices are CUDA devices. Each gradient reaches the bucket
node as a block of its replica's device written on the stream its replica ran on (the engine model adopts it), and
the sums are computed on the host while the reads and writes they stand for are noted on the stream they run on, so a
read that is not ordered after the write it needs, or a block handed out while another stream may still use it, is
a misuse (the ``cuda`` fixture fails the test). Every result is compared with torch's own on the bare model.
"""

import copy

import pytest
import torch
import torch.nn as nn

from fastdp import comm
from fastdp._platform import devices as _devices
from fastdp._reduction import reducer as _reducer, sums as _sums, cuda as _rcuda, flat as _flat
from fastdp._step import replicas as _replicas

pytestmark = pytest.mark.sim

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.fixture(autouse=True)
def _work_left(cuda):
    """Every torch operation on fake device memory is noted while a test runs (install_memory(work=True))."""
    yield
    cuda.leave()


def _replica_set(net, cuda, bucket_bytes=1 << 20):
    """A ReplicaSet over host tensors whose state says CUDA devices 0 and 1; the reducer's sums are allocated in fake
    device memory (their tensors stay on the host)."""
    rs = _replicas.ReplicaSet(net, [_devices.CPU] * 2, bucket_bytes)
    rs.state.devices = [0, 1]
    rs.state.host = False
    reducer = _reducer.Reducer([0, 1], CUDA, net)
    rs.reducer, rs.reduced = reducer, [reducer.bucket(b) for b in rs.layout[0]]
    return rs


def _gradient_devices(ctx, n):
    """The device of each gradient reaching a bucket node: replica-major, replica r's on device r."""
    k = len(ctx.bucket.members)
    return [ctx.bucket.reducer.devices[i // k] for i in range(n)]


def _model(cuda, monkeypatch, rule, producers):
    """The engine model for the bucket nodes, and the sums on the host with their reads and writes noted on the
    streams current where they run (the reduction's own, if the code under test is right)."""
    cuda.install_memory(monkeypatch, work=True)
    monkeypatch.setattr(_reducer, "_ZEROS", {})
    cuda.engine(monkeypatch, _reducer.BucketNode, rule, producers, _gradient_devices)

    def host_sum(bucket, grads, taken, out):
        for g in grads:
            if g is not None:
                cuda.use(g)
        rows = _sums.replica_rows(bucket, grads, taken)
        views = _flat.result_views(out, bucket)
        result = [None] * len(bucket.members)
        for j, view in enumerate(views):
            column = [row[j] for row in rows if row[j] is not None]
            if column:
                view.copy_(sum(column[1:], column[0]))
                result[j] = view
        cuda.use(out, write=True)
        return tuple(result)

    monkeypatch.setattr(_sums, "bucket_sum", host_sum)
    accumulate = _reducer._accumulate

    def noted_accumulate(bucket, grads, accumulating):  # no_sync: replica 0's passed on, the others' kept
        for g in grads:
            if g is not None:
                cuda.use(g)
        return accumulate(bucket, grads, accumulating)

    monkeypatch.setattr(_reducer, "_accumulate", noted_accumulate)

    def host_reduce_add_coalesced(per_device, destination=None, buffer_size=0):  # create_graph's sums
        for row in per_device:
            for t in row:
                cuda.use(t)
        return [sum(column[1:], column[0]) for column in zip(*per_device)]

    monkeypatch.setattr(comm, "reduce_add_coalesced", host_reduce_add_coalesced)


def _step(cuda, rs, x, streams):
    """One forward of the two replicas on `streams` (the caller's), then backward (the engine model runs the bucket
    nodes on their canonical streams)."""
    with cuda.stream(streams[0]), cuda.stream(streams[1]):
        roots = rs.refresh()
        out = roots[0](x[:2]).sum() + roots[1](x[2:]).sum()
        out.backward()


def _synchronized(cuda):
    """The host waits for every device before it reads results (as a test on a GPU would, before reading them back)."""
    for d in range(cuda.ndev):
        cuda.synchronize(d)


def _bare_grads(net, x):
    bare = copy.deepcopy(net)
    for p in bare.parameters():
        p.grad = None
    (bare(x[:2]).sum() + bare(x[2:]).sum()).backward()
    return [p.grad for p in bare.parameters()]


# ---- autograd's stream waits: replica 0's backward is not held by the other devices (either side of torch 2.8) ----


@pytest.mark.parametrize("version, engine", [
    ("2.9.0+cu128", "canonical"), ("2.7.1+cu126", "default"),
    ("2.8.0a0+git1111111", "canonical"), ("2.8.0a0+git0000000", "default")],
    ids=["torch>=2.8", "torch<2.8", "2.8-prerelease-new-rule", "2.8-prerelease-old-rule"])
def test_replica_0s_compute_stream_never_waits_for_another_devices_gradients(cuda, monkeypatch, version, engine):
    """From torch 2.8 autograd makes a node's canonical stream wait for every incoming gradient: a bucket node whose
    canonical stream were replica 0's compute stream would hold replica 0's remaining backward until the slowest
    device's gradients of every bucket exist. The waits land on the reduction's own stream instead; and whatever
    the engine's rule and whatever the version string says, the reduction reads no gradient before it is written
    (the queues run late, so nothing is complete by chance)."""
    monkeypatch.setattr(_rcuda, "_STREAM_RULE", _rcuda.stream_rule(version))
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, engine, {0: caller[0], 1: caller[1]})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    rs = _replica_set(net, cuda, bucket_bytes=1)  # a bucket per tensor: many nodes
    x = torch.randn(4, 4)
    _step(cuda, rs, x, caller)
    held = [e for e in cuda.log if e[0].startswith("wait") and e[1] == "caller@0"]
    assert held and all(e[2].endswith("@0") or e[2].startswith("f") for e in held), held
    assert cuda.host_syncs() == []
    _synchronized(cuda)
    for p, want in zip(net.parameters(), _bare_grads(net, x)):
        torch.testing.assert_close(p.grad, want, check_device=False)


def test_a_reduction_on_the_wrong_side_of_the_rule_reads_gradients_before_they_exist(cuda, monkeypatch):
    """The model is what catches a wrong rule: trusting torch 2.8's rule on an engine that has the old one (a
    pre-release 2.8 whose version string misleads) reads replica 1's gradients before its stream wrote them."""
    monkeypatch.setattr(_rcuda, "_STREAM_RULE", "canonical")
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "default", {0: caller[0], 1: caller[1]})
    net = nn.Linear(4, 3)
    _step(cuda, _replica_set(net, cuda), torch.randn(4, 4), caller)
    found, cuda.misuse[:] = list(cuda.misuse), []
    assert found and all("reads a block of device 1" in m for m in found), found


# ---- memory: nothing of the reduction outlives backward (the GPU behind the host) --------------------------------


def _live_blocks(cuda, device):
    return {address: b.nbytes for address, b in cuda.blocks.items() if b.device == device}


def test_device_0_at_optimizer_step_holds_what_upstream_holds_while_the_gpu_is_behind(cuda, monkeypatch):
    """With the GPU behind the host, backward returns long before its work has run. What a device holds when
    optimizer.step() starts allocating must be what upstream holds: the master's .grad on device 0, nothing of the
    replicas' gradients anywhere. Their memory goes back to the allocator stream-ordered, for it to hand out once the
    reduction's streams have read it (and on its out-of-memory path, after waiting for them)."""
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "canonical", {0: caller[0], 1: caller[1]})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    rs = _replica_set(net, cuda)
    x = torch.randn(4, 16)
    _step(cuda, rs, x, caller)
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in net.parameters()}
    token = {z.untyped_storage().data_ptr(): z.untyped_storage().nbytes() for z in _reducer._ZEROS.values()}
    assert _live_blocks(cuda, 0) == {**grads, **token}  # upstream's .grad (and the token zero made once)
    assert _live_blocks(cuda, 1) == {} and cuda.allocated == [sum(grads.values()) + sum(token.values()), 0]
    _synchronized(cuda)
    for p, want in zip(net.parameters(), _bare_grads(net, x)):
        torch.testing.assert_close(p.grad, want, check_device=False)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("mode", ["sync", "no_sync", "create_graph"])
def test_a_block_the_reduction_still_reads_is_not_handed_out_again(cuda, monkeypatch, mode):
    """The next forward allocates on the caller's streams at once, while the late reduction streams have not read the
    gradients autograd has already dropped (a started sum, no_sync's shares, create_graph's differentiable sum):
    the allocator must not hand their blocks to it (the fake records a block reused while a stream not ordered
    before may still read it)."""
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "canonical", {0: caller[0], 1: caller[1]})
    net = nn.Linear(8, 8)
    rs = _replica_set(net, cuda, bucket_bytes=1)
    rs.reducer.set_sync(mode != "no_sync")
    x = torch.randn(4, 8)
    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        roots = rs.refresh()
        (roots[0](x[:2]).sum() + roots[1](x[2:]).sum()).backward(create_graph=mode == "create_graph")
    del roots
    freed = [b for b in cuda.pool if b.device == 1 and b.stream == caller[1]]
    assert freed  # replica 1's gradients, dropped by autograd
    with cuda.stream(caller[1]):
        again = [torch.empty(b.nbytes // 4, device=CUDA[1]) for b in freed]  # the next forward's activations
    cuda.synchronize(0)  # device 0 has caught up, device 1's reduction stream has not
    with cuda.stream(caller[1]):
        again += [torch.empty(b.nbytes // 4, device=CUDA[1]) for b in freed]
    assert again and cuda.misuse == []
    assert all(torch.isnan(t).all() for t in again)  # fresh memory is poisoned, never zeros by chance
    cuda.synchronize(1)  # once the reduction's work has run, the blocks are the allocator's again
    with cuda.stream(caller[1]):
        torch.empty(freed[0].nbytes // 4, device=CUDA[1])
    assert not [b for b in cuda.pool if b is freed[0]]


def test_a_sum_a_failed_backward_drops_is_not_handed_out_under_the_reduction(cuda, monkeypatch):
    """A backward that fails after a bucket's sum started drops the sum's buffer (allocated on the consumer's
    stream) while the late reduction stream still writes it: the allocator must not hand it to the caller's next
    allocation before that write has run."""
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "canonical", {0: caller[0], 1: caller[1]})
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    rs = _replica_set(net, cuda, bucket_bytes=1)
    x = torch.randn(4, 8)

    def fail(grad):
        raise RuntimeError("planted: a hook fails in backward")

    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        roots = rs.refresh()
        h = roots[1][0](x[2:])
        h.register_hook(fail)  # runs after the last layer's buckets started their sums
        out = roots[0](x[:2]).sum() + roots[1][1](h).sum()
        with pytest.raises(RuntimeError, match="planted"):
            out.backward()
    del out, h, roots
    dropped = [b for b in cuda.pool if b.device == 0 and b.stream == caller[0]]
    assert dropped  # the started sums' buffers
    with cuda.stream(caller[0]):
        [torch.empty(b.nbytes // 4, device=CUDA[0]) for b in dropped]
    assert cuda.misuse == []


def test_a_rescue_finds_the_failed_attempts_memory_free_once_the_reducer_settled(cuda, monkeypatch):
    """Before an out-of-memory retry the reducer waits for its devices: every block its streams used is then the
    allocator's to hand out again, on every device (no block still waits for a late stream)."""
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "canonical", {0: caller[0], 1: caller[1]})
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    rs = _replica_set(net, cuda, bucket_bytes=1)
    _step(cuda, rs, torch.randn(4, 4), caller)
    assert [b for b in cuda.pool if b.ready > cuda.now]  # the GPU is behind: blocks wait for the reduction streams
    cuda.log.clear()
    rs.reducer.settle()
    assert {e[1] for e in cuda.entries("device_sync")} == {0, 1}
    assert [b for b in cuda.pool if b.ready > cuda.now] == []


# ---- no_sync on the model: shares held on the reduction's streams, fresh memory poisoned ----------------------------


@pytest.mark.parametrize("engine", ["canonical", "default"])
def test_no_sync_then_a_synchronising_backward_equals_the_bare_model(cuda, monkeypatch, engine):
    """Two backwards under no_sync then one outside it: the unsynced sums are made, added and read on the
    reduction's streams after the gradients are written (either engine rule, queues late), and no value comes from
    memory nobody wrote (fresh blocks are NaN). The master's .grad equals the bare model's accumulation."""
    monkeypatch.setattr(_rcuda, "_STREAM_RULE", engine)
    cuda.late()
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, engine, {0: caller[0], 1: caller[1]})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    bare = copy.deepcopy(net)
    rs = _replica_set(net, cuda)
    xs = [torch.randn(4, 4) for _ in range(3)]
    for i, x in enumerate(xs):
        rs.reducer.set_sync(i == 2)
        _step(cuda, rs, x, caller)
        (bare(x[:2]).sum() + bare(x[2:]).sum()).backward()
    _synchronized(cuda)
    for p, q in zip(net.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, check_device=False)


class _Either(nn.Module):
    """A replica with two rows of input uses ``a``, the others ``b``: each member has one replica without a
    gradient for it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x) if x.shape[0] == 2 else self.b(x)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_differentiable_sum_counts_a_missing_gradient_as_zero(cuda, monkeypatch):
    """create_graph=True sums through ReduceAddCoalesced, which stands a zero in for a replica that has no gradient
    of a member: fresh memory is poisoned, so anything but written zeros shows in the result."""
    caller = [cuda.stream_on(0, "caller@0"), cuda.stream_on(1, "caller@1")]
    _model(cuda, monkeypatch, "canonical", {0: caller[0], 1: caller[1]})
    torch.manual_seed(0)
    net = _Either()
    bare = copy.deepcopy(net)
    rs = _replica_set(net, cuda)
    x = torch.randn(5, 4)
    with cuda.stream(caller[0]), cuda.stream(caller[1]):
        roots = rs.refresh()
        (roots[0](x[:2]).sum() + roots[1](x[2:]).sum()).backward(create_graph=True)
    (bare(x[:2]).sum() + bare(x[2:]).sum()).backward(create_graph=True)
    _synchronized(cuda)
    for p, q in zip(net.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, check_device=False)
