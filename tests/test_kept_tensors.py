"""Kept replica tensors (NOTE [kept replica tensors] in fastdp/_step/replicas.py) on emulated CPU replicas.

The grad buckets' autograd nodes and the replicas' parameter tensors are made once and reused every step. Each
test compares against the bare module on the full batch, doing the same thing, or against what the bare module
does when it fails (a graph whose saved weights changed in place)."""

import pytest
import torch
import torch.nn as nn

import fastdp
from test_dp_persistent import assert_grads_equal as assert_all_close
from test_dp_persistent import grads

pytestmark = pytest.mark.usefixtures("cpu_apply")

R = 3
X = torch.randn(9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def wrapped():
    return fastdp.DataParallel(mlp(), device_ids=["cpu"] * R)


def sgd_step(model, lr=0.1):
    """Squared-output loss, backward and plain SGD on the parameters that got a gradient."""
    model(X).pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def replica_weights(dp):
    return [replica[0].weight for replica in (row[0] for row in dp._replica_set.replicas)]


def test_kept_tensors_are_reused_and_training_equals_the_bare_model():
    bare, dp = mlp(), wrapped()
    opt_b = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    first = None
    for _ in range(5):
        for model, opt in ((bare, opt_b), (dp, opt_d)):
            opt.zero_grad()
            model(X).pow(2).sum().backward()
            opt.step()
        weights = replica_weights(dp)
        # Upstream's replica tensors: non-leaves with a grad_fn (its test_parameter_list_dict_replica).
        assert all(w.grad_fn is not None and not w.is_leaf and w.requires_grad for w in weights)
        assert type(weights[0].grad_fn).__name__ == "BucketNodeBackward"
        first = first or [id(w) for w in weights]
        assert [id(w) for w in weights] == first
        assert_all_close(list(dp.module.parameters()), list(bare.parameters()), 1e-10)
    kept = dp._replica_set
    assert kept.kept is not None and kept.sets[(True, True)].kept is kept.kept


def test_two_forwards_then_one_backward():
    bare, dp = mlp(), wrapped()
    for model in (bare, dp):
        (model(X).pow(2).sum() + model(X * 2).sin().sum()).backward()
    assert_all_close(grads(dp.module), grads(bare))


def test_retained_graph_backward_again_after_another_forward():
    bare, dp = mlp(), wrapped()
    for model in (bare, dp):
        loss = model(X).pow(2).sum()
        loss.backward(retain_graph=True)
        model(X * 3).sum().backward()  # a forward (and its backward) between the two backwards of the first graph
        loss.backward()
    assert_all_close(grads(dp.module), grads(bare))


def test_master_changed_in_place_before_backward_fails_loudly_as_on_the_bare_model():
    # The bare model's saved weights change under the graph: autograd refuses. The kept buffers copied after the
    # change must refuse the same way, not compute with the new weights.
    for model in (mlp(), wrapped()):
        loss = model(X.requires_grad_()).pow(2).sum()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        model(X)  # the next forward copies the changed master into every replica's kept buffers
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    X.requires_grad_(False)


@pytest.mark.parametrize("layer", [2, 4])  # weights the graph saves (layer 0's input needs no gradient)
def test_each_buckets_replicas_refuse_a_graph_whose_weights_changed(layer):
    # One bucket per tensor, and replica 0 (which shares the master's counters) given no rows: only the other
    # replicas' kept buffers saw the forward, so whichever bucket holds the changed weight must refuse by itself.
    for model in (mlp(), fastdp.DataParallel(mlp(), device_ids=["cpu"] * R, chunk_sizes=[0, 4, 5],
                                             bucket_cap_mb=1e-6)):
        loss = model(X).pow(2).sum()
        master = model.module if isinstance(model, fastdp.DataParallel) else model
        with torch.no_grad():
            master[layer].weight.mul_(0.5)
        model(X)  # the next forward copies the changed master into the kept buffers
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_data_edits_reach_every_replica():
    # p.data edits move no version counter: the kept buffers are copied every step anyway.
    bare, dp = mlp(), wrapped()
    for model in (bare, dp):
        model(X).sum().backward()
        for p in model.parameters():
            p.data.mul_(-0.5)
            p.grad = None
        out = model(X)
        out.pow(2).sum().backward()
    torch.testing.assert_close(dp(X), bare(X), rtol=0, atol=1e-12)
    assert_all_close(grads(dp.module), grads(bare))


def test_master_data_replaced_remakes_the_kept_nodes():
    bare, dp = mlp(), wrapped()
    dp(X).sum().backward()
    before = dp._replica_set.kept
    for model in (bare, dp.module):
        model[0].weight.data = torch.full_like(model[0].weight, 0.25)
        model.zero_grad()
    for model in (bare, dp):
        model(X).pow(2).sum().backward()
    assert dp._replica_set.kept is not before
    assert_all_close(grads(dp.module), grads(bare))


class HookedLinear(nn.Linear):
    """Registers a gradient hook on its weight in every forward (as gradient-inspecting code does)."""

    calls = 0

    def forward(self, x):
        if self.weight.requires_grad:
            self.weight.register_hook(self._count)
        return super().forward(x)

    @classmethod
    def _count(cls, g):
        cls.calls += 1


@pytest.mark.parametrize("report", [False, True], ids=["report off", "report on"])
def test_hooks_registered_on_replica_tensors_last_one_step(report):
    # With the report on, its own hooks on the step's nodes are registered in the same steps (the hooked layer is
    # not the first: the first parameter is the backward mark's, a view made in the step).
    torch.manual_seed(0)
    dp = fastdp.DataParallel(nn.Sequential(nn.Linear(6, 6), HookedLinear(6, 3)).double(), device_ids=["cpu"] * R,
                             report=report)
    counts = []
    for _ in range(4):
        HookedLinear.calls = 0
        dp(X).sum().backward()
        counts.append(HookedLinear.calls)
    assert counts == [R] * 4  # once per replica and step, as on fresh replicas; not growing with the steps


def test_the_reports_own_hooks_leave_the_kept_tensors_hook_dicts_alone(monkeypatch):
    # Its hooks sit on the step's nodes, never in a tensor's hook dict: a recording step gives the next one no
    # reason to empty every kept tensor's dict (the reference: the same steps with the report off, which empty none).
    emptied = []
    clear = fastdp._C.clear_hooks
    monkeypatch.setattr(fastdp._C, "clear_hooks", lambda tensors: emptied.append(len(tensors)) or clear(tensors))
    for report in (False, True):
        dp = fastdp.DataParallel(mlp(), device_ids=["cpu"] * R, report=report)
        sgd_step(dp)
        emptied.clear()
        for _ in range(3):
            sgd_step(dp)
        assert emptied == [], report


def test_autograd_grad_and_hooks_on_master_parameters():
    bare, dp = mlp(), wrapped()
    seen = {id(bare): [], id(dp.module): []}
    results = []
    for model, master in ((bare, bare), (dp, dp.module)):
        master[0].weight.register_hook(lambda g, key=id(master): seen[key].append(g.clone()))
        for _ in range(2):
            results.append(torch.autograd.grad(model(X).pow(2).sum(), list(master.parameters())))
    assert_all_close(results[2], results[0])
    assert_all_close(results[3], results[1])
    assert_all_close(seen[id(dp.module)], seen[id(bare)])
    assert len(seen[id(bare)]) == 2


def test_double_backward_gradient_penalty():
    bare, dp = mlp(), wrapped()
    for model, master in ((bare, bare), (dp, dp.module)):
        for _ in range(2):
            gs = torch.autograd.grad(model(X).pow(2).sum(), list(master.parameters()), create_graph=True)
            sum(g.pow(2).sum() for g in gs).backward()
    assert_all_close(grads(dp.module), grads(bare), 1e-9)


def test_no_grad_and_inference_forwards_between_training_steps():
    bare, dp = mlp(), wrapped()
    for _ in range(2):
        for model in (bare, dp):
            model(X).pow(2).sum().backward()
            with torch.no_grad():
                out_ng = model(X)
            with torch.inference_mode():
                out_inf = model(X)
            torch.testing.assert_close(out_ng, out_inf, rtol=0, atol=0)
            for p in model.parameters():
                with torch.no_grad():
                    p -= 0.1 * p.grad
    torch.testing.assert_close(dp(X), bare(X), rtol=0, atol=1e-12)
    assert_all_close(grads(dp.module), grads(bare), 1e-10)
    # Without autograd the kept buffers serve too (plain aliases): no second set of replica buffers.
    assert not any(pool.entries for b in dp._replica_set.layout[0] for pool in b.pools)
    with torch.no_grad():
        weights = replica_weights(dp)
        dp(X)
        plain = replica_weights(dp)
    assert plain[0] is dp.module[0].weight  # replica 0 gets the master tensors, as upstream's detached replicate
    assert all(not w.requires_grad for w in plain[1:])
    assert all(p.data_ptr() == w.data_ptr() for p, w in zip(plain[1:], weights[1:]))


def test_frozen_parameters_and_buffers_beside_kept_ones():
    def model_fn():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
        m[0].bias.requires_grad_(False)
        return m

    bare = model_fn()
    dp = fastdp.DataParallel(model_fn(), device_ids=["cpu"])  # BatchNorm statistics: one replica = full batch
    dp3 = fastdp.DataParallel(model_fn(), device_ids=["cpu"] * R)
    for _ in range(3):
        for model in (bare, dp, dp3):
            sgd_step(model)
    assert dp3._replica_set.kept is not None
    torch.testing.assert_close(dp.module[0].weight, bare[0].weight, rtol=0, atol=1e-12)
    # Three replicas see three chunks (BatchNorm statistics per chunk, as upstream): compare against fresh
    # replicas of the same wrapper instead.
    fresh = fastdp.DataParallel(model_fn(), device_ids=["cpu"] * R)
    fresh.replicate = lambda module, devices: fastdp.replicate(module, devices)
    for _ in range(3):
        sgd_step(fresh)
    assert_all_close(list(dp3.module.state_dict().values()), list(fresh.module.state_dict().values()), 1e-10)


def test_a_graph_holding_another_replicas_tensor_fails_loudly_when_the_master_changed():
    # Replica 0's tensors share the master's version counters; the other replicas' kept buffers are bumped when
    # the master's counters moved, so a graph that saved one of them refuses instead of using the new values.
    dp = wrapped()
    dp(X).sum().backward()
    w1 = replica_weights(dp)[1]
    pending = (w1 * w1).sum()  # saves w1
    dp(X)  # master unchanged: copied to equal values, the graph stays valid
    pending.backward(retain_graph=True)
    with torch.no_grad():
        dp.module[0].weight.mul_(0.5)
    dp(X)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


class Checkpointed(nn.Module):
    """The middle layers recomputed in backward: the kept node is reached again from inside backward."""

    def __init__(self, reentrant):
        super().__init__()
        self.inner, self.reentrant = mlp(), reentrant
        self.head = nn.Linear(3, 2).double()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.inner, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    bare = Checkpointed(reentrant)
    dp = fastdp.DataParallel(Checkpointed(reentrant), device_ids=["cpu"] * R)
    dp.module.load_state_dict(bare.state_dict())
    x = X.clone().requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
    for _ in range(2):
        for model in (bare, dp):
            model(x).pow(2).sum().backward()
    assert_all_close(grads(dp.module), grads(bare), 1e-10)


def test_parametrized_weights():
    from torch.nn.utils import parametrizations

    def model_fn():
        torch.manual_seed(0)
        m = mlp()
        parametrizations.weight_norm(m[0])
        parametrizations.orthogonal(m[2])
        return m

    bare, dp = model_fn(), fastdp.DataParallel(model_fn(), device_ids=["cpu"] * R)
    for _ in range(3):
        for model in (bare, dp):
            sgd_step(model, 0.05)
    torch.testing.assert_close(dp(X), bare(X), rtol=0, atol=1e-10)


def test_channels_last_weights_keep_their_layout():
    # channels_last weights (not contiguous) keep their own memory and layout; the replicas get them copied member
    # by member into the kept buffers.
    def model_fn():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 2, 3)).double()
        m.to(memory_format=torch.channels_last)
        return m

    x = torch.randn(6, 2, 7, 7, dtype=torch.float64)
    bare, dp = model_fn(), fastdp.DataParallel(model_fn(), device_ids=["cpu"] * R)
    for _ in range(3):
        for model in (bare, dp):
            model(x).pow(2).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
        assert dp.module[0].weight.is_contiguous(memory_format=torch.channels_last)
        assert dp._replica_set.kept is not None
    torch.testing.assert_close(dp(x), bare(x), rtol=0, atol=1e-10)
    before = dp._replica_set.kept
    for model in (bare, dp.module):  # a member's .data replaced: replica 0's alias would be stale
        model[0].weight.data = model[0].weight.data.contiguous(memory_format=torch.channels_last) * 0.5
    torch.testing.assert_close(dp(x), bare(x), rtol=0, atol=1e-10)
    assert dp._replica_set.kept is not before


def test_parameters_sharing_one_storage():
    def model_fn():
        torch.manual_seed(0)
        m = mlp()
        m[2].bias.data = m[2].weight.data[0]  # the bias a view of the weight's storage
        return m

    bare, dp = model_fn(), wrapped()
    dp.module.load_state_dict(bare.state_dict())
    dp.module[2].bias.data = dp.module[2].weight.data[0]
    for _ in range(2):
        for model in (bare, dp):
            sgd_step(model, 0.05)
    assert dp._replica_set.kept is not None
    assert dp.module[2].bias.data_ptr() == dp.module[2].weight.data_ptr()  # still one storage, as the user made it
    torch.testing.assert_close(dp(X), bare(X), rtol=0, atol=1e-10)


def test_version_sum_and_clear_hooks_against_python():
    """The two per-step scans of the kept path in C: the masters' summed version counters, and emptying the hook
    dicts a forward left on kept replica tensors, compared with the same done in Python."""
    from fastdp import _C

    ts = [torch.zeros(3, requires_grad=i % 2 == 0).detach() for i in range(7)]
    assert _C.version_sum(ts) == sum(t._version for t in ts)
    ts[3].add_(1)
    ts[5].mul_(2)
    assert _C.version_sum(ts) == sum(t._version for t in ts) == 2
    views = [t.detach().requires_grad_() for t in ts]
    handles = [views[i].register_hook(lambda g: g) for i in (1, 4, 6)]
    assert [bool(v._backward_hooks) for v in views] == [i in (1, 4, 6) for i in range(7)]
    assert _C.clear_hooks(views) == 3
    assert not any(v._backward_hooks for v in views)
    assert _C.clear_hooks(views) == 0
    del handles
    with pytest.raises(TypeError):
        _C.version_sum(3)
    with pytest.raises(AttributeError):
        _C.clear_hooks([views[0], object()])


def test_handles_made_counts_every_registration_but_fastdps_own_on_nodes():
    from fastdp._step import hooks as _hooks

    t = torch.ones(2, requires_grad=True)
    node = (t * 2).grad_fn
    start = _hooks.handles_made()
    _hooks.on_node(node, lambda grad_outputs: None, pre=True)
    _hooks.on_node(node, lambda grad_inputs, grad_outputs: None)
    assert _hooks.handles_made() == start
    t.register_hook(lambda g: g)  # a tensor's hook
    nn.Linear(2, 2).register_forward_hook(lambda m, i, o: o)  # a module's
    node.register_hook(lambda grad_inputs, grad_outputs: None)  # a node's, not through on_node
    assert _hooks.handles_made() == start + 3
    _ = (t * 2).grad_fn  # a node made, nothing registered
    assert _hooks.handles_made() == start + 3
