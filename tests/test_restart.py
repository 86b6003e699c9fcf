"""Restart strategies (``deploy.restart``): the decisions, and every driver obeying them.

The decisions are pure functions of the failure times, tested directly and as doctests. The
drivers share one retry loop (``deploy.driver.Driver.run``, tenacity); the simulator shows it
end to end: how many attempts each strategy allows, the error when it gives up, and that a
failure-rate strategy lets a job with spread-out failures finish.
"""

from __future__ import annotations

import doctest
import json
import threading
import time
import urllib.request

import pytest

from epochstream import Pipeline
from epochstream.deploy import restart
from epochstream.deploy.failures import JobFailedError
from epochstream.deploy.restart import (
    ExponentialDelayRestart,
    FailureRateRestart,
    FixedDelayRestart,
    no_restart,
    parse_restart_strategy,
)
from epochstream.deploy.sim import FailureSchedule
from pipelines import committed_counts, committed_output, running_count, sim_run


def test_doctests():
    failures, _ = doctest.testmod(restart, raise_on_error=False)
    assert failures == 0


def test_fixed_delay_counts_restarts():
    s = FixedDelayRestart(attempts=3, delay=0.25)
    assert [s.decide([0.0] * n, 0.0) for n in range(1, 6)] == [0.25, 0.25, 0.25, None, None]
    assert no_restart().decide([1.0], 1.0) is None


def test_exponential_delay_grows_caps_resets_and_limits():
    s = ExponentialDelayRestart(initial=0.1, max_delay=1.0, multiplier=3.0, jitter=0.0, reset_after=10.0, attempts=4)
    times = [0.0, 1.0, 2.0, 3.0]
    assert [s.decide(times[:n], times[n - 1]) for n in range(1, 5)] == pytest.approx([0.1, 0.3, 0.9, 1.0])
    assert s.decide(times + [4.0], 4.0) is None  # a fifth failure in one streak: over the 4 attempts
    assert s.decide(times + [20.0], 20.0) == pytest.approx(0.1)  # 16 s stable: back to the start


def test_exponential_jitter_stays_in_band_and_is_deterministic():
    s = ExponentialDelayRestart(initial=1.0, max_delay=1.0, jitter=0.2)
    delays = [s.decide([0.0] * n, 0.0) for n in range(1, 40)]
    assert all(0.8 <= d <= 1.2 for d in delays)
    assert len({round(d, 6) for d in delays}) > 5  # the jitter spreads them
    assert delays == [s.decide([0.0] * n, 0.0) for n in range(1, 40)]


def test_failure_rate_counts_only_the_window():
    s = FailureRateRestart(max_failures=2, interval=5.0, delay=0.5)
    assert s.decide([0.0, 1.0], 1.0) == 0.5
    assert s.decide([0.0, 1.0, 2.0], 2.0) is None
    assert s.decide([0.0, 1.0, 7.0], 7.0) == 0.5  # 0.0 and 1.0 fell out of the window


@pytest.mark.parametrize("spec, expected", [
    ("none", FixedDelayRestart(0, 0.0)),
    ("fixed-delay:4:0.5", FixedDelayRestart(4, 0.5)),
    ("exponential-delay:0.1:2", ExponentialDelayRestart(0.1, 2.0)),
    ("exponential-delay:0.1:2:3:7", ExponentialDelayRestart(0.1, 2.0, 3.0, attempts=7)),
    ("failure-rate:3:60:1", FailureRateRestart(3, 60.0, 1.0)),
])
def test_parse(spec, expected):
    assert parse_restart_strategy(spec) == expected


@pytest.mark.parametrize("spec", ["", "fixed", "fixed-delay:1", "fixed-delay:x:1", "failure-rate:1:0:1",
                                  "exponential-delay:2:1", "none:1"])
def test_parse_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="restart strategy"):
        parse_restart_strategy(spec)


def test_pipeline_keeps_the_fixed_delay_knobs():
    p = Pipeline("x", restart_attempts=3, restart_delay=0.2)
    assert p.restart_strategy == FixedDelayRestart(3, 0.2)
    p.restart_attempts = 7
    p.restart_delay = 0.0
    assert p.restart_strategy == FixedDelayRestart(7, 0.0)
    assert Pipeline("y").restart_strategy == FixedDelayRestart(10, 0.5)
    q = Pipeline("z", restart_strategy=FailureRateRestart(2, 60.0, 0.1))
    assert q.restart_attempts is None and q.restart_delay == 0.1
    with pytest.raises(ValueError, match="has no 'attempts'"):
        q.restart_attempts = 3
    with pytest.raises(ValueError, match="not both"):
        Pipeline("w", restart_attempts=1, restart_strategy=no_restart())
    with pytest.raises(TypeError, match="RestartStrategy"):
        Pipeline("v", restart_strategy="fixed-delay:1:1")


KILLS = [0.002, 0.004, 0.006, 0.008]


def _run(tmp_path, strategy, kills=KILLS):
    p = running_count(n=400, parallelism=2, out=tmp_path / "out")
    p.restart_strategy = strategy
    return sim_run(p, tmp_path / "chk", seed=3, failures=FailureSchedule(kill_times=list(kills)))


@pytest.mark.parametrize("strategy, gives_up", [
    (FixedDelayRestart(3, 0.0), "fixed-delay: gave up after 3 restarts"),
    (ExponentialDelayRestart(0.0, 0.0, attempts=2), "exponential-delay: gave up after 2 restarts"),
    # the simulator's restart delay is 0.01 virtual seconds: four kills 2 ms apart fall within 1 s
    (FailureRateRestart(max_failures=2, interval=1.0, delay=0.0), "failure-rate: more than 2 failures within 1.0s"),
])
def test_strategies_give_up_with_a_clear_error(tmp_path, strategy, gives_up):
    with pytest.raises(JobFailedError) as exc:
        _run(tmp_path, strategy)
    msg = str(exc.value)
    assert gives_up in msg, msg
    assert "last failure: " in msg and "worker" in msg, msg


@pytest.mark.parametrize("strategy", [
    FixedDelayRestart(4, 0.0),
    ExponentialDelayRestart(0.0, 0.0, attempts=4),
    FailureRateRestart(max_failures=1, interval=0.001, delay=0.0),  # kills 2 ms apart: never two in a window
])
def test_strategies_that_allow_the_failures_finish_exactly_once(tmp_path, strategy):
    result = _run(tmp_path, strategy)
    assert result.restarts == len(KILLS)
    assert len(result.metrics["failovers"]) == len(KILLS)
    counts = committed_counts(tmp_path / "chk")
    assert sum(counts.values()) == 400, counts
    k0_counts = sorted(r[1] for r in committed_output(tmp_path / "out" / "counts") if r[0] == "k0")
    assert k0_counts == list(range(1, len(range(0, 400, 7)) + 1))


@pytest.mark.slow
def test_the_restart_count_is_published_while_restarting(tmp_path):
    """Issue 18 finding 8: REST said RESTARTING with restarts 0. The count is published with the
    failure, before the restart delay (3 s here) and the next attempt (local driver)."""
    from epochstream.deploy.failures import FailureSchedule
    from pipelines import running_count

    # paced (>= 3 s) so epoch 2 always commits before the input ends, however fast the machine
    p = running_count(n=3000, parallelism=1, interval=0.05, source_delay=0.001, out=tmp_path / "out")
    p.restart_strategy = FixedDelayRestart(attempts=2, delay=3.0)
    info: dict = {}
    started = threading.Event()

    def on_start(doc):
        info.update(doc)
        started.set()

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=p.run(
        deployment="local", checkpoint_dir=str(tmp_path / "chk"), on_start=on_start,
        failures=FailureSchedule(fail_points={"after_commit": {2}}))))
    t.start()
    seen = []
    try:
        assert started.wait(60)
        while t.is_alive():
            try:
                with urllib.request.urlopen(f"{info['endpoint']}/jobs/{info['id']}", timeout=5) as r:
                    doc = json.loads(r.read())
            except OSError:
                break  # the job ended and its server closed
            seen.append((doc["state"], doc["restarts"]))
            time.sleep(0.05)
    finally:
        t.join(120)
    assert box["result"].restarts == 1
    restarting = {n for state, n in seen if state == "RESTARTING"}
    assert restarting == {1}, seen  # never RESTARTING with 0
