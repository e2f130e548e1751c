"""What each replica runs under, through fastdp.DataParallel and fastdp.parallel_apply (docs/data_parallel.md):
the caller's grad mode and autocast state and dtype, a replica's own changes kept from the others, a replica's
exception raised in the caller (the lowest failing replica's), and forward hooks on the wrapper and on the module.

Every case runs on ``["cpu"] * N`` devices, and those written with tests/_places.py on simulated CUDA devices too
(tests/test_sim_contract.py; not autocast's, whose "cpu" device type is what they check). Results are compared with the bare module on the full batch,
never with numbers typed by hand.
"""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import ids
from _places import devices, host, module, on
from _replica_errors import ReplicaError


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")


# ---------------------------------------------------------------- worker context


def test_grad_mode_reaches_replicas():
    modes = []

    class Net(nn.Module):
        def forward(self, x):
            modes.append(torch.is_grad_enabled())
            return x

    dp = fastdp.DataParallel(module(Net()), device_ids=devices(2))
    x = torch.randn(4, 1)
    with torch.no_grad():
        dp(x)
    assert modes == [False, False]
    modes.clear()
    dp(x)
    assert modes == [True, True]
    modes.clear()
    with torch.inference_mode():
        dp(x)
    assert modes == [False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_enabled_and_dtype_reach_replicas(dtype):
    m = nn.Linear(4, 4)
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=dtype):
        expected = m(x)
        out = fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x)
        outs = fastdp.parallel_apply(fastdp.replicate(m, ["cpu"] * 2), [x[:3], (x[3:],)], None, ["cpu", "cpu"])
    assert expected.dtype == dtype
    assert out.dtype == dtype  # upstream keeps only the enabled flag: fp16 would turn into the default dtype
    torch.testing.assert_close(out, expected)
    assert [o.dtype for o in outs] == [dtype, dtype]


def test_autocast_decorated_forward_inside_replica():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(2, 2)

        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, x):
            return self.l(x)

    assert fastdp.DataParallel(Net(), device_ids=ids("cpu", 2))(torch.randn(4, 2)).dtype == torch.bfloat16


def test_parallel_apply_two_modules():
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    expected = (l1(i1), l2(i2))
    m1, m2 = module(copy.deepcopy(l1), 0), module(copy.deepcopy(l2), 1)
    d1, d2 = on(i1, 0), on(i2, 1)
    for inputs in ((d1, d2), ((d1,), (d2,))):
        outputs = fastdp.parallel_apply((m1, m2), inputs, None, devices(2))
        for out, exp, d in zip(outputs, expected, devices(2)):
            assert out.device == torch.device(d) if isinstance(d, str) else out.get_device() == d
            torch.testing.assert_close(host(out), exp)
    with pytest.raises(AssertionError) as reference:
        torch.nn.parallel.parallel_apply((l1, l2), (i1,))
    with pytest.raises(AssertionError) as info:
        fastdp.parallel_apply((l1, l2), (i1,))
    assert str(info.value) == str(reference.value)


def test_each_replica_starts_from_the_callers_grad_mode():
    # A replica that switches autograd off does not change what the next replica (same thread or not) or the
    # caller sees afterwards.
    seen = []

    class Switches(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)
            return x * 2

    x = torch.ones(2, requires_grad=True)
    outs = fastdp.parallel_apply([Switches() for _ in range(3)], [(on(x, k),) for k in range(3)], None, devices(3))
    assert seen == [True] * 3 and torch.is_grad_enabled()
    for out in outs:
        torch.testing.assert_close(host(out), x * 2)


def test_parallel_apply_passes_exception():
    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    with pytest.raises(KeyError) as info:
        fastdp.parallel_apply([TestModule()], [None], None, devices(1))
    ReplicaError("KeyError", 0, "KeyError: 'wonderful'", devices(1)[0]).check(info.value)
    dp = fastdp.DataParallel(module(TestModule()), device_ids=devices(2))
    with pytest.raises(KeyError) as info:
        dp(torch.randn(4, 1))
    ReplicaError("KeyError", 0, "KeyError: 'wonderful'", devices(2)[0]).check(info.value)


def test_lowest_failing_replica_wins():
    class Net(nn.Module):
        def forward(self, x):
            k = int(x[0, 0])
            if k == 1:
                raise ValueError("from replica one")
            if k == 2:
                raise TypeError("from replica two")
            return x

    x = torch.arange(3.0).repeat_interleave(2).unsqueeze(1)
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(module(Net()), device_ids=devices(3))(x)
    ReplicaError("ValueError", 1, "ValueError: from replica one", devices(3)[1]).check(info.value)


def test_forward_hooks_on_wrapper_run_once_and_on_module_per_replica():
    m = module(nn.Linear(2, 2))
    dp = fastdp.DataParallel(m, device_ids=devices(3))
    outer, inner = [], []
    dp.register_forward_hook(lambda *a: outer.append(1))
    m.register_forward_hook(lambda *a: inner.append(1))
    dp(torch.randn(6, 2))
    assert len(outer) == 1 and len(inner) == 3
