"""The exactly-once oracle on every storage backend, in both exactly-once modes.

One table, ``BACKENDS``, says how a test gets a fresh work location on a backend (a local
folder; a bucket on moto's HTTP server); every test below runs once per row, so a new
backend is one more row. Checkpoints *and* sink output go to the backend.

Fast suite (simulator): the oracle under job-master crashes and failed writes at the
delicate points of the epoch commit:

* ``pre-commit``: state writes that fail, a worker killed while captures are being written,
  and a crash before the manifest;
* ``manifest-to-commit``: crashes after the manifest and in the middle of the sink commits,
  so recovery must re-issue commits without duplicating output;
* ``recovery``: crashes while recovery re-issues those commits, repeatedly.

Slow suite (local driver, real processes): real SIGKILLs of workers, and on S3 a worker
SIGKILLed by the fault proxy while its state or staged-output upload is in flight, with
throttling and slow PUTs injected all along; the driver itself SIGKILLed mid manifest
upload (through the CLI), then resumed with ``--restore latest``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest

from epochstream import FileSink
from epochstream.backends import open_storage
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import OracleReport, check_exactly_once
from pipelines import SOURCE_RATE, check_running_counts, running_count, sim_run, two_sinks, without_fsync
from s3server import Fault, wait_for

#: backend -> fresh work location (path or URL) for one test; ``request`` gives fixtures lazily
BACKENDS: dict[str, Callable[[Any, Path], str]] = {
    "local": lambda request, tmp_path: str(tmp_path / "work"),
    "s3": lambda request, tmp_path: request.getfixturevalue("s3_url"),
}
MODES = ("aligned", "tracker")

#: what goes wrong in the simulator (occurrence numbers count over the whole chaos run)
SCENARIOS = {
    "pre-commit": FailureSchedule(kill_times=[0.0021], write_failures={2, 5},
                                  fail_points={"before_manifest": {2}}),
    "manifest-to-commit": FailureSchedule(fail_points={"after_manifest": {1, 3}, "mid_commit": {2}}),
    "recovery": FailureSchedule(fail_points={"after_manifest": {2}, "recovery": {1, 3, 4}}),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tmp_path) -> tuple[str, str]:
    return request.param, BACKENDS[request.param](request, tmp_path)


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def assert_exactly_once(report: OracleReport, why: str = "") -> None:
    why = why or json.dumps(report.to_json())
    assert report.ok, why
    assert report.lost == report.duplicated == 0, why
    assert report.mismatched_state == report.mismatched_epoch_output == 0, why
    assert report.epochs_checked >= 2, why
    assert report.records_committed == report.records_expected > 0, why


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("mode", MODES)
def test_oracle_on_every_backend(backend, mode, scenario):
    name, work = backend
    schedule = SCENARIOS[scenario]
    build = partial(two_sinks, n=200, parallelism=2, mode=mode, interval=0.001, batch_size=8, tolerable_failed=0)
    results = {}

    def run(p, chk, failing):
        r = sim_run(p, chk, seed=11, failures=schedule if failing else None, source_rate=SOURCE_RATE)
        results[failing] = r
        return r

    report = check_exactly_once(build, run, work)
    chaos = results[True]
    why = f"{name}/{mode}/{scenario}: {report.to_json()} failovers={chaos.metrics['failovers']}"
    assert chaos.metrics["failures_injected"] >= 2, why
    assert chaos.restarts >= 2, why
    assert_exactly_once(report, why)
    assert str(chaos.checkpoint_dir).startswith("s3://" if name == "s3" else "/"), why


# ---------------------------------------------------------------- slow: real processes


RESTART_DELAY = 0.05
N_LOCAL = 50_000


def _local_oracle(work: str, mode: str, kills: list[float], seed: int,
                  fail_points: dict[str, set[int]] | None = None, build=None):
    """The oracle over the local driver; ``kills`` are SIGKILL times of workers as fractions of
    the failure-free run's measured duration (at least 0.25 s apart); ``fail_points`` crash
    the driver-side job master."""
    runs: dict[str, Any] = {}

    def run(p, chk, failing):
        p.restart_delay = RESTART_DELAY
        p.restart_attempts = 30
        failures = None
        if failing:
            horizon = runs["reference_seconds"]
            # one kill per attempt (the driver's rule): a passed kill time waits for the next attempt
            failures = FailureSchedule(kill_times=[f * horizon for f in kills],
                                       fail_points=dict(fail_points or {}))
        t0 = time.perf_counter()
        runs["chaos" if failing else "reference"] = r = p.run(deployment="local", checkpoint_dir=chk,
                                                               failures=failures, seed=seed)
        runs.setdefault("reference_seconds", time.perf_counter() - t0)
        return r

    build = build or partial(running_count, n=N_LOCAL, parallelism=2, mode=mode, interval=0.1, batch_size=64)
    return check_exactly_once(build, run, work), runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_local_driver_with_real_kills_on_every_backend(backend, mode):
    name, work = backend
    report, runs = _local_oracle(work, mode, kills=[0.15, 0.4], seed=5)
    chaos = runs["chaos"]
    why = f"{name}/{mode}: {report.to_json()} failovers={chaos.metrics['failovers']}"
    assert chaos.metrics["failures_injected"] >= 2 and chaos.restarts >= 2, why
    assert_exactly_once(report, why)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_local_driver_job_master_crashes_on_every_backend(backend, mode):
    """Real processes, two sinks: the job master crashes after a manifest, between two sink
    commits, and twice while recovery re-issues commits; a worker is SIGKILLed too."""
    name, work = backend
    points = {"after_manifest": {2}, "mid_commit": {3}, "recovery": {3, 5}}
    build = partial(two_sinks, n=15_000, parallelism=2, mode=mode, interval=0.25, batch_size=64)
    report, runs = _local_oracle(work, mode, kills=[0.6], seed=8, fail_points=points, build=build)
    chaos = runs["chaos"]
    why = f"{name}/{mode}: {report.to_json()} failovers={chaos.metrics['failovers']}"
    reasons = " ".join(f["reason"] for f in chaos.metrics["failovers"])
    for point in points:
        assert f"injected crash at {point}" in reasons, why
    assert_exactly_once(report, why)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_s3_worker_killed_mid_upload_under_throttling(s3_url, fault_proxy, monkeypatch, mode):
    """Workers write through the fault proxy: a few 503 SlowDown and slow PUTs, and twice a
    worker is SIGKILLed while its upload is in flight (a state file, then staged output). The
    job fails over, recovers, and the oracle passes."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    monkeypatch.setenv("EPOCHSTREAM_S3_READ_TIMEOUT", "2")
    chaos_only = r"/chaos/"
    kills = [fault_proxy.add(Fault("PUT", chaos_only + r"chk/shared/", "kill_sender", times=1, skip=2)),
             fault_proxy.add(Fault("PUT", chaos_only + r"out/counts/_staging/", "kill_sender", times=1, skip=5))]
    fault_proxy.add(Fault("PUT", chaos_only + r"chk/shared/", "error", 503, "SlowDown", times=3))
    fault_proxy.add(Fault("PUT", chaos_only + r"out/counts/_staging/", "delay", seconds=2.5, times=1, skip=1))
    build = partial(running_count, n=60_000, parallelism=2, mode=mode, interval=0.1, batch_size=64)
    report, runs = _local_oracle(s3_url, mode, kills=[], seed=6, build=build)
    chaos = runs["chaos"]
    why = f"{mode}: {report.to_json()} failovers={chaos.metrics['failovers']} proxy={fault_proxy.log[-5:]}"
    assert [len(k.killed) for k in kills] == [1, 1], why
    assert chaos.restarts >= 2, why
    assert fault_proxy.count("PUT", r"/shared/", "error") == 3, why
    assert_exactly_once(report, why)


JOB = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from pipelines import running_count

    def build():
        p = running_count(n={n}, parallelism=2, interval=0.02, batch_size=64, out={out!r}, emit_ids=True)
        p.restart_delay = 0.05
        return p
""")


@pytest.mark.slow
def test_s3_driver_killed_mid_manifest_upload_then_resumed(tmp_path, s3_url, s3_env, fault_proxy):
    """``epochstream run`` on S3, SIGKILLed (driver process) by the proxy while its second
    manifest PUT is in flight: that checkpoint never exists. ``run --restore latest`` then
    finishes the job: every id is committed once and each key's counts are exactly 1..n."""
    n = 300_000
    out = f"{s3_url}/out"
    job = tmp_path / "job.py"
    job.write_text(JOB.format(tests=str(Path(__file__).parent), n=n, out=out))
    env = {**os.environ, **s3_env, "AWS_ENDPOINT_URL": fault_proxy.url,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    kill = fault_proxy.add(Fault("PUT", r"/chk/chk-\d+/_metadata", "kill_sender", times=1, skip=1))
    cmd = [sys.executable, "-m", "epochstream.cli", "run", f"{job}:build", "--deployment", "local",
           "--checkpoint-dir", f"{s3_url}/chk", "--json"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == -9, (first.returncode, first.stdout[:300], first.stderr[-2000:],
                                    [e for e in fault_proxy.log if "_metadata" in e[1]])
    assert len(kill.killed) == 1
    storage = open_storage(f"{s3_url}/chk")
    assert storage.list_checkpoints() == [1]  # the second manifest never landed, nor half of it
    second = subprocess.run(cmd + ["--restore", "latest"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads(second.stdout)["completed_epochs"][0] == 2
    assert check_running_counts(FileSink(f"{out}/counts").read(), range(n)) == []
    # the killed run's workers noticed their driver was gone and exited
    assert wait_for(lambda: not _processes_with(str(job)), timeout=20), _processes_with(str(job))


def _processes_with(text: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                continue
    return pids
