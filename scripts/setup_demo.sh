#!/usr/bin/env bash
# Prepares .venv with what running fastdp and its demo need, and nothing more: torch (the CPU build 2.13.0 unless a
# torch is already importable, as on a GPU box), matplotlib (fastdp's "plot" extra: the report's picture and the
# benchmarks' charts; it brings numpy), and fastdp itself built from this checkout. Run by scripts/demo.sh; sourced
# by scripts/setup.sh, which adds the test tools. Each install says what it installs, and why, before it starts.
#
# A later run installs nothing that is there already, and rebuilds fastdp only when what its build depends on
# changed: the hash of scripts/build_hash.sh (csrc/, cuda/, python/, setup.py, pyproject.toml, the interpreter, the
# build knobs) is kept in .venv/fastdp-build.sha256 beside the build it describes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "set-up: making .venv with $("$PY" --version 2>&1) (system packages stay visible, so a machine's own CUDA" \
    "build of torch is used rather than replaced)"
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
# The modules among "$@" that the environment cannot find (found, not imported: one quick interpreter start).
missing_modules() {
  "$VPY" -c "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))" "$@"
}
if [ -n "$(missing_modules torch)" ]; then
  echo "set-up: installing torch 2.13.0 (the CPU build; the largest package, a few hundred MB from the index," \
    "from a minute upwards on a slow link)"
  "$VPY" -m pip install torch==2.13.0
fi
# setuptools and wheel build fastdp; matplotlib draws the pictures.
missing=$(missing_modules setuptools wheel matplotlib)
if [ -n "$missing" ]; then
  echo "set-up: installing$(printf ' %s' $missing) (to build fastdp and draw its pictures; some 50 MB)"
  "$VPY" -m pip install $missing
fi

stamp=.venv/fastdp-build.sha256
want=$(PYTHON="$VPY" bash scripts/build_hash.sh)
if [ -z "$(missing_modules fastdp)" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "set-up: fastdp unchanged since its last build here: reused (.venv/fastdp-build.sha256)"
else
  echo "set-up: building fastdp from this checkout (its C core with the machine's C compiler: under a minute on" \
    "2 cores; pip prints only on failure)"
  rm -f "$stamp"
  # No build isolation: the build needs only setuptools and a C compiler, and some machines have no index. No
  # cache: a wheel of this checkout is never installed twice, and pip would keep one per build in the home folder.
  FASTDP_WERROR=${FASTDP_WERROR:-1} "$VPY" -m pip install -q --no-build-isolation --no-cache-dir --force-reinstall \
    --no-deps .
  echo "$want" >"$stamp"
fi
