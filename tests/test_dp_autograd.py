"""Gradients through fastdp.DataParallel against the bare module's (docs/data_parallel.md): buffers that require
grad, double backward (a gradient penalty), unused and partly used parameters, channels-last and sparse gradients,
complex parameters, and no reference cycles left by a step.

Every case runs on ``["cpu"] * N`` devices. Results are compared with the bare module on the full batch,
never with numbers typed by hand.
"""

import copy
import gc

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import ids
from _places import devices, host, module, on


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")


# ---------------------------------------------------------------- autograd


def test_buffers_requiring_grad_gradcheck():
    class TestModule(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.detach().clone())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    t = on(torch.randn(1, dtype=torch.double)).requires_grad_()
    m = TestModule(t)
    dp = fastdp.DataParallel(m, device_ids=devices(2))

    def fn(t):
        m.t_rg = t  # re-registered as the buffer each call
        return dp(torch.ones(4, 1, dtype=torch.double))

    torch.autograd.gradcheck(fn, (t,))


def test_double_backward_gradient_penalty():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    ref = copy.deepcopy(m)
    m = module(m)
    x = torch.randn(7, 3, dtype=torch.double)
    dp = fastdp.DataParallel(m, device_ids=devices(3))

    def penalty(model, params):
        xi = x.clone().requires_grad_()
        out = model(xi).sum()
        (g,) = torch.autograd.grad(out, xi, create_graph=True)
        gp = g.pow(2).sum()
        return gp, torch.autograd.grad(gp, params, allow_unused=True)

    got_gp, got = penalty(dp, list(m.parameters()))
    exp_gp, exp = penalty(ref, list(ref.parameters()))
    torch.testing.assert_close(host(got_gp), exp_gp)
    for g, e in zip(got, exp):
        assert (g is None) == (e is None)  # the last bias does not affect the input gradient
        if e is not None:
            torch.testing.assert_close(host(g), e)
    # Through the parameters' own graph, too (ReduceAddCoalesced's backward broadcasts).
    gw = torch.autograd.grad(dp(x).sum(), list(m.parameters()), create_graph=True)
    ew = torch.autograd.grad(ref(x).sum(), list(ref.parameters()), create_graph=True)
    hp = torch.autograd.grad(sum(g.pow(2).sum() for g in gw), list(m.parameters()), allow_unused=True)
    he = torch.autograd.grad(sum(g.pow(2).sum() for g in ew), list(ref.parameters()), allow_unused=True)
    for a, b in zip(hp, he):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(host(a), b)


def test_unused_parameters_keep_grad_none_partially_used_get_sums():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)
            self.sometimes = nn.Linear(2, 2)
            self.frozen = nn.Linear(2, 2)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            y = self.frozen(self.used(x))
            if x[0, 0] > 0:  # only replica 0's chunk
                y = y + self.sometimes(x)
            return y

    m = Net()
    ref = copy.deepcopy(m)
    m = module(m)
    x = torch.randn(4, 2)
    x[:2, 0] = 1.0
    x[2:, 0] = -1.0
    fastdp.DataParallel(m, device_ids=devices(2))(x).sum().backward()
    assert m.unused.weight.grad is None  # deliberate: upstream reduces zeros here
    assert m.frozen.weight.grad is None
    (ref.frozen(ref.used(x)) + torch.cat([ref.sometimes(x[:2]), torch.zeros(2, 2)])).sum().backward()
    torch.testing.assert_close(host(m.sometimes.weight.grad), ref.sometimes.weight.grad)
    torch.testing.assert_close(host(m.used.weight.grad), ref.used.weight.grad)


def test_strided_grad_layout_channels_last():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(m)
    m = module(m)
    x = torch.randn(5, 3, 6, 6).to(memory_format=torch.channels_last)
    dp = fastdp.DataParallel(m, device_ids=devices(2))
    for _ in range(2):
        dp(x).sum().backward()
        ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(host(p.grad), q.grad, rtol=1e-5, atol=1e-5)
        if p.dim() == 4:
            assert p.grad.is_contiguous(memory_format=torch.channels_last) == p.is_contiguous(
                memory_format=torch.channels_last
            )


def test_sparse_embedding_grads():
    torch.manual_seed(0)
    m = nn.Embedding(10, 3, sparse=True)
    ref = copy.deepcopy(m)
    idx = torch.randint(0, 10, (8, 2))
    fastdp.DataParallel(m, device_ids=ids("cpu", 2))(idx).sum().backward()
    ref(idx).sum().backward()
    torch.testing.assert_close(m.weight.grad.coalesce().to_dense(), ref.weight.grad.coalesce().to_dense())


def test_complex_parameters_and_inputs_stay_complex():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, dtype=torch.cfloat))

        def forward(self, x):
            return x * self.w

    m = Net()
    ref = copy.deepcopy(m)
    m = module(m)
    x = torch.randn(4, 10, dtype=torch.cfloat)
    out = fastdp.DataParallel(m, device_ids=devices(2))(x)
    assert out.dtype == torch.cfloat and out.shape == (4, 10)  # released upstream: a real view [.., 2]
    torch.testing.assert_close(host(out), ref(x))
    out.abs().sum().backward()
    ref(x).abs().sum().backward()
    torch.testing.assert_close(host(m.w.grad), ref.w.grad)


# ---------------------------------------------------------------- reference cycles


def test_no_reference_cycles():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    warm = fastdp.DataParallel(module(Model()), device_ids=devices(2))
    warm(torch.randn(2, 1)).sum().backward()
    del warm
    gc.collect()
    model = fastdp.DataParallel(module(Model()), device_ids=devices(2))
    out = model(torch.randn(4, 1))
    out.sum().backward()
    del out
    assert gc.collect() == 0
