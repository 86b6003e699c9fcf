"""One job per checkpoint folder (issue 18 item 1): the lease, its takeover and attempt fencing.

The concurrency tests hold the first run inside a user function (on a thread) while a
second run, restore or chaos starts on the same folder: the second is refused with the
holder named and nothing in the folder changes; then the first finishes and its committed
output is checked independently (every id once, every key's counts 1..n), on a local
disk and on moto's real S3 server, in both exactly-once modes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from epochstream import FileSink
from epochstream.backends import open_storage
from epochstream.deploy.lease import (
    LEASE,
    FencedError,
    Lease,
    LeaseHeldError,
    LeaseInfo,
    check_fence,
    lease_status,
)
from epochstream.deploy.persist import persist
from epochstream.runtime.messages import KeyedCapture, SinkCapture, TaskCapture
from pipelines import (
    RunningCount,
    _key,
    check_running_counts,
    committed_output,
    input_records,
    make_pipeline,
    sim_run,
    without_fsync,
)

N, KEYS = 600, 5


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


#: the first run holds at its first record after an epoch committed into GATE_DIR (functions
#: are copied per subtask: module-level events)
REACHED, RELEASE = threading.Event(), threading.Event()
GATE_DIR: list[str] = []


class GatedCount(RunningCount):
    """RunningCount that, once a checkpoint exists, says so and waits until released."""

    def process(self, value, ctx):
        if value[1] % 25 == 0 and not RELEASE.is_set() and open_storage(GATE_DIR[0]).list_checkpoints():
            REACHED.set()
            assert RELEASE.wait(60), "the test never released the first run"
        return super().process(value, ctx)


def gated_job(out, mode: str, gated: bool = False):
    p = make_pipeline("lease-job", mode=mode, parallelism=2)
    p.checkpoint.num_retained = 50
    fn = GatedCount(emit_ids=True) if gated else RunningCount(emit_ids=True)
    p.from_collection(input_records(N, KEYS), uid="src").key_by(_key).process(fn, uid="count") \
        .sink(FileSink(Path(out) / "counts"), uid="counts")
    return p


def snapshot(chk: str, moto_s3=None) -> dict[str, str]:
    """Every object under the checkpoint folder with a hash of its bytes."""
    if chk.startswith("s3://"):
        bucket, _, prefix = chk[5:].partition("/")
        client = moto_s3.client()
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = o["ETag"]
        return out
    return {str(p.relative_to(chk)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(chk).rglob("*") if p.is_file()}


def unchanged(snap: dict[str, str]) -> dict[str, str]:
    """A snapshot without the lease object, which the holder's heartbeats rewrite."""
    return {k: v for k, v in snap.items() if not k.endswith(LEASE)}


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])  # s3: ~20 s each
def test_two_runs_on_one_folder_second_refused_first_exact(tmp_path, mode, where, request):
    chk = request.getfixturevalue("s3_url") if where == "s3" else str(tmp_path / "chk")
    moto = request.getfixturevalue("moto_s3") if where == "s3" else None
    REACHED.clear()
    RELEASE.clear()
    GATE_DIR[:] = [chk]
    reached, release = REACHED, RELEASE
    first = gated_job(tmp_path / "out1", mode, gated=True)
    box: dict = {}

    def run_first():
        try:
            box["result"] = sim_run(first, chk, seed=1)
        except BaseException as exc:  # reported by the main thread
            box["error"] = exc

    t = threading.Thread(target=run_first)
    t.start()
    try:
        assert reached.wait(60), f"the first run never held: {box.get('error')}"
        assert open_storage(chk).list_checkpoints(), "the first run should have committed epochs by now"
        before = unchanged(snapshot(chk, moto))
        for restore in (None, "latest"):
            second = gated_job(tmp_path / "out2", mode)
            with pytest.raises(LeaseHeldError) as exc:
                sim_run(second, chk, seed=2, restore=restore)
            msg = str(exc.value)
            print(msg)
            assert "is in use by job 'lease-job'" in msg and f"pid {os.getpid()}" in msg, msg
            assert socket.gethostname() in msg and "nothing was changed" in msg and "--checkpoint-dir" in msg
            assert unchanged(snapshot(chk, moto)) == before, "the refused run changed the checkpoint folder"
            assert not committed_output(tmp_path / "out2" / "counts")
    finally:
        release.set()
        t.join(120)
    assert "error" not in box, box.get("error")
    records = committed_output(tmp_path / "out1" / "counts")
    assert check_running_counts(records, range(N)) == []
    assert sorted(r[2] for r in records) == list(range(N))  # independent of the oracle: each id once
    assert lease_status(open_storage(chk))[0] == "free", "the lease is released when the run ends"


def test_chaos_on_a_held_folder_is_refused(tmp_path):
    from epochstream.cli import main

    chk = tmp_path / "chk"
    lease = Lease(open_storage(str(chk)), "holder", "f" * 32).acquire()
    try:
        job = tmp_path / "job.py"
        job.write_text("from epochstream import DiscardingSink, Pipeline\ndef build():\n    p = Pipeline('x')\n"
                       "    p.from_collection([1, 2], uid='s').sink(DiscardingSink(), uid='o')\n    return p\n")
        assert main(["chaos", f"{job}:build", "--deployment", "sim", "--checkpoint-dir", str(chk)]) == 2
        assert sorted(p.name for p in chk.iterdir()) == [".lock", LEASE]
    finally:
        lease.release()
    assert not chk.exists(), "releasing the lease removes the folder it created"


HOLDER = """
import sys, time
from epochstream.backends import open_storage
from epochstream.deploy.lease import Lease
Lease(open_storage(sys.argv[1]), "other-job", "a" * 32).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_lease_held_by_another_process_is_refused_and_taken_over_when_it_dies(tmp_path):
    chk = tmp_path / "chk"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(chk)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeldError) as exc:
            sim_run(gated_job(tmp_path / "out", "aligned"), str(chk), seed=1)
        assert f"job 'other-job' (id {'a' * 32}" in str(exc.value) and f"pid {proc.pid}" in str(exc.value)
    finally:
        proc.kill()
        proc.wait()
    # the holder died: the OS dropped its lock and its pid is gone, so the next run takes over
    assert lease_status(open_storage(str(chk)))[0] == "dead"
    sim_run(gated_job(tmp_path / "out", "aligned"), str(chk), seed=1)
    assert check_running_counts(committed_output(tmp_path / "out" / "counts"), range(N)) == []


def _write_lease(storage, heartbeat_at: float, ttl: float = 30.0, host: str = "elsewhere") -> None:
    info = LeaseInfo(host, 1, "old-job", "b" * 32, "r.0", heartbeat_at, heartbeat_at, ttl, "tok")
    storage.store.put(storage.store.root / LEASE, info.to_bytes())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_live_lease_of_another_host_is_refused_an_expired_one_taken_over(tmp_path, where, request):
    chk = request.getfixturevalue("s3_url") if where == "s3" else str(tmp_path / "chk")
    storage = open_storage(chk)
    if where == "local":
        Path(chk).mkdir()
    _write_lease(storage, time.time())
    with pytest.raises(LeaseHeldError) as exc:
        Lease(storage, "new-job", "c" * 32).acquire()
    assert "job 'old-job'" in str(exc.value) and "host elsewhere" in str(exc.value)
    _write_lease(storage, time.time() - 31)  # no heartbeat for longer than its ttl
    lease = Lease(storage, "new-job", "c" * 32).acquire()
    try:
        lease.begin_attempt("new.0")
        with pytest.raises(FencedError, match=r"attempt r\.0 is fenced: .* held by attempt new\.0 of job 'new-job'"):
            check_fence(storage, "r.0")
        check_fence(storage, "new.0")
    finally:
        lease.release()


def test_s3_renewal_after_a_takeover_loses_the_lease(s3_url):
    storage = open_storage(s3_url)
    lease = Lease(storage, "slow-job", "d" * 32, ttl=30).acquire()
    lease.begin_attempt("slow.0")
    # another host found it expired (our heartbeats stalled) and took it over by its ETag
    _write_lease(storage, time.time(), host="fast-host")
    with pytest.raises(FencedError, match="was taken over by job 'old-job'"):
        lease.renew()
    with pytest.raises(FencedError):
        check_fence(storage, "slow.0")
    lease.release()  # does not delete the new holder's lease
    assert lease_status(storage)[1].host == "fast-host"


def test_a_zombie_attempt_writes_no_state_and_stages_no_output(tmp_path):
    """A worker of attempt r.0 woken after the failover to r.1 persists its capture: refused,
    and neither a state file nor staged sink output appears."""
    chk, out = tmp_path / "chk", tmp_path / "out"
    storage = open_storage(str(chk))
    sink = FileSink(out / "counts")
    lease = Lease(storage, "job", "e" * 32).acquire()
    try:
        lease.begin_attempt("run.0")
        capture = TaskCapture(
            task=(0, 0), epoch=3,
            keyed=(KeyedCapture("count", [(1, b"k", "count", b"v")], True, (3,), (0, 63)),),
            sinks=(SinkCapture("counts", 3, [["k", 1, 7]]),),
        )
        info = persist(storage, {"counts": sink}, capture, "run.0")  # the holder's attempt writes
        assert info.files and info.staged["counts"]
        lease.begin_attempt("run.1")  # the failover
        files_before = {p for p in tmp_path.rglob("*") if p.is_file()}
        with pytest.raises(FencedError) as exc:
            persist(storage, {"counts": sink}, capture, "run.0")
        assert "attempt run.0 is fenced" in str(exc.value) and "attempt run.1" in str(exc.value)
        assert {p for p in tmp_path.rglob("*") if p.is_file()} == files_before
    finally:
        lease.release()


JOB = """
import os, sys, time
sys.path.insert(0, {tests!r})
from pipelines import RunningCount, _key, input_records, make_pipeline
from epochstream import FileSink


def gate(record):  # record 300 waits until the test has tried its second runs
    while record[1] == 300 and not os.path.exists({gate!r}):
        time.sleep(0.05)
    return record


def build():
    p = make_pipeline("cli-lease", parallelism=2, interval=0.05)
    p.from_collection(input_records(400, 5), uid="src").map(gate, name="gate").key_by(_key) \\
        .process(RunningCount(emit_ids=True), uid="count").sink(FileSink({out!r}), uid="counts")
    return p
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_two_cli_runs_local_driver_second_refused(tmp_path, mode):
    """Two ``epochstream run --deployment local`` processes on one --checkpoint-dir: the second
    (a fresh run, then ``--restore latest``) exits 2 naming the first; the first's output is exact."""
    job = tmp_path / "job.py"
    gate = tmp_path / "release"
    job.write_text(JOB.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"), gate=str(gate)))
    chk = tmp_path / "chk"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), EPOCHSTREAM_HOME=str(tmp_path / "home"))
    cmd = [sys.executable, "-m", "epochstream.cli", "run", f"{job}:build", "--checkpoint-dir", str(chk),
           "--mode", mode]
    first = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stderr is not None
        line = first.stderr.readline()
        assert "is running as" in line, line
        for extra in ([], ["--restore", "latest"]):
            second = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=120)
            print(second.stderr.strip())
            assert second.returncode == 2, second.stderr
            assert "is in use by job 'cli-lease'" in second.stderr and f"pid {first.pid}" in second.stderr
        gate.touch()
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    records = committed_output(tmp_path / "out")
    assert check_running_counts(records, range(400)) == []


def test_s3_lease_left_by_an_ended_run_of_this_process_is_taken_over_at_once(s3_url, monkeypatch):
    """A run that failed while S3 was down could not delete its lease; the restart in the same
    process takes it over at once (its pid is alive: it is us), a lease this process still holds not."""
    storage = open_storage(s3_url)
    held = Lease(storage, "job", "e" * 32).acquire()
    with pytest.raises(LeaseHeldError):  # held by a live run of this very process
        Lease(open_storage(s3_url), "job", "f" * 32).acquire()

    def down(*_a, **_k):
        raise OSError("S3 is down")

    monkeypatch.setattr(held.store, "delete", down)
    held.release()  # the delete fails: the lease file stays
    assert lease_status(storage)[1].pid == os.getpid()
    again = Lease(open_storage(s3_url), "job", "f" * 32).acquire()
    try:
        assert lease_status(storage)[1].job_id == "f" * 32
    finally:
        again.release()


SPARK_JOB = """
import os, sys, time
sys.path.insert(0, {tests!r})
from pipelines import RunningCount, _key, input_records, make_pipeline
from epochstream import FileSink
from epochstream.backends import open_storage


def gate(record):  # paced; from id 300 on, once an epoch is committed, hold until the test has tried its second runs
    time.sleep(0.02)
    if record[1] >= 300 and not os.path.exists({gate!r}) and open_storage({chk!r}).list_checkpoints():
        open({held!r}, "a").close()  # a held source task takes no more epoch triggers: the folder stays as it is
        while not os.path.exists({gate!r}):
            time.sleep(0.05)
    return record


def build():
    p = make_pipeline("cli-lease", parallelism=2, interval=0.05)
    p.from_collection(input_records(400, 5), uid="src").map(gate, name="gate").key_by(_key) \\
        .process(RunningCount(emit_ids=True), uid="count").sink(FileSink({out!r}), uid="counts")
    return p
"""


@pytest.mark.slow
def test_two_cli_runs_spark_driver_second_refused(tmp_path):
    """The same on the spark driver (``local[2]``): the running driver process holds the lease
    (its pid, this host, its attempt); a second spark-driver run and a ``--restore latest`` are
    refused naming it and change nothing; the first's output is exact. The lease is
    mode-independent (the local-driver test covers both modes)."""
    job = tmp_path / "job.py"
    gate = tmp_path / "release"
    chk = tmp_path / "chk"
    held = tmp_path / "held"
    job.write_text(SPARK_JOB.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"), gate=str(gate),
                                    chk=str(chk), held=str(held)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), EPOCHSTREAM_HOME=str(tmp_path / "home"))
    cmd = [sys.executable, "-m", "epochstream.cli", "run", f"{job}:build", "--checkpoint-dir", str(chk),
           "--deployment", "spark", "--master", "local[2]", "--spark-conf", "spark.ui.enabled=false",
           "--heartbeat-timeout", "600"]  # the held worker is not declared failed (no failover while held)
    first = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stderr is not None
        line = ""
        while "is running as" not in line:  # Spark's own start-up lines come first
            line = first.stderr.readline()
            assert line, "the first run ended before it started"
        err_lines: list[str] = []  # keep reading: Spark's log lines would fill the pipe and block the driver
        drain = threading.Thread(target=lambda: err_lines.extend(first.stderr), daemon=True)  # type: ignore[arg-type]
        drain.start()
        deadline = time.monotonic() + 180
        while not held.exists():  # it holds from record 300 on, after an epoch
            assert time.monotonic() < deadline and first.poll() is None, "".join(err_lines)[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)  # an epoch whose markers passed the held task before it held completes first
        holder = LeaseInfo(**json.loads((chk / LEASE).read_text()))
        assert holder.pid == first.pid and holder.host == socket.gethostname(), holder  # the driver process
        assert holder.job == "cli-lease" and holder.attempt.endswith(".0"), holder
        before = unchanged(snapshot(str(chk)))
        for extra in ([], ["--restore", "latest"]):
            second = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, timeout=300)
            refusal = [ln for ln in second.stderr.splitlines() if ln.startswith("epochstream:")]
            print(refusal)
            assert second.returncode == 2, second.stderr[-2000:]
            assert any("is in use by job 'cli-lease'" in ln and f"pid {first.pid}" in ln and "nothing was changed"
                       in ln for ln in refusal), refusal
            assert unchanged(snapshot(str(chk))) == before, "the refused spark run changed the checkpoint folder"
        gate.touch()
        assert first.wait(timeout=300) == 0, "".join(err_lines)[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    records = committed_output(tmp_path / "out")
    assert check_running_counts(records, range(400)) == []
    assert sorted(r[2] for r in records) == list(range(400))
    assert lease_status(open_storage(str(chk)))[0] == "free"
