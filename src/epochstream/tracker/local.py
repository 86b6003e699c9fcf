"""The local tracker: one per worker, folds SND/RCV events and flushes them to the agent.

Theory of operation. Every batch that crosses a channel has a random 64-bit id. The
sending process records ``snd(id, epoch, destination segment)`` when it emits the batch;
the receiving process records ``rcv(id, epoch, own segment)`` when it processes it. XOR is
associative and commutative, so the local tracker may fold any number of events of one
(segment, epoch) into one ``Report(segment, epoch, xor, snd, rcv)`` without losing
anything the agent needs (paper 000 §4.1, "local tracking agent"; FlameStream's
LocalAcker). ``poll(now)`` flushes when due: ``flush_count`` events recorded, or
``flush_interval`` passed since the last flush, or (with ``flush_on_promise``) a promise
waiting. ``flush(now)`` flushes now. A flush is one ``TrackerMessage``: one service
message on the wire.

With ``aggregate=False`` nothing is folded: every event (and every promise) becomes its
own message, and ``poll`` sends whatever is pending. That is the paper's "without
optimisation" curve.

The chain rule, and why folding keeps it. The agent's safety argument (agent.py) needs:
*the SND of an output batch reaches the agent no later than the RCV of the input batch
that caused it*. The process records ``snd`` of its outputs before ``rcv`` of the input
(the caller's duty: record the SNDs of a step's outputs, then the RCVs of the inputs it
processed; a poll between them is harmless, it only sends the SNDs earlier). The tracker
never reorders events across flushes: an event recorded before flush k goes out in
flush k or earlier, because a flush takes *everything* pending. So the SND lands either
in the same message
as the RCV (the agent applies a message atomically, so it never sees the RCV without the
SND) or in an earlier one (the link is FIFO and the agent checks ``seq``). Folding only
merges events that travel in the same message, so it cannot move a SND after a RCV.

Promises. ``promise(segment, n, now)`` says this source sends no more batches of epoch
<= n. It must reach the agent after the SNDs of the batches it covers, or the agent could
close epoch n downstream while one of them is unreported (the XOR of an empty slot is 0).
The tracker guarantees it: a promise is always sent in a flush that also carries (or
comes after) every event recorded before it, and the agent applies reports before
promises. With ``flush_on_promise`` (the default) a pending promise makes the tracker due
at once: notification latency starts at the promise. Without it a promise waits for the
next timed flush, as FlameStream's LocalAcker keeps a front's heartbeat until its 5 ms
ping: a source that ends an epoch per record then costs one message per flush interval,
not one per record (only the newest promise per source is kept; older ones are implied).
Without a ``flush_interval`` a promise must not wait for events that may never come, so
it stays urgent.

Free local hops. A batch sent and processed on the same worker between two flushes
folds to xor 0, snd == rcv; such a report tells the agent nothing and is dropped from the
flush. So recording local hops costs CPU, not messages; skipping them is *not* safe in
general (see the package docstring).

Dimensions. Events and promises name a dimension (epochs, or coarse time labels when
the pipeline uses event time); the tables are keyed by it and one flush carries both, so
the chain rule holds per dimension for the same reason it holds for one. ``confirm``
(a firing segment's process has emitted its timer output for label t) travels like a
promise: after the events recorded before it, and it makes the tracker due at once.

Sans-IO: no clocks (``now`` is an argument), no randomness (the ids come from the caller,
e.g. ``BatchIds``), no I/O.
"""

from __future__ import annotations

from typing import Generic, Hashable, Iterator, TypeVar

from ..runtime.errors import ProtocolError
from .messages import EPOCHS, MAX_ID, Confirm, Promise, Report, TrackerMessage

M = TypeVar("M")


class FlushSchedule(Generic[M]):
    """When a local tracker flushes (the epoch tracker here, the key tracker in keys.py): at
    once when ``urgent``, else after ``flush_count`` events or ``flush_interval`` since the
    last flush, and never with nothing pending. Subclasses keep the four fields up to date."""

    flush_interval: float | None
    flush_count: int | None
    last_flush: float
    pending_events: int

    def has_pending(self) -> bool:
        raise NotImplementedError

    def flush(self, now: float) -> list[M]:
        raise NotImplementedError

    def urgent(self) -> bool:
        return False

    def due(self, now: float) -> bool:
        if not self.has_pending():
            return False
        if self.urgent():
            return True
        if self.flush_count is not None and self.pending_events >= self.flush_count:
            return True
        return self.flush_interval is not None and now >= self.last_flush + self.flush_interval

    def next_deadline(self, now: float) -> float | None:
        """When ``poll`` will flush without new events (None: only new events can make it due)."""
        if self.due(now):
            return now
        if self.has_pending() and self.flush_interval is not None:
            return self.last_flush + self.flush_interval
        return None

    def poll(self, now: float) -> list[M]:
        """Flush if due; the driver sends each message, in order, on a FIFO link to the agent."""
        return self.flush(now) if self.due(now) else []


class LocalTracker(FlushSchedule[TrackerMessage]):
    """Folds SND/RCV events per (segment, epoch); flushes them as ``TrackerMessage``s."""

    def __init__(
        self,
        tracker_id: Hashable,
        *,
        aggregate: bool = True,
        flush_interval: float | None = 0.005,
        flush_count: int | None = 1000,
        now: float = 0.0,
        flush_on_promise: bool = True,
    ) -> None:
        if aggregate and flush_interval is None and flush_count is None:
            raise ValueError("LocalTracker: with aggregate=True set flush_interval or flush_count (or both)")
        if flush_interval is not None and flush_interval < 0:
            raise ValueError(f"LocalTracker: flush_interval must be >= 0, got {flush_interval}")
        if flush_count is not None and flush_count < 1:
            raise ValueError(f"LocalTracker: flush_count must be >= 1, got {flush_count}")
        self.id = tracker_id
        self.aggregate = aggregate
        self.flush_interval = flush_interval
        self.flush_count = flush_count
        #: a pending promise or confirmation flushes at once (else it rides the next timed flush)
        self.flush_on_promise = flush_on_promise or flush_interval is None
        #: aggregated mode: (segment, epoch, dim) -> [xor, snd, rcv], in first-event order
        self._slots: dict[tuple[int, int, int], list[int]] = {}
        #: non-aggregated mode: every event and promise, in recording order
        self._queue: list[Report | Promise | Confirm] = []
        #: aggregated mode: (segment, source, dim) -> newest pending promise (older ones are implied)
        self._promises: dict[tuple[int, Hashable, int], int] = {}
        #: (segment, process) -> newest pending confirmation (aggregated mode)
        self._confirms: dict[tuple[int, Hashable], int] = {}
        #: events recorded since the last flush (drives ``flush_count``)
        self.pending_events = 0
        self.last_flush = now
        #: sequence number of the next message; the agent requires 0, 1, 2, ... per tracker
        self.seq = 0
        #: newest promise per (segment, source, dim); promises must increase
        self._promised: dict[tuple[int, Hashable, int], int] = {}
        # statistics
        self.events = 0
        self.messages = 0

    # ------------------------------------------------------------ events in (buffer only)
    def snd(self, batch_id: int, epoch: int, segment: int, dim: int = EPOCHS) -> None:
        """A batch of ``epoch`` (a time label if ``dim`` is TIME) was emitted towards ``segment``."""
        self._record(batch_id, epoch, segment, True, dim)

    def rcv(self, batch_id: int, epoch: int, segment: int, dim: int = EPOCHS) -> None:
        """A batch of ``epoch`` was processed by a process of ``segment`` (its own)."""
        self._record(batch_id, epoch, segment, False, dim)

    def confirm(self, segment: int, label: int, process: Hashable) -> None:
        """``process`` handled WindowEnd(segment, label); record after the SNDs of its output."""
        if self.aggregate:
            self._confirms[(segment, process)] = label
        else:
            self._queue.append(Confirm(segment, label, process))

    def promise(self, segment: int, epoch: int, now: float, source: Hashable | None = None, dim: int = EPOCHS) -> None:
        """Source ``source`` (default: this tracker) of ``segment`` ends epoch ``epoch``.

        Record it after the SNDs of every batch of epoch <= ``epoch`` the source sent;
        it is sent in the next flush, after them.
        """
        src = self.id if source is None else source
        key = (segment, src, dim)
        last = self._promised.get(key)
        if last is not None and epoch <= last:
            raise ProtocolError(
                "LocalTracker", f"{self.id}: source {src!r} promised epoch {last}",
                f"promise(segment={segment}, epoch={epoch})", "promises must increase",
            )
        self._promised[key] = epoch
        if self.aggregate:
            self._promises[key] = epoch
        else:
            self._queue.append(Promise(segment, epoch, src, dim))

    # ------------------------------------------------------------ queries
    def has_pending(self) -> bool:
        return bool(self._slots or self._queue or self._promises or self._confirms or self.pending_events)

    def urgent(self) -> bool:
        """Every event without aggregation leaves at once; promises and confirmations too
        with ``flush_on_promise``."""
        if not self.aggregate:
            return True
        return self.flush_on_promise and (bool(self._promises) or bool(self._confirms))

    # ------------------------------------------------------------ flushing

    def flush(self, now: float) -> list[TrackerMessage]:
        """Flush everything pending now (one message, or one per event without aggregation)."""
        self.last_flush = now
        self.pending_events = 0
        out: list[TrackerMessage] = []
        if self.aggregate:
            reports = tuple(
                Report(seg, ep, x, s, r, dim) for (seg, ep, dim), (x, s, r) in self._slots.items() if x or s != r
            )
            promises = tuple(Promise(seg, ep, src, dim) for (seg, src, dim), ep in self._promises.items())
            confirms = tuple(Confirm(seg, label, proc) for (seg, proc), label in self._confirms.items())
            self._slots = {}
            self._promises = {}
            self._confirms = {}
            if reports or promises or confirms:
                out.append(TrackerMessage(self.id, self.seq, reports, promises, confirms))
                self.seq += 1
        else:
            for item in self._queue:
                if isinstance(item, Report):
                    out.append(TrackerMessage(self.id, self.seq, (item,), ()))
                elif isinstance(item, Promise):
                    out.append(TrackerMessage(self.id, self.seq, (), (item,)))
                else:
                    out.append(TrackerMessage(self.id, self.seq, (), (), (item,)))
                self.seq += 1
            self._queue = []
        self.messages += len(out)
        return out

    # ------------------------------------------------------------ internals
    def _record(self, batch_id: int, epoch: int, segment: int, is_snd: bool, dim: int) -> None:
        if not 0 < batch_id <= MAX_ID:
            raise ValueError(
                f"LocalTracker {self.id}: batch id {batch_id!r} is not in [1, 2**64): ids are random 64-bit")
        self.events += 1
        self.pending_events += 1
        if not self.aggregate:
            self._queue.append(Report(segment, epoch, batch_id, 1, 0, dim) if is_snd
                               else Report(segment, epoch, batch_id, 0, 1, dim))
            return
        slot = self._slots.get((segment, epoch, dim))
        if slot is None:
            self._slots[(segment, epoch, dim)] = [batch_id, 1, 0] if is_snd else [batch_id, 0, 1]
        else:
            slot[0] ^= batch_id
            slot[1 if is_snd else 2] += 1


class BatchIds:
    """Pseudo-random, non-zero 64-bit batch ids without ``random`` (sans-IO).

    SplitMix64 over a counter, from a 64-bit ``seed`` the driver draws per task and attempt
    from its (seeded) generator. The ids must look random: sequential ids would make XOR
    collisions common (1 ^ 2 ^ 3 == 0); SplitMix64's multiply-xorshift finaliser is a
    bijection with full avalanche, so distinct counters give distinct, well-mixed ids.
    Every seed starts somewhere on the same cycle of 2**64 counters, so two tasks share
    ids only if their starting points lie within the ids they draw: draw seeds at random
    (collision odds ~ ids * tasks / 2**64); never use seed and seed + 0x9E3779B97F4A7C15.

    >>> ids = BatchIds(seed=42)
    >>> a, b = next(ids), next(ids)
    >>> a != b and 0 < a < 2**64 and 0 < b < 2**64
    True
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & MAX_ID

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        while True:
            self._state = (self._state + 0x9E3779B97F4A7C15) & MAX_ID
            z = self._state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MAX_ID
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MAX_ID
            z ^= z >> 31
            if z:
                return z
