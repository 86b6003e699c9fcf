"""What a task needs to take part in trAcker mode (kept apart so tasks stay mode-agnostic).

``Tracked`` is the trAcker's ``runtime.progress.Progress``: the chain rule (SND of every
output before the RCV of the inputs that caused it; tracker/local.py) is kept by ``flush``,
which records the SNDs of what it drains and only then the RCVs of ``received``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterator, Protocol

from .errors import ProtocolError
from .messages import Batch, Send, TaskAction, TaskId

if TYPE_CHECKING:
    from .chain import OutputBuffers

#: the tracker's dimensions (tracker.messages.EPOCHS / TIME; runtime may not import tracker/)
EPOCHS, TIME = 0, 1


class Tracker(Protocol):
    """The calls a task makes on its worker's local tracker (``tracker.local.LocalTracker``)."""

    def snd(self, batch_id: int, epoch: int, segment: int, dim: int = EPOCHS) -> None: ...

    def rcv(self, batch_id: int, epoch: int, segment: int, dim: int = EPOCHS) -> None: ...

    def promise(self, segment: int, epoch: int, now: float, source: Hashable | None = None,
                dim: int = EPOCHS) -> None: ...

    def confirm(self, segment: int, label: int, process: Hashable) -> None: ...


class TimeNote(Protocol):
    """A time-dimension NEOSS as a task sees it (``tracker.messages.WindowEnd``)."""

    @property
    def label(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def token_of(self, process: Hashable) -> int: ...


@dataclass
class TaskTracking:
    """The worker's local tracker, this task's segment, where each output channel leads,
    and the task's batch-id generator."""

    tracker: Tracker
    segment: int
    out_segment: dict[int, int]
    ids: Iterator[int]
    #: event time: seconds per coarse time label (None: the pipeline has no event time)
    slack: float | None = None


class Tracked:
    """``Progress`` of trAcker mode: every batch reported, epochs and time promised."""

    __slots__ = ("out", "tracker", "segment", "out_segment", "ids", "labels_batches")

    in_band = False

    def __init__(self, out: OutputBuffers, tracking: TaskTracking) -> None:
        self.out = out
        self.tracker = tracking.tracker
        self.segment = tracking.segment
        self.out_segment = tracking.out_segment
        self.ids = tracking.ids
        #: event time on: batches carry labels and are reported in the time dimension too
        self.labels_batches = tracking.slack is not None

    def flush(self, epoch: int, label: int, received: list[Batch], actions: list[TaskAction],
              only: list[int] | None = None) -> None:
        tracker, ids, seg_of, timed = self.tracker, self.ids, self.out_segment, self.labels_batches
        for ch, batch in self.out.drain(epoch, label, only):
            batch.id = next(ids)
            tracker.snd(batch.id, batch.epoch, seg_of[ch])
            if timed:
                tracker.snd(batch.id, batch.time, seg_of[ch], TIME)
            actions.append(Send(ch, batch))
        if received and only is None:  # a partial flush: the RCVs wait for the rest of the output
            seg = self.segment
            for b in received:
                tracker.rcv(b.id, b.epoch, seg)
                if timed:
                    tracker.rcv(b.id, b.time, seg, TIME)
            received.clear()

    def epoch_ended(self, epoch: int, now: float, source: TaskId | None, actions: list[TaskAction],
                    aligned: bool = False) -> None:
        if source is not None:  # the promise follows the SNDs of every batch of epoch <= n (just flushed)
            self.tracker.promise(self.segment, epoch, now, source=source)

    def time_passed(self, label: int, now: float, source: TaskId | None, actions: list[TaskAction]) -> None:
        if source is None:
            raise ProtocolError("Tracked", f"segment {self.segment}", f"time_passed({label})",
                                "in trAcker mode only sources promise time; the agent sends WindowEnd")
        self.tracker.promise(self.segment, label, now, source=source, dim=TIME)

    def window_ended(self, note: TimeNote, process: TaskId) -> None:
        self.tracker.confirm(self.segment, note.label, process)
        self.tracker.rcv(note.token_of(process), note.epoch, self.segment)
