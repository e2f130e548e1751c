"""Conformance of fastdp.DataParallel with torch.nn.DataParallel (contract §1-§3, §6.1) on emulated replicas.

Every case runs on ``["cpu"] * N`` devices; the ones marked ``gpu`` repeat it on CUDA (repeated ids on one GPU).
Results are compared with the bare module on the full batch, never with numbers typed by hand.
"""

import collections
import copy
import dataclasses
import gc
import io
import re
import threading
import typing
import warnings

import pytest
import torch
import torch.nn as nn

import fastdp

from _replica_errors import ReplicaError

# Upstream's text for a parameter or buffer off device_ids[0] (torch.nn.DataParallel.forward; it needs CUDA to say it).
MODULE_DEVICE = ("module must have its parameters and buffers on device {} (device_ids[0]) but found one of them on "
                 "device: {}")


# Upstream's text (its Gather needs CUDA to say it).
SCALARS_WARNING = ("Was asked to gather along dimension 0, but all input tensors were scalars; "
                   "will instead unsqueeze and return a vector.")

def _upstream_minus_one_warning():
    """The FutureWarning upstream's comm.gather gives for destination=-1 (what follows it may fail without CUDA)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            torch.nn.parallel.comm.gather([torch.zeros(1)], destination=-1)
        except Exception:
            pass
    (warning,) = [w for w in seen if w.category is FutureWarning]
    return str(warning.message)

# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")

KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def ids(kind, n):
    """n emulated replicas: distinct "cpu" entries, or CUDA device 0 repeated."""
    return ["cpu"] * n if kind == "cpu" else [0] * n


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


# ---------------------------------------------------------------- constructor and devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="pass-through applies only without a GPU")
def test_pass_through_without_gpu():
    m = nn.Linear(3, 2)
    dp = fastdp.DataParallel(m)
    assert dp.device_ids == []
    assert dp.module is m
    for name in ("dim", "output_device", "src_device_obj"):
        with pytest.raises(AttributeError):
            getattr(dp, name)
    seen = []
    m.register_forward_hook(lambda mod, i, o: seen.append(threading.current_thread()))
    x = torch.randn(5, 3)
    assert torch.equal(dp(x), m(x))
    assert seen[0] is threading.current_thread()
    # Upstream ignores CUDA device_ids without a GPU, too.
    assert fastdp.DataParallel(m, device_ids=[0, 1]).device_ids == []


def test_cpu_device_forms_are_normalised():
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=["cpu", torch.device("cpu"), "cpu:0"], dim=1)
    assert dp.device_ids == ["cpu", "cpu", "cpu"]
    assert dp.output_device == "cpu"
    assert dp.src_device_obj == torch.device("cpu")
    assert dp.dim == 1
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=("cpu", "cpu"), output_device=torch.device("cpu"))
    assert dp.output_device == "cpu"


def test_mixed_cpu_and_cuda_ids_raise():
    for device_ids in (["cpu", 0], [torch.device("cuda", 0), "cpu"]):
        with pytest.raises(ValueError) as info:
            fastdp.DataParallel(nn.Linear(3, 2), device_ids=device_ids)
        assert str(info.value) == (
            f"device_ids mixes 'cpu' entries with CUDA devices ({device_ids!r}). fastdp emulates replicas on the host "
            "only when every entry is 'cpu': pass device_ids=['cpu'] * N for emulated replicas, or CUDA device "
            "indices only (e.g. [0, 1])."
        )


def test_cuda_output_device_with_cpu_ids_raises():
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(nn.Linear(3, 2), device_ids=["cpu", "cpu"], output_device=0)
    assert str(info.value) == ("output_device=0 is a CUDA device but device_ids are emulated 'cpu' replicas; with "
                               "'cpu' device_ids leave output_device unset or pass 'cpu'")


def test_non_indexable_device_ids_raise_type_error():
    for device_ids in ({"cpu"}, (d for d in ["cpu", "cpu"])):
        with pytest.raises(TypeError) as info:
            fastdp.DataParallel(nn.Linear(3, 2), device_ids=device_ids)
        assert str(info.value) == ("device_ids must be a list or tuple of devices (DataParallel reads device_ids[0]), "
                                   f"got {type(device_ids).__name__} {device_ids!r}")


def test_unknown_device_string_raises_torchs_error():
    with pytest.raises(RuntimeError) as expected:
        torch.device("tpu:0")
    with pytest.raises(RuntimeError) as got:
        fastdp.DataParallel(nn.Linear(3, 2), device_ids=["cpu", "tpu:0"])
    assert str(got.value) == str(expected.value)


@pytest.mark.gpu
def test_cuda_constructor_defaults_match_upstream():
    m = nn.Linear(3, 2)
    ours = fastdp.DataParallel(copy.deepcopy(m))
    theirs = nn.DataParallel(copy.deepcopy(m))
    assert ours.device_ids == theirs.device_ids
    assert ours.output_device == theirs.output_device
    assert ours.src_device_obj == theirs.src_device_obj
    with pytest.raises(IndexError):
        fastdp.DataParallel(m, device_ids=[])
    # Deliberate: output_device='cpu' is accepted (upstream raises, yet accepts the deprecated -1).
    assert fastdp.DataParallel(copy.deepcopy(m), device_ids=[0, 0], output_device="cpu").output_device == "cpu"
    dp = fastdp.DataParallel(m, device_ids=[torch.device("cuda:0")], output_device="cuda:0")
    assert dp.device_ids == [0] and dp.output_device == 0
    assert next(m.parameters()).is_cuda  # one device: moved in __init__


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
    dp = Recorder(m, device_ids=ids("cpu", 8))
    x = torch.randn(batch, 3)
    out = dp(x)
    replicated = [c for c in dp.calls if c[0] == "replicate"]
    if used == 1:
        assert replicated == [("replicate", ["cpu"])]
    else:
        assert replicated == [("replicate", ["cpu"] * used)]
    torch.testing.assert_close(out, m(x))


def test_surplus_chunks_of_larger_inputs_are_dropped_like_upstream():
    class Pair(nn.Module):
        def forward(self, a, b):
            return a.sum(1, keepdim=True), b.sum(1, keepdim=True)

    dp = fastdp.DataParallel(Pair(), device_ids=ids("cpu", 4))
    a, b = torch.randn(4, 2), torch.randn(2, 2)
    ra, rb = dp(a, b)
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
    dp = Recorder(m, device_ids=ids("cpu", n))
    out = dp()
    torch.testing.assert_close(out, m())
    if n > 1:
        assert ("replicate", ["cpu"]) in dp.calls
    for inputs in (None, ()):
        torch.testing.assert_close(fastdp.data_parallel(m, inputs, device_ids=ids("cpu", 2)), m())


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
    x = torch.randn(20, 10)
    torch.testing.assert_close(fastdp.data_parallel(lin, x, ["cpu", "cpu"]), lin(x))


def test_device_args_as_torch_devices():
    lin = nn.Linear(10, 10)
    x = torch.randn(20, 10)
    cpu = torch.device("cpu")
    out = fastdp.DataParallel(lin, device_ids=[cpu, cpu], output_device=cpu)(x)
    torch.testing.assert_close(out, lin(x))
    out = fastdp.data_parallel(lin, x, device_ids=[cpu, cpu], output_device=cpu)
    torch.testing.assert_close(out, lin(x))


def test_nested_input():
    class Net(nn.Module):
        def forward(self, x):
            a, (b, c), d = x
            return a + b * c - d

    xs = [torch.randn(6, 3) for _ in range(4)]
    nested = (xs[0], (xs[1], xs[2]), xs[3])
    out = fastdp.DataParallel(Net(), device_ids=ids("cpu", 3))(nested)
    torch.testing.assert_close(out, Net()(nested))


def test_nested_output_types_and_values():
    def fn(x):
        return [x, (x.sin(), [x.cos(), x.exp()]), collections.OrderedDict(a=x, b=[x.sin()])]

    class Net(nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.randn(7, 3)
    out = fastdp.DataParallel(Net(), device_ids=ids("cpu", 3))(x)
    ref = fn(x)
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert isinstance(out[2], collections.OrderedDict) and list(out[2]) == ["a", "b"]
    assert isinstance(out[2]["b"], list)
    torch.testing.assert_close(out, ref)


Point = collections.namedtuple("Point", "x y")


class TypedPoint(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Box:
    t: torch.Tensor


@pytest.mark.parametrize("cls", [Point, TypedPoint])
def test_namedtuple_scatter_and_gather(cls):
    seen = []

    class Net(nn.Module):
        def forward(self, p):
            seen.append(type(p))
            return cls(p.x * 2, p.y + 1)

    p = cls(torch.randn(6, 2), torch.randn(6, 3))
    out = fastdp.DataParallel(Net(), device_ids=ids("cpu", 3))(p)
    assert seen == [cls] * 3
    assert type(out) is cls
    torch.testing.assert_close(out.x, p.x * 2)
    torch.testing.assert_close(out.y, p.y + 1)


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
    fastdp.DataParallel(Net(), device_ids=ids("cpu", 2))(x, lengths, box, empty, info, "s", 3)
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
    out = fastdp.DataParallel(Net(), device_ids=ids("cpu", 2))(batch)
    assert seen == [collections.OrderedDict] * 2
    torch.testing.assert_close(out, batch["a"] + batch["b"])


def test_scatter_along_dim_1():
    m = nn.Conv1d(3, 4, 1)

    class Net(nn.Module):
        def forward(self, x):  # x: (C, B, L) → scatter along B
            return m(x.transpose(0, 1)).transpose(0, 1)

    x = torch.randn(3, 5, 6)
    out = fastdp.DataParallel(Net(), device_ids=ids("cpu", 2), dim=1)(x)
    torch.testing.assert_close(out, Net()(x))


# ---------------------------------------------------------------- scatter_kwargs / gather rules


def test_scatter_kwargs_pads_the_shorter_list():
    x = torch.randn(4, 2)
    y = torch.randn(2, 2)
    inputs, kwargs = fastdp.scatter_kwargs((x,), {"y": y}, ["cpu"] * 4)
    # Current upstream compares len(kwargs) with len(inputs) (the unscattered tuple) and leaves kwargs short here.
    assert len(inputs) == len(kwargs) == 4
    assert kwargs[2] == {} and kwargs[3] == {}
    inputs, kwargs = fastdp.scatter_kwargs((y,), {"x": x}, ["cpu"] * 4)
    assert len(inputs) == len(kwargs) == 4 and inputs[3] == ()
    assert fastdp.scatter_kwargs((), {}, ["cpu"] * 2) == ((), ())


def test_gather_scalars_become_a_vector_with_upstream_warning():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(3, 1)

        def forward(self, x):
            return self.l(x).pow(2).mean()

    m = Net()
    x = torch.randn(6, 3)
    with pytest.warns(UserWarning, match="^" + re.escape(SCALARS_WARNING) + "$"):
        out = fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x)
    assert out.shape == (2,)
    torch.testing.assert_close(out, torch.stack([m(x[:3]), m(x[3:])]))
    out.sum().backward()
    ref = copy.deepcopy(m)
    ref.zero_grad()
    (ref(x[:3]) + ref(x[3:])).backward()
    torch.testing.assert_close(m.l.weight.grad, ref.l.weight.grad)


def test_output_device_minus_one_gathers_to_cpu_with_future_warning():
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=ids("cpu", 2), output_device=-1)
    assert dp.output_device == -1
    with pytest.warns(FutureWarning, match="^" + re.escape(_upstream_minus_one_warning()) + "$"):
        out = dp(torch.randn(4, 3))
    assert out.device.type == "cpu"


class Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


def _upstream_gather_error(outputs):
    """The message of the error upstream's gather raises for these outputs (on the host)."""
    try:
        torch.nn.parallel.gather(outputs, target_device="cpu")
    except (TypeError, ValueError) as e:
        return str(e)
    raise AssertionError("upstream gathered them")


_NOT_GATHERED = ("Cannot gather {} of type {}: DataParallel gathers tensors, None, and tuples, lists, dicts and "
                 "namedtuples of them, and rebuilds other iterables from their gathered items. Return a tensor instead "
                 "(e.g. torch.tensor(value)), or keep such values out of forward's output.")


@pytest.mark.parametrize(
    "make,exc,message",
    [
        (lambda x: {f"k{int(x[0, 0])}": x} if int(x[0, 0]) else {"a": x, "b": x}, ValueError,
         _upstream_gather_error(({"a": torch.zeros(1), "b": torch.zeros(1)}, {"k1": torch.zeros(1)}))),
        (lambda x: {f"k{int(x[0, 0])}": x}, ValueError,
         "All dicts must have the same keys: at output, replica 1 lacks ['k0'] (replica 0 has ['k0'], replica 1 has "
         "['k1'])"),
        (lambda x: "label", TypeError, _NOT_GATHERED.format("output", "str")),
        (lambda x: (x, 3), TypeError, _NOT_GATHERED.format("output[1]", "int")),
        (lambda x: Box(x), TypeError, _NOT_GATHERED.format("output", "Box")),
        (lambda x: [x] * (1 + int(x[0, 0])), ValueError,
         "Cannot gather output: replica 0 returned a list of 1 elements but replica 1 returned 2"),
        (lambda x: x if int(x[0, 0]) == 0 else None, TypeError,
         "Cannot gather output: replica 0 returned a Tensor but replica 1 returned NoneType"),
    ],
)
def test_outputs_that_cannot_be_gathered(make, exc, message):
    x = torch.zeros(4, 3)
    x[2:, 0] = 1  # replica 0 sees 0, replica 1 sees 1
    x[:2, 1:] = 5
    with pytest.raises(exc) as info:
        fastdp.DataParallel(Returns(make), device_ids=ids("cpu", 2))(x)
    assert str(info.value) == message


def test_outputs_of_different_shapes_cannot_be_gathered():
    x = torch.zeros(4, 3)
    x[2:, 0] = 1
    x[:2, 1:] = 5
    with pytest.raises(RuntimeError) as info:  # the core's check (comm), with the shapes it compared
        fastdp.DataParallel(Returns(lambda x: x[:, : int(x[0, 0])]), device_ids=ids("cpu", 2))(x)
    shapes = [list(x[:2, :int(x[0, 0])].shape), list(x[2:, :int(x[2, 0])].shape)]
    # Upstream's type; the message names the output and the sizes, then gives the core's text.
    assert str(info.value).startswith("Cannot gather output: its size along dim 1 differs across replicas (0, 1)")
    assert str(info.value).endswith(f"(Input tensor at index 1 has invalid shape {shapes[1]}, but expected "
                                    f"{shapes[0]} (all dimensions but 0 must match input 0))")


def test_gather_of_none_is_none():
    assert fastdp.DataParallel(Returns(lambda x: None), device_ids=ids("cpu", 2))(torch.randn(4, 1)) is None


def test_gather_different_len_dicts_functional():
    inputs = ({"a": torch.randn(1, 2)}, {"b": torch.randn(1, 2), "a": torch.randn(1, 2)})
    with pytest.raises(ValueError) as reference:
        torch.nn.parallel.gather(inputs, target_device="cpu")
    with pytest.raises(ValueError) as info:
        fastdp.gather(inputs, target_device="cpu")
    assert str(info.value) == str(reference.value)


def test_gather_namedtuple_functional():
    outs = [Point(torch.randn(2, 2), torch.randn(2)), Point(torch.randn(3, 2), torch.randn(3))]
    got = fastdp.gather(outs, "cpu")
    assert type(got) is Point
    torch.testing.assert_close(got.x, torch.cat([outs[0].x, outs[1].x]))


# ---------------------------------------------------------------- scatter / gather autograd (upstream 19, 22)


def test_scatter_cpu():
    dp = fastdp.DataParallel(nn.Linear(1, 1), device_ids=ids("cpu", 2))
    x = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    (a,), (b,) = dp.scatter((x,), None, ["cpu", "cpu"])[0]
    torch.testing.assert_close(a, x[:2])
    torch.testing.assert_close(b, x[2:])
    assert a.data_ptr() == x.data_ptr()  # entry 0 holds the source: a view
    assert b.data_ptr() != x.data_ptr()
    grad = torch.randn(4, 4, dtype=torch.double)
    torch.autograd.backward([a, b], [grad[:2], grad[2:]])
    torch.testing.assert_close(x.grad, grad)

    def fn(t):
        return torch.cat(fastdp.scatter((t,), ["cpu", "cpu"])[0] + fastdp.scatter((t,), ["cpu", "cpu"])[1])

    torch.autograd.gradcheck(fn, (x.detach().requires_grad_(),))
    torch.autograd.gradgradcheck(fn, (x.detach().requires_grad_(),))


def test_gather_cpu():
    a = torch.randn(2, 5, dtype=torch.double, requires_grad=True)
    b = torch.randn(2, 5, dtype=torch.double, requires_grad=True)
    out = fastdp.gather((a, b), "cpu")
    torch.testing.assert_close(out, torch.cat([a, b]))
    assert not out.is_cuda
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(a.grad, torch.ones_like(a))
    torch.autograd.gradcheck(lambda x, y: fastdp.gather((x, y), "cpu"), (a, b))
    torch.autograd.gradgradcheck(lambda x, y: fastdp.gather((x, y), "cpu"), (a, b))
    sa = torch.randn((), dtype=torch.double, requires_grad=True)
    sb = torch.randn((), dtype=torch.double, requires_grad=True)
    with pytest.warns(UserWarning, match="^" + re.escape(SCALARS_WARNING) + "$"):
        v = fastdp.gather((sa, sb), "cpu")
    assert v.shape == (2,)
    v.backward(torch.tensor([2.0, 3.0], dtype=torch.double))
    assert sa.grad.item() == 2.0 and sb.grad.item() == 3.0


# ---------------------------------------------------------------- replication


def test_replicate_storage_sharing_and_parameters_inside_replicas():
    m = nn.Linear(4, 3)
    replicas = fastdp.replicate(m, ["cpu"] * 3)
    assert len(replicas) == 3
    x = torch.randn(5, 4)
    for k, r in enumerate(replicas):
        assert r._is_replica
        params = list(r.parameters())  # deliberate: upstream yields nothing here
        assert len(params) == 2
        for p, master in zip(params, m.parameters()):
            assert p.requires_grad and p.grad_fn is not None and not isinstance(p, nn.Parameter)
            torch.testing.assert_close(p, master)
            assert (p.data_ptr() == master.data_ptr()) == (k == 0)
        torch.testing.assert_close(r(x), m(x))
    detached = fastdp.replicate(m, ["cpu"] * 2, detach=True)
    assert detached[0].weight is m.weight
    assert not detached[1].weight.requires_grad
    assert detached[1].weight.data_ptr() != m.weight.data_ptr()


def test_replicate_accepts_any_iterable_and_tuple():
    m = nn.Linear(2, 2)
    assert len(fastdp.replicate(m, ("cpu", "cpu"))) == 2
    assert len(fastdp.replicate(m, iter(["cpu", "cpu", "cpu"]))) == 3


def test_replicate_buffers_and_batchnorm_chunk0_semantics():
    bn = nn.BatchNorm1d(3)
    ref = copy.deepcopy(bn)
    x = torch.randn(8, 3) * 3 + 1
    for r in fastdp.replicate(bn, ["cpu"] * 2):
        assert r.running_mean.device.type == "cpu" and r.num_batches_tracked.dtype == torch.long
    dp = fastdp.DataParallel(bn, device_ids=ids("cpu", 2))
    out = dp(x)
    # Each chunk is normalised with its own statistics; running stats come from chunk 0 only.
    ref1 = copy.deepcopy(ref)
    expected = torch.cat([ref(x[:4]), ref1(x[4:])])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == 1


def test_shared_submodules_and_tied_weights_stay_shared():
    emb = nn.Embedding(10, 4)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = emb
            self.b = emb
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = emb.weight

        def forward(self, idx):
            return self.out(self.a(idx) + self.b(idx))

    m = Tied()
    for r in fastdp.replicate(m, ["cpu"] * 2):
        assert r.a is r.b
        assert r.out.weight is r.a.weight
    idx = torch.randint(0, 10, (6,))
    ref = copy.deepcopy(m)
    fastdp.DataParallel(m, device_ids=ids("cpu", 3))(idx).sum().backward()
    ref(idx).sum().backward()
    torch.testing.assert_close(m.a.weight.grad, ref.a.weight.grad)


def test_save_replica_module():
    m = nn.Linear(3, 2)
    for detach in (False, True):
        for r in fastdp.replicate(m, ["cpu"] * 2, detach=detach):
            torch.save(r, io.BytesIO())


def test_parameter_list_and_dict_inside_replica():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.plist = nn.ParameterList([nn.Parameter(torch.randn(2, 2)) for _ in range(2)])
            self.pdict = nn.ParameterDict({"a": nn.Parameter(torch.randn(2, 2))})

        def forward(self, x):
            checks.append(all(p.requires_grad and p.grad_fn is not None for p in [*self.plist, self.pdict["a"]]))
            return x @ self.plist[0] @ self.plist[1] @ self.pdict["a"]

    checks = []
    m = Net()
    x = torch.randn(4, 2)
    out = fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x)
    assert checks == [True, True]
    torch.testing.assert_close(out, m(x))


def test_zero_grad_inside_replica_warns_upstream_text():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(2, 2)

        def forward(self, x):
            self.zero_grad()
            return self.l(x)

    replica = nn.Linear(1, 1)
    replica._is_replica = True
    with pytest.warns(UserWarning) as upstream:  # torch's own text, from a module marked as a replica
        replica.zero_grad()
    with pytest.warns(UserWarning, match="^" + re.escape(str(upstream[0].message)) + "$"):
        fastdp.DataParallel(Net(), device_ids=ids("cpu", 2))(torch.randn(4, 2))


def test_rnn_flatten_parameters_no_grad_and_one_step():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)[0]

    torch.manual_seed(0)
    m = Net().double()
    ref = copy.deepcopy(m)
    x = torch.randn(6, 3, 4, dtype=torch.double)
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    with torch.no_grad():
        torch.testing.assert_close(dp(x), ref(x))
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_lazy_linear_raises():
    dp = fastdp.DataParallel(nn.LazyLinear(10), device_ids=ids("cpu", 2))
    with pytest.raises(ValueError) as info:
        dp(torch.randn(4, 3))
    with pytest.raises(ValueError) as upstream:  # torch's own text, naming fastdp's function
        nn.UninitializedParameter.__torch_function__("fastdp.replicate", (), ())
    assert str(info.value) == str(upstream.value)


def test_script_module_replicates():
    scripted = torch.jit.script(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    replicas = fastdp.replicate(scripted, ["cpu", "cpu"])
    for r in replicas:
        torch.testing.assert_close(r(x), scripted(x))
    torch.testing.assert_close(fastdp.DataParallel(scripted, device_ids=ids("cpu", 2))(x), scripted(x))


def test_python_module_wrapping_script_module():
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.jit.script(nn.Linear(3, 2))

        def forward(self, x):
            return self.inner(x)

    m = Wrap()
    x = torch.randn(4, 3)
    torch.testing.assert_close(fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x), m(x))


# ---------------------------------------------------------------- autograd


def test_buffers_requiring_grad_gradcheck():
    class TestModule(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.detach().clone())

        def forward(self, x):
            return x * self.t_rg + self.t_not_rg

    t = torch.randn(1, dtype=torch.double, requires_grad=True)
    m = TestModule(t)
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))

    def fn(t):
        m.t_rg = t  # re-registered as the buffer each call
        return dp(torch.ones(4, 1, dtype=torch.double))

    torch.autograd.gradcheck(fn, (t,))


def test_double_backward_gradient_penalty():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    ref = copy.deepcopy(m)
    x = torch.randn(7, 3, dtype=torch.double)
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 3))

    def penalty(model, params):
        xi = x.clone().requires_grad_()
        out = model(xi).sum()
        (g,) = torch.autograd.grad(out, xi, create_graph=True)
        gp = g.pow(2).sum()
        return gp, torch.autograd.grad(gp, params, allow_unused=True)

    got_gp, got = penalty(dp, list(m.parameters()))
    exp_gp, exp = penalty(ref, list(ref.parameters()))
    torch.testing.assert_close(got_gp, exp_gp)
    for g, e in zip(got, exp):
        assert (g is None) == (e is None)  # the last bias does not affect the input gradient
        if e is not None:
            torch.testing.assert_close(g, e)
    # Through the parameters' own graph, too (ReduceAddCoalesced's backward broadcasts).
    gw = torch.autograd.grad(dp(x).sum(), list(m.parameters()), create_graph=True)
    ew = torch.autograd.grad(ref(x).sum(), list(ref.parameters()), create_graph=True)
    hp = torch.autograd.grad(sum(g.pow(2).sum() for g in gw), list(m.parameters()), allow_unused=True)
    he = torch.autograd.grad(sum(g.pow(2).sum() for g in ew), list(ref.parameters()), allow_unused=True)
    for a, b in zip(hp, he):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, b)


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
    x = torch.randn(4, 2)
    x[:2, 0] = 1.0
    x[2:, 0] = -1.0
    fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x).sum().backward()
    assert m.unused.weight.grad is None  # deliberate: upstream reduces zeros here
    assert m.frozen.weight.grad is None
    ref = copy.deepcopy(m)
    for p in ref.parameters():
        p.grad = None
    (ref.frozen(ref.used(x)) + torch.cat([ref.sometimes(x[:2]), torch.zeros(2, 2)])).sum().backward()
    torch.testing.assert_close(m.sometimes.weight.grad, ref.sometimes.weight.grad)
    torch.testing.assert_close(m.used.weight.grad, ref.used.weight.grad)


def test_strided_grad_layout_channels_last():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(m)
    x = torch.randn(5, 3, 6, 6).to(memory_format=torch.channels_last)
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    for _ in range(2):
        dp(x).sum().backward()
        ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
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
    x = torch.randn(4, 10, dtype=torch.cfloat)
    out = fastdp.DataParallel(m, device_ids=ids("cpu", 2))(x)
    assert out.dtype == torch.cfloat and out.shape == (4, 10)  # released upstream: a real view [.., 2]
    torch.testing.assert_close(out, m(x))
    out.abs().sum().backward()
    ref = copy.deepcopy(m)
    ref.w.grad = None
    ref(x).abs().sum().backward()
    torch.testing.assert_close(m.w.grad, ref.w.grad)


# ---------------------------------------------------------------- worker context


def test_grad_mode_reaches_replicas():
    modes = []

    class Net(nn.Module):
        def forward(self, x):
            modes.append(torch.is_grad_enabled())
            return x

    dp = fastdp.DataParallel(Net(), device_ids=ids("cpu", 2))
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
    for inputs in ((i1, i2), ((i1,), (i2,))):
        outputs = fastdp.parallel_apply((l1, l2), inputs, None, ["cpu", "cpu"])
        for out, exp in zip(outputs, expected):
            torch.testing.assert_close(out, exp)
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
    outs = fastdp.parallel_apply([Switches() for _ in range(3)], [(x,)] * 3, None, ["cpu"] * 3)
    assert seen == [True] * 3 and torch.is_grad_enabled()
    for out in outs:
        torch.testing.assert_close(out, x * 2)


def test_parallel_apply_passes_exception():
    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    with pytest.raises(KeyError) as info:
        fastdp.parallel_apply([TestModule()], [None], None, ["cpu"])
    ReplicaError("KeyError", 0, "KeyError: 'wonderful'").check(info.value)
    dp = fastdp.DataParallel(TestModule(), device_ids=ids("cpu", 2))
    with pytest.raises(KeyError) as info:
        dp(torch.randn(4, 1))
    ReplicaError("KeyError", 0, "KeyError: 'wonderful'").check(info.value)


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
        fastdp.DataParallel(Net(), device_ids=ids("cpu", 3))(x)
    ReplicaError("ValueError", 1, "ValueError: from replica one").check(info.value)


def test_forward_hooks_on_wrapper_run_once_and_on_module_per_replica():
    m = nn.Linear(2, 2)
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 3))
    outer, inner = [], []
    dp.register_forward_hook(lambda *a: outer.append(1))
    m.register_forward_hook(lambda *a: inner.append(1))
    dp(torch.randn(6, 2))
    assert len(outer) == 1 and len(inner) == 3


# ---------------------------------------------------------------- device check, refcycles


def test_parameters_on_wrong_device_raise_upstream_message():
    m = nn.Linear(2, 2)
    m.register_buffer("stray", torch.empty(1, device="meta"))
    for n in (1, 2):
        dp = fastdp.DataParallel(nn.Identity(), device_ids=ids("cpu", n))
        dp.module = m  # after construction (one device moves the module in __init__)
        with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "meta")) + "$"):
            dp(torch.randn(2, 2))
    with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "meta")) + "$"):
        fastdp.data_parallel(m, torch.randn(2, 2), ["cpu", "cpu"])


@pytest.mark.parametrize("n", [1, 2])
def test_forward_label_is_recorded_only_while_a_profiler_runs(n, monkeypatch):
    # The label appears in both profilers' events, as upstream's does.
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=ids("cpu", n))
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


@pytest.mark.gpu
def test_cuda_module_with_cpu_replicas_and_back():
    m = nn.Linear(2, 2).cuda()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "cuda:0")) + "$"):
        dp(torch.randn(2, 2))


def test_no_reference_cycles():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    warm = fastdp.DataParallel(Model(), device_ids=ids("cpu", 2))
    warm(torch.randn(2, 1)).sum().backward()
    del warm
    gc.collect()
    model = fastdp.DataParallel(Model(), device_ids=ids("cpu", 2))
    out = model(torch.randn(4, 1))
    out.sum().backward()
    del out
    assert gc.collect() == 0


# ---------------------------------------------------------------- checkpoints


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def test_state_dict_has_no_prefix_and_equals_module_state_dict():
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    sd, msd = dp.state_dict(), m.state_dict()
    assert list(sd) == list(msd)
    for k in sd:
        assert torch.equal(sd[k], msd[k])
    assert sd._metadata == msd._metadata
    bare = _model()
    for p in bare.parameters():
        p.data.add_(1)
    bare.load_state_dict(sd, strict=True)
    x = torch.randn(5, 3)
    bare.eval()
    m.eval()
    torch.testing.assert_close(bare(x), m(x))


@pytest.mark.parametrize("form", ["plain", "prefixed"])
def test_load_state_dict_accepts_both_forms(form):
    src = _model()
    for p in src.parameters():
        p.data.mul_(2)
    sd = src.state_dict() if form == "plain" else nn.DataParallel(src).state_dict()
    if form == "prefixed":
        assert all(k.startswith("module.") for k in sd)
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    result = dp.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)


@pytest.mark.parametrize("form", ["plain", "prefixed"])
def test_load_state_dict_strict_errors_name_plain_keys(form):
    sd = _model().state_dict()
    del sd["0.bias"]
    sd["extra.weight"] = torch.zeros(1)
    if form == "prefixed":
        sd = collections.OrderedDict(("module." + k, v) for k, v in sd.items())
    dp = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2))
    with pytest.raises(RuntimeError) as info:
        dp.load_state_dict(sd)
    with pytest.raises(RuntimeError) as bare:  # the bare model's text for the same keys, without the prefix
        _model().load_state_dict(collections.OrderedDict((k.removeprefix("module."), v) for k, v in sd.items()))
    assert str(info.value) == str(bare.value)
    result = dp.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["extra.weight"]


def test_wrapped_module_with_child_named_module():
    inner = nn.DataParallel(nn.Linear(2, 2))  # its own keys start with "module."
    dp = fastdp.DataParallel(inner, device_ids=ids("cpu", 2))
    assert list(dp.state_dict()) == ["module.weight", "module.bias"]
    src = nn.DataParallel(nn.Linear(2, 2))
    assert dp.load_state_dict(src.state_dict()).missing_keys == []
    assert torch.equal(inner.module.weight, src.module.weight)
    wrapped_twice = nn.DataParallel(nn.DataParallel(nn.Linear(2, 2)))
    dp.load_state_dict(wrapped_twice.state_dict())
    assert torch.equal(inner.module.weight, wrapped_twice.module.module.weight)


def test_wrapper_nested_in_another_module_round_trips():
    class Outer(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.head = nn.Linear(2, 1)

    a = Outer(fastdp.DataParallel(_model(), device_ids=ids("cpu", 2)))
    sd = a.state_dict()
    assert "net.0.weight" in sd and not any(".module." in k for k in sd)
    b = Outer(fastdp.DataParallel(_model(), device_ids=ids("cpu", 2)))
    for p in b.parameters():
        p.data.zero_()
    b.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(b.state_dict()[k], v)
    upstream = Outer(nn.DataParallel(_model()))  # "net.module.0.weight" keys load too
    b.load_state_dict(upstream.state_dict())
    assert torch.equal(b.net.module[0].weight, upstream.net.module[0].weight)


def test_checkpoint_file_round_trip(tmp_path):
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    dp(torch.randn(6, 3)).sum().backward()
    torch.save(dp.state_dict(), tmp_path / "ckpt.pt")
    bare = _model()
    bare.load_state_dict(torch.load(tmp_path / "ckpt.pt"), strict=True)
    for k, v in m.state_dict().items():
        assert torch.equal(bare.state_dict()[k], v)


# ---------------------------------------------------------------- attribute forwarding


class WithExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.num_classes = 7
        self.device_ids = "module's own"

    def forward(self, x):
        return self.l(x)

    def embed(self, x):
        return self.l(x) * 2

    @property
    def broken(self):
        return self.does_not_exist


def test_attribute_forwarding():
    m = WithExtras()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    assert dp.num_classes == 7
    assert dp.l is m.l
    x = torch.randn(3, 2)
    torch.testing.assert_close(dp.embed(x), m.embed(x))
    assert dp.device_ids == ["cpu", "cpu"]  # the wrapper's own attribute wins
    assert dp.module is m
    with pytest.raises(AttributeError) as info:
        dp.nope
    assert str(info.value) == (f"'DataParallel' object has no attribute 'nope', nor has its wrapped module "
                               f"('{type(m).__name__}')")
    with pytest.raises(AttributeError):
        dp.broken
    assert not hasattr(dp, "nope")
    dp.num_classes = 3  # writes stay on the wrapper
    assert m.num_classes == 7 and dp.num_classes == 3


def test_wrapper_copies_and_pickles():
    dp = fastdp.DataParallel(WithExtras(), device_ids=ids("cpu", 2))
    clone = copy.deepcopy(dp)
    assert clone.module is not dp.module and clone.num_classes == 7
    buf = io.BytesIO()
    torch.save(dp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, 2)
    torch.testing.assert_close(loaded(x), dp(x))
    loaded.load_state_dict(dp.state_dict())


def test_wrapper_methods_act_on_module():
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    assert [n for n, _ in dp.named_parameters()][0] == "module.0.weight"
    dp.eval()
    assert not m.training
    dp.train()
    assert m.training
    dp.double()
    assert m[0].weight.dtype == torch.float64


def test_warnings_are_not_emitted_on_a_plain_step():
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=ids("cpu", 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(torch.randn(4, 3)).sum().backward()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_data_parallel_module_matches_linear(kind, dtype):
    lin = nn.Linear(10, 5).to(dev(kind), dtype)
    x = torch.randn(20, 10, device=dev(kind), dtype=dtype)
    out = fastdp.DataParallel(lin, device_ids=ids(kind, 2))(x)
    assert out.device == dev(kind)
    torch.testing.assert_close(out, lin(x))


class PicklableOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2))


def test_nested_load_still_works_after_pickling_the_outer_module():
    a = PicklableOuter()
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    b = torch.load(buf, weights_only=False)
    c = copy.deepcopy(a)
    for p in a.parameters():
        p.data.add_(1)
    for target in (b, c):
        target.load_state_dict(a.state_dict())
        for k, v in a.state_dict().items():
            assert torch.equal(target.state_dict()[k], v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_functional_without_gpu_and_cuda_ids_raises_upstream_error():
    with pytest.raises(RuntimeError) as reference:
        torch.nn.parallel.data_parallel(nn.Linear(2, 2), torch.randn(2, 2))
    for device_ids in (None, [0, 1]):
        with pytest.raises(RuntimeError) as info:
            fastdp.data_parallel(nn.Linear(2, 2), torch.randn(2, 2), device_ids=device_ids)
        assert str(info.value) == str(reference.value)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_side_by_side_with_upstream_on_repeated_cuda_ids(n):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).cuda()
    ours_m, theirs_m = copy.deepcopy(m), copy.deepcopy(m)
    x = torch.randn(11, 6, device="cuda")
    ours = fastdp.DataParallel(ours_m, device_ids=[0] * n)(x)
    theirs = nn.DataParallel(theirs_m, device_ids=[0] * n)(x)
    torch.testing.assert_close(ours, theirs)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    for p, q in zip(ours_m.parameters(), theirs_m.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(ours_m[1].running_mean, theirs_m[1].running_mean)


def test_scatter_set_on_the_instance_is_called():
    """Like upstream, the forward calls self.scatter: a function set on the instance replaces the method too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    calls = []

    def scatter(inputs, kwargs, device_ids):
        calls.append(len(device_ids))
        return fastdp.DataParallel.scatter(dp, inputs, kwargs, device_ids)

    dp.scatter = scatter
    x = torch.randn(6, 4, dtype=torch.float64)
    assert torch.allclose(dp(x), model(x), rtol=0, atol=1e-12)
    assert calls == [2]
