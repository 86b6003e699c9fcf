"""Faults beyond kills on the spark driver (issue 14, item 5), judged by the exactly-once oracle.

* a TCP fault proxy on the mesh link between the two tasks (``tcpproxy``, through the driver's
  ``mesh_route``): every byte delayed, the failure-free run included (delays alone must not
  break anything); in the run with faults the first attempt's link is reset (both ends get an
  RST: the tasks fail, the job fails over), the second attempt's link turns into a black hole
  (open but silent: the epoch cannot complete, the checkpoint timeout fails the job over), and
  the third attempt finishes;
* SIGSTOP of a task's Python worker (the ``freeze`` kill target): alive but silent, so only
  the heartbeat timeout finds it; the job fails over, the frozen task is cancelled, and the
  run is exact.

One local SparkSession for the module; both modes each.
"""

from __future__ import annotations

import time
from functools import partial

import pytest

from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.liveness import HeartbeatConfig
from epochstream.deploy.restart import FixedDelayRestart
from epochstream.deploy.spark import spark_session
from epochstream.oracle import check_exactly_once
from pipelines import union_chain
from tcpproxy import TcpFaultProxy

pytestmark = pytest.mark.slow

MASTER = "local[3,4]"  # two barrier tasks, and a slot while a cancelled frozen task is still being ended


@pytest.fixture(scope="module")
def spark():
    session = spark_session(MASTER, {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _build(mode: str):
    return partial(union_chain, n=20_000, emit_ids=True, parallelism=2, mode=mode, interval=0.05, batch_size=8)


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_sigstopped_spark_python_worker_fails_over_on_heartbeat_timeout_exactly_once(tmp_path, spark, mode):
    runs: dict = {}
    heartbeat = HeartbeatConfig(interval=0.2, timeout=2.0)

    def run(p, chk, failing):
        p.restart_strategy = FixedDelayRestart(attempts=3, delay=0.0)
        p.heartbeat = heartbeat
        failures = None
        if failing:
            failures = FailureSchedule(kill_times=[0.0], kill_targets=["freeze"])  # once all are ready
        t0 = time.perf_counter()
        result = p.run(deployment="spark", checkpoint_dir=chk, failures=failures, seed=3, spark=spark)
        runs["chaos" if failing else "reference"] = (result, time.perf_counter() - t0)
        return result

    report = check_exactly_once(_build(mode), run, tmp_path)
    chaos, seconds = runs["chaos"]
    why = (f"{report.to_json()} failovers={chaos.metrics['failovers']} kills={chaos.metrics.get('kills')} "
           f"recovery={chaos.metrics.get('recovery_seconds')}")
    assert chaos.metrics["failures_injected"] == 1 and chaos.restarts == 1, why
    reason = chaos.metrics["failovers"][0]["reason"]
    victim = chaos.metrics["kills"][0]["worker"]
    assert f"worker {victim} sent no heartbeat" in reason and "heartbeat timeout 2 s" in reason, why
    assert report.ok, why
    assert report.lost == report.duplicated == report.inputs_lost == report.inputs_duplicated == 0, why
    detected = chaos.metrics["failovers"][0]["time"] - chaos.metrics["kills"][0]["time"]
    print(f"\nspark {mode} freeze: reference {runs['reference'][1]:.1f} s, chaos {seconds:.1f} s, freeze to "
          f"failover {detected:.2f} s, recovery {chaos.metrics.get('recovery_seconds')}; lost {report.lost}, "
          f"duplicated {report.duplicated}, ok {report.ok}")


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_mesh_link_delayed_reset_and_dropped_fails_over_exactly_once(tmp_path, spark, mode):
    runs: dict = {}

    def run(p, chk, failing):
        p.restart_strategy = FixedDelayRestart(attempts=4, delay=0.0)
        p.checkpoint.timeout = 6.0  # a black-holed link stalls the epoch: this is what finds it
        # each fault a fifth of the way through the failure-free run's traffic on the link
        at = runs["reference"][2].relayed // 5 if failing else 0
        proxy = TcpFaultProxy(delay=0.02, plan=[("reset", at), ("drop", at)] if failing else [])
        t0 = time.perf_counter()
        try:
            result = p.run(deployment="spark", checkpoint_dir=chk, seed=3, spark=spark, mesh_route=proxy.route())
        finally:
            proxy.stop()
        runs["chaos" if failing else "reference"] = (result, time.perf_counter() - t0, proxy)
        return result

    report = check_exactly_once(_build(mode), run, tmp_path)
    (ref, ref_s, ref_proxy), (chaos, chaos_s, proxy) = runs["reference"], runs["chaos"]
    reasons = [f["reason"].splitlines()[0][:200] for f in chaos.metrics["failovers"]]
    why = f"{report.to_json()} failovers={reasons} events={proxy.events} opened={proxy.opened}"
    assert ref.restarts == 0 and ref_proxy.relayed > 0 and [o[:2] for o in ref_proxy.opened] == [(1, 0)], why
    assert [k for k, _t in proxy.events] == ["reset", "drop"] and len(proxy.opened) == 3, why
    assert chaos.restarts == 2, why
    assert "worker 1 lost its connection to worker 0" in reasons[0] or \
        "worker 0 lost its connection to worker 1" in reasons[0], why  # the reset: named at once
    assert "timed out after 6.0s" in reasons[1], why  # the black hole: only the checkpoint timeout finds it
    assert report.ok, why
    assert report.lost == report.duplicated == report.inputs_lost == report.inputs_duplicated == 0, why
    print(f"\nspark {mode} mesh proxy: reference (delay only) {ref_s:.1f} s, chaos {chaos_s:.1f} s; failovers "
          f"{reasons}; link bytes {ref_proxy.relayed}; lost {report.lost}, duplicated {report.duplicated}, "
          f"ok {report.ok}")
