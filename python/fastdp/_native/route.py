"""Which implementation serves each of the shim's data-moving calls (copy, broadcast, scatter, gather, reduce_many):
the one place that decides.

The C core serves every call it can. Its own router picks the backend (host, cuda or nccl: NOTE [routing] in
csrc/core/backend.h), and when no backend can run a call here it raises ``BackendUnavailableError`` saying why (no
usable driver, no kernels for this GPU, CUDA or NCCL disabled). That answer routes the call on:

- a sum whose inputs sit on other CUDA devices than its output, which the core cannot run together (no NCCL), is
  staged: each input is copied to its output's device, and the core sums there;
- otherwise torch serves it (``fastdp._native.fallback``: the same work in the same order and rounding), after the one
  ``FallbackWarning`` of the process, which names the reason and the fix; under ``FASTDP_STRICT=1`` the error is
  raised instead.

Any other failure (a CUDA or NCCL error, bad input) is an error to report, never a reason to take another route.
The decision is made per call: the core may serve one call (on the host, between devices with a flat copy) and not
another (a strided copy that needs a kernel).
"""

from .. import _C
from . import fallback as _fallback

__all__ = ["copy", "broadcast", "scatter", "gather", "reduce_many"]


def _core_or_torch(name, args):
    try:
        return getattr(_C, name)(*args)  # looked up per call, so that tests can stand in for the core
    except _C.BackendUnavailableError as e:
        return _torch(name, args, e)


def _torch(name, args, why):
    _fallback.take_over(why, f"fastdp.comm's {name}")
    return getattr(_fallback, name)(*args)


def copy(dsts, srcs, streams):
    """dsts[i] = srcs[i], each on its destination device's listed stream."""
    return _core_or_torch("copy", (dsts, srcs, streams))


def broadcast(src, dsts, streams):
    """Every dst = src."""
    return _core_or_torch("broadcast", (src, dsts, streams))


def scatter(src, outs, dim, chunk_sizes, streams):
    """outs[i] = the i-th chunk of src along dim (``chunk_sizes`` long each)."""
    return _core_or_torch("scatter", (src, outs, dim, chunk_sizes, streams))


def gather(inputs, out, dim, streams):
    """out = the inputs concatenated along dim."""
    return _core_or_torch("gather", (inputs, out, dim, streams))


def reduce_many(columns, outs, streams):
    """outs[j] = sum of columns[j], added in order; staged on each output's device when the core cannot sum across
    the devices (``streams`` already lists every output device's stream)."""
    try:
        return _C.reduce_many(columns, outs, streams)
    except _C.BackendUnavailableError as e:
        if all(t.device == out.device for column, out in zip(columns, outs) for t in column):
            return _torch("reduce_many", (columns, outs, streams), e)  # nothing to stage
    staged = [[t if t.device == out.device else t.to(out.device) for t in column] for column, out in zip(columns, outs)]
    return _core_or_torch("reduce_many", (staged, outs, streams))
