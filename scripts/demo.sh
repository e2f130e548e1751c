#!/usr/bin/env bash
# The main job: set-up (scripts/setup_demo.sh: what the demo needs, none of the test tools), what fastdp sees on
# this machine, the comm benchmark (bench-out/comm.csv and its chart, comm.png), then the training demo, which ends
# with dp.report() of its own run and its picture (demo-out/report.png).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_demo.sh
.venv/bin/python -m fastdp info
.venv/bin/python -m fastdp.bench comm --sizes-mb "${FASTDP_BENCH_SIZES_MB:-1,16,64,256}"
if [ -f examples/train.py ]; then .venv/bin/python examples/train.py; fi
