"""What fastdp can do on this machine: versions, backends (compiled, usable, why not, library found), where the
kernels come from (fatbin, NVRTC compiled now or from the disk cache), the torch fallback, GPUs and peer access."""

import platform

import torch

from .. import _C
from . import fallback as _fallback
from .._version import __version__


def _version(v):
    """13000 → "13.0"; NCCL's 22703 → "2.27.3"; 0 → None."""
    if not v:
        return None
    if v >= 10000 and v < 100000 and v % 10 == 0 and v // 1000 < 20:  # CUDA: major*1000 + minor*10
        return f"{v // 1000}.{(v % 1000) // 10}"
    if v >= 20000:  # NCCL ≥ 2.9: major*10000 + minor*100 + patch
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return str(v)


def _kernels():
    k = _C.kernels_info()
    major, minor = k["nvrtc_version"]
    devices = []
    for i, src in enumerate(k["devices"]):
        devices.append({"index": i, "source": src or "not loaded yet in this process"})
    return {
        "fatbin_bytes": k["fatbin_bytes"],
        "nvrtc": f"{major}.{minor}" if major else None,
        "nvrtc_library": k["nvrtc_library"] or None,
        "nvrtc_why": k["nvrtc_why"] or None,
        "cache_dir": k["cache_dir"] or None,
        "devices": devices,
    }


def _mapped(prefix):
    """The file of a loaded shared library whose name starts with prefix (Linux /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if path.rsplit("/", 1)[-1].startswith(prefix):
                    return path
    except OSError:
        pass
    return None


def _libraries(core, kernels):
    """Per backend: the library it found (path) and its version, or why none."""
    nccl_why = core["backends"]["nccl"]["why"]
    cuda_why = core["backends"]["cuda"]["why"]
    return {
        "host": {"library": None, "version": None},
        "cuda": {
            "library": (_mapped("libcuda.so") or "libcuda.so.1") if core["cuda_driver_version"] else None,
            "version": _version(core["cuda_driver_version"]),
            "why": None if core["cuda_driver_version"] else cuda_why,
        },
        "nvrtc": {"library": kernels["nvrtc_library"], "version": kernels["nvrtc"], "why": kernels["nvrtc_why"]},
        "nccl": {
            "library": core["nccl_library"] or None,
            "version": _version(core["nccl_version"]),
            "why": None if core["nccl_version"] else nccl_why,
        },
    }


def _kernel_source(kernels):
    """One line: where the kernels come from (or would come from) on this machine."""
    loaded = {d["source"] for d in kernels["devices"] if not d["source"].startswith("not loaded")}
    if loaded:
        return "; ".join(sorted(loaded))
    ways = []
    if kernels["fatbin_bytes"]:
        ways.append(f"fatbin ({kernels['fatbin_bytes']} bytes, built with nvcc)")
    if kernels["nvrtc"]:
        cache = f"cached in {kernels['cache_dir']}" if kernels["cache_dir"] else "memory only"
        ways.append(f"NVRTC {kernels['nvrtc']} at first use, {cache}")
    return (" or ".join(ways) + " (not loaded yet)") if ways else "none: no fatbin and no NVRTC"


def _tensor_path():
    """How tensors become core descriptors: libtorch's C shim ("aoti") or the tensor's Python API ("python"), and
    why that one."""
    name, why = _C.tensor_path()
    return {"name": name, "why": why}


def _tensor_path_line(info):
    """One line of the rendered report: the tensor path and why."""
    tp = info["tensor_path"]
    how = "libtorch's C shim (aoti_torch_*)" if tp["name"] == "aoti" else "the tensors' Python API"
    return f"tensor metadata: {how}; {tp['why']}"


def collect(memory=False):
    """Machine facts. Free GPU memory is read only on GPUs whose CUDA context already exists (PyTorch or fastdp used
    them) unless ``memory`` is true: reading it elsewhere creates a context on each such GPU (seconds and hundreds of
    MB while it lives, and an error under exclusive-process mode); ``free_bytes`` is None where it was not read."""
    core = _C.info(memory=memory)
    kernels = _kernels()
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
        "libraries": _libraries(core, kernels),
        "kernels": kernels,
        "kernel_source": _kernel_source(kernels),
        "fallback": _fallback.reason(),
        "strict": _fallback.strict(),
        "tensor_path": _tensor_path(),
        "devices": core["devices"],
    }


def _gib(n):
    return f"{n / 2**30:.1f} GiB"


def _yes(flag):
    return "yes" if flag else "no"


def _header(info):
    nccl = f"NCCL {info['nccl'] or 'not loaded'}"
    if info["nccl_library"]:
        nccl += f" ({info['nccl_library']})"
    if info["torch_nccl"]:
        nccl += f"; torch's NCCL {info['torch_nccl']}"
    return [
        f"fastdp {info['fastdp']}  torch {info['torch']}  python {info['python']}",
        f"CUDA driver {info['cuda_driver'] or 'not found'}; "
        f"torch's CUDA runtime {info['torch_cuda_runtime'] or 'none (CPU build)'}",
        nccl,
    ]


def _backend_line(name, b, lib):
    """One row of the backend table: compiled, loadable, and the library found (or why none)."""
    if name == "host":
        found = "built in"
    elif lib.get("library"):
        found = f"{lib['library']} ({lib['version']})"
    else:
        found = f"none: {lib.get('why') or b['why']}"
    unusable = "" if b["usable"] or lib.get("why") else f"; not usable: {b['why']}"
    return f"{name:<8} {_yes(b['compiled']):<9} {_yes(b['usable']):<9} {found}{unusable}"


def _backends(info):
    libs = info["libraries"]
    lines = ["backend  compiled  loadable  library (version)"]
    lines += [_backend_line(name, b, libs.get(name, {})) for name, b in info["backends"].items()]
    nv = libs["nvrtc"]
    found = f"{nv['library']} ({nv['version']})" if nv["library"] else f"none: {nv['why']}"
    lines.append(f"{'nvrtc':<8} {'-':<9} {_yes(nv['library']):<9} {found}")
    return lines


def _kernels_and_fallback(info):
    lines = [f"kernels: {info['kernel_source']}"]
    lines += [f"  GPU {d['index']}: {d['source']}" for d in info["kernels"]["devices"]]
    if info["fallback"]:
        fb = f"in use (torch's implementation): {info['fallback']}"
    elif info["strict"]:
        fb = "not used so far (FASTDP_STRICT=1: it would be an error)"
    else:
        fb = "not used so far; torch's implementation takes over any operation the core cannot run"
    lines.append(f"fallback: {fb}")
    lines.append(_tensor_path_line(info))
    return lines


def _gpu_line(d):
    free = _gib(d["free_bytes"]) if d["free_bytes"] is not None else "?"
    error = f"  ({d['error']})" if d["error"] else ""
    return f"{d['index']:<4} {d['name'][:33]:<33} {_gib(d['total_bytes']):>10} {free:>10}{error}"


def _gpus(devices):
    if not devices:
        return ["GPUs: none visible (the host backend serves \"cpu\" device entries: emulated replicas)"]
    lines = ["GPU  name                              total       free"]
    lines += [_gpu_line(d) for d in devices]
    if any(d["free_bytes"] is None for d in devices):
        lines.append("? free memory not read on GPUs no process context uses yet (--memory reads it there too)")
    lines += ["", "peer access (row → column): " + " ".join(str(d["index"]) for d in devices)]
    lines += [f"  {d['index']}: " + " ".join("Y" if p else "." for p in d["peer_access"]) for d in devices]
    return lines


def render(info):
    """``collect()``'s facts as the text ``python -m fastdp info`` prints: sections separated by blank lines."""
    sections = (_header(info), _backends(info), _kernels_and_fallback(info), _gpus(info["devices"]))
    return "\n\n".join("\n".join(lines) for lines in sections)
