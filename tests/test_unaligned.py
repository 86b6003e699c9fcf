"""Unaligned snapshots (alignment/unaligned.py) and the task that applies them (runtime/task.py).

The gate is fed markers directly (sans-IO); tasks are built from a real pipeline and plan and
fed Batch / Marker messages by hand, one ``step`` at a time, like a driver would. The
end-to-end proof (kills while channel state is written and restored) is the oracle suite,
tests/test_exactly_once.py, with mode "unaligned".
"""

from __future__ import annotations

import json
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream.alignment.channel_state import ChannelStateRecorder, decode_channel_state
from epochstream.alignment.unaligned import UnalignedGate
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.assembly import build_tasks
from epochstream.deploy.restore import Restored, check_compatible
from epochstream.deploy.sim import FailureSchedule, SimConfig
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import ProtocolError, StateSerializationError
from epochstream.runtime.messages import Batch, Marker, Snapshot
from epochstream.runtime.task import ConsumingTask
from epochstream.snapshot.manifest import CheckpointError
from pipelines import SOURCE_RATE, running_count, sim_run, union_chain
from test_alignment import build, decode, emitted, kbatch, sent

# ---------------------------------------------------------------- UnalignedGate


def test_first_marker_starts_the_snapshot_and_the_last_completes_its_channel_state():
    g = UnalignedGate([0, 1, 2])
    assert g.open_epoch == 1 and not g.holding
    assert g.may_overtake(1, 1) and not g.may_overtake(1, 2)
    assert g.on_marker(1, 1, now=5.0) == (1, 0.0)  # no waiting: alignment time 0
    assert g.open_epoch == 2 and g.pending == 1
    assert g.recording(0) and not g.recording(1) and g.recording(2)
    assert g.take_completed() is None
    assert g.on_marker(2, 1, now=6.0) is None
    assert g.on_marker(0, 1, now=7.0) is None
    assert g.take_completed() == 1 and g.take_completed() is None
    assert g.pending is None and not any(g.recording(c) for c in (0, 1, 2))
    g.check_invariants()


def test_the_next_epoch_waits_until_the_pending_one_is_complete():
    g = UnalignedGate([0, 1])
    g.on_marker(0, 1, now=0.0)
    assert not g.may_overtake(0, 2), "marker 2 on a channel while epoch 1 still records"
    with pytest.raises(ProtocolError):
        g.on_marker(0, 2, now=0.0)
    g.on_marker(1, 1, now=0.0)
    assert not g.may_overtake(0, 2), "completed but not collected"
    assert g.take_completed() == 1
    assert g.may_overtake(0, 2)


@pytest.mark.parametrize("bad", [(9, 1), (0, 2), (0, 0)])
def test_unknown_channels_skipped_and_stale_epochs_are_protocol_errors(bad):
    g = UnalignedGate([0, 1])
    with pytest.raises(ProtocolError):
        g.on_marker(*bad, now=0.0)
    assert g.pending is None and g.last_started == 0


def test_an_aligned_savepoint_marker_blocks_its_channel_until_every_marker_arrived():
    g = UnalignedGate([0, 1])
    assert g.on_aligned_marker(1, 1, now=2.0) is None
    assert g.holding and not g.admits(1, Batch(2, []), 2.0) and g.admits(0, Batch(1, []), 2.0)
    assert not g.may_overtake(0, 1), "an unaligned marker cannot start while a savepoint aligns"
    assert g.on_aligned_marker(0, 1, now=3.5) == (1, 1.5)
    assert not g.holding and g.open_epoch == 2 and g.pending is None


def test_a_savepoint_may_align_while_the_previous_epoch_still_records():
    g = UnalignedGate([0, 1])
    g.on_marker(0, 1, now=0.0)  # unaligned epoch 1 pending on channel 1
    assert g.on_aligned_marker(0, 2, now=1.0) is None  # savepoint 2 blocks channel 0
    assert g.may_overtake(1, 1), "channel 1's marker 1 must still be taken (no deadlock)"
    g.on_marker(1, 1, now=1.5)
    assert g.take_completed() == 1
    assert g.on_aligned_marker(1, 2, now=2.0) == (2, 1.0)


def test_with_a_timeout_epochs_start_aligned_and_switch_when_alignment_lasts_too_long():
    g = UnalignedGate([0, 1, 2], aligned_timeout=0.5)
    assert g.aligns(1) and not g.may_overtake(0, 1), "markers are taken aligned, in FIFO order"
    assert g.on_aligned_marker(0, 1, now=10.0, forced=False) is None
    assert g.switch_deadline() == 10.5 and g.switch(10.4) is None
    assert g.on_aligned_marker(1, 1, now=10.45, forced=False) is None
    assert g.switch(10.5) == (1, 0.5)  # unaligned now: the blocked channels count as arrived
    assert not g.holding and g.pending == 1 and g.open_epoch == 2
    assert g.recording(2) and not g.recording(0) and g.may_overtake(2, 1)
    assert g.on_marker(2, 1, now=10.6) is None and g.take_completed() == 1
    # the next epoch aligns in time: no switch, no channel state
    for ch in (2, 0):
        assert g.on_aligned_marker(ch, 2, now=11.0, forced=False) is None
    assert g.on_aligned_marker(1, 2, now=11.25, forced=False) == (2, 0.25)
    assert g.switch_deadline() is None


def test_with_a_timeout_the_clock_starts_when_a_marker_is_seen_queued():
    """Flink's announcement: under backpressure every channel's marker waits behind a queue,
    so no channel blocks; the timeout still runs from the first marker seen in the mailbox."""
    g = UnalignedGate([0, 1], aligned_timeout=0.5)
    assert g.switch_deadline() is None
    g.announce(1, now=10.0)
    g.announce(1, now=10.2)  # a later sighting does not move the clock
    g.announce(2, now=10.1)  # nor one of a later epoch
    assert g.switch_deadline() == 10.5 and g.switch(10.4) is None
    assert g.switch(10.5) == (1, 0.5) and g.pending == 1 and not g.arrived
    assert g.may_overtake(0, 1) and g.may_overtake(1, 1), "the queued markers overtake now"
    assert g.on_marker(1, 1, now=10.6) is None and g.on_marker(0, 1, now=10.6) is None
    assert g.take_completed() == 1 and g.switch_deadline() is None
    g.check_invariants()


def test_a_savepoint_never_switches_to_unaligned():
    g = UnalignedGate([0, 1], aligned_timeout=0.0)
    g.on_aligned_marker(0, 1, now=1.0, forced=True)
    assert g.switch_deadline() is None and g.switch(100.0) is None


@settings(max_examples=200, deadline=None)
@given(arrivals=st.lists(st.permutations([0, 1, 2, 3]), min_size=1, max_size=6))
def test_every_epoch_starts_at_its_first_marker_and_completes_at_its_last(arrivals):
    """Epoch by epoch, markers on every channel in any order: one start (the first) and one
    completion (the last); exactly the channels without their marker are recording."""
    g = UnalignedGate([0, 1, 2, 3])
    for n, order in enumerate(arrivals, start=1):
        for i, ch in enumerate(order):
            assert g.may_overtake(ch, n)
            started = g.on_marker(ch, n, now=float(n))
            assert (started is not None) == (i == 0)
            g.check_invariants()
            done = g.take_completed()
            assert (done == n) == (i == len(order) - 1) and (done is None) == (i < len(order) - 1)
            if done is None:
                assert {c for c in range(4) if g.recording(c)} == set(order[i + 1:])
        assert g.open_epoch == n + 1


# ---------------------------------------------------------------- tasks


def test_the_first_marker_overtakes_queued_records_which_become_channel_state(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", 1)]))
    t.receive(c_b, kbatch(1, [("j", 1)]))
    t.receive(c_a, Marker(1))  # overtakes ("k", 1) and ("j", 1)
    t.receive(c_a, kbatch(2, [("k", 2)]))
    acts = t.step(1.0, budget=1)
    t.check_invariants()
    # the snapshot is taken at once, before any queued record, and marker 1 leaves first; then
    # ("k", 1) is processed in epoch 2 (it was copied as channel state)
    assert sent(acts) == [(2, Marker(1)), (2, Batch(2, [("k", 1, 1)]))]
    assert t.epoch == 2 and not t.held
    assert not [a for a in acts if isinstance(a, Snapshot)], "channel b's state is not complete yet"
    rest = acts[1:]
    t.receive(c_b, kbatch(1, [("j", 2)]))  # before b's marker: channel state, arriving late
    t.receive(c_b, Marker(1))
    t.receive(c_b, kbatch(2, [("j", 3)]))  # after b's marker: not channel state
    while t.has_input():
        rest += t.step(3.0, budget=1)
        t.check_invariants()
    (snap,) = [a.capture for a in rest if isinstance(a, Snapshot)]
    assert snap.epoch == 1 and snap.alignment_seconds == 0.0 and snap.held_records == 0
    (keyed,) = snap.keyed
    assert decode(keyed) == {}  # nothing was processed before the cut
    assert snap.sinks[0].records == []
    state = decode_channel_state(snap.channel_state)
    assert [(ch, recs) for ch, recs, _keys, _wm in state] == [
        (c_a, [("k", 1)]), (c_b, [("j", 1)]), (c_b, [("j", 2)])]
    assert snap.channel_state_records == 3 and snap.channel_state_bytes == len(snap.channel_state)
    # channel state is processed now, in epoch 2, like everything after the markers
    assert sorted(emitted(rest)) == [("j", 1, 1), ("j", 2, 2), ("j", 3, 3), ("k", 1, 1), ("k", 2, 2)]
    assert all(m.epoch == 2 for _c, m in sent(rest) if isinstance(m, Batch))


def test_a_single_input_completes_its_capture_with_the_marker(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(3, 0)]  # the map after the rebalance: one input channel
    (ch,) = plan.inputs[(3, 0)]
    t.receive(ch, Batch(1, [("k", 1, 1), ("k", 2, 2)]))
    t.receive(ch, Marker(1))
    acts = t.step(1.0, budget=1)
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert [recs for _c, recs, _k, _w in decode_channel_state(snap.channel_state)] == [[("k", 1, 1), ("k", 2, 2)]]


def test_restore_replays_channel_state_before_new_input(tmp_path):
    p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", 1)]))
    t.receive(c_b, kbatch(1, [("j", 1)]))
    t.receive(c_a, Marker(1))
    t.receive(c_b, Marker(1))
    acts = []
    while t.has_input():
        acts += t.step(1.0)
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    _p2, _plan2, fresh = build(tmp_path / "again", mode="unaligned")
    r = fresh[(2, 0)]
    r.restore_channel_state(decode_channel_state(snap.channel_state))
    r.receive(c_b, kbatch(1, [("j", 2)]))  # new input queues behind the replay
    out = []
    while r.has_input():
        out += r.step(2.0, budget=1)
    assert emitted(out) == [("k", 1, 1), ("j", 1, 1), ("j", 2, 2)]


def test_a_savepoint_marker_aligns_and_carries_no_channel_state(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, Marker(1, aligned=True))
    t.receive(c_a, kbatch(2, [("k", 2)]))  # waits: channel a is blocked
    t.receive(c_b, kbatch(1, [("j", 1)]))
    t.receive(c_b, Marker(1, aligned=True))
    acts = []
    while t.has_input():
        acts += t.step(1.0, budget=1)
        t.check_invariants()
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert snap.channel_state == b"" and decode(snap.keyed[0])["count"] == {"j": 1}
    assert (2, Marker(1, aligned=True)) in sent(acts), "the savepoint's markers stay aligned downstream"
    assert json.loads(snap.sinks[0].records[0]) == ["j", 1, 1]


def test_restore_of_channel_state_at_another_parallelism_names_the_way_out(tmp_path):
    p, plan, _tasks = build(tmp_path, parallelism=2, mode="unaligned")
    manifest = {"job": p.name, "epoch": 3, "parallelism": 1, "max_parallelism": plan.max_parallelism,
                "operators": {}, "sources": {}, "sinks": {}, "metrics": {"channel_state_records": 5},
                "channel_state": {"2.0": {"records": 5, "bytes": 10, "data": ""}}}
    with pytest.raises(CheckpointError, match="parallelism 1.*take a savepoint"):
        check_compatible(plan, p, Restored(3, manifest, tmp_path, tmp_path / "chk-3"), False)


def test_channel_state_of_a_changed_graph_is_a_checkpoint_error_with_the_way_out(tmp_path):
    """Channel ids the task does not have (the graph changed since the snapshot): a clear
    CheckpointError, not a protocol failure."""
    import base64
    import pickle

    from epochstream.deploy.assembly import _restore_channel_state

    p, plan, tasks = build(tmp_path, mode="unaligned")
    blob = pickle.dumps([pickle.dumps((9_999, [("k", 1)], None, None))])
    manifest = {"job": p.name, "epoch": 3, "parallelism": 1, "max_parallelism": plan.max_parallelism,
                "operators": {}, "sources": {}, "sinks": {}, "metrics": {"channel_state_records": 1},
                "channel_state": {"2.0": {"records": 1, "bytes": len(blob),
                                          "data": base64.b64encode(blob).decode("ascii")}}}
    assert decode_channel_state(blob) == [(9_999, [("k", 1)], None, None)]
    with pytest.raises(CheckpointError, match="graph changed.*take a savepoint"):
        _restore_channel_state(tasks[(2, 0)], Restored(3, manifest, tmp_path, tmp_path / "chk-3"), "unaligned")


# ---------------------------------------------------------------- kills while channel state is replayed


def _kills_after_channel_state(tmp_path, replay):
    """The oracle over a run whose kills restore checkpoints holding channel state; ``replay``
    stands in for ``ConsumingTask.restore_channel_state``."""
    def run(p, chk, failing):
        if not failing:
            return sim_run(p, chk, seed=1, source_rate=SOURCE_RATE)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ConsumingTask, "restore_channel_state", replay)
            # virtual seconds: the first epochs complete by ~3 ms, each holding channel state; the
            # 9th capture comes after both kills, and it (or the next with keyed state) fails its write
            result = sim_run(p, chk, seed=1, failures=FailureSchedule(kill_times=[0.0035, 0.006], write_failures={9}),
                             source_rate=SOURCE_RATE)
            assert result.metrics["failures_landed"] == ["worker/now", "worker/now", "write_failure"], \
                result.metrics["failovers"]
            return result

    build = partial(union_chain, mode="unaligned", parallelism=2, batch_size=1, interval=0.0003, emit_ids=True)
    return check_exactly_once(build, run, tmp_path)


def test_kills_while_channel_state_is_written_and_replayed_stay_exactly_once(tmp_path):
    """Kills (one soon after a restore) and a failed write: restores replay channel state (spied)
    and the run is still exactly-once."""
    replayed: list[int] = []
    real = ConsumingTask.restore_channel_state

    def spy(self, entries):
        replayed.append(sum(len(r) for _c, r, _k, _w in entries if r is not None))
        return real(self, entries)

    report = _kills_after_channel_state(tmp_path, spy)
    assert report.ok and report.lost == report.duplicated == 0, report.to_json()
    assert report.mismatched_state == report.mismatched_epoch_output == 0, report.to_json()
    assert report.restarts >= 2 and report.channel_state_records > 0, report.to_json()
    assert sum(replayed) > 0, "no restore replayed channel state: the scenario tests nothing"


def test_the_oracle_sees_channel_state_that_a_restore_drops(tmp_path):
    """Sabotage: restores forget their channel state. The records in flight at the cut are lost,
    and the oracle must say so (it is not blind to channel state)."""
    report = _kills_after_channel_state(tmp_path, lambda self, entries: None)
    assert not report.ok, report.to_json()
    assert report.lost > 0 or report.inputs_lost > 0 or report.mismatched_state > 0, report.to_json()


def test_a_task_whose_alignment_times_out_snapshots_unaligned(tmp_path):
    p, plan, _tasks = build(tmp_path, mode="aligned")
    p.aligned_timeout = 0.5
    t = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk2"), None)[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, Marker(1))
    t.receive(c_a, kbatch(2, [("k", 2)]))  # held: channel a is blocked
    t.receive(c_b, kbatch(1, [("j", 1)]))
    acts = t.step(1.0, budget=1)  # the marker: a blocks
    acts += t.step(1.1, budget=1)  # ("k", 2) held, ("j", 1) processed in epoch 1
    assert [m.records for _c, m in t.held] == [[("k", 2)]] and t.flush_deadline() == 1.5
    t.receive(c_b, kbatch(1, [("j", 2)]))  # before b's marker, after the switch: channel state
    acts += t.step(1.5, budget=1)  # the switch: snapshot of epoch 1 now, held records released
    t.receive(c_b, Marker(1))
    while t.has_input():
        acts += t.step(2.0)
        t.check_invariants()
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert snap.epoch == 1 and snap.alignment_seconds == 0.5 and snap.held_records == 1
    assert decode(snap.keyed[0])["count"] == {"j": 1}
    assert [recs for _c, recs, _k, _w in decode_channel_state(snap.channel_state)] == [[("j", 2)]]
    assert sorted(emitted(acts)) == [("j", 1, 1), ("j", 2, 2), ("k", 2, 1)]


def test_a_task_whose_markers_wait_behind_queues_switches_after_the_timeout(tmp_path):
    """Both channels' markers queued behind data (backpressure): nothing blocks, and the task
    switches ``aligned_timeout`` after it first saw a marker; the records ahead of the markers
    are channel state."""
    p, plan, _tasks = build(tmp_path, mode="aligned")
    p.aligned_timeout = 0.5
    t = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk2"), None)[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    for ch, key in ((c_a, "k"), (c_b, "j")):
        t.receive(ch, kbatch(1, [(key, 1)]))
        t.receive(ch, kbatch(1, [(key, 2)]))
        t.receive(ch, Marker(1))
    acts = t.step(1.0, budget=1)  # ("k", 1) processed; the markers are seen queued
    assert t.flush_deadline() == 1.5 and not any(isinstance(a, Snapshot) for a in acts)
    acts += t.step(1.5, budget=1)  # the switch: snapshot of epoch 1, the markers overtake
    while t.has_input():
        acts += t.step(2.0)
        t.check_invariants()
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert snap.epoch == 1 and snap.alignment_seconds == 0.5
    assert decode(snap.keyed[0])["count"] == {"k": 1}
    assert sorted(r for _c, recs, _k, _w in decode_channel_state(snap.channel_state) for r in recs) == \
        [("j", 1), ("j", 2), ("k", 2)]
    assert sorted(emitted(acts)) == [("j", 1, 1), ("j", 2, 2), ("k", 1, 1), ("k", 2, 2)]


# ---------------------------------------------------------------- messages cut by the step budget


@pytest.mark.parametrize("first", ["other channel", "own channel"])
def test_a_marker_overtakes_the_rest_of_a_message_cut_by_the_step_budget(tmp_path, first):
    """A step stops inside a message at its row budget; a marker that arrives meanwhile is taken
    before the message's rest, which becomes channel state (recorded once, whichever channel's
    marker comes first) and is still processed after the snapshot."""
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", v) for v in range(1, 6)]))
    acts = t.step(1.0, budget=2)  # rows 1-2; rows 3-5 wait for later steps
    assert t.has_input() and not t.mailbox and t.records_in == 2
    order = [c_b, c_a] if first == "other channel" else [c_a, c_b]
    t.receive(order[0], Marker(1))
    acts += t.step(1.1, budget=2)  # the marker first: snapshot at 2 rows; then rows 3-4
    t.receive(order[1], Marker(1))
    while t.has_input():
        acts += t.step(2.0, budget=2)
        t.check_invariants()
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert decode(snap.keyed[0])["count"] == {"k": 2}
    assert [(c, recs) for c, recs, _k, _w in decode_channel_state(snap.channel_state)] == \
        [(c_a, [("k", 3), ("k", 4), ("k", 5)])]
    assert [r for r in emitted(acts) if r[0] == "k"] == [("k", v, v) for v in range(1, 6)]


def test_the_rest_of_a_cut_message_is_channel_state_of_every_epoch_it_outlives(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", v) for v in range(1, 7)]))
    acts = t.step(1.0, budget=1)  # row 1
    for epoch in (1, 2):
        t.receive(c_b, Marker(epoch))
        t.receive(c_a, Marker(epoch))
        acts += t.step(1.0 + epoch, budget=1)  # both markers, then one more row
        t.check_invariants()
    while t.has_input():
        acts += t.step(4.0, budget=1)
    snaps = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert [s.epoch for s in snaps] == [1, 2]
    assert [decode(s.keyed[0])["count"] for s in snaps] == [{"k": 1}, {"k": 2}]
    assert [[recs for _c, recs, _k, _w in decode_channel_state(s.channel_state)] for s in snaps] == [
        [[("k", v) for v in range(2, 7)]], [[("k", v) for v in range(3, 7)]]]


def _cut_messages_under_kills(tmp_path, seed=4, record_cost=2e-5):
    """The strict oracle over a sim run whose unaligned tasks cut multi-row messages at random
    row budgets, with two kills."""
    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=[0.004, 0.009]) if failing else None
        # records cost 10x the default: consuming steps are long enough for markers to arrive
        # while a message is half done
        return p.run(deployment="sim", checkpoint_dir=str(chk), seed=seed, failures=failures,
                     sim=SimConfig(source_rate=SOURCE_RATE, record_cost=record_cost))

    build_ = partial(union_chain, n=600, mode="unaligned", parallelism=2, batch_size=16, interval=0.0005,
                     emit_ids=True)
    return check_exactly_once(build_, run, tmp_path)


def test_kills_with_cut_messages_in_channel_state_stay_exactly_once(tmp_path, monkeypatch):
    cut: list[int] = []
    real = ChannelStateRecorder._record_cursor

    def spy(self):
        cut.append(len(self.cursor[1].records) - self.cursor[2])
        return real(self)

    monkeypatch.setattr(ChannelStateRecorder, "_record_cursor", spy)
    report = _cut_messages_under_kills(tmp_path)
    assert report.ok and report.lost == report.duplicated == 0, report.to_json()
    assert report.restarts >= 2 and report.channel_state_records > 0, report.to_json()
    assert sum(cut) > 0, "no cut message became channel state: the scenario tests nothing"


def test_the_oracle_sees_a_cut_message_left_out_of_channel_state(tmp_path, monkeypatch):
    """Sabotage: the rest of a cut message is marked recorded but not stored; restores lose it."""
    monkeypatch.setattr(ChannelStateRecorder, "_record_cursor", lambda self: setattr(self, "_cursor_recorded", True))
    report = _cut_messages_under_kills(tmp_path)
    assert not report.ok, report.to_json()


def test_a_record_that_cannot_be_pickled_is_a_clear_error_when_it_becomes_channel_state(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, _c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", lambda: 0)]))
    t.receive(c_a, Marker(1))
    with pytest.raises(StateSerializationError, match=f"input channel {c_a} cannot be stored as channel state"):
        t.step(1.0)


def test_the_strict_oracle_completes_epochs_with_their_channel_state(tmp_path):
    """``compare="strict"`` (order-free reference): committed state plus the channel state fed in
    at its channels equals the reference at every epoch, with kills restoring channel state."""

    def run(p, chk, failing):
        kills = FailureSchedule(kill_times=[0.004, 0.007]) if failing else None
        return sim_run(p, chk, seed=2, failures=kills, source_rate=SOURCE_RATE)

    build = partial(running_count, mode="unaligned", parallelism=3, batch_size=1, interval=0.0003)
    report = check_exactly_once(build, run, tmp_path, compare="strict")
    assert report.ok and report.compare == "strict", report.to_json()
    assert report.channel_state_records > 0 and report.restarts >= 2, report.to_json()


# ---------------------------------------------------------------- overtaking at the sender (worker links)


def test_a_link_sends_an_unaligned_marker_ahead_of_the_data_waiting_for_credit():
    from epochstream.deploy.protocol import PriorityMarker
    from epochstream.deploy.worker import PeerLink

    link = PeerLink(conn=None, window=0, overtake=True)  # no credit: data waits; the sender thread is not started
    link.send_data([(5, Batch(1, ["a"])), (6, Batch(1, ["x"]))])
    link.send_data([(5, Batch(1, ["b"])), (5, Marker(1)), (5, Batch(2, ["c"])), (6, Marker(1))])
    m5, m6 = link.window.control
    assert type(m5) is type(m6) is PriorityMarker and m5.channel == 5 and m6.channel == 6
    assert m5.marker.overtook == 2 and [b.records for b in m5.marker.carried] == [["a"], ["b"]]
    assert m6.marker.overtook == 1 and [b.records for b in m6.marker.carried] == [["x"]]
    assert [m.records for env in link.window.data for _c, m in env] == [["a"], ["x"], ["b"], ["c"]]
    assert link.queued == 2 and link.queued_rows == 4  # the markers left the data queue
    # a savepoint's marker stays in line, and a marker never passes another of its channel
    link.send_data([(5, Marker(2, aligned=True))])
    link.send_data([(5, Marker(3))])
    assert len(link.window.control) == 2 and [env[-1][1] for env in list(link.window.data)[-2:]] == [
        Marker(2, aligned=True), Marker(3)]
    # aligned modes: no overtaking at all
    plain = PeerLink(conn=None, window=0)
    plain.send_data([(5, Batch(1, ["a"])), (5, Marker(1))])
    assert not plain.window.control and len(plain.window.data) == 1


def test_overtaking_is_a_pure_step_over_the_queue():
    """``alignment.overtaking.overtake``: what leaves ahead and what stays, the queue untouched."""
    from epochstream.alignment.overtaking import overtake

    queued = [[(5, Batch(1, ["a"])), (7, Batch(1, ["z"]))], [(5, Marker(1, aligned=True))]]
    snapshot = [list(env) for env in queued]
    rest, ahead = overtake(queued, [(6, Batch(1, ["x"])), (6, Marker(1)), (5, Marker(2)), (6, Batch(2, ["y"]))])
    assert queued == snapshot  # pure: the queue is read, never changed
    # channel 6: one record ahead of it in the envelope itself; channel 5: a marker is queued ahead
    assert [(c, m.epoch, m.overtook) for c, m in ahead] == [(6, 1, 1)]
    assert [b.records for b in ahead[0][1].carried] == [["x"]]
    assert [(c, m) for c, m in rest] == [(6, Batch(1, ["x"])), (5, Marker(2)), (6, Batch(2, ["y"]))]
    envelope = [(5, Batch(1, ["a"]))]
    assert overtake(queued, envelope) == (envelope, [])  # no marker: the envelope as it is
    assert overtake([], [(5, Marker(3, aligned=True))]) == ([(5, Marker(3, aligned=True))], [])


def test_messages_a_marker_overtook_at_the_sender_are_channel_state_when_they_arrive(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", 1)]))  # queued ahead of the marker here
    t.receive(c_a, Marker(1, overtook=2))  # ... and two more still at the sender
    t.receive(c_b, Marker(1))
    acts = t.step(1.0, budget=1)
    assert sent(acts)[0] == (2, Marker(1)) and not [a for a in acts if isinstance(a, Snapshot)]
    t.receive(c_a, kbatch(1, [("k", 2)]))
    t.receive(c_a, kbatch(1, [("k", 3)]))
    t.receive(c_a, kbatch(2, [("k", 4)]))  # after the marker at the sender: not channel state
    while t.has_input():
        acts += t.step(2.0, budget=1)
        t.check_invariants()
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert [recs for _c, recs, _k, _w in decode_channel_state(snap.channel_state)] == [
        [("k", 1)], [("k", 2)], [("k", 3)]]
    assert emitted(acts) == [("k", 1, 1), ("k", 2, 2), ("k", 3, 3), ("k", 4, 4)]


def test_a_marker_carrying_what_it_overtook_completes_the_capture_at_once(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="unaligned")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    overtaken = (kbatch(1, [("k", 2)]), kbatch(1, [("k", 3)]))
    t.receive(c_a, kbatch(1, [("k", 1)]))
    t.receive(c_a, Marker(1, overtook=2, carried=overtaken))
    t.receive(c_b, Marker(1))
    acts = t.step(1.0, budget=1)
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]  # no waiting for the overtaken batches
    assert [recs for _c, recs, _k, _w in decode_channel_state(snap.channel_state)] == [
        [("k", 1)], [("k", 2)], [("k", 3)]]
    for b in overtaken:  # they arrive after the marker and are processed once, not recorded again
        t.receive(c_a, b)
    while t.has_input():
        acts += t.step(2.0)
        t.check_invariants()
    assert emitted(acts) == [("k", 1, 1), ("k", 2, 2), ("k", 3, 3)]
    assert len([a for a in acts if isinstance(a, Snapshot)]) == 1


def test_a_cut_takes_rows_and_their_keys_from_lists_and_arrow_batches():
    import pyarrow as pa

    from epochstream.alignment.channel_state import rows as _rows

    rows = Batch(1, [("a", 1), ("b", 2), ("c", 3)], ["a", "b", "c"])
    assert _rows(rows, 1, 3) == ([("b", 2), ("c", 3)], ["b", "c"])
    assert _rows(rows, 0, 3) == (rows.records, rows.keys)
    arrow = Batch(1, pa.record_batch({"k": ["a", "b", "c"], "v": [1, 2, 3]}), None)  # type: ignore[arg-type]
    part, keys = _rows(arrow, 1, 2)
    assert part.to_pylist() == [{"k": "b", "v": 2}] and keys is None


# ---------------------------------------------------------------- watermarks in channel state


def test_a_watermark_replayed_from_channel_state_may_be_announced_again_once():
    from epochstream.runtime.eventtime import EventClock

    c = EventClock(1.0, [0, 1])
    assert c.replayed(0, 7) is None and c.on_watermark(1, 5) == 5
    assert c.on_watermark(0, 7) is None and c.on_watermark(0, 6) is None  # the restored sender repeats itself
    assert c.on_watermark(0, 9) is None and c.watermark == 5
    with pytest.raises(ProtocolError, match="must increase"):
        c.on_watermark(0, 9)  # past the replayed one, a repeat is an error again


def test_kills_restoring_watermarks_in_channel_state_keep_event_time_exact(tmp_path):
    """Event-time sessions in unaligned mode, killed so that a restore replays a watermark its
    source then sends again (it was before the cut); every session comes out once, complete."""
    import random

    from pipelines import committed_output
    from test_pyspark_exactly_once import session_pipeline
    from test_pyspark_exactly_once import sim_run as pyspark_sim_run

    rng = random.Random(5)
    schedule = FailureSchedule(kill_times=sorted(rng.uniform(0, 0.02) for _ in range(rng.randint(1, 3))))
    replayed: list[int] = []
    real = ConsumingTask.restore_channel_state

    def spy(self, entries):
        replayed.extend(w for _c, r, _k, w in entries if r is None)
        return real(self, entries)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ConsumingTask, "restore_channel_state", spy)
        p = session_pipeline(which="tws", parallelism=2, mode="unaligned", out=tmp_path / "out")
        pyspark_sim_run(p, tmp_path / "chk", seed=5, failures=schedule)
    assert replayed, "no restore replayed a watermark: the scenario tests nothing"
    got = sorted((r["k"], r["n"], r["end"]) for r in committed_output(tmp_path / "out"))
    assert got == sorted((f"s{k}", 20, 1_000_000 + k * 8_000 + 300 * 19 + 10_000) for k in range(12))
