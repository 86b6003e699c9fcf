"""Savepoints on a real running job, end to end through the CLI (slow: real worker processes).

``epochstream run`` starts an unbounded job (local driver, two worker processes) that serves
its HTTP API; ``epochstream savepoint JOB DIR`` takes a savepoint while it runs,
``epochstream stop --savepoint DIR JOB`` takes one and stops it; ``epochstream run
--from-savepoint PATH -p 3`` restores it at another parallelism; ``epochstream state
query`` reads the result. Every key's committed count must equal the number of records of
that key the committed source offsets name: nothing lost, nothing doubled across the stop,
the rescale and the restore.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from epochstream.backends.local import LocalCheckpointStorage

pytestmark = pytest.mark.slow

#: the CLI without interpreter teardown (pyarrow may abort it after the result is out; see test_cli.py)
RUN = [sys.executable, "-c", "import os, sys\nfrom epochstream.cli import main\ncode = main(sys.argv[1:])\n"
       "sys.stdout.flush(); sys.stderr.flush(); os._exit(code)"]

KEYS = 5
JOB = textwrap.dedent('''
    from pathlib import Path
    from epochstream import CheckpointConfig, FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

    class Count(KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.state(ValueStateDescriptor("count", default=0))

        def process(self, value, ctx):
            n = self.count.value() + 1
            self.count.update(n)
            if n % 20000 == 0:
                return ((ctx.key, n),)

    def endless():
        p = Pipeline("endless", parallelism=2, max_parallelism=16, checkpoint=CheckpointConfig(interval=0.2),
                     restart_delay=0.1)
        (p.generate(lambda i: (f"k{{i % {keys}}}", i), count=None, uid="gen")
          .key_by(lambda r: r[0]).process(Count(), uid="count")
          .sink(FileSink(Path(__file__).parent / "out"), uid="out"))
        return p
''').format(keys=KEYS)


def cli(*args, cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RUN, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def expected_counts(offsets: dict[str, int], splits: int) -> dict[str, int]:
    """Records of each key the offsets name: split s holds ids s, s + splits, ... (GeneratorSource)."""
    out: dict[str, int] = {}
    for s, off in offsets.items():
        for j in range(int(off)):
            key = f"k{(j * splits + int(s)) % KEYS}"
            out[key] = out.get(key, 0) + 1
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_savepoint_stop_rescale_restore_query(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ, EPOCHSTREAM_HOME=str(tmp_path / "home"))
    job = subprocess.Popen([*RUN, "run", "job.py:endless", "--checkpoint-dir", "chk", "--savepoint-dir", "sp"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: list((tmp_path / "home" / "jobs").glob("*.json")) if (tmp_path / "home" / "jobs").is_dir()
                 else None, 60, "the job file")
        wait_for(lambda: LocalCheckpointStorage(tmp_path / "chk").list_checkpoints(), 60, "a first checkpoint")
        # a savepoint while it runs: into the job's --savepoint-dir, found by job name
        r = cli("savepoint", "endless", "--json", cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        first = json.loads(r.stdout)
        assert first["status"]["id"] == "COMPLETED"
        sp1 = Path(first["operation"]["location"])
        assert sp1.parent == tmp_path / "sp" and (sp1 / "_metadata.json").is_file()
        # the job answers its REST API: status and checkpoints
        info = json.loads(next((tmp_path / "home" / "jobs").glob("*.json")).read_text())
        r = cli("savepoint", info["endpoint"], tmp_path / "sp-endpoint", cwd=tmp_path, env=env)
        assert r.returncode == 0 and "savepoint: " in r.stdout, r.stderr
        # stop with a savepoint into another dir: the job ends after it
        r = cli("stop", "--savepoint", tmp_path / "sp-final", info["id"][:8], "--json", cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        final = Path(json.loads(r.stdout)["operation"]["location"])
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
        assert str(final) in out
        assert not list((tmp_path / "home" / "jobs").glob("*.json")), "the job file outlived the job"
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGKILL)
            job.wait()
    m = json.loads((final / "_metadata.json").read_text())
    assert m["kind"] == "savepoint" and m["epoch"] > json.loads((sp1 / "_metadata.json").read_text())["epoch"]
    r = cli("savepoint", "list", tmp_path / "sp", "--json", cwd=tmp_path, env=env)
    assert [Path(x["path"]) for x in json.loads(r.stdout)["savepoints"]] == [sp1]
    # the final savepoint holds exactly the records its offsets name
    offsets = m["sources"]["gen"]["offsets"]
    want = expected_counts(offsets, m["sources"]["gen"]["splits"])
    r = cli("state", "query", "--checkpoint-dir", final, "--operator", "count", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert {row["key"]: row["value"] for row in json.loads(r.stdout)["rows"]} == want
    # restore at parallelism 3 for a short while, then check the committed state against its offsets
    r = cli("run", "job.py:endless", "--from-savepoint", final, "-p", "3", "--checkpoint-dir", "chk3",
            "--duration", "1.5", "--json", cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["metrics"]["parallelism"] == 3
    storage = LocalCheckpointStorage(tmp_path / "chk3")
    m3, _ = storage.latest()
    assert m3["parallelism"] == 3 and m3["sources"]["gen"]["splits"] == 2
    assert all(int(m3["sources"]["gen"]["offsets"][s]) >= int(offsets[s]) for s in offsets)
    r = cli("state", "query", "--checkpoint-dir", tmp_path / "chk3", "--operator", "count", "--json",
            cwd=tmp_path, env=env)
    rows = json.loads(r.stdout)["rows"]
    assert {row["key"]: row["value"] for row in rows} == expected_counts(m3["sources"]["gen"]["offsets"], 2)
    assert {row["subtask"] for row in rows} <= {0, 1, 2}
    # dispose the first savepoint
    r = cli("savepoint", "dispose", sp1, cwd=tmp_path, env=env)
    assert r.returncode == 0 and not sp1.exists()


def test_state_query_as_a_spark_dataframe(tmp_path):
    """``epochstream.state.query_df``: the same committed state as the pyarrow Table, in a Spark
    DataFrame of a real (local) SparkSession."""
    from pyspark.sql import SparkSession

    import epochstream.state as state_api
    from epochstream import FileSink, Pipeline

    p = Pipeline("sums", parallelism=2, max_parallelism=16, checkpoint_interval=None)
    (p.from_collection(range(1000), uid="numbers").key_by(lambda x: x % 3).reduce(lambda a, b: a + b, uid="sums")
      .sink(FileSink(tmp_path / "out"), uid="out"))
    p.run(deployment="sim", checkpoint_dir=str(tmp_path / "chk"))
    table = state_api.query(tmp_path / "chk", "sums")
    spark = (SparkSession.builder.master("local[1]").appName("epochstream-query-test")
             .config("spark.ui.enabled", "false").getOrCreate())
    try:
        df = state_api.query_df(tmp_path / "chk", "sums", spark=spark)
        assert df.columns == table.column_names
        rows = sorted((r["key"], r["value"], r["subtask"]) for r in df.collect())
        assert rows == sorted(zip(table.column("key").to_pylist(), table.column("value").to_pylist(),
                                  table.column("subtask").to_pylist(), strict=True))
        assert {k: v for k, v, _s in rows} == {r: sum(x for x in range(1000) if x % 3 == r) for r in range(3)}
    finally:
        spark.stop()


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_restore_with_rescale_under_real_kills(tmp_path, mode):
    """The exactly-once oracle over restore-with-rescale on real processes: the chaos run is a job
    at parallelism 2 stopped with a savepoint, then that savepoint restored at parallelism 3,
    each phase with 2 SIGKILLs of workers; the committed output equals a failure-free run
    without rescaling and every epoch of both phases matches the sequential reference."""
    from epochstream.deploy.sim import FailureSchedule
    from epochstream.oracle import check_exactly_once
    from pipelines import running_count

    n = 120_000
    seconds: dict[str, float] = {}

    def run(p, chk, failing):
        p.restart_delay = 0.05
        p.restart_attempts = 50
        p.checkpoint.interval = 0.05
        if not failing:
            t0 = time.perf_counter()
            r = p.run(deployment="local", checkpoint_dir=chk, seed=1)
            seconds["reference"] = time.perf_counter() - t0
            return r
        h = max(seconds["reference"], 1.0)
        kills = FailureSchedule(kill_times=[0.15 * h, 0.15 * h + 0.3])
        first = p.run(deployment="local", checkpoint_dir=chk, seed=2, failures=kills, duration=0.45 * h + 0.3,
                      savepoint_dir=str(tmp_path / "savepoints"), stop_with_savepoint=True)
        assert first.savepoints and first.restarts >= 1, first.metrics["failovers"]
        kills = FailureSchedule(kill_times=[0.1 * h, 0.1 * h + 0.3])
        second = p.run(deployment="local", checkpoint_dir=chk, seed=3, failures=kills,
                       restore=first.savepoints[-1], parallelism=3)
        assert second.metrics["parallelism"] == 3
        second.restarts += first.restarts
        return second

    report = check_exactly_once(lambda: running_count(n=n, parallelism=2, mode=mode, max_parallelism=16,
                                                      batch_size=64), run, tmp_path / "work")
    assert report.ok and report.records_committed == report.records_expected == n, report.to_json()
    assert report.restarts >= 2 and report.epochs_checked >= 2, report.to_json()
