"""What fastdp can do on this machine: versions, backends (compiled, usable, why not), GPUs and peer access."""

import platform

import torch

from . import _C, __version__


def _version(v):
    """13000 → "13.0"; NCCL's 22703 → "2.27.3"; 0 → None."""
    if not v:
        return None
    if v >= 10000 and v < 100000 and v % 10 == 0 and v // 1000 < 20:  # CUDA: major*1000 + minor*10
        return f"{v // 1000}.{(v % 1000) // 10}"
    if v >= 20000:  # NCCL ≥ 2.9: major*10000 + minor*100 + patch
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return str(v)


def collect(memory=False):
    """Machine facts. Free GPU memory is read only on GPUs whose CUDA context already exists (PyTorch or fastdp used
    them) unless ``memory`` is true: reading it elsewhere creates a context on each such GPU (seconds and hundreds of
    MB while it lives, and an error under exclusive-process mode); ``free_bytes`` is None where it was not read."""
    core = _C.info(memory=memory)
    torch_nccl = None
    if torch.cuda.is_available():
        try:
            torch_nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # torch built without NCCL
            torch_nccl = None
    return {
        "fastdp": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_cuda_runtime": torch.version.cuda,
        "torch_nccl": torch_nccl,
        "cuda_driver": _version(core["cuda_driver_version"]),
        "nccl": _version(core["nccl_version"]),
        "nccl_library": core["nccl_library"] or None,
        "backends": core["backends"],
        "devices": core["devices"],
    }


def _gib(n):
    return f"{n / 2**30:.1f} GiB"


def render(info):
    lines = [
        f"fastdp {info['fastdp']}  torch {info['torch']}  python {info['python']}",
        f"CUDA driver {info['cuda_driver'] or 'not found'}; torch's CUDA runtime {info['torch_cuda_runtime'] or 'none (CPU build)'}",
        f"NCCL {info['nccl'] or 'not loaded'}" + (f" ({info['nccl_library']})" if info["nccl_library"] else "")
        + (f"; torch's NCCL {info['torch_nccl']}" if info["torch_nccl"] else ""),
        "",
        "backend  compiled  usable  why not",
    ]
    for name, b in info["backends"].items():
        lines.append(f"{name:<8} {'yes' if b['compiled'] else 'no':<9} {'yes' if b['usable'] else 'no':<7} "
                     f"{'' if b['usable'] else b['why']}")
    devices = info["devices"]
    lines.append("")
    if not devices:
        lines.append("GPUs: none visible (the host backend serves \"cpu\" device entries: emulated replicas)")
    else:
        lines.append("GPU  name                              total       free")
        for d in devices:
            free = _gib(d["free_bytes"]) if d["free_bytes"] is not None else "?"
            lines.append(f"{d['index']:<4} {d['name'][:33]:<33} {_gib(d['total_bytes']):>10} {free:>10}"
                         + (f"  ({d['error']})" if d["error"] else ""))
        if any(d["free_bytes"] is None for d in devices):
            lines.append("? free memory not read on GPUs no process context uses yet (--memory reads it there too)")
        lines.append("")
        lines.append("peer access (row → column): " + " ".join(str(d["index"]) for d in devices))
        for d in devices:
            lines.append(f"  {d['index']}: " + " ".join("Y" if p else "." for p in d["peer_access"]))
    return "\n".join(lines)
