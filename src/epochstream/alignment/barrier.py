"""Epoch alignment for one task with input channels (thesis Algorithm 6).

Theory of operation. Every input channel carries marker n exactly once, after all records
of epochs <= n on that channel (FIFO). In *exactly-once* mode, a channel whose marker n
has arrived is *blocked*: its later messages belong to epoch n+1 and must wait, so the
task finishes epoch n from the other channels first. When marker n has arrived on every
channel the task is *aligned*: it snapshots, forwards marker n, and unblocks all
channels. The snapshot then holds exactly the effects of epochs <= n (epoch-complete).

In *at-least-once* mode nothing is blocked; the snapshot is taken when the last marker n
arrives, so it may include records of epoch n+1 that are replayed after a rollback.

This module only decides; the task holds the blocked messages. It is one of the two
``runtime.gate.Gate`` implementations: a NEOSS never reaches it (``on_neoss`` raises).
"""

from __future__ import annotations

from typing import Iterable

from ..runtime.errors import ProtocolError
from ..runtime.messages import Message

MACHINE = "BarrierAligner"


class BarrierAligner:
    """Which channels are blocked, and when an epoch is aligned."""

    #: ``Gate``: nothing is held waiting for a notification in the aligned modes
    last_hold_seconds = 0.0
    #: ``Gate``: markers are taken in FIFO order (``alignment.unaligned`` takes them early)
    overtakes = False

    def __init__(self, channels: Iterable[int], exactly_once: bool = True) -> None:
        self.channels = frozenset(channels)
        self.exactly_once = exactly_once
        #: epoch -> channels whose marker for it has arrived; invariant (exactly-once):
        #: at most one epoch is open, and its channels are exactly ``blocked``
        self.arrived: dict[int, set[int]] = {}
        self.blocked: set[int] = set()
        #: time the first marker of each open epoch arrived (alignment duration metric)
        self.started: dict[int, float] = {}
        #: last aligned epoch; markers must come in increasing order
        self.last_aligned = 0

    def is_blocked(self, channel: int) -> bool:
        return channel in self.blocked

    # ------------------------------------------------------------ Gate
    @property
    def open_epoch(self) -> int:
        return self.last_aligned + 1

    @property
    def holding(self) -> bool:
        return bool(self.blocked)

    def admits(self, channel: int, message: Message, now: float) -> bool:
        """Everything on a blocked channel waits (records, markers and watermarks alike)."""
        return channel not in self.blocked

    def on_neoss(self, epoch: int, now: float) -> list[int]:
        raise ProtocolError(MACHINE, f"aligned up to {self.last_aligned}", f"NEOSS({epoch})",
                            "the aligned modes end epochs with markers; NEOSS belongs to trAcker mode")

    def on_marker(self, channel: int, epoch: int, now: float) -> tuple[int, float] | None:
        """Record marker ``epoch`` on ``channel``; return (epoch, alignment seconds) once aligned."""
        if channel not in self.channels:
            raise ProtocolError(MACHINE, "aligning", f"Marker({epoch})", f"unknown channel {channel}")
        if epoch <= self.last_aligned:
            raise ProtocolError(
                MACHINE, f"aligned up to {self.last_aligned}", f"Marker({epoch})", f"stale marker on channel {channel}"
            )
        if self.exactly_once:
            if channel in self.blocked:
                raise ProtocolError(MACHINE, "blocked", f"Marker({epoch})", f"channel {channel} is blocked")
            open_epochs = [e for e in self.arrived if e != epoch]
            if open_epochs:
                raise ProtocolError(
                    MACHINE, f"aligning epoch {open_epochs[0]}", f"Marker({epoch})", f"on channel {channel}"
                )
            if epoch != self.last_aligned + 1:
                raise ProtocolError(
                    MACHINE, f"aligned up to {self.last_aligned}", f"Marker({epoch})", "epoch skipped"
                )
        seen = self.arrived.setdefault(epoch, set())
        if channel in seen:
            raise ProtocolError(MACHINE, f"aligning epoch {epoch}", f"Marker({epoch})", f"duplicate on {channel}")
        if not seen:
            self.started[epoch] = now
        seen.add(channel)
        if self.exactly_once:
            self.blocked.add(channel)
        if len(seen) < len(self.channels):
            return None
        del self.arrived[epoch]
        self.blocked.clear()
        self.last_aligned = epoch
        return epoch, now - self.started.pop(epoch)

    def reset(self, last_completed: int) -> None:
        self.arrived.clear()
        self.blocked.clear()
        self.started.clear()
        self.last_aligned = last_completed
