"""Exactly-once on cyclic pipelines, in both modes, shown with the oracle and without it.

* property tests (hypothesis) over the simulator: the oracle on every cyclic pipeline of
  ``cycle_pipelines.py`` (a bounded number of rounds per record, reachability over edge
  insertions, nested loops, a cycle wired without ``iterate()``) with kills, job-master
  crashes and failed writes, parallelism 1..3, in ``aligned`` and ``tracker`` mode; no loss
  in at-least-once mode;
* failures placed where loops are delicate (aligned mode): when a marker has gone round the
  loop and is back at its head, and while a head replays its log after a restore;
* final results against a direct computation (a BFS, the iteration itself), without the
  oracle; the final epoch of a bounded job cuts through empty loops;
* oracle self-tests: a head that does not log, or does not replay, must be caught;
* tracker mode's trade-off: a loop that never drains never ends its epoch; the timeout
  aborts it and the failure names the loop;
* the local driver (``slow``): real processes, real SIGKILLs, both modes.
"""

from __future__ import annotations

import collections
import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cycle_pipelines import CYCLE_BUILDERS, Halve, collatz, edge_stream, reachability, rounds
from epochstream import CheckpointConfig, FileSink, Pipeline
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.failures import InjectedFailure, JobFailedError
from epochstream.deploy.sim import FailureSchedule
from epochstream.loops.head import LoopHead
from epochstream.loops.task import LoopHeadTask
from epochstream.oracle import OracleReport, check_exactly_once, loop_logs
from pipelines import committed_output, sim_run, without_fsync

RATE = 20_000.0
POINTS = ("before_manifest", "after_manifest", "mid_commit", "after_commit", "recovery")
MODES = ("aligned", "tracker", "unaligned")
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return lambda label: tmp_path_factory.mktemp(label)


@dataclass(frozen=True)
class Chaos:
    seed: int
    parallelism: int
    batch_size: int
    interval: float
    max_concurrent: int
    kill_fractions: tuple[float, ...]
    fail_points: tuple[tuple[str, tuple[int, ...]], ...]
    write_failures: tuple[int, ...]

    def knobs(self) -> dict:
        return dict(parallelism=self.parallelism, batch_size=self.batch_size, interval=self.interval,
                    max_concurrent=self.max_concurrent)

    def schedule(self) -> FailureSchedule:
        horizon = 0.012  # virtual seconds: about the length of a failure-free run
        return FailureSchedule(kill_times=sorted(f * horizon for f in self.kill_fractions),
                               fail_points={n: set(o) for n, o in self.fail_points},
                               write_failures=set(self.write_failures))


@st.composite
def chaos(draw, kills=st.integers(0, 3)):
    k = draw(kills)
    return Chaos(
        seed=draw(st.integers(0, 2**32 - 1)),
        parallelism=draw(st.integers(1, 3)),
        batch_size=draw(st.sampled_from([1, 4, 16])),
        interval=draw(st.sampled_from([0.0003, 0.0006, 0.0012])),
        max_concurrent=draw(st.integers(1, 2)),
        kill_fractions=tuple(draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k))),
        fail_points=tuple(sorted((n, tuple(sorted(o))) for n, o in draw(st.dictionaries(
            st.sampled_from(POINTS), st.frozensets(st.integers(1, 4), min_size=1, max_size=2), max_size=2)).items())),
        write_failures=tuple(sorted(draw(st.frozensets(st.integers(1, 30), max_size=2)))),
    )


def oracle(builder, c: Chaos, work: Path, mode: str, inject=None) -> OracleReport:
    """The oracle over ``builder``: a failure-free run, then the chaos run (``inject(mp)``
    patches the code for the chaos run only)."""

    def run(p, chk, failing):
        with pytest.MonkeyPatch.context() as mp:
            if failing and inject is not None:
                inject(mp)
            return sim_run(p, chk, seed=c.seed, failures=c.schedule() if failing else None, source_rate=RATE)

    return check_exactly_once(partial(builder, mode=mode, **c.knobs()), run, work)


def assert_exactly_once(report: OracleReport) -> None:
    assert report.ok, report.to_json()
    assert report.epochs_checked >= 1
    assert report.records_committed == report.records_expected > 0


# ---------------------------------------------------------------- the oracle, both modes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("builder_name", sorted(CYCLE_BUILDERS))
@settings(max_examples=8, **COMMON)
@given(c=chaos())
def test_cycles_exactly_once_under_failures(builder_name, mode, c, workdirs):
    """Kills, job-master crashes, failed writes: committed output equals the failure-free
    run, and every epoch (completed through its logged in-transit records in aligned mode)
    equals the sequential reference run to its fixpoint."""
    work = workdirs(f"cyc-{mode}-{builder_name}")
    report = oracle(CYCLE_BUILDERS[builder_name], c, work, mode)
    assert_exactly_once(report)
    if mode == "tracker":
        assert report.loop_records_logged == 0  # epochs end when the loop has drained them
    shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=12, **COMMON)
@given(builder_name=st.sampled_from(sorted(CYCLE_BUILDERS)), c=chaos())
def test_cycles_at_least_once_loses_nothing(builder_name, c, workdirs):
    work = workdirs(f"cyc-alo-{builder_name}")
    report = oracle(CYCLE_BUILDERS[builder_name], c, work, "at-least-once")
    assert report.at_least_once and report.ok and report.lost == 0, report.to_json()
    assert report.records_committed >= report.records_expected > 0
    shutil.rmtree(work, ignore_errors=True)


def test_aligned_epochs_really_cut_through_loops(workdirs):
    """The aligned runs above are not trivially drained: their checkpoints hold logs."""
    logged = 0
    for seed in range(3):
        c = Chaos(seed, 2, 4, 0.0003, 1, (0.5,), (), ())
        report = oracle(rounds, c, workdirs("cut"), "aligned")
        assert_exactly_once(report)
        logged += report.loop_records_logged
    assert logged > 0


# ---------------------------------------------------------------- failures at the loop's delicate moments


def _fail_nth(mp, cls, name, n, when=lambda *a: True):
    """Patch ``cls.name`` to raise an injected failure on its n-th qualifying call."""
    original = getattr(cls, name)
    calls = {"n": 0}

    def patched(self, *args, **kwargs):
        if when(self, *args):
            calls["n"] += 1
            if calls["n"] == n:
                raise InjectedFailure(f"injected in {cls.__name__}.{name} (call {n})")
        return original(self, *args, **kwargs)

    mp.setattr(cls, name, patched)
    return calls


@pytest.mark.parametrize("builder_name", sorted(CYCLE_BUILDERS))
@pytest.mark.parametrize("nth", [1, 3, 6])
def test_failure_when_a_marker_is_back_at_the_loop_head(builder_name, nth, workdirs):
    """The n-th marker to come back round a loop crashes the job before the head snapshots:
    the epoch's other tasks have acked, the head has not, and its log dies with it."""
    c = Chaos(seed=nth, parallelism=2, batch_size=4, interval=0.0003, max_concurrent=2, kill_fractions=(),
              fail_points=(), write_failures=())
    seen = {}
    report = oracle(CYCLE_BUILDERS[builder_name], c, workdirs("marker-back"), "aligned",
                    inject=lambda mp: seen.setdefault("calls", _fail_nth(mp, LoopHead, "on_marker", nth)))
    assert_exactly_once(report)
    assert report.restarts >= 1 and seen["calls"]["n"] >= nth


@pytest.mark.parametrize("builder_name", sorted(CYCLE_BUILDERS))
@pytest.mark.parametrize("nth", [1, 2])
def test_failure_while_a_head_replays_its_log(builder_name, nth, workdirs):
    """A kill early in the run, then a crash the n-th time a head replays a restored,
    non-empty log (mid-replay: its records partly pushed into the loop)."""
    c = Chaos(seed=11 * nth, parallelism=2, batch_size=4, interval=0.0003, max_concurrent=1,
              kill_fractions=(0.35, 0.6), fail_points=(), write_failures=())
    original_push = {}

    def inject(mp):
        calls = {"n": 0}
        real_step = LoopHeadTask.step

        def step(self, now, budget=1024, read_source=True):
            if self.replay:
                calls["n"] += 1
                if calls["n"] == nth:
                    self._push(self.replay[: len(self.replay) // 2], None)  # half of it goes in, then the crash
                    raise InjectedFailure(f"injected while replaying {len(self.replay)} logged records")
            return real_step(self, now, budget, read_source)

        mp.setattr(LoopHeadTask, "step", step)
        original_push["calls"] = calls

    report = oracle(CYCLE_BUILDERS[builder_name], c, workdirs("replay"), "aligned", inject=inject)
    assert_exactly_once(report)


# ---------------------------------------------------------------- results without the oracle


def _reachable(edges, root=0) -> set[int]:
    adj = collections.defaultdict(set)
    for _k, u, v in edges:
        adj[u].add(v)
    seen, todo = {root}, [root]
    while todo:
        for w in adj[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("mode", ("aligned", "tracker", "at-least-once"))
def test_reachability_equals_a_bfs(mode, tmp_path):
    n, nodes = 300, 80
    p = reachability(n=n, nodes=nodes, mode=mode, parallelism=3, out=tmp_path / "out")
    result = sim_run(p, tmp_path / "chk", seed=5, failures=FailureSchedule(kill_times=[0.004, 0.009]))
    assert result.restarts == 2
    got = [tuple(r) for r in committed_output(tmp_path / "out" / "reached")]
    want = _reachable(edge_stream(n, nodes))
    want.discard(0)  # the root is reached from the start, never emitted
    if mode == "at-least-once":
        assert {x for _o, x in got} == want
    else:
        assert sorted(x for _o, x in got) == sorted(want)  # each node once


@pytest.mark.parametrize("mode", MODES)
def test_rounds_equal_the_iteration_itself(mode, tmp_path):
    n, max_rounds = 250, 9
    p = rounds(n=n, max_rounds=max_rounds, mode=mode, parallelism=2, out=tmp_path / "out")
    sim_run(p, tmp_path / "chk", seed=3, failures=FailureSchedule(kill_times=[0.003, 0.007]))
    want = []
    for i in range(n):
        x, r = 7 + i % 23, 0
        while True:
            x, r = collatz(x), r + 1
            if x == 1 or r >= max_rounds:
                break
        want.append((i, x, r))
    assert sorted(tuple(rec) for rec in committed_output(tmp_path / "out" / "done")) == want


@pytest.mark.parametrize("mode", MODES)
def test_the_final_epoch_of_a_bounded_job_cuts_through_empty_loops(mode, tmp_path):
    p = rounds(n=300, mode=mode, parallelism=2, interval=0.0003, out=tmp_path / "out")
    p.checkpoint.num_retained = 1000
    result = sim_run(p, tmp_path / "chk", seed=2)
    final = [e for e in result.metrics["epochs"] if e.get("kind") == "final"]
    assert final and final[-1]["loop_log_records"] == 0
    storage = LocalCheckpointStorage(tmp_path / "chk")
    manifest, root = storage.load_manifest(result.completed_epochs[-1])
    assert not any(loop_logs(storage, manifest, root, p.plan().loops).values())
    if mode == "aligned":  # earlier epochs did cut through records in flight
        assert any(e["loop_log_records"] for e in result.metrics["epochs"] if e.get("state") == "completed")


@pytest.mark.parametrize("resume_parallelism", [2, 3, 1])
def test_a_job_stopped_by_duration_resumes_with_its_loops_in_flight(tmp_path, resume_parallelism):
    """An aligned job stopped early stops with records going round; the resumed run (also
    rescaled: the logs move by key group) replays the logs, and across both runs every
    record leaves the loop exactly once."""
    def build(count, parallelism=2):
        p = Pipeline("resume-loop", parallelism=parallelism, checkpoint=CheckpointConfig(interval=0.0005),
                     restart_attempts=5, restart_delay=0.0)
        src = p.generate(lambda i: (i, 1 + i % 50), count=count, uid="gen")
        loop = src.iterate(uid="loop")
        body = loop.key_by(lambda r: r[0] % 5).process(Halve(), uid="halve")
        loop.close_with(body.filter(lambda r: r[1] > 0))
        body.filter(lambda r: r[1] == 0).sink(FileSink(tmp_path / "out"), uid="zeros")
        return p

    n = 2000
    first = sim_run(build(n), tmp_path / "chk", seed=1, duration=0.004)
    assert first.completed_epochs
    storage = LocalCheckpointStorage(tmp_path / "chk")
    manifest = storage.load_manifest(first.completed_epochs[-1])[0]
    assert sum(int(v) for v in manifest["sources"]["gen"]["offsets"].values()) < n  # stopped early
    assert manifest["metrics"]["loop_log_records"] > 0  # ... with records going round
    second = sim_run(build(n, resume_parallelism), tmp_path / "chk", seed=2, restore="latest",
                     failures=FailureSchedule(kill_times=[0.001]))
    ids = sorted(r[0] for r in committed_output(tmp_path / "out"))
    assert ids == list(range(n)), (len(ids), n, second.restarts)


# ---------------------------------------------------------------- the oracle catches broken loops


def _sabotaged(builder_name, inject, workdirs) -> list[OracleReport]:
    reports = []
    for seed in range(3):
        c = Chaos(seed, 2, 4, 0.0003, 1, (0.4, 0.7), (), ())
        reports.append(oracle(CYCLE_BUILDERS[builder_name], c, workdirs("sabotage"), "aligned", inject=inject))
    return reports


@pytest.mark.parametrize("builder_name", ["rounds", "reachability"])
def test_oracle_catches_a_head_that_does_not_log(builder_name, workdirs):
    reports = _sabotaged(builder_name, lambda mp: mp.setattr(LoopHead, "on_records", lambda self, rs: None), workdirs)
    assert any(not r.ok for r in reports), [r.to_json() for r in reports]


@pytest.mark.parametrize("builder_name", ["rounds", "reachability"])
def test_oracle_catches_a_head_that_does_not_replay(builder_name, workdirs):
    def inject(mp):
        real = LoopHeadTask.__init__

        def init(self, *a, **k):
            real(self, *a, **k)
            self.replay = []

        mp.setattr(LoopHeadTask, "__init__", init)

    reports = _sabotaged(builder_name, inject, workdirs)
    assert any(not r.ok for r in reports), [r.to_json() for r in reports]
    if builder_name == "rounds":  # a record that is not replayed never leaves its loop
        assert any(r.lost for r in reports), [r.to_json() for r in reports]


# ---------------------------------------------------------------- tracker mode: a loop that never drains


def _endless(mode: str, out: Path, timeout: float) -> Pipeline:
    p = Pipeline("endless", parallelism=2, mode=mode, restart_attempts=1, restart_delay=0.0,
                 checkpoint=CheckpointConfig(interval=0.0005, timeout=timeout))
    loop = p.from_collection(list(range(20)), uid="nums").iterate(uid="spin")
    body = loop.map(lambda x: x + 1)
    loop.close_with(body)  # every record goes round forever
    body.filter(lambda x: x < 5).sink(FileSink(out), uid="out")
    return p


def test_tracker_mode_times_out_an_epoch_whose_loop_never_drains(tmp_path, caplog):
    p = _endless("tracker", tmp_path / "out", timeout=0.01)
    with pytest.raises(JobFailedError) as info:
        sim_run(p, tmp_path / "chk", seed=1)
    msg = str(info.value)
    assert "timed out" in msg and "loop never drained" in msg and "'segment'" in msg, msg
    assert "loop never drained in tracker mode" in caplog.text


def test_aligned_mode_keeps_completing_epochs_around_an_endless_loop(tmp_path):
    """The other side of the trade-off: aligned epochs end whatever the loop does (the head
    logs what is in flight), so a job stopped by duration has checkpoints to resume from."""
    p = _endless("aligned", tmp_path / "out", timeout=0.01)
    result = sim_run(p, tmp_path / "chk", seed=1, duration=0.01)
    assert len(result.completed_epochs) >= 3 and result.restarts == 0
    assert all(e["loop_log_records"] > 0 for e in result.metrics["epochs"] if e.get("state") == "completed")


def test_event_time_with_loops_is_refused_clearly(tmp_path):
    from epochstream.runtime.errors import ConfigurationError

    p = Pipeline("timed-loop", parallelism=2)
    loop = p.from_collection([(i, 3) for i in range(10)], uid="nums", timestamps=lambda r: r[0]).iterate(uid="l")
    body = loop.map(lambda r: (r[0], r[1] - 1))
    loop.close_with(body.filter(lambda r: r[1] > 0))
    body.filter(lambda r: r[1] == 0).sink(FileSink(tmp_path / "out"), uid="out")
    with pytest.raises(ConfigurationError, match=r"event time .* loops \['l/loop-head'\]"):
        sim_run(p, tmp_path / "chk")


# ---------------------------------------------------------------- CLI


def test_chaos_cli_on_the_reachability_example(tmp_path):
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "reachability.py"
    for mode in MODES:
        proc = subprocess.run(
            [sys.executable, "-m", "epochstream.cli", "chaos", f"{example}:build", "--json", "--deployment", "sim",
             "--kills", "3", "--seed", "4", "--mode", mode, "--workdir", str(tmp_path / mode)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        doc = json.loads(proc.stdout)
        assert doc["ok"] and doc["mode"] == "exactly-once" and doc["restarts"] >= 1, doc


# ---------------------------------------------------------------- local driver: real processes, real kills


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("builder_name", ["rounds", "reachability"])
def test_cycles_local_driver_with_real_kills(builder_name, mode, tmp_path):
    import time

    knobs = dict(n=20000, nodes=3000) if builder_name == "reachability" else dict(n=6000)
    build = partial(CYCLE_BUILDERS[builder_name], mode=mode, parallelism=2, interval=0.05, batch_size=64, **knobs)
    t0 = time.monotonic()
    state = {}

    def run(p, chk, failing):
        if not failing:
            r = p.run(deployment="local", checkpoint_dir=chk)
            state["seconds"] = time.monotonic() - t0
            return r
        span = state["seconds"]  # kills inside the failure-free run's length, so the first always lands
        kills = FailureSchedule(kill_times=[0.2 * span, 0.45 * span, 0.7 * span])
        return p.run(deployment="local", checkpoint_dir=chk, failures=kills)

    report = check_exactly_once(build, run, tmp_path)
    assert_exactly_once(report)
    assert report.restarts >= 1, report.to_json()
