#!/usr/bin/env bash
# The one-shot GPU check (README "GPU checks"): every step runs on its own, under its own time limit, and a
# summary table says ok / FAILED rc / skipped for each. Written for the lent H200 machine (no network, `python3`
# is a venv that already holds torch), and dry-run on CPU by tests/test_gpu_check.py, where every GPU step
# reports "skipped: no GPU".
#
#   bash scripts/gpu_check.sh                       # all steps; log and CSVs in $OUT (else gpu-out/)
#   PYTHON=/path/python bash scripts/gpu_check.sh   # another interpreter (it must import torch)
#   GPU_CHECK_STEPS=copy-paths,pytest-gpu bash scripts/gpu_check.sh  # a rerun: these (env, build, helpers always)
#
# Budget (seconds; each is the step's hard timeout, together at most GPU_CHECK_TOTAL_S = 450, i.e. 7.5 min):
#   env 8 · build 36 · info 10 · helpers 8 · nccl-selftest 20 · copy-paths 25 · dp-repeated 15 ·
#   sync-debug 14 · alloc-expandable 14 · alloc-async 14 · caller-stream 14 · cpu-batch 10 · output-cpu 8 ·
#   syncbn-dtypes 14 · graph-capture 10 · oom-rescue 8 · pytest-gpu 48 · c-gpu-ops 30 · c-memcheck 45 ·
#   c-racecheck 28 · bench-comm 10 · bench-train 14 · per-tensor 10 · overlap 12 · memory-across-step 8 ·
#   lockstep 8 · report-exposed 7 · map-report 2
# A step never runs past the total: it gets what is left, and is "skipped: out of time" (a failure) under 5 s.
# GPU_CHECK_TIME_SCALE (an integer, default 1) multiplies every limit, for slow shared machines (the CPU dry run).
#
# Nothing is installed from an index: fastdp is built with the chosen interpreter by
# `pip install --no-build-isolation --no-deps --no-index --target <scratch>` (or `setup.py build_ext --inplace`
# where pip is missing) from a scratch copy of the sources, then used through PYTHONPATH. The system
# interpreter is never modified.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOTAL_BUDGET_S=${GPU_CHECK_TOTAL_S:-450}
TIME_SCALE=${GPU_CHECK_TIME_SCALE:-1}
STEP_NAMES=()
STEP_RESULTS=()
STEP_SECONDS=()
STEP_BUDGETS=()
ANY_FAILED=0

# ---- the step helper ----

# step NAME BUDGET_S NEEDS COMMAND...: runs COMMAND (a program or an exported function) under `timeout`,
# records ok / FAILED rc / skipped, and never stops the script. NEEDS: "-" (anything), "gpu" (a CUDA device),
# "gpu,gpu-ops" (also tests/c/build.py --gpu-ops).
step() {
  local name=$1 budget=$2 needs=$3
  shift 3
  local why=""
  if [[ -n ${GPU_CHECK_STEPS:-} && ",$GPU_CHECK_STEPS,env,build,helpers," != *",$name,"* ]]; then
    why="skipped: not selected"
  elif [[ ,$needs, == *,gpu,* && ${GPU_COUNT:-0} -lt 1 ]]; then
    why="skipped: no GPU"
  elif [[ ,$needs, == *,gpu-ops,* ]] && ! grep -q -- "--gpu-ops" "$ROOT/tests/c/build.py" 2>/dev/null; then
    why="skipped: not available"
  fi
  local left=$((GPU_CHECK_DEADLINE - SECONDS))
  if [[ -z $why && $left -lt 5 ]]; then
    why="skipped: out of time"
    ANY_FAILED=1
  fi
  if [[ -n $why ]]; then
    printf '\n=== %s: %s\n' "$name" "$why"
    record "$name" "$why" 0 "$budget"
    return 0
  fi
  local limit=$((budget * TIME_SCALE))
  ((limit > left)) && limit=$left
  printf '\n=== %s (budget %ss): %s\n' "$name" "$limit" "$*"
  local t0=$SECONDS rc result
  # A child bash, so that exported functions run too; GNU timeout signals its whole process group (compilers,
  # pytest, compute-sanitizer's children), and -k kills what ignores SIGTERM 5 s later.
  timeout -k 5 "$limit" bash -c '"$@"' step "$@"
  rc=$?
  if ((rc == 0)); then
    result="ok"
  elif ((rc == 124 || rc == 137)); then
    result="FAILED rc=$rc (timeout ${limit}s)"
  else
    result="FAILED rc=$rc"
  fi
  ((rc != 0)) && ANY_FAILED=1
  printf '=== %s: %s in %ss\n' "$name" "$result" "$((SECONDS - t0))"
  record "$name" "$result" "$((SECONDS - t0))" "$budget"
  return 0
}

record() {
  STEP_NAMES+=("$1")
  STEP_RESULTS+=("$2")
  STEP_SECONDS+=("$3")
  STEP_BUDGETS+=("$4")
}

# Prints the table and writes $OUT/summary.csv; returns 1 when a step that ran failed.
summary() {
  local i
  printf '\n%-18s %-32s %7s %7s\n' "step" "result" "seconds" "budget"
  printf '%-18s %-32s %7s %7s\n' "----" "------" "-------" "------"
  echo "step,result,seconds,budget_s" >"$OUT/summary.csv"
  for i in "${!STEP_NAMES[@]}"; do
    printf '%-18s %-32s %7s %7s\n' "${STEP_NAMES[$i]}" "${STEP_RESULTS[$i]}" "${STEP_SECONDS[$i]}" "${STEP_BUDGETS[$i]}"
    echo "${STEP_NAMES[$i]},${STEP_RESULTS[$i]},${STEP_SECONDS[$i]},${STEP_BUDGETS[$i]}" >>"$OUT/summary.csv"
  done
  local verdict="all ran steps ok"
  [[ $ANY_FAILED == 0 ]] || verdict="FAILURES above"
  printf 'total %ss of %ss; %s\n' "$SECONDS" "$((TOTAL_BUDGET_S * TIME_SCALE))" "$verdict"
  return "$ANY_FAILED"
}

# ---- set-up ----

# The interpreter: $PYTHON, else .venv/bin/python, else python3 — the first that imports torch. On the GPU
# machine that is python3 (a venv with torch 2.11 + CUDA 13); a venv made from it does not see its torch.
pick_python() {
  local cands=() c path
  if [[ -n ${PYTHON:-} ]]; then cands=("$PYTHON"); else cands=("$ROOT/.venv/bin/python" python3 python); fi
  for c in "${cands[@]}"; do
    path=$(command -v "$c" 2>/dev/null) || continue
    # Steps run in other folders: a relative path (PYTHON=.venv/bin/python) is made absolute here.
    if [[ $path == */* && $path != /* ]]; then path="$(cd "$(dirname "$path")" && pwd)/$(basename "$path")"; fi
    if "$path" -c "import torch" >/dev/null 2>&1; then
      echo "$path"
      return 0
    fi
    echo "gpu_check: $path cannot import torch; not used" >&2
  done
  command -v "${cands[0]}" 2>/dev/null || echo "${cands[0]}"
  return 1
}

find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer)" "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
    "${CUDA_HOME:-/usr/local/cuda}/compute-sanitizer/compute-sanitizer"; do
    [[ -n $c && -x $c ]] && { echo "$c"; return 0; }
  done
  return 0
}

# ---- steps (exported functions, each run in its own bash under timeout) ----

step_env() {
  echo "python: $PY"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| GPUs', torch.cuda.device_count() if torch.cuda.is_available() else 0)" || return 1
  "$PY" -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); \
print('Python.h:', h if os.path.exists(h) else 'MISSING (the build needs the Python headers)')"
  "$PY" -m pip --version 2>/dev/null || echo "pip: not available (build falls back to setup.py build_ext)"
  "${CC:-cc}" --version 2>/dev/null | head -n 1
  "$PY" -c "import pytest_timeout" 2>/dev/null && echo "pytest-timeout: yes" || echo "pytest-timeout: no"
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  echo "compute-sanitizer: ${SANITIZER:-not found}"
  env | grep '^FASTDP_' || true
  echo "scratch: $WORK"
}

step_build() {
  rm -rf "$WORK/src" "$WORK/site"
  mkdir -p "$WORK/src" "$WORK/site" || return 1
  local f
  for f in csrc cuda python setup.py pyproject.toml README.md setup.cfg MANIFEST.in; do
    [[ -e $ROOT/$f ]] && cp -r "$ROOT/$f" "$WORK/src/"
  done
  # Nothing built elsewhere comes along (an in-place extension of another Python, stale bytecode).
  find "$WORK/src" \( -name "*.so" -o -name __pycache__ -o -name build -o -name "*.egg-info" \) -prune \
    -exec rm -rf {} +
  cd "$WORK/src" || return 1
  if "$PY" -m pip --version >/dev/null 2>&1; then
    PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
      "$PY" -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir --target "$WORK/site" . || return 1
  else
    "$PY" setup.py -q build_ext --inplace || return 1
    cp -r python/fastdp "$WORK/site/" || return 1
  fi
  cd "$WORK" && "$PY" -c "import fastdp, fastdp._C; print('built', fastdp.__file__)"
}

step_info() {
  cd "$WORK" || return 1
  FASTDP_STRICT=1 "$PY" -m fastdp info || return 1
  FASTDP_STRICT=1 "$PY" -m fastdp info --json >"$OUT/info.json"
}

# Compiles the C helpers (no GPU needed, so a broken helper shows in the CPU dry run), and notes the folders
# of the libnccl.so.2 / libcuda.so.1 PyTorch loads, for the C programs that load them by name.
step_helpers() {
  "$PY" "$ROOT/scripts/gpu/build_nccl_selftest.py" "$WORK/bin/nccl_selftest" || return 1
  "$PY" "$ROOT/scripts/gpu/libpaths.py" >"$WORK/ld_path" || return 1
  echo "library folders for C programs: $(cat "$WORK/ld_path")"
}

# LD_LIBRARY_PATH for the C programs: the folders of PyTorch's NCCL and driver first. The FASTDP_*_LIBRARY
# overrides (the simulated GPU of tests/sim) are unset for the whole script: these steps use the real ones.
c_env() {
  local extra
  extra=$(cat "$WORK/ld_path" 2>/dev/null)
  export LD_LIBRARY_PATH="${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

step_nccl_selftest() {
  c_env
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$WORK/bin/nccl_selftest"
  local rc=$?
  if ((rc != 0)); then # once more, for the log only: NCCL's own account, over loopback (one process, one rank)
    echo "nccl self-test failed ($rc); rerunning with NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=lo for diagnosis"
    NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=lo "$WORK/bin/nccl_selftest" 2>&1 | tail -n 60
  fi
  return "$rc"
}

step_copy_paths() {
  cd "$WORK" && FASTDP_STRICT=1 "$PY" "$ROOT/scripts/gpu/copy_paths.py" --device cuda
}

step_dp_repeated() {
  cd "$WORK" && FASTDP_STRICT=1 "$PY" "$ROOT/scripts/gpu/dp_repeated.py" --device cuda --replicas 4
}

step_pytest_gpu() {
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra=(--timeout 60)
  cd "$ROOT/tests" && "$PY" -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" -rs "${extra[@]}" .
}

# tests/c/build.py --gpu-ops builds the C test program of the GPU ops and runs it (real driver and NCCL when
# FASTDP_CUDA_DRIVER_LIBRARY / FASTDP_NCCL_LIBRARY are unset): once plainly, so that a failure of the program
# reads apart from one of the tools, then under compute-sanitizer, which follows it from python.
step_c_gpu_ops() {
  c_env
  "$PY" "$ROOT/tests/c/build.py" --gpu-ops
}

step_c_sanitizer() {
  local tool=$1
  [[ -n ${SANITIZER:-} ]] || { echo "compute-sanitizer not found (PATH, \$CUDA_HOME, /usr/local/cuda)"; return 1; }
  c_env
  # An ASan build under compute-sanitizer (which preloads its own library) needs these; build.py may set its own.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:verify_asan_link_order=0}
  "$SANITIZER" --tool "$tool" --target-processes all --error-exitcode 86 --print-limit 20 \
    "$PY" "$ROOT/tests/c/build.py" --gpu-ops
}
step_c_memcheck() { step_c_sanitizer memcheck; }
step_c_racecheck() { step_c_sanitizer racecheck; }

step_bench_comm() {
  cd "$WORK" && "$PY" -m fastdp.bench comm --sizes-mb 1,16 --seconds 0.1 --out "$OUT"
}

# How much of the gradient reduction backward hides, with repeated ids on one GPU (a timeline of one step, the
# overlap fraction, and the backward time with the reductions started early against held to the end).
step_overlap() {
  cd "$WORK" && FASTDP_STRICT=1 "$PY" "$ROOT/scripts/gpu/overlap.py" --device cuda --replicas 4 --compare
}

step_bench_train() {
  cd "$WORK" && "$PY" -m fastdp.bench train --rounds 2 --steps 6 --out "$OUT"
}

# The host's cost per parameter tensor and step on a GPU (1000 x Linear(8, 8), 4 replicas): fastdp's replicate and
# reduction against torch.nn.DataParallel's, and DDP's reducer in one process against the bare model's step.
step_per_tensor() {
  cd "$WORK" && "$PY" -m fastdp.bench train --device cuda --params 1000 --replicas 4 --rounds 2 --steps 4 --ddp \
    --out "$OUT"
}

# What only a GPU can say about the gradient reduction (scripts/gpu/findings.py; docs/benchmarks.md, "To be measured
# on the first GPU"): device 0's memory across optimizer.step() against the bare model and upstream, replica 0's
# backward with slowed replicas, and the report's exposed reduction against a synchronised timing. Each prints its
# comparison and writes $OUT/findings-<name>.csv.
findings() {
  cd "$WORK" && FASTDP_STRICT=1 "$PY" "$ROOT/scripts/gpu/findings.py" "$1" --device cuda --out "$OUT"
}
step_memory_across_step() { findings memory; }
step_lockstep() { findings lockstep; }
step_report_exposed() { findings exposed; }

# The shim's CUDA-only branches (docs/gpu-verification.md): one check of scripts/gpu/cuda_branches.py per step,
# each tracing which entries of the map it ran into $OUT/map-trace/<name>.txt for map-report.
cuda_branch_check() {
  local check=$1 name=${2:-$1}
  cd "$WORK" && FASTDP_STRICT=1 "$PY" "$ROOT/scripts/gpu/cuda_branches.py" "$check" --trace "$OUT/map-trace" \
    --name "$name"
}
step_sync_debug() { cuda_branch_check sync-debug; }
step_alloc_expandable() { PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cuda_branch_check allocator alloc-expandable; }
step_alloc_async() { PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync cuda_branch_check allocator alloc-async; }
step_caller_stream() { cuda_branch_check caller-stream; }
step_cpu_batch() { cuda_branch_check cpu-batch; }
step_output_cpu() { cuda_branch_check output-cpu; }
step_syncbn_dtypes() { cuda_branch_check syncbn-dtypes; }
step_graph_capture() { cuda_branch_check graph-capture; }
step_oom_rescue() { cuda_branch_check oom-rescue; }
step_map_report() { "$PY" "$ROOT/scripts/gpu/cuda_branches.py" map-report --trace "$OUT/map-trace"; }

# What the steps' child shells see: the chosen tools, the scratch build first on PYTHONPATH, the step functions.
export_for_steps() {
  export ROOT OUT WORK PY SANITIZER
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  export -f step_env step_build step_info step_helpers c_env step_nccl_selftest step_copy_paths step_dp_repeated \
    step_pytest_gpu step_c_gpu_ops step_c_sanitizer step_c_memcheck step_c_racecheck step_bench_comm step_bench_train \
    step_per_tensor \
    cuda_branch_check step_sync_debug step_alloc_expandable step_alloc_async step_caller_stream step_cpu_batch \
    step_output_cpu step_syncbn_dtypes step_graph_capture step_oom_rescue step_overlap step_map_report \
    findings step_memory_across_step step_lockstep step_report_exposed
}

main() {
  cd "$ROOT" || exit 1
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastdp-gpu-check.XXXXXX") || exit 1
  trap 'rm -rf "$WORK"' EXIT
  GPU_CHECK_DEADLINE=$((SECONDS + TOTAL_BUDGET_S * TIME_SCALE))
  unset FASTDP_CUDA_DRIVER_LIBRARY FASTDP_NCCL_LIBRARY FASTDP_WERROR
  PY=$(pick_python) || echo "gpu_check: no interpreter imports torch; set PYTHON=... (steps will fail)"
  GPU_COUNT=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" \
    2>/dev/null | tail -n 1) || GPU_COUNT=0
  [[ $GPU_COUNT =~ ^[0-9]+$ ]] || GPU_COUNT=0
  SANITIZER=$(find_sanitizer)
  export_for_steps
  echo "fastdp GPU check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), GPUs: $GPU_COUNT, out: $OUT"

  step env 8 - step_env
  step build 36 - step_build
  step info 10 - step_info
  step helpers 8 - step_helpers
  step nccl-selftest 20 gpu step_nccl_selftest
  step copy-paths 25 gpu step_copy_paths
  step dp-repeated 15 gpu step_dp_repeated
  step sync-debug 14 gpu step_sync_debug
  step alloc-expandable 14 gpu step_alloc_expandable
  step alloc-async 14 gpu step_alloc_async
  step caller-stream 14 gpu step_caller_stream
  step cpu-batch 10 gpu step_cpu_batch
  step output-cpu 8 gpu step_output_cpu
  step syncbn-dtypes 14 gpu step_syncbn_dtypes
  step graph-capture 10 gpu step_graph_capture
  step oom-rescue 8 gpu step_oom_rescue
  step pytest-gpu 48 gpu step_pytest_gpu
  step c-gpu-ops 30 gpu,gpu-ops step_c_gpu_ops
  step c-memcheck 45 gpu,gpu-ops step_c_memcheck
  step c-racecheck 28 gpu,gpu-ops step_c_racecheck
  step bench-comm 10 gpu step_bench_comm
  step bench-train 14 gpu step_bench_train
  step per-tensor 10 gpu step_per_tensor
  step overlap 12 gpu step_overlap
  step memory-across-step 8 gpu step_memory_across_step
  step lockstep 8 gpu step_lockstep
  step report-exposed 7 gpu step_report_exposed
  step map-report 2 - step_map_report
  summary
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  OUT=${OUT:-$ROOT/gpu-out}
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
  main "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
