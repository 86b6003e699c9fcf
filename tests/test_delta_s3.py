"""Delta Lake on S3: checkpoints (boto3) and Delta tables (Spark through S3A) in one moto bucket.

moto's real HTTP server (``s3server.MotoS3``); the Spark session of this module is started
after the AWS_* variables point at it, so S3A (``spark_session.s3a_conf``) and boto3 reach
the same store. Delta's default S3 log store is the single-driver one: epochstream's job
master is the only writer of its tables. Slow: S3A round trips to moto are many per commit.

The exactly-once oracle runs in both modes with one chaos run per mode that crashes at every
delicate point of the two-phase commit (``CHAOS``), each failure checked to have fired where
it was meant to (``FailPointLog``): a failed state write and a worker kill during pre-commit;
a crash after the manifest, before any Delta commit; a crash during recovery, between the
re-issued state append and the re-issued sink append; a crash in a normal commit, between the
state append and the sink append (its recovery re-issues an append that already happened). Each
table on S3 then holds exactly one transaction per completed epoch.
"""

from __future__ import annotations

import inspect
import os

import pyarrow as pa
import pytest

from epochstream.backends import spark_session
from epochstream.backends.delta import DeltaCheckpointStorage, DeltaSink, history, read_state, tables
from epochstream.deploy.driver import Driver
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from pipelines import RunningCount, _key, input_records, make_pipeline, sim_run
from s3server import FAKE_KEY, FAKE_SECRET, REGION

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
N, KEYS = 80, 4


@pytest.fixture(scope="module")
def s3_spark(moto_s3_process):
    """AWS_* pointed at moto for the whole module, then one Spark session that inherits them."""
    env = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_DEFAULT_REGION": REGION,
           "AWS_ENDPOINT_URL": moto_s3_process.url}
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


def txn_epochs(table: str) -> list[int]:
    """Epochs of epochstream's transactions in a table, oldest first (duplicates kept)."""
    return sorted(h["meta"]["epoch"] for h in history(table)
                  if h["meta"] and h["meta"].get("epoch", 0) > 0 and not tables.is_compaction(h["meta"]))


#: occurrences count over the whole chaos run (seed 4): the first state write of the counting
#: operator fails (epoch 1 is declined; in aligned mode that is the run's 3rd capture, in tracker
#: mode the 5th: sources capture first) and a worker dies at virtual t=3.1 ms, both before any
#: manifest; the manifest of epoch 2 is written and the job master crashes (after_manifest 2);
#: recovery re-issues epoch 2's state append and crashes before the sink append (mid_commit 3,
#: inside recovery); the next recovery re-issues the MERGE (skipped: it happened) and the
#: append; epoch 3's commit crashes between its MERGE and its sink append (mid_commit 5), and
#: recovery finishes it (the MERGE skipped again)
CHAOS = dict(
    kill_times=[0.0031],
    fail_points={"after_manifest": {2}, "mid_commit": {3, 5}},
)
WRITE_FAILURE = {"aligned": 3, "tracker": 5}
#: where each injected crash must have happened: (point, occurrence, during recovery). An epoch's
#: commit passes ``mid_commit`` once per table or sink (the state table, the sink table, and the
#: oracle's order log of the keyed operator), so occurrence 3 is the last of the first commit and
#: occurrence 5 the second of the re-commit that the recovery after ``after_manifest`` runs
EXPECTED_CRASHES = [("mid_commit", 3, False), ("after_manifest", 2, False), ("mid_commit", 5, True)]


class FailPointLog:
    """Records every fail point the driver passes (name, occurrence, whether inside the
    recovery of a restart, whether a crash was injected there): the proof that each crash of
    the schedule fired, and fired at the protocol moment the test means."""

    def __init__(self) -> None:
        self.passed: list[tuple[str, int, bool, bool]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = Driver.fail_point
        log = self

        def fail_point(driver: Driver, name: str) -> None:
            n = driver.point_counts.get(name, 0) + 1
            in_recovery = any(f.function == "recover" for f in inspect.stack(0)[1:8])
            crash = n in driver.failures.fail_points.get(name, ())
            log.passed.append((name, n, in_recovery, crash))
            original(driver, name)

        monkeypatch.setattr(Driver, "fail_point", fail_point)

    def crashes(self) -> list[tuple[str, int, bool]]:
        return [(name, n, rec) for name, n, rec, crash in self.passed if crash]


@pytest.mark.timeout(1500)  # S3A to moto makes many requests per Delta commit; minutes under load
@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_delta_on_s3_crashing_at_every_point(s3_spark, moto_s3_process, monkeypatch, mode):
    """The oracle with checkpoints, state tables and the sink table all under s3:// (S3A for
    Spark), crashes at every point of the two-phase commit (``CHAOS``); re-issued commits never
    duplicate: each table holds one transaction per completed epoch."""
    bucket = moto_s3_process.new_bucket(f"delta-{mode}")
    work = f"s3://{bucket}/oracle"
    points = FailPointLog()
    runs = {}

    def run(p, chk, failing):
        failures = None
        if failing:
            failures = FailureSchedule(kill_times=list(CHAOS["kill_times"]),
                                       write_failures={WRITE_FAILURE[mode]},
                                       fail_points={k: set(v) for k, v in CHAOS["fail_points"].items()})
            points.install(monkeypatch)
        runs["sinks"] = len(p.sinks)  # recovery passes its fail point once per sink
        runs["chaos" if failing else "reference"] = result = sim_run(p, chk, seed=4, failures=failures)
        return result

    report = check_exactly_once(lambda: delta_count(mode=mode), run, work)
    chaos = runs["chaos"]
    reasons = [f["reason"] for f in chaos.metrics["failovers"]]
    assert report.ok, (report.to_json(), reasons)
    assert report.records_committed == report.records_expected == N
    # every scheduled failure fired, each at its moment, and each caused its own restart
    assert points.crashes() == EXPECTED_CRASHES, (points.passed, reasons)
    # the kill and the failed write came first, in pre-commit: three attempts started before any manifest
    first_manifest = [name for name, *_ in points.passed].index("before_manifest")
    assert [name for name, *_ in points.passed[:first_manifest]] == ["recovery"] * 3 * runs["sinks"], points.passed
    assert all("killed" in r or "state write failure" in r for r in reasons[:2]), reasons
    assert sum("injected state write failure" in r for r in reasons) == 1, reasons
    assert sum(" killed at t=" in r for r in reasons) == 1, reasons
    assert chaos.metrics["failures_injected"] == 5 and chaos.restarts == 5, reasons
    assert report.epochs_checked >= 3, report.to_json()

    storage = DeltaCheckpointStorage(f"{work}/chaos/chk")
    completed = storage.list_checkpoints()
    table = storage.table_path("count")
    sink_table = f"{work}/chaos/out/counts"
    assert table.startswith("s3://")
    # re-issued commits (three recoveries re-issued epochs 2 and 3) were skipped, not applied twice
    assert txn_epochs(table) == completed
    assert txn_epochs(sink_table) == completed
    for epoch in completed:  # each manifest names the Delta version that holds its epoch
        manifest, _ = storage.load_manifest(epoch)
        entry = manifest["delta"]["state"]["count"]
        assert entry["txn_version"] == epoch and isinstance(entry["version"], int)
    assert read_state(s3_spark, table).count() == KEYS  # the changelog folded by Spark, on S3A
    rows = DeltaSink(sink_table, SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", c) for k in range(KEYS) for c in range(1, N // KEYS + 1))
