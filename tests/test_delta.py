"""Delta Lake: committed keyed state and sink output as Delta tables, exactly once.

Real Spark (a local session with the jars ``scripts/setup.sh`` fetched with mvn), real Delta
tables on the local filesystem. One session serves the whole module: Spark start-up costs
seconds, each Delta commit about one on an idle machine. Missing jars make the fixture,
and so every test, fail (not skip).

* the exactly-once oracle in both modes with crashes in pre-commit (worker kills, failed
  state writes), between the manifest and the commits, between the state and the sink
  commit, and during recovery; every epoch's state is read back from the Delta table at the
  epoch's version, every epoch's output from the sink table at its version;
* one Delta transaction per operator and per sink per epoch, never two for one epoch, even
  when recovery re-issues commits that had already happened;
* read-committed: the table is a plain Delta table for Spark SQL, time travel per epoch; a
  prepared epoch whose commit has not happened is invisible until recovery commits it;
* restore reads state from Delta (the snapshot files are not needed);
* bad inputs: tables created by something else, a foreign commit (conflict), missing jars.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from epochstream import CheckpointError
from epochstream.backends import spark_session
from epochstream.backends.delta import (
    DeltaCheckpointStorage,
    DeltaConflictError,
    DeltaSink,
    history,
    read_state,
    state_at,
    tables,
)
from epochstream.backends.delta import schema as state_schema
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.failures import JobFailedError
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import ConfigurationError, SchemaError
from pipelines import (
    PacedSource,
    RunningCount,
    _key,
    delta_chaos_run,
    input_records,
    make_pipeline,
    sim_run,
    without_fsync,
)

pytestmark = pytest.mark.slow

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
N, KEYS = 160, 5


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def delta_count(*, out=None, mode: str = "aligned", n: int = N, parallelism: int = 2, **knobs) -> Any:
    """collection -> key_by -> RunningCount [uid "count", Delta state] -> DeltaSink "counts"."""
    p = make_pipeline("delta-count", parallelism=parallelism, mode=mode, interval=knobs.pop("interval", 0.002),
                      **knobs)
    p.checkpoint.state_backend = "delta"
    p.checkpoint.delta_compact_every = 2  # compactions happen (inline on the simulator) and meet the crashes
    target = Path(out) / "counts" if out is not None else Path("/nonexistent/epochstream-placeholder")
    (
        p.from_collection(input_records(n, KEYS), uid="src")
        .key_by(_key)
        .process(RunningCount(), uid="count")
        .sink(DeltaSink(target, SCHEMA), uid="counts")
    )
    return p


def file_counts(chk: Path, epoch: int) -> dict:
    """The ``count`` state of one checkpoint read from its snapshot files (no Delta involved)."""
    files = LocalCheckpointStorage(chk)
    manifest, root = files.load_manifest(epoch)
    out = {}
    for _kg, kbytes, name, vbytes in files.read_operator_rows(manifest, root, "count"):
        if name == "count":
            if vbytes is None:
                out.pop(pickle.loads(kbytes), None)
            else:
                out[pickle.loads(kbytes)] = pickle.loads(vbytes)
    return out


def txn_epochs(table: str | Path) -> list[int]:
    """Epochs of epochstream's transactions in a table, oldest first (duplicates kept)."""
    return sorted(h["meta"]["epoch"] for h in history(str(table))
                  if h["meta"] and h["meta"].get("epoch", 0) > 0 and not tables.is_compaction(h["meta"]))


# ---------------------------------------------------------------- exactly-once, the oracle


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_delta_state_and_sink(spark, mode, tmp_path):
    report = check_exactly_once(lambda: delta_count(mode=mode), delta_chaos_run(), tmp_path)
    assert report.ok, report.to_json()
    assert report.restarts >= 3, report.to_json()
    assert report.epochs_checked >= 2
    assert report.records_committed == report.records_expected == N
    chk = tmp_path / "chaos" / "chk"
    storage = DeltaCheckpointStorage(chk)
    completed = storage.list_checkpoints()
    # one transaction per completed epoch in the state table and in the sink table: re-issued
    # commits (recovery after the crashes above) were skipped by Delta, not applied twice
    assert txn_epochs(storage.table_path("count")) == completed
    assert txn_epochs(tmp_path / "chaos" / "out" / "counts") == completed
    for epoch in completed:  # every manifest records the Delta version that holds its epoch
        manifest, _ = storage.load_manifest(epoch)
        entry = manifest["delta"]["state"]["count"]
        assert entry["txn_version"] == epoch and isinstance(entry["version"], int)
        assert manifest["sinks"]["counts"]["delta"]["app_id"].startswith("epochstream/delta-count/sink/counts/")


def paced_delta_count(*, out=None, n: int = 3000, mode: str = "aligned"):
    p = make_pipeline("delta-paced", parallelism=2, mode=mode, interval=0.4, batch_size=16, restart_attempts=10)
    p.checkpoint.state_backend = "delta"
    p.checkpoint.delta_compact_every = 3  # compactions on the job master's thread while workers are killed
    p.restart_delay = 0.05
    target = Path(out) / "counts" if out is not None else Path("/nonexistent/epochstream-placeholder")
    (
        p.from_source(PacedSource(input_records(n, KEYS), 2, pause=0.03), uid="src")
        .key_by(_key)
        .process(RunningCount(), uid="count")
        .sink(DeltaSink(target, SCHEMA), uid="counts")
    )
    return p


def test_exactly_once_with_delta_on_the_local_driver_with_real_kills(spark, tmp_path):
    """Worker processes SIGKILLed while records flow (state capture and output staging happen
    in them) and a job-master crash between a manifest and its commits, on the local driver:
    the oracle passes with Delta state and sink, one transaction per epoch."""

    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=[0.8, 1.6], fail_points={"after_manifest": {2}}) if failing else None
        return p.run(deployment="local", checkpoint_dir=chk, failures=failures, seed=5)

    report = check_exactly_once(paced_delta_count, run, tmp_path)
    assert report.ok, report.to_json()
    assert report.restarts >= 2, report.to_json()
    assert report.records_committed == report.records_expected == 3000
    storage = DeltaCheckpointStorage(tmp_path / "chaos" / "chk")
    assert txn_epochs(storage.table_path("count")) == storage.list_checkpoints()


# ---------------------------------------------------------------- read-committed view, restore


def test_committed_state_is_a_plain_delta_table_with_time_travel(spark, tmp_path):
    p = delta_count(out=tmp_path / "out", interval=0.0005)  # 3 epochs: the 3rd append is compacted
    result = sim_run(p, tmp_path / "chk", seed=1)
    storage = DeltaCheckpointStorage(tmp_path / "chk")
    table = storage.table_path("count")
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW counts_state AS SELECT * FROM delta.`{table}`")
    columns = lambda st: [(f.name, f.dataType, f.nullable) for f in st.fields]  # noqa: E731
    # the table has the columns the state table's schema defines (schema.DDL, parsed by Spark)
    assert columns(spark.table("counts_state").schema) == columns(spark.createDataFrame([], state_schema.DDL).schema)
    for epoch in result.completed_epochs:
        manifest, _ = storage.load_manifest(epoch)
        version = manifest["delta"]["state"]["count"]["version"]
        # the changelog folded at the epoch's version (read_state runs STATE_SQL): by version and by epoch
        rows = read_state(spark, table, version=version).filter("state = 'count'").collect()
        got = {pickle.loads(r["key"]): pickle.loads(r["value"]) for r in rows}
        # the same committed state as the snapshot files of that checkpoint (read without Delta)
        assert got == file_counts(tmp_path / "chk", epoch), epoch
        assert all(r["epoch"] <= epoch for r in rows)
        # and what delta-rs folds (no Spark) is the same
        assert sorted(tuple(d.values()) for d in state_at(table, epoch).filter(pc.equal(pc.field("state"), "count"))
                      .to_pylist()) == sorted(tuple(r.asDict().values()) for r in rows)
    last = result.completed_epochs[-1]
    newest = {pickle.loads(r["key"]): pickle.loads(r["value"]) for r in read_state(spark, table).collect()}
    assert newest == file_counts(tmp_path / "chk", last)  # read_state with no epoch: the newest
    assert read_state(spark, table, epoch=last).count() == len(newest)  # by epoch (its version from the history)
    # the table was compacted after the last epoch (delta_count compacts every 2 appends): Spark reads the
    # compacted file (written by pyarrow, added with its Delta stats) as the raw newest version, one row per key;
    # a filter on epoch goes through the file statistics
    assert tables.is_compaction(history(table)[0]["meta"])
    raw = spark.read.format("delta").load(table).filter(f"epoch <= {last}").collect()
    assert {pickle.loads(r["key"]): pickle.loads(r["value"]) for r in raw} == newest and len(raw) == len(newest)
    final = {r["key"]: r["n"] for r in spark.read.format("delta").load(str(tmp_path / "out" / "counts"))
             .groupBy("key").max("n").withColumnRenamed("max(n)", "n").collect()}
    assert final == {f"k{i}": N // KEYS for i in range(KEYS)}
    # the sink table (written by delta-rs) read by Spark at every epoch's version: what delta-rs reads there
    sink = DeltaSink(tmp_path / "out" / "counts", SCHEMA)
    assert [e for e, _v in sink.epochs()] == result.completed_epochs
    epochs = sink.epochs()
    for _epoch, version in sorted({epochs[0], epochs[len(epochs) // 2], epochs[-1]}):  # a Spark job each
        by_spark = spark.read.format("delta").option("versionAsOf", version).load(str(sink.path)).collect()
        assert sorted((r["key"], r["n"]) for r in by_spark) == sorted((r["key"], r["n"]) for r in sink.read(version))
    described = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").select("version", "userMetadata").collect()
    assert {json.loads(r["userMetadata"])["epoch"] for r in described if r["userMetadata"]} >= set(
        result.completed_epochs)  # Spark sees each epoch's transaction label in the history


def test_prepared_epoch_is_invisible_until_recovery_commits_it(spark, tmp_path):
    """A crash right after epoch 2's manifest: the Delta tables still show epoch 1 (never a mix);
    the restart's recovery re-issues epoch 2's commits, once."""
    p = delta_count(out=tmp_path / "out", restart_attempts=0)
    with pytest.raises(JobFailedError):
        sim_run(p, tmp_path / "chk", seed=1, failures=FailureSchedule(fail_points={"after_manifest": {2}}))
    storage = DeltaCheckpointStorage(tmp_path / "chk")
    assert storage.list_checkpoints() == [1, 2]
    assert txn_epochs(storage.table_path("count")) == [1]
    assert txn_epochs(tmp_path / "out" / "counts") == [1]
    latest = spark.read.format("delta").load(storage.table_path("count"))
    assert latest.filter("epoch > 1").count() == 0
    sim_run(delta_count(out=tmp_path / "out"), tmp_path / "chk", seed=1, restore="latest")
    done = storage.list_checkpoints()
    assert txn_epochs(storage.table_path("count")) == done
    assert txn_epochs(tmp_path / "out" / "counts") == done
    rows = DeltaSink(tmp_path / "out" / "counts", SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", c) for k in range(KEYS) for c in range(1, N // KEYS + 1))


def test_restore_reads_state_back_from_delta_by_time_travel(spark, tmp_path):
    """The restored state comes from the Delta table at the recorded version: with the
    snapshot files deleted, a restore still continues the counts exactly."""
    p = delta_count(out=tmp_path / "out", restart_attempts=0, n=2 * N)
    with pytest.raises(JobFailedError):
        sim_run(p, tmp_path / "chk", seed=2, failures=FailureSchedule(fail_points={"after_commit": {2}}))
    shutil.rmtree(tmp_path / "chk" / "shared")
    sim_run(delta_count(out=tmp_path / "out", n=2 * N), tmp_path / "chk", seed=2, restore="latest")
    rows = DeltaSink(tmp_path / "out" / "counts", SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", c) for k in range(KEYS) for c in range(1, 2 * N // KEYS + 1))


def test_checkpoint_copied_without_its_tables_restores_from_its_files(spark, tmp_path):
    """A checkpoint folder copied elsewhere without the Delta tables (as a relocated savepoint
    is) restores from its state files; the new run builds new tables in its own checkpoint dir."""
    p = delta_count(out=tmp_path / "out", restart_attempts=0, n=2 * N)
    with pytest.raises(JobFailedError):
        sim_run(p, tmp_path / "chk", seed=2, failures=FailureSchedule(fail_points={"after_commit": {2}}))
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "chk", copy, ignore=shutil.ignore_patterns("delta"))
    latest = max(DeltaCheckpointStorage(copy).list_checkpoints())
    sim_run(delta_count(out=tmp_path / "out", n=2 * N), tmp_path / "chk2", seed=2, restore=str(copy / f"chk-{latest}"))
    rows = DeltaSink(tmp_path / "out" / "counts", SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", c) for k in range(KEYS) for c in range(1, 2 * N // KEYS + 1))
    storage = DeltaCheckpointStorage(tmp_path / "chk2")
    final = max(storage.list_checkpoints())
    manifest, _ = storage.load_manifest(final)
    version = manifest["delta"]["state"]["count"]["version"]
    got = {pickle.loads(r["key"]): pickle.loads(r["value"])
           for r in read_state(spark, storage.table_path("count"), version=version).collect()}
    assert got == {f"k{k}": 2 * N // KEYS for k in range(KEYS)}


# ---------------------------------------------------------------- bad inputs


def test_state_table_created_by_something_else_is_refused(spark, tmp_path):
    table = tmp_path / "chk" / "delta" / "count"
    spark.createDataFrame([(1, "theirs")], "id INT, note STRING").write.format("delta").save(str(table))
    before = history(str(table))
    with pytest.raises(CheckpointError, match="not created by epochstream"):
        sim_run(delta_count(out=tmp_path / "out"), tmp_path / "chk", seed=1)
    assert history(str(table)) == before  # nothing written to it
    assert [tuple(r) for r in spark.read.format("delta").load(str(table)).collect()] == [(1, "theirs")]


def test_sink_table_created_by_something_else_is_refused(spark, tmp_path):
    table = tmp_path / "out" / "counts"
    spark.createDataFrame([("x", 1)], "key STRING, n BIGINT").write.format("delta").save(str(table))
    with pytest.raises(CheckpointError, match="not created by epochstream"):
        sim_run(delta_count(out=tmp_path / "out"), tmp_path / "chk", seed=1)
    assert len(history(str(table))) == 1
    assert not (tmp_path / "chk").exists() or DeltaCheckpointStorage(tmp_path / "chk").list_checkpoints() == []


def test_foreign_commit_to_the_state_table_is_a_conflict(spark, tmp_path):
    """Someone else updates the committed-state table between two runs: the restart refuses
    to commit on top of it (its content no longer matches the checkpoints); nothing is lost:
    the foreign commit and every checkpoint stay as they were."""
    p = delta_count(out=tmp_path / "out", restart_attempts=0, n=2 * N)
    with pytest.raises(JobFailedError):
        sim_run(p, tmp_path / "chk", seed=2, failures=FailureSchedule(fail_points={"after_manifest": {2}}))
    storage = DeltaCheckpointStorage(tmp_path / "chk")
    table = storage.table_path("count")
    spark.sql(f"UPDATE delta.`{table}` SET epoch = 99")  # touches every row: a real commit
    checkpoints = storage.list_checkpoints()
    versions = len(history(table))
    with pytest.raises(DeltaConflictError, match="changed by another writer"):
        sim_run(delta_count(out=tmp_path / "out", n=2 * N), tmp_path / "chk", seed=2, restore="latest")
    assert len(history(table)) == versions
    assert storage.list_checkpoints() == checkpoints


def test_missing_jars_is_a_clear_configuration_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EPOCHSTREAM_JARS", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigurationError, match="Delta Lake jars are missing.*setup.sh"):
        spark_session.spark_jars()


def test_s3a_jars_go_on_the_session_only_when_s3_is_in_play(monkeypatch, tmp_path):
    """The AWS SDK bundle (~650 MB, copied into every session's and executor's temp folder) is
    left out of spark.jars for local tables, and put in for S3 ones."""
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(spark_session, "_s3a_needed", False)
    names = lambda: {Path(j).name.split("-")[0] for j in spark_session.spark_jars()}  # noqa: E731
    DeltaCheckpointStorage(tmp_path / "chk")
    DeltaSink(tmp_path / "out", SCHEMA)
    assert "delta" in names() and "hadoop" not in names() and "bundle" not in names()
    DeltaSink("s3://bucket/out", SCHEMA)  # an S3 table: the session it starts needs S3A
    assert {"hadoop", "bundle"} <= names()
    monkeypatch.setattr(spark_session, "_s3a_needed", False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # so does a process configured for S3
    assert {"hadoop", "bundle"} <= names()


def test_driver_memory_of_the_local_session_comes_from_the_environment(monkeypatch):
    """EPOCHSTREAM_SPARK_DRIVER_MEMORY sizes the local session (large MERGEs); configure() still wins."""
    monkeypatch.setenv(spark_session.DRIVER_MEMORY_ENV, "3g")
    try:
        assert spark_session.builder()._options["spark.driver.memory"] == "3g"
        monkeypatch.delenv(spark_session.DRIVER_MEMORY_ENV)
        assert spark_session.builder()._options["spark.driver.memory"] == "1g"
        monkeypatch.setenv(spark_session.DRIVER_MEMORY_ENV, "3g")
        monkeypatch.setitem(spark_session._extra_conf, "spark.driver.memory", "5g")
        assert spark_session.builder()._options["spark.driver.memory"] == "5g"
    finally:
        monkeypatch.undo()
        spark_session.builder()  # the builder's options are shared: leave the defaults behind


def test_delta_sink_rejects_records_that_do_not_fit(tmp_path):
    sink = DeltaSink(tmp_path / "t", SCHEMA)
    with pytest.raises(SchemaError, match="does not match the columns"):
        sink.pre_commit("s", 0, 1, "a", [("only-one-field",)])
    with pytest.raises(SchemaError, match="do not fit the schema"):
        sink.pre_commit("s", 0, 1, "a", [("k", "not-a-number")])
    assert json.loads(sink.encoder(("k", 3))) == {"key": "k", "n": 3}
