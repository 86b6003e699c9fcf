"""The epoch gate: what a task with input channels may process now, and when an epoch ends.

Theory of operation. A consuming task (``runtime.task.ConsumingTask``) keeps one FIFO mailbox of
(channel, message). For every message it takes out it asks its gate ``admits``; a refused
message is set aside (held, in arrival order) and goes back to the head of the mailbox
when the gate ends an epoch. The gate ends epochs in one of two ways, one per mode:

==================  ==========================================  ==============================
                    ``alignment.BarrierAligner`` (aligned)      ``tracker.FirmBoundGate``
==================  ==========================================  ==============================
refuses             any message on a channel whose marker n     a batch of an epoch after the
                    arrived, until n is aligned (exactly-once)  open one, until its NEOSS
ends epochs on      ``on_marker``: the last marker n arrived     ``on_neoss``: NEOSS(n) closes
                    -> (n, alignment seconds)                    open .. n, oldest first
the other entry     ``on_neoss`` raises ``ProtocolError``        ``on_marker`` raises
==================  ==========================================  ==============================

A third gate, ``alignment.UnalignedGate`` (unaligned mode), refuses nothing and
``overtakes``: the task scans its mailbox for markers and hands each to ``on_marker`` ahead
of the records queued before it; the first marker n starts epoch n's snapshot at once, and
the records still "before marker n" become its channel state (``ConsumingTask._overtake``, which asks the task's
``alignment.channel_state.ChannelStateRecorder``).

So the task never asks which mode it is in: markers go to ``on_marker``, notifications to
``on_neoss``, and a message the mode never carries is the gate's protocol error. The gate
only decides; the task holds the messages, snapshots and forwards.

Invariant both keep (checked by ``ConsumingTask.check_invariants``): ``open_epoch`` is the epoch of
the records the task processes now, and nothing is held unless ``holding``.
"""

from __future__ import annotations

from typing import Protocol

from .messages import Message


class Gate(Protocol):
    """One task's epoch gate (structural: the two gates do not import this class)."""

    @property
    def exactly_once(self) -> bool:
        """True: one epoch at a time (the task rejects a batch of another epoch)."""
        ...

    @property
    def open_epoch(self) -> int:
        """The epoch whose records are processed now (the last ended epoch + 1)."""
        ...

    @property
    def holding(self) -> bool:
        """True while the task may hold messages this gate refused (False: it holds none)."""
        ...

    @property
    def overtakes(self) -> bool:
        """True: the task hands markers over as soon as they are queued, ahead of the records
        before them (``alignment.UnalignedGate``; those records become channel state)."""
        ...

    @property
    def last_hold_seconds(self) -> float:
        """Seconds records were held before the last ``on_neoss`` (0.0 in the aligned modes)."""
        ...

    def admits(self, channel: int, message: Message, now: float) -> bool:
        """May ``message``, just taken from ``channel``, be processed now? False: hold it."""
        ...

    def on_marker(self, channel: int, epoch: int, now: float) -> tuple[int, float] | None:
        """Marker ``epoch`` was processed on ``channel``: (epoch, seconds aligning) once it ends."""
        ...

    def on_neoss(self, epoch: int, now: float) -> list[int]:
        """NEOSS(``epoch``) for the task's segment: the epochs it ends, oldest first."""
        ...

    def reset(self, last_completed: int) -> None:
        """Restart after a restore: every epoch <= ``last_completed`` has ended."""
        ...


class Overtaking(Gate, Protocol):
    """A gate that ``overtakes`` (unaligned mode): what the task's mailbox scan asks it."""

    def may_overtake(self, channel: int, epoch: int) -> bool:
        """May marker ``epoch``, queued on ``channel``, be taken now ahead of what is before it?"""
        ...

    def recording(self, channel: int) -> bool:
        """Are records processed now from ``channel`` channel state of the pending epoch?"""
        ...

    def on_marker(self, channel: int, epoch: int, now: float, overtook: int = 0) -> tuple[int, float] | None:
        """Marker ``epoch`` taken on ``channel``, having overtaken ``overtook`` messages at the
        sender: (epoch, 0.0) if it starts the epoch's snapshot."""
        ...

    def on_overtaken(self, channel: int) -> None:
        """One of the messages the marker of ``channel`` overtook at the sender was recorded."""
        ...

    @property
    def owed(self) -> dict[int, int]:
        """Channel -> messages its marker overtook at the sender, still to come."""
        ...

    def on_aligned_marker(self, channel: int, epoch: int, now: float,
                          forced: bool = True) -> tuple[int, float] | None:
        """A marker taken aligned in FIFO order (a savepoint's: ``forced``; or any, with an
        aligned timeout): block ``channel`` until every channel's marker ``epoch`` arrived;
        then (epoch, seconds aligning)."""
        ...

    def aligns(self, epoch: int) -> bool:
        """Aligned with a timeout: is marker ``epoch`` taken aligned (the epoch starts aligned)?"""
        ...

    @property
    def aligned_timeout(self) -> float | None:
        """Seconds an epoch may wait aligned before it switches (None: unaligned from the start)."""
        ...

    def announce(self, epoch: int, now: float) -> None:
        """A marker ``epoch`` is queued in the mailbox (aligned with a timeout: the clock starts)."""
        ...

    def switch_deadline(self) -> float | None:
        """When the alignment going on switches to unaligned (None: never)."""
        ...

    def switch(self, now: float) -> tuple[int, float] | None:
        """The alignment timed out: the epoch starts unaligned now; (epoch, seconds aligned)."""
        ...

    def take_completed(self) -> int | None:
        """The epoch whose channel state just became complete (its last marker was taken)."""
        ...
