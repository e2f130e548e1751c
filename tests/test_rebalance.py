"""Rows moved between emulated replicas while training: ``chunk_sizes="auto"``'s time phase (rows away from a
replica that sleeps, convergence to the replicas' speeds within its bounds, its options checked), its memory window
between samples (against the allocator counters of tests/_fake_cuda.py), and the out-of-memory rescue
(``oom="rebalance"``, ``fastdp.inject_oom``) in the forward and in ``train_step``'s backward.

References: the bare module on the full batch (float64 within 1e-10).
Timings only against injected sleeps, with generous bounds (never a speed), on one torch thread (conftest's
``one_torch_thread``).
"""

import copy
import threading
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from fastdp._balance import memory as _memory

from _fake_cuda import FakeCuda
from _places import devices, host, module
from _reference import TOL, params_close
from _report_cases import bn_model, data, mlp, sleep_in_forward, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- chunk_sizes="auto": time ------------------------------------------------------------------------------------


def test_auto_moves_rows_away_from_a_sleeping_replica_settles_and_equals_the_bare_model():
    bare = mlp(width=256)
    model = copy.deepcopy(bare)
    sleep_in_forward(model, 1, 3)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(bare.parameters(), lr=0.05)
    sizes = []
    for s in range(14):
        train(dp, 1, n=90, seed=s, opt=opt)
        train(bare, 1, n=90, seed=s, opt=ref_opt)
        sizes.append(dp._last_step.chunk_sizes)
    rule = dp._split
    assert rule.settled, rule.describe()
    assert sizes[0] == [30, 30, 30]
    assert sizes[-1][1] <= 15 and sizes[-1][0] + sizes[-1][2] >= 75, (sizes, rule.describe(), rule.time_history)
    assert sizes[-1] == sizes[-2] == sizes[-3]  # settled: fixed from then on
    assert dp._recording.recorder is None  # it measured only while it had to
    params_close(model, bare)


def test_auto_time_phase_converges_to_the_speeds_and_keeps_its_bounds():
    costs = [1.0, 2.0, 1.0]  # ms per row: position 1 is half as fast

    def run(costs, **options):
        rule = fastdp.AutoSplit(warmup=0, timer=lambda: timings[0], **options).bind(["cpu"] * 3)
        timings = [None]
        for _ in range(20):
            sizes = rule.split(60, 0, 3)
            timings[0] = (sizes, [n * c / 1e3 for n, c in zip(sizes, costs)])
            rule.observe()
        return rule, rule.split(60, 0, 3)

    rule, sizes = run(costs)
    assert rule.settled and abs(sizes[1] - 12) <= 2 and abs(sizes[0] - 24) <= 2  # rows as speeds: busy times level
    rule, sizes = run([1.0, 1000.0, 1.0], min_weight=0.2)
    assert rule.settled and min(rule.weights) >= 0.2 * max(rule.weights) - 1e-12  # held at its bound
    rule, sizes = run([1.0, 1.0, 1.0])
    assert rule.settled and sizes == [20, 20, 20] and len(rule.time_history) == 1


@pytest.mark.parametrize("options, error, text", [
    ({"time_tolerance": -1}, ValueError, "time_tolerance must be a finite non-negative number, got -1"),
    ({"time_steps": 0}, ValueError, "time_steps must be a positive int, got 0"),
    ({"min_weight": 0}, ValueError, "min_weight must be a number in (0, 1]"),
    ({"balance_time": 1}, TypeError, "balance_time must be True or False, got int"),
    ({"timer": 3}, TypeError, "timer must be callable"),
])
def test_auto_time_options_are_checked(options, error, text):
    with pytest.raises(error) as info:
        fastdp.AutoSplit(**options)
    assert text in str(info.value)


# ---- chunk_sizes="auto": memory between samples --------------------------------------------------------------------


def test_peak_window_sees_device_0s_backward_high_and_never_resets_the_users_counters(monkeypatch):
    cuda = FakeCuda(2).install(monkeypatch)
    window = _memory.PeakWindow([0, 1])
    window.read()  # the window starts
    cuda.allocate(0, 500)  # forward: activations on both devices
    cuda.allocate(1, 400)
    window.sample()  # the end of the forward
    cuda.allocate(0, 300)  # backward on device 0: the gathered outputs' gradient, alive for a moment
    cuda.allocate(0, -300)
    cuda.allocate(0, -500)
    cuda.allocate(1, -400)
    assert window.read() == [800, 400]  # the counter moved: device 0's high is known exactly
    assert window.exact == [True, True]
    # Later steps stay below the first high: the counter cannot move, so the samples are what is known...
    cuda.allocate(0, 200)
    window.sample()
    cuda.allocate(0, 100)  # ... unless one is taken where the high is (backward reaching the outputs)
    window.sample()
    cuda.allocate(0, -300)
    assert window.read() == [300, 0] and window.exact == [False, False]
    cuda.reset_peak_memory_stats(0)  # the user resets their own counter inside a window
    cuda.log.remove(("reset_peak", 0))
    cuda.allocate(0, 250)
    cuda.allocate(0, -250)
    assert window.read()[0] == 250 and window.exact[0]
    assert cuda.entries("reset_peak") == []  # fastdp never reset a counter


# ---- out-of-memory rescue ----------------------------------------------------------------------------------------


def test_forward_oom_moves_rows_and_counts_the_batch_once():
    model = bn_model()
    bare = copy.deepcopy(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    injection = fastdp.inject_oom(dp, 2, above=5)
    x, y = data(18)
    with pytest.warns(RuntimeWarning, match="out of memory at position 2"):
        out = dp(x)
    assert injection.fired == 1
    sizes = dp._last_step.chunk_sizes
    assert sizes[2] <= 5 and sum(sizes) == 18
    bn, ref = model[1], bare[1]
    ref(bare[0](x[: sizes[0]]))  # upstream's rule: statistics from chunk 0, of the step that ran, once
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=TOL)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=TOL)
    assert out.shape == (18, 3)
    dp(x)  # the next steps keep the moved split, and fit
    assert dp._last_step.chunk_sizes == sizes and injection.fired == 1
    dp.enable_report()
    dp.disable_report()  # switching the report leaves a test's injection in place
    assert dp._recording.recorder is not None and dp._recording.recorder.inject is injection


def test_forward_oom_rescue_equals_the_bare_model():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance", chunk_sizes="auto", report=True)
    fastdp.inject_oom(dp, 0, above=6, times=1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(bare.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning):
        train(dp, 3, n=21, opt=opt)
    train(bare, 3, n=21, opt=ref_opt)
    params_close(model, bare)
    assert dp._split.settled and dp._last_step.chunk_sizes[0] < 7
    assert dp.report().steps == 3  # the failed attempt is not a step


def test_an_injected_forward_oom_ends_the_replica_where_synced_layers_see_it():
    """The injected error is raised inside the replica's own forward, as a failing allocation is: the replicas
    waiting for it in a synced layer are released, and the step is rescued instead of hanging."""
    model = fastdp.convert_sync_batchnorm(bn_model())
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    injection = fastdp.inject_oom(dp, 1, times=1)
    x = data(18)[0]
    done = []
    worker = threading.Thread(target=lambda: done.append(dp(x).shape), daemon=True)
    with pytest.warns(RuntimeWarning, match="position 1"):
        worker.start()
        worker.join(60)
    assert done == [(18, 3)] and injection.fired == 1


def test_the_failed_attempt_leaves_nothing_alive_before_the_retry():
    model = mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    fastdp.inject_oom(dp, 2, above=5)
    outputs, alive_at_retry = [], []

    def hook(module, inputs, output):
        if len(outputs) == 2:  # positions 0 and 1 ran in the failed attempt; this is the retry's first call
            alive_at_retry.append([r() is not None for r in outputs])
        outputs.append(weakref.ref(output))

    model.register_forward_hook(hook)
    with pytest.warns(RuntimeWarning):
        dp(data(18)[0])
    assert alive_at_retry == [[False, False]]


def test_forward_oom_twice_raises_the_first_error_with_advice_and_leaves_nothing_changed():
    model = bn_model()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    fastdp.inject_oom(dp, 1)  # every attempt fails
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError) as info:
        dp(data(18)[0]).sum().backward()
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "position 1" in text and "6 -> 4 rows of 18" in text and "failed too" in text
    assert "criterion=" in text and "a smaller batch" in text
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


def test_without_rebalance_the_error_is_raised_as_it_is():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2)
    fastdp.inject_oom(dp, 1)
    with pytest.raises(torch.OutOfMemoryError) as info:
        dp(data(8)[0])
    assert "oom='rebalance'" not in str(info.value) + "".join(getattr(info.value, "__notes__", []))


def test_train_step_rescues_a_backward_oom_and_grads_count_each_step_once():
    bare = mlp()
    model = module(copy.deepcopy(bare))
    dp = fastdp.DataParallel(model, device_ids=devices(3), criterion=nn.CrossEntropyLoss(), oom="rebalance",
                             bucket_cap_mb=1e-4)  # many buckets: some reach .grad before a later one fails
    x, y = data(18)
    dp.train_step(x, target=y)  # .grad exists now: the next step accumulates onto it
    params = list(model.parameters())
    arrived = []

    def fail_last_once(grad):  # the reduction of the last bucket fails (once), after the others reached .grad
        arrived.append(1)
        if len(arrived) == len(params):
            raise torch.OutOfMemoryError("CUDA out of memory (test): GPU 0 ran out during the reduction")
        return None

    for p in params:
        p.register_hook(fail_last_once)
    x2, y2 = data(18, seed=7)
    with pytest.warns(RuntimeWarning, match="position 0"):
        loss = dp.train_step(x2, target=y2)
    assert not loss.requires_grad
    for a, b in ((x, y), (x2, y2)):
        F.cross_entropy(bare(a), b).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(host(p.grad), q.grad, rtol=0, atol=TOL)
    assert dp._last_step.chunk_sizes[0] < 6


def test_train_step_backward_oom_injected_in_a_replica():
    bare = mlp()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    injection = fastdp.inject_oom(dp, 2, phase="backward", above=4)
    x, y = data(15)
    with pytest.warns(RuntimeWarning, match="position 2"):
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    F.cross_entropy(bare(x), y).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
    assert injection.fired == 1 and dp._last_step.chunk_sizes[2] <= 4


class _OOMOnce(torch.autograd.Function):
    """Identity whose backward runs out of memory once, when `armed` says so (after some bucket's sum started)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.armed():
            raise torch.OutOfMemoryError("CUDA out of memory (a test's, in the first layer's backward)")
        return g, None


def test_train_step_drops_the_sums_a_failed_backward_started(monkeypatch):
    """A backward that runs out of memory after some buckets' sums started never delivers them: the rescue drops them
    before the step runs again, so they hold no memory through the retry, and the step equals the bare model's."""
    started, fired = [], []

    def armed():
        if started and not fired:
            fired.append(True)
            return True
        return False

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp(width=64)
            self.__dict__["armed"] = armed

        def forward(self, x):
            return self.body[1:](_OOMOnce.apply(self.body[0](x), self.armed))

    bare = Net()
    model = module(copy.deepcopy(bare))
    dp = fastdp.DataParallel(model, device_ids=devices(3), oom="rebalance", bucket_cap_mb=1e-6)
    x, y = data(15)
    real_start = fastdp._reduction.reducer.start
    first_attempt = []  # weak references to the sums the failing backward started

    def start(bucket, grads):
        started.append(bucket.index)
        handed = real_start(bucket, grads)
        job = getattr(handed[0], "_fastdp_sum", None)  # a weak reference to the started sum
        if job is not None and not fired:
            first_attempt.append(job)
        return handed

    monkeypatch.setattr(fastdp._reduction.reducer, "start", start)
    with pytest.warns(RuntimeWarning):
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    assert fired and first_attempt  # sums were in flight at the failure
    assert [r() for r in first_attempt] == [None] * len(first_attempt)  # and none outlived it (no collection needed)
    started.append(-1)  # the bare model: no failure (fired already)
    F.cross_entropy(bare(x), y).backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(host(p.grad), q.grad, rtol=0, atol=TOL)


def test_train_step_failing_twice_leaves_grads_and_buffers_as_they_were():
    model = bn_model()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, oom="rebalance")
    x, y = data(18)
    dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    fastdp.inject_oom(dp, 1, phase="backward")
    with pytest.warns(RuntimeWarning), pytest.raises(torch.OutOfMemoryError) as info:
        dp.train_step(x, loss_fn=lambda out: F.cross_entropy(out, y))
    assert "failed too" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for b, c in zip(model.buffers(), buffers):
        torch.testing.assert_close(b, c, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, text", [
    ({"position": 3}, "position=3 must be a device_ids position in [0, 3)"),
    ({"position": 0, "phase": "optimizer"}, "phase='optimizer' must be 'forward' or 'backward'"),
    ({"position": 0, "above": -1}, "above=-1 must be a non-negative int"),
    ({"position": 0, "times": 0}, "times=0 must be None or a positive int"),
])
def test_inject_oom_checks_its_arguments(kwargs, text):
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError) as info:
        fastdp.inject_oom(dp, **kwargs)
    assert text in str(info.value)


def test_train_step_needs_a_scalar_loss():
    dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2)
    with pytest.raises(TypeError, match="one-element loss tensor"):
        dp.train_step(data(4)[0])
