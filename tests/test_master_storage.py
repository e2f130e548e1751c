"""Flat buckets: the master tensors of each bucket live in one flat buffer on device_ids[0], replicate copies whole
buffers, and replica gradients are reduced one flat buffer per bucket.

Every check compares with the bare module on the full batch (or with the module's own tensors before wrapping)."""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import _C, _core, _replicas

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


def flat_buckets(dp):
    kept = dp._replica_set
    return [b for b in kept.layout[0] + kept.layout[1]]


def test_master_tensors_become_pieces_of_one_flat_buffer_per_bucket():
    model = mlp()
    model.add_module("bn", nn.BatchNorm1d(3).double())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {k: id(p) for k, p in model.named_parameters()}
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    loss_of(dp, torch.randn(9, 6, dtype=torch.float64)).backward()
    assert {k: id(p) for k, p in model.named_parameters()} == ids  # the same Parameter objects
    for bucket in flat_buckets(dp):
        assert bucket.flat is not None
        start = bucket.flat.data_ptr()
        size = bucket.flat.element_size()
        offsets = [(t.data_ptr() - start) // size for t in bucket.master]
        assert offsets == _cumulative(bucket.sizes)  # member j at the sum of the sizes before it
        # Each member on a storage of its own covering exactly its bytes (serialisers write only those).
        assert all(t.untyped_storage().data_ptr() == t.data_ptr() for t in bucket.master)
        assert [t.untyped_storage().nbytes() for t in bucket.master] == [n * size for n in bucket.sizes]
    # Values are unchanged by flattening (BatchNorm's statistics moved by the training forward are skipped).
    for k, v in model.state_dict().items():
        if not k.startswith("bn.running") and k != "bn.num_batches_tracked":
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def _cumulative(sizes):
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


@pytest.mark.parametrize("change", ["double", "data_middle", "load_state_dict", "reassign", "to_same"])
def test_changed_master_tensors_are_refreshed(change):
    """After the master tensors are replaced or rewritten the replicas see the new values (gradients equal the
    bare module's on the same values)."""
    model = mlp(dtype=torch.float32)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6)
    loss_of(dp, x).backward()
    model.zero_grad()
    torch.manual_seed(1)
    if change == "double":
        model.double()
        x = x.double()
    elif change == "data_middle":
        model[2].weight.data = torch.randn(8, 8)
    elif change == "load_state_dict":
        model.load_state_dict(mlp(seed=5, dtype=torch.float32).state_dict())
    elif change == "reassign":
        model[2].weight = nn.Parameter(torch.randn(8, 8))
    elif change == "to_same":
        model.to(torch.float32)
    ref = copy.deepcopy(model)
    loss_of(dp, x).backward()
    loss_of(ref, x).backward()
    assert_same_grads(model, ref, tol=1e-5)
    if change == "load_state_dict":  # copy_ into the views: still flat, no re-flattening
        assert all(b.reflattened == 1 for b in flat_buckets(dp))
    if change in ("double", "data_middle"):
        assert all(b.master_flat() is not None for b in flat_buckets(dp))


def test_optimizer_keeps_training_the_same_parameters():
    model, ref = mlp(), mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(3)
    for _ in range(4):
        x = torch.randn(9, 6, dtype=torch.float64)
        for m, o in ((dp, opt), (ref, opt_ref)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    assert all(b.flat is not None for b in flat_buckets(dp))


def test_tensors_sharing_memory_stay_unflattened():
    model = mlp()
    model[4].bias.data = model[2].bias.data[:3]  # a view into another parameter's memory
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    ref = copy.deepcopy(model)
    loss_of(dp, x).backward()
    loss_of(ref, x).backward()
    assert_same_grads(model, ref)
    assert model[4].bias.data_ptr() == model[2].bias.data_ptr()  # the user's aliasing is kept
    shared = [b for b in flat_buckets(dp) if any(t is model[4].bias for t in b.master)]
    assert len(shared) == 1 and shared[0].master_flat() is None  # that bucket is copied member by member
    loss_of(dp, x).backward()  # and stays on that path (checked once, not every step)
    assert shared[0].reflattened > _replicas._REFLATTEN and shared[0].flat is None


def test_replicate_copies_one_flat_buffer_per_bucket_and_device(monkeypatch):
    calls = []
    real = _replicas._C.copy

    def spy(dsts, srcs, streams):
        calls.append(len(dsts))
        return real(dsts, srcs, streams)

    model = mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    x = torch.randn(9, 6, dtype=torch.float64)
    loss_of(dp, x).backward()
    monkeypatch.setattr(_replicas._C, "copy", spy)
    loss_of(dp, x).backward()
    buckets = flat_buckets(dp)
    assert calls == [R - 1] * len(buckets)  # one pair (flat -> replica flat) per replica, one call per bucket


@pytest.mark.parametrize("path", ["aoti", "python"])
@pytest.mark.parametrize("zero", ["set_to_none", "zeros", "accumulate"])
def test_reduction_is_one_flat_sum_per_bucket(monkeypatch, zero, path):
    """Each bucket's replica gradients are summed in one call into one flat result: member by member straight from
    the R x k gradients (reduce_rows) where tensors are read through the C shim, else as R packed flat tensors;
    .grad matches the bare module's whether the optimizer drops gradients, zeroes them in place or lets them
    accumulate."""
    if path == "aoti" and not _core.tensor_shim_usable():
        pytest.skip("this torch has no usable C shim")
    previous = _C.set_tensor_path(path)
    calls = []
    real_columns, real_rows = _replicas.reduce_columns, _C.reduce_rows

    def spy_columns(columns, outs):
        calls.append(("packed", len(columns), [t.numel() for t in columns[0]], outs[0].numel()))
        return real_columns(columns, outs)

    def spy_rows(grads, k, out):
        done = real_rows(grads, k, out)
        if done:
            calls.append(("rows", len(grads) // k, k, out.numel()))
        return done

    monkeypatch.setattr(_replicas, "reduce_columns", spy_columns)
    monkeypatch.setattr(_C, "reduce_rows", spy_rows)
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
    """The flat buffers made at the first forward are ordinary tensors even when that forward runs under
    inference_mode or no_grad: training afterwards matches the bare module."""
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
    assert all(b.pending is None for b in dp._replica_set.layout[0])


def test_a_replaced_replica_set_is_freed_without_the_collector():
    """Buckets and their shared state form no reference cycle: when a structure change replaces the replica set,
    its flat buffers (device memory on a GPU) are freed at once, not at the next garbage collection."""
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
