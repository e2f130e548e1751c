"""SyncBatchNorm across emulated replicas: training equals the bare model's BatchNorm on the full batch. Those written
with tests/_places.py run on simulated CUDA devices too (tests/test_sim_contract.py)."""

import copy
import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fastdp

from _places import devices, host, module
from _replica_errors import ReplicaError

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class Net(nn.Module):
    """A convolution (or linear layer), a BatchNorm, a non-linearity, a head: the BatchNorm sees each replica's
    chunk, the loss the whole batch."""

    def __init__(self, dims, bn_kwargs, seq=False):
        super().__init__()
        c = 4
        if dims == 1 and not seq:
            self.pre = nn.Linear(5, c)
        else:
            conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
            self.pre = conv(3, c, 3, padding=1)
        self.bn = BN[dims](c, **bn_kwargs)
        self.head = nn.Linear(c, 2)

    def forward(self, x):
        h = torch.tanh(self.bn(self.pre(x)))
        if h.dim() > 2:
            h = h.flatten(2).mean(2)
        return self.head(h)


def _input(dims, batch, dtype, seq=False, gen=None):
    if dims == 1 and not seq:
        shape = (batch, 5)
    else:
        shape = (batch, 3) + (6,) * dims
    return torch.randn(shape, dtype=dtype, generator=gen)


def _close(a, b, tol, what):
    a = host(a)
    assert (a is None) == (b is None), what
    if a is None or a.numel() == b.numel() == 0:
        return
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


def _train_and_compare(bare, n, dtype, dims, chunk_sizes=None, steps=5, batch=10, seq=False, eval_after=True,
                       channels_last=False):
    tol = TOL[dtype]
    bare = bare.to(dtype)
    synced = module(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)))
    dp = fastdp.DataParallel(synced, device_ids=devices(n), chunk_sizes=chunk_sizes)
    opt_b = torch.optim.SGD(bare.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(synced.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = _input(dims, batch, dtype, seq, gen)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        xb = x.clone().requires_grad_()
        xd = x.clone().requires_grad_()
        yb, yd = bare(xb), dp(xd)
        _close(yd, yb, tol, f"step {step} output")
        yb.square().mean().backward()
        yd.square().mean().backward()
        _close(xd.grad, xb.grad, tol, f"step {step} input grad")
        for (name, pb), pd in zip(bare.named_parameters(), synced.parameters()):
            _close(pd.grad, pb.grad, tol, f"step {step} grad of {name}")
        opt_b.step()
        opt_d.step()
        opt_b.zero_grad()
        opt_d.zero_grad()
        for (name, bb), bd in zip(bare.named_buffers(), synced.buffers()):
            if bb.is_floating_point():
                _close(bd, bb, tol, f"step {step} buffer {name}")
            else:
                assert torch.equal(host(bd), bb), name
    if eval_after:
        bare.eval()
        dp.eval()
        x = _input(dims, batch, dtype, seq, gen)
        _close(dp(x), bare(x), tol, "eval output")
    return bare, synced, dp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 3])
def test_training_equals_full_batch(dims, n, dtype):
    torch.manual_seed(0)
    _train_and_compare(Net(dims, {}), n, dtype, dims)


@pytest.mark.parametrize("chunk_sizes", [[2, 5, 3], [1, 1, 8], [0, 6, 4]])
def test_uneven_chunks(chunk_sizes):
    # [0, 6, 4]: device 0 runs no chunk; its statistics come back from the first running replica.
    torch.manual_seed(0)
    _train_and_compare(Net(2, {}), 3, torch.float64, 2, chunk_sizes=chunk_sizes)


@pytest.mark.parametrize(
    "bn_kwargs",
    [{"momentum": None}, {"affine": False}, {"track_running_stats": False}, {"eps": 1e-2, "momentum": 0.5}],
    ids=["momentum-None", "affine-False", "no-running-stats", "eps-momentum"],
)
def test_layer_settings(bn_kwargs):
    torch.manual_seed(0)
    _train_and_compare(Net(2, bn_kwargs), 2, torch.float64, 2, chunk_sizes=[3, 7])


def test_sequence_input_batchnorm1d():
    torch.manual_seed(0)
    _train_and_compare(Net(1, {}, seq=True), 2, torch.float64, 1, seq=True)


def test_channels_last():
    torch.manual_seed(0)
    _train_and_compare(Net(2, {}), 2, torch.float32, 2, channels_last=True)


def test_threads_forced_even_when_cpu_replicas_run_in_thread(cpu_apply):
    torch.manual_seed(0)
    _train_and_compare(Net(2, {}), 3, torch.float64, 2, steps=2)


def test_layer_called_twice_and_no_grad():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.lin(self.bn(x)))

    torch.manual_seed(0)
    bare = Twice().double()
    synced = module(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)))
    dp = fastdp.DataParallel(synced, device_ids=devices(2))
    x = torch.randn(9, 4, dtype=torch.float64)
    _close(dp(x), bare(x), 1e-10, "output")
    with torch.no_grad():
        _close(dp(x), bare(x), 1e-10, "no_grad output")
    _close(synced.bn.running_var, bare.bn.running_var, 1e-10, "running_var")
    assert synced.bn.num_batches_tracked.item() == bare.bn.num_batches_tracked.item() == 4


def test_data_parallel_function():
    torch.manual_seed(0)
    bare = Net(2, {}).double()
    synced = module(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)))
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    out = fastdp.data_parallel(synced, x, device_ids=devices(2))
    _close(out, bare(x), 1e-10, "output")
    _close(synced.bn.running_mean, bare.bn.running_mean, 1e-10, "running_mean")


def test_criterion_path():
    torch.manual_seed(0)
    bare = Net(2, {}).double()
    synced = module(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)))
    loss_fn = nn.MSELoss()
    dp = fastdp.DataParallel(synced, device_ids=devices(2), criterion=loss_fn, chunk_sizes=[3, 5])
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    lb, ld = loss_fn(bare(x), y), dp(x, target=y)
    _close(ld, lb, 1e-10, "loss")
    lb.backward()
    ld.backward()
    _close(synced.pre.weight.grad, bare.pre.weight.grad, 1e-10, "grad")


def test_one_replica_is_plain_batchnorm():
    torch.manual_seed(0)
    _train_and_compare(Net(2, {}), 1, torch.float64, 2, steps=2)


def test_batch_of_one_raises_like_batchnorm():
    bare = nn.BatchNorm1d(3)
    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)), device_ids=["cpu"] * 2,
                             chunk_sizes=[1, 0])
    x = torch.randn(1, 3)
    with pytest.raises(ValueError) as upstream:
        bare(x)
    with pytest.raises(ValueError) as info:
        dp(x)
    ReplicaError("ValueError", 0, f"ValueError: {upstream.value}").check(info.value)


def test_convert_sync_batchnorm_keeps_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3), nn.Sequential(nn.BatchNorm1d(4)))
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].weight.uniform_()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    converted = fastdp.convert_sync_batchnorm(model)
    assert type(converted[1]) is nn.SyncBatchNorm and type(converted[2][0]) is nn.SyncBatchNorm
    assert type(converted[0]) is nn.Conv2d
    assert converted[1].momentum == 0.3
    got = converted.state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert type(fastdp.convert_sync_batchnorm(nn.BatchNorm3d(2))) is nn.SyncBatchNorm
    with pytest.raises(TypeError) as info:
        fastdp.convert_sync_batchnorm(lambda x: x)
    assert str(info.value) == "convert_sync_batchnorm: module must be a torch.nn.Module, got function"


def _no_hang(fn, timeout=60):
    """Runs fn in a thread; fails the test instead of hanging when it does not return in time."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the forward hung"
    if "error" in box:
        raise box["error"]
    return box.get("result")


class Picky(nn.Module):
    """Raises (or skips its BatchNorm) in the replica whose chunk has `bad` samples, before or after the BN."""

    def __init__(self, bad, where):
        super().__init__()
        self.bn = nn.SyncBatchNorm(3)
        self.bn2 = nn.SyncBatchNorm(3)
        self.bad, self.where = bad, where

    def forward(self, x):
        chosen = x.size(0) == self.bad
        if chosen and self.where == "before":
            raise KeyError("chosen replica fails")
        x = self.bn(x)
        if chosen and self.where == "skip":
            return x
        if chosen and self.where == "between":
            raise KeyError("chosen replica fails")
        return self.bn2(x)


@pytest.mark.parametrize("bad", [2, 4], ids=["replica0", "replica1"])
@pytest.mark.parametrize("where", ["before", "between", "skip"])
def test_failing_replica_releases_the_others(where, bad):
    dp = fastdp.DataParallel(Picky(bad, where), device_ids=["cpu"] * 3, chunk_sizes=[2, 4, 3])
    x = torch.randn(9, 3)
    expected = KeyError if where != "skip" else RuntimeError
    with pytest.raises(expected) as info:
        _no_hang(lambda: dp(x))
    chosen = [2, 4, 3].index(bad)
    if where == "skip":
        # The first replica released: the lowest index other than the chosen one; layer 1 is bn2.
        released = fastdp.sync_batchnorm.ReplicaReleased
        ReplicaError(
            "ReplicaReleased", 1 if chosen == 0 else 0,
            f"{released.__module__}.{released.__qualname__}: fastdp: replica {chosen} ended its forward without "
            "reaching call 0 of SyncBatchNorm layer 1; every replica must run the same synced layers",
        ).check(info.value)
    else:
        ReplicaError("KeyError", chosen, "KeyError: 'chosen replica fails'").check(info.value)
    # The wrapper still works afterwards.
    dp.module.bad = -1
    _no_hang(lambda: dp(x))


class RaisesOnFlag(nn.Module):
    """Two BatchNorm layers and a check before, between or after them that raises when a sample is flagged: the bare
    model raises there on the full batch, the wrapper in the replica whose chunk holds the sample."""

    def __init__(self, where, momentum):
        super().__init__()
        self.pre = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4, momentum=momentum)
        self.bn2 = nn.BatchNorm1d(4, momentum=momentum)
        self.head = nn.Linear(4, 2)
        self.where = where

    def check(self, where, flags):
        if where == self.where and bool(flags.any()):
            raise KeyError("a flagged sample")

    def forward(self, x, flags):
        self.check("before", flags)
        h = self.bn(self.pre(x))
        self.check("between", flags)
        h = self.bn2(torch.tanh(h))
        self.check("after", flags)
        return self.head(h)


def _buffers_equal(synced, bare, what):
    for (name, bb), bd in zip(bare.named_buffers(), synced.buffers()):
        if bb.is_floating_point():
            _close(bd, bb, 1e-10, f"{what}: {name}")
        else:
            assert torch.equal(bd, bb), f"{what}: {name} is {bd.item()}, the bare model's {bb.item()}"


@pytest.mark.parametrize("chunk_sizes", [[2, 4, 3], [0, 5, 4]], ids=["device0-runs", "device0-idle"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "momentum-None"])
@pytest.mark.parametrize("flagged", ["first-chunk", "last-chunk"])
@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_failed_step_leaves_buffers_as_the_bare_models_failed_forward(where, flagged, momentum, chunk_sizes):
    # A layer counts the batch once every replica reached it, and updates its statistics only from a completed
    # exchange: the buffers after a failed step, and every step after it, are the bare model's.
    torch.manual_seed(0)
    bare = RaisesOnFlag(where, momentum).double()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    dp = fastdp.DataParallel(synced, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)
    gen = torch.Generator().manual_seed(1)
    clear = torch.zeros(9, dtype=torch.bool)
    flags = clear.clone()
    flags[0 if flagged == "first-chunk" else 8] = True
    for step, marks in enumerate([clear, flags, clear, clear]):
        x = torch.randn(9, 3, dtype=torch.float64, generator=gen)
        if marks.any():
            with pytest.raises(KeyError):
                bare(x, marks)
            with pytest.raises(KeyError):
                _no_hang(lambda: dp(x, marks))
            _buffers_equal(synced, bare, f"step {step}, failed")
            continue
        yb, yd = bare(x, marks), dp(x, marks)
        _close(yd, yb, 1e-10, f"step {step} output")
        yb.square().mean().backward()
        yd.square().mean().backward()
        for (name, pb), pd in zip(bare.named_parameters(), synced.parameters()):
            _close(pd.grad, pb.grad, 1e-10, f"step {step} grad of {name}")
            pb.grad = pd.grad = None
        _buffers_equal(synced, bare, f"step {step}")


class Checkpointed(nn.Module):
    """BatchNorm layers inside blocks that activation checkpointing recomputes in backward. ``how``: "checkpoint" (two
    blocks, one a BatchNorm without affine), "sequential" (checkpoint_sequential over them), "shared" (one block,
    hence the same layers, checkpointed twice: their recomputations run in the reverse order of their calls),
    "input" (the block's input needs no gradient: BatchNorm on the raw images first)."""

    def __init__(self, how, momentum=0.1, reentrant=False):
        super().__init__()
        self.how, self.reentrant = how, reentrant
        self.raw = nn.Sequential(nn.BatchNorm2d(3, momentum=momentum), nn.Conv2d(3, 3, 1))
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block1 = nn.Sequential(nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                                    nn.BatchNorm2d(4, momentum=momentum), nn.Tanh())
        self.block2 = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=momentum, affine=False),
                                    nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        r = self.reentrant
        if self.how == "input":
            x = checkpoint(self.raw, x.detach(), use_reentrant=r)
        h = self.stem(x)
        if self.how == "sequential":
            h = checkpoint_sequential(nn.Sequential(*self.block1, *self.block2), 2, h, use_reentrant=r)
        elif self.how == "shared":
            h = checkpoint(self.block1, h, use_reentrant=r)
            h = checkpoint(self.block1, h, use_reentrant=r)
        else:
            h = checkpoint(self.block1, h, use_reentrant=r)
            h = checkpoint(self.block2, h, use_reentrant=r)
        return self.head(h.flatten(2).mean(2))


@pytest.mark.parametrize("chunk_sizes", [None, [2, 4, 3], [0, 5, 4]], ids=["chunk", "uneven", "device0-idle"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "momentum-None"])
@pytest.mark.parametrize("how", ["checkpoint", "sequential", "shared", "input"])
def test_checkpointed_synced_layers_equal_the_bare_model(how, momentum, chunk_sizes):
    # A recomputed synced layer normalises with its forward's whole-batch statistics, and counts and updates the
    # running statistics once more, as the bare model's recomputed BatchNorm does: outputs, gradients and buffers
    # equal the bare model's under the same checkpointing.
    torch.manual_seed(0)
    _train_and_compare(Checkpointed(how, momentum), 3, torch.float64, 2, chunk_sizes=chunk_sizes, steps=3, batch=9)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_synced_layer_followed_by_an_in_place_activation(reentrant):
    # timm's SyncBatchNormAct applies its activation in place on the norm's output: a recomputed synced call's output
    # must take that as the forward's did, with affine parameters and without.
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.head = nn.Conv2d(3, 4, 1), nn.Linear(4, 2)
            self.block = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1),
                                       nn.BatchNorm2d(4, affine=False), nn.ReLU(inplace=True))

        def forward(self, x):
            return self.head(checkpoint(self.block, self.stem(x), use_reentrant=reentrant).mean((2, 3)))

    torch.manual_seed(0)
    _train_and_compare(InPlace(), 3, torch.float64, 2, chunk_sizes=[2, 4, 3], steps=2, batch=9)


def _checkpointed_pair(how="checkpoint", reentrant=False, chunk_sizes=None):
    torch.manual_seed(0)
    bare = Checkpointed(how, reentrant=reentrant).double()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    return bare, synced, fastdp.DataParallel(synced, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)


def _grads_and_buffers_equal(synced, bare, what):
    for (name, pb), pd in zip(bare.named_parameters(), synced.parameters()):
        _close(pd.grad, pb.grad, 1e-10, f"{what}: grad of {name}")
    _buffers_equal(synced, bare, what)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # "input", in both models
@pytest.mark.parametrize("chunk_sizes", [None, [0, 5, 4]], ids=["chunk", "device0-idle"])
@pytest.mark.parametrize("how", ["checkpoint", "sequential", "shared", "input"])
def test_reentrant_checkpointed_synced_layers_equal_the_bare_model(how, chunk_sizes):
    # use_reentrant=True (torch's default before 2.9): the bare model's BatchNorm recomputes with the same batch, so
    # the same statistics, and counts and updates its running statistics once more; the synced layers train alike.
    # "input": the block's input needs no gradient, so neither the bare model's nor the replicas' block parameters
    # get one.
    torch.manual_seed(0)
    _train_and_compare(Checkpointed(how, reentrant=True), 3, torch.float64, 2, chunk_sizes=chunk_sizes, steps=3,
                       batch=9)


_REENTRANT = torch.utils.checkpoint.CheckpointFunction  # torch's class, bound at import as older code binds it


class DirectReentrant(nn.Module):
    """Calls torch's reentrant checkpoint class itself, as code written before torch.utils.checkpoint.checkpoint
    took use_reentrant does: a reentrant checkpoint fastdp cannot run in another form."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh())

    def forward(self, x):
        return self.head(_REENTRANT.apply(self.block, True, self.stem(x)))


def test_reentrant_checkpoint_it_cannot_redirect_raises_naming_the_fix():
    # A synced layer's gradient cannot be computed inside a reentrant recomputation (NOTE [synced layers]): an error
    # that names the layer and the call to make instead, never a silently wrong gradient.
    torch.manual_seed(0)
    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(DirectReentrant().double()), device_ids=["cpu"] * 2)
    loss = dp(torch.randn(8, 4, dtype=torch.float64)).square().mean()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    text = str(info.value)
    assert text.startswith("fastdp: SyncBatchNorm 'block.1' sits in a block checkpointed in reentrant mode by a "
                           "call fastdp does not see"), text
    assert "torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)" in text, text


def test_only_synced_replicas_threads_checkpoint_without_reentry():
    # The replicas' own reentrant checkpoints run without reentry while they run; a thread the forward starts, and
    # everything after the forward, gets torch's reentrant checkpoint.
    seen = []

    def reentrant_node(block, h):
        return type(checkpoint(block, h, use_reentrant=True).grad_fn).__name__

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.lin = nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            seen.append(("replica", reentrant_node(self.bn, h)))
            other = threading.Thread(target=lambda: seen.append(("other thread", reentrant_node(nn.Tanh(), h))))
            other.start()
            other.join()
            return self.bn(h)

    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(Probe()), device_ids=["cpu"] * 2)
    dp(torch.randn(8, 4)).sum().backward()
    replicas = [name for who, name in seen if who == "replica"]
    assert len(replicas) == 2 and "CheckpointFunctionBackward" not in replicas, seen
    assert [name for who, name in seen if who == "other thread"] == ["CheckpointFunctionBackward"] * 2, seen
    assert torch.utils.checkpoint.CheckpointFunction is _REENTRANT
    assert reentrant_node(nn.Tanh(), torch.randn(2, 4, requires_grad=True)) == "CheckpointFunctionBackward"


def test_pending_checkpointed_graphs_and_a_graph_backwarded_twice():
    # Two forwards before their backwards, in the other order, then a graph retained and backwarded twice: each
    # recomputation finds its own forward's statistics, and updates the running statistics as the bare model's.
    bare, synced, dp = _checkpointed_pair()
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(9, 3, 6, 6, dtype=torch.float64, generator=gen) for _ in range(3)]
    first, second = [(bare(x).square().mean(), dp(x).square().mean()) for x in xs[:2]]
    for lb, ld in (second, first):
        lb.backward()
        ld.backward()
        _grads_and_buffers_equal(synced, bare, "pending graphs")
    lb, ld = bare(xs[2]).square().mean(), dp(xs[2]).square().mean()
    for _ in range(2):
        lb.backward(retain_graph=True)
        ld.backward(retain_graph=True)
        _grads_and_buffers_equal(synced, bare, "graph backwarded twice")


def test_one_chunk_between_synced_checkpointed_steps():
    # A batch of one chunk runs the replica's layers alone (torch's SyncBatchNorm, as plain BatchNorm), recomputation
    # included; the synced steps around it are unaffected.
    bare, synced, dp = _checkpointed_pair()
    gen = torch.Generator().manual_seed(3)
    for n in (9, 1, 9):
        x = torch.randn(n, 3, 6, 6, dtype=torch.float64, generator=gen)
        yb, yd = bare(x), dp(x)
        _close(yd, yb, 1e-10, f"batch {n} output")
        yb.square().mean().backward()
        yd.square().mean().backward()
        _grads_and_buffers_equal(synced, bare, f"batch {n}")


def test_checkpointing_still_frees_the_synced_layers_inputs():
    # Each replica saves its synced layers' inputs in its own thread, through its own checkpoint: they are freed
    # after the forward and recomputed in backward, as the bare model's are.
    seen = []

    class Watched(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, h):
            h = self.conv(h)
            seen.append(weakref.ref(h))
            return torch.tanh(self.bn(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.block, self.head = nn.Conv2d(3, 4, 1), Watched(), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(checkpoint(self.block, self.stem(x), use_reentrant=False).mean((2, 3)))

    torch.manual_seed(0)
    bare = Model().double()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    dp = fastdp.DataParallel(synced, device_ids=["cpu"] * 3)
    x = torch.randn(9, 3, 6, 6, dtype=torch.float64)
    for model in (bare, dp):
        seen.clear()
        loss = model(x).square().mean()
        gc.collect()
        assert seen and all(ref() is None for ref in seen), f"{type(model).__name__} keeps a synced layer's input"
        loss.backward()
    _grads_and_buffers_equal(synced, bare, "after backward")


@pytest.mark.parametrize("how", ["checkpoint", "plain"])
def test_statistics_kept_for_recomputation_live_as_long_as_their_graph(how):
    # What a recomputation would need is kept per forward while its graph lives, never longer: after a backward,
    # a graph dropped without one, and a forward without autograd, nothing stays.
    kept = fastdp._syncbn.recompute.RECORDINGS
    torch.manual_seed(0)
    model = Checkpointed("checkpoint") if how == "checkpoint" else Net(2, {})
    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(model.double()), device_ids=["cpu"] * 3)
    x = torch.randn(9, 3, 6, 6, dtype=torch.float64)
    for _ in range(3):
        y = dp(x)
        assert len(kept) == 1
        y.square().mean().backward()
        del y
        assert len(kept) == 0
    y = dp(x)
    del y
    assert len(kept) == 0
    with torch.no_grad():
        dp(x)
    assert len(kept) == 0


def test_recomputation_that_differs_from_its_forward_raises():
    # A block that draws other random numbers when recomputed (checkpoint's preserve_rng_state=False) gives its
    # synced layer an input its forward never saw: an error, never another forward's statistics.
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.bn, self.head = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

        def block(self, h):
            return torch.tanh(self.bn(nn.functional.dropout(h, 0.5)))

        def forward(self, x):
            return self.head(checkpoint(self.block, self.stem(x), use_reentrant=False, preserve_rng_state=False))

    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(Noisy().double()), device_ids=["cpu"] * 2)
    loss = dp(torch.randn(8, 4, dtype=torch.float64)).sum()
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    assert str(info.value).startswith("fastdp: SyncBatchNorm layer 0 of a replica runs again in backward (a "
                                      "checkpointed block's recomputation) on an input whose statistics differ"), \
        str(info.value)


class _EveryDeviceAChunk(fastdp.DataParallel):
    """A scatter override that hands every device its chunk, an empty one included."""

    def scatter(self, inputs, kwargs, device_ids):
        return fastdp.scatter_kwargs(inputs, kwargs, device_ids, chunk_sizes=[4, 0, 3])


@pytest.mark.parametrize("case", ["empty-chunk", "no-spatial-extent", "empty-batch"])
def test_chunks_with_no_value_per_channel(case):
    # A replica whose chunk has no value per channel weighs nothing in the statistics, and a batch with no value at
    # all leaves the running statistics as they are (torch's BatchNorm on an empty input) and counts the batch.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
            self.bn = nn.BatchNorm1d(3, momentum=None).double()

        def forward(self, x):
            return self.bn(x * self.scale)

    torch.manual_seed(0)
    bare = Scaled()
    with torch.no_grad():
        bare.bn.running_mean.uniform_()
        bare.bn.running_var.uniform_(1, 2)
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    if case == "empty-chunk":
        dp, x = _EveryDeviceAChunk(synced, device_ids=["cpu"] * 3), torch.randn(7, 3, 5, dtype=torch.float64)
    else:  # (torch.chunk gives an empty batch one empty chunk per device)
        shape = (6, 3, 0) if case == "no-spatial-extent" else (0, 3, 5)
        dp, x = fastdp.DataParallel(synced, device_ids=["cpu"] * 3), torch.randn(shape, dtype=torch.float64)
    for step in range(2):
        yb, yd = bare(x), dp(x)
        assert yd.shape == yb.shape
        _close(yd, yb, 1e-10, f"step {step} output")
        (yb.square().sum() + yb.sum()).backward()
        (yd.square().sum() + yd.sum()).backward()
        _grads_and_buffers_equal(synced, bare, f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_of_offset_data(dtype):
    # Channels far from zero (100 standard deviations): variances from plain sums of squares would lose about
    # three digits in float32 (mean^2 = 1e4 against a variance of 1).
    torch.manual_seed(0)
    bare = nn.BatchNorm2d(3).to(dtype)
    dp = fastdp.DataParallel(fastdp.convert_sync_batchnorm(copy.deepcopy(bare)), device_ids=["cpu"] * 3,
                             chunk_sizes=[2, 3, 4])
    x = torch.randn(9, 3, 5, 5, dtype=dtype) + torch.tensor([100.0, -50.0, 7.0], dtype=dtype).view(1, 3, 1, 1)
    _close(dp(x), bare(x), TOL[dtype], "output")
    _close(dp.module.running_var, bare.running_var, TOL[dtype], "running_var")


def test_bench_sync_bn_option(tmp_path):
    from fastdp.bench import main

    assert main(["train", "--sync-bn", "2", "--steps", "1", "--warmup", "0", "--rounds", "1", "--batch", "8",
                 "--out", str(tmp_path)]) == 0
    import csv

    with open(tmp_path / "syncbn.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["config"] for r in rows] == ["BatchNorm", "BatchNorm, threads", "SyncBatchNorm"]
    assert all(float(r["step_ms"]) > 0 for r in rows) and rows[2]["extra_ms"] != ""
    assert main(["train", "--sync-bn", "1", "--out", str(tmp_path)]) == 2
