"""The torch route: torch's own implementation of the core's data-moving calls, and what taking it says.

``fastdp._native.route`` sends a call here when fastdp's C core cannot run it (``BackendUnavailableError``: no CUDA
driver it can use, no kernels for this GPU (no NVRTC and no matching fatbin), CUDA disabled...). The functions below do
the same work with ``Tensor.copy_`` and ``torch.add`` (what ``torch.nn.parallel.comm`` does underneath), in the same
order and rounding, with the core's signatures. ``take_over`` warns once per process, naming the reason and the fix;
``FASTDP_STRICT=1`` (declared in csrc/base/param.c) makes it raise that error instead, for benchmarks and checks that
must prove the C paths ran.
"""

import contextlib
import os
import sys
import threading
import warnings

import torch

from .. import _C

__all__ = ["FallbackWarning", "reason", "strict", "take_over", "copy", "broadcast", "scatter", "gather", "reduce_many",
           "user_stacklevel"]


class FallbackWarning(UserWarning):
    """fastdp's C core could not run an operation; torch's implementation ran it."""


_lock = threading.Lock()
_reason = None

# What to do about a reason, by the words the C core uses in it (first match wins).
_FIXES = (
    ("FASTDP_DISABLE_CUDA", "unset FASTDP_DISABLE_CUDA"),
    ("NVRTC", "pip install nvidia-cuda-nvrtc matching the driver (PyTorch's CUDA wheels bring it), or reinstall "
              "fastdp on a machine where nvcc is found"),
    ("no fastdp kernels", "install the nvidia-cuda-nvrtc that matches the driver, or update the driver"),
    ("libcuda", "install the NVIDIA driver (R525 or newer; R580 or newer with CUDA 13 libraries)"),
    ("driver", "update the NVIDIA driver (R525 or newer; R580 or newer with CUDA 13 libraries)"),
    ("NCCL", "pip install nvidia-nccl-cu13 (or -cu12), or unset FASTDP_DISABLE_NCCL"),
)


def strict():
    """True when FASTDP_STRICT asks for errors instead of the torch fallback."""
    return os.environ.get("FASTDP_STRICT", "0").strip() not in ("", "0")


def reason():
    """Why this process fell back to torch (the first reason), or None when it never did."""
    return _reason


def _fix(message):
    for words, fix in _FIXES:
        if words in message:
            return fix
    return "see `python -m fastdp info` for what is missing"


def take_over(exc, op):
    """Torch is about to run ``op`` because the core raised ``exc``: raises under FASTDP_STRICT; otherwise records
    the reason and warns the first time."""
    global _reason
    if strict():
        raise _C.BackendUnavailableError(
            f"{exc} (FASTDP_STRICT is set, so fastdp does not fall back to torch)"
        ) from exc
    with _lock:
        first = _reason is None
        if first:
            _reason = str(exc)
    if first:
        warnings.warn(
            f"fastdp: the C core cannot run {op} here ({exc}); torch's own implementation is used instead, "
            f"for this and every later call that needs it. Fix: {_fix(str(exc))}. Set FASTDP_STRICT=1 to make "
            "this an error. (Shown once per process.)",
            FallbackWarning,
            stacklevel=user_stacklevel(),
        )


def user_stacklevel():
    """The warning's stack level that names the user's line: the first frame that is neither fastdp's nor torch's
    (the data moves run inside autograd Functions and Module.__call__), whichever path led here. On a thread that
    fastdp or torch started, no frame is the user's, and the thread's start is named."""
    frame, level = sys._getframe(1), 1  # the frame calling warnings.warn is its level 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_THE_USERS):
        frame, level = frame.f_back, level + 1
    return level


# The package folders of fastdp (this file's folder's parent) and of torch: frames there are not the user's.
_NOT_THE_USERS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                       for f in (os.path.dirname(os.path.abspath(__file__)), torch.__file__))


def _on_stream(streams, t):
    """The listed stream of t's device as the current stream (the core orders its work there); else nothing."""
    if not streams or not t.is_cuda:
        return contextlib.nullcontext()
    index = t.get_device()
    for dev, handle in streams:
        if dev == index and handle != torch.cuda.current_stream(index).cuda_stream:
            return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=t.device))
    return contextlib.nullcontext()


def copy(dsts, srcs, streams=None):
    with torch.no_grad():  # a data move, as the core's: never recorded by autograd (sources may be parameters)
        for d, s in zip(dsts, srcs):
            with _on_stream(streams, d):
                d.copy_(s)


def broadcast(src, dsts, streams=None):
    copy(dsts, [src] * len(dsts), streams)


def _same_view(a, b):
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def scatter(src, outs, dim, chunk_sizes, streams=None):
    for o, piece in zip(outs, src.split(list(chunk_sizes), dim)):
        if not _same_view(o, piece):  # the source's own entry is a view of it: nothing to move
            with _on_stream(streams, o):
                o.copy_(piece)


def gather(inputs, out, dim, streams=None):
    start = 0
    with _on_stream(streams, out):
        for t in inputs:
            n = t.shape[dim]
            out.narrow(dim, start, n).copy_(t)
            start += n


def _sum_into(inputs, out):
    """out = ((in0 + in1) + in2) + ..., rounding to the dtype after every add, as the core's kernels do."""
    acc = inputs[0].to(out.device)
    for t in inputs[1:]:
        acc = torch.add(acc, t.to(out.device))
    out.copy_(acc)


def _reduce(inputs, out, streams=None):
    with _on_stream(streams, out):
        _sum_into(list(inputs), out)


def reduce_many(columns, outs, streams=None):
    for column, out in zip(columns, outs):
        _reduce(column, out, streams)
