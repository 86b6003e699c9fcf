"""Kafka in, Kafka out on the spark driver: the source and the sink's staging run inside Spark
tasks (their Python workers use the same confluent-kafka client), the job master commits the
Kafka transactions in the driver. A task Python worker is SIGKILLed mid-run in each mode; the
output topic at read_committed holds every input's result exactly once."""

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
