"""Out-of-memory rescue for ``fastdp.DataParallel(..., oom="rebalance")`` and its test hook, ``fastdp.inject_oom``.

NOTE [out-of-memory rescue]: what fastdp runs itself, it can run again. A forward over several devices is fastdp's
from scatter to gather: when a replica (or the gather) raises ``torch.OutOfMemoryError``, the wrapper puts the
master's buffers back as they were before the step (BatchNorm counts the batch once), lets go of everything the
failed attempt held, moves half of that device's rows to the others (for good: the next steps use the new split)
and runs the forward once more with the same batch. The backward is the user's (``loss.backward()``): once it has
failed, what it wrote cannot be told apart from what was there. So ``dp.train_step(...)`` runs forward and
backward for the user: its backward computes the gradients with ``torch.autograd.grad`` and adds them to ``.grad``
only when all of them exist, so a failed backward leaves ``.grad`` as it was; then it moves rows and runs forward and
backward once more. A second failure raises the first error, with advice. See docs/balance.md.
"""

import re
import traceback
import warnings

import torch

from .._platform import devices as _devices
from .._report import recorder as _recorder, report as _report
from . import split as _split
from .._step import step as _step

__all__ = ["parse", "run_rescued", "train_step", "Injection", "inject_oom", "OOM"]

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

_GPU = re.compile(r"GPU (\d+)")
_POSITION = re.compile(r"position (\d+)")


class Rescue:
    """The wrapper's ``oom="rebalance"`` state: the rescues so far, as (position, rows before, rows after)."""

    def __init__(self):
        self.rescues = []


def parse(oom):
    """``oom=``: None (an out-of-memory error is raised as it is) or "rebalance"."""
    if oom is None:
        return None
    if oom != "rebalance":
        raise ValueError(
            f"oom={oom!r}: expected None (out-of-memory errors raised as they are) or 'rebalance' (move rows away "
            "from the device that ran out and run the step again once)"
        )
    return Rescue()


class _Buffers:
    """The master's buffers before a step (what a forward changes: BatchNorm statistics), to put back after a
    failed attempt."""

    def __init__(self, module):
        self.saved = [(b, b.clone()) for b in module.buffers() if not b.requires_grad] if module.training else []

    def restore(self):
        with torch.no_grad():
            for b, copy in self.saved:
                b.copy_(copy)


def _free(error):
    """Lets go of what a failed attempt's frames held (partial outputs, activations) while keeping the error. (The
    gradient sums a failed backward started were dropped with it: fastdp._reduction.reducer._Backward.)"""
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)


def failed_position(wrapper, step, error):
    """The device_ids position that ran out of memory: the failing replica's (parallel_apply says which), the
    injected one's, the GPU the message names, else device_ids[0] (it holds the gathered outputs, the loss and the
    reduced gradients)."""
    index = getattr(error, "_fastdp_replica", None)
    if index is not None and step is not None and step.run is not None and index < len(step.run):
        return step.run[index]
    position = getattr(error, "_fastdp_position", None)
    if position is not None:
        return position
    text = str(error)
    found = _POSITION.search(text)
    if found and int(found.group(1)) < len(wrapper.device_ids):
        return int(found.group(1))
    found = _GPU.search(text)
    if found and int(found.group(1)) in wrapper.device_ids:
        return wrapper.device_ids.index(int(found.group(1)))
    return 0


def _rows(wrapper, step, inputs, kwargs):
    """Rows per position of the failed attempt (torch.chunk's rule when no split was given)."""
    if step is not None and step.chunk_sizes is not None:
        return list(step.chunk_sizes)
    batch = _split.batch_size(inputs, kwargs, wrapper.dim) or 0
    n = len(wrapper.device_ids)
    sizes = [c.shape[0] for c in torch.empty(batch, 0).chunk(n)] if batch else []
    return sizes + [0] * (n - len(sizes))


def move_rows(wrapper, step, position, inputs, kwargs):
    """Halves ``position``'s rows for this and the next steps; (rows before, rows after), or None when it has no
    row left to give."""
    before = _rows(wrapper, step, inputs, kwargs)
    if before[position] < 1 or len(before) < 2:
        return None
    rule = wrapper.__dict__.get("_split")
    if isinstance(rule, _split.AutoSplit):
        rule.avoid(position)
    else:
        weights = [float(n) for n in before]
        weights[position] /= 2
        wrapper.__dict__["_split"] = _split.parse_chunk_sizes(weights, len(wrapper.device_ids))
    batch = sum(before)
    after = _split.split_for(wrapper.__dict__["_split"], (torch.empty(batch, 0),), {}, 0, len(before))
    return before, after


def _advise(error, wrapper, position, moved, again=None):
    """Adds the advice to the first error (a note where Python has them, else its message)."""
    device = wrapper.device_ids[position]
    name = "cpu" if device == _devices.CPU else f"cuda:{device}"
    if moved is None:
        what = f"{name} (position {position}) had no rows left to give"
    else:
        what = (f"moved rows away from {name} (position {position}: {moved[0][position]} -> {moved[1][position]} "
                f"rows of {sum(moved[0])}) and ran the step once more with the same batch")
        if again is not None:
            what += f", which failed too ({type(again).__name__})"
    fixes = []
    if wrapper.__dict__.get("_criterion") is None:
        fixes.append("criterion= (the loss on each replica: no outputs or their gradients gathered on device 0)")
    fixes += ["a smaller share for that device (chunk_sizes=)", "a smaller batch"]
    note = f"fastdp (oom='rebalance'): out of memory; {what}. To fit: " + "; or ".join(fixes) + "."
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}",) + error.args[1:]
    error._fastdp_rescued = True


def _note(wrapper, position, moved):
    wrapper.__dict__["_oom"].rescues.append((position, moved[0], moved[1]))
    warnings.warn(
        f"fastdp (oom='rebalance'): out of memory at position {position}; its rows {moved[0][position]} -> "
        f"{moved[1][position]} for this and the next steps (split {moved[0]} -> {moved[1]}), and the step ran again",
        RuntimeWarning, stacklevel=4)


def _retry_step(wrapper, step):
    if step.recorder is not None:
        step.recorder.discard_open()  # the failed attempt is not a step of the report
    again = _step.Step(wrapper, step.loss)
    again.avoided_gather_bytes = step.avoided_gather_bytes
    again.recorder = wrapper.__dict__.get("_recorder")
    return again


def run_rescued(wrapper, step, inputs, kwargs):
    """The forward of a wrapper with ``oom="rebalance"``: see NOTE [out-of-memory rescue]."""
    return _twice(wrapper, step, inputs, kwargs, lambda: wrapper._run_step(step, inputs, kwargs),
                  lambda: wrapper._run_step(_retry_step(wrapper, step), inputs, kwargs))


def _twice(wrapper, step, inputs, kwargs, attempt, retry):
    """``attempt()``; on an out-of-memory error, the buffers put back, rows moved away from the failing device and
    ``retry()`` once; a second failure raises the first error with advice."""
    buffers = _Buffers(wrapper.module)
    try:
        return attempt()
    except OOM as error:
        if getattr(error, "_fastdp_rescued", False):
            raise  # a rescue inside (the forward's own) already ran it twice
        _free(error)
        buffers.restore()
        position = failed_position(wrapper, step, error)
        moved = move_rows(wrapper, step, position, inputs, kwargs)
        if moved is None:
            _advise(error, wrapper, position, None)
            raise
        _note(wrapper, position, moved)
        try:
            return retry()
        except OOM as again:
            _free(again)
            buffers.restore()
            _advise(error, wrapper, position, moved, again)
        raise error


def _loss_of(out, loss_fn):
    loss = loss_fn(out) if loss_fn is not None else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "dp.train_step: the forward (or loss_fn) must give a one-element loss tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; pass criterion= to "
            "DataParallel and target= here, or loss_fn=lambda out: ... that returns the loss"
        )
    return loss


def _forward_backward(wrapper, inputs, kwargs, loss_fn, params):
    """One attempt; ``.grad`` is written only once every gradient exists."""
    loss = _loss_of(wrapper(*inputs, **kwargs), loss_fn)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g
    return loss.detach()


def train_step(wrapper, inputs, kwargs, loss_fn):
    """``dp.train_step``: forward, loss and backward in one call, rescued as a whole under ``oom="rebalance"``."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"dp.train_step: loss_fn must be callable (output -> loss), got {type(loss_fn).__name__}")
    rescue = wrapper.__dict__.get("_oom")
    if rescue is None or not wrapper.__dict__.get("_sync_enabled", True):
        # Nothing to roll back (no rescue), or no_sync()'s per-replica sums, which a failed backward leaves partial.
        loss = _loss_of(wrapper(*inputs, **kwargs), loss_fn)
        loss.backward()
        return loss.detach()
    params = [p for p in wrapper.module.parameters() if p.requires_grad]

    def attempt():
        return _forward_backward(wrapper, inputs, kwargs, loss_fn, params)

    return _twice(wrapper, None, inputs, kwargs, attempt, attempt)


# ---- the test hook ----------------------------------------------------------------------------------------------


class Injection:
    """An out-of-memory error injected into an emulated replica (``fastdp.inject_oom``). ``fired``: how many
    times it was raised. ``remove()`` ends it."""

    def __init__(self, wrapper, position, phase, above, times):
        self.wrapper, self.position, self.phase, self.above, self.times = wrapper, position, phase, above, times
        self.fired = 0

    def _due(self, position, args, kwargs):
        if position != self.position or (self.times is not None and self.fired >= self.times):
            return None
        rows = _split.batch_size(args, kwargs, self.wrapper.dim) or 0
        return rows if rows > self.above else None

    def _error(self, rows):
        self.fired += 1
        error = OOM(f"CUDA out of memory (injected by fastdp.inject_oom in the {self.phase} of the replica at "
                    f"position {self.position}: {rows} rows, more than {self.above})")
        error._fastdp_position = self.position
        return error

    def forward(self, position, args, kwargs):
        if self.phase == "forward":
            rows = self._due(position, args, kwargs)
            if rows is not None:
                raise self._error(rows)

    def backward(self, position, args, kwargs, output):
        if self.phase != "backward":
            return
        rows = self._due(position, args, kwargs)
        if rows is None:
            return
        outs = _recorder.graph_tensors(output, [])

        def fail(grad_outputs):
            raise self._error(rows)

        if outs:
            outs[0].grad_fn.register_prehook(fail)

    def remove(self):
        rec = self.wrapper.__dict__.get("_recorder")
        if rec is not None and rec.inject is self:
            rec.inject = None
        _report.start_recording(self.wrapper)


def inject_oom(dp, position, *, phase="forward", above=0, times=None):
    """Test hook: the emulated replica at ``device_ids`` position ``position`` raises ``torch.OutOfMemoryError``
    in its ``phase`` ("forward", or "backward": when the gradient reaches its outputs) whenever its chunk has more
    than ``above`` rows, at most ``times`` times (None: every time). For ``device_ids=["cpu"] * N`` wrappers, where
    no allocation can fail. Returns the :class:`Injection` (``.fired``, ``.remove()``)."""
    ids = getattr(dp, "device_ids", None)
    if not ids or any(d != _devices.CPU for d in ids):
        raise ValueError("inject_oom: dp must be a fastdp.DataParallel over emulated replicas (device_ids=['cpu'] "
                         "* N); on GPUs allocations fail for real")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(ids):
        raise ValueError(f"inject_oom: position={position!r} must be a device_ids position in [0, {len(ids)})")
    if phase not in ("forward", "backward"):
        raise ValueError(f"inject_oom: phase={phase!r} must be 'forward' or 'backward'")
    if isinstance(above, bool) or not isinstance(above, int) or above < 0:
        raise ValueError(f"inject_oom: above={above!r} must be a non-negative int (rows)")
    if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 1):
        raise ValueError(f"inject_oom: times={times!r} must be None or a positive int")
    injection = Injection(dp, position, phase, above, times)
    rec = dp.__dict__.get("_recorder") or _recorder.Recorder(4, internal=True)
    rec.inject = injection
    dp.__dict__["_recorder"] = rec
    _report.start_recording(dp)
    return injection
