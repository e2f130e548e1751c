"""torch.compile with the wrapper, both ways, against the bare model: a compiled module inside
(``DataParallel(torch.compile(m))``: replicas run compiled code, compiled on the first step, at most once per
replica, and reused across steps)
and the compiled wrapper (``torch.compile(DataParallel(m))``: Dynamo stops at the wrapper, one graph break).
The "aot_eager" backend keeps these fast (Dynamo and AOTAutograd, no code generation); one case uses the default
backend (inductor) end to end. float64 throughout, so results match the bare model to rounding."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fastdp

STEPS = 20


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _batches(n=STEPS, batch=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g, dtype=torch.float64),
             torch.randn(batch, 2, generator=g, dtype=torch.float64)) for _ in range(n)]


def _train(forward, params, batches, seen=None):
    """SGD steps; seen, when given, collects Dynamo's count of compiled graphs after each step."""
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
    outs = []
    for x, y in batches:
        opt.zero_grad()
        out = forward(x)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
        outs.append(out.detach())
        if seen is not None:
            seen.append(counters["stats"]["unique_graphs"])
    return outs


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("replicas", [2, 3])
def test_compiled_module_inside_compiles_once_per_replica(replicas, cpu_apply):
    bare = _model()
    inner = copy.deepcopy(bare)
    dp = fastdp.DataParallel(torch.compile(inner, backend="aot_eager"), device_ids=["cpu"] * replicas)
    batches = _batches()
    seen = []
    ours = _train(dp, dp.parameters(), batches, seen)
    theirs = _train(bare, bare.parameters(), batches)
    # Compiled on the first step (once, or once per replica where replicas run on worker threads at the same
    # time) and never again in the next 19 steps.
    assert 1 <= seen[0] <= replicas and seen == [seen[0]] * STEPS, seen
    for a, b in zip(ours, theirs):
        _close(a, b)
    for p, q in zip(inner.parameters(), bare.parameters()):
        _close(p, q)


def test_compiled_module_checkpoint_has_the_bare_keys():
    bare = _model()
    dp = fastdp.DataParallel(torch.compile(copy.deepcopy(bare), backend="aot_eager"), device_ids=["cpu"] * 2)
    sd = dp.state_dict()
    assert list(sd) == list(bare.state_dict())  # neither "module." nor "_orig_mod."
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh.load_state_dict(sd)  # loads into the bare model as is
    again = fastdp.DataParallel(torch.compile(fresh, backend="aot_eager"), device_ids=["cpu"] * 2)
    again.load_state_dict({"_orig_mod." + k: v + 1 for k, v in sd.items()})  # torch.compile's own key form
    for k, v in sd.items():
        _close(again.state_dict()[k], v + 1)


def test_compiled_wrapper_breaks_its_graph_once_and_matches():
    bare = _model()
    inner = copy.deepcopy(bare)
    dp = torch.compile(fastdp.DataParallel(inner, device_ids=["cpu"] * 2), backend="aot_eager")
    batches = _batches(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Dynamo warns for every fastdp._C call it tries to trace
        ours = _train(dp, inner.parameters(), batches)
    theirs = _train(bare, bare.parameters(), batches)
    for a, b in zip(ours, theirs):
        _close(a, b)
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])


@pytest.mark.parametrize("replicas", [1, 2])
def test_compiled_function_calling_the_wrapper_breaks_once_and_matches(replicas):
    """Work before and after the wrapper in one compiled function: one graph break at the wrapper, two frames
    compiled (the function and its continuation after the break; never the wrapper's own forward), and the
    bare model's results and gradients, on the one-device short path as on the step over two replicas."""
    bare = _model()
    inner = copy.deepcopy(bare)
    dp = fastdp.DataParallel(inner, device_ids=["cpu"] * replicas)

    @torch.compile(backend="aot_eager")
    def compiled(x):
        return dp(torch.sin(x)).cos().sum()

    for x, _ in _batches(3):
        ours, theirs = compiled(x), bare(torch.sin(x)).cos().sum()
        _close(ours, theirs)
        ours.backward()
        theirs.backward()
    for p, q in zip(inner.parameters(), bare.parameters()):
        _close(p.grad, q.grad)
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])


def test_compiled_wrapper_around_a_compiled_module():
    """Both: the wrapper is a boundary, the replicas inside run their own compiled code."""
    bare = _model()
    inner = copy.deepcopy(bare)
    dp = torch.compile(fastdp.DataParallel(torch.compile(inner, backend="aot_eager"), device_ids=["cpu"] * 2),
                       backend="aot_eager")
    _matches_bare_and_compiled(dp, inner, bare, _batches(5))


def test_inductor_end_to_end():
    bare = _model()
    inner = copy.deepcopy(bare)
    dp = fastdp.DataParallel(torch.compile(inner), device_ids=["cpu"] * 2)
    _matches_bare_and_compiled(dp, inner, bare, _batches(3))


def _matches_bare_and_compiled(dp, inner, bare, batches):
    """Training through dp equals the bare model's, and the replicas ran compiled code (1 or 2 graphs)."""
    ours = _train(dp, inner.parameters(), batches)
    theirs = _train(bare, bare.parameters(), batches)
    for a, b in zip(ours, theirs):
        _close(a, b)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
