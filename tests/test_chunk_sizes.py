"""The batch split, ``chunk_sizes=``, on emulated CPU replicas: the largest-remainder rule, every form of the
argument and the error for each bad one, explicit sizes in scatter_kwargs and scatter, training with any split equal
to the bare model, and BatchNorm's running statistics from the first non-empty chunk.

References: the bare module on the full batch (float64 within 1e-10), and the bare module on the chunk that
upstream's rule makes responsible for BatchNorm statistics.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from fastdp.balance import largest_remainder

from _balance_cases import R, STEPS, batch, batch_of, net
from _reference import TOL, params_close


# ---- largest remainder and the forms of chunk_sizes ---------------------------------------------------------------


def test_largest_remainder_is_exact_deterministic_and_favours_later_devices_on_ties():
    assert largest_remainder([0.1, 0.2, 0.7], 10) == [1, 2, 7]  # no float noise: exact quotas
    assert largest_remainder([1.0, 1.0, 1.0], 10) == [3, 3, 4]  # tie: the later device
    assert largest_remainder([1.0, 1.0, 1.0, 1.0], 9) == [2, 2, 2, 3]
    assert largest_remainder([0.0, 1.0, 1.0], 7) == [0, 3, 4]  # zero weight, zero samples
    assert largest_remainder([0.5, 1.0, 1.0, 1.0], 32) == [5, 9, 9, 9]
    for n in range(0, 40):
        for w in ([0.5, 1.0, 1.0], [3.0, 1e-9, 2.0], [1.0, 0.0, 0.0]):
            sizes = largest_remainder(w, n)
            assert sum(sizes) == n and all(s >= 0 for s in sizes)
            assert all(s == 0 for s, x in zip(sizes, w) if x == 0)
            assert all(abs(s - n * x / sum(w)) < 1 for s, x in zip(sizes, w))


@pytest.mark.parametrize(
    "spec, batch, expected",
    [
        ([3, 0, 7], 10, [3, 0, 7]),
        ((0, 5, 5), 10, [0, 5, 5]),
        ([1.0, 2.0, 3.5], 10, [2, 3, 5]),
        ([2, 1.0, 1], 8, [4, 2, 2]),  # any float makes the entries weights
        (0.5, 10, [2, 4, 4]),
        (0, 10, [0, 5, 5]),
        (0.0, 7, [0, 3, 4]),
        (1.0, 10, [3, 3, 4]),
        (torch.tensor([1, 3, 4]), 8, [1, 3, 4]),
        (torch.tensor(0.5), 5, [1, 2, 2]),
    ],
)
def test_chunk_sizes_forms(spec, batch, expected):
    model = net()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec)
    dp(batch_of(batch))
    assert dp._last_step.chunk_sizes == expected
    assert sorted(s[0] for s in model.seen) == sorted(n for n in expected if n > 0)  # replicas run concurrently


# fastdp's own messages, whole.
_SHARE = ("chunk_sizes={!r}: a single number is device 0's share relative to each other device's, and must be finite "
          "and in [0, 1] (0.5: device 0 gets half as many samples as each other device; 0: none). For a fixed number "
          "of samples pass one int per device; for any other proportion, one float weight per device")
_NEGATIVE = "chunk_sizes[1] is {}; expected non-negative sizes or weights"
_ZERO = "chunk_sizes={} are all zero; expected at least one device with a positive size or weight"
_COUNT = ("chunk_sizes has {} entries but device_ids has 3 devices; expected one size (int) or weight (float) per "
          "device")
_FINITE = "chunk_sizes[1] is {}; expected finite, non-negative weights"
_NUMBER = "{} must be an int (a size) or a float (a weight), got {}"


@pytest.mark.parametrize(
    "spec, error, text",
    [
        ([3, -1, 8], ValueError, _NEGATIVE.format(-1)),
        ([1.0, -0.5, 1.0], ValueError, _NEGATIVE.format(-0.5)),
        ([0, 0, 0], ValueError, _ZERO.format([0, 0, 0])),
        ([0.0, 0.0, 0.0], ValueError, _ZERO.format([0.0, 0.0, 0.0])),
        ([5, 5], ValueError, _COUNT.format(2)),
        ([1.0, 1.0, 1.0, 1.0], ValueError, _COUNT.format(4)),
        ([1.0, float("nan"), 1.0], ValueError, _FINITE.format(float("nan"))),
        ([1.0, float("inf"), 1.0], ValueError, _FINITE.format(float("inf"))),
        (float("nan"), ValueError, _SHARE.format(float("nan"))),
        (1.5, ValueError, _SHARE.format(1.5)),
        (-0.25, ValueError, _SHARE.format(-0.25)),
        (8, ValueError, _SHARE.format(8)),
        ("half", ValueError, "chunk_sizes='half': expected None, 'auto', a float in [0, 1] (device 0's share of each "
                             "other device's share), or one int size or float weight per device"),
        (True, TypeError, _NUMBER.format("chunk_sizes", "bool True")),
        ([1, True, 1], TypeError, _NUMBER.format("chunk_sizes[1]", "bool True")),
        ([1, "2", 1], TypeError, _NUMBER.format("chunk_sizes[1]", "str '2'")),
        ({0: 1}, TypeError, "chunk_sizes must be None, 'auto', a float share for device 0, or a list/tuple with one "
                            "entry per device; got dict"),
    ],
)
def test_chunk_sizes_validation(spec, error, text):
    with pytest.raises(error) as info:
        fastdp.DataParallel(net(), device_ids=["cpu"] * R, chunk_sizes=spec)
    assert str(info.value) == text


def test_explicit_sizes_must_add_up_to_each_batch():
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * R, chunk_sizes=[3, 0, 7])
    dp(batch_of(10))
    with pytest.raises(ValueError) as info:
        dp(batch_of(9))
    assert str(info.value) == (
        "chunk_sizes=[3, 0, 7] add up to 10, but the batch has 9 samples along dim 0; explicit sizes (ints) must add "
        "up to the batch. Pass float weights (e.g. [3.0, 0.0, 7.0]) to split batches of any size in that proportion."
    )


def test_share_zero_needs_another_device_and_pass_through_checks_the_form(monkeypatch):
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(net(), device_ids=["cpu"], chunk_sizes=0.0)
    assert str(info.value) == ("chunk_sizes=0 gives device 0 no samples, but device_ids has a single device; "
                               "expected a share in (0, 1] with one device, or more devices")
    one = fastdp.DataParallel(net(), device_ids=["cpu"], chunk_sizes=0.5)
    x = batch_of(5)
    torch.testing.assert_close(one(x), one.module(x), rtol=0, atol=0)
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: False)
    plain = fastdp.DataParallel(net(), chunk_sizes=[1, 2])  # pass-through: no devices, the rule is not used
    assert plain.device_ids == []
    with pytest.raises(ValueError) as info:
        fastdp.DataParallel(net(), chunk_sizes=[1, -2])
    assert str(info.value) == _NEGATIVE.format(-2)


def test_every_tensor_must_have_the_batch_size_when_a_split_is_given():
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * R, chunk_sizes=0.5)
    x, pair, mask, _ = batch(10)
    with pytest.raises(ValueError) as info:
        dp(x, pair, mask=mask[:9])
    assert str(info.value) == (
        "chunk_sizes splits every tensor of the inputs in the same way, so every tensor must have the same size along "
        "dim 0; got input[0]: 10, input[1][0]: 10, input[1][1][0]: 10, kwargs['mask']: 9"
    )


def test_scatter_kwargs_takes_explicit_chunk_sizes():
    x = torch.arange(10.0).view(5, 2)
    args, kwargs = fastdp.scatter_kwargs((x,), {"m": x + 1, "k": 3}, ["cpu"] * 3, chunk_sizes=[0, 2, 3])
    assert [a[0].shape[0] for a in args] == [0, 2, 3]
    assert [kw["m"].shape[0] for kw in kwargs] == [0, 2, 3] and all(kw["k"] == 3 for kw in kwargs)
    torch.testing.assert_close(torch.cat([a[0] for a in args]), x)
    assert [c.shape[0] for c in fastdp.scatter(x, ["cpu"] * 2, chunk_sizes=[4, 1])] == [4, 1]
    with pytest.raises(ValueError) as info:
        fastdp.scatter_kwargs((x,), None, ["cpu"] * 2, chunk_sizes=[1, 2, 2])
    assert str(info.value) == "chunk_sizes has 3 entries for 2 devices; expected one size per device"


# ---- training with any split equals the bare model ---------------------------------------------------------------


SPLITS = [[3, 0, 8], [0, 5, 6], [7, 4, 0], [1.0, 2.0, 3.5], 0.5, 0.0, 0.25]


@pytest.mark.parametrize("spec", SPLITS, ids=str)
def test_training_with_any_split_equals_the_bare_model(spec):
    bare = net()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec)
    opt_a = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, pair, mask, y = batch(11, seed=step)
        for m, opt in ((bare, opt_a), (dp, opt_b)):
            opt.zero_grad()
            out = m(x, pair, mask=mask, scale=0.5)
            F.cross_entropy(out, y).backward()
            opt.step()
    params_close(model, bare)
    # Every tensor of args and kwargs got the same chunk in each replica.
    expected = [n for n in dp._last_step.chunk_sizes if n > 0]
    assert sorted(model.seen[-len(expected):]) == sorted([n] * 4 for n in expected)


def test_no_replica_runs_on_device_0_when_its_chunk_is_0():
    model = net()
    ptrs = []
    model.enc.register_forward_pre_hook(lambda m, args: ptrs.append(m.weight.data_ptr()))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=[0, 4, 6])
    out = dp(batch_of(10))
    assert len(ptrs) == 2 and model.enc.weight.data_ptr() not in ptrs  # copies, never the master's storage
    out.sum().backward()
    assert model.enc.weight.grad is not None  # gradients still reduce onto device_ids[0]
    ptrs.clear()
    fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=[2, 4, 4])(batch_of(10))
    assert ptrs[0] == model.enc.weight.data_ptr()  # with a chunk, replica 0 aliases the master as upstream


@pytest.mark.parametrize("spec, first", [([0, 4, 6], slice(0, 4)), ([0, 0, 10], slice(0, 10)),
                                         ([3, 3, 4], slice(0, 3)), (None, slice(0, 4))])
def test_batchnorm_running_stats_come_from_the_first_nonempty_chunk(spec, first):
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)).double()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, chunk_sizes=spec)
    for step in range(3):
        x = batch_of(10)
        dp(x).sum().backward()
        bare(x[first])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(dp.module[1], name), getattr(bare[1], name), rtol=0, atol=TOL)
    dp.eval()
    x = batch_of(10)
    torch.testing.assert_close(dp(x), bare.eval()(x), rtol=0, atol=TOL)


@pytest.mark.parametrize("spec, first", [([0, 4, 6], slice(0, 4)), ([3, 3, 4], slice(0, 3))])
def test_batchnorm_running_stats_after_a_replica_failed(spec, first):
    # The replica that plays chunk 0 updated its statistics before another replica raised: the master keeps that
    # update, as upstream's replica 0 (the master's own buffers) keeps it, also when device 0 runs no chunk.
    class FailsLast(nn.Module):
        """Raises after its BatchNorm in the replica of the last chunk (the largest)."""

        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(6, 5), nn.BatchNorm1d(5)

        def forward(self, x):
            h = self.bn(self.lin(x))
            if x.size(0) == max(spec):
                raise KeyError("the last chunk fails")
            return h

    torch.manual_seed(0)
    model = FailsLast().double()
    bare = copy.deepcopy(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec)
    x = batch_of(10)
    with pytest.raises(KeyError):
        dp(x)
    bare.bn(bare.lin(x[first]))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.bn, name), getattr(bare.bn, name), rtol=0, atol=TOL)


def test_empty_batch_and_inputs_without_tensors_follow_upstream():
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * R, chunk_sizes=[0.0, 1.0, 1.0])
    out = dp(batch_of(0))
    assert out.shape == (0, 3) and dp._last_step.chunk_sizes is None
