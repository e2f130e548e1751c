#!/usr/bin/env bash
# The tests against another torch, in a virtual environment of its own that is kept between runs:
#   bash scripts/test_torch.sh 2.14.1                      # the whole suite on torch 2.14.1 (on Linux, a CUDA build)
#   bash scripts/test_torch.sh 2.14.1 test_comm.py -x      # pytest arguments, run from tests/
# The environment is ${FASTDP_TORCH_ENVS:-$HOME/.cache/fastdp}/venv-torch-VERSION: made and filled once (a CUDA
# build of torch is some 5 GB), reused after; only that torch is in it (no system packages), and fastdp is built
# into it from this checkout on every run. scripts/test.sh stays the one test command on a fresh machine; CI runs
# this too (.ci/run), for the tests whose expectations depend on the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION=${1:?usage: bash scripts/test_torch.sh TORCH_VERSION [pytest arguments]}
shift
VENV=${FASTDP_TORCH_ENVS:-$HOME/.cache/fastdp}/venv-torch-$VERSION
VPY=$VENV/bin/python
if ! "$VPY" -c "import torch, pytest, hypothesis, numpy, setuptools, wheel" >/dev/null 2>&1; then
  mkdir -p "$(dirname "$VENV")"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VPY" -m pip install -q "torch==$VERSION" pytest numpy hypothesis setuptools wheel
fi
have=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$have" != "$VERSION" ]; then
  echo "test_torch.sh: $VENV has torch $have, not $VERSION; remove it to start again" >&2
  exit 1
fi
FASTDP_WERROR=${FASTDP_WERROR:-1} "$VPY" -m pip install -q --no-build-isolation --force-reinstall --no-deps .
"$VPY" -c "import torch; print('torch', torch.__version__, '| CUDA build:', torch.backends.cuda.is_built(), \
'| GPUs:', torch.cuda.device_count() if torch.backends.cuda.is_built() else 0)"
cd tests
if [ $# -eq 0 ]; then set -- .; fi
"$VPY" -m pytest -q -p no:cacheprovider "$@"
