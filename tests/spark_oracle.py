"""Helpers of the spark suites (``test_spark_local.py``, ``test_spark_cluster.py``): the
exactly-once oracle over the spark driver with real kills.

Kills follow ``FailureSchedule``: wall-clock times from the start of the run, at most one per
attempt (so every kill causes its own failover and restore), each waiting for its protocol
moment (``now``, ``alignment``, ``snapshot_write``, ``commit``) and hitting a ``worker`` (the
task's Python worker) or an ``executor`` (its JVM; local-cluster only). Kill times start
early in the failure-free run's measured duration, so each attempt after a restore is killed
soon after its workers are up and the fifth kill still lands before the job can finish.
"""

from __future__ import annotations

import time

from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.restart import FixedDelayRestart
from epochstream.oracle import OracleReport, check_exactly_once

MOMENTS = ["now", "alignment", "snapshot_write", "commit", "now"]


def spark_oracle(build, work, spark, *, targets: list[str], moments: list[str] = MOMENTS,
                 seed: int = 0) -> tuple[OracleReport, dict]:
    """A failure-free spark run, then one with ``len(targets)`` kills; returns the oracle's
    report and {"reference"|"chaos": JobResult}."""
    runs: dict = {}

    def run(p, chk, failing):
        p.restart_strategy = FixedDelayRestart(attempts=3 * len(targets) + 5, delay=0.0)
        failures = None
        if failing:
            horizon = runs["reference"].metrics["run_seconds"]
            # early, so that a short run on an idle machine still sees them all: the driver kills
            # at most once per attempt, so a passed kill time waits for the next attempt's moment
            failures = FailureSchedule(kill_times=[(0.1 + 0.02 * i) * horizon for i in range(len(targets))],
                                       kill_moments=list(moments[:len(targets)]), kill_targets=list(targets))
        t0 = time.perf_counter()
        result = p.run(deployment="spark", checkpoint_dir=chk, failures=failures, seed=seed, spark=spark)
        result.metrics["wall_seconds"] = time.perf_counter() - t0
        runs["chaos" if failing else "reference"] = result
        return result

    report = check_exactly_once(build, run, work)
    return report, runs


def describe(report: OracleReport, runs: dict) -> str:
    parts = [f"report={report.to_json()}"]
    for label, r in runs.items():
        parts.append(
            f"{label}: {r.metrics['wall_seconds']:.1f}s restarts={r.restarts} "
            f"injected={r.metrics['failures_injected']} "
            f"epochs={len(r.completed_epochs)} kills={r.metrics['kills']} recovery={r.metrics['recovery_seconds']} "
            f"failovers={[(round(f['time'], 2), f['reason'].splitlines()[0][:160]) for f in r.metrics['failovers']]}")
    return "\n".join(parts)


def assert_exactly_once_with_kills(report: OracleReport, runs: dict, kills: int) -> None:
    why = describe(report, runs)
    chaos = runs["chaos"]
    assert chaos.metrics["failures_injected"] >= kills, why
    assert len(chaos.metrics["kills"]) >= kills, why
    assert chaos.restarts >= kills, why  # every kill failed the job over (none merged into one attempt)
    assert len(chaos.metrics["recovery_seconds"]) >= kills, why  # every attempt after a kill came back up
    assert report.ok, why
    assert report.lost == 0 and report.duplicated == 0, why
    assert report.mismatched_state == 0 and report.mismatched_epoch_output == 0, why
    assert report.epochs_checked >= 2, why
    assert report.records_committed == report.records_expected > 0, why
