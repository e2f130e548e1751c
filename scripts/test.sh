#!/usr/bin/env bash
# The test command: set-up, then the whole suite (pytest, including the C core under ASan/UBSan).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
# Run from tests/ so that the installed package, not the source folder, is imported.
cd tests && ../.venv/bin/python -m pytest -q -p no:cacheprovider "$@" .
