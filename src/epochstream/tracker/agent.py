"""The tracking agent: from SND/RCV reports and promises to NEOSS, per segment.

Theory of operation. For every segment s the agent keeps a *bound* b(s): NEOSS(s, b(s))
has been sent, meaning no record of an epoch <= b(s) is in flight to s, and none will be.
It also keeps a table of *slots*: for each epoch e > b(s) that some report touched, the
XOR of the ids and the balance (#SND - #RCV) of all events of (s, e) received so far. A
slot that is back to (0, 0) is deleted, so "no slot" means "clear" (this is FlameStream's
ArrayAckTable, as a dict that holds only the non-clear epochs).

After applying a message the agent advances, in topological order, every segment that
may have changed:

    cap(s)  = min( b(u) for u in upstream(s) )  and  min( promise(src) for src of s )
    b(s)   := the largest n <= cap(s) such that every slot (s, e), b(s) < e <= n, is clear

and sends NEOSS(s, b(s)) when b(s) grows. A jump over several epochs is one NEOSS (it is
cumulative). Bounds only grow, so notifications are monotone per segment: the consistent
order of paper 000 §3.3 / §4.2, with the epoch as the ordered label t(M).

Assumptions (the callers' duties):

- (A1) a batch has the epoch of the input that caused it or a later one (never earlier);
  a source's batches have its current epoch, which only grows;
- (A2) chain rule: a process records SND of its outputs before RCV of the input that
  caused them; the local tracker keeps that order (local.py), the tracker -> agent link
  is FIFO (checked here with ``seq``) and a message is applied atomically;
- (A3) a source promises n after recording the SNDs of all its batches of epoch <= n,
  through the same local tracker, and sends no batch of epoch <= n afterwards;
- (A4) the ids of distinct batches are distinct, non-zero and random.

Safety. Claim: if the agent sets b(s) >= n at time T, every batch of epoch <= n destined
to s that is ever sent has both its SND and its RCV applied by T (so it was processed
before T, and no such batch is sent after T). By induction over the topological order:

1. *Batches from outside s.* A batch x into s from another segment comes from a source
   of s or from a process of an upstream segment u (upstream(s) holds every segment with
   an edge into s). From a source: b(s) >= n needed its promise >= n, applied before T,
   and by (A3) the SND of x was applied before that promise. From u: x was emitted while
   processing an input y of u, and by (A1) epoch(y) <= epoch(x) <= n. b(s) >= n needed
   b(u) >= n, set at some T' <= T; by induction RCV(y) was applied by T', and by (A2)
   SND(x) was applied no later than RCV(y). Either way SND(x) is applied by T.
2. *Batches from inside s (a cycle).* Let X be the batches of epoch <= n into s, sent at
   any time, whose SND or RCV is not applied by T. Every slot (s, e <= n) is clear at T,
   so the applied SNDs and RCVs pair up (up to a 2**-64 XOR collision, which the balance
   also guards) and each x in X has neither applied. Take x in X sent first. By (1) its
   sender is in s, and it emitted x while processing an input y of s with epoch(y) <= n
   (A1), sent before x. By (A2) RCV(y) is applied no earlier than SND(x), so not by T:
   y is in X and was sent before x. Contradiction, so X is empty.

The XOR-zero false positive. A slot with no events is clear, so "XOR == 0" alone would
close every epoch of every segment at once, before a single record moved. What makes a
clear slot mean "nothing in flight" is the cap: s may pass n only after all of its
producers have passed n (their bounds) or promised n (sources), and (1) shows that by
then every SND into s of epoch <= n has been applied, so an empty slot really is empty.
The cap is checked on every advance; the test suite drives the unflushed-SND case.

Protocol violations (``ProtocolError``, and the agent enters FAILED): a report for an
epoch <= b(s) (a record of a closed epoch: a broken promise, a chain-rule violation or a
duplicate report), a promise that does not increase or comes from an unknown source, an
unknown segment, a message out of ``seq`` order, an id or count out of range. The message
is validated whole before anything is applied, so the tables stay as they were.

Choices where the paper is silent:

- A segment's producers are its upstream segments *and* the sources registered for it;
  a segment with neither could never be bounded, and is refused at construction.
- Each source promises separately, and the cap takes the minimum over the sources of a
  segment (FlameStream: the minimum heartbeat over fronts).
- After a restore the agent is rebuilt with ``last_closed`` = the restored epoch; it
  keeps no state worth checkpointing (the paper leaves agent fault tolerance open).

Sans-IO: ``now`` is only passed through; the driver delivers NEOSS to the processes.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Mapping, Sequence

from ..runtime.errors import ProtocolError
from .messages import MAX_ID, NEOSS, NEOSS_WIRE, TrackerMessage
from .segments import Segmentation
from .traffic import NEOSS_KIND, PROMISE, REPORT, ServiceTraffic

MACHINE = "TrackingAgent"


class TrackingAgent:
    """Central agent: applies ``TrackerMessage``s, returns ``NEOSS`` actions."""

    def __init__(
        self,
        segmentation: Segmentation,
        promisers: Mapping[int, Iterable[Hashable]],
        *,
        last_closed: int = 0,
        processes: Mapping[int, Sequence[Hashable]] | None = None,
        traffic: ServiceTraffic | None = None,
    ) -> None:
        """``promisers[s]``: ids of the sources that promise epochs for segment s (every
        root segment needs at least one). ``processes[s]``: where a NEOSS for s goes (only
        for traffic accounting): the NEOSS of one step are bundled into one message per
        destination; default: one message per NEOSS.
        ``last_closed``: every epoch <= it counts as closed (a restored checkpoint)."""
        k = len(segmentation)
        self.segmentation = segmentation
        self._upstream: tuple[tuple[int, ...], ...] = tuple(tuple(sorted(u)) for u in segmentation.upstream)
        self._downstream: tuple[tuple[int, ...], ...] = tuple(tuple(sorted(d)) for d in segmentation.downstream)
        #: per segment: source -> newest promised epoch (last_closed before any promise)
        self._promised: list[dict[Hashable, int]] = [{} for _ in range(k)]
        for s, sources in promisers.items():
            if not 0 <= s < k:
                raise ValueError(f"TrackingAgent: promisers name segment {s}, but there are {k} segments")
            for src in sources:
                self._promised[s][src] = last_closed
        for s in range(k):
            if not self._upstream[s] and not self._promised[s]:
                raise ValueError(
                    f"TrackingAgent: segment {s} {list(segmentation.segments[s])} has no upstream segment and no "
                    f"promising source, so nothing could ever end its epochs"
                )
        self.processes = processes
        self.traffic = traffic if traffic is not None else ServiceTraffic()
        #: b(s): NEOSS(s, b(s)) sent; only grows
        self._bound: list[int] = [last_closed] * k
        #: per segment: epoch -> [xor, snd - rcv]; invariant: keys > b(s), values != [0, 0]
        self._slots: list[dict[int, list[int]]] = [{} for _ in range(k)]
        #: next expected ``seq`` per sender
        self._next_seq: dict[Hashable, int] = {}
        #: reason of the protocol violation that stopped the agent, or None
        self.failed: str | None = None

    # ------------------------------------------------------------ queries
    def bound(self, segment: int) -> int:
        return self._bound[segment]

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(self._bound)

    def in_flight(self, segment: int) -> dict[int, tuple[int, int]]:
        """Epochs of ``segment`` with unpaired events: epoch -> (xor, snd - rcv)."""
        return {e: (x, bal) for e, (x, bal) in sorted(self._slots[segment].items())}

    def cap(self, segment: int) -> int:
        """How far the producers of ``segment`` allow its bound to go."""
        caps = [self._bound[u] for u in self._upstream[segment]]
        caps.extend(self._promised[segment].values())
        return min(caps)

    # ------------------------------------------------------------ events
    def receive(self, message: TrackerMessage, now: float) -> list[NEOSS]:
        """Apply one flush of a local tracker; return the NEOSS it enables, in topological order."""
        if self.failed is not None:
            raise ProtocolError(MACHINE, "FAILED", f"TrackerMessage(from {message.sender!r})", self.failed)
        try:
            self._validate(message)
        except ProtocolError as exc:
            self.failed = str(exc)
            raise
        self._next_seq[message.sender] = message.seq + 1
        kind = REPORT if message.reports else PROMISE
        self.traffic.record(
            kind, message.sender, message.min_epoch, nbytes=message.nbytes,
            entries=len(message.reports) + len(message.promises),
        )
        dirty: set[int] = set()
        for r in message.reports:
            slots = self._slots[r.segment]
            slot = slots.get(r.epoch)
            if slot is None:
                slot = slots[r.epoch] = [0, 0]
            slot[0] ^= r.xor
            slot[1] += r.snd - r.rcv
            if slot[0] == 0 and slot[1] == 0:
                del slots[r.epoch]
                if r.epoch == self._bound[r.segment] + 1:
                    dirty.add(r.segment)
        for p in message.promises:
            self._promised[p.segment][p.source] = p.epoch
            dirty.add(p.segment)
        return self._advance(dirty, now)

    def check_invariants(self) -> None:
        """Every slot is open and non-clear, and no bound can advance any further."""
        for s, slots in enumerate(self._slots):
            b = self._bound[s]
            assert all(e > b for e in slots), f"segment {s}: a slot at or below bound {b}"
            assert all(v != [0, 0] for v in slots.values()), f"segment {s}: a clear slot is stored"
            assert b <= self.cap(s), f"segment {s}: bound {b} above its cap {self.cap(s)}"
            assert self._reach(s) == b, f"segment {s}: bound {b} could advance to {self._reach(s)}"

    # ------------------------------------------------------------ internals
    def _reach(self, s: int) -> int:
        """The largest bound the current tables justify for ``s``."""
        cap = self.cap(s)
        slots = self._slots[s]
        if slots:
            cap = min(cap, min(slots) - 1)
        return max(cap, self._bound[s])

    def _advance(self, dirty: set[int], now: float) -> list[NEOSS]:
        # Segments are numbered topologically and an advance only dirties later segments,
        # so one pass in increasing order sees every upstream change before its consumers.
        heap = list(dirty)
        heapq.heapify(heap)
        out: list[NEOSS] = []
        #: destination -> epochs notified to it in this step: one service message each
        bundles: dict[Hashable, list[int]] = {}
        last = -1
        while heap:
            s = heapq.heappop(heap)
            if s == last:
                continue
            last = s
            b = self._reach(s)
            if b <= self._bound[s]:
                continue
            self._bound[s] = b
            out.append(NEOSS(s, b))
            targets = self.processes.get(s, ()) if self.processes is not None else (("segment", s),)
            for p in targets:
                bundles.setdefault(p, []).append(b)
            for d in self._downstream[s]:
                heapq.heappush(heap, d)
        # the NEOSS of one step travel together: one message per destination, one entry each
        for p, epochs in bundles.items():
            self.traffic.record(NEOSS_KIND, p, min(epochs), nbytes=NEOSS_WIRE.size * len(epochs), entries=len(epochs))
        return out


    def _validate(self, m: TrackerMessage) -> None:
        expected = self._next_seq.get(m.sender, 0)
        if m.seq != expected:
            raise ProtocolError(
                MACHINE, f"expecting message {expected} from {m.sender!r}", f"TrackerMessage(seq={m.seq})",
                "the link from a local tracker must be FIFO and lossless",
            )
        k = len(self._bound)
        for r in m.reports:
            event = f"Report(segment={r.segment}, epoch={r.epoch}) from {m.sender!r}"
            if not (type(r.segment) is int and 0 <= r.segment < k):
                raise ProtocolError(MACHINE, "running", event, f"unknown segment (there are {k})")
            b = self._bound[r.segment]
            if r.epoch <= b:
                raise ProtocolError(
                    MACHINE, f"segment {r.segment} {list(self.segmentation.segments[r.segment])} notified up to {b}",
                    event, f"epoch {r.epoch} of segment {r.segment} is already closed: a record of a closed epoch "
                    "(broken promise, chain-rule violation or duplicate report)",
                )
            if not 0 <= r.xor <= MAX_ID or r.snd < 0 or r.rcv < 0:
                raise ProtocolError(MACHINE, "running", event, f"xor/snd/rcv out of range: {r}")
        pending: dict[tuple[int, Hashable], int] = {}
        for p in m.promises:
            event = f"Promise(segment={p.segment}, epoch={p.epoch}, source={p.source!r}) from {m.sender!r}"
            if not (type(p.segment) is int and 0 <= p.segment < k):
                raise ProtocolError(MACHINE, "running", event, f"unknown segment (there are {k})")
            promised = self._promised[p.segment]
            if p.source not in promised:
                raise ProtocolError(MACHINE, "running", event, f"not a source of segment {p.segment}")
            last = pending.get((p.segment, p.source), promised[p.source])
            if p.epoch <= last:
                raise ProtocolError(MACHINE, f"source {p.source!r} promised {last}", event, "promises must increase")
            pending[(p.segment, p.source)] = p.epoch
