"""The spark driver on a local master, ``local[2,4]`` (slow suite: ``pytest -m slow``).

One SparkSession for the whole module (start-up costs seconds). Every worker is a task of a
barrier stage in a Python worker that Spark starts; kills are real SIGKILLs of those Python
workers, at random protocol moments (``spark_oracle.MOMENTS``), and every kill aborts the
Spark job, which the driver resubmits (``local[N,F]`` allows task retries, but Spark never
retries a failed barrier result stage on its own). Correctness is the exactly-once oracle in
both modes; also: Spark DataFrame and rate sources, the restart strategy giving up, bad
set-ups, and per-epoch metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from epochstream import FileSink, Pipeline
from epochstream.deploy.failures import FailureSchedule, JobFailedError
from epochstream.deploy.restart import ExponentialDelayRestart, FixedDelayRestart
from epochstream.deploy.spark import spark_session
from epochstream.runtime.errors import ConfigurationError, UserFunctionError
from pipelines import RunningCount, committed_output, make_pipeline, running_count, union_chain
from spark_oracle import assert_exactly_once_with_kills, spark_oracle
from test_epoch_metrics import check_epoch_metrics

pytestmark = pytest.mark.slow

MASTER = "local[2,4]"
KILLS = 5


@pytest.fixture(scope="module")
def spark():
    session = spark_session(MASTER, {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


# ---------------------------------------------------------------- exactly-once with real kills


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_python_worker_kills(tmp_path, spark, mode):
    """5 SIGKILLs of task Python workers (now, mid-alignment, mid-snapshot-write, mid-commit,
    now): every kill aborts the barrier job, the driver resubmits it and the tasks restore
    from the latest completed epoch; committed output and every epoch's state are exact."""
    build = partial(union_chain, n=90_000, parallelism=2, mode=mode, interval=0.05, batch_size=64)
    report, runs = spark_oracle(build, tmp_path, spark, targets=["worker"] * KILLS, seed=3)
    assert_exactly_once_with_kills(report, runs, KILLS)
    chaos = runs["chaos"]
    assert chaos.metrics["deployment"] == "spark" and chaos.metrics["mode"] == mode
    assert all("died" in f["reason"] or "spark job failed" in f["reason"] for f in chaos.metrics["failovers"]), \
        chaos.metrics["failovers"]
    check_epoch_metrics(runs["reference"], tmp_path / "reference" / "chk", mode)



def test_exactly_once_columnar_with_python_worker_kills(tmp_path, spark):
    """Arrow batches over the Spark driver's TCP mesh (Arrow IPC frames): the columnar
    running count (from_arrow -> key_by("key") -> a keyed batch function), 5 kills."""
    build = partial(running_count, n=90_000, parallelism=2, mode="aligned", interval=0.05, batch_size=256,
                    columnar=True)
    report, runs = spark_oracle(build, tmp_path, spark, targets=["worker"] * KILLS, seed=4)
    assert_exactly_once_with_kills(report, runs, KILLS)

# ---------------------------------------------------------------- sources from Spark


def _dataframe_pipeline(df, snap: Path, out: Path | None, mode: str = "aligned") -> Pipeline:
    p = make_pipeline("dataframe", parallelism=2, mode=mode, interval=0.1, batch_size=64)
    snap.mkdir(parents=True, exist_ok=True)
    (
        p.from_dataframe(df, uid="orders", path=str(snap / f"s{len(list(snap.iterdir()))}"), records="tuple")
        .key_by(lambda r: r[0])
        .process(RunningCount(), uid="count")
        .sink(FileSink(out / "counts") if out else FileSink(snap / "placeholder"), uid="counts")
    )
    return p


def test_dataframe_source_from_parquet_exactly_once_with_kills(tmp_path, spark):
    """A DataFrame read from Parquet (written by Spark, 5 partitions) is a bounded source whose
    partitions are the splits; with 2 kills its committed counts are exact."""
    spark.range(0, 8_000, numPartitions=5).selectExpr("concat('k', cast(id % 11 as string)) as key", "id") \
        .write.parquet(str(tmp_path / "orders.parquet"))
    df = spark.read.parquet(str(tmp_path / "orders.parquet")).repartition(5)
    build = partial(_dataframe_pipeline, df, tmp_path / "snapshots", None)
    probe = build()
    src = probe.sources["orders"]
    assert src.num_splits == 5 and sum(src.split_length(s) for s in range(5)) == 8_000
    report, runs = spark_oracle(build, tmp_path / "oracle", spark, targets=["worker"] * 2, seed=5)
    assert_exactly_once_with_kills(report, runs, 2)


def test_dataframe_snapshot_missing_is_a_clear_error(tmp_path, spark):
    df = spark.range(0, 100, numPartitions=2).selectExpr("'k' as key", "id")
    p = _dataframe_pipeline(df, tmp_path / "snap", tmp_path / "out")
    p.restart_strategy = FixedDelayRestart(1, 0.0)
    victim = next((tmp_path / "snap").rglob("split-00001.parquet"))
    victim.unlink()
    with pytest.raises(JobFailedError) as exc:
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark)
    assert "split-00001.parquet" in str(exc.value) and "cannot be read" in str(exc.value), str(exc.value)


def test_rate_source_unbounded_run_commits_a_gapless_prefix(tmp_path, spark):
    """An unbounded rate source stopped by ``duration``: every split's committed values are
    exactly its records before the final epoch's offsets (no gap, no duplicate), one kill
    included."""
    p = make_pipeline("rate", parallelism=2, interval=0.1, batch_size=64)
    p.rate(2_000, uid="rate").map(lambda r: r["value"]).sink(FileSink(tmp_path / "out"), uid="values")
    result = p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark, duration=4.0,
                   failures=FailureSchedule(kill_times=[1.0]))
    assert result.metrics["failures_injected"] == 1 and result.restarts == 1
    manifest = json.loads((Path(result.latest_checkpoint) / "_metadata.json").read_text())
    offsets = {int(k): v for k, v in manifest["sources"]["rate"]["offsets"].items()}
    expected = sorted(j * 2 + s for s, off in offsets.items() for j in range(off))
    assert sorted(committed_output(tmp_path / "out")) == expected
    assert len(expected) > 1_000


# ---------------------------------------------------------------- restart strategy and bad set-ups


class FailsAt(RunningCount):
    def process(self, value, ctx):
        if value[1] == 500:
            raise ValueError("bad record 500")
        return super().process(value, ctx)


@pytest.mark.parametrize("strategy, words", [
    (FixedDelayRestart(2, 0.1), "fixed-delay: gave up after 2 restarts"),
    (ExponentialDelayRestart(0.05, 0.2, attempts=1), "exponential-delay: gave up after 1 restarts"),
])
def test_restart_strategy_resubmits_then_gives_up(tmp_path, spark, strategy, words):
    p = make_pipeline("fails", parallelism=2, interval=0.1, batch_size=64)
    p.restart_strategy = strategy
    p.from_collection([(f"k{i % 3}", i) for i in range(2_000)], uid="src").key_by(lambda r: r[0]) \
        .process(FailsAt(), uid="count").sink(FileSink(tmp_path / "out"), uid="out")
    with pytest.raises(JobFailedError) as exc:
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark)
    msg = str(exc.value)
    assert words in msg and "bad record 500" in msg and "count" in msg, msg
    assert isinstance(exc.value.__cause__, Exception)


def test_more_workers_than_slots_is_refused_without_retries(tmp_path, spark):
    p = running_count(n=100, parallelism=3, out=tmp_path / "out")
    with pytest.raises(ConfigurationError, match=r"needs 3 barrier task slots.*offers 2"):
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark)


def test_executor_kills_need_local_cluster(tmp_path, spark):
    p = running_count(n=50_000, parallelism=2, interval=0.1, batch_size=64, out=tmp_path / "out")
    with pytest.raises(ConfigurationError, match="local-cluster"):
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark,
              failures=FailureSchedule(kill_times=[0.0], kill_targets=["executor"]))


def test_user_error_names_the_operator(tmp_path, spark):
    p = make_pipeline("fails", parallelism=2, interval=0.1, batch_size=64, restart_attempts=0)
    p.from_collection([(f"k{i % 3}", i) for i in range(2_000)], uid="src").key_by(lambda r: r[0]) \
        .process(FailsAt(), uid="count").sink(FileSink(tmp_path / "out"), uid="out")
    with pytest.raises(JobFailedError) as exc:
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=spark)
    assert "UserFunctionError" in str(exc.value) and "'count'" in str(exc.value), str(exc.value)
    assert UserFunctionError.__name__ in str(exc.value)


# ---------------------------------------------------------------- command line


def test_cli_run_on_spark(tmp_path):
    """``epochstream run --deployment spark --master ...`` in its own process (its own JVM),
    then ``checkpoints list --json`` shows the per-epoch metrics."""
    job = tmp_path / "job.py"
    job.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from pipelines import running_count\n"
        f"def build():\n    return running_count(n=5000, parallelism=2, interval=0.2, out={str(tmp_path / 'out')!r})\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**__import__("os").environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "epochstream.cli", "run", f"{job}:build", "--deployment", "spark",
           "--master", "local[2,2]", "--spark-conf", "spark.ui.enabled=false", "--checkpoint-dir",
           str(tmp_path / "chk"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["metrics"]["deployment"] == "spark" and doc["records_in"] == 5000
    assert sum(1 for _ in committed_output(tmp_path / "out" / "counts")) == 5000
    listed = subprocess.run([sys.executable, "-m", "epochstream.cli", "checkpoints", "list", "--checkpoint-dir",
                             str(tmp_path / "chk"), "--json"], capture_output=True, text=True, env=env, timeout=60)
    rows = json.loads(listed.stdout)["checkpoints"]
    assert rows and all(r["metrics"]["tasks"] and r["metrics"]["service_messages"]["acks"] == 4 for r in rows)
    bad = subprocess.run([sys.executable, "-m", "epochstream.cli", "run", f"{job}:build", "--master", "local[2]"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2
    assert "--master, --spark-conf and --slot-wait-timeout need --deployment spark" in bad.stderr
