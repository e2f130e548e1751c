#!/usr/bin/env bash
# The main job: set-up, what fastdp sees on this machine, the training demo (ending with dp.report() of its run and
# its picture, demo-out/report.png), and the comm benchmark (bench-out/comm.csv and its chart, comm.png).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
.venv/bin/python -m fastdp info
if [ -f examples/train.py ]; then .venv/bin/python examples/train.py; fi
.venv/bin/python -m fastdp.bench comm --sizes-mb "${FASTDP_BENCH_SIZES_MB:-1,16,64,256}"
