"""How a task tells the rest of the job what it has done: in band or to the trAcker.

Theory of operation. Three facts leave a task besides its records: *these batches were
sent and those processed* (needed only by the trAcker, which counts them), *epoch n ended
here* and *event time reached label t*. The aligned modes carry the last two in band, as
punctuation behind the batches they cover (``Marker``, ``Watermark``; FIFO channels keep
them in place). TrAcker mode carries all three out of band, as SND/RCV reports, promises
and confirmations to the worker's local tracker, whose agent turns them into NEOSS and
``WindowEnd`` notes. ``Progress`` is that choice, made once when the task is built:

=================  ===============================  ======================================
                   ``InBand`` (aligned modes)       ``runtime.tracking.Tracked`` (trAcker)
=================  ===============================  ======================================
``flush``          drain outputs into ``Send``s     same, stamped with ids and time labels;
                                                    SND of each, then RCV of the inputs
``epoch_ended``    ``Marker(n)`` on every output    a source promises n; others say nothing
``time_passed``    ``Watermark(t)`` on every output  a source promises label t (dimension 1)
``window_ended``   ``ProtocolError`` (no WindowEnd)  confirm, then acknowledge the note's token
``labels_batches`` False (labels ride watermarks)   True with event time: a batch carries one
=================  ===============================  ======================================

Each method is called per flush or per epoch, never per record.
"""

from __future__ import annotations

from typing import Protocol

from .chain import OutputBuffers
from .errors import ProtocolError
from .messages import Batch, Marker, Send, TaskAction, TaskId, Watermark
from .tracking import TimeNote


class Progress(Protocol):
    """The output side of one task's mode (structural; see the table above)."""

    @property
    def in_band(self) -> bool:
        """True: epochs end with markers on the data channels (the aligned modes)."""
        ...

    @property
    def labels_batches(self) -> bool:
        """True: every batch carries its time label, and a batch never spans two."""
        ...

    def flush(self, epoch: int, label: int, received: list[Batch], actions: list[TaskAction],
              only: list[int] | None = None) -> None:
        """Send the buffered output as batches of ``epoch`` (and time label ``label``), then
        account for the ``received`` batches that caused it; empty ``received``. With ``only``
        (the batching policy sends full channels early) send those channels' output and keep
        ``received``: what the inputs caused is not all sent yet."""
        ...

    def epoch_ended(self, epoch: int, now: float, source: TaskId | None, actions: list[TaskAction],
                    aligned: bool = False) -> None:
        """Epoch ``epoch`` ended at this task (``source``: its id if it reads splits), after its
        snapshot action; ``aligned``: a savepoint's epoch (its markers say so)."""
        ...

    def time_passed(self, label: int, now: float, source: TaskId | None, actions: list[TaskAction]) -> None:
        """No record with a time label <= ``label`` will leave this task any more."""
        ...

    def window_ended(self, note: TimeNote, process: TaskId) -> None:
        """``process`` fired the timers of ``note`` and flushed their output: acknowledge it."""
        ...


class InBand:
    """``Progress`` of the aligned modes: markers and watermarks on every output channel."""

    __slots__ = ("out", "out_channels")

    in_band = True
    labels_batches = False

    def __init__(self, out: OutputBuffers, out_channels: list[int]) -> None:
        self.out = out
        self.out_channels = out_channels

    def flush(self, epoch: int, label: int, received: list[Batch], actions: list[TaskAction],
              only: list[int] | None = None) -> None:
        for ch, batch in self.out.drain(epoch, 0, only):
            actions.append(Send(ch, batch))
        if only is None:
            received.clear()  # nothing to account for: markers follow the batches in band

    def epoch_ended(self, epoch: int, now: float, source: TaskId | None, actions: list[TaskAction],
                    aligned: bool = False) -> None:
        marker = Marker(epoch, aligned)
        for ch in self.out_channels:
            actions.append(Send(ch, marker))

    def time_passed(self, label: int, now: float, source: TaskId | None, actions: list[TaskAction]) -> None:
        watermark = Watermark(label)  # behind the batches it covers, on every output channel
        for ch in self.out_channels:
            actions.append(Send(ch, watermark))

    def window_ended(self, note: TimeNote, process: TaskId) -> None:
        raise ProtocolError("InBand", "aligned mode", f"WindowEnd(label={note.label})",
                            f"task {process}: the aligned modes advance event time with watermarks")
