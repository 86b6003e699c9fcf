#!/usr/bin/env bash
# The test command: install, lint and type-check, then the fast suite (simulator, unit and
# property tests), then the slow suite (real worker processes killed with SIGKILL, CLI end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
# pyproject.toml configures both: ruff ([tool.ruff]: pyflakes, pycodestyle errors, isort, bugbear,
# complexity and statement ceilings per function)
# and mypy ([tool.mypy]: basic for the package, strict for the sans-IO core); any error fails the run
"$PY" -m ruff check .
"$PY" -m mypy src/epochstream
"$PY" -m pytest -q --durations=15 "$@"
# exit code 5 = "no tests collected": the slow suite must exist, so that is a failure too
"$PY" -m pytest -q -m slow --durations=30 "$@"
