"""Unaligned epoch snapshots (Flink's unaligned checkpoints) for one task with input channels.

Theory of operation. A marker overtakes the records queued ahead of it. The task scans its
mailbox for markers (as Flink's input gate handles priority events) and hands each one it
takes out of order to this gate. The *first* marker n of a task starts epoch n's snapshot at
once: the task captures its state, forwards marker n and goes on in epoch n + 1, blocking
nothing. The records that are "before marker n" but not processed when the snapshot was
taken are the snapshot's *channel state*: on the first channel those queued ahead of the
marker, on every other channel those that arrive (are processed, or still queued) before
that channel's marker n. The task still processes them now, in epoch n + 1 (their effects
are not in the snapshot), and stores them with it; a restore replays them before any new
input. Epoch n's capture is complete once marker n has been taken on every channel.

So the snapshot of epoch n holds exactly the effects of the input before the cut minus the
channel state, and channel state plus later input is what a restore processes: nothing is
lost or counted twice, and no channel waits (alignment time 0).

A marker can overtake at the sender too: a driver whose link queues data waiting for credit
sends an unaligned marker ahead of it (``alignment.overtaking``) and says how many messages of
its channel it passed (``Marker.overtook``). Those arrive after the marker; the channel's state
is complete once they have (``owed``, ``on_overtaken``).

One epoch's channel state is recorded at a time: a marker n + 1 is taken only once epoch n's
capture is complete (``may_overtake``); until then it waits in the mailbox in FIFO order.

Aligned with a timeout (Flink's ``aligned-checkpoint-timeout``, ``aligned_timeout``): every
epoch starts aligned (markers in FIFO order, channels blocked as their marker arrives). The
clock starts when the task first *sees* a marker n in its mailbox (``announce``), wherever it
is queued, as Flink (1.14 on) announces a barrier to the receiver while it still waits behind
data: under backpressure every channel's marker may sit behind a queue, and an alignment
measured from the first marker at the head would never start. ``aligned_timeout`` seconds
later the task switches to unaligned for n (``switch``): it snapshots at once, the blocked
channels count as arrived (everything before their markers is processed), the held records
go back to the mailbox, the queued markers n overtake, and on the other channels the records
before marker n become channel state as above.

Savepoints (and final epochs: a stop with savepoint is one) are aligned, as in Flink: their
markers say so (``Marker.aligned``), are taken in
FIFO order and block their channel like ``BarrierAligner`` (``on_aligned_marker``), so a
savepoint has no channel state and can be restored at another parallelism.

This module only decides; the task scans, records and snapshots. It is one of the
``runtime.gate.Gate`` implementations: it admits everything, and a NEOSS never reaches it.
"""

from __future__ import annotations

from typing import Iterable

from ..runtime.errors import ProtocolError
from ..runtime.messages import Message

MACHINE = "UnalignedGate"


class UnalignedGate:
    """Which epoch's channel state is being recorded, and on which channels."""

    #: ``Gate``: nothing is held in an aligned epoch's wait
    last_hold_seconds = 0.0
    exactly_once = True
    #: the task scans its mailbox for markers and hands them over out of order
    overtakes = True

    def __init__(self, channels: Iterable[int], last_completed: int = 0,
                 aligned_timeout: float | None = None) -> None:
        self.channels = frozenset(channels)
        #: None: unaligned from the first marker; else epochs start aligned and switch after this long
        self.aligned_timeout = aligned_timeout
        #: the epoch aligning now is a savepoint's (forced aligned: it never switches)
        self.forced = False
        #: newest epoch whose snapshot was taken here (its first marker arrived)
        self.last_started = last_completed
        #: the epoch whose channel state is still being recorded (None: none)
        self.pending: int | None = None
        #: channels whose marker ``pending`` was taken
        self.arrived: set[int] = set()
        #: channel -> messages its marker overtook at the sender, not yet arrived
        self.owed: dict[int, int] = {}
        #: a pending epoch whose last marker arrived, not yet collected by ``take_completed``
        self._completed: int | None = None
        #: an aligned (savepoint) epoch: channels whose marker arrived (blocked) and since when
        self.blocked: set[int] = set()
        self.aligning_since = 0.0
        #: (epoch, when a marker of it was first seen queued) for the epoch aligning next
        self.announced: tuple[int, float] | None = None

    # ------------------------------------------------------------ Gate
    @property
    def open_epoch(self) -> int:
        return self.last_started + 1

    @property
    def holding(self) -> bool:
        return bool(self.blocked)

    def admits(self, channel: int, message: Message, now: float) -> bool:
        """Everything, except on a channel blocked by an aligned (savepoint) marker."""
        return channel not in self.blocked

    def on_neoss(self, epoch: int, now: float) -> list[int]:
        raise ProtocolError(MACHINE, f"started up to {self.last_started}", f"NEOSS({epoch})",
                            "unaligned mode ends epochs with markers; NEOSS belongs to trAcker mode")

    def reset(self, last_completed: int) -> None:
        self.last_started = last_completed
        self.pending = None
        self.arrived.clear()
        self.owed.clear()
        self._completed = None
        self.blocked.clear()
        self.announced = None

    def aligns(self, epoch: int) -> bool:
        """Is an (unforced) marker ``epoch`` taken aligned, in FIFO order? (aligned with a timeout)"""
        return self.aligned_timeout is not None and self.pending is None and self._completed is None

    def announce(self, epoch: int, now: float) -> None:
        """A (not forced) marker ``epoch`` is queued in the mailbox: the timeout runs from now."""
        if self.aligned_timeout is not None and self.announced is None and epoch == self.last_started + 1 \
                and self.pending is None and self._completed is None and not (self.blocked and self.forced):
            self.announced = (epoch, now)

    def _since(self) -> float | None:
        """When the epoch aligning next began to wait: its announcement, or its first blocked channel."""
        if self.forced and self.blocked:
            return None
        since = self.aligning_since if self.blocked else None
        if self.announced is not None and self.announced[0] == self.last_started + 1:
            since = self.announced[1] if since is None else min(since, self.announced[1])
        return since

    def switch_deadline(self) -> float | None:
        """When the epoch aligning now switches to unaligned (None: it never does)."""
        if self.aligned_timeout is None or self.pending is not None or self._completed is not None:
            return None
        since = self._since()
        return None if since is None else since + self.aligned_timeout

    def switch(self, now: float) -> tuple[int, float] | None:
        """If the alignment timed out: start its epoch unaligned now; (epoch, seconds waited)."""
        due = self.switch_deadline()
        if due is None or now < due:
            return None
        since = self._since()
        assert since is not None
        epoch = self.last_started + 1
        self.pending = self.last_started = epoch
        self.arrived = set(self.blocked)
        self.blocked.clear()
        self.announced = None
        return epoch, now - since

    def on_aligned_marker(self, channel: int, epoch: int, now: float,
                          forced: bool = True) -> tuple[int, float] | None:
        """A marker taken aligned, in FIFO order (a savepoint's: ``forced``, or any with a
        timeout): block ``channel``; (epoch, seconds aligning) once every channel's marker
        arrived (``alignment.BarrierAligner``'s rule)."""
        if channel not in self.channels or channel in self.blocked or epoch != self.last_started + 1 \
                or (self.pending is not None and channel not in self.arrived):
            state = f"aligning {sorted(self.blocked)}" if self.blocked else f"started up to {self.last_started}"
            raise ProtocolError(MACHINE, state, f"Marker({epoch}, aligned)", f"on channel {channel}")
        if not self.blocked:
            self.aligning_since = now
            self.forced = forced
        self.blocked.add(channel)
        if len(self.blocked) < len(self.channels):
            return None
        self.blocked.clear()
        self.last_started = epoch
        self.announced = None
        return epoch, now - self.aligning_since

    # ------------------------------------------------------------ overtaking
    def may_overtake(self, channel: int, epoch: int) -> bool:
        """May marker ``epoch`` on ``channel`` be taken now, ahead of what is queued before it?"""
        if self._completed is not None:
            return False
        if self.pending is not None:
            return epoch == self.pending and channel not in self.arrived
        return epoch == self.last_started + 1 and not self.blocked and self.aligned_timeout is None

    def recording(self, channel: int) -> bool:
        """Are records processed now from ``channel`` channel state of the pending epoch?"""
        return self.pending is not None and (channel not in self.arrived or channel in self.owed)

    def on_overtaken(self, channel: int) -> None:
        """A message the marker of ``channel`` overtook at the sender arrived (and was recorded)."""
        left = self.owed[channel] - 1
        if left:
            self.owed[channel] = left
        else:
            del self.owed[channel]
            self._check_complete()

    def _check_complete(self) -> None:
        if self.pending is not None and len(self.arrived) == len(self.channels) and not self.owed:
            self._completed = self.pending
            self.pending = None
            self.arrived.clear()

    def on_marker(self, channel: int, epoch: int, now: float, overtook: int = 0) -> tuple[int, float] | None:
        """Marker ``epoch`` taken on ``channel`` (having overtaken ``overtook`` messages at the
        sender): (epoch, 0.0) if it starts the epoch's snapshot."""
        if channel not in self.channels:
            raise ProtocolError(MACHINE, "recording", f"Marker({epoch})", f"unknown channel {channel}")
        if not self.may_overtake(channel, epoch):
            state = f"recording epoch {self.pending}, arrived on {sorted(self.arrived)}" if self.pending \
                else f"started up to {self.last_started}"
            raise ProtocolError(MACHINE, state, f"Marker({epoch})", f"on channel {channel}")
        started = self.pending is None
        if started:
            self.pending = epoch
            self.last_started = epoch
        self.arrived.add(channel)
        if overtook:
            self.owed[channel] = overtook
        self._check_complete()
        return (epoch, 0.0) if started else None

    def take_completed(self) -> int | None:
        """The epoch whose channel state became complete (every marker taken), once; else None."""
        done, self._completed = self._completed, None
        return done

    def check_invariants(self) -> None:
        assert self.pending is None or self.pending == self.last_started, "pending epoch is not the newest"
        assert self.arrived <= self.channels, "arrived on unknown channels"
        assert self.pending is not None or not self.arrived, "arrivals without a pending epoch"
        assert set(self.owed) <= self.arrived and all(n > 0 for n in self.owed.values()), "owed without arrival"
        assert self.blocked <= self.channels, "blocked unknown channels"
