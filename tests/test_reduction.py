"""The gradient reduction while backward runs (NOTE [reduction while backward runs] in fastdp/_reduction/reducer.py): each
bucket's sum starts as soon as every replica's gradients for it exist, runs while the rest of backward goes on, and
reaches the master parameters through autograd, so that every way of taking gradients sees what the bare model
gives. Each case compares with the bare model on the full batch."""

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn

import fastdp
from _places import devices, host, module
from fastdp._reduction import reducer as _reducer, host as _host, sums as _sums, cuda as _rcuda

pytestmark = pytest.mark.usefixtures("cpu_apply")

R = 2
WIDTH = 16
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 8 / 2**20  # one layer's weight and bias (float64): one bucket per layer


class Marked(nn.Module):
    """Six Linear layers, each followed by a marker whose backward logs the layer's name (and may sleep)."""

    def __init__(self, log, sleep=None):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH).double() for _ in range(6))
        self.__dict__["log"] = log  # plain attributes: the replicas share the log
        self.__dict__["sleep"] = sleep or {}

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = _Marker.apply(torch.tanh(layer(x)), f"L{i}", self.log, self.sleep.get(i, 0))
        return x


class _Marker(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, log, sleep):
        ctx.name, ctx.log, ctx.sleep = name, log, sleep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append((ctx.name, time.perf_counter_ns()))
        if ctx.sleep:
            time.sleep(ctx.sleep)
            ctx.log.append((ctx.name + "-end", time.perf_counter_ns()))
        return g, None, None, None


def _spy_starts(monkeypatch, log):
    real = _reducer.start

    def start(bucket, grads):
        log.append((f"R{5 - bucket.index}", time.perf_counter_ns()))  # bucket 0 holds the last layer
        return real(bucket, grads)

    monkeypatch.setattr(_reducer, "start", start)


def test_each_buckets_reduction_starts_as_soon_as_its_gradients_exist(monkeypatch):
    """A bucket's reduction starts before the last replica's backward reaches the layer two below it (autograd runs
    the bucket's node at once), not after the whole backward (where a node made at the first step would run)."""
    log = []
    _spy_starts(monkeypatch, log)
    model = Marked(log)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, bucket_cap_mb=LAYER_MB)
    bare = copy.deepcopy(model)
    for _ in range(3):
        log.clear()
        x = torch.randn(8, WIDTH, dtype=torch.float64)
        dp(x).sum().backward()
        names = [n for n, _ in log]
        assert len(dp._replica_set.layout[0]) == 6 and names.count("R5") == 1
        assert [n for n in names if n.startswith("R")] == ["R5", "R4", "R3", "R2", "R1", "R0"]
        for i in range(5, 1, -1):
            below = [k for k, n in enumerate(names) if n == f"L{i - 2}"]
            assert names.index(f"R{i}") < max(below), names
        bare(x).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_host_reductions_run_while_backward_goes_on(monkeypatch):
    """On host replicas the reducer thread sums the buckets while the thread running backward is still busy: with
    the first layer's backward slowed down (a sleep, as a long kernel would), every other bucket's sum has completed
    before that layer's backward ends."""
    log = []
    model = Marked(log, sleep={0: 0.3})
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, bucket_cap_mb=LAYER_MB)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    dp(x).sum().backward()  # builds the replicas
    done = []
    real = _sums.bucket_sum

    def timed(bucket, grads, kept, out):
        result = real(bucket, grads, kept, out)
        done.append((bucket.index, time.perf_counter_ns(), threading.current_thread() is threading.main_thread()))
        return result

    monkeypatch.setattr(_sums, "bucket_sum", timed)
    log.clear()
    dp(x).sum().backward()
    slow_end = max(t for n, t in log if n == "L0-end")
    assert sorted(b for b, _, _ in done) == list(range(6))
    assert all(end < slow_end and not main for b, end, main in done if b < 5), (done, slow_end)


# ---- autograd's ways of taking gradients, against the bare model --------------------------------------------------


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


X = torch.randn(9, 6, dtype=torch.float64)


@pytest.fixture(params=[25, 1e-6], ids=["one-bucket", "bucket-per-tensor"])
def pair(request):
    bare = mlp()
    dp = fastdp.DataParallel(module(mlp()), device_ids=devices(3), bucket_cap_mb=request.param)
    return bare, dp


def _close(a, b):
    torch.testing.assert_close(host(a), host(b), rtol=1e-10, atol=1e-10)


def test_hooks_on_master_parameters_see_the_sum_once(pair):
    bare, dp = pair
    seen = {id(bare): [], id(dp.module): []}
    for m in (bare, dp.module):
        for p in m.parameters():
            p.register_hook(lambda g, out=seen[id(m)]: out.append(g.clone()))
    for m in (bare, dp):
        m(X).pow(2).sum().backward()
    assert len(seen[id(dp.module)]) == len(seen[id(bare)]) == len(list(bare.parameters()))
    for a, b in zip(sorted(seen[id(dp.module)], key=lambda g: g.shape), sorted(seen[id(bare)], key=lambda g: g.shape)):
        assert a.shape == b.shape


def test_autograd_grad_and_backward_inputs_on_master_parameters(pair):
    bare, dp = pair
    for _ in range(2):
        got = torch.autograd.grad(dp(X).pow(2).sum(), list(dp.module.parameters()))
        want = torch.autograd.grad(bare(X).pow(2).sum(), list(bare.parameters()))
        for a, b in zip(got, want):
            _close(a, b)
        assert all(p.grad is None for p in dp.module.parameters())
    chosen = [dp.module[2].weight, dp.module[4].bias]
    dp(X).pow(2).sum().backward(inputs=chosen)
    bare(X).pow(2).sum().backward(inputs=[bare[2].weight, bare[4].bias])
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            _close(p.grad, q.grad)


def test_retained_graph_twice_and_double_backward(pair):
    bare, dp = pair
    for m in (bare, dp):
        loss = m(X).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)
    penalties = []
    for m in (bare, dp):
        m.zero_grad()
        params = list(m.parameters())
        grads = torch.autograd.grad(m(X).pow(2).sum(), params, create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads)
        penalty.backward()
        penalties.append(penalty.detach())
    _close(penalties[0], penalties[1])
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_optimizer_stepping_inside_backward(pair):
    """Post-accumulate-grad hooks (an optimizer per parameter, stepping as each gradient is complete) see the summed
    gradient once, as on the bare model."""
    bare, dp = pair
    for m in (bare, dp.module):
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in m.parameters()}

        def hook(p, opts=opts):
            opts[p].step()
            p.grad = None

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    for _ in range(3):
        for m in (bare, dp):
            m(X).pow(2).sum().backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p, q)
        assert p.grad is None


class Partial(nn.Module):
    """A layer only the rows with a positive first value use, and one nobody uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = nn.Linear(6, 6).double(), nn.Linear(6, 6).double(), nn.Linear(6, 6).double()

    def forward(self, x):
        h = self.a(x)
        if x[0, 0] > 0:
            h = self.b(h)
        return h


@pytest.mark.parametrize("signs", [(1, 1, 1), (1, -1, -1), (-1, 1, -1), (-1, -1, -1)])
def test_parameters_some_or_all_replicas_leave_unused(signs):
    bare, model = Partial(), module(Partial())
    dp = fastdp.DataParallel(model, device_ids=devices(3), bucket_cap_mb=1e-6)
    x = torch.randn(9, 6, dtype=torch.float64)
    for r, s in enumerate(signs):
        x[3 * r, 0] = s * abs(x[3 * r, 0])
    dp(x).pow(2).sum().backward()
    for chunk in x.chunk(3):
        bare(chunk).pow(2).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            _close(p.grad, q.grad)
    assert model.unused.weight.grad is None


# ---- no_sync with gradients taken other ways ---------------------------------------------------------------------


def test_no_sync_keeps_only_what_autograd_accumulated(pair):
    """Inside no_sync, torch.autograd.grad leaves .grad alone and backward(inputs=...) touches only its inputs: the
    other replicas' shares are kept only for what autograd accumulated, so the synchronising backward after gives
    the bare model's .grad (which accumulates exactly those backwards)."""
    bare, dp = pair
    xs = [torch.randn(9, 6, dtype=torch.float64) for _ in range(4)]
    chosen = [2, 5]  # parameters backward(inputs=...) names
    with dp.no_sync():
        got = torch.autograd.grad(dp(xs[0]).pow(2).sum(), list(dp.module.parameters()))
        want = torch.autograd.grad(bare(xs[0]).pow(2).sum(), list(bare.parameters()))
        for a, b in zip(got, want):
            _close(a, b)  # the full batch's gradient, as the bare model's
        assert all(p.grad is None for p in dp.module.parameters())
        dp(xs[1]).pow(2).sum().backward(inputs=[list(dp.module.parameters())[i] for i in chosen])
        dp(xs[2]).pow(2).sum().backward()
    bare(xs[1]).pow(2).sum().backward(inputs=[list(bare.parameters())[i] for i in chosen])
    bare(xs[2]).pow(2).sum().backward()
    dp(xs[3]).pow(2).sum().backward()
    bare(xs[3]).pow(2).sum().backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_functional_grad_around_the_wrapper_inside_no_sync(pair):
    """torch.func.grad over a function that calls the wrapper (its parameters as explicit inputs is not how a
    wrapped model is used; here the input's gradient is taken): nothing is accumulated, nothing kept."""
    bare, dp = pair
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    with dp.no_sync():
        g = torch.autograd.grad(dp(x).pow(2).sum(), x)[0]
    want = torch.autograd.grad(bare(x).pow(2).sum(), x)[0]
    _close(g, want)
    dp(X).pow(2).sum().backward()
    bare(X).pow(2).sum().backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


# ---- a backward that fails part way --------------------------------------------------------------------------------


class Failing(nn.Module):
    """The MLP with a node between its first layer and the rest whose backward raises `error` in the first replica
    that reaches it after some bucket's reduction started (`started` non-empty)."""

    def __init__(self, error, started):
        super().__init__()
        torch.manual_seed(0)
        self.body = mlp()
        self.__dict__["trigger"] = lambda: error if started else None

    def forward(self, x):
        return self.body[1:](_Raise.apply(self.body[0](x), self.trigger))


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trigger):
        ctx.trigger = trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        error = ctx.trigger()
        if error is not None:
            raise error
        return g, None


@pytest.mark.parametrize("error", [RuntimeError("boom in backward"), KeyboardInterrupt()])
def test_a_replica_failing_in_backward_after_buckets_started(monkeypatch, error):
    """One replica's backward raises after the last layers' buckets were started: backward raises that error, no
    master .grad is written, and the next steps equal the bare model's."""
    started, never = [], []
    model, bare = Failing(error, started), Failing(error, never)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, bucket_cap_mb=1e-6)
    x = torch.randn(9, 6, dtype=torch.float64)
    dp(x).pow(2).sum().backward()
    bare(x).pow(2).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    real = _reducer.start

    sums = []  # weak references to the sums the failing backward started

    def start(bucket, grads):
        started.append(bucket.index)
        handed = real(bucket, grads)
        if getattr(handed[0], "_fastdp_sum", None) is not None:
            sums.append(handed[0]._fastdp_sum)  # a weak reference to the started sum
        return handed

    monkeypatch.setattr(_reducer, "start", start)
    with pytest.raises(type(error)):
        dp(x).pow(2).sum().backward()
    assert started and sums  # some buckets (the last layers') were started before the failure
    assert [r() for r in sums] == [None] * len(sums)  # and their sums died with the backward
    monkeypatch.setattr(_reducer, "start", real)
    started.clear()
    for p, b in zip(model.parameters(), before):
        _close(p.grad, b)
    for _ in range(2):
        dp(x).pow(2).sum().backward()
        bare(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_a_failing_synchronising_backward_keeps_what_no_sync_kept(monkeypatch):
    """Two backwards inside no_sync, then a synchronising backward that fails after some buckets took no_sync's kept
    shares into their sums: those shares are kept again, so the retried backward gives the bare model's .grad
    (which accumulated all three successful backwards)."""
    started, never = [], []
    armed = []
    model, bare = Failing(RuntimeError("boom"), armed), Failing(RuntimeError("boom"), never)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, bucket_cap_mb=1e-6)
    xs = [torch.randn(9, 6, dtype=torch.float64) for _ in range(3)]
    with dp.no_sync():
        for x in xs[:2]:
            dp(x).pow(2).sum().backward()
    for x in xs[:2]:
        bare(x).pow(2).sum().backward()
    real = _reducer.start

    def start(bucket, grads):
        started.append(bucket.index)
        armed.append(True)  # the first layer's backward fails once a bucket started
        return real(bucket, grads)

    monkeypatch.setattr(_reducer, "start", start)
    with pytest.raises(RuntimeError, match="boom"):
        dp(xs[2]).pow(2).sum().backward()
    assert started
    monkeypatch.setattr(_reducer, "start", real)
    armed.clear()
    dp(xs[2]).pow(2).sum().backward()
    bare(xs[2]).pow(2).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_a_sum_failing_on_the_reducer_thread_gives_no_syncs_shares_back_at_once(monkeypatch):
    """A synchronising backward after no_sync whose sum raises on the reducer thread: backward raises that error,
    and the shares no_sync kept for that sum are kept again before it reaches the caller, without waiting for a
    garbage collection (the error's traceback, which the caller may hold for long, must not hold them)."""
    model = mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, bucket_cap_mb=1e-6)
    with dp.no_sync():
        for _ in range(2):
            dp(X).pow(2).sum().backward()
    real = _host.timed_sum
    failed = []

    def host_sum(bucket, grads, kept):
        if not failed and threading.current_thread() is not threading.main_thread():
            failed.append(bucket)
            raise RuntimeError("a sum failed on the reducer thread")
        return real(bucket, grads, kept)

    monkeypatch.setattr(_host, "timed_sum", host_sum)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="a sum failed") as info:
            dp(X).pow(2).sum().backward()
        assert failed and len(failed[0].unsynced.returned) == 1  # kept again while the error is still held
        del info
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("cap, storages", [(25, 1), (1e-6, 6)], ids=["one-bucket", "bucket-per-tensor"])
def test_the_sum_becomes_grad_without_a_copy(cap, storages):
    """Nothing but autograd holds a delivered sum, so AccumulateGrad takes it as .grad instead of copying it: the
    members of a bucket get views of its one sum (as upstream's do of its coalesced sum), each changed in place on
    its own (an optimizer's, clipping's) without touching the others."""
    bare, dp = mlp(), fastdp.DataParallel(module(mlp()), device_ids=devices(3), bucket_cap_mb=cap)
    dp(X).pow(2).sum().backward()
    bare(X).pow(2).sum().backward()
    grads = [p.grad for p in dp.module.parameters()]
    assert len({g.untyped_storage().data_ptr() for g in grads}) == storages
    grads[0].mul_(0)
    for p, q in list(zip(dp.module.parameters(), bare.parameters()))[1:]:
        _close(p.grad, q.grad)
    dp(X).pow(2).sum().backward()  # accumulates in place, view by view
    bare(X).pow(2).sum().backward()
    bare_first = next(bare.parameters())
    _close(grads[0], bare_first.grad - (bare_first.grad / 2))
    for p, q in list(zip(dp.module.parameters(), bare.parameters()))[1:]:
        _close(p.grad, q.grad)


@pytest.mark.parametrize("how", ["backward", "no_sync", "create_graph"])
def test_no_replica_gradient_outlives_its_backward(pair, monkeypatch, how):
    """Every gradient the replicas handed the bucket nodes is gone once backward returns (the reducer thread, the
    started sums and the kept nodes hold none), except those that became the master's .grad (no_sync: replica 0's
    share, as a DDP rank's own)."""
    bare, dp = pair
    handed = []
    real = _reducer.start

    def start(bucket, grads):
        handed.extend(weakref.ref(g) for g in grads if g is not None)
        return real(bucket, grads)

    monkeypatch.setattr(_reducer, "start", start)
    if how == "no_sync":
        with dp.no_sync():
            dp(X).pow(2).sum().backward()
    elif how == "create_graph":
        torch.autograd.grad(dp(X).pow(2).sum(), list(dp.module.parameters()), create_graph=True)
    else:
        dp(X).pow(2).sum().backward()
    assert handed
    grads = {id(p.grad) for p in dp.module.parameters()}
    assert [r() for r in handed if r() is not None and id(r()) not in grads] == []


def test_torch_func_transforms_around_the_wrapper_raise_a_clear_error(pair):
    """torch.func's transforms (grad, vmap, ...) cannot follow the replicas' threads and the C data moves: the
    wrapper says so and names what works (upstream fails with torch's message about setup_context)."""
    bare, dp = pair
    x = torch.randn(9, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="torch.func transform.*dp.module"):
        torch.func.grad(lambda x: dp(x).sum())(x)
    _close(torch.func.grad(lambda x: dp.module(x).sum())(x), torch.func.grad(lambda x: bare(x).sum())(x))
    with dp.no_sync():
        with pytest.raises(RuntimeError, match="torch.func transform"):
            torch.func.grad(lambda x: dp(x).sum())(x)
    dp(X).pow(2).sum().backward()  # nothing was kept by the refused call
    bare(X).pow(2).sum().backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_autograd_backward_with_grad_tensors_and_inputs(pair):
    """torch.autograd.backward(tensors, grad_tensors, inputs=...) inside and outside no_sync, as on the bare model."""
    bare, dp = pair
    xs = [torch.randn(9, 6, dtype=torch.float64) for _ in range(4)]
    for m in (bare, dp):
        params = list(m.module.parameters()) if m is dp else list(m.parameters())
        with dp.no_sync() if m is dp else torch.enable_grad():
            out = m(xs[0])
            w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            torch.autograd.backward([out], [w], inputs=params[:3])  # kept for those three only
            m(xs[1]).sum().backward()  # kept for every parameter
        torch.autograd.grad(m(xs[2]).sum(), params)  # writes no .grad: what no_sync kept stays kept
        torch.autograd.backward([m(xs[3]).sum()], inputs=params[3:])  # the first backward that writes gradients
        for p, q in zip(params, params if m is bare else params):
            assert p.grad is not None
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        _close(p.grad, q.grad)


def test_a_rescued_forward_settles_the_reductions_before_it_runs_again(monkeypatch):
    """The out-of-memory rescue asks the reducer to let go of what the failed attempt's reductions hold before the
    step runs again (on GPUs their memory is what the retry needs), and only then."""
    calls = []
    real = _reducer.Reducer.settle
    monkeypatch.setattr(_reducer.Reducer, "settle", lambda self: (calls.append("settle"), real(self))[1])
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, oom="rebalance")
    dp(torch.randn(8, 4)).sum().backward()  # the replica set exists
    assert calls == []
    fastdp.inject_oom(dp, 1, times=1)
    with pytest.warns(RuntimeWarning, match="oom='rebalance'"):
        dp(torch.randn(8, 4))
    assert calls == ["settle"]
