"""The spark driver on a real standalone cluster that loses machines (issue 18 item 7; slow).

One Master and three one-core Workers started from the pip-installed pyspark package
(``spark_standalone.StandaloneCluster``); jobs run at parallelism 2, so one Worker is a warm
spare. A Worker "machine" kill is SIGKILL of the Worker JVM and of the executor JVM it started
(the driver's chaos target ``machine``):

- exactly-once under a Worker kill in both modes (the oracle; the lost task is placed on the
  spare at once);
- a job that needs more slots than the cluster has: with ``slot_wait_timeout=0`` it fails
  within seconds naming slots needed, slots available and Spark's ``[SPARK-24819]`` message;
  with a timeout it waits visibly (REST ``WAITING_FOR_SLOTS``, ``slots``, ``restarts`` >= 1)
  and resumes, exactly, when a Worker comes back.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from epochstream.deploy.slots import SlotsUnavailableError
from epochstream.deploy.spark import spark_session
from pipelines import check_running_counts, committed_output, running_count
from spark_oracle import assert_exactly_once_with_kills, spark_oracle
from spark_standalone import StandaloneCluster

pytestmark = pytest.mark.slow

WORKERS = 3  # parallelism 2 and one warm spare


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = StandaloneCluster(tmp_path_factory.mktemp("standalone"), workers=WORKERS)
    session = None
    try:
        session = spark_session(c.url, {"spark.ui.enabled": "false", "spark.executor.cores": "1",
                                        "spark.executor.memory": "512m", "spark.driver.host": "127.0.0.1",
                                        "spark.driver.bindAddress": "127.0.0.1"})
        session.sparkContext.setLogLevel("ERROR")
        yield c, session
    finally:
        if session is not None:
            session.stop()
        c.stop()


def _slots(session) -> int:
    jsc = session.sparkContext._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def _restore_workers(c: StandaloneCluster, session, want: int = WORKERS, timeout: float = 120.0) -> None:
    """Start Workers until ``want`` are alive and their executors count as slots."""
    while sum(w.poll() is None for w in c.workers) < want:
        c.add_worker()
    deadline = time.monotonic() + timeout
    while _slots(session) < want:
        assert time.monotonic() < deadline, f"only {_slots(session)} slots {timeout}s after starting Workers"
        time.sleep(0.5)


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_when_a_worker_machine_is_lost(tmp_path, cluster, mode):
    c, session = cluster
    _restore_workers(c, session)
    build = partial(running_count, n=20_000, parallelism=2, mode=mode, interval=0.05, batch_size=64)
    try:
        report, runs = spark_oracle(build, tmp_path, session, targets=["machine"], moments=["now"], seed=5)
    finally:
        _restore_workers(c, session)
    assert_exactly_once_with_kills(report, runs, 1)
    assert runs["chaos"].metrics["kills"][0]["target"] == "machine"


def test_too_few_slots_fail_at_once_with_sparks_message(tmp_path, cluster):
    c, session = cluster
    _restore_workers(c, session)
    p = running_count(n=100, parallelism=WORKERS + 1, interval=0.05)
    p.slot_wait_timeout = 0
    t0 = time.monotonic()
    with pytest.raises(SlotsUnavailableError) as exc:
        p.run(deployment="spark", checkpoint_dir=str(tmp_path / "chk"), spark=session)
    seconds = time.monotonic() - t0
    msg = str(exc.value)
    print(f"failed after {seconds:.1f}s: {msg}")
    assert f"needs {WORKERS + 1} task slots at once, {c.url} has {WORKERS}" in msg, msg
    assert "Spark: [SPARK-24819]: Barrier execution mode does not allow run a barrier stage" in msg, msg
    assert "--slot-wait-timeout" in msg


def _status(endpoint: str, job_id: str, run: threading.Thread, box: dict) -> dict:
    """The job's REST status. A request that fails while the run goes on is asked again (a
    loaded machine; printed, so it shows in a failure's output); the server going away with
    the run means the run ended: say how."""
    for attempt in range(5):
        try:
            with urllib.request.urlopen(f"{endpoint}/jobs/{job_id}", timeout=10) as r:
                return json.loads(r.read())
        except OSError as exc:
            print(f"GET /jobs/{job_id} failed ({exc!r}), attempt {attempt + 1}; the run is "
                  f"{'alive' if run.is_alive() else 'over'}")
            if not run.is_alive():
                run.join(30)
                raise AssertionError(f"the job's REST API went away ({exc!r}); the run ended with {box}") from exc
            time.sleep(1.0)
    raise AssertionError(f"the job's REST API failed 5 times while the run went on; the run: {box}")


def test_a_lost_worker_is_waited_for_visibly_and_the_job_resumes_exactly(tmp_path, cluster):
    """p = every slot: a lost Worker leaves the stage short. REST shows WAITING_FOR_SLOTS with the
    counts and Spark's message and restarts >= 1; a new Worker lets it finish, exactly."""
    c, session = cluster
    _restore_workers(c, session)
    n = 60_000
    # paced (0.5 ms a record: 10 s of reading at least), so the job cannot end before the Worker
    # kill it waits for; unpaced, a CI machine once finished all 60,000 records 80 ms after epoch 1
    p = running_count(n=n, parallelism=WORKERS, interval=0.05, batch_size=64, emit_ids=True,
                      out=tmp_path / "out", source_delay=0.0005)
    p.slot_wait_timeout = 300
    chk = tmp_path / "chk"
    info: dict = {}
    started = threading.Event()

    def on_start(doc):
        info.update(doc)
        started.set()

    box: dict = {}

    def run():
        try:
            box["result"] = p.run(deployment="spark", checkpoint_dir=str(chk), spark=session, on_start=on_start)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    try:
        assert started.wait(180), box
        deadline = time.monotonic() + 180
        while _status(info["endpoint"], info["id"], t, box).get("completed-epochs", 0) < 1:
            assert time.monotonic() < deadline and "error" not in box, box
            time.sleep(0.1)
        victim = next(i for i, w in enumerate(c.workers) if w.poll() is None)
        c.kill_worker(victim)
        killed = time.monotonic()
        seen: dict[str, float] = {}
        status: dict = {}
        while "spark" not in seen:
            status = _status(info["endpoint"], info["id"], t, box)
            now = time.monotonic() - killed
            if status.get("restarts", 0) >= 1:
                seen.setdefault("restarts", now)
            if status.get("state") == "WAITING_FOR_SLOTS":
                seen.setdefault("waiting", now)
                if (status.get("slots") or {}).get("spark-message"):
                    seen["spark"] = now
            assert now < 120 and "error" not in box, (seen, status, box)
            time.sleep(0.1)
        print(f"after the Worker kill: {json.dumps({k: round(v, 2) for k, v in seen.items()})}; status slots: "
              f"{status['slots']}")
        slots = status["slots"]
        assert slots["needed"] == WORKERS and slots["available"] == WORKERS - 1, slots
        assert slots["spark-message"].startswith("[SPARK-24819]: Barrier execution mode"), slots
        assert status["restarts"] >= 1, status
        assert f"needs {WORKERS} task slots at once" in slots["message"]
    finally:
        _restore_workers(c, session)
        t.join(300)
    assert "error" not in box, box.get("error")
    result = box["result"]
    waits = result.metrics["slot_waits"]
    assert waits and waits[0]["needed"] == WORKERS and waits[0]["spark_message"].startswith("[SPARK-24819]")
    assert result.restarts >= 1
    records = committed_output(Path(tmp_path / "out") / "counts")
    assert check_running_counts(records, range(n)) == []  # independent of the oracle: each id once, counts 1..n
