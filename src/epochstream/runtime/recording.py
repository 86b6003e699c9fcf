"""What a consuming task asks of unaligned mode's channel-state recorder.

A consuming task (``runtime.task.ConsumingTask``) holds a recorder only in unaligned mode
(and aligned with a timeout), where its gate ``overtakes``; in the other modes it holds None.
The recorder (``alignment.channel_state.ChannelStateRecorder``) decides which queued markers
are taken early and records the channel state of the pending epoch; the task scans, pushes
records into its chain and captures. The task never imports the recorder's module (runtime
sits below alignment), so this ``Protocol`` is the task's view of it.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Any, Protocol

from .messages import Batch, Marker, Message, Snapshot, TaskCapture


class AtHead(Enum):
    """What the task does with a marker that reached the head of its mailbox (unaligned mode)."""

    #: take it now, as an overtaking marker with nothing queued ahead of it
    OVERTAKE = "overtake"
    #: put it back at the head: it waits for the pending epoch's channel state to complete
    WAIT = "wait"
    #: take it aligned, in FIFO order (a savepoint's marker, or any with an aligned timeout)
    ALIGN = "align"


class Recorder(Protocol):
    """Unaligned mode's part of one consuming task: markers taken early, channel state recorded."""

    #: a marker arrived since the last scan of the mailbox (or an epoch's capture completed)
    scan: bool
    #: the message cut by the step budget: (channel, batch, rows done), or None
    cursor: tuple[int, Batch, int] | None

    def switch_deadline(self) -> float | None:
        """When an alignment going on switches to unaligned (None: never)."""
        ...

    def switch(self, now: float) -> tuple[int, float] | None:
        """The alignment timed out: (epoch, seconds aligned) to snapshot now, else None."""
        ...

    def begin(self, capture: TaskCapture) -> None:
        """The pending epoch's capture was taken: its channel state starts empty."""
        ...

    def scan_mailbox(self, mailbox: deque[tuple[int, Message]], now: float) -> list[tuple[int, Message]]:
        """The mailbox's items for ``next_overtaking`` (the scan flag is cleared)."""
        ...

    def next_overtaking(self, items: list[tuple[int, Message]]) -> tuple[int, Marker, list[Message]] | None:
        """Remove the first marker that may be taken now from ``items``: (channel, marker, the
        messages of its channel queued ahead of it), or None."""
        ...

    def take(self, channel: int, marker: Marker, now: float) -> int | None:
        """Marker taken early on ``channel``: the epoch whose snapshot it starts, or None."""
        ...

    def taken(self, channel: int, marker: Marker, ahead: list[Message]) -> Snapshot | None:
        """Record what ``marker`` passed; the completed capture if it was the last one."""
        ...

    def processed(self, channel: int, msg: Message) -> Snapshot | None:
        """A batch or watermark about to be processed: channel state if its channel records;
        the completed capture if it was the last message owed."""
        ...

    def at_head(self, channel: int, marker: Marker) -> AtHead:
        """What to do with ``marker``, at the head of the mailbox."""
        ...

    def on_aligned_marker(self, channel: int, marker: Marker, now: float) -> tuple[int, float] | None:
        """A marker taken aligned: (epoch, seconds aligning) once every channel's arrived."""
        ...

    def cut(self, channel: int, msg: Batch) -> None:
        """``msg`` does not fit the step's budget: it becomes the cursor."""
        ...

    def next_rows(self, budget: int) -> tuple[int, Any, Any]:
        """Up to ``budget`` (at least one) more rows of the cursor: (channel, records, keys)."""
        ...

    def check_invariants(self) -> None:
        ...
