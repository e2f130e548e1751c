#!/usr/bin/env bash
# The main job, in four phases, each announced with what it does when it starts and timed when it ends:
#   1/4 set-up (scripts/setup_demo.sh): .venv with torch, matplotlib and fastdp built from this checkout, nothing the
#       tests alone need. A later run installs nothing and reuses the build while fastdp's sources are unchanged.
#   2/4 python -m fastdp info: what fastdp can do on this machine (backends, kernels, the fallback in use).
#   3/4 the comm benchmark (python -m fastdp.bench comm): GB/s per operation against the copy limit, a line per
#       size, then bench-out/comm.csv and its chart bench-out/comm.png. FASTDP_BENCH_SIZES_MB=1,16,64 (MB) picks
#       other sizes (each holds about 19 times itself in memory).
#   4/4 the training demo (examples/train.py): trains, saves, reloads into the bare model and compares, then prints
#       dp.report() of its own run and writes its picture, trace and CSV, and the checkpoint, to demo-out/.
# It ends with every file the run wrote, in this checkout and in the caches of the home folder, also when a phase
# fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1  # each line when it is printed, also through a pipe
# A file made now: whatever is newer than it, this run wrote (or something running beside it, in shared caches).
since=$(mktemp "${TMPDIR:-/tmp}/fastdp-demo-start.XXXXXX")
started=$SECONDS

# Prints the files newer than $since under each folder given: one line per file, or one line for a folder
# holding more than 10 of them (the environment, the build), with count and size, and what each one is.
list_new() {  # list_new PREFIX FOLDER...: paths printed with PREFIX (empty: relative to the checkout)
  local prefix=$1
  shift
  for dir in "$@"; do
    [ -d "$dir" ] || continue
    find "$dir" -path ./.git -prune -o -type f -newer "$since" -printf '%s\t%p\n' 2>/dev/null || true
  done | awk -F '\t' -v prefix="$prefix" -v home="$HOME" '
    function human(b) { return b >= 1048576 ? sprintf("%.0f MB", b / 1048576) : sprintf("%.1f kB", b / 1024) }
    function what(p) {
      if (p ~ /^\.venv\//) return "the environment: torch, matplotlib, fastdp"
      if (p ~ /^build\// || p ~ /egg-info/ || p ~ /_kernels_blob\.c$/) return "the build of fastdp"
      if (p ~ /comm\.csv$/) return "the comm benchmark: GB/s and % of the copy limit per operation and size"
      if (p ~ /comm\.png$/) return "its chart"
      if (p ~ /report\.png$/) return "dp.report() of the training demo: its picture"
      if (p ~ /report_trace\.json$/) return "its trace (open it in ui.perfetto.dev)"
      if (p ~ /report\.csv$/) return "its numbers"
      if (p ~ /checkpoint\.pt$/) return "the wrapper'"'"'s checkpoint, reloaded into the bare model"
      if (p ~ /\/pip\//) return "pip'"'"'s download cache (shared with every pip run as this user)"
      if (p ~ /matplotlib/) return "matplotlib'"'"'s font cache"
      if (p ~ /fastdp\/kernels/) return "fastdp'"'"'s compiled kernels (GPU)"
      if (p ~ /\.nv\//) return "the CUDA driver'"'"'s compile cache (GPU)"
      return ""
    }
    {
      p = $2; sub(/^\.\//, "", p)
      if (prefix == "~/") { q = p; if (index(q, home "/") == 1) q = "~/" substr(q, length(home) + 2); p = q }
      n = split(p, parts, "/"); top = (n > 1 ? parts[1] "/" : p)
      if (prefix == "~/" && n > 3) top = parts[1] "/" parts[2] "/" parts[3] "/"
      count[top]++; bytes[top] += $1
      if (count[top] <= 10) files[top] = files[top] p "\t" $1 "\n"
    }
    END {
      for (top in count) {
        if (count[top] > 10) {
          printf "  %-44s %9s  %s\n", top " (" count[top] " files)", human(bytes[top]), what(top)
        } else {
          m = split(files[top], lines, "\n")
          for (i = 1; i < m; i++) { split(lines[i], f, "\t"); printf "  %-44s %9s  %s\n", f[1], human(f[2]), what(f[1]) }
        }
      }
    }' | LC_ALL=C sort
}
list_written() {
  local status=$?
  echo
  if [ "$status" -ne 0 ]; then echo "== the demo stopped (exit status $status) after $((SECONDS - started)) s"; fi
  echo "== files this run wrote, in $PWD:"
  local inside
  inside=$(list_new "" .)
  echo "${inside:-  (none)}"
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}
  local outside
  outside=$(list_new "~/" "$cache/matplotlib" "${MPLCONFIGDIR:-$HOME/.config/matplotlib}" "$cache/pip" \
    "${FASTDP_CACHE_DIR:-$cache/fastdp/kernels}" "$HOME/.nv")
  if [ -n "$outside" ]; then
    echo "== and outside it:"
    echo "$outside"
  fi
  rm -f "$since"
}
trap list_written EXIT

phase() {  # phase N TITLE COMMAND...: runs COMMAND between a line saying what it does and one with its time
  local n=$1 title=$2 t=$SECONDS
  shift 2
  echo
  echo "== demo $n/4: $title"
  "$@"
  echo "== demo $n/4 done in $((SECONDS - t)) s"
}
sizes=()
if [ -n "${FASTDP_BENCH_SIZES_MB:-}" ]; then sizes=(--sizes-mb "$FASTDP_BENCH_SIZES_MB"); fi

phase 1 "set-up: .venv with torch, matplotlib and fastdp built from this checkout (the first run installs and "\
"builds; a later run reuses all of it)" bash scripts/setup_demo.sh
phase 2 "python -m fastdp info: what fastdp can do on this machine" .venv/bin/python -m fastdp info
phase 3 "the comm benchmark: GB/s of each fastdp.comm operation against one plain copy, a line per size "\
"(seconds per size)" .venv/bin/python -m fastdp.bench comm "${sizes[@]}" --out bench-out
phase 4 "the training demo (examples/train.py): train on every GPU or on emulated replicas, save, reload into "\
"the bare model, compare, then dp.report() of the run" \
  .venv/bin/python examples/train.py --out demo-out --checkpoint demo-out/checkpoint.pt
echo
echo "== the demo took $((SECONDS - started)) s; open bench-out/comm.png and demo-out/report.png to see the charts"
