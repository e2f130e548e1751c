"""Patterns from users' own training scripts on emulated replicas, each against the bare model on the full batch (or
against upstream's behaviour where it is right): SyncBatchNorm subclasses, per-replica losses that are not a plain
mean, parameters made under inference mode, inputs and outputs that cannot be split or gathered along the batch,
and unwrapping the wrapper with ``isinstance(model, torch.nn.DataParallel)``.
"""

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

DEVICES = ["cpu"] * 3


# ---- SyncBatchNorm subclasses keep their own forward ---------------------------------------------------------------


class ShiftedSyncBatchNorm(nn.SyncBatchNorm):
    """A SyncBatchNorm whose forward does more than normalise (timm's SyncBatchNormAct adds an activation)."""

    def forward(self, x):
        return super().forward(x) + 1


class NormAct(nn.SyncBatchNorm):
    def forward(self, x):
        x = super().forward(x)
        if hasattr(self, "act"):
            x = self.act(x)
        return x


def _conv_net(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.Conv2d(4, 2, 1), norm(2), nn.Flatten()).double()


def _act_norm(channels):
    layer = NormAct(channels)
    layer.act = nn.ReLU()
    return layer


@pytest.mark.parametrize("norm", [ShiftedSyncBatchNorm, _act_norm], ids=["shifted", "with-act"])
def test_sync_batchnorm_subclass_runs_its_own_forward(norm):
    bare = _conv_net(norm)
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    for step in range(2):
        expected, got = bare(x), dp(x)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        expected.square().sum().backward()
        got.square().sum().backward()
        for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
    for b, q in zip(bare.buffers(), dp.module.buffers()):
        torch.testing.assert_close(q, b, rtol=1e-10, atol=1e-10)


# ---- isinstance(model, torch.nn.DataParallel) ------------------------------------------------------------------------


def test_wrapper_is_an_nn_dataparallel_for_unwrapping():
    net = nn.Linear(4, 2)
    dp = fastdp.DataParallel(net, device_ids=DEVICES)
    assert isinstance(dp, torch.nn.DataParallel) and isinstance(dp, torch.nn.parallel.DataParallel)
    unwrapped = dp.module if isinstance(dp, torch.nn.DataParallel) else dp
    assert unwrapped is net
    # The wrapper still behaves as fastdp's: its state dict is the bare model's, and torch's constructor never ran.
    assert list(dp.state_dict()) == list(net.state_dict())
    x = torch.randn(5, 4)
    torch.testing.assert_close(dp(x), net(x))


def test_upstream_members_resolve_to_fastdp_or_module():
    """Whatever torch's DataParallel defines, a fastdp wrapper uses fastdp's or Module's own: a method torch adds to
    its class later never runs on the fastdp wrapper by inheritance."""
    upstream = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel
    for name, value in vars(upstream).items():
        if not callable(value):
            continue
        assert getattr(fastdp.DataParallel, name) is not value, name


def test_transformers_unwrap_helpers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import unwrap_model

    net = nn.Linear(4, 2)
    assert unwrap_model(fastdp.DataParallel(net, device_ids=DEVICES)) is net


def test_accelerate_unwrap_helper():
    accelerate = pytest.importorskip("accelerate")
    net = nn.Linear(4, 2)
    assert accelerate.utils.extract_model_from_parallel(fastdp.DataParallel(net, device_ids=DEVICES)) is net


# ---- criterion=: per-replica losses only where exact ----------------------------------------------------------------


class ShiftedCrossEntropy(nn.CrossEntropyLoss):
    """Causal-LM loss: position t predicts label t + 1."""

    def forward(self, logits, labels):
        return super().forward(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _labels(batch, length, ignored):
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 11, (batch, length), generator=g)
    if ignored:
        labels[torch.rand(batch, length, generator=g) < 0.4] = -100
        labels[0] = -100  # the first replica's chunk counts fewer tokens than the others
    return labels


def _shifted_fn(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _flat_ce(**kwargs):
    ce = nn.CrossEntropyLoss(**kwargs)
    return lambda logits, labels: ce(logits.flatten(0, 1), labels.flatten())


CRITERIA = {
    "shifted-subclass": lambda: ShiftedCrossEntropy(),
    "shifted-function": lambda: _shifted_fn,
    "subclass-smoothing": lambda: ShiftedCrossEntropy(label_smoothing=0.1),
}


def _check_loss(criterion, model_fn, x, target, **dp_kwargs):
    torch.manual_seed(0)
    bare = model_fn().double()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES, criterion=criterion, **dp_kwargs)
    expected = criterion(bare(x), target)
    got = dp(x, target=target)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    expected.backward()
    got.backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    return dp


@pytest.mark.parametrize("name", sorted(CRITERIA))
@pytest.mark.parametrize("ignored", [False, True], ids=["all", "ignore_index"])
def test_criterion_that_is_not_a_plain_mean_matches_the_bare_loss(name, ignored):
    ids = torch.randint(0, 11, (7, 6), generator=torch.Generator().manual_seed(1))
    _check_loss(CRITERIA[name](), TokenModel, ids, _labels(7, 6, ignored))


class ClassModel(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        return self.fc(x)


def _class_target(batch=7, classes=5, ignored=True):
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, classes, (batch,), generator=g)
    if ignored:
        t[:3] = 2  # ignore_index below: the first chunk has no counted sample
    return t


TORCH_LOSSES = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "ce-ignore": lambda: nn.CrossEntropyLoss(ignore_index=2),
    "ce-weight-ignore-smooth": lambda: nn.CrossEntropyLoss(
        weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1], dtype=torch.float64), ignore_index=2, label_smoothing=0.2),
    "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum", ignore_index=2),
    "nll-weight": lambda: nn.NLLLoss(weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1], dtype=torch.float64)),
    "multimargin-weight": lambda: nn.MultiMarginLoss(weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1],
                                                                         dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(TORCH_LOSSES))
def test_torch_losses_per_replica_equal_the_bare_loss(name):
    x = torch.randn(7, 6, dtype=torch.float64)
    dp = _check_loss(TORCH_LOSSES[name](), ClassModel, x, _class_target())
    assert dp._avoided_gather_bytes, "torch's own losses are computed per replica"


def test_function_criterion_goes_through_the_gathered_output():
    x = torch.randn(7, 6, dtype=torch.float64)
    target = torch.randn(7, 5, dtype=torch.float64)
    dp = _check_loss(lambda out, t: (out - t).square().mean(), ClassModel, x, target)
    assert not dp._avoided_gather_bytes


def test_declared_decomposable_criterion_runs_per_replica():
    x = torch.randn(7, 6, dtype=torch.float64)
    target = torch.randn(7, 5, dtype=torch.float64)
    dp = _check_loss(lambda out, t: (out - t).square().mean(), ClassModel, x, target, criterion_reduction="mean")
    assert dp._avoided_gather_bytes
    _check_loss(lambda out, t: (out - t).square().sum(), ClassModel, x, target, criterion_reduction="sum")


def test_criterion_reduction_is_checked():
    with pytest.raises(ValueError, match="criterion_reduction"):
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=DEVICES, criterion=nn.MSELoss(), criterion_reduction="avg")
    with pytest.raises(ValueError, match="criterion_reduction.*criterion"):
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=DEVICES, criterion_reduction="mean")


# ---- parameters made under inference mode ---------------------------------------------------------------------------


def _inference_made(layers):
    torch.manual_seed(0)
    with torch.inference_mode():
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_inference_made_parameters_serve_like_the_bare_model(mode):
    bare = _inference_made(2)
    dp = fastdp.DataParallel(bare, device_ids=DEVICES)
    x = torch.randn(7, 4)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    for _ in range(2):
        with ctx():
            torch.testing.assert_close(dp(x), bare(x))


def test_training_inference_made_parameters_names_the_parameter_and_the_fix():
    bare = _inference_made(2)
    x = torch.randn(7, 4)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        bare(x)  # the bare model refuses too
    dp = fastdp.DataParallel(bare, device_ids=DEVICES)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight'.*inference mode.*clone"):
        dp(x)


# ---- inputs and outputs that cannot be split or gathered along the batch ------------------------------------------


class PackedRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4)

    def forward(self, packed):
        return self.rnn(packed)[1]


def test_packed_sequence_input_is_refused_with_the_fix():
    seqs = [torch.randn(n, 3) for n in (5, 4, 4, 3, 2, 2)]
    packed = nn.utils.rnn.pack_sequence(seqs)
    dp = fastdp.DataParallel(PackedRNN(), device_ids=DEVICES)
    with pytest.raises(TypeError, match=r"input\[0\] is a PackedSequence.*pack_padded_sequence"):
        dp(packed)
    with pytest.raises(TypeError, match=r"packed"):
        dp(packed=packed)


class PairScores(nn.Module):
    """CLIP-like: the chunk's image-text similarity matrix, (chunk, chunk)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, images, texts):
        a, b = self.fc(images), self.fc(texts)
        return {"image_embeds": a, "logits_per_image": a @ b.t()}


def test_gather_of_outputs_with_unequal_non_batch_sizes_names_the_output():
    dp = fastdp.DataParallel(PairScores(), device_ids=DEVICES)
    with pytest.raises(ValueError, match=r"output\['logits_per_image'\].*dim 1.*\(3, 3, 1\)"):
        dp(torch.randn(7, 4), torch.randn(7, 4))
