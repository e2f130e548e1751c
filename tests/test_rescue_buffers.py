"""What ``oom="rebalance"`` keeps of the module's buffers to put them back after a failed attempt: kept from step to
step and refreshed in one fused copy, never every buffer copied anew by a step that does not fail, and still the
buffers as they were just before the failing step, whatever the user did to them between steps (written in place or
through ``.data``, rebound, resized, moved to other memory, a buffer registered).

References: the bare model (a deep copy run without the wrapper on the full batch), edited as the wrapped one is,
float64 within 1e-10 (tests/test_rescue_contract.py's helpers).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

from _report_cases import bn_model, data
from test_rescue_contract import assert_buffers, assert_grads, bare_step, wrapped, wrapper_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Totals(nn.Module):
    """Every buffer added to by every forward, by a value of the parameters only (every replica and the bare model
    add the same), whatever its size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 3).double()
        self.register_buffer("total", torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        value = self.lin.weight.detach().abs().mean()
        for b in self._buffers.values():
            b.add_(value)
        return self.lin(x) * self.total.sum()


def _edit(m, how):
    """What a user does to the buffers between two steps."""
    with torch.no_grad():
        if how == "in place":
            m.total.mul_(2)
        elif how == ".data":
            m.total.data.fill_(0.25)
        elif how == "rebound":
            m.total = m.total * 3 + 1
        elif how == "resized":
            m.total.resize_(6).fill_(0.5)
        elif how == "set_":
            m.total.set_(torch.full((5,), 2.0, dtype=torch.float64))
        elif how == "registered":
            m.register_buffer("extra", torch.zeros(2, dtype=torch.float64))


EDITS = ["in place", ".data", "rebound", "resized", "set_", "registered"]


@pytest.mark.parametrize("how", EDITS)
@pytest.mark.parametrize("route", ["loss.backward", "train_step"])
def test_buffers_edited_between_steps_are_put_back_as_the_failing_step_found_them(route, how):
    """Two steps that do not fail, the buffers edited, then a step whose replica 1 runs out of memory after replica 0
    (the master's own buffers) added to them: put back, the step run again, the buffers are the bare model's."""
    bare = Totals()
    dp, model = wrapped(bare)
    for s in range(4):
        if s == 2:
            _edit(model, how)
            _edit(bare, how)
        x, y = data(18, seed=s)
        wrapper_step(dp, route, "forward" if s >= 2 else None, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
        assert_buffers(model, bare)
    assert_grads(model, bare)


def test_a_step_that_does_not_fail_copies_no_buffer_anew(monkeypatch):
    """After the first step, the buffers kept for a rescue are refreshed in place: no step that does not fail makes
    a new copy of any buffer (a model with many BatchNorm layers pays for none)."""
    bare = nn.Sequential(bn_model(), *[nn.BatchNorm1d(3).double() for _ in range(8)])
    dp, model = wrapped(bare)
    buffers = {id(b) for b in model.buffers()}
    assert len(buffers) > 20
    x, y = data(18, seed=0)
    wrapper_step(dp, "loss.backward", None, (x,), lambda out: F.cross_entropy(out, y))
    copied = []
    clone, empty_like = torch.Tensor.clone, torch.empty_like

    def counting_clone(t, *args, **kwargs):
        if id(t) in buffers:
            copied.append(t.shape)
        return clone(t, *args, **kwargs)

    def counting_empty_like(t, *args, **kwargs):
        if id(t) in buffers:
            copied.append(t.shape)
        return empty_like(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    monkeypatch.setattr(torch, "empty_like", counting_empty_like)
    for s in range(1, 4):
        x, y = data(18, seed=s)
        wrapper_step(dp, "loss.backward", None, (x,), lambda out: F.cross_entropy(out, y))
        bare_step(bare, (x,), lambda out: F.cross_entropy(out, y))
    assert copied == []


def test_a_copied_wrapper_keeps_no_copy_of_the_buffers():
    """The buffers kept for a rescue are a cache: a deep copy or a pickle of the wrapper takes its own (they would
    be the original's, and doubled in the file)."""
    import copy
    import pickle

    dp, model = wrapped(bn_model())
    x, y = data(18, seed=0)
    wrapper_step(dp, "loss.backward", None, (x,), lambda out: F.cross_entropy(out, y))
    assert dp._oom.buffers is not None
    for other in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert other._oom.buffers is None
        wrapper_step(other, "loss.backward", "forward", (x,), lambda out: F.cross_entropy(out, y))


def test_a_module_whose_buffers_cannot_be_taken_raises_what_the_wrapper_raises_without_a_rescue():
    """Uninitialized lazy layers: nothing can be noted of them, and no forward of the wrapper can run them; the error
    is the wrapper's own, as with oom=None."""
    x = torch.randn(6, 3)
    errors = []
    for oom in (None, "rebalance"):
        model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())
        dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2, oom=oom)
        with pytest.raises(Exception) as raised:
            dp(x)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]
    assert "LazyModule" in errors[0][1]


def test_a_failure_to_note_the_buffers_of_an_initialized_module_is_raised(monkeypatch):
    """Only uninitialized lazy buffers let a step run unrescued; any other failure to note the buffers (an
    out-of-memory error while copying them, say) is the caller's to see, not a rescue silently switched off."""
    from fastdp._balance import rescue

    def fails(kept, module):
        raise RuntimeError("noting the buffers failed")

    monkeypatch.setattr(rescue._Buffers, "taken", staticmethod(fails))
    dp = fastdp.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), device_ids=["cpu"] * 2, oom="rebalance")
    with pytest.raises(RuntimeError, match="noting the buffers failed"):
        dp(torch.randn(6, 3))
