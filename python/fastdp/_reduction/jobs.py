"""A started sum as its backward holds it: computed already (``Finished``), running on the host reducer thread
(``HostJob``), or enqueued on the reduction's CUDA streams (fastdp._reduction.cuda.CudaJob). ``take()`` hands the
sum to the delivery node once; ``restore`` is the finalizer that gives no_sync's unsynced sums back if it never
is."""

import threading

__all__ = ["Finished", "HostJob"]


class Finished:
    """A sum computed already. ``take()`` hands it over once; ``restore``: the finalizer (on the backward's
    _Backward) that holds the unsynced sums again if it never is."""

    __slots__ = ("value", "restore", "__weakref__")

    def __init__(self, value):
        self.value, self.restore = value, None

    def take(self):
        if self.restore is not None:
            self.restore.detach()
        value, self.value = self.value, None  # (autograd takes the sum as .grad only if nothing else holds it)
        return value


class HostJob:
    """A sum started on the reducer thread; ``take()`` waits for it and raises what it raised (the only kind of
    sum that can keep backward waiting in the delivery node)."""

    __slots__ = ("value", "restore", "done", "error", "__weakref__")

    def __init__(self):
        self.value = self.restore = self.error = None
        self.done = threading.Event()

    def take(self):
        self.done.wait()
        if self.error is not None:
            error, self.error = self.error, None  # (its traceback holds this frame: no cycle through the job)
            raise error
        if self.restore is not None:
            self.restore.detach()
        value, self.value = self.value, None
        return value
