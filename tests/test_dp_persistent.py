"""Persistent replicas, bucketed reduction, the worker pool and no_sync on emulated CPU replicas.

Every check compares against a reference: the bare module on the full batch, or what fresh replicas
(``fastdp.replicate``, rebuilt every step as upstream does) produce."""

import copy
import gc
import threading

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._reduction import reducer as _reducer
from fastdp._step import replicas as _replicas

from _places import devices, host, module

# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")

R = 3


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def grads(model):
    return [None if p.grad is None else host(p.grad).clone() for p in model.parameters()]


def assert_grads_equal(a, b, tol=1e-12):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=tol)


def step(model, x, backward=True):
    out = model(x)
    if backward:
        out.pow(2).sum().backward()
    return out


def reference(model_fn, x, mutate=None):
    """Gradients of the bare module on the full batch, after the same mutation."""
    bare = model_fn()
    if mutate:
        mutate(bare)
    step(bare, x)
    return bare, grads(bare)


def test_replicas_are_kept_across_steps():
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    x = torch.randn(10, 6, dtype=torch.float64)
    step(dp, x)
    kept = dp._replica_set
    first = [id(m) for m in kept.replicas[1]]
    step(dp, x)
    assert dp._replica_set is kept and [id(m) for m in kept.replicas[1]] == first
    # One autograd node per bucket: a tiny bucket size gives several, each reducing on its own.
    dp_small = fastdp.DataParallel(module(mlp()), device_ids=devices(R), bucket_cap_mb=1e-5)
    out = dp_small(x)
    nodes = [n for n in _walk(out.grad_fn) if type(n).__name__ == "BucketNodeBackward"]
    assert len(nodes) == len(dp_small._replica_set.layout[0]) == len(list(dp_small.parameters()))


def _walk(fn, seen=None):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return seen
    seen.add(fn)
    for nxt, _ in fn.next_functions:
        _walk(nxt, seen)
    return seen


def test_buckets_reverse_order_dtype_homogeneous_and_frozen_excluded():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).half(), nn.Linear(4, 4))
    model[0].bias.requires_grad_(False)
    kept = _replicas.ReplicaSet(model, ["cpu"] * 2, 1 << 20)
    diff, rest = kept.layout
    params = kept.params
    members = [params[i] for b in diff for i in b.members]
    assert all(p.requires_grad for p in members) and id(model[0].bias) not in {id(m) for m in members}
    assert all(len({params[i].dtype for i in b.members}) == 1 for b in diff)
    order = [i for b in diff for i in b.members if params[i].dtype == torch.float32]
    assert order == sorted(order, reverse=True)  # reverse registration order
    assert [id(params[i]) for b in rest for i in b.members] == [id(model[0].bias)]


def test_frozen_parameters_are_not_reduced(monkeypatch):
    calls = []
    real = _reducer.start

    def spy(bucket, grads):
        calls.append([bucket.reducer.devices, list(bucket.members)])
        return real(bucket, grads)

    monkeypatch.setattr(_reducer, "start", spy)
    model = module(mlp())
    model[0].weight.requires_grad_(False)
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    step(dp, torch.randn(9, 6, dtype=torch.float64))
    reduced = [dp._replica_set.params[i] for _, m in calls for i in m]
    assert id(model[0].weight) not in {id(p) for p in reduced} and model[0].weight.grad is None
    assert len(reduced) == len([p for p in model.parameters() if p.requires_grad])


MUTATIONS = {
    "attribute": lambda m: setattr(m[1], "scale_out", True),
    # A new __dict__ with the same contents (a __setstate__ assigning the state it got), then an attribute set in it.
    "instance_dict": lambda m: (setattr(m[1], "__dict__", dict(m[1].__dict__)), setattr(m[1], "scale_out", True)),
    "forward_hook": lambda m: m[2].register_forward_hook(lambda mod, i, o: o * 2),
    "pre_hook": lambda m: m[0].register_forward_pre_hook(lambda mod, i: (i[0] + 1,)),
    "eval": lambda m: m.eval(),
    "replace_param": lambda m: setattr(m[2], "weight", nn.Parameter(torch.randn(8, 8, dtype=torch.float64))),
    "add_param": lambda m: m[4].register_parameter("extra", nn.Parameter(torch.ones(3, dtype=torch.float64))),
    "remove_bias": lambda m: setattr(m[4], "bias", None),
    "freeze": lambda m: m[0].weight.requires_grad_(False),
    "new_module": lambda m: m.append(nn.Linear(3, 2).double()),
    "to_float": lambda m: m.float(),
    "load_state_dict": lambda m: m.load_state_dict(mlp(seed=5).state_dict()),
}


class Scaled(nn.Module):
    """A module whose forward reads an attribute and uses an extra parameter when present."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        y = self.body(x)
        extra = getattr(self.body[4], "extra", None)
        return y + extra if extra is not None else y


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_master_changes_are_seen_like_fresh_replicas(name):
    """Change the master between steps: the next step equals the bare module with the same change."""
    x = torch.randn(11, 6, dtype=torch.float64)
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    step(dp, x)  # builds and keeps replicas
    model.zero_grad(set_to_none=True)
    mutate = MUTATIONS[name]
    mutate(model)
    if name in ("replace_param", "add_param", "new_module"):
        model = module(model)  # what the change made on the host joins the rest
    if name == "to_float":
        x = x.float()
    if name in ("attribute", "instance_dict"):  # a forward that reads the attribute
        for m in (model,):
            m[1].forward = _relu_scaled.__get__(m[1])
    if name == "replace_param":
        replaced = host(model[2].weight.detach()).clone()
    out = step(dp, x)

    bare = mlp()
    if name == "replace_param":
        bare[2].weight = nn.Parameter(replaced.clone())
    else:
        mutate(bare)
    if name in ("attribute", "instance_dict"):
        bare[1].forward = _relu_scaled.__get__(bare[1])
    ref_out = step(bare, x)
    torch.testing.assert_close(host(out), ref_out, rtol=1e-5 if name == "to_float" else 0, atol=1e-5 if name == "to_float" else 1e-12)
    tol = 1e-5 if name == "to_float" else 1e-12
    assert_grads_equal(grads(model), grads(bare), tol)


def _relu_scaled(self, x):
    y = torch.relu(x)
    return y * 3 if getattr(self, "scale_out", False) else y


def test_replica_only_attributes_do_not_persist():
    """A fresh replica would not see an attribute set on a replica in an earlier step."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            seen = getattr(self, "seen", 0)
            self.seen = seen + 1  # lost after forward, as upstream's docs say
            return self.lin(x) * (seen + 1)

    model = module(Counter())
    dp = fastdp.DataParallel(model, device_ids=devices(2))
    x = torch.randn(4, 2)
    a = dp(x)
    b = dp(x)
    torch.testing.assert_close(a, b)
    assert not hasattr(model, "seen")


def test_changing_number_of_replicas_between_steps():
    x_full = torch.randn(12, 6, dtype=torch.float64)
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(4))
    for batch in (12, 2, 3, 1, 12):  # 4, 2, 3, 1 (one chunk) and 4 replicas again
        model.zero_grad(set_to_none=True)
        x = x_full[:batch]
        step(dp, x)
        bare, ref = reference(mlp, x)
        assert_grads_equal(grads(model), ref)


@pytest.fixture(params=["storage_use_count", "weak_references"])
def liveness(request, monkeypatch):
    """Both ways of deciding that a buffer's flat buffer is free: torch's storage use count, and the fallback."""
    if request.param == "weak_references":
        monkeypatch.setattr(_replicas, "_use_count", None)
    return request.param


def bn_model():
    """BatchNorm in eval mode: its running statistics (buffers, copied into pooled flat buffers every step) are
    saved for backward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    with torch.no_grad():
        m[1].running_var.uniform_(0.5, 2.0)
    return m


def replica_running_var(dp):
    return dp._replica_set.replicas[1][2].running_var.data_ptr()  # modules in walk order: root, Linear, BN, ...


def test_two_forwards_before_backward(liveness):
    """The second forward must not overwrite buffers the first graph still needs."""
    model = module(bn_model())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    x1, x2 = torch.randn(7, 6, dtype=torch.float64), torch.randn(9, 6, dtype=torch.float64)
    step(dp, x1)  # steady state: flats exist
    model.zero_grad(set_to_none=True)
    out1 = dp(x1)
    ptr1 = replica_running_var(dp)
    out2 = dp(x2)
    assert replica_running_var(dp) != ptr1  # graph 1 still holds its replica buffers: fresh ones for graph 2
    (out1.sum() * out2.sum()).backward()
    del out1, out2
    model.zero_grad(set_to_none=True)
    (dp(x1).sum() * dp(x2).sum()).backward()
    bare = bn_model()
    (bare(x1).sum() * bare(x2).sum()).backward()
    assert_grads_equal(grads(model), grads(bare))


def test_flat_buffers_are_reused_in_steady_state(liveness):
    dp = fastdp.DataParallel(module(bn_model()), device_ids=devices(R))
    x = torch.randn(9, 6, dtype=torch.float64)
    ptrs, kept = set(), set()
    for _ in range(6):
        step(dp, x)
        ptrs.add(replica_running_var(dp))
        kept.add(dp._replica_set.replicas[1][1].weight.data_ptr())
    assert len(ptrs) <= 2  # the same buffers, not new ones every step
    assert len(kept) == 1  # parameters: the kept buffers


def test_no_sync_equals_plain_accumulation():
    xs = [torch.randn(n, 6, dtype=torch.float64) for n in (7, 10, 5)]
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    share = mlp()  # replica 0's share: the first chunk of each micro-batch (torch.chunk's rule)
    with dp.no_sync():
        for x in xs[:-1]:
            step(dp, x)
            step(share, x.chunk(R)[0])
            # Nothing reduced yet: .grad holds replica 0's own accumulation, as a DDP rank's does.
            assert_grads_equal(grads(model), grads(share), 1e-12)
    step(dp, xs[-1])
    bare = mlp()
    for x in xs:
        step(bare, x)
    assert_grads_equal(grads(model), grads(bare), 1e-12)


@pytest.mark.parametrize("change", ["append", "replace"])
def test_no_sync_sums_survive_a_structure_change(change):
    """A structure change while no_sync keeps sums rebuilds the replicas; the sums reach the master's .grad first,
    so .grad ends as accumulating on the bare model with the same change (a replaced parameter keeps what it
    accumulated, its successor starts without)."""
    xs = [torch.randn(n, 6, dtype=torch.float64) for n in (6, 7)]
    bare, model = mlp(), mlp()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    old = []
    for m, run in ((bare, bare), (model, dp)):
        with dp.no_sync():
            step(run, xs[0])
        if change == "append":
            m.append(nn.Linear(3, 3).double())
            m[-1].load_state_dict(bare[-1].state_dict())
        else:
            old.append(m[0].weight)
            m[0].weight = nn.Parameter(bare[0].weight.detach().clone() if m is model else m[0].weight.detach())
        step(run, xs[1])
    assert_grads_equal(grads(model), grads(bare), 1e-12)
    if old:
        assert_grads_equal([old[1].grad], [old[0].grad], 1e-12)


def test_worker_threads_are_reused(cpu_apply):
    # Threads (CUDA's path, forced for "cpu" replicas): one worker per replica but the first, the same ones call
    # after call. In the calling thread (the "cpu" default): every replica runs there and no worker is started.
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            seen.append(threading.get_ident())
            return self.lin(x)

    def workers():
        # fastdp's own threads only: threads other tests left behind may end at any moment (the count of all
        # threads once made this test fail on a loaded machine).
        return {t.ident for t in threading.enumerate() if t.name.startswith("fastdp-replica")}

    dp = fastdp.DataParallel(Probe(), device_ids=["cpu"] * 3)
    x = torch.randn(6, 3)
    dp(x)
    first = sorted(seen)
    seen.clear()
    before = workers()
    for _ in range(5):
        dp(x)
    assert workers() == before
    if cpu_apply == "in-thread":
        assert set(first) == set(seen) == {threading.get_ident()} and len(first) == 3
        return
    assert sorted(set(seen)) == sorted(set(first)) and len(set(first)) == 3
    assert set(first) - {threading.get_ident()} <= workers()


def test_grad_keeps_memory_format_and_matches_bare():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).double()
    conv = conv.to(memory_format=torch.channels_last)
    bare = copy.deepcopy(conv)
    conv = module(conv)
    dp = fastdp.DataParallel(conv, device_ids=devices(R))
    x = torch.randn(7, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        step(dp, x)
        step(bare, x)
    for p, q in zip(conv.parameters(), bare.parameters()):
        if p.dim() == 4:
            assert p.grad.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(host(p.grad), q.grad, rtol=0, atol=1e-10)


def test_no_reference_cycles_with_kept_replicas():
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    x = torch.randn(8, 6, dtype=torch.float64)
    step(dp, x)
    gc.collect()
    step(dp, x)
    assert gc.collect() == 0


def test_pickle_and_deepcopy_drop_the_cache():
    model = module(mlp())
    dp = fastdp.DataParallel(model, device_ids=devices(R))
    x = torch.randn(8, 6, dtype=torch.float64)
    step(dp, x)
    clone = copy.deepcopy(dp)
    assert clone._replica_set is None
    torch.testing.assert_close(host(clone(x)), host(dp(x)))
    assert clone._replica_set is not None and clone._replica_set.network is clone.module


def test_bucket_cap_validation():
    for bad in (0, -1, float("nan"), "25", True):
        with pytest.raises(ValueError) as info:
            fastdp.DataParallel(mlp(), device_ids=["cpu"] * 2, bucket_cap_mb=bad)
        assert str(info.value) == f"bucket_cap_mb must be a positive number of MiB, got {bad!r}"


def test_batchnorm_stats_from_chunk0_with_kept_replicas():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bare = copy.deepcopy(model)
    model = module(model)
    dp = fastdp.DataParallel(model, device_ids=devices(2))
    for _ in range(3):
        x = torch.randn(8, 4)
        dp(x)
        bare(x[:4])  # chunk 0 only updates the running statistics
    torch.testing.assert_close(host(model[1].running_mean), bare[1].running_mean)
    torch.testing.assert_close(host(model[1].running_var), bare[1].running_var)
    assert model[1].num_batches_tracked.item() == 3


def _move_bias_to_buffers(m):
    b = m[0]._parameters.pop("bias")  # the last parameter, becoming the only buffer: the same entries in order
    m[0].register_buffer("bias", b)  # the same tensor object: only the list it sits in differs


WALK_CHANGES = {
    "param_to_buffer": _move_bias_to_buffers,
    "param_to_none": lambda m: setattr(m[0], "bias", None),
    "none_buffer": lambda m: m[0].register_buffer("spare", None),
    "freeze": lambda m: m[1].weight.requires_grad_(False),
    "swap_children": lambda m: m._modules.update({"0": m[1], "1": m[0]}),
    "empty_child": lambda m: m[0].add_module("inner", nn.Identity()),
    "shape": lambda m: setattr(m[0].weight, "data", torch.zeros(3, 4)),
}


@pytest.mark.parametrize("name", list(WALK_CHANGES))
def test_walk_signature_sees_structure_changes(name):
    """The per-step structure signature changes with each change that makes kept replicas stale, and is stable
    when nothing changed."""
    from fastdp._step.replicas import walk

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    before = walk(model)[1]
    assert walk(model)[1] == before
    WALK_CHANGES[name](model)
    assert walk(model)[1] != before
