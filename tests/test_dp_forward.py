"""fastdp.DataParallel's forward against torch.nn.DataParallel's (docs/data_parallel.md): scatter, replicate,
parallel_apply and gather called through ``self`` in upstream's order (overridden in a subclass or set on the
instance), the chunk rule that decides how many replicas run, positional, keyword, nested and zero inputs, the
containers scattered and rebuilt on the way out, and the profiler label of the forward.

Every case runs on ``["cpu"] * N`` devices; the ones marked ``gpu`` repeat it on CUDA (repeated ids on one GPU), and
the ones written with tests/_places.py run on simulated CUDA devices too (tests/test_sim_contract.py).
Results are compared with the bare module on the full batch, never with numbers typed by hand.
"""

import collections
import copy
import typing

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import Box, Point, ids
from _places import device, devices, host, module


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")

KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def dev(kind):
    return torch.device("cpu") if kind == "cpu" else torch.device("cuda", 0)


class Recorder(fastdp.DataParallel):
    """A subclass that records the overridable methods' calls (users subclass them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def scatter(self, inputs, kwargs, device_ids):
        self.calls.append(("scatter", list(device_ids)))
        return super().scatter(inputs, kwargs, device_ids)

    def replicate(self, module, device_ids):
        self.calls.append(("replicate", list(device_ids)))
        return super().replicate(module, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs):
        self.calls.append(("parallel_apply", len(replicas)))
        return super().parallel_apply(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        self.calls.append(("gather", output_device))
        return super().gather(outputs, output_device)


# ---------------------------------------------------------------- forward algorithm


@pytest.mark.parametrize("kind", KINDS)
def test_one_device_scatters_and_calls_without_replicate_or_gather(kind):
    m = nn.Linear(4, 1).to(dev(kind))
    dp = Recorder(m, device_ids=ids(kind, 1))
    x = torch.randn(6, 4, device=dev(kind), requires_grad=True)
    out = dp(x).sum()  # 0-dim stays 0-dim: no gather
    assert [c[0] for c in dp.calls] == ["scatter"]
    assert out.dim() == 0
    out.backward()
    ref = copy.deepcopy(m)
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_methods_are_called_through_self_in_order(kind):
    m = nn.Linear(4, 2).to(dev(kind))
    dp = Recorder(m, device_ids=ids(kind, 3))
    dp(torch.randn(6, 4, device=dev(kind)))
    out_dev = "cpu" if kind == "cpu" else 0
    assert dp.calls == [
        ("scatter", ids(kind, 3)),
        ("replicate", ids(kind, 3)),
        ("parallel_apply", 3),
        ("gather", out_dev),
    ]


@pytest.mark.parametrize("batch,used", [(9, 5), (10, 5), (17, 6), (1, 1), (16, 8), (0, 8)])
def test_chunk_rule_decides_replica_count(batch, used):
    m = nn.Linear(3, 2)
    ref = copy.deepcopy(m)
    dp = Recorder(module(m), device_ids=devices(8))
    x = torch.randn(batch, 3)
    out = dp(x)
    replicated = [c for c in dp.calls if c[0] == "replicate"]
    assert replicated == [("replicate", devices(8)[:used])]
    torch.testing.assert_close(host(out), ref(x))


def test_surplus_chunks_of_larger_inputs_are_dropped_like_upstream():
    class Pair(nn.Module):
        def forward(self, a, b):
            return a.sum(1, keepdim=True), b.sum(1, keepdim=True)

    dp = fastdp.DataParallel(module(Pair()), device_ids=devices(4))
    a, b = torch.randn(4, 2), torch.randn(2, 2)
    ra, rb = host(dp(a, b))
    # b gives 2 chunks, so only 2 replicas run: a's chunks 2 and 3 are dropped (zip), as upstream.
    torch.testing.assert_close(ra, a[:2].sum(1, keepdim=True))
    torch.testing.assert_close(rb, b.sum(1, keepdim=True))


class Const(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 2))

    def forward(self):
        return self.w * 2


@pytest.mark.parametrize("n", [1, 2])
def test_module_zero_inputs(n):
    m = Const()
    ref = copy.deepcopy(m)
    dp = Recorder(module(m), device_ids=devices(n))
    out = dp()
    torch.testing.assert_close(host(out), ref())
    if n > 1:
        assert ("replicate", devices(1)) in dp.calls
    for inputs in (None, ()):
        torch.testing.assert_close(host(fastdp.data_parallel(m, inputs, device_ids=devices(2))), ref())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extra", [None, [], {}, ()])
def test_module_kwargs_only(kind, dtype, extra):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(10, 5)

        def forward(self, input, unused=None):
            return self.l(input)

    m = Net().to(dev(kind), dtype)
    x = torch.randn(20, 10, device=dev(kind), dtype=dtype)
    kwargs = {"input": x} if extra is None else {"input": x, "unused": extra}
    out = fastdp.DataParallel(m, device_ids=ids(kind, 2))(**kwargs)
    assert out.device == dev(kind) and out.dtype == dtype
    torch.testing.assert_close(out, m(x))


@pytest.mark.parametrize("kind", KINDS)
def test_multiple_input(kind):
    class TestModule(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            if var3 is None:
                return float1 * (var1 * var2)
            return float1 * (var1 * var2 + var3)

    d = dev(kind)
    float1 = torch.randn(1).item()
    v1 = torch.randn(5, 5, device=d, requires_grad=True)
    v2 = torch.randn(5, 5, device=d, requires_grad=True)
    v3 = torch.randn(5, 5, device=d, requires_grad=True)
    expected_plain = float1 * (v1 * v2 + v3)
    grads = torch.autograd.grad(expected_plain.sum(), (v1, v2, v3))
    for n in (1, 2):
        for out in (
            fastdp.DataParallel(TestModule(), device_ids=ids(kind, n))(v1, v2, float1, var3=v3),
            fastdp.data_parallel(TestModule(), (v1, v2, float1), ids(kind, n), module_kwargs={"var3": v3}),
        ):
            torch.testing.assert_close(out, expected_plain.detach())
            got = torch.autograd.grad(out.sum(), (v1, v2, v3))
            for g, r in zip(got, grads):
                torch.testing.assert_close(g, r)


def test_data_parallel_small_back():
    lin = nn.Linear(10, 10)
    ref = copy.deepcopy(lin)
    x = torch.randn(20, 10)
    torch.testing.assert_close(host(fastdp.data_parallel(module(lin), x, devices(2))), ref(x))


def test_device_args_as_torch_devices():
    lin = nn.Linear(10, 10)
    ref = copy.deepcopy(lin)
    lin = module(lin)
    x = torch.randn(20, 10)
    ds = [device(d) for d in devices(2)]
    out = fastdp.DataParallel(lin, device_ids=ds, output_device=ds[0])(x)
    assert out.device == ds[0]
    torch.testing.assert_close(host(out), ref(x))
    out = fastdp.data_parallel(lin, x, device_ids=ds, output_device=ds[0])
    assert out.device == ds[0]
    torch.testing.assert_close(host(out), ref(x))


def test_nested_input():
    class Net(nn.Module):
        def forward(self, x):
            a, (b, c), d = x
            return a + b * c - d

    xs = [torch.randn(6, 3) for _ in range(4)]
    nested = (xs[0], (xs[1], xs[2]), xs[3])
    out = fastdp.DataParallel(module(Net()), device_ids=devices(3))(nested)
    torch.testing.assert_close(host(out), Net()(nested))


def test_nested_output_types_and_values():
    def fn(x):
        return [x, (x.sin(), [x.cos(), x.exp()]), collections.OrderedDict(a=x, b=[x.sin()])]

    class Net(nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.randn(7, 3)
    out = fastdp.DataParallel(module(Net()), device_ids=devices(3))(x)
    ref = fn(x)
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert isinstance(out[2], collections.OrderedDict) and list(out[2]) == ["a", "b"]
    assert isinstance(out[2]["b"], list)
    torch.testing.assert_close(host(out), ref)


class TypedPoint(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize("cls", [Point, TypedPoint])
def test_namedtuple_scatter_and_gather(cls):
    seen = []

    class Net(nn.Module):
        def forward(self, p):
            seen.append(type(p))
            return cls(p.x * 2, p.y + 1)

    p = cls(torch.randn(6, 2), torch.randn(6, 3))
    out = fastdp.DataParallel(module(Net()), device_ids=devices(3))(p)
    assert seen == [cls] * 3
    assert type(out) is cls
    torch.testing.assert_close(host(out.x), p.x * 2)
    torch.testing.assert_close(host(out.y), p.y + 1)


def test_scatter_passes_other_objects_by_reference():
    seen = []
    lengths = [3, 2, 1]
    box = Box(torch.randn(4, 2))
    empty = []
    info = {"k": "v"}

    class Net(nn.Module):
        def forward(self, x, lengths, box, empty, info, s, n):
            seen.append((lengths, box, empty, info, s, n, x.shape[0]))
            return x

    x = torch.randn(4, 2)
    fastdp.DataParallel(module(Net()), device_ids=devices(2))(x, lengths, box, empty, info, "s", 3)
    assert len(seen) == 2
    for got_lengths, got_box, got_empty, got_info, s, n, rows in seen:
        assert got_lengths == lengths and got_box is box and got_empty is empty
        assert got_info == info and s == "s" and n == 3 and rows == 2


def test_dict_inputs_are_scattered_into_same_type():
    seen = []

    class Net(nn.Module):
        def forward(self, batch):
            seen.append(type(batch))
            return batch["a"] + batch["b"]

    batch = collections.OrderedDict(a=torch.randn(4, 2), b=torch.randn(4, 2))
    out = fastdp.DataParallel(module(Net()), device_ids=devices(2))(batch)
    assert seen == [collections.OrderedDict] * 2
    torch.testing.assert_close(host(out), batch["a"] + batch["b"])


def test_scatter_along_dim_1():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.Conv1d(3, 4, 1)

        def forward(self, x):  # x: (C, B, L) → scatter along B
            return self.m(x.transpose(0, 1)).transpose(0, 1)

    net = Net()
    ref = copy.deepcopy(net)
    x = torch.randn(3, 5, 6)
    out = fastdp.DataParallel(module(net), device_ids=devices(2), dim=1)(x)
    torch.testing.assert_close(host(out), ref(x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_data_parallel_module_matches_linear(kind, dtype):
    lin = nn.Linear(10, 5).to(dev(kind), dtype)
    x = torch.randn(20, 10, device=dev(kind), dtype=dtype)
    out = fastdp.DataParallel(lin, device_ids=ids(kind, 2))(x)
    assert out.device == dev(kind)
    torch.testing.assert_close(out, lin(x))


# ---------------------------------------------------------------- a method set on the instance; the profiler label


def test_scatter_set_on_the_instance_is_called():
    """Like upstream, the forward calls self.scatter: a function set on the instance replaces the method too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    ref = copy.deepcopy(model)
    dp = fastdp.DataParallel(module(model), device_ids=devices(2))
    calls = []

    def scatter(inputs, kwargs, device_ids):
        calls.append(len(device_ids))
        return fastdp.DataParallel.scatter(dp, inputs, kwargs, device_ids)

    dp.scatter = scatter
    x = torch.randn(6, 4, dtype=torch.float64)
    assert torch.allclose(host(dp(x)), ref(x), rtol=0, atol=1e-12)
    assert calls == [2]


@pytest.mark.parametrize("n", [1, 2])
def test_forward_label_is_recorded_only_while_a_profiler_runs(n, monkeypatch):
    # The label appears in both profilers' events, as upstream's does.
    dp = fastdp.DataParallel(module(nn.Linear(3, 2)), device_ids=devices(n))
    x = torch.randn(4, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dp(x).sum().backward()
    assert "DataParallel.forward" in [e.name for e in prof.events()]
    with torch.autograd.profiler.profile() as legacy:
        dp(x)
    assert "DataParallel.forward" in [e.name for e in legacy.function_events]
    # With no profiler, record_function (about 25 µs per step) is not entered at all; under one it is, once.
    entered = []
    real = torch.autograd.profiler.record_function

    class Counting(real):
        def __enter__(self):
            entered.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Counting)
    dp(x).sum().backward()
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        dp(x)
    assert entered == ["DataParallel.forward"]
