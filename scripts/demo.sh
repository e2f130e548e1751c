#!/usr/bin/env bash
# The main job: set-up, what fastdp sees on this machine, the training demo, and the comm benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
.venv/bin/python -m fastdp info
if [ -f examples/train.py ]; then .venv/bin/python examples/train.py; fi
.venv/bin/python -m fastdp.bench comm --sizes-mb "${FASTDP_BENCH_SIZES_MB:-1,16,64,256}"
