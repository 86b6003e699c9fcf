"""Liveness: heartbeats between the job master and its workers (issue 14, finding 2).

The pure part (``deploy.liveness``) is driven with explicit times; the slow test freezes a
worker of a local-driver job with SIGSTOP (alive but silent, as a hung or cut-off host) and
checks that the job fails over within the heartbeat timeout, names the worker and why, and
still commits every record exactly once (the oracle in recorded order: the pipeline merges
two sources, so its running counts depend on arrival order).
"""

from __future__ import annotations

import time
from functools import partial

import pytest

from epochstream.deploy.liveness import HeartbeatConfig, HeartbeatMonitor, HeartbeatSender
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import ConfigurationError
from pipelines import union_chain

# ---------------------------------------------------------------- sans-IO decisions


def test_a_silent_worker_expires_after_the_timeout_and_not_before():
    m = HeartbeatMonitor(HeartbeatConfig(interval=1.0, timeout=5.0))
    assert m.expired(100.0) == [] and m.next_deadline() is None
    m.watch(0, 0.0)
    m.watch(1, 0.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        m.heard(0, t)
    assert m.expired(4.99) == []
    assert m.next_deadline() == 5.0
    silent = m.expired(6.0)
    assert [s.worker for s in silent] == [1]
    assert "worker 1 sent no heartbeat for 6.0 s" in silent[0].reason and "timeout 5 s" in silent[0].reason
    m.heard(1, 6.5)  # a late message revives it
    assert m.expired(7.0) == []
    m.forget_all()
    assert m.expired(1000.0) == []


def test_messages_from_unwatched_workers_are_ignored_and_time_never_goes_back():
    m = HeartbeatMonitor(HeartbeatConfig(interval=0.5, timeout=2.0))
    m.heard(3, 1.0)  # before its Ready: not watched
    assert m.last_heard == {}
    m.watch(0, 10.0)
    m.heard(0, 9.0)  # an older timestamp does not move it back
    assert m.last_heard[0] == 10.0


def test_sender_is_due_every_interval():
    s = HeartbeatSender(0.5, 0.0)
    assert [s.due(t) for t in (0.1, 0.49, 0.5, 0.6, 1.0, 1.01)] == [False, False, True, False, True, False]


@pytest.mark.parametrize("interval,timeout", [(0, 1), (1, 0), (2, 2), (3, 1), (-1, 5)])
def test_bad_heartbeat_settings_are_refused(interval, timeout):
    with pytest.raises(ConfigurationError, match="heartbeat"):
        HeartbeatConfig(interval, timeout)


def test_default_timeout_is_at_most_ten_seconds():
    assert HeartbeatConfig().timeout <= 10.0 and HeartbeatConfig().interval < HeartbeatConfig().timeout


# ---------------------------------------------------------------- a frozen worker, for real


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_sigstopped_worker_is_declared_failed_and_the_job_fails_over_exactly_once(tmp_path, mode):
    runs: dict = {}
    heartbeat = HeartbeatConfig(interval=0.2, timeout=2.0)

    def run(p, chk, failing):
        p.restart_delay = 0.05
        p.heartbeat = heartbeat
        failures = None
        if failing:
            failures = FailureSchedule(kill_times=[0.3 * runs["reference"][1]], kill_targets=["freeze"])
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=chk, failures=failures, seed=3)
        runs["chaos" if failing else "reference"] = (result, time.perf_counter() - t0)
        return result

    build = partial(union_chain, n=40_000, emit_ids=True, parallelism=2, mode=mode, interval=0.05, batch_size=8)
    report = check_exactly_once(build, run, tmp_path)
    chaos = runs["chaos"][0]
    why = f"{report.to_json()} failovers={chaos.metrics['failovers']} kills={chaos.metrics.get('kills')}"
    assert chaos.metrics["failures_injected"] == 1, why
    assert chaos.restarts == 1, why
    reason = chaos.metrics["failovers"][0]["reason"]
    victim = chaos.metrics["kills"][0]["worker"]
    assert f"worker {victim} sent no heartbeat" in reason and "heartbeat timeout 2 s" in reason, why
    assert report.ok, why
    assert report.lost == report.duplicated == report.inputs_lost == report.inputs_duplicated == 0, why


def test_a_worker_that_never_gets_ready_expires_after_the_startup_timeout():
    m = HeartbeatMonitor(HeartbeatConfig(interval=1.0, timeout=5.0, startup_timeout=30.0))
    m.launched(0, 0.0)
    m.launched(1, 0.0)
    m.watch(0, 1.0)
    assert m.next_deadline() == 6.0
    m.heard(0, 29.0)
    assert m.expired(29.9) == []
    silent = m.expired(30.0)
    assert [(s.worker, s.starting) for s in silent] == [(1, True)]
    assert "was not ready 30.0 s after its launch" in silent[0].reason


# ---------------------------------------------------------------- long steps are not silence


def test_a_long_step_is_alive_until_the_step_timeout_and_a_turning_loop_clears_it():
    m = HeartbeatMonitor(HeartbeatConfig(interval=1.0, timeout=5.0, step_timeout=60.0))
    m.watch(0, 0.0)
    m.watch(1, 0.0)
    for t in range(2, 59):  # worker 0's pulse thread: inside one step since t = 1
        m.heard(0, float(t))
        m.busy(0, float(t), busy_for=t - 1.0)
        m.heard(1, float(t))
        m.busy(1, float(t), None)  # worker 1's loop turns
    assert m.expired(60.9) == [] and m.next_deadline() == 61.0
    stuck = m.expired(61.0)
    assert [(s.worker, s.stuck) for s in stuck] == [(0, True)]
    assert "inside one task step for 60.0 s (heartbeat step timeout 60 s)" in stuck[0].reason
    m.busy(0, 61.0, None)  # the step ended: the loop's own heartbeat
    assert m.expired(61.0) == []
    m.busy(7, 61.0, busy_for=100.0)  # not a watched worker
    assert m.expired(61.0) == []


def test_a_step_timeout_must_exceed_the_interval():
    with pytest.raises(ConfigurationError, match="step_timeout"):
        HeartbeatConfig(interval=1.0, timeout=5.0, step_timeout=1.0)


class _SleepOnce:
    """map: sleeps ``seconds`` on the record with id ``at`` (a step far longer than the heartbeat timeout)."""

    def __init__(self, seconds: float, at: int) -> None:
        self.seconds, self.at = seconds, at

    def __call__(self, record):
        if record[1] == self.at:
            time.sleep(self.seconds)
        return record


def _sleepy(tmp_path, seconds: float, heartbeat: HeartbeatConfig, attempts: int):
    from epochstream import FileSink, Pipeline

    p = Pipeline("sleepy", parallelism=2, checkpoint_interval=0.1, batch_rows=16, heartbeat=heartbeat,
                 restart_attempts=attempts, restart_delay=0.05)
    (p.from_collection([(f"k{i % 5}", i) for i in range(2000)], uid="src").key_by(lambda r: r[0])
      .map(_SleepOnce(seconds, 1000)).sink(FileSink(str(tmp_path / "out")), uid="out"))
    return p


@pytest.mark.slow
def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_failure(tmp_path):
    """A user function that takes 3 s on one record, with a 1 s heartbeat timeout: the worker's
    pulse thread keeps it alive, so the job ends without a failover (before, it was declared
    failed at every attempt)."""
    result = _sleepy(tmp_path, 3.0, HeartbeatConfig(interval=0.2, timeout=1.0, step_timeout=30.0), 0).run(
        deployment="local", checkpoint_dir=str(tmp_path / "chk"))
    assert result.restarts == 0 and result.records_in == 2000, result.metrics["failovers"]


@pytest.mark.slow
def test_a_step_that_never_returns_is_declared_failed_at_the_step_timeout(tmp_path):
    from epochstream.deploy.failures import JobFailedError

    p = _sleepy(tmp_path, 3600.0, HeartbeatConfig(interval=0.2, timeout=1.0, step_timeout=2.0), 0)
    with pytest.raises(JobFailedError, match=r"inside one task step for \d+\.\d s \(heartbeat step timeout 2 s\)"):
        p.run(deployment="local", checkpoint_dir=str(tmp_path / "chk"))
