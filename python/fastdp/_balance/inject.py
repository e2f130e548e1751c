"""``fastdp.inject_oom``: the test hook of the out-of-memory rescue, for emulated replicas, where no allocation can
fail. The injection runs where the step's recording runs each replica (fastdp._report.recorder.ReplicaSite)."""

import contextlib
import threading

import torch

from .._platform import devices as _devices
from .._report import recorder as _recorder
from . import split as _split
from .rescue import OOM

__all__ = ["Injection", "inject_oom"]


class Injection:
    """An out-of-memory error injected into an emulated replica (``fastdp.inject_oom``). ``fired``: how many
    times it was raised. ``remove()`` ends it."""

    def __init__(self, wrapper, position, phase, above, times, error=None):
        self.wrapper, self.position, self.phase, self.above, self.times = wrapper, position, phase, above, times
        self.make_error = error  # None: torch.OutOfMemoryError; else a callable that makes the exception raised
        self.fired = 0

    def _due(self, position, args, kwargs):
        if position != self.position or (self.times is not None and self.fired >= self.times):
            return None
        rows = _split.batch_size(args, kwargs, self.wrapper.dim) or 0
        return rows if rows > self.above else None

    def _error(self, rows):
        self.fired += 1
        if self.make_error is not None:
            error = self.make_error()
        else:
            error = OOM(f"CUDA out of memory (injected by fastdp.inject_oom in the {self.phase} of the replica at "
                        f"position {self.position}: {rows} rows, more than {self.above})")
        error._fastdp_position = self.position
        return error

    @contextlib.contextmanager
    def forward(self, position, args, kwargs):
        """Around the replica's call: the error, when due, is raised by the first module forward this thread enters,
        the replica's own, as a real allocation failing there is (what wraps the replica, the synced layers' session
        among them, sees it end with the error)."""
        rows = self._due(position, args, kwargs) if self.phase == "forward" else None
        if rows is None:
            yield
            return
        thread = threading.get_ident()

        def fail(module, inputs):
            if threading.get_ident() == thread:
                handle.remove()
                raise self._error(rows)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(fail)
        try:
            yield
        finally:
            handle.remove()

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
        self.wrapper._uninject(self)


def inject_oom(dp, position, *, phase="forward", above=0, times=None, error=None):
    """Test hook: the emulated replica at ``device_ids`` position ``position`` raises ``torch.OutOfMemoryError``
    in its ``phase`` ("forward", or "backward": when the gradient reaches its outputs) whenever its chunk has more
    than ``above`` rows, at most ``times`` times (None: every time). ``error``: a callable that makes the exception
    to raise instead (an allocation failure in another library's words: cuBLAS's, NCCL's; or any other error).
    For ``device_ids=["cpu"] * N`` wrappers, where no allocation can fail. Returns the :class:`Injection`
    (``.fired``, ``.remove()``)."""
    _check_where(dp, position)
    _check_when(phase, above, times, error)
    injection = Injection(dp, position, phase, above, times, error)
    dp._inject(injection)
    return injection


def _check_where(dp, position):
    """inject_oom's wrapper and position checked: a ValueError that names the argument and what it takes."""
    ids = getattr(dp, "device_ids", None)
    if not ids or any(d != _devices.CPU for d in ids):
        raise ValueError("inject_oom: dp must be a fastdp.DataParallel over emulated replicas (device_ids=['cpu'] "
                         "* N); on GPUs allocations fail for real")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(ids):
        raise ValueError(f"inject_oom: position={position!r} must be a device_ids position in [0, {len(ids)})")


def _check_when(phase, above, times, error):
    """inject_oom's phase, threshold, count and error checked: a ValueError or TypeError that names the argument."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"inject_oom: phase={phase!r} must be 'forward' or 'backward'")
    if isinstance(above, bool) or not isinstance(above, int) or above < 0:
        raise ValueError(f"inject_oom: above={above!r} must be a non-negative int (rows)")
    if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 1):
        raise ValueError(f"inject_oom: times={times!r} must be None or a positive int")
    if error is not None and not callable(error):
        raise TypeError(f"inject_oom: error={error!r} must be None (torch.OutOfMemoryError) or a callable that "
                        "returns the exception to raise (an exception class, or lambda: RuntimeError('...'))")
