#!/usr/bin/env bash
# Every GPU check in one run, for a machine with a GPU (see README "GPU checks"): build, info, the GPU tests,
# the comm and train benchmarks. Output goes to ${OUT:-gpu-out}/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
{
  source scripts/setup.sh
  .venv/bin/python -m fastdp info
  (cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" -rs .)
  (cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider -x test_comm.py test_dp_persistent.py)
  .venv/bin/python -m fastdp.bench comm --sizes-mb 1,16,64,256 --out "$OUT"
  .venv/bin/python -m fastdp.bench train --out "$OUT"
  .venv/bin/python -m fastdp.bench train --split --rounds 3 --out "$OUT/split"
} 2>&1 | tee "$OUT/gpu_check.log"
