"""fastdp.DataParallel's devices as torch.nn.DataParallel takes them (docs/data_parallel.md): the forms of
``device_ids`` and ``output_device`` and the errors for mixed, unknown or non-indexable ones, the pass-through
without a GPU, the check that the module sits on ``device_ids[0]``, and the CUDA defaults and results side by side
with upstream's.

Every case runs on ``["cpu"] * N`` devices; the ones marked ``gpu`` repeat it on CUDA (repeated ids on one GPU).
Results are compared with the bare module on the full batch, never with numbers typed by hand.
"""

import copy
import re
import threading

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import ids


# Upstream's text for a parameter or buffer off device_ids[0] (torch.nn.DataParallel.forward; it needs CUDA to say it).
MODULE_DEVICE = ("module must have its parameters and buffers on device {} (device_ids[0]) but found one of them on "
                 "device: {}")


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")


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


# ---------------------------------------------------------------- the module's device


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


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, extra=None):
        return self.lin(x) + (0 if extra is None else extra[0])


class _ScatterOverridden(fastdp.DataParallel):
    """Never takes the one-device short path (an overridden scatter must run): the reference for where inputs go."""

    def scatter(self, inputs, kwargs, device_ids):
        return super().scatter(inputs, kwargs, device_ids)


@pytest.mark.parametrize("where", ["positional", "nested", "keyword"])
def test_one_device_input_elsewhere_is_not_given_to_the_module_as_it_is(where):
    """On one device the module gets the inputs as they are only when every one is on device_ids[0] already; an input
    elsewhere (here on "meta", wherever it sits in the arguments) goes through scatter, so the error is scatter's, the
    same as a wrapper that never takes that path gives, and not the module's own."""
    meta, here = torch.randn(4, 2, device="meta"), torch.randn(4, 2)
    args, kwargs = {"positional": ((meta,), {}), "nested": ((here, [meta]), {}),
                    "keyword": ((here,), {"extra": [meta]})}[where]
    errors = []
    for cls in (fastdp.DataParallel, _ScatterOverridden):
        with pytest.raises(Exception) as info:
            cls(_TwoInputs(), device_ids=["cpu"])(*args, **kwargs)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]
    assert errors[0][0] is ValueError and "meta" in errors[0][1]


class _ScatterDoubles(fastdp.DataParallel):
    """An overridden scatter that changes what the module gets: upstream calls it on one device too."""

    def scatter(self, inputs, kwargs, device_ids):
        inputs, kwargs = super().scatter(inputs, kwargs, device_ids)
        return tuple(tuple(t * 2 for t in chunk) for chunk in inputs), kwargs


def test_one_device_calls_an_overridden_scatter_with_the_inputs_already_there():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    torch.testing.assert_close(_ScatterDoubles(lin, device_ids=["cpu"])(x), lin(x * 2), rtol=0, atol=0)
    dp = fastdp.DataParallel(lin, device_ids=["cpu"])

    def doubled(inputs, kwargs, device_ids):  # set on the instance
        inputs, kwargs = fastdp.DataParallel.scatter(dp, inputs, kwargs, device_ids)
        return tuple(tuple(t * 2 for t in chunk) for chunk in inputs), kwargs

    dp.scatter = doubled
    torch.testing.assert_close(dp(x), lin(x * 2), rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_module_with_cpu_replicas_and_back():
    m = nn.Linear(2, 2).cuda()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "cuda:0")) + "$"):
        dp(torch.randn(2, 2))


# ---------------------------------------------------------------- the functional form; side by side on CUDA


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
