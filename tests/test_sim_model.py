"""The simulator's load model for the paper's throughput and straggler figures (paper 000 §5.3-5.4).

``SimConfig`` can pause whole workers (stragglers), make a worker's tasks share its cores, and
charge the trAcker's local reports and its single agent. These change *when* things happen,
never *what* is committed: the oracle must hold with all of them on, in both modes, under
kills; and each knob must actually cost virtual time (a model that changes nothing proves
nothing about the figures built on it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream import CheckpointConfig, DiscardingSink, Pipeline
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.sim import SimConfig, SimDriver
from epochstream.oracle import check_exactly_once
from pipelines import SOURCE_RATE, RunningCount, running_count, union_chain, without_fsync

LOADED = SimConfig(source_rate=SOURCE_RATE, straggler_rate=300.0, straggler_min=0.0002, worker_cores=1,
                   report_cost=2e-6, agent_cost=20e-6)


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def _run(p, chk, cfg: SimConfig, seed: int = 1, failures: FailureSchedule | None = None) -> SimDriver:
    driver = SimDriver(p, LocalCheckpointStorage(str(chk)), seed=seed, config=cfg, failures=failures)
    driver.run(None, False, None)
    return driver


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_each_knob_costs_virtual_time(mode, tmp_path):
    """Stragglers, shared cores and the trAcker's costs each make the same job end later (with
    sources fast enough that CPU, not the input rate, decides when the job ends)."""
    base = SimConfig(source_rate=2_000_000.0)
    knobs = {"stragglers": dict(straggler_rate=300.0, straggler_min=0.0005), "cores": dict(worker_cores=1)}
    if mode == "tracker":
        knobs["tracker costs"] = dict(report_cost=5e-6, agent_cost=50e-6)
    else:  # markers cost a step each at every task they reach
        knobs["marker cost"] = dict(marker_cost=50e-6)
    job = dict(n=4000, parallelism=2, batch_size=1, mode=mode)
    plain = _run(running_count(**job, out=tmp_path / "o0"), tmp_path / "plain", base).now
    for name, kw in knobs.items():
        p = running_count(**job, out=tmp_path / f"o-{name}")
        loaded = _run(p, tmp_path / name, replace(base, **kw)).now
        assert loaded > plain, f"{name}: {loaded} <= {plain}"


def test_stragglers_replay_with_the_seed(tmp_path):
    """The pauses come from the run's seeded generator: a seed is still a schedule."""
    ends = {_run(running_count(n=300, parallelism=3, out=tmp_path / f"o{i}"), tmp_path / f"r{i}", LOADED, seed=7).now
            for i in range(2)}
    assert len(ends) == 1


def test_the_pause_log_holds_every_pause_as_drawn(tmp_path):
    """``pause_log`` (Figure 13a's straggler floor) has each worker's pauses in order, never
    overlapping, each at least ``straggler_min`` long, and nothing without stragglers."""
    loaded = _run(running_count(n=3000, parallelism=3, out=tmp_path / "ol"), tmp_path / "l", LOADED, seed=7)
    assert loaded.pause_log, "300 pauses per virtual second: the run must have drawn some"
    for w in range(3):
        mine = [(start, end) for worker, start, end in loaded.pause_log if worker == w]
        assert len(mine) >= 2, f"worker {w} drew {len(mine)} pauses in {loaded.now:.4f} virtual s"
        for (s0, e0), (s1, e1) in zip(mine, mine[1:], strict=False):
            assert e0 <= s1, f"worker {w}: pauses overlap: ({s0}, {e0}) then ({s1}, {e1})"
        assert all(end - start >= LOADED.straggler_min * (1 - 1e-9) for start, end in mine)
    assert {w for w, _s, _e in loaded.pause_log} == {0, 1, 2}
    # the pauses cost the run their time: it ends later than the same seed without them
    plain = _run(running_count(n=3000, parallelism=3, out=tmp_path / "op"), tmp_path / "p",
                 replace(LOADED, straggler_rate=0.0), seed=7)
    assert plain.pause_log == []
    assert loaded.now > plain.now


@pytest.mark.parametrize("seed", [3, 11])
def test_both_modes_see_the_same_pauses(seed, tmp_path):
    """Figure 13a compares the modes on one seed: each worker's pauses are the same in both runs
    (the pauses drawn while both ran), whatever else each mode draws (network delays, steps)."""
    logs = {}
    for mode in ("aligned", "tracker"):
        d = _run(running_count(n=3000, parallelism=3, mode=mode, out=tmp_path / f"o{mode}"), tmp_path / mode, LOADED,
                 seed=seed)
        logs[mode] = d.pause_log
    for w in range(3):
        a = [(s, e) for wk, s, e in logs["aligned"] if wk == w]
        t = [(s, e) for wk, s, e in logs["tracker"] if wk == w]
        n = min(len(a), len(t))
        assert n >= 2, f"worker {w}: {len(a)} and {len(t)} pauses, too short a run to compare"
        assert a[:n] == t[:n], f"worker {w}: the modes paused differently"


def test_no_stragglers_draw_nothing(tmp_path):
    """With the knobs off the generator sees no extra draws, so earlier seeds keep their schedules."""
    cfg = SimConfig(source_rate=SOURCE_RATE, straggler_alpha=3.0, worker_cores=None)
    plain = SimConfig(source_rate=SOURCE_RATE)
    a = _run(running_count(n=300, parallelism=2, out=tmp_path / "oa"), tmp_path / "a", plain, seed=3)
    b = _run(running_count(n=300, parallelism=2, out=tmp_path / "ob"), tmp_path / "b", cfg, seed=3)
    assert a.rng.random() == b.rng.random()


@pytest.mark.parametrize("builder", [running_count, union_chain], ids=["running_count", "union_chain"])
@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kills=st.lists(st.floats(0.0, 1.0), max_size=2),
       parallelism=st.integers(1, 3))
def test_exactly_once_on_a_loaded_simulator(builder, mode, seed, kills, parallelism, tmp_path_factory):
    """Paused workers, shared cores and a busy agent under worker kills: still exactly once."""
    work = tmp_path_factory.mktemp("loaded")
    horizon = 2.0 * 200 / (parallelism * SOURCE_RATE)

    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=sorted(k * horizon for k in kills)) if failing else None
        return p.run(deployment="sim", checkpoint_dir=chk, seed=seed, sim=LOADED, failures=failures)

    report = check_exactly_once(lambda: builder(n=200, parallelism=parallelism, mode=mode, interval=0.0005), run,
                                work)
    assert report.ok, report.to_json()
    assert report.lost == report.duplicated == 0


def _ident(record):
    return record


def _write_cost_job(mode: str, stateful: bool) -> Pipeline:
    """200 records at 2,000/s on 2 workers, an epoch every 0.5 ms of virtual time (~100 epochs):
    a stateless chain into a DiscardingSink, or the same with a running count (a state file per epoch)."""
    p = Pipeline(f"write-cost-{mode}", parallelism=2, mode=mode, batch_size=1, restart_attempts=0,
                 checkpoint=CheckpointConfig(interval=0.0005, max_concurrent=1_000_000, num_retained=1))
    s = p.from_collection([(f"k{i % 7}", i) for i in range(200)], uid="src").key_by(_key_of).map(_ident, name="m")
    if stateful:
        s = s.key_by(_key_of).process(RunningCount(False), uid="count")
    s.sink(DiscardingSink(), uid="sink")
    return p


def _key_of(record):
    return record[0]


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_only_captures_that_write_a_file_pay_the_write(mode, tmp_path):
    """A snapshot write costs ``write_base`` per task and a task's writes queue behind each other,
    but a stateless task's capture writes no file (``persist``), so it must not be charged: a
    stateless job ends at the same virtual moment whether a write costs 10 ms or nothing, however
    many epochs it cuts. The same job with a keyed state still writes a file per epoch and task,
    and cannot end before its epochs' writes (about ``epochs * write_base``). With every capture
    charged, the stateless job was capped at ``1 / write_base`` epochs per virtual second too."""
    write = 0.01  # 10 ms a write: ~200 epochs would take ~2 s of virtual time on a task's lane
    ends = {}
    for stateful in (False, True):
        for wb in (0.0, write):
            cfg = SimConfig(source_rate=1_000.0, source_batch=1, write_base=wb)
            d = _run(_write_cost_job(mode, stateful), tmp_path / f"chk{stateful}{wb}", cfg)
            epochs = len({e for e, _t, _s in d.bound_latency})
            assert epochs >= 100, epochs  # many epochs: charged writes would dominate the run
            ends[stateful, wb] = (d.now, epochs)
    assert ends[False, write] == ends[False, 0.0], ends
    stateful_end, stateful_epochs = ends[True, write]
    assert stateful_end >= 0.9 * stateful_epochs * write > 2 * ends[True, 0.0][0], ends
