"""The out-of-memory rescue of ``fastdp.DataParallel(..., oom="rebalance")``: the forward's (``Rescue.run``) and
``dp.train_step``'s (``train_step``). The wrapper hands it what one step needs (a :class:`Context`) and the attempt,
a callable; the rescue decides what is put back, where the rows go, and runs the attempt again.

NOTE [out-of-memory rescue]: what fastdp runs itself, it can run again, and a rescued step is an ordinary step. A
forward over several devices is fastdp's from scatter to gather: when a replica (or the gather) runs out of memory
(``torch.OutOfMemoryError``, or another library's allocation failure: :func:`out_of_memory`), the rescue puts back what the failed attempt changed (every buffer of the module, in
whatever mode its layers ran, with its size and storage; the random generators; the report's record of the
attempt), lets go of everything the attempt held, halves that device's weight in the split, for good (again until
it runs fewer rows than the attempt ran), and runs the forward once more with the same batch. The backward is the user's
(``loss.backward()``): once it has failed, what it wrote cannot be told apart from what was there. So
``dp.train_step(...)`` runs forward and backward for the user: its backward takes the gradients of every leaf of
the loss's graph (what ``loss.backward()`` would fill: parameters of the module and of the loss, inputs) with
``torch.autograd.grad`` and adds them to ``.grad`` only when all of them exist, so a failed backward leaves
``.grad`` as it was; what ``no_sync()`` kept is reduced into ``.grad`` before the first attempt. Then it moves rows
and runs forward and backward once more. A second failure raises the first error, with advice. One rescue per
step: train_step's forward is rescued by train_step's rescue, as part of the whole step. See docs/balance.md,
"What a rescued step keeps".
"""

import collections
import re
import threading
import traceback
import warnings

import torch
from torch.nn.parameter import is_lazy

from .. import _C
from .._platform import devices as _devices
from . import split as _split

__all__ = ["parse", "Rescue", "Context", "train_step", "OOM", "out_of_memory"]

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

# Allocation failures in other libraries' words, raised as RuntimeError (or fastdp.NcclError) rather than
# torch.OutOfMemoryError: CUDA's own ("CUDA error: out of memory": memory taken outside PyTorch's allocator, a
# context), the CUDA libraries' handles and workspaces (cuBLAS's CUBLAS_STATUS_ALLOC_FAILED, cuDNN's, cuSOLVER's,
# cuSPARSE's, cuFFT's CUFFT_ALLOC_FAILED), and NCCL's communicator set-up, whose last error names the allocation
# ("Failed to CUDA calloc ...", "Cuda failure 'out of memory'", "posix_fallocate failed: No space left on device").
# An NCCL system error that names no allocation is not one: it is as likely a socket or a missing /dev/shm.
_ALLOCATION_FAILED = re.compile(
    r"\bout of memory\b|_ALLOC_FAILED\b|fail\w*\s+to\s+(?:cuda\s+)?(?:c|m|re|f)?alloc|"
    r"\b(?:c|m|re|posix_f)alloc\w*\s+failed|no space left on device", re.IGNORECASE)

_GPU = re.compile(r"GPU (\d+)")
_POSITION = re.compile(r"position (\d+)")

Context = collections.namedtuple(
    "Context", ["module", "device_ids", "dim", "gathers_outputs", "split", "set_split", "failed", "inputs", "kwargs",
                "mark_records", "reduce_unsynced", "settle"])
Context.__doc__ = """What the rescue of one step needs from the wrapper: its ``module`` (whose buffers are put back),
``device_ids`` and ``dim``; ``gathers_outputs``: whether the outputs are gathered on device 0 (no ``criterion=``);
``split()`` and ``set_split(rule)``: read and replace the wrapper's split rule; ``failed()``: what the failed
attempt's forward ran (the wrapper's last fastdp._step.Outcome: its chunk sizes and the positions that ran a
replica), read once it has failed; the step's ``inputs`` and ``kwargs``; ``mark_records()``: a callable that
forgets the steps the report recorded since (those of a failed attempt); ``reduce_unsynced()``: reduces into
``.grad`` what no_sync() kept (train_step, whose gradients autograd returns rather than accumulates); ``settle()``:
waits for the reductions the failed attempt left in flight and releases their memory, before the step runs again."""


def out_of_memory(error):
    """Whether `error` says an allocation failed, whoever raised it: torch.OutOfMemoryError (fastdp's core raises
    fastdp.CudaOutOfMemoryError, one of them), MemoryError (the host's; fastdp's core raises it when its own
    allocations fail), and a RuntimeError in the words of a library that allocates for itself (_ALLOCATION_FAILED).
    Other errors are the step's own: rows moved elsewhere would not help."""
    if isinstance(error, (OOM, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and _ALLOCATION_FAILED.search(str(error)) is not None


def parse(oom):
    """``oom=``: None (an out-of-memory error is raised as it is) or a :class:`Rescue` for "rebalance"."""
    if oom is None:
        return None
    if oom != "rebalance":
        raise ValueError(
            f"oom={oom!r}: expected None (out-of-memory errors raised as they are) or 'rebalance' (move rows away "
            "from the device that ran out and run the step again once)"
        )
    return Rescue()


class Rescue:
    """The wrapper's ``oom="rebalance"`` state: the rescues so far, as (position, rows before, rows after)."""

    def __init__(self):
        self.rescues = []
        self.buffers = None  # the module's buffers as before the step now running (_Buffers), kept across steps

    def __getstate__(self):
        state = self.__dict__.copy()
        state["buffers"] = None  # a cache of the module's buffers: a copied or unpickled wrapper takes its own
        return state

    def run(self, ctx, attempt):
        """``attempt()``; on an out-of-memory error, what the attempt changed put back (:class:`_Before`), rows moved
        away from the failing device and ``attempt()`` once more; a second failure raises the first error with
        advice (NOTE [out-of-memory rescue]). Inside this rescue's own attempt (train_step's forward), the attempt
        runs as it is: the outer rescue puts back and runs again the whole step."""
        outer = getattr(_running, "rescues", ())
        if any(r is self for r in outer):
            return attempt()
        _running.rescues = outer + (self,)
        try:
            return self._run(ctx, attempt)
        finally:
            _running.rescues = outer

    def _run(self, ctx, attempt):
        try:
            self.buffers = _Buffers.taken(self.buffers, ctx.module)
        except (RuntimeError, ValueError):
            if not any(map(is_lazy, ctx.module.buffers())):
                raise
            return attempt()  # a module no forward can run (uninitialized lazy layers): its own error
        before = _Before(ctx, self.buffers)
        try:
            return attempt()
        except Exception as error:
            if not out_of_memory(error) or getattr(error, "_fastdp_rescued", False):
                raise  # not an allocation failure; or a rescue inside (a nested wrapper's) already ran it twice
            _free(error)
            before.restore()
            position = failed_position(ctx, error)
            moved = move_rows(ctx, position)
            if moved is None:
                _advise(error, ctx, position, None)
                raise
            before.forget_records()  # the failed attempt is not a step of the report
            self._note(position, moved)
            ctx.settle()
            try:
                return attempt()
            except Exception as again:
                if not out_of_memory(again):
                    raise
                _free(again)
                before.restore()
                _advise(error, ctx, position, moved, again)
            raise error

    def _note(self, position, moved):
        self.rescues.append((position, moved[0], moved[1]))
        warnings.warn(
            f"fastdp (oom='rebalance'): out of memory at position {position}; its rows {moved[0][position]} -> "
            f"{moved[1][position]} for this and the next steps (split {moved[0]} -> {moved[1]}), and the step ran "
            "again", RuntimeWarning, stacklevel=5)


_running = threading.local()  # per thread: the rescues whose attempt runs now, innermost last


class _Before:
    """What an attempt can change, as it was before it, put back after it failed (docs/balance.md, "What a rescued
    step keeps"): the module's buffers, the random generators the replicas draw from, and the report's records
    (``forget_records``, before the step runs again; a step that fails twice keeps the record of its last
    attempt)."""

    def __init__(self, ctx, buffers):
        self.buffers = buffers
        self.generators = _Generators(ctx.device_ids)
        self.forget_records = ctx.mark_records()

    def restore(self):
        self.buffers.restore()
        self.generators.restore()


class _Buffers:
    """Every buffer of the module before a step, whatever the modes of its layers (a forward writes buffers in eval()
    too: BatchNorm layers left training for re-estimation, quantization observers, caches): the tensor each module
    holds under each name, its storage, its place there and its values, so that what a failed attempt wrote (in
    place or through ``.data``), resized, moved to other memory (``set_``) or rebound is put back as it was. The
    values are written back without a version bump (through ``.data``): a graph of an earlier forward that saved
    a buffer the attempt left alone stays valid, as on the bare model.

    Kept from step to step, so that a step that does not fail pays little: the copies are made once and refreshed
    by one fused copy per step, and the tensors, storages and places are noted once, while the module's structure
    signature (fastdp._C.walk: per buffer slot its tensor, shape, strides and data pointer) stays the same; a
    changed structure (a buffer rebound, resized or registered between steps) takes them anew. Which buffers a
    forward writes cannot be learned cheaply instead: BatchNorm writes its running statistics inside its kernel,
    without a version bump."""

    def __init__(self, module):
        self.module = module
        self.modules, self.signature = _C.walk(module)
        self.saved = [(m, name, b, b.untyped_storage(), _place(b)) for m in module.modules()
                      for name, b in m.named_buffers(recurse=False)]
        self.tensors = [b for _, _, b, _, _ in self.saved]
        with torch.no_grad():
            self.values = [b.clone(memory_format=torch.preserve_format) for b in self.tensors]

    @classmethod
    def taken(cls, kept, module):
        """The buffers of `module` now: `kept` (the last step's) with its values refreshed where the structure is
        unchanged, else taken anew."""
        if kept is None or kept.module is not module or _C.matches(kept.modules, kept.signature) != 1:
            return cls(module)
        try:
            with torch.no_grad():
                torch._foreach_copy_(kept.values, kept.tensors)
        except (RuntimeError, TypeError, ValueError):  # a buffer the fused copy does not take (an uninitialized one)
            return cls(module)
        return kept

    def restore(self):
        with torch.no_grad():
            for (m, name, b, storage, place), values in zip(self.saved, self.values):
                if getattr(m, name, None) is not b:
                    setattr(m, name, b)
                if _place(b) != place:
                    if storage.nbytes() != place[1]:
                        storage.resize_(place[1])  # grown in place by the attempt
                    b.set_(storage, place[2], place[3], place[4])
                b.data.copy_(values)


def _place(b):
    """Where a tensor's values are: (its storage's address and bytes, its offset, size and strides there)."""
    storage = b.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), b.storage_offset(), b.size(), b.stride()


class _Generators:
    """The default random generators the replicas draw from (the host's, and each CUDA device's of device_ids)
    before a step, put back after a failed attempt: the step run again draws what the failed attempt drew."""

    def __init__(self, device_ids):
        self.host = torch.get_rng_state()
        self.devices = {d: torch.cuda.get_rng_state(d) for d in set(device_ids) if d != _devices.CPU}

    def restore(self):
        torch.set_rng_state(self.host)
        for d, state in self.devices.items():
            torch.cuda.set_rng_state(state, d)


def _free(error):
    """Lets go of what a failed attempt's frames held (partial outputs, activations) while keeping the error. (The
    gradient sums a failed backward started were dropped with it: fastdp._reduction.reducer._Backward.)"""
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)


def failed_position(ctx, error):
    """The device_ids position that ran out of memory: the failing replica's (parallel_apply says which), the
    injected one's, the GPU the message names, else device_ids[0] (it holds the gathered outputs, the loss and the
    reduced gradients)."""
    failed = ctx.failed()
    index = getattr(error, "_fastdp_replica", None)
    if index is not None and failed is not None and failed.run is not None and index < len(failed.run):
        return failed.run[index]
    position = getattr(error, "_fastdp_position", None)
    if position is not None:
        return position
    text = str(error)
    found = _POSITION.search(text)
    if found and int(found.group(1)) < len(ctx.device_ids):
        return int(found.group(1))
    found = _GPU.search(text)
    if found and int(found.group(1)) in ctx.device_ids:
        return ctx.device_ids.index(int(found.group(1)))
    return 0


def _rows(ctx):
    """Rows per position of the failed attempt: the split its forward ran (torch.chunk's rule when the wrapper has
    no split rule)."""
    failed = ctx.failed()
    if failed is not None and failed.chunk_sizes is not None:
        return list(failed.chunk_sizes)
    batch = _split.batch_size(ctx.inputs, ctx.kwargs, ctx.dim) or 0
    n = len(ctx.device_ids)
    sizes = [c.shape[0] for c in torch.empty(batch, 0).chunk(n)] if batch else []
    return sizes + [0] * (n - len(sizes))


def move_rows(ctx, position):
    """Moves rows away from ``position`` for this and the next steps: its weight in the split halved (AutoSplit's
    ``avoid``); (rows before, rows after), or None when it has no row to give or no other device takes rows."""
    before = _rows(ctx)
    if before[position] < 1 or len(before) < 2:
        return None
    rule = ctx.split()
    if isinstance(rule, _split.AutoSplit):
        rule.avoid(position)
    else:
        rule = _halved(rule, position, before)
        if rule is None:
            return None
        ctx.set_split(rule)
    batch = sum(before)
    after = _split.split_for(rule, (torch.empty(batch, 0),), {}, 0, len(before))
    return before, after


def _halved(rule, position, before):
    """The rule's weights (torch.chunk's rule: equal ones) with ``position``'s halved, again until it runs fewer rows
    of this batch than the failed attempt's ``before``: the other devices keep their proportions for batches of any
    size (a device left without rows by a small batch is not left out for good, one the rule gives no weight stays
    idle). None when no other device has weight."""
    weights = _split.weights_of(rule, len(before))
    if not any(w > 0 for i, w in enumerate(weights) if i != position):
        return None
    batch = sum(before)
    while True:
        weights[position] /= 2
        halved = _split.parse_chunk_sizes(weights, len(before))
        if halved.split(batch, 0)[position] < before[position]:
            return halved


def _advise(error, ctx, position, moved, again=None):
    """Adds the advice to the first error (a note where Python has them, else its message)."""
    device = ctx.device_ids[position]
    name = "cpu" if device == _devices.CPU else f"cuda:{device}"
    if moved is None:
        what = f"{name} (position {position}) could give no rows away (it ran none, or no other device takes rows)"
    else:
        what = (f"moved rows away from {name} (position {position}: {moved[0][position]} -> {moved[1][position]} "
                f"rows of {sum(moved[0])}) and ran the step once more with the same batch")
        if again is not None:
            what += f", which failed too ({type(again).__name__})"
    fixes = []
    if ctx.gathers_outputs:
        fixes.append("criterion= (the loss on each replica: no outputs or their gradients gathered on device 0)")
    fixes += ["a smaller share for that device (chunk_sizes=)", "a smaller batch"]
    note = f"fastdp (oom='rebalance'): out of memory; {what}. To fit: " + "; or ".join(fixes) + "."
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}",) + error.args[1:]
    error._fastdp_rescued = True


# ---- dp.train_step ---------------------------------------------------------------------------------------------------


def _loss_of(out, loss_fn):
    loss = loss_fn(out) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "dp.train_step: the forward (or loss_fn) must give a one-element loss tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; pass criterion= to "
            "DataParallel and target= here, or loss_fn=lambda out: ... that returns the loss"
        )
    return loss


def _leaves(loss):
    """Every tensor whose ``.grad`` ``loss.backward()`` accumulates: the leaves of the loss's graph (the module's
    parameters, and whatever else the loss depends on: a criterion's parameters, a tensor used in ``loss_fn``,
    inputs that require grad), found from their AccumulateGrad nodes."""
    root = loss.grad_fn
    if root is None:
        return [loss] if loss.requires_grad else []
    seen, stack, found = {root}, [root], []
    while stack:
        node = stack.pop()
        if type(node).__name__ == "AccumulateGrad":
            found.append(node.variable)
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                stack.append(following)
    return found


def _accumulate(tensors, grads):
    """Adds each gradient to its tensor's ``.grad`` as autograd's AccumulateGrad does: an in-place sum where there is
    a ``.grad`` (out of place onto a sparse one from a dense gradient); else the gradient itself, or a copy in the
    tensor's layout where it is not laid out as the tensor (an expanded gradient) or was handed to another tensor
    already (autograd returns one tensor for both operands of a sum)."""
    given = set()
    with torch.no_grad():
        for t, g in zip(tensors, grads):
            if g is None:
                continue
            if t.grad is None:
                if id(g) in given or g.stride() != t.stride():
                    g = torch.empty_like(t, memory_format=torch.preserve_format).copy_(g)
                given.add(id(g))
                t.grad = g
            elif t.grad.is_sparse and not g.is_sparse:
                t.grad = t.grad + g
            else:
                t.grad += g


def _forward_backward(forward, loss_fn):
    """One attempt; ``.grad`` is written only once every gradient exists."""
    loss = _loss_of(forward(), loss_fn)
    tensors = _leaves(loss)
    if tensors:
        _accumulate(tensors, torch.autograd.grad(loss, tensors, allow_unused=True))
    else:
        loss.backward()  # torch's own error: nothing in the loss requires grad
    return loss.detach()


def train_step(forward, loss_fn, rescue, ctx):
    """``dp.train_step``: ``forward()``, the loss and backward in one call, rescued as a whole by `rescue` (None:
    no rescue, or none possible: no_sync()'s per-replica sums, which a failed backward leaves partial). Rescued,
    its gradients are taken with ``torch.autograd.grad``, which accumulates nothing: what no_sync() kept is reduced
    into ``.grad`` first, as the first backward after no_sync() would (and a failed attempt cannot touch it)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"dp.train_step: loss_fn must be callable (output -> loss), got {type(loss_fn).__name__}")
    if rescue is None:
        loss = _loss_of(forward(), loss_fn)
        loss.backward()
        return loss.detach()
    ctx.reduce_unsynced()
    return rescue.run(ctx, lambda: _forward_backward(forward, loss_fn))
