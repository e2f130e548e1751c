"""Helpers for the NVRTC and kernel-cache tests: each compilation runs in a fresh process (the core keeps one
image per architecture and process), with its own environment."""

import json
import os
import subprocess
import sys

import pytest

HEADER_BYTES = 144  # csrc/backend/cuda/kernel_image.c: magic 8, key 112, size 8, checksum 8, arch 4, ptx 4

# Loads fastdp._C alone (no torch import: these processes start in a fraction of a second) and names the NVRTC
# folders the way fastdp/_native/libs.py does at import.
_SNIPPET = """
import glob, importlib.util, json, os, sys
pkg = importlib.util.find_spec("fastdp").submodule_search_locations[0]
spec = importlib.util.spec_from_file_location("fastdp._C", glob.glob(os.path.join(pkg, "_C*.so"))[0])
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)
nv = importlib.util.find_spec("nvidia")
roots = list(nv.submodule_search_locations) if nv else []
_C.nvrtc_search_dirs(":".join(os.path.join(r, s) for s in ("cu13/lib", "cuda_nvrtc/lib") for r in roots))
out = []
for cc in json.loads(sys.argv[1]):
    try:
        out.append(_C.kernels_image(cc))
    except _C.FastDPError as e:
        out.append({"error": type(e).__name__, "message": str(e)})
print(json.dumps(out))
"""


def run_images(ccs, env=None, timeout=300):
    """kernels_image(cc) for each cc, in a new interpreter; returns the list of result dicts."""
    full = dict(os.environ)
    full.update(env or {})
    res = subprocess.run([sys.executable, "-c", _SNIPPET, json.dumps(list(ccs))], env=full, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def nvrtc_or_skip():
    from fastdp import _C

    info = _C.kernels_info()
    if not info["nvrtc_version"][0]:
        pytest.skip(f"no NVRTC here: {info['nvrtc_why']}")
    return info
