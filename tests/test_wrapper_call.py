"""``dp(x)`` runs the wrapper's hooks, tracing and compiled call exactly as ``nn.Module.__call__`` does: the wrapper's
own call skips torch's only where torch's would do nothing but call ``forward`` (NOTE [the wrapper's own call])."""

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import fastdp


class Reference(nn.Module):
    """The same module behind a plain nn.Module: what the wrapper's hooks must see and do."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


def _pair(device_ids):
    torch.manual_seed(0)
    inner = nn.Linear(4, 3)
    ref_inner = nn.Linear(4, 3)
    ref_inner.load_state_dict(inner.state_dict())
    return fastdp.DataParallel(inner, device_ids=device_ids), Reference(ref_inner)


_HOOKS = {
    "pre": lambda m, seen: m.register_forward_pre_hook(lambda mod, args: (seen.append("pre"), (args[0] * 2,))[1]),
    "pre-kw": lambda m, seen: m.register_forward_pre_hook(lambda mod, args, kwargs: (seen.append("pre-kw"), None)[1],
                                                          with_kwargs=True),
    "fwd": lambda m, seen: m.register_forward_hook(lambda mod, args, out: (seen.append("fwd"), out + 1)[1]),
    "bwd-pre": lambda m, seen: m.register_full_backward_pre_hook(
        lambda mod, grad_out: (seen.append("bwd-pre"), (grad_out[0] * 3,))[1]),
    "bwd": lambda m, seen: m.register_full_backward_hook(lambda mod, grad_in, grad_out: (seen.append("bwd"), None)[1]),
}


@pytest.mark.parametrize("device_ids", [["cpu"], ["cpu"] * 2], ids=["one device", "two replicas"])
@pytest.mark.parametrize("kinds", [[k] for k in _HOOKS] + [list(_HOOKS)], ids=list(_HOOKS) + ["all"])
def test_the_wrappers_own_hooks_run_as_on_any_module(device_ids, kinds):
    """Each kind of module hook on the wrapper alone, then all of them: called in the same order, with the same
    effect on outputs and gradients, as on a plain module."""
    dp, ref = _pair(device_ids)
    seen_dp, seen_ref = [], []
    for kind in kinds:
        _HOOKS[kind](dp, seen_dp)
        _HOOKS[kind](ref, seen_ref)
    x = torch.randn(6, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out, out_ref = dp(x), ref(xr)
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    assert seen_dp == seen_ref == kinds
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(dp.module.weight.grad, ref.module.weight.grad)


@pytest.mark.parametrize("kind", ["forward_pre", "forward", "backward_pre", "backward"])
def test_global_module_hooks_see_the_wrapper(kind):
    dp, _ = _pair(["cpu"])
    called = []
    if kind == "forward_pre":
        handle = torch_module.register_module_forward_pre_hook(lambda m, args: called.append(type(m).__name__))
    elif kind == "forward":
        handle = torch_module.register_module_forward_hook(lambda m, args, out: called.append(type(m).__name__))
    elif kind == "backward_pre":
        handle = torch_module.register_module_full_backward_pre_hook(lambda m, go: called.append(type(m).__name__))
    else:
        handle = torch_module.register_module_full_backward_hook(lambda m, gi, go: called.append(type(m).__name__))
    try:
        dp(torch.randn(2, 4, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    assert "DataParallel" in called and "Linear" in called, called
    called.clear()
    dp(torch.randn(2, 4, requires_grad=True)).sum().backward()  # removed: nothing more
    assert called == []


def test_a_removed_hook_leaves_the_plain_call():
    dp, _ = _pair(["cpu"])
    seen = []
    handle = dp.register_forward_hook(lambda m, args, out: seen.append(1))
    dp(torch.randn(2, 4))
    handle.remove()
    dp(torch.randn(2, 4))
    assert seen == [1]


class Doubling(fastdp.DataParallel):
    def forward(self, x):
        return super().forward(x) * 2  # an op of the wrapper's own, recorded in its scope


def test_tracing_the_wrapper_records_its_scope():
    """torch.jit.trace goes through torch's call (``_slow_forward``), which opens the wrapper's scope for what its
    own forward records (seen where the wrapper is a submodule of the traced model)."""
    torch.manual_seed(0)
    inner = nn.Linear(4, 3)
    model = Reference(Doubling(inner, device_ids=["cpu"]))
    x = torch.randn(3, 4)
    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), inner(x) * 2)
    scopes = {node.kind(): node.scopeName() for node in traced.inlined_graph.nodes()}
    assert scopes.get("aten::mul") == "__module.module", scopes
    assert scopes.get("aten::linear") == "__module.module/__module.module.module", scopes


def test_a_compiled_call_is_used():
    """``dp.compile()`` sets the module's compiled call: the wrapper's call takes it."""
    dp, ref = _pair(["cpu"])
    used = []
    dp._compiled_call_impl = lambda *args, **kwargs: (used.append(1), dp.forward(*args, **kwargs))[1]
    x = torch.randn(3, 4)
    torch.testing.assert_close(dp(x), ref(x))
    assert used == [1]


def test_a_patched_module_call_still_sees_hooked_calls(monkeypatch):
    """Where torch's call runs (a hook registered), it is Module.__call__ as it stands then, patched or not."""
    dp, _ = _pair(["cpu"])
    dp.register_forward_hook(lambda m, args, out: None)
    original, seen = nn.Module.__call__, []

    def patched(self, *args, **kwargs):
        seen.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "__call__", patched)
    dp(torch.randn(2, 4))
    assert "DataParallel" in seen
