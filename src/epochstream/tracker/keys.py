"""Per-key substreams: the trAcker tells when no in-flight message references a key (paper 000 §5.4).

The epoch tracker (local.py, agent.py) tracks one substream per (segment, epoch). Distributed
garbage collection needs a different predicate: pred_k(M) = "message M references key k", one
substream per key, over the whole dataflow (a cycle included). A key's state may leave memory
once the substream of k has ended: no message referencing k is in flight.

Reports (paper 000 §3.1, §4.1). Every message has a random 64-bit id. A process records
``snd(id, keys)`` for each message it emits, naming the keys the message references, and
``rcv(id, keys)`` for the message it processed, *after* the SNDs of the outputs that message
caused (the chain rule, as in local.py). ``LocalKeyTracker`` XOR-folds the events per key and
flushes them as one ``KeyMessage``: a ``KeyReport(key, xor, snd, rcv)`` for every key touched
since the last flush, *including keys whose events cancelled* (xor 0, snd == rcv). The epoch
tracker drops such slots; here they carry news: a message of k was sent and processed inside
one flush interval, so the agent, which may never have heard of k, must still say it ended.

The agent (``KeyTrackingAgent``) keeps per key the XOR of the ids and the balance #SND - #RCV
of every event applied so far, and deletes a key whose slot is back to (0, 0). After applying
a message it returns ``KeyFree(k, n)`` for every key the message touched whose slot is clear:
the n-th substream of k ended. There is no promise: a key's substream starts whenever some
process emits a message referencing k (``snd`` from a process whose input did not reference
k, or from an ingesting front), and it may start again after it ended; ``n`` counts them.

What ``KeyFree(k)`` guarantees. Under the chain rule and a FIFO tracker -> agent link, when the
agent emits KeyFree(k) every message of k that descends, through messages of k, from an SND
the agent has applied, has been processed: its SND and RCV pair up (an unpaired event keeps
the slot non-zero up to a 2**-64 XOR collision; the balance also guards reused ids), and a
child's SND is applied no later than its parent's RCV. A message of k still in flight is
then the start of a new substream of k whose first SND is not applied yet. That is the soft
bound of paper 000 §2.2.2: GC may drop k's state and load it again if k returns. State that
cannot be reloaded must not be dropped this way.

Sans-IO: ``now`` is an argument, ids come from the caller (``BatchIds``), no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Hashable, Iterable

from ..runtime.errors import ProtocolError
from .local import FlushSchedule
from .messages import HEADER_WIRE, MAX_ID

#: key hash (u64), xor (u64), snd count (u32), rcv count (u32)
KEY_REPORT_WIRE = struct.Struct("<QQII")
#: key hash (u64), substream number (u32)
KEY_FREE_WIRE = struct.Struct("<QI")

MACHINE = "KeyTrackingAgent"


@dataclass(frozen=True, slots=True)
class KeyReport:
    """SND/RCV events of messages referencing ``key``, XOR-folded at one local tracker."""

    key: Hashable
    xor: int
    snd: int
    rcv: int


@dataclass(frozen=True, slots=True)
class KeyMessage:
    """One flush of local key tracker ``sender``: its ``seq``-th message (0, 1, 2, ...)."""

    sender: Hashable
    seq: int
    reports: tuple[KeyReport, ...]

    @property
    def nbytes(self) -> int:
        return HEADER_WIRE.size + len(self.reports) * KEY_REPORT_WIRE.size


@dataclass(frozen=True, slots=True)
class KeyFree:
    """The ``substream``-th substream of ``key`` ended: no in-flight message references it."""

    key: Hashable
    substream: int


class LocalKeyTracker(FlushSchedule[KeyMessage]):
    """Folds per-key SND/RCV events of one process (or worker); flushes them as ``KeyMessage``s.

    Flushes when ``flush_count`` events were recorded or ``flush_interval`` passed since the
    last flush; a flush takes everything pending, so it never moves a SND after the RCV
    recorded after it (the chain rule survives folding, as in local.py).
    """

    def __init__(self, tracker_id: Hashable, *, flush_interval: float | None = 0.005,
                 flush_count: int | None = 1000, now: float = 0.0) -> None:
        if flush_interval is None and flush_count is None:
            raise ValueError("LocalKeyTracker: set flush_interval or flush_count (or both)")
        if flush_interval is not None and flush_interval < 0:
            raise ValueError(f"LocalKeyTracker: flush_interval must be >= 0, got {flush_interval}")
        if flush_count is not None and flush_count < 1:
            raise ValueError(f"LocalKeyTracker: flush_count must be >= 1, got {flush_count}")
        self.id = tracker_id
        self.flush_interval = flush_interval
        self.flush_count = flush_count
        #: key -> [xor, snd, rcv], in first-event order
        self._slots: dict[Hashable, list[int]] = {}
        self.pending_events = 0
        self.last_flush = now
        self.seq = 0
        self.events = 0
        self.messages = 0

    def snd(self, msg_id: int, keys: Iterable[Hashable]) -> None:
        """A message referencing ``keys`` was emitted (record before the RCV of its cause)."""
        self._record(msg_id, keys, 1)

    def rcv(self, msg_id: int, keys: Iterable[Hashable]) -> None:
        """A message referencing ``keys`` was processed (record after the SNDs it caused)."""
        self._record(msg_id, keys, 2)

    def has_pending(self) -> bool:
        return bool(self._slots)

    def flush(self, now: float) -> list[KeyMessage]:
        """Everything pending as one message (none if nothing is pending)."""
        self.last_flush = now
        self.pending_events = 0
        if not self._slots:
            return []
        msg = KeyMessage(self.id, self.seq, tuple(KeyReport(k, x, s, r) for k, (x, s, r) in self._slots.items()))
        self._slots = {}
        self.seq += 1
        self.messages += 1
        return [msg]

    def _record(self, msg_id: int, keys: Iterable[Hashable], column: int) -> None:
        if not 0 < msg_id <= MAX_ID:
            raise ValueError(f"LocalKeyTracker {self.id}: message id {msg_id!r} is not in [1, 2**64)")
        for key in keys:
            self.events += 1
            self.pending_events += 1
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = [0, 0, 0]
            slot[0] ^= msg_id
            slot[column] += 1


class KeyTrackingAgent:
    """Central agent for key substreams: applies ``KeyMessage``s, returns ``KeyFree`` notes."""

    def __init__(self) -> None:
        #: key -> [xor, snd - rcv]; invariant: values != [0, 0]
        self._slots: dict[Hashable, list[int]] = {}
        #: key -> number of its substreams that ended
        self._ended: dict[Hashable, int] = {}
        self._next_seq: dict[Hashable, int] = {}
        self.reports = 0
        self.messages = 0
        self.frees = 0
        self.failed: str | None = None

    def referenced(self, key: Hashable) -> bool:
        """True while the applied events of ``key`` do not pair up (a message of it is in flight)."""
        return key in self._slots

    @property
    def live_keys(self) -> int:
        return len(self._slots)

    def substreams_ended(self, key: Hashable) -> int:
        return self._ended.get(key, 0)

    def receive(self, msg: KeyMessage) -> list[KeyFree]:
        """Apply one flush atomically; the keys it touched that are now clear, in report order."""
        if self.failed is not None:
            raise ProtocolError(MACHINE, "FAILED", f"receive from {msg.sender!r}", self.failed)
        expected = self._next_seq.get(msg.sender, 0)
        if msg.seq != expected:
            self._fail(f"message seq {msg.seq} from {msg.sender!r}", f"expected seq {expected}: the link must be "
                       "FIFO and lossless")
        for r in msg.reports:
            if not (0 <= r.xor <= MAX_ID and r.snd >= 0 and r.rcv >= 0 and r.snd + r.rcv > 0):
                self._fail(f"report {r!r} from {msg.sender!r}", "xor must be 64-bit and counts non-negative, "
                           "not both zero")
        self._next_seq[msg.sender] = expected + 1
        self.messages += 1
        self.reports += len(msg.reports)
        free: list[KeyFree] = []
        for r in msg.reports:
            slot = self._slots.get(r.key)
            if slot is None:
                slot = self._slots[r.key] = [0, 0]
            slot[0] ^= r.xor
            slot[1] += r.snd - r.rcv
            if slot[0] == 0 and slot[1] == 0:
                del self._slots[r.key]
                n = self._ended[r.key] = self._ended.get(r.key, 0) + 1
                free.append(KeyFree(r.key, n))
        self.frees += len(free)
        return free

    def _fail(self, event: str, detail: str) -> None:
        self.failed = f"{event}: {detail}"
        raise ProtocolError(MACHINE, "RUNNING", event, detail)
