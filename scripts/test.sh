#!/usr/bin/env bash
# The test command: set-up, then the whole suite: pytest (the C core under ASan/UBSan included), then every
# simulated-GPU test (scripts/sim_tests.sh: the pytest items marked `sim`, two processes side by side). Arguments
# go to both pytest runs. FASTDP_SIM_SEPARATE=1 leaves the simulated-GPU tests out, for a caller (CI) that runs
# scripts/sim_tests.sh itself. Exit status: non-zero when either part fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
status=0
# Run from tests/ so that the installed package, not the source folder, is imported.
(cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider -m "not sim" "$@" .) || status=$?
if [ "${FASTDP_SIM_SEPARATE:-0}" != 1 ]; then
  bash scripts/sim_tests.sh "$@" || status=$?
fi
exit "$status"
