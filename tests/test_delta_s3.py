"""Delta Lake on S3: checkpoints (boto3) and Delta tables (Spark through S3A) in one moto bucket.

moto's real HTTP server (``s3server.MotoS3``); the Spark session of this module is started
after the AWS_* variables point at it, so S3A (``spark_session.s3a_conf``) and boto3 reach
the same store. Delta's default S3 log store is the single-driver one: epochstream's job
master is the only writer of its tables. Slow: S3A round trips to moto are many per commit.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from epochstream.backends import spark_session
from epochstream.backends.delta import DeltaCheckpointStorage, DeltaSink, history
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from pipelines import RunningCount, _key, input_records, make_pipeline, sim_run
from s3server import FAKE_KEY, FAKE_SECRET, REGION

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
N, KEYS = 80, 4


@pytest.fixture(scope="module")
def s3_spark(moto_s3):
    """AWS_* pointed at moto for the whole module, then one Spark session that inherits them."""
    env = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_DEFAULT_REGION": REGION,
           "AWS_ENDPOINT_URL": moto_s3.url}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    spark_session.stop()  # a session of another module would not have the S3A settings
    spark = spark_session.get_spark()
    yield spark
    spark_session.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def delta_count(*, out=None, mode: str = "aligned"):
    p = make_pipeline("delta-s3-count", parallelism=2, mode=mode, interval=0.001)
    p.checkpoint.state_backend = "delta"
    (
        p.from_collection(input_records(N, KEYS), uid="src")
        .key_by(_key)
        .process(RunningCount(), uid="count")
        .sink(DeltaSink(out or "s3://placeholder-bucket/none", SCHEMA), uid="counts")
    )
    return p


@pytest.mark.timeout(1500)  # S3A to moto makes many requests per Delta commit; minutes under load
def test_exactly_once_with_delta_on_s3(s3_spark, moto_s3):
    """The oracle with checkpoints, state tables and the sink table all under s3://: a crash
    after the first manifest, before its Delta commits, so recovery re-issues them (once) through S3A."""
    bucket = moto_s3.new_bucket("delta")
    work = f"s3://{bucket}/oracle"

    def run(p, chk, failing):
        failures = FailureSchedule(fail_points={"after_manifest": {1}}) if failing else None
        return sim_run(p, chk, seed=4, failures=failures)

    report = check_exactly_once(lambda: delta_count(), run, work)
    assert report.ok, report.to_json()
    assert report.restarts >= 1
    assert report.records_committed == report.records_expected == N
    storage = DeltaCheckpointStorage(f"{work}/chaos/chk")
    table = storage.table_path("count")
    assert table.startswith("s3://")
    epochs = sorted(h["meta"]["epoch"] for h in history(table) if h["meta"] and h["meta"]["epoch"] > 0)
    assert epochs == storage.list_checkpoints()
    rows = s3_spark.read.format("delta").load(table.replace("s3://", "s3a://", 1)).count()
    assert rows == KEYS
