"""The firm-bound gate: the trAcker's counterpart of barrier alignment, for one task.

Theory of operation. The task's segment has been notified up to epoch ``closed`` (the
last NEOSS); its *open* epoch is ``closed + 1``. A record of the open epoch is admitted. A
record of a later epoch is *held*: processing it now would put epoch n+1 effects into
the snapshot of epoch n (paper 000 §3.2: "hold elements that do not belong to the
substream in the mailbox until NEOSS has arrived"). When NEOSS(n) arrives, epochs
``closed+1 .. n`` are closed: the task snapshots each, in order, and puts the held
records back at the head of its mailbox in arrival order; those of the new open epoch
run, later ones are held again. A record of an epoch <= ``closed`` contradicts the NEOSS
and raises ``ProtocolError``.

Why it is firm: NEOSS(s, n) is sent only after every record of epoch <= n destined to s
has been processed (its RCV applied at the agent; agent.py), and the gate lets nothing of
a later epoch run before it. So between the last record of epoch n and the snapshot of
n the task processes nothing: the snapshot is epoch-complete (the paper's eos_firm).
Why it cannot deadlock: NEOSS(s, n) waits only for records of epochs <= n, which the gate
admits (held records are all of epochs > n), and for upstream bounds, which by induction
over the topological order are reached the same way.

A NEOSS that jumps several epochs (n -> n+3) means those epochs brought this segment no
record at all (the agent can only pass an epoch once its records are processed, and the
gate held them); each still gets its own (empty) snapshot, because the coordinator waits
for an ack per epoch.

With ``firm=False`` (soft bound; at-least-once, window GC) every record is admitted and
``on_neoss`` only reports which epochs ended.

One of the two ``runtime.gate.Gate`` implementations (the other is
``alignment.BarrierAligner``): ``admits`` (a batch if ``admit`` says so; anything else
passes), ``holding``, ``open_epoch``, ``on_neoss``, ``reset``; a marker never travels in
tracker mode, so ``on_marker`` raises ``ProtocolError``. ``blocked`` and
``is_blocked(channel)`` (always False: the gate is per epoch, not per channel) remain for
callers that knew the aligner.

How ``runtime.task.ConsumingTask`` uses it: a ``Batch`` the gate does not admit is held; a NEOSS
is buffered and applied at the start of the next ``step``: every epoch ``on_neoss``
returns is snapshotted in order (no marker forwarded), then held records go back to the
head of the mailbox in arrival order.
``last_hold_seconds`` is reported where aligned mode reports the alignment time. An
admitted batch has epoch == open epoch == ``task.epoch``, so the task's epoch check holds.
"""

from __future__ import annotations

from typing import Hashable

from ..runtime.errors import ProtocolError
from ..runtime.messages import Batch, Message

MACHINE = "FirmBoundGate"


class FirmBoundGate:
    """Admits records of the open epoch; closes epochs on NEOSS."""

    #: ``Gate``: no markers in trAcker mode
    overtakes = False

    def __init__(self, segment: int | None = None, last_closed: int = 0, firm: bool = True) -> None:
        self.segment = segment
        self.firm = firm
        #: ``Task`` reads this to enforce one epoch at a time
        self.exactly_once = firm
        #: newest epoch closed by a NEOSS (or restored); only grows
        self.closed = last_closed
        #: True while the task holds records this gate refused (cleared by a NEOSS)
        self._holding = False
        #: time of the first refusal since the last NEOSS, if the caller passed ``now``
        self.held_since: float | None = None
        #: seconds records were held before the last NEOSS (alignment time's counterpart)
        self.last_hold_seconds = 0.0

    @property
    def open_epoch(self) -> int:
        return self.closed + 1

    @property
    def blocked(self) -> bool:
        return self._holding

    def is_blocked(self, channel: Hashable) -> bool:
        return False

    @property
    def holding(self) -> bool:
        return self._holding

    def admits(self, channel: int, message: Message, now: float) -> bool:
        """``Gate``: a batch if ``admit`` lets its epoch in; markers and watermarks never wait
        here (they never travel in tracker mode: ``on_marker`` rejects one)."""
        return type(message) is not Batch or self.admit(message.epoch, now)

    def on_marker(self, channel: int, epoch: int, now: float) -> tuple[int, float] | None:
        raise ProtocolError(MACHINE, f"segment {self.segment} closed up to {self.closed}", f"Marker({epoch})",
                            f"on channel {channel}: trAcker mode ends epochs with NEOSS; markers belong to the "
                            "aligned modes")

    def admit(self, epoch: int, now: float | None = None) -> bool:
        """May a record of ``epoch`` be processed now? False: the task holds it."""
        if epoch <= self.closed:
            raise ProtocolError(
                MACHINE, f"segment {self.segment} closed up to {self.closed}", f"admit(epoch={epoch})",
                "a record of a closed epoch arrived after its NEOSS",
            )
        if not self.firm or epoch == self.closed + 1:
            return True
        if not self._holding:
            self._holding = True
            self.held_since = now
        return False

    def on_neoss(self, epoch: int, now: float) -> list[int]:
        """NEOSS(epoch) arrived: return the epochs now closed, oldest first (snapshot each)."""
        if epoch <= self.closed:
            raise ProtocolError(
                MACHINE, f"segment {self.segment} closed up to {self.closed}", f"NEOSS({epoch})",
                "stale or duplicate notification (NEOSS must increase)",
            )
        closed = list(range(self.closed + 1, epoch + 1))
        self.closed = epoch
        self.last_hold_seconds = 0.0 if self.held_since is None else now - self.held_since
        self.held_since = None
        self._holding = False
        return closed

    def reset(self, last_completed: int) -> None:
        """Restart from a restored checkpoint: every epoch <= ``last_completed`` is closed."""
        self.closed = last_completed
        self._holding = False
        self.held_since = None
        self.last_hold_seconds = 0.0
