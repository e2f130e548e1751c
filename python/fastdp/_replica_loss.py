"""The per-replica loss of ``fastdp.DataParallel(criterion=...)``: each replica runs the criterion on its chunk of
the target, and the replicas' losses combine into the full-batch loss (docs/balance.md).

The weights of the combination make it equal the full-batch loss, so the gradients are the same as with the
outputs gathered and the criterion run once; only the scalars travel to the output device.
"""

import torch
import torch.nn as nn

from ._functions import Gather
from .replicate import replicate

__all__ = ["loss_rule", "criterion_replicas", "ReplicaLoss", "pair", "combine"]

_RATIO = (nn.CrossEntropyLoss, nn.NLLLoss)


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


def loss_rule(criterion, target, dim):
    """How the replicas' losses combine into the full-batch loss: "sum", "mean", "ratio" or "none".

    "mean" weights each replica's loss by its chunk's share of the batch. "ratio" is for CrossEntropyLoss and
    NLLLoss with class-index targets, whose mean divides by the summed class weights of the targets that are not
    ``ignore_index``: each replica returns its sum and that denominator, and the total is sum / denominator.
    """
    reduction = getattr(criterion, "reduction", "mean")
    if reduction == "sum":
        return "sum"
    if reduction == "none":
        return "none"
    if reduction == "batchmean":  # KLDivLoss: the sum over the chunk divided by its size along dim 0
        return "mean" if dim == 0 else "sum"
    if reduction == "mean":
        t = _first_tensor(target)
        if isinstance(criterion, _RATIO) and t is not None and not t.is_floating_point():
            return "ratio"
        return "mean"
    raise ValueError(
        f"criterion.reduction is {reduction!r}; fastdp combines per-replica losses for 'mean', 'sum', 'batchmean' "
        "and 'none'"
    )


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
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the criterion returned {type(loss).__name__} in replica {i}; expected a tensor")
        if rule != "none" and loss.numel() != 1:
            raise ValueError(
                f"the criterion returned a tensor of shape {tuple(loss.shape)} in replica {i} with reduction "
                f"{rule!r}; expected a scalar"
            )
    if rule == "none":
        return gather(losses)
    if rule == "sum":
        return _scalars_to(losses, device).sum()
    if rule == "ratio":
        sums = _scalars_to(losses, device)
        dens = _scalars_to([r[1].to(losses[0].dtype) for r in results], device)
        return sums.sum() / dens.sum()
    counts = []
    for t in targets:
        first = _first_tensor(t)
        counts.append(first.shape[dim] if first is not None and first.dim() > 0 else 1)
    total = sum(counts)
    # Each loss weighted on its own device by a Python number: a weight tensor made from a list on a CUDA device
    # would be a host-to-device copy that waits for the device in every step.
    return _scalars_to([loss * (c / total) for loss, c in zip(losses, counts)], device).sum()


def pair(replicas, criterion, devices, target, dim):
    """(the replicas as the ReplicaLoss their workers run, the rule that combines their losses): each replica gets
    its own copy of the criterion (``criterion_replicas``); ``devices`` are the replicas' devices and ``target``
    the first running chunk's target (its dtype decides the rule)."""
    rule = loss_rule(criterion, target, dim)
    copies = criterion_replicas(criterion, devices, rule)
    return [ReplicaLoss(r, c, rule) for r, c in zip(replicas, copies)], rule
