"""The Kafka transactions of one exactly-once sink subtask: which producer holds which epoch.

Theory of operation. Each sink subtask owns a small pool of transactional producers (*slots*,
transactional ids ``<prefix><uid>-<subtask>-<slot>``). At pre-commit the subtask stages the
epoch's messages durably and produces them into a transaction of a free slot, left open
(``Produce``). When the job master has written the manifest of epoch n it tells every subtask
(``completed(n)``), and the subtask commits, in epoch order, every epoch up to n it holds
(``Commit``): epochs whose own checkpoint was aborted commit with the next completed one, as
their staged output does. Each commit carries a *marker*: the epoch, as the offset of the
transactional id's consumer group on partition 0 of the topic, committed atomically with the
records. A slot is free again once its transaction is committed.

Slots let epoch n+1 be produced while epoch n waits for its manifest (concurrent epochs, and
the notice racing the next epoch's records). When every slot holds an open transaction the
epoch is *deferred*: only staged, and produced and committed in one go when its epoch
completes (``ProduceCommit``), so a subtask never waits for a notice. A one-go commit runs on
the *spare* producer (slot ``slots``), which never holds a transaction between two calls, so it
is always free. (A transaction the broker aborted before its commit, its timeout passed, is
produced again on its own slot by the sink at once: it is an I/O outcome, not bookkeeping.)

Invariants (``check``): an epoch is held at most once (open in one slot, or deferred); every
held epoch is newer than ``committed``; pre-commits come in increasing epoch order.

Recovery reads the markers: because a subtask commits in epoch order, the largest marker over
its slots is the newest epoch Kafka committed for it, and every staged epoch after that one
is produced again from its staged file (``to_reproduce``). ``init_transactions`` of each slot
first aborts what an earlier attempt left open and fences its producers.

Sans-IO: events in, actions out; ``backends.kafka.sink`` and the simulator's model carry them out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from ...runtime.errors import ProtocolError

#: open transactions per sink subtask: one epoch can wait for its commit while the next is
#: produced (plus the spare producer of one-go commits)
SLOTS = 2

_STAGED = re.compile(r"/e(\d+)-s(\d+)-a[^/]+\.msgs$")


@dataclass(frozen=True, slots=True)
class Produce:
    """Begin a transaction on ``slot``'s producer and produce ``epoch``'s messages into it."""

    slot: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Commit:
    """Add the marker ``epoch`` to ``slot``'s open transaction and commit it."""

    slot: int
    epoch: int


@dataclass(frozen=True, slots=True)
class ProduceCommit:
    """A deferred epoch: begin on ``slot``, produce ``epoch``'s messages, add its marker, commit."""

    slot: int
    epoch: int


Action = Produce | Commit | ProduceCommit


def transactional_id(prefix: str, uid: str, subtask: int, slot: int) -> str:
    """The transactional id of slot ``slot`` of sink ``uid``'s subtask ``subtask`` (also its
    marker's consumer group)."""
    return f"{prefix}{uid}-{subtask}-{slot}"


@dataclass
class SubtaskTransactions:
    """The pool of one sink subtask; see the module docstring."""

    slots: int = SLOTS
    #: the newest epoch Kafka committed for this subtask (restored, then each ``Commit``)
    committed: int = -1
    #: slot -> the epoch whose transaction is open on it
    open: dict[int, int] = field(default_factory=dict)
    #: epochs staged but not produced (every slot was busy), oldest first
    deferred: list[int] = field(default_factory=list)
    #: the newest epoch pre-committed (pre-commits come in epoch order)
    last: int = -1

    def staged(self, epoch: int) -> list[Action]:
        """Epoch ``epoch``'s messages are staged: produce them into a free slot, or defer."""
        if epoch <= self.last or epoch <= self.committed:
            raise ProtocolError("SubtaskTransactions", f"last={self.last} committed={self.committed}", "staged",
                                f"epoch {epoch} is not newer than the epochs already held or committed")
        self.last = epoch
        free = self._free()
        if free is None:
            self.deferred.append(epoch)
            return []
        self.open[free] = epoch
        return [Produce(free, epoch)]

    def completed(self, upto: int) -> list[Action]:
        """Epoch ``upto``'s manifest exists: commit every held epoch up to it, oldest first."""
        held = sorted([(e, s) for s, e in self.open.items() if e <= upto] +
                      [(e, None) for e in self.deferred if e <= upto])
        out: list[Action] = []
        for epoch, slot in held:
            if slot is None:
                self.deferred.remove(epoch)
                out.append(ProduceCommit(self.spare, epoch))
            else:
                del self.open[slot]
                out.append(Commit(slot, epoch))
            self.committed = epoch
        return out

    @property
    def spare(self) -> int:
        """The slot of one-go commits (``ProduceCommit``); producers per subtask: ``slots + 1``."""
        return self.slots

    def _free(self) -> int | None:
        for s in range(self.slots):
            if s not in self.open:
                return s
        return None

    def check(self) -> None:
        """The invariants of the module docstring."""
        held = list(self.open.values()) + self.deferred
        assert len(held) == len(set(held)), f"an epoch is held twice: {held}"
        assert all(e > self.committed for e in held), f"held epochs {held} not after committed {self.committed}"
        assert all(0 <= s < self.slots for s in self.open), f"slots {sorted(self.open)} outside 0..{self.slots - 1}"


def staged_epoch_subtask(rel: str) -> tuple[int, int]:
    """(epoch, subtask) of a staged file name ``.../e<epoch>-s<subtask>-a<attempt>.msgs``."""
    m = _STAGED.search("/" + rel)
    if m is None:
        raise ValueError(f"not a staged Kafka sink file: {rel!r}")
    return int(m.group(1)), int(m.group(2))


def to_reproduce(staged: Iterable[str], committed: dict[int, int]) -> dict[int, list[tuple[int, str]]]:
    """The staged files Kafka lacks, per subtask, oldest first: those of epochs after the
    subtask's newest committed epoch (``committed``: subtask -> epoch; -1 or absent: none)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for rel in staged:
        epoch, subtask = staged_epoch_subtask(rel)
        if epoch > committed.get(subtask, -1):
            out.setdefault(subtask, []).append((epoch, rel))
    for files in out.values():
        files.sort()
    return out
