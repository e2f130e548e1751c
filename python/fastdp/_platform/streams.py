"""The CUDA streams that order the shim's own work, and the CUDA-graph capture check.

Work that fastdp runs for the caller, in the caller's thread or in a thread acting for it (a replica worker, the
SyncBatchNorm exchange, autograd's backward threads), is ordered on the caller's current stream of each device:
``current`` captures those streams in the caller's thread and ``entered`` makes them current again elsewhere. A
thread's current stream is its own (a new thread starts on each device's default stream), so work that skipped this
would race with the caller's work on a non-default stream.
"""

import contextlib

import torch

from .. import _C
from . import devices as _devices

__all__ = ["current", "cuda_indices", "entered", "order", "Fence", "refuse_capture"]


def current(devices):
    """This thread's current stream of each distinct CUDA device among ``devices`` (normalised: ints or "cpu"), in
    first-seen order; an empty tuple when none is a CUDA device."""
    seen = {}
    for d in devices:
        if d != _devices.CPU and d not in seen:
            seen[d] = torch.cuda.current_stream(d)
    return tuple(seen.values())


def cuda_indices(devices):
    """The distinct CUDA device indices among ``devices`` (normalised), in first-seen order."""
    return tuple(dict.fromkeys(d for d in devices if d != _devices.CPU))


def _handle(stream):
    return (stream.device_index, stream.cuda_stream)


def order(pairs):
    """For each (waiter, signal) pair of CUDA streams: the waiter waits, without blocking the host, for the work
    enqueued so far on the signal stream (another device's too). The core does it, through the driver."""
    pairs = [(_handle(w), _handle(s)) for w, s in pairs if w != s]
    if pairs:
        _C.order([w for w, _ in pairs], [s for _, s in pairs])


class Fence:
    """The point each of ``streams`` has reached now (CUDA streams; the core records one event per stream): other
    streams can wait for it, and the host can ask whether the work before it has completed."""

    __slots__ = ("_fence",)

    def __init__(self, streams):
        self._fence = _C.Fence([_handle(s) for s in streams])

    def wait(self, stream):
        """``stream`` waits (without blocking the host) for the work before the fence, on every fenced stream."""
        self._fence.wait([_handle(stream)])

    def done(self):
        """Whether the work before the fence has completed on every fenced stream (the host does not wait)."""
        return self._fence.done()


def entered(streams):
    """A context in which each of ``streams`` is the current stream of its device (nothing for an empty tuple)."""
    if not streams:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    try:
        for s in streams:
            stack.enter_context(torch.cuda.stream(s))
    except BaseException:
        stack.close()
        raise
    return stack


def refuse_capture(what):
    """Raises when the current CUDA stream is capturing a graph: ``what`` (a multi-device forward, a gradient
    reduction) hops threads, enqueues work on several devices' streams and waits on the host, none of which a CUDA
    graph can record. Call it only where CUDA devices are in use."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fastdp: {what} cannot run while the current CUDA stream is capturing a CUDA graph (torch.cuda.graph, "
            "CUDAGraph.capture_begin, torch.compile's mode='reduce-overhead'): it runs replicas on worker threads "
            "and orders work across several devices, which a graph capture cannot record. Run the fastdp step "
            "outside the capture, or capture the module on a single device without the wrapper."
        )
