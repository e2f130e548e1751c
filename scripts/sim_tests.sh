#!/usr/bin/env bash
# Every simulated-GPU test (tests/sim/README.md): the C program tests/c/test_gpu_ops.c with its fault-injection sweep,
# and the Python cases through fastdp._C, that is every pytest item marked `sim`. Two pytest processes run side by
# side (the C items, the rest), one per core of a small machine. Exit status: non-zero when any item fails.
#
#   scripts/sim_tests.sh [--fail-fast] [extra pytest arguments]
#
# --fail-fast stops at the first failing item and ends the other process too (scripts/mutants.py runs it so).
# Runs in the checkout's .venv (scripts/setup.sh makes it; set FASTDP_PYTHON to use another interpreter).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fail_fast=()
if [ "${1:-}" = "--fail-fast" ]; then
  fail_fast=(-x)
  shift
fi
python="${FASTDP_PYTHON:-$PWD/.venv/bin/python}"
if [ ! -x "$python" ]; then
  echo "sim_tests.sh: no $python; run scripts/setup.sh first" >&2
  exit 2
fi
cd tests
# The files holding `sim` items (collecting the whole suite would cost more than some of them take), split in two
# halves of similar length: the C programs (test_gpu_ops.c and its sweep, the NCCL self-test), and the rest.
c_files=(test_sim.py test_gpu_check.py)
mapfile -t py_files < <(grep -l -E "pytest\.mark\.sim\b" test_*.py | grep -v -x -F "${c_files[@]/#/-e}")
common=(-q -p no:cacheprovider -m sim "${fail_fast[@]}" "$@")
"$python" -m pytest "${common[@]}" "${c_files[@]}" &
"$python" -m pytest "${common[@]}" "${py_files[@]}" &
status=0
for _ in 1 2; do
  wait -n
  rc=$?
  if [ "$rc" -ne 0 ]; then
    status=$rc
    if [ "${#fail_fast[@]}" -gt 0 ]; then
      kill $(jobs -p) 2>/dev/null
      wait
      break
    fi
  fi
done
exit "$status"
