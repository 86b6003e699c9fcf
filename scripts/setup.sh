#!/usr/bin/env bash
# Install epochstream and everything its tests and benchmarks need, into the current Python.
# Idempotent: a second run only checks. JVM jars for Spark (Delta Lake, S3A) come from Maven Central
# through mvn (jars/pom.xml) into jars/lib, fetched again only when the pom changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the spark driver's suites start a real Spark (JVM): Java 17 must be on the PATH
if ! command -v java >/dev/null; then
  echo "setup: java not found; the spark suites need Java 17 (e.g. apt-get install openjdk-17-jre-headless)" >&2
  exit 1
fi
# the dashboard's browser test drives a real headless Chromium: Debian's chromium and its chromedriver
# (same version, from the same archive; selenium talks to the driver, nothing is downloaded at run time)
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  else  # not root: everything but the dashboard's browser test works; that test fails naming what is missing
    echo "setup: warning: the browser test needs chromium and chromium-driver (apt-get install chromium chromium-driver)" >&2
  fi
fi
# constraints.txt holds the exact versions CI tested (scripts/lock.py writes it)
"$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
"$PY" - <<'PY'
import epochstream, pyarrow, hypothesis, pyspark, rocksdict  # rocksdict: the RocksDB keyed-state backend
print(f"epochstream {epochstream.__version__} installed (pyarrow {pyarrow.__version__}, pyspark {pyspark.__version__})")
PY

# Spark's jars: delta-spark + hadoop-aws and their dependencies not already in pyspark (see jars/pom.xml)
JARS=jars/lib
STAMP="$JARS/.pom-sha256"
WANT=$(sha256sum jars/pom.xml | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! ls "$JARS"/delta-spark_*.jar >/dev/null 2>&1; then
  command -v mvn >/dev/null || { echo "setup: mvn is needed to fetch the Delta Lake jars (apt-get install maven)" >&2; exit 1; }
  rm -rf "$JARS"
  mvn -q -B -f jars/pom.xml dependency:copy-dependencies
  echo "$WANT" > "$STAMP"
fi
echo "spark jars: $(ls "$JARS"/*.jar | wc -l) in $JARS"

# Apache Kafka's broker (KRaft) for the Kafka tests, benchmarks and demo: its own folder and stamp
# (jars/kafka/pom.xml -> jars/kafka/lib), run in its own JVM by epochstream.deploy.kafka_broker
KJARS=jars/kafka/lib
KSTAMP="$KJARS/.pom-sha256"
KWANT=$(sha256sum jars/kafka/pom.xml | cut -d' ' -f1)
if [ "$(cat "$KSTAMP" 2>/dev/null)" != "$KWANT" ] || ! ls "$KJARS"/kafka_2.13-*.jar >/dev/null 2>&1; then
  command -v mvn >/dev/null || { echo "setup: mvn is needed to fetch the Kafka broker jars (apt-get install maven)" >&2; exit 1; }
  rm -rf "$KJARS"
  mvn -q -B -f jars/kafka/pom.xml dependency:copy-dependencies
  echo "$KWANT" > "$KSTAMP"
fi
echo "kafka broker jars: $(ls "$KJARS"/*.jar | wc -l) in $KJARS"

# Spark Structured Streaming's own Kafka connector: only the Spark peer of benchmarks/kafka/kafka.py uses it
SKJARS=jars/kafka-spark/lib
SKSTAMP="$SKJARS/.pom-sha256"
SKWANT=$(sha256sum jars/kafka-spark/pom.xml | cut -d' ' -f1)
if [ "$(cat "$SKSTAMP" 2>/dev/null)" != "$SKWANT" ] || ! ls "$SKJARS"/spark-sql-kafka-*.jar >/dev/null 2>&1; then
  rm -rf "$SKJARS"
  mvn -q -B -f jars/kafka-spark/pom.xml dependency:copy-dependencies
  echo "$SKWANT" > "$SKSTAMP"
fi
echo "spark kafka connector jars: $(ls "$SKJARS"/*.jar | wc -l) in $SKJARS"
