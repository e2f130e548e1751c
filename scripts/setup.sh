#!/usr/bin/env bash
# Prepares .venv on a fresh machine: torch (CPU build 2.13.0 unless a torch is already importable, as on a GPU
# box), pytest, and fastdp itself built from this checkout. Sourced by scripts/test.sh and scripts/demo.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # System packages stay visible, so a machine's own CUDA build of torch is used rather than replaced.
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
need() { ! "$VPY" -c "import $1" >/dev/null 2>&1; }
if need torch; then "$VPY" -m pip install -q torch==2.13.0; fi
missing=""
for mod in setuptools wheel pytest numpy hypothesis; do if need "$mod"; then missing="$missing $mod"; fi; done
if [ -n "$missing" ]; then "$VPY" -m pip install -q $missing; fi
# No build isolation: the build needs only setuptools and a C compiler, and some machines have no index.
FASTDP_WERROR=${FASTDP_WERROR:-1} "$VPY" -m pip install -q --no-build-isolation --force-reinstall --no-deps .
# NVRTC as torch's CUDA wheels bring it: the run-time kernel compilation is tested with it (no GPU needed). fastdp's
# own search decides whether one is there already; where no index has it, those tests skip.
if ! "$VPY" -c "import sys; from fastdp import _C; sys.exit(not _C.kernels_info()['nvrtc_version'][0])" >/dev/null 2>&1; then
  "$VPY" -m pip install -q nvidia-cuda-nvrtc==13.0.88 || echo "setup.sh: nvidia-cuda-nvrtc not installed; NVRTC tests will skip" >&2
fi
# transformers for tests/test_transformers.py, pinned, installed after torch so pip keeps torch as it is (the tests
# skip where no index has it). --no-deps would not do: it needs its own small dependencies (tokenizers,
# safetensors, huggingface-hub); torch is not among them, and the check below says so if that ever changes.
if need transformers; then
  before=$("$VPY" -c "import torch; print(torch.__version__)")
  "$VPY" -m pip install -q transformers==5.24.0 || echo "setup.sh: transformers not installed; its tests will skip" >&2
  after=$("$VPY" -c "import torch; print(torch.__version__)")
  if [ "$before" != "$after" ]; then echo "setup.sh: installing transformers changed torch $before -> $after" >&2; exit 1; fi
fi
