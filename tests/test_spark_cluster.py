"""The spark driver on ``local-cluster[2,1,1024]``: a standalone master with two separate
executor JVMs, from pip-installed pyspark (slow suite: ``pytest -m slow``).

Kills hit executor JVMs (SIGKILL: Spark loses the executor, the standalone master starts a
new one, the barrier job aborts and the driver resubmits it once two slots are back) and the
Python workers of tasks, at random protocol moments, in both exactly-once modes; the oracle
checks committed output and every epoch's state. One SparkSession for the module (a
local-cluster takes ~13 s to start).
"""

from __future__ import annotations

from functools import partial

import pytest

from epochstream.deploy.spark import spark_session
from pipelines import running_count
from spark_oracle import assert_exactly_once_with_kills, spark_oracle

pytestmark = pytest.mark.slow

MASTER = "local-cluster[2,1,1024]"
#: executor JVMs and Python workers, alternating; five real kills per run
TARGETS = ["executor", "worker", "executor", "worker", "worker"]


@pytest.fixture(scope="module")
def spark():
    session = spark_session(MASTER, {"spark.ui.enabled": "false", "spark.executor.cores": "1"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_executor_and_worker_kills(tmp_path, spark, mode):
    build = partial(running_count, n=150_000, parallelism=2, mode=mode, interval=0.05, batch_size=64)
    report, runs = spark_oracle(build, tmp_path, spark, targets=TARGETS, seed=11)
    assert_exactly_once_with_kills(report, runs, len(TARGETS))
    kills = runs["chaos"].metrics["kills"]
    assert sum(k["target"] == "executor" for k in kills) >= 2, kills
