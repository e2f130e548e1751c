"""The sum of one bucket across replicas, wherever it runs: the replicas' gradients of each member added, with the
unsynced sums no_sync held for them, into one flat buffer on device_ids[0] (one core call for the whole bucket)."""

import operator
from itertools import repeat

import torch

from .. import _C, comm
from .._native.core import reduce_columns, to_core_dtype
from .flat import flatten, result_views
from .unsynced import member_rows

__all__ = ["bucket_sum", "reduce_members", "replica_rows"]

_is_sparse = operator.attrgetter("is_sparse")


def bucket_sum(bucket, grads, taken, out):
    """One gradient (or None) per member: the replicas' sum plus the unsynced sums `taken` from the bucket, into
    `out` (a flat buffer of the bucket on device_ids[0]) or a new one."""
    if out is None:
        out = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.tdevs[0])
    if not bucket.host:
        grads = every_device(bucket, grads)
    if bucket.host and taken is None and _summed_by_plan(bucket, grads, out):
        return tuple(result_views(out, bucket))  # each member summed in place, nothing packed
    if _packable(bucket, grads, taken):
        result = _reduce_packed(bucket, grads, taken, out)
        if result is not None:
            return result
    return reduce_members(bucket, replica_rows(bucket, grads, taken), out)


def every_device(bucket, grads):
    """`grads` with zeros, on its replica's device, for each member a replica gave no gradient for while another
    replica did (a device that ran no rows this step, a parameter its forward skipped): every member is then summed
    over the replica set's full device list. Across distinct devices a sum is one NCCL collective over the devices
    of its inputs, and a device list NCCL has not seen would set up a communicator set of its own (memory on every
    device, and seconds) in the middle of backward. Zeros add nothing to the sum. On the reduction's streams, where
    the sum reads them."""
    if all(map(operator.is_not, grads, repeat(None))):
        return grads
    k, out = len(bucket.members), list(grads)
    for j in range(k):
        present = next((g for g in grads[j::k] if g is not None), None)
        if present is None or present.is_sparse:
            continue  # no replica's gradient (the member's .grad stays as it is); or sparse: summed through comm
        for r in range(bucket.nrep):
            if out[r * k + j] is None:
                out[r * k + j] = torch.zeros_like(present, device=bucket.tdevs[r])
    return out


def _summed_by_plan(bucket, grads, out):
    """The host replicas' sums through the bucket's prepared sum (its members' shapes, dtype and offsets checked
    once, when the first sum runs): per step only each gradient's data pointer is taken, after a check that it is
    still a dense host tensor shaped and typed as its member. False, with nothing written, where one is not (a
    gradient of other strides, dtype or shape; a missing one) or the bucket's dtype has no host sum: the other
    paths then sum, with their own checks and errors."""
    plan = bucket.rows
    if plan is None:
        try:
            plan = _C.PreparedSum(bucket.master, bucket.nrep)
        except (TypeError, ValueError, RuntimeError):  # a dtype the host sum lacks (complex), a tensor it cannot
            plan = False  # describe (torch refuses a sparse tensor's data pointer): the general path sums them all
        bucket.rows = plan
    return plan is not False and plan.run(grads, out)


def _packable(bucket, grads, taken):
    """Whether the packed path may run: every replica produced every member's dense gradient (the common case),
    and the unsynced sums taken are packed too."""
    return (bucket.pack and (taken is None or taken[0]) and not any(map(operator.is_, grads, repeat(None)))
            and not any(map(_is_sparse, grads)))


def _reduce_packed(bucket, grads, taken, out):
    """Each replica's gradients packed into one flat tensor by torch's C++ and the packed tensors summed in one core
    call, with the packed unsynced sums. None where packing changed a dtype (the caller then takes the per-member
    path)."""
    k, nrep = len(bucket.members), bucket.nrep
    flats = [flatten(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if not all(f.dtype == bucket.dtype for f in flats):
        return None
    if taken is not None:
        flats = [f if acc is None else acc + f for acc, f in zip(taken[1], flats)]
    if bucket.dtype.is_complex:
        reduce_columns([[to_core_dtype(f) for f in flats]], [to_core_dtype(out)])
    else:
        reduce_columns([flats], [out])
    return tuple(result_views(out, bucket))


def replica_rows(bucket, grads, taken):
    """Per replica, per member, the gradient to sum: this backward's plus the unsynced sums `taken`."""
    k, nrep = len(bucket.members), bucket.nrep
    rows = [list(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    if taken is None:
        return rows
    for row, acc_row in zip(rows[1:], member_rows(bucket, taken)[1:]):
        for j, acc in enumerate(acc_row):
            if acc is not None:
                row[j] = acc if row[j] is None else acc + row[j]
    return rows


def reduce_members(bucket, rows, out):
    """Column by column in one core call into views of `out` (sparse gradients through comm)."""
    dest = bucket.tdevs[0]
    result = [None] * len(bucket.members)
    columns, outs = [], []
    views = None
    complex_ = bucket.dtype.is_complex  # one dtype per bucket: only complex buckets need the real-pair views
    for j in range(len(result)):
        column = [row[j] for row in rows if row[j] is not None]
        if not column:
            continue
        if any(g.is_sparse for g in column):
            result[j] = comm.reduce_add([g.to(dest) if g.device != dest else g for g in column], dest)
            continue
        if views is None:  # every member's view of one flat result, in one call
            views = result_views(out, bucket)
        result[j] = views[j]
        columns.append([to_core_dtype(_dense(g)) if complex_ else _dense(g) for g in column])
        outs.append(to_core_dtype(views[j]) if complex_ else views[j])
    if columns:
        reduce_columns(columns, outs)
    return tuple(result)


def _dense(g):
    return g if g.is_contiguous() else g.contiguous()
