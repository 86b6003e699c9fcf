#!/usr/bin/env bash
# The test command: install, then the fast suite (simulator, unit and property tests), then
# the slow suite (real worker processes killed with SIGKILL, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -q "$@"
# exit code 5 = "no tests collected": the slow suite must exist, so that is a failure too
"$PY" -m pytest -q -m slow "$@"
