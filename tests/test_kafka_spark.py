"""Kafka in, Kafka out on the spark driver: the source and the sink subtasks run inside Spark
tasks (their Python workers use the same confluent-kafka client); each sink subtask produces
into its own Kafka transactions and commits them when the driver's manifest exists. A task's
Python worker is SIGKILLed mid-run in each mode; the output topic at read_committed holds
every input's result exactly once."""

from __future__ import annotations

import pytest

from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.spark import spark_session
from kafkaserver import new_topic
from pipelines import check_running_counts
from test_kafka import N, _committed, _count_job, _fill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[2,4]", {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_on_spark_with_a_worker_kill(kafka, spark, tmp_path, mode):
    src = _fill(kafka)
    out = new_topic(kafka, "out", 2)
    p, _ = _count_job(kafka, src, out, mode=mode, staging=tmp_path / "staging")
    res = p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark,
                failures=FailureSchedule(kill_times=[1.0], kill_moments=["snapshot_write"]))
    assert res.metrics["deployment"] == "spark" and res.restarts >= 1
    assert check_running_counts(_committed(kafka, out), range(N)) == []


def _pandas_counts(key, pdfs, state):
    """applyInPandasWithState: a running count per key, one output row per input row."""
    import pandas as pd

    count = state.get[0] if state.exists else 0
    for pdf in pdfs:
        n = len(pdf)
        yield pd.DataFrame({"key": [key[0]] * n, "n": range(count + 1, count + n + 1), "id": pdf["id"].to_numpy()})
        count += n
    state.update((count,))


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_kafka_json_to_pandas_state_to_kafka_on_spark_with_a_worker_kill(kafka, spark, tmp_path, mode):
    """The pipeline PySpark users run, on the spark driver: Kafka (Arrow batches) -> from_json
    with malformed and oversized records -> applyInPandasWithState running count -> Kafka, dead
    letters to a second topic; a task's Python worker SIGKILLed mid-run. Every good id once,
    each key's counts 1..n, every bad record once among the dead letters."""
    import collections
    import json

    from epochstream import KafkaSink
    from epochstream.backends.kafka import read_topic
    from pipelines import make_pipeline
    from test_kafka_arrow import MAX_RECORD_BYTES, SCHEMA, _json_topic

    src, bad, good_ids = _json_topic(kafka)
    out = new_topic(kafka, "counts", 2)
    dead_topic = new_topic(kafka, "dead", 1)
    p = make_pipeline("kafka-json-spark", mode=mode, interval=0.1, batch_size=64)
    (p.from_kafka(kafka.bootstrap_servers, src, end="latest", uid="src")
     .from_json(SCHEMA, uid="json", max_record_bytes=MAX_RECORD_BYTES,
                dead_letter=KafkaSink(kafka.bootstrap_servers, dead_topic, staging=str(tmp_path / "staging-dead")))
     .apply_in_pandas_with_state(_pandas_counts, "key string, n long, id long", "count long", "append",
                                 "NoTimeout", key="key", uid="count")
     .sink(KafkaSink(kafka.bootstrap_servers, out, key=lambda r: r["key"], staging=str(tmp_path / "staging")),
           uid="out"))
    res = p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark,
                failures=FailureSchedule(kill_times=[1.0], kill_moments=["snapshot_write"]))
    assert res.metrics["deployment"] == "spark" and res.restarts >= 1
    counts = [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, out)]
    assert check_running_counts([(r["key"], r["n"], r["id"]) for r in counts], good_ids) == []
    seen = collections.Counter((d["partition"], d["offset"])
                               for d in (json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers,
                                                                                     dead_topic)))
    assert set(seen) == bad and set(seen.values()) == {1}
