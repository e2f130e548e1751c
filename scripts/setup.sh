#!/usr/bin/env bash
# Prepares .venv for the tests: what the demo needs (scripts/setup_demo.sh: torch, matplotlib, fastdp built from
# this checkout, reused while its sources are unchanged), then the test tools (pytest, hypothesis), NVRTC and the
# pinned third-party models the tests train (transformers, torchvision, timm). Sourced by scripts/test.sh (and so by
# .ci/run); scripts/demo.sh sources only scripts/setup_demo.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_demo.sh
missing=$(missing_modules pytest numpy hypothesis)
if [ -n "$missing" ]; then
  echo "set-up: installing$(printf ' %s' $missing) (the test tools)"
  "$VPY" -m pip install -q $missing
fi
# NVRTC as torch's CUDA wheels bring it: the run-time kernel compilation is tested with it (no GPU needed). fastdp's
# own search decides whether one is there already; where no index has it, those tests skip.
if ! "$VPY" -c "import sys; from fastdp import _C; sys.exit(not _C.kernels_info()['nvrtc_version'][0])" >/dev/null 2>&1; then
  echo "set-up: installing nvidia-cuda-nvrtc (NVRTC, for the tests of the kernels' compilation at run time)"
  "$VPY" -m pip install -q nvidia-cuda-nvrtc==13.0.88 || echo "setup.sh: nvidia-cuda-nvrtc not installed; NVRTC tests will skip" >&2
fi
# Third-party models for tests/test_transformers.py and the zoo (tests/test_zoo.py), pinned, installed after torch so
# pip keeps torch as it is (their tests skip where no index has them). --no-deps would not do: they need their own
# small dependencies (tokenizers, safetensors, huggingface-hub, pillow); torchvision 0.28.0 requires exactly torch
# 2.13.0, which the CPU build satisfies; the check below stops the set-up if an install changed torch anyway.
pinned() {  # pinned MODULE PACKAGE==VERSION (installed, not imported: torchvision's CUDA build imports only under
  # the tests' stand-in for its operators, tests/_torchvision_ops.py)
  if [ -n "$(missing_modules "$1")" ]; then
    echo "set-up: installing $2 (for the tests that train its models)"
    before=$("$VPY" -c "import torch; print(torch.__version__)")
    "$VPY" -m pip install -q "$2" || echo "setup.sh: $2 not installed; its tests will skip" >&2
    after=$("$VPY" -c "import torch; print(torch.__version__)")
    if [ "$before" != "$after" ]; then echo "setup.sh: installing $2 changed torch $before -> $after" >&2; exit 1; fi
  fi
}
pinned transformers transformers==5.24.0
pinned torchvision torchvision==0.28.0
pinned timm timm==1.0.31
