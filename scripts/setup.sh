#!/usr/bin/env bash
# Prepares .venv on a fresh machine: torch (CPU build 2.13.0 unless a torch is already importable, as on a GPU
# box), pytest, matplotlib (fastdp's "plot" extra: the report's picture and the benchmarks' charts), and fastdp
# itself built from this checkout. Sourced by scripts/test.sh and scripts/demo.sh.
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
for mod in setuptools wheel pytest numpy hypothesis matplotlib; do if need "$mod"; then missing="$missing $mod"; fi; done
if [ -n "$missing" ]; then "$VPY" -m pip install -q $missing; fi
# No build isolation: the build needs only setuptools and a C compiler, and some machines have no index.
FASTDP_WERROR=${FASTDP_WERROR:-1} "$VPY" -m pip install -q --no-build-isolation --force-reinstall --no-deps .
# NVRTC as torch's CUDA wheels bring it: the run-time kernel compilation is tested with it (no GPU needed). fastdp's
# own search decides whether one is there already; where no index has it, those tests skip.
if ! "$VPY" -c "import sys; from fastdp import _C; sys.exit(not _C.kernels_info()['nvrtc_version'][0])" >/dev/null 2>&1; then
  "$VPY" -m pip install -q nvidia-cuda-nvrtc==13.0.88 || echo "setup.sh: nvidia-cuda-nvrtc not installed; NVRTC tests will skip" >&2
fi
# Third-party models for tests/test_transformers.py and the zoo (tests/test_zoo.py), pinned, installed after torch so
# pip keeps torch as it is (their tests skip where no index has them). --no-deps would not do: they need their own
# small dependencies (tokenizers, safetensors, huggingface-hub, pillow); torchvision 0.28.0 requires exactly torch
# 2.13.0, which the CPU build satisfies; the check below stops the set-up if an install changed torch anyway.
pinned() {  # pinned MODULE PACKAGE==VERSION (installed, not imported: torchvision's CUDA build imports only under
  # the tests' stand-in for its operators, tests/_torchvision_ops.py)
  if ! "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" >/dev/null 2>&1; then
    before=$("$VPY" -c "import torch; print(torch.__version__)")
    "$VPY" -m pip install -q "$2" || echo "setup.sh: $2 not installed; its tests will skip" >&2
    after=$("$VPY" -c "import torch; print(torch.__version__)")
    if [ "$before" != "$after" ]; then echo "setup.sh: installing $2 changed torch $before -> $after" >&2; exit 1; fi
  fi
}
pinned transformers transformers==5.24.0
pinned torchvision torchvision==0.28.0
pinned timm timm==1.0.31
