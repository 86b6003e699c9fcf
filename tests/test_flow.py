"""Flow control (``deploy.flow``): the objects alone, wired together in memory, and on the simulator.

* buffer debloating: the bound's arithmetic (counters and time in, rows out) and the setting on
  the ``Pipeline`` and the CLI; slow: the local driver with a slow stage and a bound small
  enough that the sources are throttled and the senders kept waiting for credit most of the
  time, and workers SIGKILLed: the oracle finds every record exactly once. How much the bound
  shortens epochs is a benchmark's question (``benchmarks/epochs/backpressure.py``);
* ``SendWindow`` / ``ReceiveWindow`` / ``Pressure`` driven event by event: control before
  data, credit bounds what leaves, credit comes back half a window at a time, hysteresis,
  peers' signals, the row verdict of debloating; a peer that breaks the window is a
  ``ProtocolError``;
* two workers' windows joined by an in-memory link under random schedules (hypothesis):
  every envelope arrives once, in order, and the invariant on the credit holds;
* the simulator with ``SimConfig.flow``: small windows really stall links and throttle
  sources, and the committed counts stay exactly 1..n;
* the no-deadlock argument of ``deploy.flow`` as a property: random cyclic pipelines
  (``cycle_pipelines.py``), every mode, small windows and bounds, random seeds and kills;
  the job always finishes (``SimConfig.time_limit`` would raise ``SimStalled``) and the
  oracle holds. A receiver that never hands credit back is caught as a stall.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from cycle_pipelines import CYCLE_BUILDERS
from epochstream import Pipeline
from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.flow import DEFAULT_TARGET, Debloater, FlowLimits, Pressure, ReceiveWindow, SendWindow
from epochstream.deploy.protocol import Backpressure, Credit, PriorityMarker
from epochstream.deploy.sim import SimConfig, SimStalled
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import ProtocolError
from epochstream.runtime.messages import Batch, Marker
from pipelines import check_running_counts, committed_output, running_count, sim_run, without_fsync

RATE = 20_000.0
#: a consumer's seconds per record: 4x what a source subtask needs at RATE (backpressure)
SLOW = 2e-4
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- buffer debloating


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


# ---------------------------------------------------------------- credit windows and pressure


def test_control_leaves_first_and_data_only_with_credit():
    w = SendWindow(window=2)
    for i in range(3):
        w.queue_data([(7, i)])
    w.queue_control(Backpressure(True))
    assert w.next_envelope() == (Backpressure(True), False)
    assert w.next_envelope() == ([(7, 0)], True) and w.next_envelope() == ([(7, 1)], True)
    assert w.next_envelope() is None and w.stalled and w.credit == 0
    w.queue_control(Credit(1))  # control needs no credit
    assert w.next_envelope() == (Credit(1), False)
    w.on_credit(Credit(2))
    assert w.next_envelope() == ([(7, 2)], True) and not w.stalled and w.credit == 1


def test_a_peer_crediting_what_it_was_never_sent_is_a_protocol_error():
    w = SendWindow(window=4)
    w.queue_data([(1, "x")])
    w.next_envelope()
    with pytest.raises(ProtocolError, match=r"Credit\(2\).*credit 3 of 4"):
        w.on_credit(Credit(2))
    with pytest.raises(ProtocolError):
        w.on_credit(Credit(0))
    assert w.credit == 3  # unchanged


def test_credit_goes_back_half_a_window_at_a_time_and_never_beyond_the_window():
    r = ReceiveWindow(window=4)
    r.on_data()
    assert r.grant() is None
    r.on_data()
    assert r.grant() == Credit(2) and r.owed == 0
    for _ in range(4):
        r.on_data()
    with pytest.raises(ProtocolError, match="beyond its credit window"):
        r.on_data()
    one = ReceiveWindow(window=1)  # a window of one: every envelope is credited back on its own
    one.on_data()
    assert one.grant() == Credit(1) and one.grant() is None


def test_pressure_is_a_hysteresis_and_peers_throttle_too():
    p = Pressure(high=4, low=2, hold=3)
    assert [p.on_backlog(n) for n in (4, 5, 3, 2, 1, 3, 5)] == [
        None, Backpressure(True), None, None, Backpressure(False), None, Backpressure(True)]
    p.on_backlog(0)
    assert not p.throttled
    p.on_signal(1, Backpressure(True))
    p.on_signal(2, Backpressure(True))
    p.on_signal(1, Backpressure(False))
    assert p.throttled and p.peers == {2}
    assert not p.withholds_credit(2) and p.withholds_credit(3)


def test_debloating_rows_turn_pressure_on_and_hold_credit_until_the_backlog_empties():
    p = Pressure(high=100, low=10, hold=100, rows_every=0.5)
    assert p.count_rows(1.0, backlog=3) and not p.count_rows(1.0, backlog=0)
    p.on_rows(1.0, inbound=900, total=1200, limit=800)  # over the row bound, the mailboxes alone too
    assert not p.count_rows(1.2, 3) and p.count_rows(1.5, 3)
    assert p.on_backlog(3) == Backpressure(True) and p.withholds_credit(0)
    p.on_rows(1.5, inbound=100, total=300, limit=800)  # under the bound, not under a quarter of it
    assert p.on_backlog(3) is None and p.pressured and not p.withholds_credit(0)
    assert p.on_backlog(0) == Backpressure(False)  # an empty backlog clears the row verdict


def test_flow_limits_are_checked():
    assert FlowLimits() == FlowLimits(16, 32, 8, 64)
    for bad in (dict(window=0), dict(low=9, high=8), dict(hold=0), dict(low=0)):  # low 0: never turns off
        with pytest.raises(ValueError, match="flow limits"):
            FlowLimits(**bad)


def test_an_overtaking_window_sends_unaligned_markers_as_priority_markers():
    w = SendWindow(window=0, overtake=True)
    assert w.queue_data([(3, Batch(1, ["a"]))]) == [(3, Batch(1, ["a"]))]
    assert w.queue_data([(3, Marker(1))]) == []  # only the marker: nothing joins the data queue
    (pm,) = w.control
    assert type(pm) is PriorityMarker and pm.channel == 3 and pm.marker.overtook == 1
    assert w.next_envelope() == (pm, False) and w.next_envelope() is None


# ---------------------------------------------------------------- two workers joined in memory


@dataclass
class _Side:
    """One worker's half of a link pair: its sender window, receiver window and mailbox."""

    send: SendWindow
    recv: ReceiveWindow
    pressure: Pressure
    mailbox: deque


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 5), hold=st.integers(1, 6), schedule=st.lists(st.integers(0, 5), max_size=400))
def test_windows_joined_by_a_link_deliver_everything_once_in_order(window, hold, schedule):
    """Random interleavings of produce / transmit / deliver / consume on both sides: data
    arrives once and in order, no side ever exceeds its window, and once production stops
    everything drains (withheld credit always comes back, as mailboxes always drain)."""
    sides = [_Side(SendWindow(window), ReceiveWindow(window), Pressure(hold=hold), deque()) for _ in range(2)]
    wire: list[deque] = [deque(), deque()]  # wire[i]: from side i to side 1 - i, FIFO
    sent = [0, 0]
    got: list[list[int]] = [[], []]

    def act(step: int, i: int) -> None:
        me, peer = sides[i], sides[1 - i]
        if step == 0:  # produce
            me.send.queue_data([(i, sent[i])])
            sent[i] += 1
        elif step == 1 and (out := me.send.next_envelope()) is not None:  # transmit
            wire[i].append(out[0])
        elif step == 2 and wire[1 - i]:  # deliver what the peer transmitted
            item = wire[1 - i].popleft()
            if type(item) is list:
                me.recv.on_data()
                me.mailbox.extend(item)
            else:
                assert type(item) is Credit
                me.send.on_credit(item)
        elif step == 3 and me.mailbox:  # consume
            got[i].append(me.mailbox.popleft()[1])
        if not me.pressure.withholds_credit(len(me.mailbox)) and (c := me.recv.grant()) is not None:
            me.send.queue_control(c)
        # invariant: credit + envelopes without credit == window, and those are somewhere
        for j in range(2):
            s = sides[j]
            out = window - s.send.credit
            on_wire = sum(1 for x in wire[j] if type(x) is list)
            credited = sum(x.envelopes for x in wire[1 - j] if type(x) is Credit) + sum(
                x.envelopes for x in sides[1 - j].send.control if type(x) is Credit)
            assert out == on_wire + sides[1 - j].recv.owed + credited
        assert peer.recv.owed <= window

    for n, step in enumerate(schedule):
        act(step % 4, n % 2)
    for _ in range(10 * (sum(sent) + 10)):  # stop producing: everything drains
        for i in range(2):
            for step in (1, 2, 3):
                act(step, i)
    assert got[1] == list(range(sent[0])) and got[0] == list(range(sent[1]))


# ---------------------------------------------------------------- on the simulator


def _sim(limits: FlowLimits | None, record_cost: float = SLOW, time_limit: float | None = 5.0) -> SimConfig:
    return SimConfig(source_rate=RATE, record_cost=record_cost, flow=limits, time_limit=time_limit)


@pytest.mark.parametrize("mode", ["aligned", "unaligned", "tracker"])
def test_small_windows_stall_links_and_throttle_sources_and_counts_stay_exact(mode, tmp_path):
    """A model that changes nothing proves nothing: with a slow consumer, links wait for
    credit, sources are held back, the job takes longer, and every count is 1..n once."""
    n = 800
    runs = {}
    for name, limits in (("off", None), ("on", FlowLimits(window=2, high=4, low=1, hold=3))):
        p = running_count(n=n, emit_ids=True, mode=mode, parallelism=3, batch_size=4, out=tmp_path / name / "out")
        with without_fsync():
            runs[name] = sim_run(p, tmp_path / name / "chk", seed=4, sim=_sim(limits),
                                 failures=FailureSchedule(kill_times=[0.05]))
        assert check_running_counts(committed_output(tmp_path / name / "out" / "counts"), range(n)) == []
    on, off = runs["on"], runs["off"]
    assert off.metrics["sim_flow"] is None
    assert on.metrics["sim_flow"]["credit_waits"] > 0 and on.metrics["sim_flow"]["throttled_reads"] > 0
    assert on.restarts == off.restarts == 1
    assert on.metrics["virtual_seconds"] > off.metrics["virtual_seconds"]


def test_a_receiver_that_withholds_credit_forever_is_reported_as_a_stall(tmp_path, monkeypatch):
    """The property below relies on ``time_limit``: a deadlock must surface, naming what waits."""
    monkeypatch.setattr(ReceiveWindow, "grant", lambda self: None)
    p = running_count(n=400, mode="aligned", parallelism=2, batch_size=4, interval=0.05, out=tmp_path / "out")
    with without_fsync(), pytest.raises(SimStalled, match=r"links with data waiting: 0->1 \(\d+ waiting, credit 0"):
        sim_run(p, tmp_path / "chk", sim=_sim(FlowLimits(window=2, high=4, low=1, hold=3), time_limit=0.5))


@st.composite
def flow_limits(draw) -> FlowLimits:
    high = draw(st.integers(1, 12))
    return FlowLimits(window=draw(st.integers(1, 4)), high=high, low=draw(st.integers(1, high)),
                      hold=draw(st.integers(1, 8)))


#: examples of the long variant (``-m long``)
LONG_EXAMPLES = int(os.environ.get("EPOCHSTREAM_LONG_EXAMPLES", "1000"))
SCENARIOS = dict(builder=st.sampled_from(sorted(CYCLE_BUILDERS)),
                 mode=st.sampled_from(["aligned", "unaligned", "tracker"]), parallelism=st.integers(2, 3),
                 batch_size=st.sampled_from([1, 4]), limits=flow_limits(), slow=st.booleans(),
                 seed=st.integers(0, 2**32 - 1), kills=st.lists(st.floats(0.0, 0.3), max_size=2))


@settings(max_examples=25, **COMMON)
@given(**SCENARIOS)
def test_loops_never_deadlock_on_flow_control(tmp_path_factory, builder, mode, parallelism, batch_size, limits,
                                              slow, seed, kills):
    """The no-deadlock argument of ``deploy.flow``, checked: cycles, small windows and bounds,
    random schedules and kills; every run finishes and the oracle holds."""
    _no_deadlock(tmp_path_factory, builder, mode, parallelism, batch_size, limits, slow, seed, kills)


@pytest.mark.long
@settings(max_examples=LONG_EXAMPLES, **COMMON)
@given(**SCENARIOS)
def test_loops_never_deadlock_on_flow_control_long(tmp_path_factory, builder, mode, parallelism, batch_size,
                                                   limits, slow, seed, kills):
    _no_deadlock(tmp_path_factory, builder, mode, parallelism, batch_size, limits, slow, seed, kills)


def _no_deadlock(tmp_path_factory, builder, mode, parallelism, batch_size, limits, slow, seed, kills) -> None:
    work = tmp_path_factory.mktemp(f"flow-{mode}-{builder}")
    cfg = _sim(limits, record_cost=SLOW if slow else 2e-6)
    note(f"{builder} {mode} p={parallelism} batch={batch_size} {limits} slow={slow} seed={seed} kills={kills}")

    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=sorted(kills)) if failing else None
        result = sim_run(p, chk, seed=seed, failures=failures, sim=cfg)
        if failing:
            flow = result.metrics["sim_flow"]
            event(f"links stalled: {flow['credit_waits'] > 0}, sources throttled: {flow['throttled_reads'] > 0}")
        return result

    build = partial(CYCLE_BUILDERS[builder], mode=mode, parallelism=parallelism, batch_size=batch_size,
                    interval=0.002)
    with without_fsync():
        report = check_exactly_once(build, run, work)
    assert report.ok, report.to_json()
    assert report.records_committed == report.records_expected > 0
    shutil.rmtree(work, ignore_errors=True)
