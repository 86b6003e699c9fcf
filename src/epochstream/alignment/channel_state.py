"""Channel state of unaligned snapshots, recorded for one consuming task.

Theory of operation. In unaligned mode (``alignment.unaligned``) the first marker n a task
takes starts epoch n's snapshot at once; the records still "before marker n" on each channel
are that snapshot's *channel state*. ``ChannelStateRecorder`` is the task's part that knows
this: which queued marker may be taken ahead of what is before it (it asks its
``UnalignedGate``), and what becomes channel state, in the order recorded:

- when a marker is taken early, the messages of its channel queued ahead of it (copied then;
  the task still processes them later, in epoch n + 1), then the messages it overtook at
  the sender and carries (``Marker.carried``);
- while the pending epoch records, every batch or watermark processed from a channel whose
  marker is still to come, or that still owes messages overtaken at the sender (``owed``);
  one already copied when its marker was taken is skipped (``_skip``);
- the rest of a message cut by the step budget (the *cursor*) is the head of its channel:
  it becomes channel state once, when the snapshot starts (if its channel still records)
  or when its channel's marker is taken, and again for each later epoch it outlives.

Once the last marker n is taken and nothing is owed the recorder hands back the capture with
its channel state (a ``Snapshot`` action). One epoch records at a time (the gate's rule).

Each entry is pickled when it is recorded, because the chain may mutate the records it is
given; a record that cannot be pickled is a ``StateSerializationError`` naming the task.

Sans-IO: the task calls it per taken marker and per processed message of a recording channel,
and does the pushing and capturing itself. In the aligned and trAcker modes a task holds no
recorder (``runtime.recording`` is the task's view of it).
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import replace
from typing import Any

from ..runtime.errors import StateSerializationError
from ..runtime.gate import Overtaking
from ..runtime.messages import Batch, Marker, Message, Snapshot, TaskCapture, TaskId, Watermark
from ..runtime.recording import AtHead


class ChannelStateRecorder:
    """Which markers a task takes early, and the channel state of the epoch still recording."""

    def __init__(self, gate: Overtaking, task: TaskId) -> None:
        self.gate = gate
        #: the task recorded for (error messages)
        self.task = task
        #: a marker arrived since the last scan of the mailbox (or an epoch's capture completed)
        self.scan = False
        #: the capture of the epoch whose channel state is still being recorded; None exactly
        #: when the gate has no pending epoch (``check_invariants``)
        self.capture: TaskCapture | None = None
        #: its channel state so far: each entry one pickled (channel, records, keys, watermark)
        self._entries: list[bytes] = []
        self._records = 0
        #: channel -> messages still queued ahead of its taken marker (copied when it was taken);
        #: only kept while the marker also owes messages it overtook at the sender
        self._skip: dict[int, int] = {}
        #: a message cut by the step budget, (channel, batch, rows done); its rest is
        #: conceptually at the head of its channel, so a marker can overtake it between two
        #: steps instead of waiting for the whole message
        self.cursor: tuple[int, Batch, int] | None = None
        #: whether the cursor's unprocessed rows are already channel state of the pending epoch
        self._cursor_recorded = False

    # ------------------------------------------------------------ the alignment timeout
    def switch_deadline(self) -> float | None:
        return self.gate.switch_deadline()

    def switch(self, now: float) -> tuple[int, float] | None:
        """Aligned with a timeout: an alignment that took too long goes unaligned; the queued
        markers of its epoch may overtake now."""
        switched = self.gate.switch(now)
        if switched is not None:
            self.scan = True
        return switched

    def begin(self, capture: TaskCapture) -> None:
        """The first marker of ``capture.epoch`` was taken (or its alignment timed out)."""
        self.capture = capture
        self._entries = []
        self._records = 0
        if self.cursor is not None and self.gate.recording(self.cursor[0]):
            # the rest of a cut message is processed after this snapshot and before its
            # channel's marker (a marker taken on that channel records it with what it passed)
            self._record_cursor()

    # ------------------------------------------------------------ markers
    def scan_mailbox(self, mailbox: deque[tuple[int, Message]], now: float) -> list[tuple[int, Message]]:
        self.scan = False
        items = list(mailbox)
        gate = self.gate
        if gate.aligned_timeout is not None:  # the timeout runs from the first queued marker seen
            for _channel, msg in items:
                if type(msg) is Marker and not msg.aligned:
                    gate.announce(msg.epoch, now)
        return items

    def next_overtaking(self, items: list[tuple[int, Message]]) -> tuple[int, Marker, list[Message]] | None:
        gate = self.gate
        for i, (channel, msg) in enumerate(items):
            if type(msg) is not Marker or msg.aligned or not gate.may_overtake(channel, msg.epoch):
                continue  # an aligned (savepoint) marker is taken in FIFO order
            ahead = [m for c, m in items[:i] if c == channel and type(m) is not Marker]
            del items[i]
            return channel, msg, ahead
        return None

    def take(self, channel: int, marker: Marker, now: float) -> int | None:
        owed = marker.overtook - len(marker.carried)  # overtaken at the sender and not carried
        started = self.gate.on_marker(channel, marker.epoch, now, owed)
        return None if started is None else started[0]

    def taken(self, channel: int, marker: Marker, ahead: list[Message]) -> Snapshot | None:
        """``marker`` was taken on ``channel`` ahead of ``ahead`` (its channel state)."""
        cursor = self.cursor
        if cursor is not None and cursor[0] == channel and not self._cursor_recorded:
            self._record_cursor()  # the rest of the cut message is the head of this channel
        for m in ahead:
            self._record(channel, m)
        for m in marker.carried:  # queued at the sender: they follow the marker, already recorded
            self._record(channel, m)
        owed = marker.overtook - len(marker.carried)
        if owed and ahead:  # processed later: already recorded, before what it overtook
            self._skip[channel] = len(ahead)
        return self._complete() if self.gate.take_completed() is not None else None

    def at_head(self, channel: int, marker: Marker) -> AtHead:
        gate = self.gate
        if not marker.aligned and gate.may_overtake(channel, marker.epoch):
            return AtHead.OVERTAKE
        if not (marker.aligned or gate.aligns(marker.epoch)):
            return AtHead.WAIT
        return AtHead.ALIGN

    def on_aligned_marker(self, channel: int, marker: Marker, now: float) -> tuple[int, float] | None:
        aligned = self.gate.on_aligned_marker(channel, marker.epoch, now, marker.aligned)
        if aligned is not None:
            self.scan = True  # markers held behind the aligned one may be taken now
        return aligned

    # ------------------------------------------------------------ messages
    def processed(self, channel: int, msg: Message) -> Snapshot | None:
        """A message about to be processed from ``channel``: channel state if the channel is
        recording, unless it was copied when its marker was taken; one the marker overtook at
        the sender counts down."""
        gate = self.gate
        if self.capture is None or not gate.recording(channel):
            return None
        skip = self._skip.get(channel)
        if skip:
            if skip == 1:
                del self._skip[channel]
            else:
                self._skip[channel] = skip - 1
            return None
        self._record(channel, msg)  # before the chain may mutate it
        if channel in gate.owed:
            gate.on_overtaken(channel)
            if gate.take_completed() is not None:
                return self._complete()
        return None

    def cut(self, channel: int, msg: Batch) -> None:
        """Cut ``msg`` at the budget, so a marker that arrives meanwhile overtakes its rest."""
        self.cursor = (channel, msg, 0)
        self._cursor_recorded = self.capture is not None and self.gate.recording(channel)

    def next_rows(self, budget: int) -> tuple[int, Any, Any]:
        assert self.cursor is not None
        channel, msg, done = self.cursor
        stop = min(len(msg.records), done + max(budget, 1))
        records, keys = rows(msg, done, stop)
        if stop == len(msg.records):
            self.cursor, self._cursor_recorded = None, False
        else:
            self.cursor = (channel, msg, stop)
        return channel, records, keys

    # ------------------------------------------------------------ recording
    def _record_cursor(self) -> None:
        """The cut message's unprocessed rows become channel state of the pending epoch."""
        assert self.cursor is not None
        channel, msg, done = self.cursor
        records, keys = rows(msg, done, len(msg.records))
        self._record(channel, Batch(msg.epoch, records, keys, msg.id, msg.time))
        self._cursor_recorded = True

    def _record(self, channel: int, msg: Message) -> None:
        try:
            self._entries.append(encode(channel, msg))
        except Exception as exc:  # a record that cannot be pickled cannot be channel state
            raise StateSerializationError(
                f"task {self.task}: a record on input channel {channel} cannot be stored as channel state of an "
                f"unaligned snapshot ({type(exc).__name__}: {exc}); records must pickle in mode 'unaligned' "
                f"(or use mode 'aligned')") from exc
        if type(msg) is Batch:
            self._records += len(msg)

    def _complete(self) -> Snapshot:
        capture, entries = self.capture, self._entries
        assert capture is not None, f"task {self.task}: channel state complete without a capture"
        self.capture, self._entries = None, []
        self._skip.clear()
        self._cursor_recorded = False  # the rest of a cut message is channel state of the next epoch too
        self.scan = True  # a marker of the next epoch may be waiting deeper in the mailbox
        blob = pickle.dumps(entries, pickle.HIGHEST_PROTOCOL) if entries else b""
        return Snapshot(replace(capture, channel_state=blob, channel_state_records=self._records,
                                channel_state_bytes=len(blob)))

    def check_invariants(self) -> None:
        assert (self.capture is None) == (getattr(self.gate, "pending", None) is None), \
            f"task {self.task}: a pending capture without a pending epoch (or the reverse)"


def rows(msg: Batch, start: int, stop: int) -> tuple[Any, Any]:
    """Rows ``start:stop`` of a batch (a list or an Arrow ``RecordBatch``) and their keys."""
    records: Any = msg.records
    keys = msg.keys
    if start == 0 and stop == len(records):
        return records, keys
    part = records[start:stop] if type(records) is list else records.slice(start, stop - start)
    return part, (keys[start:stop] if keys is not None else None)


def encode(channel: int, msg: Message) -> bytes:
    """One entry of channel state, pickled when it is recorded (the chain may mutate records)."""
    if type(msg) is Batch:
        return pickle.dumps((channel, msg.records, msg.keys, None), pickle.HIGHEST_PROTOCOL)
    assert type(msg) is Watermark, f"channel state holds batches and watermarks, not {msg!r}"
    return pickle.dumps((channel, None, None, msg.label), pickle.HIGHEST_PROTOCOL)


def decode_channel_state(blob: bytes) -> list[tuple[int, Any, Any, int | None]]:
    """Channel state as stored (``TaskCapture.channel_state``): (channel, records, keys,
    watermark label) in the order recorded."""
    return [pickle.loads(e) for e in pickle.loads(blob)] if blob else []
