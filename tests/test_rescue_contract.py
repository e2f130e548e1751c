"""A rescued step is an ordinary step: ``dp.train_step(...)`` and the out-of-memory rescue (``oom="rebalance"``)
keep ``loss.backward()``'s contract whether or not a rescue happens (docs/balance.md, "What a rescued step keeps").

Each observable is compared with the same step on the bare model (a deep copy run without the wrapper on the full
batch), by both routes (``dp(...)`` then ``loss.backward()``, and ``dp.train_step``), without an out-of-memory
error and with one injected once (``fastdp.inject_oom``) in a replica's forward or, for ``train_step``, its
backward. The injected position is 1 by default: replica 0, which runs on the master's own buffers, has run its
forward when it fails. float64, within 1e-10.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

from _reference import TOL
from _report_cases import bn_model, data, mlp

pytestmark = pytest.mark.usefixtures("one_torch_thread")

R = 3
# (how the step runs, the phase an out-of-memory error is injected in, or None). loss.backward() is the user's:
# only train_step rescues a backward.
ROUTES = [("train_step", None), ("train_step", "forward"), ("train_step", "backward"),
          ("loss.backward", None), ("loss.backward", "forward")]
ROUTE_IDS = [f"{route}-{phase or 'no-oom'}" for route, phase in ROUTES]
RESCUED = [route for route in ROUTES if route[1]]  # the routes with an injected error
RESCUED_IDS = [i for route, i in zip(ROUTES, ROUTE_IDS) if route[1]]


def wrapped(bare, convert=None, **options):
    """A rescuing wrapper over a deep copy of `bare` (R emulated replicas, `convert` applied to the copy), and the
    copy."""
    model = copy.deepcopy(bare)
    if convert is not None:
        model = convert(model)
    return fastdp.DataParallel(model, device_ids=["cpu"] * R, oom="rebalance", **options), model


def wrapper_step(dp, route, phase, inputs, loss_fn=None, position=1, **kwargs):
    """One training step of `dp` by `route`, with an out-of-memory error injected once at `position` in `phase`
    (None: none); checks that the error fired and was rescued once. Returns the loss."""
    injection = None if phase is None else fastdp.inject_oom(dp, position, phase=phase, times=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if route == "train_step":
            loss = dp.train_step(*inputs, loss_fn=loss_fn, **kwargs)
        else:
            out = dp(*inputs, **kwargs)
            loss = out if loss_fn is None else loss_fn(out)
            loss.backward()
    rescues = [w for w in caught if "oom='rebalance'" in str(w.message)]
    if injection is not None:
        injection.remove()
        assert injection.fired == 1
    assert len(rescues) == (phase is not None), [str(w.message) for w in caught]
    return loss.detach()


def bare_step(model, inputs, loss_fn):
    loss = loss_fn(model(*inputs))
    loss.backward()
    return loss.detach()


def assert_close(actual, expected, what):
    assert (actual is None) == (expected is None), what
    if expected is not None:
        assert actual.shape == expected.shape, what
        torch.testing.assert_close(actual, expected, rtol=0, atol=TOL, msg=lambda m: f"{what}: {m}")


def assert_grads(model, bare):
    for (name, p), q in zip(model.named_parameters(), bare.parameters()):
        assert_close(p.grad, q.grad, f".grad of {name}")


def assert_buffers(model, bare):
    for (name, b), c in zip(model.named_buffers(), bare.buffers()):
        assert_close(b, c, f"buffer {name}")


# ---- every .grad loss.backward() fills ---------------------------------------------------------------------------


class TemperedLoss(nn.Module):
    """A criterion with learnable tensors of its own: a temperature, and penalties whose gradients autograd hands
    over as one tensor for two parameters (``a + b``) and as an expanded one (``c.sum()``)."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.a, self.b, self.c = (nn.Parameter(torch.full((4,), v, dtype=torch.float64)) for v in (0.1, 0.2, 0.3))

    def forward(self, out, target):
        return F.cross_entropy(out / self.temperature, target) + 1e-3 * ((self.a + self.b).pow(2).sum() + self.c.sum())


@pytest.mark.parametrize("where", ["loss_fn", "criterion", "criterion-per-replica"])
@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_gradients_outside_the_module_are_filled_as_loss_backward_fills_them(route, phase, where):
    """The loss's own learnable tensors (in loss_fn, in a criterion on the gathered output, in a criterion run on
    every replica) and an input that requires grad get the bare model's .grad, over two steps (the second
    accumulates onto the first's)."""
    bare = mlp()
    criterion = TemperedLoss()
    options = {}
    if where != "loss_fn":
        options = {"criterion": copy.deepcopy(criterion)}
        if where == "criterion-per-replica":
            options["criterion_reduction"] = "mean"
    dp, model = wrapped(bare, **options)
    theirs = options.get("criterion", copy.deepcopy(criterion))
    for s in range(2):
        x, y = data(18, seed=s)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        bare_step(bare, (xs[0],), lambda out: criterion(out, y))
        if where == "loss_fn":
            wrapper_step(dp, route, phase if s else None, (xs[1],), lambda out: theirs(out, y))
        else:
            wrapper_step(dp, route, phase if s else None, (xs[1],), target=y)
        assert_close(xs[1].grad, xs[0].grad, f"step {s}: the input's .grad")
    assert_grads(model, bare)
    assert_grads(theirs, criterion)


@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_a_no_sync_window_closed_by_either_route_reduces_what_no_sync_kept(route, phase):
    """Micro-batches under no_sync(), then the synchronising step by `route`: .grad holds every micro-batch's
    gradients, as loss.backward() accumulates them on the bare model; the next window starts from nothing kept."""
    bare = mlp()
    dp, model = wrapped(bare)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, bare)]
    seed = 0
    for window in range(2):
        for n in (7, 5):
            seed += 1
            x, y = data(n, seed=seed)
            with dp.no_sync():
                F.cross_entropy(dp(x), y).backward()
            F.cross_entropy(bare(x), y).backward()
        x, y = data(12, seed=100 + window)
        wrapper_step(dp, route, phase, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
        assert_grads(model, bare)
        for opt in opts:
            opt.step()
            opt.zero_grad()


# ---- buffers, running statistics and counters ----------------------------------------------------------------------


def set_mode(model, mode):
    """"train", or "re-estimate": the model in eval() with its BatchNorm layers in train(), as BatchNorm
    re-estimation (after SWA, after pruning) runs it."""
    model.train(mode == "train")
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()


def one_sample_repeated(n, seed):
    """A batch of one sample n times: every chunk has the full batch's statistics, so the buffers DataParallel's
    rule computes from replica 0's chunk (BatchNorm, observers) are the bare model's, whatever the split."""
    x, y = data(1, seed=seed)
    return x.expand(n, -1).contiguous(), y.expand(n).contiguous()


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("mode", ["train", "re-estimate"])
@pytest.mark.parametrize("layers", ["synced", "chunk-0"])
@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_running_statistics_and_counters_count_the_batch_once(route, phase, layers, mode, momentum):
    """BatchNorm's running statistics and num_batches_tracked after a rescued step are the bare model's, in
    training and with only the BatchNorm layers training. "synced": SyncBatchNorm across the replicas (the full
    batch's statistics); "chunk-0": BatchNorm, statistics from replica 0's chunk (upstream's rule), which runs
    before the failing replica, on one sample repeated."""
    bare = bn_model(momentum=momentum)
    dp, model = wrapped(bare, convert=fastdp.convert_sync_batchnorm if layers == "synced" else None)
    for m in (bare, model):
        set_mode(m, mode)
    for s in range(2):
        x, y = data(18, seed=s) if layers == "synced" else one_sample_repeated(18, s)
        wrapper_step(dp, route, phase, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
        assert_buffers(model, bare)
    assert_grads(model, bare)


class LazyTotal(nn.Module):
    """A buffer sized by the first forward (``how``: resize_, resize_as_ or set_ from a one-element placeholder
    that holds 1), zeroed then, and added to by every forward: a value of the parameters only, so every replica
    and the bare model add the same."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 3).double()
        self.register_buffer("total", torch.ones(1, dtype=torch.float64))

    def forward(self, x):
        value = self.lin.weight.detach().abs().mean(1)
        if self.total.shape != value.shape:
            if self.how == "resize_":
                self.total.resize_(value.shape)
            elif self.how == "resize_as_":
                self.total.resize_as_(value)
            else:
                self.total.set_(torch.empty_like(value))
            self.total.zero_()
        self.total += value
        return self.lin(x) * self.total


@pytest.mark.parametrize("how", ["resize_", "resize_as_", "set_"])
@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_buffers_sized_by_the_forward_are_put_back_with_their_size(route, phase, how):
    bare = LazyTotal(how)
    dp, model = wrapped(bare)
    for s in range(2):
        x, y = data(18, seed=s)
        wrapper_step(dp, route, phase, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
        assert_buffers(model, bare)
    assert_grads(model, bare)


def qat_net():
    ao = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    m = nn.Sequential(ao.QuantStub(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3), ao.DeQuantStub())
    m.train()
    m.qconfig = ao.get_default_qat_qconfig("fbgemm")
    return ao.prepare_qat(m)


@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_quantization_observers_sized_and_updated_by_the_forward(route, phase):
    """Quantization-aware training: the per-channel observers size their buffers in the first forward and every
    observer updates a moving average in each (from replica 0's chunk, upstream's rule: one sample repeated)."""
    bare = qat_net()
    dp, model = wrapped(bare)
    for s in range(3):
        x, y = one_sample_repeated(18, s)
        wrapper_step(dp, route, phase, (x.float(),), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x.float(),), lambda out: F.cross_entropy(out, y))
        for (name, b), c in zip(model.named_buffers(), bare.buffers()):
            assert b.shape == c.shape, (s, name)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {s}, {name}: {m}")


# ---- random draws --------------------------------------------------------------------------------------------------


def dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 3)).double()


@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_a_rescued_step_draws_what_the_same_step_draws_when_nothing_fails(route, phase):
    """Each replica draws its own chunk's dropout mask, so no split draws the bare model's masks (with or without a
    rescue). What the rescue keeps: the random generators are put back before the step runs again, so the step
    draws, computes and leaves the generators as the same step, on the split it ran with, does when nothing fails."""
    bare = dropout_net()
    dp, model = wrapped(bare)
    x, y = data(18)
    torch.manual_seed(5)
    loss = wrapper_step(dp, route, phase, (x,), lambda out: F.cross_entropy(out, y))
    state = torch.get_rng_state()
    ref, ref_model = wrapped(bare, chunk_sizes=dp._last_step.chunk_sizes)
    torch.manual_seed(5)
    ref_loss = wrapper_step(ref, route, None, (x,), lambda out: F.cross_entropy(out, y))
    assert ref._last_step.chunk_sizes == dp._last_step.chunk_sizes
    assert_close(loss, ref_loss, "the loss")
    assert_grads(model, ref_model)
    assert torch.equal(state, torch.get_rng_state())


# ---- the report ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route, phase", ROUTES, ids=ROUTE_IDS)
def test_a_rescued_step_is_one_step_of_the_report(route, phase):
    bare = mlp()
    dp, model = wrapped(bare, report=True)
    for s in range(3):
        x, y = data(18, seed=s)
        wrapper_step(dp, route, phase if s == 1 else None, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
    assert dp.report().steps == 3
    assert_grads(model, bare)


# ---- where the rows go ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_sizes", [[0, 9, 9], [2, 8, 8], [1.0, 2.0, 2.0]], ids=["idle-device-0", "sizes",
                                                                                      "weights"])
@pytest.mark.parametrize("route, phase", RESCUED, ids=RESCUED_IDS)
def test_rows_move_from_the_split_the_failed_attempt_ran(route, phase, chunk_sizes):
    """The failing position runs fewer rows than it ran in the failed attempt (the user's split, not torch.chunk's),
    and its rows go to the others in proportion to theirs: a device the split leaves idle stays idle, no device
    gets fewer rows than it had, none more than its share of the moved rows (and one for rounding)."""
    bare = mlp()
    x, y = data(18)
    ref, _ = wrapped(bare, chunk_sizes=chunk_sizes)
    ref(x)
    before = ref._last_step.chunk_sizes
    dp, model = wrapped(bare, chunk_sizes=chunk_sizes)
    wrapper_step(dp, route, phase, (x,), lambda out: F.cross_entropy(out, y), position=2)
    bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
    after = dp._last_step.chunk_sizes
    assert sum(after) == sum(before) and after[2] < before[2], (before, after)
    others = sum(before) - after[2]  # the rows the other positions take now
    for i in (0, 1):
        share = before[i] * others / (sum(before) - before[2])
        assert before[i] <= after[i] <= share + 1, (i, before, after)
    assert_grads(model, bare)


@pytest.mark.parametrize("route, phase", RESCUED, ids=RESCUED_IDS)
def test_a_device_a_small_batch_left_without_rows_keeps_its_share(route, phase):
    """torch.chunk's rule runs a batch smaller than the devices on the first ones only: a rescue of such a batch
    halves the failing device's share of every batch and leaves the others theirs, so the next, larger batch runs
    on every device again, the failing one with fewer rows than the others."""
    bare = mlp()
    dp, model = wrapped(bare)
    for s, n in enumerate((2, 18)):
        x, y = data(n, seed=s)
        wrapper_step(dp, route, phase if s == 0 else None, (x,), lambda out: F.cross_entropy(out, y), position=0)
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
    rows = dp._last_step.chunk_sizes
    assert 0 < rows[0] < min(rows[1:]), rows
    assert_grads(model, bare)


# ---- a step that fails twice ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("route, phase", RESCUED, ids=RESCUED_IDS)
@pytest.mark.parametrize("how", ["resize_", "set_"])
def test_failing_twice_leaves_every_observable_as_before_the_step(route, phase, how):
    """Every attempt runs out of memory: the first error is raised, and .grad, the buffers (sized by the forward
    here: their values, sizes and the bytes their storage holds) and the random generators are as before the step,
    as the bare model's that never ran it."""
    bare = LazyTotal(how)
    dp, model = wrapped(bare)
    x, y = data(18)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    injection = fastdp.inject_oom(dp, 1, phase=phase)
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError):
        if route == "train_step":
            dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
        else:
            F.cross_entropy(dp(x), y).backward()
    assert injection.fired == 2
    assert_grads(model, bare)
    assert_buffers(model, bare)
    assert model.total.untyped_storage().nbytes() == bare.total.untyped_storage().nbytes()
    assert torch.equal(state, torch.get_rng_state())
