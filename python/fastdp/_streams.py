"""The CUDA streams that order the shim's own work, and the CUDA-graph capture check.

Work that fastdp runs for the caller, in the caller's thread or in a thread acting for it (a replica worker, the
SyncBatchNorm exchange, autograd's backward threads), is ordered on the caller's current stream of each device:
``current`` captures those streams in the caller's thread and ``entered`` makes them current again elsewhere. A
thread's current stream is its own (a new thread starts on each device's default stream), so work that skipped this
would race with the caller's work on a non-default stream.
"""

import contextlib

import torch

from . import _devices

__all__ = ["current", "entered", "refuse_capture"]


def current(devices):
    """This thread's current stream of each distinct CUDA device among ``devices`` (normalised: ints or "cpu"), in
    first-seen order; an empty tuple when none is a CUDA device."""
    seen = {}
    for d in devices:
        if d != _devices.CPU and d not in seen:
            seen[d] = torch.cuda.current_stream(d)
    return tuple(seen.values())


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
