"""The per-replica loss of ``fastdp.DataParallel(criterion=...)``: each replica runs the criterion on its chunk of
the target, and the replicas' losses combine into the full-batch loss (docs/balance.md).

The weights of the combination make it equal the full-batch loss, so the gradients are the same as with the
outputs gathered and the criterion run once; only the scalars travel to the output device.
"""

from typing import NamedTuple

import torch
import torch.nn as nn

from .._step.functions import Gather
from ..replicate import replicate

__all__ = ["loss_rule", "check_declared", "PerReplicaLoss", "criterion_replicas", "ReplicaLoss", "pair", "combine",
           "WITHOUT_TARGET"]

# The warning of a training forward that has criterion= and no target=: the criterion never runs then. Evaluation
# forwards (no grad, or eval mode) are the documented way to get the outputs of such a wrapper and draw no warning.
WITHOUT_TARGET = (
    "fastdp.DataParallel has criterion= but this training forward got no target=: it returns the outputs, gathered "
    "on the output device, and the criterion does not run; pass the labels as dp(x, target=y) to get the loss "
    "computed on each replica, or leave criterion= out if you compute the loss yourself (a forward without grad or "
    "in eval mode returns the outputs without this warning)"
)

# torch's own losses whose full-batch value the replicas' values give exactly, by exact type: a subclass (or any other
# callable) may count differently from what the target's chunks show, e.g. shift the labels of a causal LM, so it
# goes through the gathered output unless the user declares it decomposable (``criterion_reduction``).
_ELEMENTWISE = frozenset({nn.L1Loss, nn.MSELoss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                          nn.KLDivLoss, nn.PoissonNLLLoss, nn.SoftMarginLoss, nn.MultiLabelSoftMarginLoss,
                          nn.MultiLabelMarginLoss, nn.MultiMarginLoss, nn.HingeEmbeddingLoss})
_CLASS_INDEX = frozenset({nn.CrossEntropyLoss, nn.NLLLoss})  # mean over the counted targets' class weights
DECLARED = ("mean", "sum")


def check_declared(criterion_reduction, criterion):
    """The constructor's ``criterion_reduction``: None, or how a decomposable criterion's chunk losses combine."""
    if criterion_reduction is None:
        return
    if criterion_reduction not in DECLARED:
        raise ValueError(
            f"criterion_reduction must be None, 'mean' or 'sum', got {criterion_reduction!r}: 'mean' declares that "
            "the criterion on the full batch equals its values on the chunks weighted by their share of the batch, "
            "'sum' that it equals their sum"
        )
    if criterion is None:
        raise ValueError("criterion_reduction declares how the criterion combines; pass criterion= with it")


class PerReplicaLoss(NamedTuple):
    """A forward's loss computed on the replicas: the criterion and how its chunk losses combine (``loss_rule``)."""

    criterion: object
    rule: str


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


def _tensor_bytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x) for x in obj.values())
    return 0


def loss_rule(criterion, target, dim, declared=None):
    """How the replicas' losses combine into the full-batch loss: "sum", "mean", "ratio" or "none"; None when only
    the criterion on the gathered output gives the bare model's loss.

    ``declared`` (the user's ``criterion_reduction``) wins. Otherwise only torch's own loss classes, by exact type,
    are combined: "mean" weights each replica's loss by its chunk's share of the batch; "ratio" is for
    CrossEntropyLoss and NLLLoss with class-index targets, whose mean divides by the summed class weights of the
    targets that are not ``ignore_index`` (label smoothing shares that denominator): each replica returns its sum
    and that denominator, and the total is sum / denominator.
    """
    if declared is not None:
        return declared
    kind = type(criterion)
    if kind not in _ELEMENTWISE and kind not in _CLASS_INDEX:
        return None
    t = _first_tensor(target)
    if t is None or _weight_varies_along(criterion, t, dim):
        return None
    reduction = criterion.reduction
    if reduction in ("sum", "none"):
        return reduction
    if reduction == "batchmean":  # KLDivLoss: the sum over the chunk divided by its size along dim 0
        return "mean" if dim == 0 else "sum"
    if reduction == "mean":
        return "ratio" if kind in _CLASS_INDEX and not t.is_floating_point() else "mean"
    return None  # torch's own error, from the criterion on the gathered output


def _weight_varies_along(criterion, target, dim):
    """Whether an element weight (BCELoss's ``weight``) differs along the split dimension: each chunk would need its
    own slice of it."""
    weight = getattr(criterion, "weight", None)
    if type(criterion) not in (nn.BCELoss, nn.BCEWithLogitsLoss) or not isinstance(weight, torch.Tensor):
        return False
    axis = dim - (target.dim() - weight.dim())  # weight broadcasts from the trailing dimensions
    return 0 <= axis < weight.dim() and weight.size(axis) != 1


def criterion_replicas(criterion, devices, rule):
    """One criterion per replica device: Module criteria are replicated like the model (their tensors, e.g.
    class weights, then live on each device, and learnable ones get their gradients summed back)."""
    if not isinstance(criterion, nn.Module):
        return [criterion] * len(devices)
    copies = replicate(criterion, devices, not torch.is_grad_enabled())
    if rule == "ratio":
        for c in copies:
            c.reduction = "sum"  # each copy is a shallow copy with its own __dict__: the master keeps "mean"
    return copies


def _ratio_denominator(criterion, target):
    valid = target != criterion.ignore_index
    weight = criterion.weight
    if weight is None:
        return valid.sum()
    # No boolean-mask indexing: that would synchronise the device with the host in every replica.
    return (weight.detach()[target.masked_fill(~valid, 0)] * valid).sum()


class ReplicaLoss:
    """What a worker runs for one replica: its forward, then the criterion on its chunk of the target (the last
    positional argument). Returns (loss, denominator or None, bytes of the output it did not gather)."""

    __slots__ = ("replica", "criterion", "rule")

    def __init__(self, replica, criterion, rule):
        self.replica, self.criterion, self.rule = replica, criterion, rule

    def __call__(self, *args, **kwargs):
        *args, target = args
        out = self.replica(*args, **kwargs)
        loss = self.criterion(out, target)
        den = _ratio_denominator(self.criterion, target) if self.rule == "ratio" else None
        return loss, den, _tensor_bytes(out)


def _scalars_to(values, device):
    """The replicas' 0-dim tensors as one vector on ``device`` (differentiable: only these scalars travel)."""
    return Gather.apply(device, 0, *(v.reshape(1) for v in values))


def combine(results, targets, rule, dim, device, gather):
    """The full-batch loss from the replicas' (loss, denominator, bytes) results; `targets` are their chunks."""
    losses = [r[0] for r in results]
    _check_losses(losses, rule)
    if rule == "none":
        return gather(losses)
    if rule == "sum":
        return _scalars_to(losses, device).sum()
    if rule == "ratio":
        sums = _scalars_to(losses, device)
        dens = _scalars_to([r[1].to(losses[0].dtype) for r in results], device)
        return sums.sum() / dens.sum()
    return _mean_over_chunks(losses, _sample_counts(targets, dim), device)


def _check_losses(losses, rule):
    """Each replica's loss is a tensor, and a scalar unless the criterion keeps one loss per sample."""
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the criterion returned {type(loss).__name__} in replica {i}; expected a tensor")
        if rule != "none" and loss.numel() != 1:
            raise ValueError(
                f"the criterion returned a tensor of shape {tuple(loss.shape)} in replica {i} with reduction "
                f"{rule!r}; expected a scalar"
            )


def _sample_counts(targets, dim):
    """Each chunk's number of samples: its target's size along dim (1 for a target without that dimension)."""
    counts = []
    for t in targets:
        first = _first_tensor(t)
        counts.append(first.shape[dim] if first is not None and first.dim() > 0 else 1)
    return counts


def _mean_over_chunks(losses, counts, device):
    """The full-batch mean: each chunk's mean weighted by its share of the samples."""
    total = sum(counts)
    if total == 0:
        # The whole batch is empty, so each chunk's loss is the criterion's value on an empty batch, as the bare
        # model's is (nan for torch's means): their mean, each replica's gradient a share of it.
        weighted = [loss * (1 / len(losses)) for loss in losses]
    else:
        # Each loss weighted on its own device by a Python number: a weight tensor made from a list on a CUDA
        # device would be a host-to-device copy that waits for the device in every step. An empty chunk (a
        # scatter override's) holds no element of the full-batch mean: its loss, the mean of nothing (nan), is
        # left out rather than weighted by 0, which would give nan.
        weighted = [loss * (c / total) for loss, c in zip(losses, counts) if c]
    return _scalars_to(weighted, device).sum()


def pair(replicas, loss, devices):
    """The replicas as the ReplicaLoss their workers run: each replica gets its own copy of the criterion
    (``criterion_replicas``); ``loss`` is the forward's PerReplicaLoss, ``devices`` the replicas' devices."""
    copies = criterion_replicas(loss.criterion, devices, loss.rule)
    return [ReplicaLoss(r, c, loss.rule) for r, c in zip(replicas, copies)]
