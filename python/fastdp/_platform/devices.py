"""Device normalisation for the DataParallel layer: CUDA entries become int indices, CPU entries the string "cpu".

Upstream keeps device ids as ints (``_get_device_index``); fastdp adds ``"cpu"`` entries, each an emulated
replica device of its own, so a normalised device list is either all ints or all ``"cpu"``.
"""

import operator

import torch

CPU = "cpu"
_CPU_DEVICE = torch.device("cpu")


def _parse(d):
    """int / str / torch.device → torch.device or int; unknown strings raise torch's own RuntimeError."""
    if isinstance(d, torch.device):
        return d
    if isinstance(d, str):
        return torch.device(d)
    if isinstance(d, bool):
        raise TypeError(f"expected a device (int, str or torch.device), got bool {d!r}")
    try:
        return operator.index(d)
    except TypeError:
        raise TypeError(f"expected a device (int, str or torch.device), got {type(d).__name__} {d!r}") from None


def is_cpu(d):
    """True for the entries that name the host: "cpu", "cpu:0", torch.device("cpu")."""
    if d.__class__ is str and d == CPU:  # the normalised entry, as each step passes it: nothing to parse
        return True
    if isinstance(d, (str, torch.device)):
        return _parse(d).type == "cpu"
    return False


def cuda_index(d, what="device"):
    """A CUDA device entry → its int index (upstream's _get_device_index(d, True) for CUDA devices)."""
    if is_cpu(d):
        # Upstream's text, from torch._utils._get_device_index.
        raise ValueError(f"Expected a non cpu device, but got: {_parse(d)}")
    return normalize(d, what)


def normalize(d, what="device"):
    """fastdp's one device normaliser (the DataParallel layer and fastdp.comm): any accepted entry → "cpu" or a
    CUDA index (int; "cuda" without an index is the current device).

    Raises, naming ``what``: TypeError for bools and non-devices, ValueError for unknown strings, negative indices
    and device types other than CPU and CUDA, BackendUnavailableError for a CUDA device where CUDA cannot run.
    """
    if d.__class__ is str and d == CPU:  # already normalised, as each step's lists are: nothing to parse
        return CPU
    if isinstance(d, bool):
        raise TypeError(f"{what}: expected a device (int, str or torch.device), got bool {d!r}")
    if isinstance(d, str):
        try:
            d = torch.device(d)
        except RuntimeError as e:
            raise ValueError(
                f"{what}: unknown device string {d!r} ({e}); use \"cpu\", \"cuda\" or \"cuda:K\""
            ) from None
    if isinstance(d, torch.device):
        return _from_torch(d, what)
    try:
        index = operator.index(d)
    except TypeError:
        raise TypeError(f"{what}: expected a device (int, str or torch.device), got {type(d).__name__} {d!r}") from None
    if index < 0:
        raise ValueError(f"{what}: device index must be non-negative, got {index}; use \"cpu\" for the host")
    return _require_cuda(index, what)


def _from_torch(d, what):
    if d.type == "cpu":
        return CPU
    if d.type != "cuda":
        raise ValueError(f"{what}: fastdp runs on CPU and CUDA devices, got a {d.type} device ({d})")
    _require_cuda(d, what)
    if d.index is None:
        return torch.cuda.current_device()
    return d.index


def _require_cuda(d, what):
    """d itself when CUDA can run here; otherwise an error naming the entry (not torch's bare AssertionError)."""
    if not cuda_available():
        from .._C import BackendUnavailableError

        why = "this torch build has no CUDA" if not torch.backends.cuda.is_built() else "no CUDA device is visible"
        shown = f"cuda:{d}" if isinstance(d, int) else str(d)
        raise BackendUnavailableError(
            f"{what}: {shown} is a CUDA device, but {why}; use \"cpu\" devices (emulated replicas) on this machine"
        )
    return d


def normalize_list(devices, what="device_ids"):
    """A device list → list of ints or list of "cpu"; mixing the two raises ValueError naming the fix."""
    if isinstance(devices, (str, torch.device, int)) or not hasattr(devices, "__iter__"):
        raise TypeError(
            f"{what} must be a list of devices (e.g. ['cpu'] * 2 or [0, 1]), got {type(devices).__name__} "
            f"{devices!r}"
        )
    devices = list(devices)
    kinds = {is_cpu(d) for d in devices}  # before normalising: a mix is named even where CUDA cannot run
    if len(kinds) > 1:
        raise ValueError(
            f"{what} mixes 'cpu' entries with CUDA devices ({list(devices)!r}). fastdp emulates replicas on the "
            f"host only when every entry is 'cpu': pass {what}=['cpu'] * N for emulated replicas, or CUDA "
            "device indices only (e.g. [0, 1])."
        )
    return [normalize(d, what) for d in devices]


def torch_device(d):
    """A normalised entry → torch.device ("cpu" stays the host; ints become cuda:k)."""
    if d == CPU:
        return _CPU_DEVICE
    device = _CUDA_DEVICES.get(d)
    if device is None:  # made once per index: torch.device objects never change, and each step asks for several
        device = _CUDA_DEVICES.setdefault(d, torch.device("cuda", d))
    return device


_CUDA_DEVICES = {}


def of_tensor(t):
    """The normalised device of a tensor (read through flags: ``t.device`` makes a device object per read)."""
    if t.is_cuda:
        return t.get_device()
    return CPU if t.is_cpu else t.device.index


def cuda_available():
    """Whether a CUDA device can run replicas (never initialises a CUDA context)."""
    return torch.cuda.is_available()


def require_indexable(device_ids):
    if not (hasattr(device_ids, "__getitem__") and hasattr(device_ids, "__len__")) or isinstance(
        device_ids, (str, torch.device)
    ):
        raise TypeError(
            f"device_ids must be a list or tuple of devices (DataParallel reads device_ids[0]), got "
            f"{type(device_ids).__name__} {device_ids!r}"
        )
