"""What ``no_sync()`` keeps: the unsynced sums, one unit of bookkeeping. Under ``no_sync()`` replica 0's gradients
go to the master's ``.grad`` at once and every other replica's are added to that replica's unsynced sums, until the
next synchronising backward reduces them with its own gradients (NOTE [no_sync sums]). The reducer
(fastdp._reduction.reducer) is this unit's only caller; nothing here sums across replicas.

NOTE [no_sync sums]
Under DDP's no_sync, whose contract fastdp keeps, each rank accumulates its own gradients in .grad, and what the
user does to .grad (zero_grad in either set_to_none mode, p.grad = None, a new optimizer's zero_grad) is done to
that accumulation. Here replica 0 plays the rank: its gradients are returned to autograd, which accumulates them
in the master's .grad; the other replicas' are summed per replica into their unsynced sums (no reduction while
no_sync lasts). A member replica 0 did not use takes another replica's gradient instead, so whatever a member
accumulated shows in its .grad. Only what autograd accumulates into .grad is added: a backward that leaves a
member's .grad alone (torch.autograd.grad, backward(inputs=...) naming other tensors) gets that member's full sum,
as the bare model's, and adds nothing for it. At the end of each no_sync backward the master's .grad objects and
version counters are noted (``UnsyncedSums.mark``); before the unsynced sums are used, a member whose .grad is gone,
replaced or zeroed since was cleared by the user, and its unsynced sums are dropped with it. A .grad changed in
place to anything but zeros cannot be applied to sums kept apart, and raises instead of being silently ignored.
A synchronising backward that fails gives back the unsynced sums of every bucket it did not deliver (the reducer's
_Backward). Two rare failures lose them instead: one between a delivery and its AccumulateGrad (a hook on a master
parameter raising, or on CUDA devices another device failing in between), and a failing create_graph=True
backward, whose differentiable sums take them at once.
"""

import weakref

import torch

from .flat import flatten, result_views

__all__ = ["NoSync", "UnsyncedSums", "member_rows"]

_graph_task_id = torch._C._current_graph_task_id  # the backward running in this thread (torch 2.1 and newer)
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class NoSync:
    """A replica set's no_sync bookkeeping across its buckets: whether any bucket holds unsynced sums (``held``:
    the next synchronising backward must reduce them), and which backwards' ends note the master's ``.grad``
    (``marking``) and reduce what is left (``flushing``), by graph task id."""

    __slots__ = ("held", "marking", "flushing")

    def __init__(self):
        self.held = False
        self.marking = None
        self.flushing = None

    def flush_at_end(self, flush):
        """The first backward after no_sync that writes gradients: ``flush()`` at its end reduces the unsynced sums
        of the buckets it never reaches (or of members it leaves out); once per backward, and a backward that fails
        never flushes, so its unsynced sums stay."""
        task = _graph_task_id()
        if self.flushing != task:
            self.flushing = task
            _queue_callback(flush)

    def mark_at_end(self, mark):
        """A no_sync backward: ``mark()`` at its end notes the master's ``.grad`` (once per backward; one that
        failed before its end never ran its callback, which ``UnsyncedSums.drop_cleared`` allows for)."""
        task = _graph_task_id()
        if self.marking != task:
            self.marking = task
            _queue_callback(mark)

    def marks_stale(self):
        """Whether the last no_sync backward failed before its end noted the master's ``.grad``."""
        return self.marking is not None and self.marking != _graph_task_id()


class UnsyncedSums:
    """One bucket's unsynced sums: per replica 1.., per member, the gradients accumulated under no_sync
    (``rows[0]`` is None: replica 0's went to ``.grad``), or one packed sum per replica (``packed``); ``marks``,
    the master's ``.grad`` per member as the last no_sync backward left it; ``returned``, sums taken by backwards
    that failed before delivering, to be held again."""

    __slots__ = ("rows", "packed", "marks", "returned")

    def __init__(self):
        self.rows = None
        self.packed = False
        self.marks = None
        self.returned = []

    def add(self, bucket, rows, nosync):
        """Adds replicas 1.. 's gradients (`rows`): packed into one tensor per replica where every member is there
        and dense (and what is held is packed too), else member by member."""
        if not self._add_packed(bucket, rows):
            self._add_members(bucket, rows)
        nosync.held = True

    def _add_packed(self, bucket, rows):
        """The packed way, where it applies; whether it did."""
        held = self.rows
        if not bucket.pack or (held is not None and not self.packed) or not _all_dense(rows[1:]):
            return False
        flats = [flatten([g.detach() for g in row]) for row in rows[1:]]
        if not all(f.dtype == bucket.dtype for f in flats):
            return False
        if held is None:  # one member: the packed tensor is a view of autograd's gradient, not a copy
            flats = [f.clone() if len(row) == 1 else f for f, row in zip(flats, rows[1:])]
        else:
            flats = [acc[0] + f for acc, f in zip(held[1:], flats)]
        self.rows, self.packed = [None] + [[f] for f in flats], True
        return True

    def _add_members(self, bucket, rows):
        by_member = self.by_member(bucket)
        for row, acc in zip(rows[1:], by_member[1:]):
            for j, g in enumerate(row):
                if g is not None:
                    g = g.detach()
                    acc[j] = g.clone() if acc[j] is None else acc[j] + g
        self.rows = by_member

    def by_member(self, bucket):
        """The sums member by member (packed ones cut into views), empty rows where nothing is held."""
        if self.rows is None:
            self.packed = False
            return [None] + [[None] * len(bucket.members) for _ in range(1, bucket.nrep)]
        if self.packed:
            self.rows = [None] + [list(result_views(acc[0], bucket)) for acc in self.rows[1:]]
            self.packed = False
        return self.rows

    def take(self, bucket, accumulating=None):
        """The sums, taken for the reduction that consumes them: (packed, per replica: one packed tensor or a row of
        members; None for replica 0), or None. With `accumulating` (per member), only the members this backward
        accumulates into .grad are taken; the others' stay."""
        if self.rows is None or (accumulating is not None and not any(accumulating)):
            return None
        if accumulating is not None and not all(accumulating):
            return False, self._take_members(bucket, accumulating)
        packed = self.packed
        rows = [None] + [acc[0] if packed else acc for acc in self.rows[1:]]
        self.rows, self.packed = None, False
        return packed, rows

    def _take_members(self, bucket, accumulating):
        rows = self.by_member(bucket)
        taken = [None] + [[acc if accumulating[j] else None for j, acc in enumerate(row)] for row in rows[1:]]
        for row in rows[1:]:
            for j, flag in enumerate(accumulating):
                if flag:
                    row[j] = None
        self._forget_if_empty()
        return taken

    def _forget_if_empty(self):
        if all(acc is None for row in self.rows[1:] for acc in row):
            self.rows = None

    def give_back(self, taken):
        """Sums taken for a sum that was never delivered (its backward failed), to be held again by ``take_back``
        before the bucket's next use (this runs whenever the failed backward's graph is freed, possibly in the
        middle of other work, so it only appends)."""
        self.returned.append(taken)

    def take_back(self, bucket, nosync):
        """Holds again what failed backwards gave back. The reducer's lock is held."""
        while self.returned:
            taken = self.returned.pop()
            now = self.by_member(bucket)
            for row, back in zip(now[1:], member_rows(bucket, taken)[1:]):
                for j, acc in enumerate(back):
                    if acc is not None:
                        row[j] = acc if row[j] is None else row[j] + acc
            self.rows = now
            nosync.held = True

    def drop_cleared(self, bucket, nosync, network):
        """Whether sums are still held, once those of members whose master ``.grad`` the user cleared since the
        last no_sync backward are dropped (NOTE [no_sync sums]). `network`: the master module, naming a parameter
        in the error for a ``.grad`` changed in place."""
        if self.rows is None or self.marks is None:
            return self.rows is not None
        # A no_sync backward that failed before its end (an error in a hook, Ctrl-C) never took the marks: what it
        # accumulated counts as held, and only a .grad now gone or zero counts as cleared.
        stale = nosync.marks_stale()
        rows = self.rows[1:]
        members = range(len(bucket.members))
        held = members if self.packed else [j for j in members if any(row[j] is not None for row in rows)]
        cleared = [j for j in held if _cleared(bucket.master[j], self.marks[j], stale, network)]
        if len(cleared) == len(bucket.members):
            self.rows = None
        elif cleared:  # (the marks are taken again at the end of the next no_sync backward)
            for row in self.by_member(bucket)[1:]:
                for j in cleared:
                    row[j] = None
            self._forget_if_empty()
        return self.rows is not None

    def mark(self, bucket):
        """Notes each master member's ``.grad`` (object and version), so that a later clear is seen."""
        if self.rows is not None:
            self.marks = [_grad_mark(p.grad) for p in bucket.master]


def _all_dense(rows):
    """Whether every replica has every member's gradient, and none is sparse."""
    return not any(g is None or g.is_sparse for row in rows for g in row)


def member_rows(bucket, taken):
    """Taken sums member by member (packed ones cut into views)."""
    packed, rows = taken
    if not packed:
        return rows
    return [None] + [list(result_views(acc, bucket)) for acc in rows[1:]]


def _grad_mark(g):
    return None if g is None else (weakref.ref(g), g._version)


def _cleared(p, mark, stale, network):
    """Whether master parameter p's .grad was cleared since `mark` (gone, replaced, or zeroed in place); with
    `stale` marks, whether it is gone or zero."""
    if mark is None and not stale:
        return False  # nothing was accumulated for p: nothing is held for it either
    g = p.grad
    if g is None:
        return True
    if stale:
        return not (g._values() if g.is_sparse else g).any()
    if g is not mark[0]():
        return True
    if g._version == mark[1]:
        return False
    if not (g._values() if g.is_sparse else g).any():
        return True
    name = next((n for n, q in network.named_parameters() if q is p), None) if network is not None else None
    raise RuntimeError(
        f"the .grad of parameter {name or tuple(p.shape)!r} was changed in place while gradients accumulated "
        "under no_sync() were not yet reduced: .grad shows replica 0's share only (the others' are kept apart "
        "until the next backward outside no_sync()), so a change other than clearing it (zero_grad(), "
        "p.grad = None) cannot be applied to them. Change .grad after the backward outside no_sync()."
    )


