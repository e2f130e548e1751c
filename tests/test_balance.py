"""Balancing device 0 on emulated CPU replicas: the batch split (``chunk_sizes=``), the per-replica loss
(``criterion=``), ``fastdp.memory_report`` and the settling of ``chunk_sizes="auto"`` with an injected reader.

References: the bare module on the full batch (float64 within 1e-10), and the bare module on the chunk that
upstream's rule makes responsible for BatchNorm statistics.
"""

import copy
import functools
import gc
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp
from fastdp.balance import DeviceMemory, MemoryReport, largest_remainder

R = 3
STEPS = 5
TOL = 1e-10


class Net(nn.Module):
    """Positional, nested and keyword inputs; records the batch size of every input each call sees."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.gate = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.seen = []

    def forward(self, x, pair=None, *, mask=None, scale=1.0):
        h = self.enc(x)
        sizes = [x.shape[0]]
        if pair is not None:
            a, (b,) = pair
            h = h + self.gate(a * b)
            sizes += [a.shape[0], b.shape[0]]
        if mask is not None:
            h = h * mask
            sizes.append(mask.shape[0])
        self.seen.append(sizes)
        return self.head(torch.tanh(h)) * scale


def net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    a = torch.randn(n, 4, generator=g, dtype=torch.float64)
    b = torch.randn(n, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, 8, generator=g) > 0.2).double()
    y = torch.randint(0, 3, (n,), generator=g)
    return x, (a, (b,)), mask, y


def params_close(a, b, tol=TOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=name)


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


def batch_of(n):
    return torch.randn(n, 6, dtype=torch.float64)


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


# ---- per-replica loss --------------------------------------------------------------------------------------------


def _loss_case(criterion, spec, make_target=None, steps=STEPS, n=11, dtype=torch.float64):
    bare = net()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec, criterion=criterion)
    opt_a = torch.optim.SGD(bare.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(dp.parameters(), lr=0.05)
    for step in range(steps):
        x, pair, mask, y = batch(n, seed=10 + step)
        target = y if make_target is None else make_target(y, x)
        opt_a.zero_grad()
        ref = criterion(bare(x, pair, mask=mask), target)
        ref.sum().backward()
        opt_a.step()
        opt_b.zero_grad()
        loss = dp(x, pair, mask=mask, target=target)  # kwargs still reach the model; target goes to the loss
        assert loss.shape == ref.shape and loss.dtype == ref.dtype
        torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
        loss.sum().backward()
        opt_b.step()
    params_close(model, bare)
    return dp


def _regression_target(y, x):
    return torch.tanh(x[:, :3] * 2)


class _LogSoftmaxNLL(nn.NLLLoss):
    """NLLLoss on logits: a subclass goes through the gathered output, and equals the bare loss with class weights."""

    def forward(self, input, target):
        return super().forward(F.log_softmax(input, 1), target)


CRITERIA = [
    ("ce-mean", lambda: nn.CrossEntropyLoss(), None),
    ("ce-sum", lambda: nn.CrossEntropyLoss(reduction="sum"), None),
    ("ce-ignore", lambda: nn.CrossEntropyLoss(ignore_index=1), None),
    ("ce-weight-ignore-smooth",
     lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64), ignore_index=2,
                                 label_smoothing=0.1), None),
    ("nll-weight-ignore", lambda: _LogSoftmaxNLL(weight=torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64),
                                                 ignore_index=0), None),
    ("ce-soft", lambda: nn.CrossEntropyLoss(), lambda y, x: F.softmax(x[:, :3], 1)),
    ("mse-mean", lambda: nn.MSELoss(), _regression_target),
    ("mse-sum", lambda: nn.MSELoss(reduction="sum"), _regression_target),
    ("l1-none", lambda: nn.L1Loss(reduction="none"), _regression_target),
    ("kl-batchmean", lambda: nn.KLDivLoss(reduction="batchmean"), lambda y, x: F.softmax(x[:, :3], 1)),
    ("function", lambda: (lambda out, t: F.cross_entropy(out, t)), None),
]


@pytest.mark.parametrize("spec", [None, [0, 4, 7], [5, 1, 5], 0.5], ids=str)
@pytest.mark.parametrize("name, make, target", CRITERIA, ids=[c[0] for c in CRITERIA])
def test_per_replica_loss_equals_the_full_batch_loss(name, make, target, spec):
    _loss_case(make(), spec, target)


def test_per_replica_loss_with_all_targets_ignored_in_one_chunk():
    # Chunk 1 has only ignored targets: its mean would be NaN, yet the total is the full-batch mean.
    criterion = nn.CrossEntropyLoss(ignore_index=0)
    bare = net()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, chunk_sizes=[3, 3, 4], criterion=criterion)
    x, pair, mask, _ = batch(10)
    y = torch.tensor([1, 2, 0, 0, 0, 0, 1, 2, 2, 1])
    loss = dp(x, pair, mask=mask, target=y)
    ref = criterion(bare(x, pair, mask=mask), y)
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    loss.backward()
    ref.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)


class _Shaped(nn.Module):
    """``net()``'s output in the form a loss class takes (probabilities, log-probabilities, positive rates)."""

    def __init__(self, post):
        super().__init__()
        self.net, self.post = net(), post

    def forward(self, x):
        out = self.net(x)
        return out if self.post is None else self.post(out)


def _class_index(n, g):
    return torch.randint(0, 3, (n,), generator=g)


def _multilabel(n, g):
    return torch.randint(-1, 3, (n, 3), generator=g)  # class indices, each row ended by its first -1


def _binary(n, g):
    return torch.randint(0, 2, (n, 3), generator=g).double()


def _signs(n, g):
    return _binary(n, g) * 2 - 1


def _probabilities(n, g):
    return F.softmax(torch.randn(n, 3, generator=g, dtype=torch.float64), 1)


def _reals(n, g):
    return torch.randn(n, 3, generator=g, dtype=torch.float64)


_ZEROS = torch.zeros(3, dtype=torch.float64)
_LOG_PROBABILITIES = functools.partial(F.log_softmax, dim=1)

# Every loss class criterion= computes per replica: (class, its output form, its target, its class weight argument
# or None). test_every_decomposed_loss_class_has_its_edge_cases keeps it complete.
LOSS_CLASSES = [
    (nn.CrossEntropyLoss, None, _class_index, "weight"),
    (nn.NLLLoss, _LOG_PROBABILITIES, _class_index, "weight"),
    (nn.MSELoss, None, _reals, None),
    (nn.L1Loss, None, _reals, None),
    (nn.SmoothL1Loss, None, _reals, None),
    (nn.HuberLoss, None, _reals, None),
    (nn.BCELoss, torch.sigmoid, _binary, "weight"),
    (nn.BCEWithLogitsLoss, None, _binary, "pos_weight"),
    (nn.KLDivLoss, _LOG_PROBABILITIES, _probabilities, None),
    (nn.PoissonNLLLoss, None, _reals, None),
    (nn.SoftMarginLoss, None, _signs, None),
    (nn.MultiLabelSoftMarginLoss, None, _binary, "weight"),
    (nn.MultiLabelMarginLoss, None, _multilabel, None),
    (nn.MultiMarginLoss, None, _class_index, "weight"),
    (nn.HingeEmbeddingLoss, None, _signs, None),
]


class _ChunkSizes(fastdp.DataParallel):
    """A scatter override that gives every device a chunk, empty ones included (upstream's rule never makes one)."""

    def __init__(self, module, sizes, **kwargs):
        super().__init__(module, **kwargs)
        self.sizes = sizes

    def scatter(self, inputs, kwargs, device_ids):
        return fastdp.scatter_kwargs(inputs, kwargs, device_ids, chunk_sizes=self.sizes)


def _edge_cases():
    """(id, loss class row, reduction, edge): every reduction of every class against each edge of the split."""
    cases = []
    for row in LOSS_CLASSES:
        cls, _, target, weight = row
        reductions = ["mean", "sum", "none"] + (["batchmean"] if cls is nn.KLDivLoss else [])
        edges = ["empty-batch", "empty-batch-weights", "empty-chunk"]
        edges += ["zero-weights"] if weight else []
        edges += ["ignored-chunk", "all-ignored"] if cls in (nn.CrossEntropyLoss, nn.NLLLoss) else []
        for reduction in reductions:
            for edge in edges:
                cases.append(pytest.param(row, reduction, edge, id=f"{cls.__name__}-{reduction}-{edge}"))
    return cases


def _edge_case_loss(row, reduction, edge):
    """(criterion, batch size, target, wrapper options) for one edge case."""
    cls, _, make_target, weight = row
    options = {"reduction": reduction}
    if edge == "zero-weights":
        options[weight] = _ZEROS
    if edge in ("ignored-chunk", "all-ignored"):
        options["ignore_index"] = 1
    g = torch.Generator().manual_seed(3)
    n = 0 if edge.startswith("empty-batch") else 7
    target = make_target(n, g)
    if edge == "ignored-chunk":
        target[4:] = 1 + target[4:] * 0  # the last chunk counts no target
    elif edge == "all-ignored":
        target.fill_(1)
    split = {"empty-batch-weights": {"chunk_sizes": [1.0, 2.0, 1.0]}}.get(edge, {})
    return cls(**options), n, target, split


@pytest.mark.filterwarnings("ignore:reduction.*'mean' divides the total loss:UserWarning")  # KLDivLoss's own
@pytest.mark.parametrize("row, reduction, edge", _edge_cases())
def test_per_replica_loss_edge_cases_equal_the_bare_model(row, reduction, edge):
    # An empty batch, an empty chunk, class weights that are all zero, chunks whose targets are all ignored: the
    # loss and every gradient equal the bare model's loss on the full batch, nan where it gives nan.
    criterion, n, target, split = _edge_case_loss(row, reduction, edge)
    bare = _Shaped(row[1])
    x = batch(n)[0]
    if edge == "empty-chunk":
        dp = _ChunkSizes(copy.deepcopy(bare), [4, 0, 3], device_ids=["cpu"] * R, criterion=criterion)
    else:
        dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, criterion=criterion, **split)
    ref = criterion(bare(x), target)
    loss = dp(x, target=target)
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL, equal_nan=True)
    ref.sum().backward()
    loss.sum().backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=TOL, equal_nan=True, msg=name)


@pytest.mark.parametrize("edge", ["empty-batch", "empty-chunk"])
def test_declared_mean_criterion_on_an_empty_batch_or_chunk(edge):
    def criterion(out, target):
        return F.mse_loss(out, target)

    bare = _Shaped(None)
    n = 0 if edge == "empty-batch" else 7
    x, target = batch(n)[0], _reals(n, torch.Generator().manual_seed(3))
    options = {"device_ids": ["cpu"] * R, "criterion": criterion, "criterion_reduction": "mean"}
    dp = (_ChunkSizes(copy.deepcopy(bare), [4, 0, 3], **options) if edge == "empty-chunk" else
          fastdp.DataParallel(copy.deepcopy(bare), **options))
    ref, loss = criterion(bare(x), target), dp(x, target=target)
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL, equal_nan=True)
    ref.backward()
    loss.backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=TOL, equal_nan=True, msg=name)


def test_every_decomposed_loss_class_has_its_edge_cases():
    from fastdp._balance import replica_loss as _replica_loss

    assert {row[0] for row in LOSS_CLASSES} == _replica_loss._ELEMENTWISE | _replica_loss._CLASS_INDEX


def test_per_replica_loss_never_gathers_outputs():
    class NoGather(fastdp.DataParallel):
        def gather(self, outputs, output_device):
            raise AssertionError("outputs were gathered")

    dp = NoGather(net(), device_ids=["cpu"] * R, criterion=nn.CrossEntropyLoss(), mode="single")
    x, pair, mask, y = batch(12)
    loss = dp(x, target=y)
    assert loss.dim() == 0
    report = fastdp.memory_report(dp)
    assert report.avoided_gather_bytes == 12 * 3 * 8  # the (12, 3) float64 output stayed on the replicas
    assert "not gathered" in str(report)


def test_criterion_leaves_plain_calls_alone():
    model = net()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, criterion=nn.CrossEntropyLoss())
    x, pair, mask, y = batch(7)
    torch.testing.assert_close(dp(x, pair, mask=mask), model(x, pair, mask=mask), rtol=0, atol=TOL)  # no target

    class TakesTarget(nn.Module):
        def forward(self, x, target=None):
            return x * (1 if target is None else target)

    plain = fastdp.DataParallel(TakesTarget(), device_ids=["cpu"] * R)  # without criterion, target is the model's
    torch.testing.assert_close(plain(x, target=2.0), x * 2)


def test_target_must_match_the_batch_and_criterion_must_be_callable():
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * R, criterion=nn.CrossEntropyLoss())
    x, _, _, y = batch(8)
    with pytest.raises(ValueError) as info:
        dp(x, target=y[:7])
    assert str(info.value) == ("target has 7 samples along dim 0 but the inputs have 8 (input[0]); the target is split "
                               "across replicas like the inputs, so its batch size must be the same")
    with pytest.raises(TypeError) as info:
        fastdp.DataParallel(net(), device_ids=["cpu"] * R, criterion="ce")
    assert str(info.value) == "criterion must be callable (e.g. nn.CrossEntropyLoss()), got str"
    bad = fastdp.DataParallel(net(), device_ids=["cpu"] * R, criterion=lambda out, t: out.sum(1),
                              criterion_reduction="mean")
    first = len(x.chunk(R)[0])  # replica 0's chunk under torch.chunk's rule
    with pytest.raises(ValueError) as info:
        bad(x, target=y)
    assert str(info.value) == (f"the criterion returned a tensor of shape ({first},) in replica 0 with reduction "
                               "'mean'; expected a scalar")


def test_learnable_criterion_gets_summed_gradients():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
            self.reduction = "mean"

        def forward(self, out, t):
            return F.cross_entropy(out / self.temperature, t)

    bare, crit_a = net(), Scaled()
    crit_b = copy.deepcopy(crit_a)
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, chunk_sizes=[2, 5, 4], criterion=crit_b)
    x, pair, mask, y = batch(11)
    crit_a(bare(x), y).backward()
    dp(x, target=y).backward()
    torch.testing.assert_close(crit_b.temperature.grad, crit_a.temperature.grad, rtol=0, atol=TOL)
    assert "temperature" not in dict(dp.named_parameters())  # the criterion is not part of the model
    assert dp.state_dict().keys() == bare.state_dict().keys()


def test_criterion_on_one_device_and_in_pass_through(monkeypatch):
    criterion = nn.CrossEntropyLoss()
    x, _, _, y = batch(9)
    one = fastdp.DataParallel(net(), device_ids=["cpu"], criterion=criterion)
    torch.testing.assert_close(one(x, target=y), criterion(one.module(x), y), rtol=0, atol=0)
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: False)
    plain = fastdp.DataParallel(net(), criterion=criterion)
    torch.testing.assert_close(plain(x, target=y), criterion(plain.module(x), y), rtol=0, atol=0)


def test_per_replica_loss_with_no_sync_and_no_reference_cycles():
    bare = net()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=["cpu"] * R, chunk_sizes=[0, 5, 6],
                             criterion=nn.CrossEntropyLoss())
    batches = [batch(11, seed=s) for s in range(3)]
    with dp.no_sync():
        for x, pair, mask, y in batches[:2]:
            dp(x, pair, mask=mask, target=y).backward()
    # Device 0 runs no chunk: replica 1's share shows in .grad in its place, replica 2's sums are kept apart.
    assert [d.pending_grads > 0 for d in fastdp.memory_report(dp).devices] == [False, False, True]
    x, pair, mask, y = batches[2]
    dp(x, pair, mask=mask, target=y).backward()
    for x, pair, mask, y in batches:
        F.cross_entropy(bare(x, pair, mask=mask), y).backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
    gc.collect()
    dp(x, pair, mask=mask, target=y).backward()
    assert gc.collect() == 0


def test_deepcopy_keeps_the_split_and_criterion():
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * R, chunk_sizes=0.5, criterion=nn.CrossEntropyLoss())
    x, _, _, y = batch(10)
    dp(x, target=y).backward()
    clone = copy.deepcopy(dp)
    torch.testing.assert_close(clone(x, target=y), dp(x, target=y), rtol=0, atol=0)
    assert clone._last_step.chunk_sizes == [2, 4, 4]


# ---- memory report -----------------------------------------------------------------------------------------------


def _param_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


@pytest.mark.parametrize("spec, holders", [(None, [1, 2]), ([0, 5, 5], [1, 2]), ([5, 0, 5], [2])])
def test_memory_report_counts_the_replicas_flat_buffers(spec, holders):
    model = net()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=spec)
    dp(batch_of(10)).sum().backward()
    report = fastdp.memory_report(dp)
    assert [d.position for d in report.devices] == [0, 1, 2]
    size = _param_bytes(model)
    assert [d.replica_buffers for d in report.devices] == [size if i in holders else 0 for i in range(R)]
    assert report.devices[0].master == size + sum(p.grad.numel() * 8 for p in model.parameters() if p.grad is not None)
    assert all(d.allocated is None and d.peak is None and d.staging == 0 for d in report.devices)
    assert report.peak_ratio() is None
    text = str(report)
    assert "n/a" in text and "replica bufs" in text and "allocator figures are n/a on the host" in text
    if spec is not None:
        assert [d.chunk for d in report.devices] == spec


def test_memory_report_before_any_step_and_for_pass_through(monkeypatch):
    dp = fastdp.DataParallel(net(), device_ids=["cpu"] * 2)
    report = fastdp.memory_report(dp)
    assert [d.fastdp_bytes for d in report.devices] == [0, 0] and any("no kept replicas" in n for n in report.notes)
    monkeypatch.setattr(fastdp._platform.devices, "cuda_available", lambda: False)
    assert fastdp.memory_report(fastdp.DataParallel(net())).devices == []


def test_memory_report_peak_ratio_uses_distinct_devices():
    rows = [DeviceMemory(i, f"cuda:{d}", None, 1, peak, 0, 0, 0, 0)
            for i, (d, peak) in enumerate([(0, 110), (1, 100), (2, 90), (3, 200)])]
    assert MemoryReport(rows).peak_ratio() == pytest.approx(110 / 100)
    same = [DeviceMemory(i, "cuda:0", None, 1, 50, 0, 0, 0, 0) for i in range(3)]
    assert MemoryReport(same).peak_ratio() is None


# ---- chunk_sizes="auto" with an injected reader -------------------------------------------------------------------


class FakeMemory:
    """Peak of each device = base + per_sample * chunk, plus `extra` on device 0 (master, grads, optimizer)."""

    def __init__(self, dp, base=1000, per_sample=100, extra=600):
        self.dp, self.base, self.per_sample, self.extra = dp, base, per_sample, extra
        self.calls = 0

    def __call__(self):
        self.calls += 1
        last = self.dp._last_step  # the previous forward's split (None before the first)
        sizes = (last and last.chunk_sizes) or [0] * len(self.dp.device_ids)
        return [self.base + self.per_sample * n + (self.extra if i == 0 else 0) for i, n in enumerate(sizes)]


def _auto_run(extra, steps=14, batch_size=32, ndev=4, **options):
    model = nn.Linear(6, 3).double()
    # The memory phase alone: the time phase (tests/test_report.py) would move rows by the replicas' timing noise.
    auto = fastdp.AutoSplit(reader=lambda: reader(), balance_time=False, **options)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * ndev, chunk_sizes=auto)
    reader = FakeMemory(dp, extra=extra)
    shares = []
    for _ in range(steps):
        dp(batch_of(batch_size)).sum().backward()
        shares.append(dp._split.share)
    return dp._split, shares, dp


def test_auto_settles_by_bisection_within_the_bound_and_stays():
    rule, shares, dp = _auto_run(extra=600)
    # Peaks at the equal split: 1000 + 800 + 600 vs 1000 + 800 → over; the bound holds from share 0.25 down.
    assert rule.settled and shares[-1] == rule.share
    assert shares[:3] == [1.0, 1.0, 1.0]  # the first reading and two warm-up steps are not judged
    assert [s for s, _ in rule.history] == [1.0, 0.5, 0.25, 0.375, 0.3125, 0.34375]
    assert rule.share == 0.34375 and all(r > 1.05 for s, r in rule.history if s > rule.share)
    sizes = largest_remainder([rule.share, 1.0, 1.0, 1.0], 32)
    assert dp._last_step.chunk_sizes == sizes
    assert 1000 + 600 + 100 * sizes[0] <= 1.05 * (1000 + 100 * sizes[1])
    assert len(set(shares[9:])) == 1  # settled after 2 + 1 + 1 + 5 steps, fixed from then on
    again, shares_again, _ = _auto_run(extra=600)
    assert shares_again == shares  # deterministic


def test_auto_keeps_the_equal_split_when_device_0_is_within_the_bound():
    rule, shares, _ = _auto_run(extra=20)
    assert rule.settled and rule.share == 1.0 and len(rule.history) == 1


def test_auto_bounded_at_zero_and_skips_other_batch_sizes_and_eval():
    rule, _, _ = _auto_run(extra=50_000)
    assert rule.settled and rule.share == 0.0  # never within the bound: device 0 gets no chunk at all
    model = nn.Linear(6, 3).double()
    auto = fastdp.AutoSplit(reader=lambda: reader(), warmup=0, probes=2, balance_time=False)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=auto)
    reader = FakeMemory(dp, extra=600)
    for n in (12, 12, 7, 12):
        dp(batch_of(n)).sum().backward()
    # Judged: the first 12-sample step (share 1, over) and the second (share 0.5, over); the 7-sample step
    # (share 0.25) was not, so the share waits at 0.25 for a step of the reference size.
    assert [s for s, _ in dp._split.history] == [1.0, 0.5] and dp._split.share == 0.25
    with torch.no_grad():
        dp(batch_of(5))
    dp.eval()
    dp(batch_of(5))
    assert reader.calls == 4  # only training forwards drive it
    dp.train()
    dp(batch_of(12)).sum().backward()  # judges the 12-sample step of share 0.25, despite the 5-sample evaluations
    assert [s for s, _ in dp._split.history] == [1.0, 0.5, 0.25]


def test_auto_without_a_reader_settles_its_memory_phase_at_once_on_cpu():
    dp = fastdp.DataParallel(nn.Linear(6, 3), device_ids=["cpu"] * 3, chunk_sizes="auto")
    assert dp._split.memory_settled and dp._split.share == 1.0 and "'cpu'" in dp._split.reason
    assert not dp._split.time_settled  # replica times can be measured on the host: that phase runs
    dp(torch.randn(10, 6))
    assert dp._last_step.chunk_sizes == [3, 3, 4]
    assert "auto" in str(fastdp.memory_report(dp))
    shared = fastdp.AutoSplit(reader=lambda: [0, 0])
    a = fastdp.DataParallel(nn.Linear(6, 3), device_ids=["cpu"] * 2, chunk_sizes=shared)
    assert a._split is not shared  # each wrapper settles on its own


@pytest.mark.parametrize("options, error, text", [
    ({"warmup": -1}, ValueError, "warmup must be a non-negative int, got -1"),
    ({"probes": 0}, ValueError, "probes must be a positive int, got 0"),
    ({"tolerance": math.inf}, ValueError, "tolerance must be a finite non-negative number, got inf"),
    ({"reader": 3}, TypeError, "reader must be callable (returning one peak per device), got int"),
])
def test_auto_options_are_checked(options, error, text):
    with pytest.raises(error) as info:
        fastdp.AutoSplit(**options)
    assert str(info.value) == text


# ---- GPU (skipped without CUDA) ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_split_loss_and_report_on_repeated_ids():
    bare = net().cuda()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=[0, 0, 0], chunk_sizes=[0, 4, 7],
                             criterion=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)))
    x, pair, mask, y = (t.cuda() if isinstance(t, torch.Tensor) else t for t in batch(11))
    loss = dp(x, target=y)
    ref = F.cross_entropy(bare(x), y, weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64, device="cuda"))
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-9)
    loss.backward()
    ref.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-9)
    report = fastdp.memory_report(dp, reset_peak=True)
    assert report.devices[0].allocated > 0 and report.devices[0].peak >= report.devices[0].allocated
    assert report.devices[1].replica_buffers > 0 and report.peak_ratio() is None
    assert fastdp.AutoSplit().bind([0, 0]).settled  # one GPU listed twice cannot be measured per replica


@pytest.mark.multi_gpu
def test_multi_gpu_share_zero_and_auto_reader():
    n = torch.cuda.device_count()
    bare = net().cuda()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=list(range(n)), chunk_sizes=0.0,
                             criterion=nn.CrossEntropyLoss())
    x, pair, mask, y = (t.cuda() if isinstance(t, torch.Tensor) else t for t in batch(4 * n))
    loss = dp(x, target=y)
    ref = F.cross_entropy(bare(x), y)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-9)
    loss.backward()
    ref.backward()
    for p, q in zip(dp.module.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-9)
    rule = fastdp.AutoSplit().bind(list(range(n)))
    assert not rule.settled and len(rule.reader()) == n
