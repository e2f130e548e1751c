"""The per-replica loss, ``criterion=``, on emulated CPU replicas: the replicas' losses combined into the full
batch's for every criterion and reduction, every loss class fastdp decomposes at the edges of a split (an empty
batch or chunk, class weights all zero, targets all ignored), outputs never gathered, plain calls left alone, the
errors for a bad target or criterion, a criterion's own parameters, no_sync and deepcopy.

References: the bare module and criterion on the full batch (float64 within 1e-10).
"""

import copy
import functools
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

from _balance_cases import R, STEPS, batch, net
from _reference import TOL, params_close


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
                marks = ()
                if cls is nn.MultiLabelMarginLoss and reduction != "none" and edge.startswith("empty-batch"):
                    # torch's own result is uninitialized memory there (any value, nan included, run to run): no
                    # reference to compare with.
                    marks = pytest.mark.skip(reason="torch's MultiLabelMarginLoss (sum, mean) of an empty batch "
                                                    "returns uninitialized memory")
                cases.append(pytest.param(row, reduction, edge, id=f"{cls.__name__}-{reduction}-{edge}", marks=marks))
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
    with pytest.warns(UserWarning, match="no target="):  # a training forward: the criterion does not run
        out = dp(x, pair, mask=mask)
    torch.testing.assert_close(out, model(x, pair, mask=mask), rtol=0, atol=TOL)

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
