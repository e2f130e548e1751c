"""What the wrapper checks and decides as upstream's DataParallel does: its device arguments (``resolve``), the
module it wraps, the GPUs' balance at construction, and at each forward whether the module and the inputs are on
device_ids[0]; keyword arguments given whole to each replica (``broadcast=``) are moved here too."""

import warnings
from itertools import chain

import torch
from torch.nn.modules import Module

from .. import _C
from .._platform import devices as _devices

__all__ = ["IMBALANCE_WARNING", "check_balance", "require_module", "whole_on", "resolve", "inputs_on",
           "check_module_device"]

_HOST = torch.device("cpu")
_Tensor = torch.Tensor

IMBALANCE_WARNING = (
    "There is an imbalance between your GPUs. You may want to exclude GPU {} which has less than 75% of the "
    "memory or cores of GPU {}. You can do so by setting the device_ids argument to DataParallel, or by setting "
    "the CUDA_VISIBLE_DEVICES environment variable."
)


def check_balance(device_ids):
    """Upstream's constructor warning for GPUs with unequal memory (or, failing that, unequal core counts)."""
    props = [torch.cuda.get_device_properties(i) for i in device_ids]
    for get in (lambda p: p.total_memory, lambda p: p.multi_processor_count):
        values = [get(p) for p in props]
        lo = min(range(len(values)), key=values.__getitem__)
        hi = max(range(len(values)), key=values.__getitem__)
        if values[lo] / values[hi] < 0.75:
            warnings.warn(IMBALANCE_WARNING.format(device_ids[lo], device_ids[hi]), stacklevel=3)
            return


def require_module(module, what):
    if not isinstance(module, Module):
        raise TypeError(
            f"{what}: module must be a torch.nn.Module (its parameters and buffers are replicated), got "
            f"{type(module).__name__}; wrap a plain function in an nn.Module subclass"
        )


def whole_on(values, device):
    """Keyword arguments given whole to a replica on ``device`` (tensors copied there, differentiably)."""
    if _devices.is_cpu(device):
        return values
    target = _devices.torch_device(device)

    def move(obj):
        if isinstance(obj, torch.Tensor):
            return obj.to(target)
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(move(x) for x in obj)
        if isinstance(obj, dict):
            return type(obj)((k, move(v)) for k, v in obj.items())
        return obj

    return {k: move(v) for k, v in values.items()}


def _is_host_index(d):
    """-1: upstream's deprecated "gather to the host" output device."""
    return isinstance(d, int) and not isinstance(d, bool) and d == -1


def resolve(device_ids, output_device):
    """(mode, device_ids, output_device) with mode "cpu", "cuda", or None for upstream's pass-through.

    CPU entries select emulated replicas on any machine; otherwise, as upstream, no GPU means pass-through.
    """
    if device_ids is not None:
        _devices.require_indexable(device_ids)
        if any(_devices.is_cpu(d) for d in device_ids):
            ids = _devices.normalize_list(device_ids, "device_ids")
            if output_device is None or _devices.is_cpu(output_device):
                out = _devices.CPU
            elif _is_host_index(output_device):
                out = -1  # Gathers to the host with upstream's FutureWarning.
            else:
                raise ValueError(
                    f"output_device={output_device!r} is a CUDA device but device_ids are emulated 'cpu' replicas; "
                    "with 'cpu' device_ids leave output_device unset or pass 'cpu'"
                )
            return "cpu", ids, out
    if not _devices.cuda_available():
        return None, [], None
    if device_ids is None:
        device_ids = list(range(torch.cuda.device_count()))
    if output_device is None:
        output_device = device_ids[0]  # IndexError for device_ids=[], as upstream.
    ids = [_devices.cuda_index(d, "device_ids") for d in device_ids]
    if _devices.is_cpu(output_device):
        out = _devices.CPU  # Deliberate: upstream raises here although -1 (deprecated) means the same.
    elif _is_host_index(output_device):
        out = -1  # upstream keeps -1 (gathers to the host with its FutureWarning)
    else:
        out = _devices.cuda_index(output_device, "output_device")
    return "cuda", ids, out


def _on_device(obj, device):
    """Whether every tensor in a (nested) input is on `device`; other values count as there."""
    if isinstance(obj, torch.Tensor):
        return obj.device == device
    if isinstance(obj, (list, tuple)):
        return all(_on_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return all(_on_device(o, device) for o in obj.values())
    return True


def inputs_on(inputs, kwargs, device):
    """Whether every input is on ``device`` (the one-device short path's question, each forward). The common case,
    top-level tensors, is unrolled, and on the host each tensor's ``is_cpu`` flag is read instead of a device object
    made and compared."""
    host = device == _HOST
    for o in inputs:
        if isinstance(o, _Tensor):
            if not (o.is_cpu if host else o.device == device):
                return False
        elif not _on_device(o, device):
            return False
    return not kwargs or _on_device(kwargs, device)


def check_module_device(module, src_device_obj):
    """Upstream's per-forward check that every parameter and buffer is on device_ids[0].

    One walk in C over the modules' own dicts (no generator chain, no names, no interpreter loop per tensor); on
    the host the test is ``is_cpu`` (a flag read, cheaper than building a torch.device per tensor). Only when
    something is off does the upstream-ordered walk run, so the error names the same tensor's device as upstream's
    would.
    """
    if not _C.on_device(module, src_device_obj, src_device_obj == _HOST):
        _raise_module_device(module, src_device_obj)


def _raise_module_device(module, src_device_obj):
    for t in chain(module.parameters(), module.buffers()):
        if t.device != src_device_obj:
            # Upstream's text.
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {src_device_obj} (device_ids[0]) but found one of "
                f"them on device: {t.device}"
            )
