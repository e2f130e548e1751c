"""Flat buffers and the per-member tensors over them: how a bucket's members are packed into one tensor and cut
out of it again (the kept replicas' buffers, packed sums, the sums handed to ``.grad``)."""

import torch

from .. import _C

__all__ = ["flatten", "unflatten", "result_views"]

_unflatten_dense = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
flatten = getattr(getattr(torch._C, "_nn", None), "flatten_dense_tensors", None)  # None on a torch without it


def unflatten(flat, like, sizes, shapes):
    """Views of `flat` shaped like the tensors `like` (torch's C++ loop where it has one)."""
    if _unflatten_dense is not None:
        return _unflatten_dense(flat, like)
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def result_views(flat, bucket):
    """Per member of `bucket`, a tensor over `flat` shaped like it, for results nobody differentiates through
    (reduced gradients): the C shim makes plain tensors sharing flat's memory (about a third of the cost of torch's
    unflatten into autograd views, docs/benchmarks.md), torch makes views where the shim cannot, detached by
    ``.data`` into plain tensors too. Either way each has a version counter of its own, as a gradient autograd made
    would: zeroing one member's ``.grad`` in place must not look like a change to the others' (NOTE [no_sync sums])."""
    views = _C.views(flat, bucket.spec)
    if views is not None:
        return views
    return [v.data for v in unflatten(flat, bucket.like, bucket.sizes, bucket.shapes)]
