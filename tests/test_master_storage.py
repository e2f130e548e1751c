"""The master's tensors stay the user's (NOTE [the master's tensors stay the user's] in fastdp/_step/replicas.py): the
wrapper never moves a parameter or a buffer, so resizing, shared memory, pinned memory, memory formats and storage
shared between tensors behave as on the bare model, whatever the replicas keep. Replication copies the master member
by member; gradients are reduced one flat sum per bucket.

Every check compares with the bare module on the full batch, or, where a forward's effect on buffers depends on the
chunk a replica sees, with DataParallel's own rule run by hand (replica 0 is the master on chunk 0, every other
replica a copy of the master made before the step, on its chunk)."""

import copy
import os
import pickle
import signal

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import _C
from fastdp._native import core as _core
from fastdp._reduction import reducer as _reducer, host as _host, sums as _sums, cuda as _rcuda

pytestmark = pytest.mark.usefixtures("cpu_apply")

R = 3


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def loss_of(model, x):
    return model(x).pow(2).sum()


def assert_same_grads(model, ref, tol=1e-10):
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)


def assert_same_state(model, ref, tol=1e-10):
    for (k, v), (k2, w) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, w, rtol=tol, atol=tol, msg=k)


def storage_facts(t):
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.stride(), t.is_shared())


def by_hand(model, x, loss=loss_of, nrep=R, sizes=None):
    """DataParallel's rule on the host, by hand: replica 0 is the master itself on chunk 0 (its buffers are the
    master's), each other replica a copy of the master made before the step, on its chunk; the copies' gradients
    are added to the master's. ``sizes``: the chunks' sizes (the running devices' only), else ``nrep`` chunks."""
    chunks = x.split(sizes) if sizes else x.chunk(nrep)
    copies = [copy.deepcopy(model) for _ in chunks[1:]]
    total = loss(model, chunks[0])
    for c, chunk in zip(copies, chunks[1:]):
        total = total + loss(c, chunk)
    total.backward()
    add_grads(model, copies)
    return total


def add_grads(model, copies):
    """The copies' gradients added to the master's, as the wrapper's reduction adds the replicas' (by name: a copied
    GraphModule may list its parameters in another order)."""
    for c in copies:
        theirs = dict(c.named_parameters())
        for name, p in model.named_parameters():
            q = theirs[name]
            if q.grad is not None:
                p.grad = q.grad.clone() if p.grad is None else p.grad + q.grad


# ---- the storage the user gave stays -------------------------------------------------------------------------------


class Tied(nn.Module):
    """A head tied to the embedding by sharing ``.data``: two Parameters over one storage (as older language models
    tie them); a tiny bucket size puts them into different buckets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6).double()
        self.mid = nn.Linear(6, 6).double()
        self.head = nn.Linear(6, 11, bias=False).double()
        self.head.weight.data = self.emb.weight.data

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids)))).sum(1)


def test_parameters_tied_through_data_stay_tied_and_train_as_the_bare_model():
    bare, model = Tied(), Tied()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, bucket_cap_mb=1e-6)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (bare, model)]
    torch.manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 11, (9, 4))
        for m, opt in ((bare, opts[0]), (dp, opts[1])):
            opt.zero_grad()
            m(ids).pow(2).sum().backward()
            opt.step()
        assert len(dp._replica_set.layout[0]) > 2  # the tied pair sits in different buckets
        assert model.head.weight.data_ptr() == model.emb.weight.data_ptr()
        assert_same_state(model, bare)


def test_storage_shared_between_modules_stays_shared():
    """A buffer of one module that views a parameter of another (a mask carved out of a weight): the wrapper keeps
    the aliasing; the replicas read the same values."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(6, 6).double()
            self.b = nn.Linear(6, 3).double()
            self.b.register_buffer("row", self.a.weight.data[0])

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * self.b.row)

    bare, model = Shared(), Shared()
    model.b.row = model.a.weight.data[0]
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    for _ in range(2):
        for m in (bare, dp):
            loss_of(m, x).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
        assert model.b.row.data_ptr() == model.a.weight.data_ptr()
    assert_same_state(model, bare)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_parameters_and_buffers_keep_their_storage_through_training(layout):
    def model_fn():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Conv2d(4, 2, 3)).double()
        return m.to(memory_format=torch.channels_last) if layout == "channels_last" else m

    model = model_fn()
    before = {k: storage_facts(v) for k, v in model.state_dict(keep_vars=True).items()}
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        dp(torch.randn(6, 2, 7, 7, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
    assert {k: storage_facts(v) for k, v in model.state_dict(keep_vars=True).items()} == before


def test_share_memory_then_training_reaches_a_forked_reader():
    """``model.share_memory()`` before training (Hogwild-style readers): a process forked before the step reads the
    parameters the parent's step wrote, as with the bare model."""
    model = mlp()
    model.share_memory()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader: waits for the parent's step, then sends what it sees
        try:
            os.close(go_w)
            os.close(out_r)
            os.read(go_r, 1)
            data = pickle.dumps([p.detach().clone() for p in model.parameters()])
            with os.fdopen(out_w, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(out_w)
    try:
        opt.zero_grad()
        loss_of(dp, torch.randn(9, 6, dtype=torch.float64)).backward()
        opt.step()
        assert all(p.is_shared() for p in model.parameters())
        os.write(go_w, b"1")
        signal.alarm(60)  # a reader that never answers fails the test instead of hanging it
        with os.fdopen(out_r, "rb") as f:
            seen = pickle.loads(f.read())
    finally:
        signal.alarm(0)
        os.close(go_w)
        os.waitpid(pid, 0)
    for p, q in zip(model.parameters(), seen):
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device's driver")
def test_pinned_parameters_stay_pinned():
    model = mlp()
    for p in model.parameters():
        p.data = p.data.pin_memory()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    loss_of(dp, torch.randn(9, 6, dtype=torch.float64)).backward()
    assert all(p.is_pinned() for p in model.parameters())


# ---- storage changed on the master between steps --------------------------------------------------------------------


def _set(m):
    with torch.no_grad():
        m[2].weight.set_(torch.randn(8, 8, dtype=torch.float64))


def _swap(m):
    torch.utils.swap_tensors(m[2].weight, nn.Parameter(torch.randn(8, 8, dtype=torch.float64)))


def _rebind(m):
    m[2].weight.data = torch.randn(8, 8, dtype=torch.float64)


def _transpose(m):
    m[2].weight.data = m[2].weight.data.t()  # same memory, other strides


def _resize_as(m):
    m[4].bias.data.resize_as_(torch.empty(3, 1, dtype=torch.float64)).fill_(0.25)
    m[4].bias.data = m[4].bias.data.view(3)


def _storage_resize(m):
    s = m[0].bias.untyped_storage()
    s.resize_(0)
    s.resize_(8 * 8)  # the bias's bytes reallocated (zeroed), as FSDP-style offloading does
    with torch.no_grad():
        m[0].bias.fill_(0.5)


def _share(m):
    m.share_memory()


CHANGES = {"set_": _set, "swap_tensors": _swap, "data_rebind": _rebind, "data_transposed": _transpose,
           "resize_as_": _resize_as, "storage_resize": _storage_resize, "share_memory": _share,
           "load_state_dict": lambda m: m.load_state_dict(mlp(seed=5).state_dict()),
           "double": lambda m: m.float().double(), "reassign": lambda m: setattr(m[2], "weight", nn.Parameter(
               torch.randn(8, 8, dtype=torch.float64)))}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_storage_changed_between_steps(change):
    """Whatever replaced, moved or rewrote a master tensor between steps, the next step sees it as the bare model
    does (the same change made to both)."""
    model, bare = mlp(), mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    for m in (dp, bare):
        loss_of(m, x).backward()
        m.zero_grad()
    for m in (model, bare):
        torch.manual_seed(3)
        CHANGES[change](m)
    for _ in range(2):
        for m in (dp, bare):
            m.zero_grad()
            loss_of(m, x).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
        assert_same_state(model, bare)
        assert_same_grads(model, bare)


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


class _Scaled(nn.Module):
    def forward(self, w):
        return 0.5 * w


@pytest.mark.parametrize("when", ["before-wrapping", "between-steps", "stacked-between-steps", "removed"])
def test_parametrized_weights(when):
    """torch.nn.utils.parametrize: the parameter becomes ``parametrizations.weight.original`` and the weight is
    computed in every forward (each replica computes its own from its copy). Registered before wrapping, between
    steps, stacked on another, or removed again (leaving a plain parameter of the computed value): every step
    equals the bare model's with the same change."""
    P = torch.nn.utils.parametrize
    model, bare = mlp(), mlp()
    if when == "before-wrapping":
        for m in (model, bare):
            P.register_parametrization(m[2], "weight", _Symmetric())
    elif when == "removed":
        for m in (model, bare):
            P.register_parametrization(m[2], "weight", _Symmetric())
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    torch.manual_seed(1)
    xs = [torch.randn(9, 6, dtype=torch.float64) for _ in range(4)]
    for i, x in enumerate(xs):
        if i == 2:
            for m in (model, bare):
                if when == "between-steps":
                    P.register_parametrization(m[2], "weight", _Symmetric())
                elif when == "stacked-between-steps":
                    P.register_parametrization(m[2], "weight", _Symmetric())
                    P.register_parametrization(m[2], "weight", _Scaled())
                elif when == "removed":
                    P.remove_parametrizations(m[2], "weight", leave_parametrized=True)
        for m in (dp, bare):
            m.zero_grad()
            loss_of(m, x).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
        assert_same_grads(model, bare)
        assert_same_state(model, bare)


# ---- storage changed inside forward ---------------------------------------------------------------------------------


class LazyStats(nn.Module):
    """Buffers sized at the first forward and written there, as lazily sized modules and quantization observers do
    (``resize_`` from a placeholder, then ``copy_``): several such buffers side by side."""

    def __init__(self, how="resize_"):
        super().__init__()
        self.how = how
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6).double()
        for name in ("lo", "hi", "mean"):
            self.register_buffer(name, torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        h = self.lin(x)
        stats = {"lo": h.detach().amin(0), "hi": h.detach().amax(0), "mean": h.detach().mean(0)}
        for name, value in stats.items():
            buf = getattr(self, name)
            if buf.shape != value.shape:
                if self.how == "resize_":
                    buf.resize_(value.shape)
                elif self.how == "resize_as_":
                    buf.resize_as_(value)
                else:
                    buf.set_(torch.empty_like(value))
            buf.copy_(value)
        return h * (self.hi - self.lo) + self.mean


@pytest.mark.parametrize("device0", ["runs", "idle"])
@pytest.mark.parametrize("how", ["resize_", "resize_as_", "set_"])
def test_buffers_sized_in_forward(how, device0):
    """Each replica's buffer grows on its own (the other replicas' buffers are not views of one flat buffer, which
    growing in place would write across); the master's grows as the bare model's does, and when device 0 runs no
    chunk it takes the first running replica's size with its values."""
    model, ref = LazyStats(how), LazyStats(how)
    idle = device0 == "idle"
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=[0.0] + [1.0] * (R - 1) if idle else None)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(9 - 3 * idle, 6, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad()
        loss_of(dp, x).backward()
        by_hand(ref, x, nrep=R - idle)
        assert_same_grads(model, ref)
        assert_same_state(model, ref)


class ParamScaled(nn.Module):
    """A buffer computed from the parameters and written by a forward only when it changes; the forward's graph
    saves it (it scales the output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6).double()
        self.register_buffer("scale", torch.zeros(6, dtype=torch.float64))

    def forward(self, x):
        value = self.lin.weight.detach().abs().mean(1) + 1
        if not torch.equal(self.scale, value):
            self.scale.copy_(value)
        return self.lin(x) * self.scale


def test_a_forward_without_device_0_keeps_a_pending_graph_valid():
    """A forward whose batch runs without device 0 (a small one under weights that give device 0 the smallest
    share) between a training forward that saved a master buffer and its backward: the buffer copied back is the
    one the master holds, written without a version bump, so the backward runs as the bare model's."""
    model, ref = ParamScaled(), ParamScaled()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=[0.5] + [1.0] * (R - 1))
    torch.manual_seed(1)
    x, small = torch.randn(9, 6, dtype=torch.float64), torch.randn(1, 6, dtype=torch.float64)
    loss = loss_of(dp, x)
    with torch.no_grad():
        dp(small)
    loss.backward()
    loss_of(ref, x).backward()
    assert_same_grads(model, ref)
    assert_same_state(model, ref)


def test_quantization_aware_training_with_per_channel_observers():
    """A model prepared for quantization-aware training with the fbgemm default: its per-channel observers resize
    their buffers in the first forward (zero_point.resize_). It trains under the wrapper as DataParallel's rule
    says."""
    ao = pytest.importorskip("torch.ao.quantization")

    def model_fn():
        torch.manual_seed(0)
        m = nn.Sequential(ao.QuantStub(), nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 3, 3), ao.DeQuantStub())
        m.train()
        m.qconfig = ao.get_default_qat_qconfig("fbgemm")
        return ao.prepare_qat(m)

    model, ref = model_fn(), model_fn()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    torch.manual_seed(2)
    for _ in range(3):
        x = torch.randn(9, 2, 8, 8)
        for opt in opts:
            opt.zero_grad()
        dp(x).pow(2).sum().backward()
        by_hand(ref, x, loss=lambda m, c: m(c).pow(2).sum())
        for opt in opts:
            opt.step()
        assert_same_state(model, ref, tol=1e-5)


class Rebinding(nn.Module):
    """A frozen parameter rebound in forward (``self.mu.data = ...``), read after the rebinding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6).double()
        self.mu = nn.Parameter(torch.zeros(6, dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        self.mu.data = x.detach().mean(0)
        return self.lin(x - self.mu)


def test_frozen_parameter_rebound_in_forward_leaves_the_master_as_upstream():
    """Upstream's replicate gives replica 0 its own alias of every parameter in a forward with autograd, so the
    master's ``mu`` stays as it was; under no_grad its detached replicate hands replica 0 the master's own tensor,
    which the rebinding then changes. The outputs are each replica's own, as the bare model's on each chunk."""
    model = Rebinding()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    chunks = x.chunk(R)
    out = dp(x)
    torch.testing.assert_close(out, torch.cat([copy.deepcopy(Rebinding())(c) for c in chunks]))
    assert torch.equal(model.mu, torch.zeros(6, dtype=torch.float64))
    with torch.no_grad():
        dp(x)
    torch.testing.assert_close(model.mu.detach(), chunks[0].mean(0))


# ---- replication and reduction paths ---------------------------------------------------------------------------------


def test_replicate_is_one_prepared_copy_per_step(monkeypatch):
    """The master's members are described once (a prepared copy) and copied in one call per step: on host replicas
    into the second replica's buffers, which a second prepared copy copies whole into the others' (one copy per
    bucket and further replica); a master tensor that moves (.data replaced) gets the copies prepared again, and the
    replicas see it."""
    made, runs = [], []
    real = _C.PreparedCopy

    class Spy:
        def __init__(self, dsts, srcs):
            self.copy, self.pairs = real(dsts, srcs), len(dsts)
            made.append(self.pairs)

        def run(self, streams=None):
            runs.append(self.pairs)
            return self.copy.run(streams)

    monkeypatch.setattr(_C, "PreparedCopy", Spy)
    model, bare = mlp(), mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    for _ in range(3):
        loss_of(dp, x).backward()
    buckets = len(dp._replica_set.layout[0])
    assert R > 2 and buckets >= 1
    copies = [len(list(model.parameters())), (R - 2) * buckets]
    assert made == copies and runs == copies * 3
    for m in (model, bare):
        m[2].weight.data = torch.full((8, 8), 0.125, dtype=torch.float64)
    model.zero_grad()
    loss_of(dp, x).backward()
    loss_of(bare, x).backward()
    assert made == copies * 2
    assert_same_grads(model, bare)


@pytest.mark.parametrize("path", ["aoti", "python"])
@pytest.mark.parametrize("zero", ["set_to_none", "zeros", "accumulate"])
def test_reduction_is_one_flat_sum_per_bucket(monkeypatch, zero, path):
    """Each bucket's replica gradients are summed in one call into one flat result: member by member straight from
    the R x k gradients (the bucket's prepared sum) where tensors are read through the C shim, else as R packed flat
    tensors; .grad matches the bare module's whether the optimizer drops gradients, zeroes them in place or lets them
    accumulate."""
    if path == "aoti" and not _core.tensor_shim_usable():
        pytest.skip("this torch has no usable C shim")
    previous = _C.set_tensor_path(path)
    calls = []
    real_columns, real_rows = _sums.reduce_columns, _C.PreparedSum

    def spy_columns(columns, outs):
        calls.append(("packed", len(columns), [t.numel() for t in columns[0]], outs[0].numel()))
        return real_columns(columns, outs)

    class SpyRows:  # the bucket's prepared sum (its members' shapes read once)
        def __init__(self, members, nrep):
            self.plan, self.k = real_rows(members, nrep), len(members)

        def run(self, grads, out):
            done = self.plan.run(grads, out)
            if done:
                calls.append(("rows", len(grads) // self.k, self.k, out.numel()))
            return done

    monkeypatch.setattr(_sums, "reduce_columns", spy_columns)
    monkeypatch.setattr(_C, "PreparedSum", SpyRows)
    try:
        model, ref = mlp(), mlp()
        dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, bucket_cap_mb=0.0005)
        torch.manual_seed(2)
        for _ in range(3):
            x = torch.randn(9, 6, dtype=torch.float64)
            if zero != "accumulate":
                model.zero_grad(set_to_none=zero == "set_to_none")
                ref.zero_grad(set_to_none=zero == "set_to_none")
            calls.clear()
            loss_of(dp, x).backward()
            loss_of(ref, x).backward()
            assert_same_grads(model, ref)
            buckets = dp._replica_set.layout[0]
            assert len(buckets) > 1
            if path == "aoti":
                want = [("rows", R, len(b.members), b.numel) for b in buckets]
            else:
                want = [("packed", 1, [b.numel] * R, b.numel) for b in buckets]
            assert sorted(calls) == sorted(want)
    finally:
        _C.set_tensor_path(previous)


@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_first_forward_without_autograd_then_training(first):
    """The buffers made at the first forward are ordinary tensors even when that forward runs under inference_mode
    or no_grad: training afterwards matches the bare module."""
    model, ref = mlp(), mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    with torch.inference_mode() if first == "inference_mode" else torch.no_grad():
        torch.testing.assert_close(dp(x), ref(x))
    assert not any(p.is_inference() for p in model.parameters())
    loss_of(dp, x).backward()
    loss_of(ref, x).backward()
    assert_same_grads(model, ref)


class _Gated(nn.Module):
    """An MLP whose middle layer is skipped when the batch's first value is negative (a member left without a
    gradient in that step: the reduction's per-member path)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if x[0, 0] >= 0:
            h = torch.tanh(self.b(h))
        return self.c(h)


@pytest.mark.parametrize("bucket_cap_mb", [25, 1e-6])  # one bucket; one member per bucket
@pytest.mark.parametrize("gates", [(1, 1, 1), (1, -1, 1), (-1, 1, 1), (1, 1, -1)])
def test_no_sync_packed_sums_match_accumulation(bucket_cap_mb, gates):
    """no_sync keeps one packed sum per replica and bucket; a step where some member has no gradient switches to
    the per-member form; a bucket none of whose members the synchronising backward uses (its node never runs) is
    reduced at the end of that backward; in every case .grad equals accumulating on the bare module."""
    model, ref = _Gated(), _Gated()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, bucket_cap_mb=bucket_cap_mb)
    torch.manual_seed(4)
    xs = []
    for g in gates:
        x = torch.randn(9, 6, dtype=torch.float64)
        x[:, 0] = g * x[:, 0].abs()  # every replica's chunk takes the same branch
        xs.append(x)
    share = _Gated()  # replica 0's share: the first chunk of each micro-batch
    with dp.no_sync():
        for x in xs[:-1]:
            loss_of(dp, x).backward()
            loss_of(share, x.chunk(R)[0]).backward()
    assert_same_grads(model, share, tol=1e-12)  # nothing reduced: .grad holds replica 0's accumulation
    loss_of(dp, xs[-1]).backward()
    for x in xs:
        loss_of(ref, x).backward()
    assert_same_grads(model, ref, tol=1e-12)
    assert not dp._replica_set.reducer.holds_unsynced()


def test_a_replaced_replica_set_is_freed_without_the_collector():
    """Buckets, their nodes and their shared state form no reference cycle: when a structure change replaces the
    replica set, its buffers (device memory on a GPU) are freed at once, not at the next garbage collection."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    gc.collect()
    gc.disable()
    try:
        with dp.no_sync():  # kept sums, so the state's bucket list and the engine callback are in use
            dp(torch.randn(4, 4)).sum().backward()
        dp(torch.randn(4, 4)).sum().backward()
        old = weakref.ref(dp._replica_set.state)
        model.add_module("extra", nn.Linear(2, 2))  # a structure change: the next forward builds a new set
        dp(torch.randn(4, 4)).sum().backward()
        assert old() is None
    finally:
        gc.enable()
