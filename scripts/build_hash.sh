#!/usr/bin/env bash
# Prints a hash of what a build of fastdp depends on: its sources (csrc/, cuda/, python/, setup.py, pyproject.toml;
# tracked or new, never what the build itself generates), the interpreter (PYTHON, default .venv/bin/python) and
# the compiler, and the build knobs of setup.py. scripts/setup_demo.sh rebuilds fastdp when this differs from the
# hash kept beside the last build, and reuses that build otherwise.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-.venv/bin/python}
paths=()
for p in csrc cuda python setup.py pyproject.toml; do if [ -e "$p" ]; then paths+=("$p"); fi; done
{
  {
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      git ls-files -z -c -o --exclude-standard -- "${paths[@]}"
    else
      find "${paths[@]}" -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' ! -name '*.pyc' ! -name '*.so' \
        ! -name '*.o' ! -name _kernels_blob.c -print0
    fi
  } | LC_ALL=C sort -z | while IFS= read -r -d '' f; do
    if [ -f "$f" ]; then sha256sum -- "$f"; fi
  done
  "$python" -c "import sys, sysconfig; print(sys.version, sysconfig.get_config_var('CC'))"
  echo "nvcc=$(command -v nvcc || true) FASTDP_WERROR=${FASTDP_WERROR:-1} FASTDP_NO_NVCC=${FASTDP_NO_NVCC:-}" \
    "FASTDP_CUDA_ARCHS=${FASTDP_CUDA_ARCHS:-} FASTDP_CUDA_DEFAULT_HOME=${FASTDP_CUDA_DEFAULT_HOME:-}" \
    "CUDA_HOME=${CUDA_HOME:-} CUDA_PATH=${CUDA_PATH:-} CC=${CC:-} CFLAGS=${CFLAGS:-}"
} | sha256sum | cut -d' ' -f1
