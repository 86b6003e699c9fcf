"""Exactly-once under injected failures, shown with the oracle and with checks that do not use it.

DESIGN.md, "How correctness is shown": run a pipeline with failures injected; the committed
output must equal that of a failure-free run, and every epoch's committed state must equal a
sequential reference over the input prefix its source offsets name. Here:

* property tests (hypothesis) over the simulator: seeds, worker kills, job-master crashes
  at the fail points, failed state writes, parallelism 1..4, batch sizes and lingers (the
  batching policy: output waits for a full batch, cut by every epoch bound), checkpoint
  intervals, for every pipeline of ``pipelines.py`` in both exactly-once modes, and no loss
  in at-least-once mode; each pipeline in both layouts (``pipelines.LAYOUTS``: records as
  Python rows, or as Arrow batches from columnar sources keyed by column): the main suite
  runs both, the other properties draw one;
* the running-count invariant read directly off committed output (every id once, each
  key's counts exactly 1..n) and the final committed state, without the oracle;
* determinism: a seed and a schedule replay the same run;
* oracle self-tests: sabotaged runs the oracle must catch, or a green oracle proves nothing;
* regressions: the bugs these suites found were strict xfails until fixed; they stay as plain tests.

Sizes: the default run does a few hundred seeded runs in about two minutes on two cores.
``pytest -m long tests/test_exactly_once.py`` runs the same properties with
``EPOCHSTREAM_LONG_EXAMPLES`` (default 2000) examples each.

Runs skip fsync (``pipelines.without_fsync``): it dominates the runtime and a simulated
crash cannot observe it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import event as _event
from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import epochstream.deploy.driver as driver_module
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.backends.sinks import FileSink
from epochstream.deploy.restore import Restored
from epochstream.deploy.sim import FailureSchedule, SimConfig
from epochstream.oracle import OracleReport, check_exactly_once, committed_state
from pipelines import (
    BUILDERS,
    LAYOUTS,
    SINK_FORMATS,
    SOURCE_RATE,
    check_running_counts,
    committed_counts,
    committed_output,
    running_count,
    sim_run,
    union_chain,
    union_chain_ids,
    without_fsync,
)

#: records/s per source subtask: 200 records take ~2.5-10 virtual ms, i.e. several epochs
RATE = SOURCE_RATE
#: input size of every property run
N = 200
POINTS = ("before_manifest", "after_manifest", "mid_commit", "after_commit", "recovery")
LONG_EXAMPLES = int(os.environ.get("EPOCHSTREAM_LONG_EXAMPLES", "2000"))

#: hypothesis settings shared by the property tests (examples are slow: no deadline)
COMMON = dict(deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow])
#: for strict xfails of known bugs: stop at the first counterexample, do not spend minutes shrinking it
FIND_ONLY = dict(COMMON, phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False)


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """A fresh directory per hypothesis example (tmp_path is per test, not per example).
    Directories of passing examples are removed; failing ones stay for inspection."""

    def make(label: str) -> Path:
        return tmp_path_factory.mktemp(label)

    return make


# ---------------------------------------------------------------- schedules


@dataclass(frozen=True)
class Chaos:
    """One drawn scenario: pipeline knobs, the simulator seed and what goes wrong when."""

    seed: int
    parallelism: int
    batch_size: int
    interval: float
    max_concurrent: int
    tolerable_failed: int
    incremental: bool
    kill_fractions: tuple[float, ...]
    fail_points: tuple[tuple[str, tuple[int, ...]], ...]
    write_failures: tuple[int, ...]
    #: how records travel (``pipelines.LAYOUTS``)
    layout: str = "rows"
    #: the batching policy's linger, virtual seconds (0: output leaves at the end of every step)
    batch_linger: float = 0.0
    #: what the FileSinks write (``pipelines.SINK_FORMATS``: JSON lines or Parquet)
    sink_format: str = "jsonl"
    #: where keyed state lives while the job runs (``CheckpointConfig.state_backend_type``)
    state_backend_type: str = "hashmap"
    #: tracker mode: promises ride the local trackers' timed flush (0.3 ms), stateless chains pass
    #: later epochs through and NEOSS to a worker coalesce on the wire (``TrackerConfig.flush_on_promise``,
    #: ``TrackerConfig.pass_through``, ``SimConfig.coalesce_neoss``)
    tracker_batching: bool = False
    #: ``CheckpointConfig.full_every``: short chains make the heap's materialisation rounds (a
    #: share of the keys per capture, older links dropped) happen within a run, under its kills
    full_every: int = 10

    def knobs(self) -> dict:
        return dict(
            **LAYOUTS[self.layout],
            **SINK_FORMATS[self.sink_format],
            n=N,
            parallelism=self.parallelism,
            batch_size=self.batch_size,
            batch_linger=self.batch_linger,
            interval=self.interval,
            max_concurrent=self.max_concurrent,
            tolerable_failed=self.tolerable_failed,
            incremental=self.incremental,
            state_backend_type=self.state_backend_type,
            full_every=self.full_every,
        )

    def horizon(self) -> float:
        """Roughly how long (virtual seconds) the failure-free run takes."""
        return 1.2 * N / (self.parallelism * RATE) + 0.002

    def schedule(self) -> FailureSchedule:
        h = self.horizon()
        return FailureSchedule(
            kill_times=sorted(f * h for f in self.kill_fractions),
            fail_points={name: set(occ) for name, occ in self.fail_points},
            write_failures=set(self.write_failures),
        )

    @property
    def failures(self) -> int:
        return len(self.kill_fractions) + sum(len(o) for _, o in self.fail_points) + len(self.write_failures)


_ANY_LAYOUT = st.sampled_from(sorted(LAYOUTS))
#: the batching policy's linger (virtual seconds): none, shorter than an epoch, longer than one
LINGERS = st.sampled_from([0.0, 0.0001, 0.002])
_ANY_SINK_FORMAT = st.sampled_from(sorted(SINK_FORMATS))
#: keyed-state backends: drawn per example, so every suite runs on both without running twice
_ANY_STATE_BACKEND = st.sampled_from(["hashmap", "rocksdb"])


@st.composite
def chaos(
    draw,
    parallelism=st.integers(1, 4),
    max_concurrent=st.just(1),
    tolerable_failed=st.just(0),
    kills=st.integers(0, 3),
    write_failures=st.frozensets(st.integers(1, 30), max_size=3),
    layout=_ANY_LAYOUT,
    batch_linger=LINGERS,
    sink_format=_ANY_SINK_FORMAT,
    state_backend_type=_ANY_STATE_BACKEND,
):
    n_kills = draw(kills)
    return Chaos(
        seed=draw(st.integers(0, 2**32 - 1)),
        parallelism=draw(parallelism),
        batch_size=draw(st.sampled_from([1, 3, 8, 32])),
        interval=draw(st.sampled_from([0.0003, 0.0005, 0.001])),
        max_concurrent=draw(max_concurrent),
        tolerable_failed=draw(tolerable_failed),
        incremental=draw(st.booleans()),
        kill_fractions=tuple(draw(st.lists(st.floats(0.0, 1.0), min_size=n_kills, max_size=n_kills))),
        fail_points=tuple(
            sorted(
                (name, tuple(sorted(occ)))
                for name, occ in draw(
                    st.dictionaries(st.sampled_from(POINTS), st.frozensets(st.integers(1, 4), min_size=1, max_size=2),
                                    max_size=2)
                ).items()
            )
        ),
        write_failures=tuple(sorted(draw(write_failures))),
        layout=draw(layout),
        batch_linger=draw(batch_linger),
        sink_format=draw(sink_format),
        state_backend_type=draw(state_backend_type),
        tracker_batching=draw(st.booleans()),
        full_every=draw(st.sampled_from([2, 3, 10])),
    )


def note(text: str) -> None:
    """hypothesis.note inside a property test; nothing in a plain test."""
    if currently_in_test_context():
        _note(text)


def event(text: str) -> None:
    if currently_in_test_context():
        _event(text)


def oracle(builder, c: Chaos, workdir: Path, mode: str = "aligned", sabotage=None,
           compare: str = "recorded") -> OracleReport:
    """The oracle over ``builder`` with scenario ``c``: a failure-free run, then the chaos run.

    ``sabotage(monkeypatch)``, if given, patches the code under test for the chaos run only.
    """

    def run(p, chk, failing):
        with pytest.MonkeyPatch.context() as mp:
            if failing and sabotage is not None:
                sabotage(mp)
            sim = None
            if c.tracker_batching and mode == "tracker":
                p.tracker = replace(p.tracker, flush_interval=0.0003, flush_on_promise=False, pass_through=True)
                sim = SimConfig(source_rate=RATE, coalesce_neoss=True)
            return sim_run(p, chk, seed=c.seed, failures=c.schedule() if failing else None, source_rate=RATE,
                           sim=sim)

    report = check_exactly_once(partial(builder, mode=mode, **c.knobs()), run, workdir, compare=compare)
    note(f"scenario: {c}")
    note(f"report: {report.to_json()}")
    if mode == "tracker":
        event(f"tracker batching: {c.tracker_batching}")
    event(f"failures scheduled: {min(c.failures, 4)}{'+' if c.failures >= 4 else ''}")
    event(f"restarts: {min(report.restarts, 4)}{'+' if report.restarts >= 4 else ''}")
    event(f"epochs checked: {'1' if report.epochs_checked <= 1 else '2-4' if report.epochs_checked <= 4 else '5+'}")
    if mode == "unaligned":
        held = report.channel_state_records
        event(f"records in channel state: {'0' if not held else '1-9' if held < 10 else '10+'}")
    return report


def assert_exactly_once(report: OracleReport) -> None:
    assert report.ok, report.to_json()
    assert report.lost == 0, report.examples
    assert report.duplicated == 0, report.examples
    assert report.mismatched_state == 0, report.examples
    assert report.mismatched_epoch_output == 0, report.examples
    assert report.epochs_checked >= 1
    assert report.records_committed == report.records_expected > 0


# ---------------------------------------------------------------- exactly-once (aligned), the oracle


#: modes that promise exactly-once: one suite runs both (barrier alignment and trAcker firm bounds)
EXACTLY_ONCE_MODES = ("aligned", "tracker", "unaligned")


def _exactly_once_property(builder_name: str, c: Chaos, workdirs, mode: str = "aligned") -> None:
    work = workdirs(f"eo-{mode}-{builder_name}")
    assert_exactly_once(oracle(BUILDERS[builder_name], c, work, mode=mode))
    shutil.rmtree(work, ignore_errors=True)


#: (mode, layout) of the parametrised suite: unaligned mode runs with row records only (CI time);
#: its columnar runs come from the suites that draw the mode and the layout (``chaos()``)
MODE_LAYOUTS = [(m, layout) for m in EXACTLY_ONCE_MODES for layout in sorted(LAYOUTS)
                if m != "unaligned" or layout == "rows"]


@pytest.mark.parametrize("mode, layout", MODE_LAYOUTS)
@pytest.mark.parametrize("builder_name", sorted(BUILDERS))
@settings(max_examples=25, **COMMON)
@given(c=chaos(layout=st.just("rows")))
def test_exactly_once_under_failures(builder_name, mode, layout, c, workdirs):
    """Kills, job-master crashes at every fail point, failed state writes (tolerable_failed=0:
    each one fails the job over), parallelism 1..4: the committed output and every epoch's
    state match the failure-free run and the sequential reference, for row and columnar records."""
    _exactly_once_property(builder_name, replace(c, layout=layout), workdirs, mode)


@settings(max_examples=12, **COMMON)
@given(c=chaos())
def test_exactly_once_with_merged_pass_through_segments(c, workdirs):
    """The trAcker with its batching on a path of two stateless chains (``union_chain(split=True)``),
    which pass-through merges into one tracking segment: a record in flight inside it must keep
    the segment and the keyed count after it from closing its epoch, under the same failures."""
    from epochstream.deploy.tracking import tracking_segments

    p = union_chain(split=True, mode="tracker")
    p.tracker = replace(p.tracker, pass_through=True)
    assert any(len(s) > 1 for s in tracking_segments(p.plan(), p).segments)
    work = workdirs("eo-tracker-merged")
    assert_exactly_once(oracle(partial(union_chain, split=True), replace(c, tracker_batching=True), work,
                               mode="tracker"))
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.long
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", EXACTLY_ONCE_MODES)
@pytest.mark.parametrize("builder_name", sorted(BUILDERS))
@settings(max_examples=LONG_EXAMPLES, **COMMON)
@given(c=chaos(layout=st.just("rows")))
def test_exactly_once_under_failures_long(builder_name, mode, layout, c, workdirs):
    _exactly_once_property(builder_name, replace(c, layout=layout), workdirs, mode)


@settings(max_examples=30, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), mode=st.sampled_from(EXACTLY_ONCE_MODES),
       c=chaos(tolerable_failed=st.integers(1, 3), write_failures=st.just(frozenset())))
def test_exactly_once_tolerable_failed_without_write_failures(builder_name, mode, c, workdirs):
    """tolerable_failed > 0 changes nothing when no epoch fails: kills and fail points still
    recover exactly once (fail points crash the job master, they are not tolerated)."""
    _exactly_once_property(builder_name, c, workdirs, mode)


@settings(max_examples=20, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), timeout=st.sampled_from([0.0, 0.00005, 0.0002]),
       c=chaos())
def test_exactly_once_aligned_with_timeout(builder_name, timeout, c, workdirs):
    """Aligned with a timeout (virtual seconds; 0: every alignment switches at once): epochs
    start aligned and the tasks whose alignment times out go unaligned, under the same failures."""
    work = workdirs(f"eo-timeout-{builder_name}")
    report = oracle(partial(BUILDERS[builder_name], aligned_timeout=timeout), c, work, mode="aligned")
    event(f"records in channel state: {'0' if not report.channel_state_records else '1+'}")
    assert_exactly_once(report)
    shutil.rmtree(work, ignore_errors=True)


# -- properties that once found bugs (declined writes lost output; GC removed files of concurrent epochs)


@settings(max_examples=40, **FIND_ONLY)
# pipelines whose stateful task also holds the sink (the bug needs a declined write on such a task)
@given(builder_name=st.sampled_from(["running_count", "list_state", "histogram", "two_sinks"]),
       mode=st.sampled_from(EXACTLY_ONCE_MODES),
       c=chaos(tolerable_failed=st.integers(1, 3), kills=st.just(0),
               write_failures=st.frozensets(st.integers(1, 24), min_size=1, max_size=3)))
def test_exactly_once_tolerated_write_failures(builder_name, mode, c, workdirs):
    _exactly_once_property(builder_name, c, workdirs, mode)


@settings(max_examples=40, **FIND_ONLY)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), mode=st.sampled_from(EXACTLY_ONCE_MODES),
       c=chaos(parallelism=st.integers(2, 4), max_concurrent=st.integers(2, 3)))
def test_exactly_once_concurrent_epochs(builder_name, mode, c, workdirs):
    _exactly_once_property(builder_name, c, workdirs, mode)


# ---------------------------------------------------------------- restore with rescale, under failures

#: Flink's RescalingITCase pairs
RESCALES = [(1, 3), (4, 2), (3, 7), (7, 3)]


def _rescale_property(builder_name: str, p1: int, p2: int, mode: str, c: Chaos, workdirs,
                      sabotage=None) -> OracleReport:
    """The chaos run is two jobs: at p1 until a stop-with-savepoint (failures injected), then the
    savepoint restored at p2 into the same checkpoint dir and sinks (failures injected again). The
    oracle checks the committed output against a failure-free run without rescaling, and every
    epoch of both phases against the sequential reference."""
    work = workdirs(f"rescale-{mode}-{builder_name}")
    knobs = dict(c.knobs(), parallelism=p1, max_parallelism=13)

    def run(p, chk, failing):
        if not failing:
            return sim_run(p, chk, seed=c.seed, source_rate=RATE)
        with pytest.MonkeyPatch.context() as mp:
            if sabotage is not None:
                sabotage(mp)
            return _two_phases(p, chk)

    def _two_phases(p, chk):
        # phase 1 stops half-way through its input, read slowly enough that epochs complete before
        # the stop (tracker epochs wait for local-tracker flushes every 5 ms: read for 40 ms there),
        # so that the savepoint cuts the input and phase 2 has work left
        rate = N / (p1 * 0.04) if mode == "tracker" else RATE / 2
        first = sim_run(p, chk, seed=c.seed, failures=c.schedule(), source_rate=rate,
                        duration=0.5 * N / (p1 * rate), savepoint_dir=str(work / "savepoints"),
                        stop_with_savepoint=True)
        assert first.savepoints, "phase 1 ended without a savepoint"
        second = sim_run(p, chk, seed=c.seed + 1, failures=c.schedule(), source_rate=RATE,
                         restore=first.savepoints[-1], parallelism=p2)
        second.restarts += first.restarts
        return second

    report = check_exactly_once(partial(BUILDERS[builder_name], mode=mode, **knobs), run, work)
    note(f"scenario: {c}, {p1} -> {p2}")
    note(f"report: {report.to_json()}")
    event(f"restarts: {min(report.restarts, 4)}{'+' if report.restarts >= 4 else ''}")
    if sabotage is None:
        assert_exactly_once(report)
        shutil.rmtree(work, ignore_errors=True)
    return report


@pytest.mark.parametrize("mode", EXACTLY_ONCE_MODES)
@pytest.mark.parametrize("p1, p2", RESCALES)
@settings(max_examples=5, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), c=chaos())
def test_exactly_once_with_rescale_under_failures(p1, p2, mode, builder_name, c, workdirs):
    _rescale_property(builder_name, p1, p2, mode, c, workdirs)


@pytest.mark.parametrize("mode", EXACTLY_ONCE_MODES)
def test_rescale_oracle_catches_state_restored_outside_its_key_groups(mode, workdirs):
    """Sabotage: every subtask restores every key (the key-group filter ignored). Subtasks then
    checkpoint stale copies of keys they do not own; the oracle must see the wrong state."""
    real = LocalCheckpointStorage.read_operator_rows

    def sabotage(mp):
        mp.setattr(LocalCheckpointStorage, "read_operator_rows",
                   lambda self, manifest, root, operator, key_groups=None: real(self, manifest, root, operator))

    c = Chaos(seed=7, parallelism=3, batch_size=3, interval=0.0003, max_concurrent=1, tolerable_failed=0,
              incremental=False, kill_fractions=(), fail_points=(), write_failures=())
    report = _rescale_property("running_count", 3, 2, mode, c, workdirs, sabotage=sabotage)
    assert not report.ok and report.mismatched_state > 0, report.to_json()


# ---------------------------------------------------------------- at-least-once: no loss


def _at_least_once_property(builder_name: str, c: Chaos, workdirs) -> None:
    work = workdirs(f"alo-{builder_name}")
    report = oracle(BUILDERS[builder_name], c, work, mode="at-least-once")
    assert report.at_least_once
    assert report.ok, report.to_json()
    assert report.lost == 0, report.examples
    assert report.records_committed >= report.records_expected > 0
    if report.duplicated:
        event("at-least-once: duplicates")
    shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=50, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), c=chaos())
def test_at_least_once_loses_nothing(builder_name, c, workdirs):
    _at_least_once_property(builder_name, c, workdirs)


@pytest.mark.long
@settings(max_examples=LONG_EXAMPLES, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), c=chaos())
def test_at_least_once_loses_nothing_long(builder_name, c, workdirs):
    _at_least_once_property(builder_name, c, workdirs)


# ---------------------------------------------------------------- the running-count invariant, without the oracle


def _running_count_invariant(which: str, c: Chaos, workdirs, mode: str = "aligned") -> None:
    work = workdirs(f"inv-{mode}-{which}")
    if which == "running_count":
        p = running_count(emit_ids=True, out=work / "out", mode=mode, **c.knobs())
        want_ids = set(range(N))
    else:
        p = union_chain(emit_ids=True, out=work / "out", mode=mode, **c.knobs())
        want_ids = union_chain_ids(N)
    result = sim_run(p, work / "chk", seed=c.seed, failures=c.schedule(), source_rate=RATE)
    note(f"scenario: {c}; restarts {result.restarts}, epochs {result.completed_epochs}")
    event(f"restarts: {min(result.restarts, 4)}")
    if "failures_injected" in result.metrics:
        event(f"failures injected: {min(result.metrics['failures_injected'], 4)}")
    # the columnar running count (a batch function) commits {"key", "n", "id"} rows
    records = [(r["key"], r["n"], r["id"]) if isinstance(r, dict) else r
               for r in committed_output(work / "out" / "counts")]
    assert check_running_counts(records, want_ids) == []
    # the final committed state agrees: count[key] == ids of that key
    per_key = collections.Counter(key for key, _n, _id in records)
    assert committed_counts(work / "chk") == dict(per_key)
    shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=80, **COMMON)
@given(which=st.sampled_from(["running_count", "union_chain"]), mode=st.sampled_from(EXACTLY_ONCE_MODES),
       c=chaos())
def test_running_counts_are_exactly_1_to_n(which, mode, c, workdirs):
    """Every input id is committed once and each key's committed counts run exactly 1..n."""
    _running_count_invariant(which, c, workdirs, mode)


@pytest.mark.long
@settings(max_examples=LONG_EXAMPLES, **COMMON)
@given(which=st.sampled_from(["running_count", "union_chain"]), mode=st.sampled_from(EXACTLY_ONCE_MODES),
       c=chaos())
def test_running_counts_are_exactly_1_to_n_long(which, mode, c, workdirs):
    _running_count_invariant(which, c, workdirs, mode)


def test_check_running_counts_finds_violations():
    """The invariant checker itself can fail."""
    good = [("a", 1, 10), ("a", 2, 11), ("b", 1, 12)]
    assert check_running_counts(good, {10, 11, 12}) == []
    assert check_running_counts(good + [("a", 2, 13)], None)  # repeated count
    assert check_running_counts([("a", 1, 10), ("a", 3, 11)], None)  # gap
    assert check_running_counts(good + [("b", 2, 12)], None)  # id twice
    assert check_running_counts(good, {10, 11, 12, 13})  # id missing
    assert check_running_counts(good, {10, 11})  # id unexpected


# ---------------------------------------------------------------- determinism


def run_fingerprint(builder_name: str, c: Chaos, work: Path, mode: str = "aligned") -> dict:
    """Everything a run commits that must not depend on anything but seed and schedule."""
    p = BUILDERS[builder_name](out=work / "out", mode=mode, **c.knobs())
    p.checkpoint.num_retained = 1_000
    result = sim_run(p, work / "chk", seed=c.seed, failures=c.schedule(), source_rate=RATE)
    files = {
        f"{uid}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
        for uid in p.sinks
        for f in sorted((work / "out" / uid).glob("part-*"))  # JSON lines or Parquet (``Chaos.sink_format``)
    }
    storage = LocalCheckpointStorage(work / "chk")
    checkpoints = {}
    for epoch in storage.list_checkpoints():
        m, root = storage.load_manifest(epoch)
        checkpoints[epoch] = {
            "sources": m["sources"],
            # attempt ids in file names are random by design; everything else must agree
            "staged": {u: sorted(re.sub(r"-a[^/]*\.(jsonl|parquet)$", "", s) for s in e["staged"])
                       for u, e in m["sinks"].items()},
            # an incremental RocksDB checkpoint's rows (the DB's key estimate) and ``full`` (no SST
            # file shared with the last one) follow RocksDB's background compactions, not the
            # schedule: its content is compared instead, as the state the manifest commits
            "state_files": sorted((f["operator"], f["subtask"], f["epoch"],
                                   *((f["rows"], f["full"]) if f.get("format", "parquet") == "parquet" else ()))
                                  for op in m["operators"].values() for f in op["files"]),
            "state": committed_state(storage, m, root),
        }
    return {
        "completed": result.completed_epochs,
        "restarts": result.restarts,
        "records_in": result.records_in,
        "failovers": [f["time"] for f in result.metrics["failovers"]],
        "files": files,
        "checkpoints": checkpoints,
    }


@settings(max_examples=15, **COMMON)
@given(builder_name=st.sampled_from(sorted(BUILDERS)), mode=st.sampled_from(EXACTLY_ONCE_MODES), c=chaos())
def test_same_seed_and_schedule_replays_the_same_run(builder_name, mode, c, workdirs):
    """In tracker mode too: batch ids differ between runs (they are drawn per attempt), but
    only their XOR matters, so the schedule and everything committed must not."""
    work = workdirs(f"det-{mode}")
    first = run_fingerprint(builder_name, c, work / "1", mode)
    second = run_fingerprint(builder_name, c, work / "2", mode)
    assert first == second
    assert first["completed"], "no epoch completed"
    shutil.rmtree(work, ignore_errors=True)


_FINGERPRINT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import test_exactly_once as t
    from pipelines import without_fsync
    from pathlib import Path
    c = t.Chaos(seed=7, parallelism=3, batch_size=3, interval=0.0005, max_concurrent=1, tolerable_failed=0,
                incremental=True, kill_fractions=(0.3,), fail_points=(("after_manifest", (2,)),), write_failures=(5,))
    with without_fsync():
        fp = t.run_fingerprint("union_chain", c, Path({work!r}))
    print(json.dumps(fp, sort_keys=True, default=str))
    """
)


def test_replay_does_not_depend_on_the_process_hash_seed(tmp_path):
    """Two interpreters with different PYTHONHASHSEED (str hashing, set order) replay one run."""
    outs = []
    for hash_seed in ("1", "2"):
        script = _FINGERPRINT_SCRIPT.format(tests=str(Path(__file__).parent), work=str(tmp_path / hash_seed))
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0]["restarts"] >= 1 and outs[0]["completed"]


# ---------------------------------------------------------------- the oracle can fail


SABOTAGE = Chaos(seed=11, parallelism=2, batch_size=3, interval=0.0005, max_concurrent=1, tolerable_failed=0,
                 incremental=True, kill_fractions=(), fail_points=(), write_failures=())


def test_oracle_passes_the_unsabotaged_scenarios(tmp_path):
    """Baseline for the sabotage tests below: the same scenarios pass without sabotage."""
    for i, c in enumerate([
        SABOTAGE,
        Chaos(**{**SABOTAGE.__dict__, "fail_points": (("after_manifest", (2,)),)}),
        Chaos(**{**SABOTAGE.__dict__, "fail_points": (("after_commit", (2,)),)}),
    ]):
        assert_exactly_once(oracle(running_count, c, tmp_path / str(i)))


def test_oracle_catches_recovery_that_does_not_recommit(tmp_path):
    """Crash between manifest and sink commit; recovery 'forgets' to re-issue the commit:
    the epoch's output is lost, and the oracle must say so."""

    def recover_without_commit(self, uid, committed):
        folder = self.path / "_staging" / uid
        if folder.is_dir():
            for p in folder.iterdir():
                p.unlink()

    c = Chaos(**{**SABOTAGE.__dict__, "fail_points": (("after_manifest", (2,)),)})
    report = oracle(running_count, c, tmp_path,
                    sabotage=lambda mp: mp.setattr(FileSink, "recover", recover_without_commit))
    assert not report.ok
    assert report.lost > 0
    assert report.mismatched_epoch_output > 0
    assert report.restarts == 1


def _commit_twice(real_commit):
    def commit_twice(self, staged):
        staged = list(staged)
        for rel in staged:
            src = self.path / rel
            if src.exists():
                dup = self.final_name(rel).replace(".jsonl", "-again.jsonl")
                shutil.copyfile(src, self.path / dup)
        return real_commit(self, staged)

    return commit_twice


def test_oracle_catches_a_double_commit(tmp_path):
    """A sink commit that also publishes each file under a second name duplicates output."""
    report = oracle(running_count, SABOTAGE, tmp_path,
                    sabotage=lambda mp: mp.setattr(FileSink, "commit", _commit_twice(FileSink.commit)))
    assert not report.ok
    assert report.lost == 0
    assert report.duplicated == report.records_expected == N
    assert report.mismatched_epoch_output > 0


def test_oracle_catches_a_double_commit_in_the_failure_free_run_too(tmp_path, monkeypatch):
    """Sabotage both runs: run-vs-run agrees, but the failure-free run no longer matches the
    sequential reference, and no epoch's output does."""
    monkeypatch.setattr(FileSink, "commit", _commit_twice(FileSink.commit))
    report = oracle(running_count, SABOTAGE, tmp_path / "strict", compare="strict")
    assert not report.ok
    assert report.duplicated == 0  # both runs doubled alike
    assert report.mismatched_epoch_output >= report.epochs_checked + 1
    assert any("differs from the sequential reference" in e for e in report.examples)
    # recorded order compares each run with the reference replayed in its own order: both are caught
    report = oracle(running_count, SABOTAGE, tmp_path / "recorded")
    assert not report.ok
    assert report.duplicated == report.records_expected == N
    assert any("failure-free run of sink counts differs" in e for e in report.examples)


def test_oracle_catches_at_least_once_through_the_exactly_once_checks(tmp_path):
    """At-least-once runs, checked as if they promised exactly-once: for some seed with
    kills, state (or output) mismatches must show. The same scenarios in aligned mode pass."""
    caught = []
    for seed in range(8):
        c = Chaos(**{**SABOTAGE.__dict__, "seed": seed, "parallelism": 3, "kill_fractions": (0.5,)})

        def run(p, chk, failing, c=c):
            p.mode = "at-least-once"  # the run is at-least-once; the oracle sees an aligned pipeline
            try:
                return sim_run(p, chk, seed=c.seed, failures=c.schedule() if failing else None, source_rate=RATE)
            finally:
                p.mode = "aligned"

        report = check_exactly_once(partial(running_count, **c.knobs()), run, tmp_path / f"alo-{seed}")
        assert not report.at_least_once
        if not report.ok:
            assert report.mismatched_state + report.mismatched_epoch_output + report.duplicated > 0
            caught.append(seed)
            assert_exactly_once(oracle(running_count, c, tmp_path / f"aligned-{seed}"))
        if len(caught) >= 2:
            break
    assert caught, "at-least-once runs with kills never differed from exactly-once: the oracle saw nothing"


def test_oracle_catches_state_restored_from_the_wrong_epoch(tmp_path):
    """Recovery takes source offsets from the latest checkpoint but keyed state from the one
    before: updates between the two are lost, so replayed records re-emit old counts."""
    real_find_restore = driver_module.find_restore  # where the restart loop looks it up

    def stale_state(storage, restore):
        r = real_find_restore(storage, restore)
        if r is None:
            return None
        older = [e for e in storage.list_checkpoints() if e < r.epoch]
        if not older:
            return r
        old_manifest, _ = storage.load_manifest(older[-1])
        return Restored(r.epoch, {**r.manifest, "operators": old_manifest["operators"]}, r.root, r.path)

    c = Chaos(**{**SABOTAGE.__dict__, "fail_points": (("after_commit", (2,)),)})
    report = oracle(running_count, c, tmp_path,
                    sabotage=lambda mp: mp.setattr(driver_module, "find_restore", stale_state))
    assert report.restarts == 1
    assert not report.ok
    assert report.duplicated > 0
    assert report.mismatched_state > 0


# ---------------------------------------------------------------- known bugs: minimal repros


def _declined_write_run(work: Path):
    """running_count at parallelism 1, one tolerated failed state write (write #2 is the
    count task's capture of epoch 1 for this seed)."""
    p = running_count(n=N, parallelism=1, tolerable_failed=1, emit_ids=True, out=work / "out")
    result = sim_run(p, work / "chk", seed=3, failures=FailureSchedule(write_failures={2}), source_rate=RATE)
    return result, committed_output(work / "out" / "counts")


def test_declined_write_scenario_declines_an_epoch(tmp_path):
    """Precondition of the BUG-A repro: the write failure is tolerated (no restart) and the
    epoch is aborted."""
    result, _records = _declined_write_run(tmp_path)
    assert result.restarts == 0
    aborted = [e for e in result.metrics["epochs"] if e["state"] == "aborted"]
    assert aborted and "declined" in aborted[0]["reason"]


def test_tolerated_write_failure_loses_no_output(tmp_path):
    _result, records = _declined_write_run(tmp_path)
    assert check_running_counts(records, set(range(N))) == []


def _concurrent_epochs_run(work: Path):
    p = running_count(n=N, parallelism=2, max_concurrent=2, out=work / "out")
    p.checkpoint.num_retained = 100
    return sim_run(p, work / "chk", seed=2, source_rate=RATE)


def test_concurrent_epochs_scenario_overlaps_epochs(tmp_path):
    """Precondition of the BUG-B repro: it completes several epochs with two in flight."""
    result = _concurrent_epochs_run(tmp_path)
    assert len(result.completed_epochs) >= 3


def test_every_completed_checkpoint_is_readable_with_concurrent_epochs(tmp_path):
    _concurrent_epochs_run(tmp_path)
    storage = LocalCheckpointStorage(tmp_path / "chk")
    for epoch in storage.list_checkpoints():
        manifest, root = storage.load_manifest(epoch)
        for uid in manifest["operators"]:
            list(storage.read_operator_rows(manifest, root, uid))  # CheckpointError: state file ... is missing


# ---------------------------------------------------------------- incremental RocksDB checkpoints (shared SST files)


def _sst_uploads_die(at: frozenset[int]):
    """Sabotage that kills the ``k``-th incremental RocksDB upload (``k`` in ``at``) after its first
    shared SST file is written and before its handle is: a writer dying mid-upload leaves SST
    files no manifest names, and the epoch never completes."""
    from epochstream.backends import rocksdb_checkpoint

    real = rocksdb_checkpoint.upload
    calls = [0]

    def patch(mp):
        def upload(store, root, *args, **kwargs):
            calls[0] += 1
            if calls[0] not in at:
                return real(store, root, *args, **kwargs)
            puts = [0]
            real_put, real_put_file = store.put, store.put_file

            def dying(write):
                def wrapped(loc, data):
                    puts[0] += 1
                    if puts[0] > 1:
                        raise OSError(f"injected: writer killed during upload {calls[0]}")
                    write(loc, data)
                return wrapped

            # SST files go through put_file (streamed), the handle through put
            mp.setattr(store, "put", dying(real_put))
            mp.setattr(store, "put_file", dying(real_put_file))
            try:
                return real(store, root, *args, **kwargs)
            finally:
                mp.setattr(store, "put", real_put)
                mp.setattr(store, "put_file", real_put_file)

        mp.setattr(rocksdb_checkpoint, "upload", upload)

    return patch


def _check_shared_files(work: Path) -> int:
    """Every retained checkpoint under ``work`` reads back whole (no shared SST file it needs was
    collected), and every SST file left is named by a retained manifest or is newer than the
    last completed epoch (in flight when the job ended). Returns the number of SST refs seen."""
    refs = 0
    for chk in {p.parent.parent for p in work.rglob("chk-*/_metadata.json")}:
        storage = LocalCheckpointStorage(chk)
        retained = [storage.load_manifest(e)[0] for e in storage.list_checkpoints()]
        live = set()
        for m in retained:
            for uid, entry in m["operators"].items():
                for f in entry["files"]:
                    if f.get("format") == "rocksdb":
                        refs += 1
                        live |= {s["path"] for s in f["shared"]}
                list(storage.read_operator_rows(m, chk, uid))  # CheckpointError if a shared file is gone
        last = max((m["epoch"] for m in retained), default=0)
        for sst in chk.rglob("*.sst"):
            rel = sst.relative_to(chk).as_posix()
            epoch = int(re.search(r"/e(\d+)-a", "/" + rel).group(1))
            assert rel in live or epoch > last, f"{rel}: no retained checkpoint names it (last epoch {last})"
    return refs


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@settings(max_examples=10, **COMMON)
@given(builder_name=st.sampled_from(["running_count", "list_state", "two_stage"]),
       c=chaos(state_backend_type=st.just("hashmap"), kills=st.integers(0, 2)),
       full_every=st.sampled_from([2, 3]))
def test_exactly_once_with_heap_materialisation_rounds(builder_name, mode, c, full_every, workdirs):
    """The heap's materialisation rounds (each capture adds a share of the keys; the links before
    a round are dropped when it ends) under kills, job-master crashes and failed state writes:
    the output exactly once and every epoch's state as the reference's."""
    c = replace(c, incremental=True, state_backend_type="hashmap", full_every=full_every)
    _exactly_once_property(builder_name, c, workdirs, mode)


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@settings(max_examples=8, **COMMON)
@given(builder_name=st.sampled_from(["running_count", "list_state", "two_stage"]),
       c=chaos(state_backend_type=st.just("rocksdb"), kills=st.integers(0, 2)),
       dying_uploads=st.frozensets(st.integers(1, 12), max_size=2))
def test_exactly_once_with_incremental_rocksdb_checkpoints(builder_name, mode, c, dying_uploads, workdirs):
    """RocksDB with incremental checkpoints (shared SST files, ``rocksdb_checkpoint``) under kills,
    job-master crashes before/after the manifest and writers dying in the middle of an SST upload:
    exactly once, every retained checkpoint restorable, and no SST file left that none names."""
    c = replace(c, incremental=True, state_backend_type="rocksdb")
    work = workdirs(f"eo-sst-{mode}-{builder_name}")
    report = oracle(BUILDERS[builder_name], c, work, mode=mode, sabotage=_sst_uploads_die(dying_uploads))
    assert_exactly_once(report)
    assert _check_shared_files(work) > 0
    shutil.rmtree(work, ignore_errors=True)
