"""The small objects a ``runtime.task.Task`` is composed of, each driven alone.

* ``Gate`` (runtime/gate.py): one conformance suite run against both implementations, the
  barrier aligner and the trAcker's firm-bound gate;
* ``SplitReader`` (runtime/reader.py): runs of one time label, the time promise;
* ``EventClock`` (runtime/eventtime.py): the watermark is the minimum over channels;
* ``Progress`` (runtime/progress.py, runtime/tracking.py): in band vs. to the tracker, and
  the chain rule (SND of the output before RCV of its cause);
* ``ChannelStateRecorder`` (alignment/channel_state.py): unaligned mode's markers taken early
  and the channel state they cut, driven with an ``UnalignedGate`` and no task;
* the roles: a ``SourceTask`` or a ``ConsumingTask`` per chain, both ``Task``s, built from a
  frozen ``TaskConfig``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Any, Callable

import pytest

from epochstream.alignment.barrier import BarrierAligner
from epochstream.alignment.channel_state import ChannelStateRecorder, decode_channel_state
from epochstream.alignment.unaligned import UnalignedGate
from epochstream.runtime.chain import OutputBuffers
from epochstream.runtime.errors import EpochStreamError, ProtocolError, StateSerializationError
from epochstream.runtime.eventtime import EventClock
from epochstream.runtime.gate import Gate
from epochstream.runtime.messages import END_OF_TIME, Batch, Marker, Send, Snapshot, TaskCapture, Watermark
from epochstream.runtime.progress import InBand
from epochstream.runtime.reader import SplitReader
from epochstream.runtime.recording import AtHead
from epochstream.runtime.sources import CollectionSource
from epochstream.runtime.task import ConsumingTask, SourceTask, Task, TaskConfig
from epochstream.runtime.tracking import TaskTracking, Tracked
from epochstream.tracker.gate import FirmBoundGate

# ---------------------------------------------------------------- Gate conformance


def _aligner() -> Gate:
    return BarrierAligner([0, 1])


def _firm() -> Gate:
    return FirmBoundGate(segment=0)


def _hold_then_end_aligned(gate: Gate) -> list[int]:
    """Epoch 1 ends after something was held: marker 1 on channel 0 blocks it, the marker
    on channel 1 aligns."""
    assert gate.on_marker(0, 1, now=1.0) is None
    assert not gate.admits(0, Batch(2, ["late"]), now=1.5)  # behind the marker: epoch 2
    assert gate.admits(1, Batch(1, ["on time"]), now=1.5)
    assert gate.holding
    ended = gate.on_marker(1, 1, now=3.0)
    assert ended == (1, 2.0)
    return [ended[0]]


def _hold_then_end_firm(gate: Gate) -> list[int]:
    """Epoch 1 ends after something was held: a batch of epoch 2 waits for NEOSS(1)."""
    assert not gate.admits(0, Batch(2, ["late"]), now=1.0)
    assert gate.admits(1, Batch(1, ["on time"]), now=1.5)
    assert gate.holding
    ended = gate.on_neoss(1, now=3.0)
    assert gate.last_hold_seconds == 2.0
    return ended


GATES: dict[str, tuple[Callable[[], Gate], Callable[[Gate], list[int]], Callable[[Gate], Any]]] = {
    "barrier": (_aligner, _hold_then_end_aligned, lambda g: g.on_neoss(1, now=0.0)),
    "firm": (_firm, _hold_then_end_firm, lambda g: g.on_marker(0, 1, now=0.0)),
}


@pytest.fixture(params=sorted(GATES))
def gate_case(request: pytest.FixtureRequest):
    return GATES[request.param]


def test_a_new_gate_processes_epoch_one_and_holds_nothing(gate_case):
    make, _end, _other = gate_case
    g = make()
    assert g.exactly_once and g.open_epoch == 1 and not g.holding
    assert g.admits(0, Batch(1, ["x"]), now=0.0) and g.admits(1, Batch(1, ["y"]), now=0.0)
    assert not g.holding


def test_ending_an_epoch_releases_what_was_held_and_opens_the_next(gate_case):
    make, end, _other = gate_case
    g = make()
    assert end(g) == [1]
    assert not g.holding and g.open_epoch == 2
    assert g.admits(0, Batch(2, ["late"]), now=4.0)  # the held batch is admitted now


def test_the_other_modes_entry_is_a_protocol_error(gate_case):
    """A marker in trAcker mode, a NEOSS in aligned mode: the gate, not the task, says no."""
    make, _end, other = gate_case
    g = make()
    with pytest.raises(ProtocolError):
        other(g)
    assert g.open_epoch == 1 and not g.holding  # and nothing changed


def test_reset_restarts_after_the_restored_epoch(gate_case):
    make, end, _other = gate_case
    g = make()
    g.admits(0, Batch(1, ["x"]), now=0.0)
    g.reset(6)
    assert g.open_epoch == 7 and not g.holding


def test_watermarks_and_markers_wait_on_a_blocked_channel_but_never_at_the_firm_gate():
    a = BarrierAligner([0, 1])
    a.on_marker(0, 1, now=0.0)
    assert not a.admits(0, Watermark(3), now=0.0) and not a.admits(0, Marker(2), now=0.0)
    f = FirmBoundGate()
    f.admits(0, Batch(3, ["x"]), now=0.0)
    assert f.holding and f.admits(0, Watermark(3), now=0.0)


# ---------------------------------------------------------------- SplitReader


def test_reader_round_robins_its_splits_and_reports_exhaustion():
    src = CollectionSource(list(range(10)), num_splits=4)
    r = SplitReader(src, "src", [1, 3], {3: 1}, slack=None)  # subtask 1 of 2; split 3 restored at 1
    assert r.read(10) == [(None, [1, 5, 9], 0)]
    assert r.read(10) == [(None, [7], 1)]
    assert r.offsets == {1: 3, 3: 2} and not r.has_more()
    assert r.read(10) == []


def test_reader_cuts_runs_of_one_label_and_promises_below_the_smallest_next_label():
    src = CollectionSource([0.5, 1.0, 2.5, 2.7, 6.0], num_splits=1)
    src.timestamp = lambda ts: ts
    r = SplitReader(src, "src", [0], {}, slack=2.0)
    assert r.next_time_promise() is None  # label 0 is still to come: nothing to promise yet
    assert r.read(4) == [(0, [0.5, 1.0], 0), (1, [2.5, 2.7], 2)]
    assert r.next_time_promise() == 0  # split's newest label 1: labels <= 0 are done
    assert r.next_time_promise() is None  # no growth, no promise
    assert r.read(4) == [(3, [6.0], 4)]
    assert r.next_time_promise() == END_OF_TIME  # exhausted


def test_reader_rejects_time_going_back_within_a_split():
    src = CollectionSource([5.0, 1.0], num_splits=1)
    src.timestamp = lambda ts: ts
    r = SplitReader(src, "src", [0], {}, slack=1.0)
    with pytest.raises(EpochStreamError, match="must not decrease"):
        r.read(2)


# ---------------------------------------------------------------- EventClock


def test_clock_watermark_is_the_minimum_over_channels_and_must_increase():
    c = EventClock(1.0, [0, 1, 2])
    assert c.on_watermark(0, 4) is None and c.on_watermark(1, 2) is None
    assert c.on_watermark(2, 3) == 2
    assert c.on_watermark(1, 9) == 3
    with pytest.raises(ProtocolError, match="increase"):
        c.on_watermark(1, 9)


# ---------------------------------------------------------------- Progress


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def snd(self, batch_id: int, epoch: int, segment: int, dim: int = 0) -> None:
        self.calls.append(("snd", batch_id, epoch, segment, dim))

    def rcv(self, batch_id: int, epoch: int, segment: int, dim: int = 0) -> None:
        self.calls.append(("rcv", batch_id, epoch, segment, dim))

    def promise(self, segment: int, epoch: int, now: float, source: Any = None, dim: int = 0) -> None:
        self.calls.append(("promise", segment, epoch, source, dim))

    def confirm(self, segment: int, label: int, process: Any) -> None:
        self.calls.append(("confirm", segment, label, process))


def test_in_band_progress_sends_markers_and_watermarks_behind_the_batches():
    out = OutputBuffers([7, 8], keyed=set())
    p = InBand(out, [7, 8])
    out.records[7].append("r")
    actions: list[Any] = []
    received = [Batch(1, ["cause"])]
    p.flush(1, 0, received, actions)
    p.epoch_ended(1, 0.0, None, actions)
    p.time_passed(4, 0.0, None, actions)
    assert actions == [Send(7, Batch(1, ["r"])), Send(7, Marker(1)), Send(8, Marker(1)),
                       Send(7, Watermark(4)), Send(8, Watermark(4))]
    assert received == []


def test_tracked_progress_reports_the_output_before_its_cause():
    out = OutputBuffers([7], keyed=set())
    rec = _Recorder()
    p = Tracked(out, TaskTracking(rec, segment=2, out_segment={7: 5}, ids=itertools.count(100), slack=1.0))
    out.records[7].append("r")
    actions: list[Any] = []
    received = [Batch(3, ["cause"], id=42, time=6)]
    p.flush(3, 6, received, actions)
    assert [a.message.id for a in actions] == [100] and actions[0].message.time == 6
    assert rec.calls == [("snd", 100, 3, 5, 0), ("snd", 100, 6, 5, 1), ("rcv", 42, 3, 2, 0), ("rcv", 42, 6, 2, 1)]
    assert received == []
    rec.calls.clear()
    p.epoch_ended(3, 0.0, None, actions)  # not a source: the agent infers the end
    p.epoch_ended(3, 0.0, (0, 1), actions)
    assert rec.calls == [("promise", 2, 3, (0, 1), 0)] and len(actions) == 1
    with pytest.raises(ProtocolError):
        p.time_passed(9, 0.0, None, actions)  # only sources promise time


# ---------------------------------------------------------------- ChannelStateRecorder

TID = (2, 0)


def _recorder(channels=(0, 1)) -> ChannelStateRecorder:
    return ChannelStateRecorder(UnalignedGate(channels), TID)


def _take(rec: ChannelStateRecorder, channel: int, marker: Marker, ahead: list, now: float = 1.0):
    """What ``ConsumingTask._take_marker`` does, with a capture standing in for the chain's."""
    started = rec.take(channel, marker, now)
    if started is not None:
        rec.begin(TaskCapture(TID, started, captured_at=now))
    return started, rec.taken(channel, marker, ahead)


def _state(snap: Snapshot) -> list[tuple[int, Any]]:
    return [(ch, recs if recs is not None else ("watermark", wm))
            for ch, recs, _keys, wm in decode_channel_state(snap.capture.channel_state)]


def test_the_first_marker_overtakes_and_the_last_completes_the_channel_state():
    rec = _recorder()
    mailbox = deque([(0, Batch(1, ["a"])), (1, Batch(1, ["b"])), (0, Marker(1)), (0, Batch(2, ["c"]))])
    rec.scan = True
    items = rec.scan_mailbox(mailbox, now=1.0)
    assert not rec.scan
    channel, marker, ahead = rec.next_overtaking(items)
    assert (channel, marker.epoch, [m.records for m in ahead]) == (0, 1, [["a"]])
    assert [m for _c, m in items if type(m) is Marker] == [] and rec.next_overtaking(items) is None
    assert _take(rec, channel, marker, ahead) == (1, None), "channel 1's marker is still to come"
    assert rec.capture is not None and rec.capture.epoch == 1
    rec.check_invariants()
    # processed later: "a" was copied when its marker was taken, "b" is recorded as processed
    assert rec.processed(0, Batch(1, ["a"])) is None
    assert rec.processed(1, Batch(1, ["b"])) is None
    assert rec.processed(1, Watermark(5)) is None
    assert rec.at_head(1, Marker(1)) is AtHead.OVERTAKE
    started, snap = _take(rec, 1, Marker(1), [])
    assert started is None and snap is not None
    assert _state(snap) == [(0, ["a"]), (1, ["b"]), (1, ("watermark", 5))]
    capture = snap.capture
    assert capture.channel_state_records == 2 and capture.channel_state_bytes == len(capture.channel_state)
    assert rec.capture is None and rec.scan, "a marker of the next epoch may wait deeper in the mailbox"
    rec.check_invariants()
    assert rec.processed(1, Batch(2, ["d"])) is None, "nothing records between epochs"


def test_a_marker_of_the_next_epoch_waits_at_the_head_until_the_state_completes():
    rec = _recorder()
    _take(rec, 0, Marker(1), [])
    assert rec.at_head(0, Marker(2)) is AtHead.WAIT
    assert rec.next_overtaking([(0, Marker(2))]) is None
    _take(rec, 1, Marker(1), [])
    assert rec.at_head(0, Marker(2)) is AtHead.OVERTAKE
    assert rec.at_head(0, Marker(2, True)) is AtHead.ALIGN, "a savepoint's marker is taken in FIFO order"


def test_the_rest_of_a_cut_message_is_channel_state_of_its_channel():
    rec = _recorder()
    rec.cut(0, Batch(1, [1, 2, 3, 4], ["k1", "k2", "k3", "k4"]))
    assert rec.next_rows(1) == (0, [1], ["k1"]) and rec.cursor is not None
    _take(rec, 0, Marker(1), [])  # the marker overtakes the rest: [2, 3, 4] is before it
    assert rec.next_rows(2) == (0, [2, 3], ["k2", "k3"])
    _started, snap = _take(rec, 1, Marker(1), [])
    assert _state(snap) == [(0, [2, 3, 4])]
    assert rec.next_rows(5) == (0, [4], ["k4"]) and rec.cursor is None


def test_a_cut_message_on_a_recording_channel_is_recorded_when_the_snapshot_starts():
    rec = _recorder()
    rec.cut(1, Batch(1, [1, 2, 3]))
    rec.next_rows(1)
    _take(rec, 0, Marker(1), [])  # channel 1 still records: its cut rest is channel state now
    rec.next_rows(10)
    assert rec.cursor is None
    _started, snap = _take(rec, 1, Marker(1), [])
    assert _state(snap) == [(1, [2, 3])]


def test_messages_a_marker_overtook_at_the_sender_complete_the_state_as_they_arrive():
    rec = _recorder(channels=(0,))
    started, snap = _take(rec, 0, Marker(1, overtook=2), [])
    assert started == 1 and snap is None, "two messages it passed are still to come"
    assert rec.processed(0, Batch(1, ["x"])) is None
    snap = rec.processed(0, Batch(1, ["y"]))
    assert snap is not None and _state(snap) == [(0, ["x"]), (0, ["y"])]


def test_a_record_that_cannot_be_pickled_names_the_task():
    rec = _recorder()
    with pytest.raises(StateSerializationError, match=r"task \(2, 0\).*channel 0"):
        _take(rec, 0, Marker(1), [Batch(1, [lambda: None])])


# ---------------------------------------------------------------- the two roles


def test_task_config_is_frozen_and_keyword_only():
    config = TaskConfig(start_epoch=3, event_time_slack=2.0)
    assert config.slack == 2.0 and config.full_every == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.start_epoch = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        TaskConfig(3)  # type: ignore[misc]


def _built(tmp_path, mode: str):
    from test_alignment import build

    _p, plan, tasks = build(tmp_path, mode=mode)
    return plan, tasks


@pytest.mark.parametrize("mode", ["aligned", "unaligned", "at-least-once"])
def test_a_source_chain_gets_a_source_task_and_the_others_consume(tmp_path, mode):
    plan, tasks = _built(tmp_path, mode)
    for tid, t in tasks.items():
        assert isinstance(t, Task)
        if plan.chains[tid[0]].is_source:
            assert type(t) is SourceTask and t.is_source and t.takes_triggers and t.reader is not None
            assert not t.overtakes
        else:
            assert type(t) is ConsumingTask and not t.is_source and not t.takes_triggers and t.reader is None
            assert (t.recorder is not None) == (mode == "unaligned") == t.overtakes


def test_a_source_task_ends_epochs_on_triggers_and_has_no_input_channels(tmp_path):
    _plan, tasks = _built(tmp_path, "aligned")
    src = tasks[(0, 0)]
    assert isinstance(src, SourceTask)
    src.on_neoss(1)  # ignored: a source's epochs end on triggers
    assert not src.has_input()
    src.trigger(1)
    assert src.has_input()
    acts = src.step(0.5, budget=4, read_source=False)
    (snap,) = [a.capture for a in acts if isinstance(a, Snapshot)]
    assert snap.epoch == 1 and snap.offsets == {"src-a": {0: 0}} and src.epoch == 2
    assert [m for a in acts if isinstance(a, Send) for m in [a.message] if type(m) is Marker] == \
        [Marker(1)] * len(src.out_channels)
    with pytest.raises(ProtocolError, match="no input channels"):
        src.receive(0, Batch(2, ["x"]))
    src.check_invariants()


def test_a_consuming_task_needs_a_recorder_exactly_when_its_gate_overtakes(tmp_path):
    plan, tasks = _built(tmp_path, "aligned")
    t = tasks[(2, 0)]
    chain, inputs = t.chain, plan.inputs[(2, 0)]
    with pytest.raises(ValueError, match="recorder"):
        ConsumingTask(plan, (2, 0), chain, UnalignedGate(inputs))
    with pytest.raises(ValueError, match="recorder"):
        ConsumingTask(plan, (2, 0), chain, BarrierAligner(inputs), recorder=_recorder(inputs))
    with pytest.raises(ValueError, match="SourceTask"):
        ConsumingTask(plan, (0, 0), tasks[(0, 0)].chain, BarrierAligner([]))
    with pytest.raises(ValueError, match="ConsumingTask"):
        SourceTask(plan, (2, 0), chain)
