"""The shim's side of the binding: dtype codes for the core, tensor preparation and the per-device streams that
order core work (PyTorch's current stream of each CUDA device; none for host tensors)."""

import torch

from . import _C
from ._fallback import core as _guarded_core  # the staged retry below falls back to torch when the core cannot

_CODES = _C.dtype_codes()
_CORE_DTYPES = {
    torch.bool: _CODES["bool"],
    torch.uint8: _CODES["uint8"],
    torch.int8: _CODES["int8"],
    torch.int16: _CODES["int16"],
    torch.int32: _CODES["int32"],
    torch.int64: _CODES["int64"],
    torch.float16: _CODES["float16"],
    torch.bfloat16: _CODES["bfloat16"],
    torch.float32: _CODES["float32"],
    torch.float64: _CODES["float64"],
}
_C.set_dtypes(_CORE_DTYPES, torch.Tensor)

_DTYPE_KEYS = {}


def dtype_key(dtype):
    """A small int per torch dtype, so that buckets never mix dtypes of one element size."""
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        key = _DTYPE_KEYS.setdefault(dtype, len(_DTYPE_KEYS))
    return key


def prepare(t):
    """The tensor whose memory the core may read: conjugate and negative bits applied."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def to_core_dtype(t):
    """Complex tensors are summed as their real pairs; every other dtype as itself."""
    return torch.view_as_real(t) if t.is_complex() else t


def streams_for(tensors):
    """(device, stream handle) of PyTorch's current stream for each CUDA device among tensors; None if none."""
    seen = None
    for t in tensors:
        if t.is_cuda:
            if seen is None:
                seen = {}
            index = t.get_device()
            if index not in seen:
                seen[index] = torch.cuda.current_stream(index).cuda_stream
    return None if seen is None else list(seen.items())


def reduce_columns(columns, outs):
    """outs[j] = sum of columns[j] in order, in one core call (dense, core dtypes). CUDA inputs spread over several
    devices with no NCCL to sum them are first staged on each output's device, then summed there."""
    try:
        _C.reduce_many(columns, outs, streams_for([*outs, *(t for c in columns for t in c)]))
    except _C.BackendUnavailableError:
        staged = [[t if t.device == o.device else t.to(o.device) for t in c] for c, o in zip(columns, outs)]
        _guarded_core.reduce_many(staged, outs, streams_for([*outs, *(t for c in staged for t in c)]))
