"""Hooks a replica registers on itself during forward stay on the replica: results equal the bare model's step
after step and the master is left without them; hooks registered on the master still run on every replica."""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import _hooks


class SelfHooking(nn.Module):
    """Registers forward hooks on itself and its child the first time it runs (guarded by a flag attribute), as
    transformers installs its output-capturing hooks; the hooks record outputs into a per-call list."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 3)

    def _record(self, module, args, output):
        self._recorded.append(output)

    def forward(self, x):
        if not getattr(self, "_hooked", False):
            self.inner.register_forward_hook(self._record)
            self.outer.register_forward_hook(self._record)
            self.inner.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
            self._hooked = True
        self._recorded = []
        y = self.outer(torch.relu(self.inner(x)))
        # What the hooks saw is part of the result: one entry per hooked call, as hidden states are.
        return y, torch.stack([r.sum(1) for r in self._recorded], 1)


class Rebuilt(SelfHooking):
    """The same module on the rebuild-every-step path (a custom _replicate_for_data_parallel)."""

    def _replicate_for_data_parallel(self):
        return super()._replicate_for_data_parallel()


def _hook_counts(model):
    return [sum(len(m.__dict__[k]) for k in _hooks.KEYS) for m in model.modules()]


@pytest.mark.parametrize("cls", [SelfHooking, Rebuilt], ids=["kept-replicas", "fresh-replicas"])
def test_hooks_registered_in_forward_stay_on_the_replica(cls, cpu_apply):
    torch.manual_seed(0)
    bare = cls().double()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    opt_b = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(6, 4, dtype=torch.float64)
        (yb, hb), (yd, hd) = bare(x), dp(x)
        assert hd.shape == hb.shape, f"step {step}: {hd.shape} vs {hb.shape}"
        torch.testing.assert_close(yd, yb, rtol=0, atol=1e-12)
        torch.testing.assert_close(hd, hb, rtol=0, atol=1e-12)
        (yb.sum() + hb.sum()).backward()
        (yd.sum() + hd.sum()).backward()
        for pb, pd in zip(bare.parameters(), model.parameters()):
            torch.testing.assert_close(pd.grad, pb.grad, rtol=0, atol=1e-12)
        opt_b.step()
        opt_d.step()
        opt_b.zero_grad()
        opt_d.zero_grad()
        assert sum(_hook_counts(model)) == 0, f"step {step}: hooks left on the master"
        assert not getattr(model, "_hooked", False)


def test_master_hooks_run_on_replicas_and_removal_reaches_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(6, 4)
    plain = dp(x)
    seen = []
    handle = model[0].register_forward_hook(lambda m, a, out: seen.append(out.shape[0]) or out * 3)
    torch.testing.assert_close(dp(x), model(x))
    assert seen == [3, 3, 6]  # both replicas, then the bare call
    handle.remove()
    seen.clear()
    torch.testing.assert_close(dp(x), plain)
    assert seen == []
    kw = model[1].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)
    torch.testing.assert_close(dp(x), model(x))
    kw.remove()
    torch.testing.assert_close(dp(x), plain)


def test_refresh_rejects_bad_mirror_count():
    from fastdp import _C

    with pytest.raises(ValueError) as info:
        _C.refresh([({}, {})], ("a",), 2)
    assert str(info.value) == "refresh: nmirrored must be between 0 and len(owned) (1), got 2"
