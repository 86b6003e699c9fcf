"""Buffer debloating (``deploy.flow``): the data in flight bounded by time, not by count.

Fast: the bound's arithmetic (sans-IO: counters and time in, rows out) and the setting on the
``Pipeline`` and the CLI. Slow: the local driver with a slow stage, the bound small enough that
the sources are throttled and the senders kept waiting for credit most of the time, and
workers SIGKILLed: the oracle finds every record exactly once, in both exactly-once modes.
How much the bound shortens epochs is a benchmark's question (``benchmarks/backpressure.py``).
"""

from __future__ import annotations

from functools import partial

import pytest

from epochstream import Pipeline
from epochstream.deploy.flow import DEFAULT_TARGET, Debloater


def test_the_bound_starts_at_one_read_and_follows_the_measured_throughput():
    d = Debloater(target=1.0, floor=16)
    assert d.limit() == 16 and d.rows_in(0.05, 4096) == 4096  # nothing measured yet
    d.observe(0.0, rows=0, busy=0.0)
    d.observe(0.1, rows=100, busy=0.1)  # shorter than a period: not yet
    assert d.throughput is None
    d.observe(0.5, rows=500, busy=0.5)
    assert d.throughput == pytest.approx(1000.0)
    assert d.limit() == 1000 and d.rows_in(0.05, 4096) == 50
    d.target = 0.01
    assert d.limit() == 16  # never below one read


def test_throughput_is_per_second_of_work_so_a_throttled_worker_keeps_its_bound():
    """A worker that idles because its sources are throttled did little work in a long time:
    per wall second it would look slow and shrink its bound further; per busy second it does not."""
    d = Debloater(target=1.0, floor=16)
    d.observe(0.0, rows=0, busy=0.0)
    d.observe(10.0, rows=1000, busy=1.0)  # 10 s of wall time, 1 s of it working
    assert d.throughput == pytest.approx(1000.0)
    d.observe(20.0, rows=1000, busy=1.0)  # idle: nothing learned, nothing forgotten
    assert d.throughput == pytest.approx(1000.0)
    d.observe(20.5, rows=1500, busy=1.5)
    assert d.throughput == pytest.approx(1000.0) and d.limit() == 1000


def test_a_slower_operator_shrinks_the_bound_smoothly_down_to_the_floor():
    d = Debloater(target=1.0, floor=16, smoothing=0.5)
    d.observe(0.0, rows=0, busy=0.0)
    d.observe(1.0, rows=1000, busy=1.0)
    d.observe(2.0, rows=1010, busy=2.0)  # now 10 rows per busy second
    assert d.throughput == pytest.approx(505.0)  # averaged, not jumped
    for t in range(3, 30):
        d.observe(float(t), rows=1010 + 10 * (t - 2), busy=float(t))
    assert d.throughput == pytest.approx(10.0, rel=0.01)
    assert d.limit() == 16 and d.rows_in(0.05, 4096) == 1


def test_a_target_must_be_positive_seconds():
    with pytest.raises(ValueError, match="seconds > 0"):
        Debloater(target=0.0, floor=16)


def test_pipeline_setting_defaults_to_one_second_and_none_turns_it_off():
    assert Pipeline("p").buffer_debloat_target == DEFAULT_TARGET == 1.0
    assert Pipeline("p", buffer_debloat_target=None).buffer_debloat_target is None
    p = Pipeline("p")
    p.buffer_debloat_target = 0.25
    assert p.buffer_debloat_target == 0.25
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="buffer_debloat_target"):
            Pipeline("p", buffer_debloat_target=bad)


def test_cli_flag_sets_the_target_and_zero_turns_it_off(tmp_path):
    from epochstream.cli import _configured, build_parser

    def run_args(*flags: str):
        return build_parser().parse_args(["run", "mod:job", *flags])

    for flags, want in ((["--buffer-debloat-target", "0.5"], 0.5), (["--buffer-debloat-target", "0"], None),
                        ([], DEFAULT_TARGET)):
        p = _configured(lambda: Pipeline("p"), run_args(*flags))()
        assert p.buffer_debloat_target == want, flags


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_under_backpressure_with_a_tight_bound_and_kills(tmp_path, mode):
    """A slow stage (0.3 ms per record) behind a keyed exchange, a 20 ms bound (sources
    throttled, credit withheld and consuming steps cut short all the time), 3 SIGKILLs."""
    from pipelines import paced
    from test_local_driver import assert_exactly_once, describe, local_oracle

    def build(**kw):
        p = paced(**kw)
        p.buffer_debloat_target = 0.02
        return p

    report, runs = local_oracle(partial(build, n=6_000, parallelism=2, mode=mode, interval=0.05, batch_size=64,
                                        sink_delay=0.0003), tmp_path, seed=7, kills=3)
    assert_exactly_once(report, describe(report, runs))
    assert runs["chaos"][0].restarts >= 1


def test_the_step_budget_before_the_first_measurement_can_be_smaller_than_the_most():
    d = Debloater(1.0, floor=1024)
    assert d.rows_in(0.05, 4096) == 4096 and d.rows_in(0.05, 4096, unmeasured=256) == 256
    d.observe(0.0, 0, 0.0)
    d.observe(1.0, 1000, 1.0)  # 1,000 rows per busy second
    assert d.rows_in(0.05, 4096, unmeasured=256) == 50
