"""Tells the C core where pip-installed NVIDIA libraries live: PyTorch's CUDA wheels bring NVRTC as the
``nvidia-cuda-nvrtc`` package (``nvidia/cu13/lib`` for CUDA 13, ``nvidia/cuda_nvrtc/lib`` for CUDA 12), outside
the dynamic loader's search path. Must run before the core first uses NVRTC, so ``fastdp`` imports it first."""

import importlib.util
import os

from .. import _C

# Newest first, as the core tries them.
_SUBDIRS = ("cu13/lib", "cuda_nvrtc/lib")


def nvrtc_dirs():
    """The folders of every installed ``nvidia`` namespace package that may hold libnvrtc."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    return [os.path.join(r, sub) for sub in _SUBDIRS for r in roots if os.path.isdir(os.path.join(r, sub))]


def register():
    dirs = nvrtc_dirs()
    if dirs:
        try:
            _C.nvrtc_search_dirs(":".join(dirs))
        except ValueError:  # NVRTC was already loaded (e.g. a reload of fastdp): the first choice stands
            pass


register()
