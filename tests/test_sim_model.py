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

from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.sim import SimConfig, SimDriver
from epochstream.oracle import check_exactly_once
from pipelines import SOURCE_RATE, running_count, union_chain, without_fsync

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
