#!/usr/bin/env bash
# Install epochstream and everything its tests and benchmarks need, into the current Python.
# Idempotent: a second run only checks. Later backends (Spark JARs via mvn) hook in here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
"$PY" - <<'PY'
import epochstream, pyarrow, hypothesis, pyspark
print(f"epochstream {epochstream.__version__} installed (pyarrow {pyarrow.__version__}, pyspark {pyspark.__version__})")
PY
