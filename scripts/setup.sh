#!/usr/bin/env bash
# Install epochstream and everything its tests and benchmarks need, into the current Python.
# Idempotent: a second run only checks. Later backends (Spark JARs via mvn) hook in here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the spark driver's suites start a real Spark (JVM): Java 17 must be on the PATH
if ! command -v java >/dev/null; then
  echo "setup: java not found; the spark suites need Java 17 (e.g. apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
"$PY" - <<'PY'
import epochstream, pyarrow, hypothesis, pyspark
print(f"epochstream {epochstream.__version__} installed (pyarrow {pyarrow.__version__}, pyspark {pyspark.__version__})")
PY
