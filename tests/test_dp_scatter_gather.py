"""fastdp's scatter and gather rules against torch.nn.DataParallel's (docs/data_parallel.md): scatter_kwargs
padding the shorter list, scalars gathered into a vector with upstream's warning, ``output_device=-1``, the outputs
that cannot be gathered and the message that says why, and the autograd of scatter and gather (gradcheck and
gradgradcheck).

Every case runs on ``["cpu"] * N`` devices. Results are compared with the bare module on the full batch,
never with numbers typed by hand.
"""

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import Box, Point, ids
from _places import dest, devices, host, on


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
    host_x = torch.randn(4, 4, dtype=torch.double)
    x = on(host_x).requires_grad_()
    (a,), (b,) = dp.scatter((x,), None, devices(2))[0]
    torch.testing.assert_close(host(a), host_x[:2])
    torch.testing.assert_close(host(b), host_x[2:])
    assert a.data_ptr() == x.data_ptr()  # entry 0 holds the source: a view
    assert b.data_ptr() != x.data_ptr()
    grad = torch.randn(4, 4, dtype=torch.double)
    torch.autograd.backward([a, b], [on(grad[:2], 0), on(grad[2:], 1)])
    torch.testing.assert_close(host(x.grad), grad)

    def fn(t):
        parts = fastdp.scatter((t,), devices(2))
        return torch.cat([p.to(t.device) for p in parts[0] + parts[1]])

    torch.autograd.gradcheck(fn, (x.detach().requires_grad_(),))
    torch.autograd.gradgradcheck(fn, (x.detach().requires_grad_(),))


def test_gather_cpu():
    host_a, host_b = torch.randn(2, 5, dtype=torch.double), torch.randn(2, 5, dtype=torch.double)
    a, b = on(host_a, 0).requires_grad_(), on(host_b, 1).requires_grad_()
    out = fastdp.gather((a, b), "cpu")
    torch.testing.assert_close(out, torch.cat([host_a, host_b]))
    assert not out.is_cuda
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(host(a.grad), torch.ones_like(host_a))
    torch.autograd.gradcheck(lambda x, y: fastdp.gather((x, y), "cpu"), (a, b))
    torch.autograd.gradgradcheck(lambda x, y: fastdp.gather((x, y), "cpu"), (a, b))
    sa = on(torch.randn((), dtype=torch.double), 0).requires_grad_()
    sb = on(torch.randn((), dtype=torch.double), 1).requires_grad_()
    with pytest.warns(UserWarning, match="^" + re.escape(SCALARS_WARNING) + "$"):
        v = fastdp.gather((sa, sb), "cpu")
    assert v.shape == (2,)
    v.backward(torch.tensor([2.0, 3.0], dtype=torch.double))
    assert sa.grad.item() == 2.0 and sb.grad.item() == 3.0
