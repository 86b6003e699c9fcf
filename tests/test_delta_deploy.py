"""Delta Lake under the real deployments (slow): the CLI with a SIGKILLed job, and the spark driver.

* ``epochstream run ... --state-backend delta`` (local driver, worker processes) is SIGKILLed,
  whole process group, in the window between an epoch's manifest and its Delta commit; ``run
  --restore latest --deployment spark`` re-issues that commit once and goes on on the spark
  driver (the CLI's session gets the Delta settings). Every retained epoch's committed
  state, read with Spark SQL (``VERSION AS OF`` the version its manifest records) and with
  ``epochstream state query --json``, equals the counts its source offsets name; the Delta
  sink holds each emitted count once; ``epochstream checkpoints list`` lists the checkpoints.
* the spark driver (``deployment="spark"``, a real ``local[3,4]`` master) with the Delta state
  backend and a Delta sink: the exactly-once oracle (aligned mode) under two real SIGKILLs of
  task Python workers (one while a snapshot is written, one while the job master commits to
  Delta) and a job-master crash after a manifest. The master has one slot more than the
  parallelism: the job master's Delta commits are Spark jobs of the same session, and a
  barrier stage holding every slot would starve them (refused with a clear error).

One SparkSession (the spark driver's, with the Delta jars and settings) serves the module:
the spark driver runs on it and the tests read the tables through it.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from epochstream.backends import spark_session as delta_session
from epochstream.backends.delta import DeltaCheckpointStorage, DeltaSink, history, read_state, tables
from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.restart import FixedDelayRestart
from epochstream.deploy.spark import spark_session
from epochstream.oracle import check_exactly_once
from pipelines import PacedSource, RunningCount, _key, input_records, make_pipeline

pytestmark = pytest.mark.slow

MASTER = "local[3,4]"  # the jobs run at parallelism 2, and one test at 3
SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])


@pytest.fixture(scope="module")
def spark():
    """The spark driver's session with Delta (jars, extension, catalog) for the whole module."""
    delta_session.stop()  # a session of another module may lack the Delta settings
    session = spark_session(MASTER, {**delta_session.delta_conf(), "spark.ui.enabled": "false",
                                     "spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2",
                                     "spark.databricks.delta.snapshotPartitions": "2"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def txn_epochs(table: str | Path) -> list[int]:
    """Epochs of epochstream's transactions in a table, oldest first (duplicates kept)."""
    return sorted(h["meta"]["epoch"] for h in history(str(table))
                  if h["meta"] and h["meta"].get("epoch", 0) > 0 and not tables.is_compaction(h["meta"]))


def value(v):
    """A state cell of the Delta table: pickled bytes unless the state declares a type."""
    return pickle.loads(v) if isinstance(v, (bytes, bytearray)) else v


# ---------------------------------------------------------------- the CLI, SIGKILL, restore

#: the CLI without interpreter teardown (pyarrow may abort it after the result is out; see test_cli.py)
RUN = [sys.executable, "-c", "import os, sys\nfrom epochstream.cli import main\ncode = main(sys.argv[1:])\n"
       "sys.stdout.flush(); sys.stderr.flush(); os._exit(code)"]
KEYS, EVERY = 5, 1000
JOB = textwrap.dedent('''
    import time
    from pathlib import Path

    import pyarrow as pa

    from epochstream import CheckpointConfig, KeyedProcessFunction, Pipeline, ValueStateDescriptor
    from epochstream.backends.delta import DeltaSink
    from epochstream.runtime.sources import GeneratorSource


    class Paced(GeneratorSource):
        """Endless (key, id) records at a bounded pace: the job leaves CPU to its Delta commits."""

        def read(self, split, offset, count):
            time.sleep(0.02)
            return super().read(split, offset, count)


    class Count(KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.state(ValueStateDescriptor("count", default=0))

        def process(self, value, ctx):
            n = self.count.value() + 1
            self.count.update(n)
            if n % {every} == 0:
                return ((ctx.key, n),)


    def endless():
        p = Pipeline("delta-endless", parallelism=2, max_parallelism=16, batch_size=256,
                     checkpoint=CheckpointConfig(interval=0.3, num_retained=100), restart_delay=0.1)
        (p.from_source(Paced(lambda i: (f"k{{i % {keys}}}", i), None, 2), uid="gen")
          .key_by(lambda r: r[0]).process(Count(), uid="count")
          .sink(DeltaSink(Path(__file__).parent / "out", pa.schema([("key", pa.string()), ("n", pa.int64())])),
                uid="out"))
        return p
''').format(keys=KEYS, every=EVERY)


def cli(*args, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def expected_counts(manifest: dict) -> dict[str, int]:
    """Records of each key the manifest's source offsets name (split s reads ids s, s + splits, ...)."""
    src = manifest["sources"]["gen"]
    splits = int(src["splits"])
    out: dict[str, int] = {}
    for s, off in src["offsets"].items():
        off = int(off)
        for r in range(KEYS):  # the j < off with j % KEYS == r all have key (r * splits + s) % KEYS
            n = off // KEYS + (1 if r < off % KEYS else 0)
            key = f"k{(r * splits + int(s)) % KEYS}"
            if n:
                out[key] = out.get(key, 0) + n
    return out


def kill_between_manifest_and_commit(job: subprocess.Popen, chk: Path, table: Path, timeout: float) -> int:
    """Wait until the newest manifest's epoch is not yet in the state table (the job master is
    between the commit point and its Delta append), then SIGKILL the job's whole process group
    (CLI process, worker processes, its Spark JVM). Returns that epoch."""
    storage = DeltaCheckpointStorage(chk)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()[1][-3000:]
        done = storage.list_checkpoints()
        # from the second epoch on (the first one also starts the job's Spark session)
        if len(done) >= 2 and (table / "_delta_log").is_dir() and done[-1] not in txn_epochs(table):
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
            gone = time.monotonic() + 30
            while time.monotonic() < gone:  # every process of the group (workers, JVM) is dead
                try:
                    os.killpg(job.pid, 0)
                except ProcessLookupError:
                    return done[-1]
                time.sleep(0.05)
            raise AssertionError(f"processes of group {job.pid} outlived the SIGKILL")
        time.sleep(0.005)
    raise AssertionError("no manifest-to-commit window seen before the timeout")


def test_cli_run_sigkill_restore_then_sql_and_state_query_agree(spark, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ, EPOCHSTREAM_HOME=str(tmp_path / "home"))
    chk, table = tmp_path / "chk", tmp_path / "chk" / "delta" / "count"
    flags = ["--checkpoint-dir", chk, "--state-backend", "delta", "--mode", "tracker"]
    job = subprocess.Popen([*RUN, "run", "job.py:endless", *map(str, flags)], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        killed = kill_between_manifest_and_commit(job, chk, table, timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == -signal.SIGKILL
    storage = DeltaCheckpointStorage(chk)
    assert max(storage.list_checkpoints()) == killed
    assert killed not in txn_epochs(table)  # the kill landed after the manifest, before the state append

    # restore on the spark driver (the CLI gives its session the Delta settings; local[3]: a slot
    # beyond the barrier stage for the commits): recovery re-issues epoch `killed`'s commits, then
    # the job runs 2 s more
    r = cli("run", "job.py:endless", *flags, "--restore", "latest", "--duration", "2", "--deployment", "spark",
            "--master", "local[3]", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["restarts"] == 0 and result["completed_epochs"], result
    assert result["metrics"]["deployment"] == "spark"
    epochs = storage.list_checkpoints()
    assert epochs[-1] == result["completed_epochs"][-1] > killed
    # one transaction per completed epoch in each table: the re-issued commit happened once
    assert txn_epochs(table) == epochs
    assert txn_epochs(tmp_path / "out") == epochs

    # every epoch's committed state, by Spark SQL time travel, equals what its offsets name
    for epoch in epochs:
        manifest, _ = storage.load_manifest(epoch)
        version = manifest["delta"]["state"]["count"]["version"]
        rows = read_state(spark, table, version=version).filter("state = 'count'").collect()
        assert {value(r["key"]): value(r["value"]) for r in rows} == expected_counts(manifest), epoch
    # the same through the CLI (read from the checkpoint's state files), newest and an older epoch
    final, _ = storage.load_manifest(epochs[-1])
    for epoch, manifest in ((None, final), (killed, storage.load_manifest(killed)[0])):
        args = ["state", "query", "--checkpoint-dir", chk, "--operator", "count", "--json"]
        r = cli(*args, *(["--epoch", epoch] if epoch else []), cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout)
        assert doc["epoch"] == manifest["epoch"]
        assert {row["key"]: row["value"] for row in doc["rows"]} == expected_counts(manifest)
    r = cli("checkpoints", "list", "--checkpoint-dir", chk, "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    listed = json.loads(r.stdout)["checkpoints"]
    assert [c["epoch"] for c in listed] == epochs and {c["status"] for c in listed} == {"completed"}
    # the Delta sink: each emitted count exactly once, all of them up to the final state
    out = spark.read.format("delta").load(str(tmp_path / "out")).collect()
    want = expected_counts(final)
    assert sorted((o["key"], o["n"]) for o in out) == sorted(
        (k, EVERY * j) for k, c in want.items() for j in range(1, c // EVERY + 1))


# ---------------------------------------------------------------- the spark driver


SPARK_N = 2400


def spark_delta_count(*, out=None, mode: str = "aligned"):
    """paced collection -> key_by -> RunningCount [uid "count", Delta state] -> DeltaSink "counts"."""
    p = make_pipeline("delta-spark", parallelism=2, mode=mode, interval=0.3, batch_size=16)
    p.checkpoint.state_backend = "delta"
    target = Path(out) / "counts" if out is not None else Path("/nonexistent/epochstream-placeholder")
    (
        p.from_source(PacedSource(input_records(SPARK_N, 4), 2, pause=0.03), uid="src")
        .key_by(_key)
        .process(RunningCount(), uid="count")
        .sink(DeltaSink(target, SCHEMA), uid="counts")
    )
    return p


def test_exactly_once_on_the_spark_driver_with_delta(spark, tmp_path):
    """Delta state backend and Delta sink on the spark driver: the job master commits through
    the driver's own session; two SIGKILLs of task Python workers (while a snapshot is written;
    while the job master commits to Delta) and a job-master crash after the second manifest.
    Aligned mode (the CLI test above runs tracker mode: the pair stays within the time budget)."""
    mode = "aligned"
    runs = {}

    def run(p, chk, failing):
        p.restart_strategy = FixedDelayRestart(attempts=10, delay=0.0)
        failures = None
        if failing:
            horizon = runs["reference"].metrics["run_seconds"]
            failures = FailureSchedule(kill_times=[0.1 * horizon, 0.12 * horizon],
                                       kill_moments=["snapshot_write", "commit"], kill_targets=["worker", "worker"],
                                       fail_points={"after_manifest": {2}})
        runs["chaos" if failing else "reference"] = result = p.run(
            deployment="spark", checkpoint_dir=chk, failures=failures, seed=3, spark=spark)
        return result

    report = check_exactly_once(lambda: spark_delta_count(mode=mode), run, tmp_path)
    chaos = runs["chaos"]
    reasons = [f["reason"].splitlines()[0][:200] for f in chaos.metrics["failovers"]]
    assert report.ok, (report.to_json(), reasons)
    assert report.records_committed == report.records_expected == SPARK_N
    assert report.epochs_checked >= 2, report.to_json()
    # all three failures fired (a kill may land in the attempt the crash ends: one failover for both)
    kills = chaos.metrics["kills"]
    assert chaos.metrics["failures_injected"] == 3 and len(kills) == 2, (kills, reasons)
    assert chaos.restarts >= 2 and any("died" in r or "spark job failed" in r for r in reasons), reasons
    assert sum("after_manifest" in r for r in reasons) == 1, reasons
    assert chaos.metrics["deployment"] == "spark" and chaos.metrics["mode"] == mode
    storage = DeltaCheckpointStorage(tmp_path / "chaos" / "chk")
    completed = storage.list_checkpoints()
    assert txn_epochs(storage.table_path("count")) == completed
    assert txn_epochs(tmp_path / "chaos" / "out" / "counts") == completed


def test_spark_driver_with_delta_runs_with_every_slot_in_the_barrier_stage(spark, tmp_path):
    """At parallelism 3 on local[3,4] the barrier stage holds every slot: the job master's Delta
    commits go through delta-rs in the driver process and need none, so the job runs exactly."""
    from deltalake import DeltaTable

    p = spark_delta_count(out=tmp_path / "out")
    p.parallelism = 3
    res = p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark)
    assert res.completed_epochs
    rows = DeltaTable(str(tmp_path / "out" / "counts")).to_pyarrow_table().to_pylist()
    counts: dict[str, list[int]] = {}
    for r in rows:
        counts.setdefault(r["key"], []).append(r["n"])
    expected = {f"k{k}": SPARK_N // 4 for k in range(4)}
    assert {k: sorted(v) for k, v in counts.items()} == {k: list(range(1, n + 1)) for k, n in expected.items()}
