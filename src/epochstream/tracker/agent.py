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

Cost. At an epoch per record every source promises every epoch, and most of those promises
cannot move anything: cap(s) takes the minimum over the sources, which rises only when the
last source at the minimum promises. The agent keeps that minimum and how many sources sit on
it, and advances s on a promise only when the minimum rose (``skip_idle_promises``; the test
suite compares the notes with an agent that advances on every promise). Why skipping is
exact: after every message b(s) equals the largest bound the tables justify, so a message
that changes neither cap(s) nor the slot at b(s) + 1 cannot move b(s).

Event time: a second dimension. When the pipeline fires event-time timers, every batch
also carries a coarse time label (paper 000 §4.2) and the agent keeps a second, identical
table over labels: sources promise labels as they read, a segment's time bound says no
record with a label <= t will reach it. Non-firing segments need no message for it. A
*firing* segment (one whose operators have timers) gets ``WindowEnd(s, t)`` and then emits
output that no input caused, which the two safety arguments above do not cover. Two
mechanisms put it back under them:

- *Confirmation (time).* Downstream of a firing segment s the cap uses ``confirmed(s)``,
  the smallest label every process of s has confirmed, instead of b(s). A process records
  the SNDs of its timer output (labelled t), then ``Confirm(s, t)``; the local tracker sends
  them in that order, so when d's cap reaches t those SNDs are applied: the timer output
  is a batch "from an upstream segment" in argument (1), with confirmation as its RCV.
- *Epoch token (epochs).* The timer output joins the epoch its process is in. When the agent
  sends ``WindowEnd`` it SNDs one random token per process into epoch slot (s, e), e = b(s)+1
  of the epoch table, and the process RCVs its token after the SNDs of its output. Slot
  (s, e) is not clear until then, so b(s) < e, so no downstream bound reaches e before
  those SNDs are applied: argument (1) again, with the token as the causing input. The
  process is in epoch e when the WindowEnd arrives: the agent-to-process link is FIFO, so
  NEOSS(s, e-1) came first, and NEOSS(s, e) cannot come before the token is back.

A WindowEnd is sent for label t only once the firing segment's time bound reaches t, so the
first rule needs no upstream help; the final epoch of a bounded job must wait until every
firing segment has confirmed ``END_OF_TIME`` (``time_finished``), or timer output would
land in an epoch after the last one.

Sans-IO: ``now`` is only passed through; the driver delivers NEOSS to the processes.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Mapping, NoReturn, Sequence

from ..runtime.errors import ProtocolError
from ..runtime.messages import END_OF_TIME
from .local import BatchIds
from .messages import (
    CONFIRM_WIRE,
    EPOCHS,
    HEADER_WIRE,
    MAX_ID,
    NEOSS,
    NEOSS_WIRE,
    PROMISE_WIRE,
    REPORT_WIRE,
    TIME,
    WINDOW_END_WIRE,
    AgentNote,
    Promise,
    TrackerMessage,
    WindowEnd,
)
from .segments import Segmentation
from .traffic import NEOSS_KIND, PROMISE, REPORT, ServiceTraffic

MACHINE = "TrackingAgent"
#: ``TrackerMessage.nbytes``'s layouts, read once
_HEADER_BYTES, _REPORT_BYTES = HEADER_WIRE.size, REPORT_WIRE.size
_PROMISE_BYTES, _CONFIRM_BYTES = PROMISE_WIRE.size, CONFIRM_WIRE.size


class _Dimension:
    """The agent's table for one dimension (epochs, or time labels)."""

    __slots__ = ("dim", "bound", "slots", "promised", "floor", "at_floor")

    def __init__(self, dim: int, k: int, last_closed: int, promisers: Mapping[int, Iterable[Hashable]]) -> None:
        self.dim = dim
        #: b(s): notified (or, for time in non-firing segments, known) up to b(s); only grows
        self.bound: list[int] = [last_closed] * k
        #: per segment: label -> [xor, snd - rcv]; invariant: keys > b(s), values != [0, 0]
        self.slots: list[dict[int, list[int]]] = [{} for _ in range(k)]
        #: per segment: source -> newest promised label (last_closed before any promise)
        self.promised: list[dict[Hashable, int]] = [{} for _ in range(k)]
        for s, sources in promisers.items():
            for src in sources:
                self.promised[s][src] = last_closed
        #: per segment: min(promised[s].values()), None without sources; the cap's share from the
        #: sources, kept so that a promise by a source above the minimum costs no advance
        self.floor: list[int | None] = [last_closed if p else None for p in self.promised]
        #: per segment: how many sources promised exactly ``floor`` (the minimum moves when none is left)
        self.at_floor: list[int] = [len(p) for p in self.promised]

    def promise(self, s: int, source: Hashable, label: int) -> bool:
        """Apply a (validated) promise; True when it raised the minimum over ``s``'s sources,
        the only way a promise can raise cap(s)."""
        promised = self.promised[s]
        old = promised[source]
        promised[source] = label
        if old != self.floor[s]:
            return False
        left = self.at_floor[s] - 1
        if left:
            self.at_floor[s] = left
            return False
        values = list(promised.values())
        low = self.floor[s] = min(values)
        self.at_floor[s] = values.count(low)
        return True


class TrackingAgent:
    """Central agent: applies ``TrackerMessage``s, returns ``NEOSS`` (and ``WindowEnd``) notes."""

    #: advance a segment on a promise only when the promise raised the minimum over its sources
    #: (the cap cannot move otherwise); False: advance on every promise, the reference the tests
    #: compare the shortcut with
    skip_idle_promises: bool = True

    def __init__(
        self,
        segmentation: Segmentation,
        promisers: Mapping[int, Iterable[Hashable]],
        *,
        last_closed: int = 0,
        processes: Mapping[int, Sequence[Hashable]] | None = None,
        traffic: ServiceTraffic | None = None,
        firing: Mapping[int, Sequence[Hashable]] | None = None,
        token_seed: int = 0x5EED,
    ) -> None:
        """``promisers[s]``: ids of the sources that promise epochs for segment s (every
        root segment needs at least one). ``processes[s]``: where a NEOSS for s goes (only
        for traffic accounting): the NEOSS of one step are bundled into one message per
        destination; default: one message per NEOSS.
        ``last_closed``: every epoch <= it counts as closed (a restored checkpoint).
        ``firing``: segment -> its processes, for segments whose operators fire event-time
        timers; given (even empty) it turns the time dimension on, and the same sources
        promise time labels."""
        k = len(segmentation)
        self.segmentation = segmentation
        self._upstream: tuple[tuple[int, ...], ...] = tuple(tuple(sorted(u)) for u in segmentation.upstream)
        self._downstream: tuple[tuple[int, ...], ...] = tuple(tuple(sorted(d)) for d in segmentation.downstream)
        for s in promisers:
            if not 0 <= s < k:
                raise ValueError(f"TrackingAgent: promisers name segment {s}, but there are {k} segments")
        self._dims = [_Dimension(EPOCHS, k, last_closed, promisers)]
        for s in range(k):
            if not self._upstream[s] and not self._dims[0].promised[s]:
                raise ValueError(
                    f"TrackingAgent: segment {s} {list(segmentation.segments[s])} has no upstream segment and no "
                    f"promising source, so nothing could ever end its epochs"
                )
        #: firing segment -> process -> newest confirmed time label
        self._confirmed: dict[int, dict[Hashable, int]] = {}
        if firing is not None:
            self._dims.append(_Dimension(TIME, k, -1, promisers))
            for s, procs in firing.items():
                if not 0 <= s < k or not procs:
                    raise ValueError(f"TrackingAgent: firing segment {s} must exist and have processes")
                self._confirmed[s] = {p: -1 for p in procs}
        self._tokens = BatchIds(token_seed)
        self.processes = processes
        self.traffic = traffic if traffic is not None else ServiceTraffic()
        #: next expected ``seq`` per sender
        self._next_seq: dict[Hashable, int] = {}
        #: reason of the protocol violation that stopped the agent, or None
        self.failed: str | None = None

    # ------------------------------------------------------------ queries
    def bound(self, segment: int, dim: int = EPOCHS) -> int:
        return self._dims[dim].bound[segment]

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(self._dims[EPOCHS].bound)

    def in_flight(self, segment: int, dim: int = EPOCHS) -> dict[int, tuple[int, int]]:
        """Labels of ``segment`` with unpaired events: label -> (xor, snd - rcv)."""
        return {e: (x, bal) for e, (x, bal) in sorted(self._dims[dim].slots[segment].items())}

    def confirmed(self, segment: int) -> int:
        """The newest time label every process of firing ``segment`` has handled."""
        return min(self._confirmed[segment].values())

    def cap(self, segment: int, dim: int = EPOCHS) -> int:
        """How far the producers of ``segment`` allow its bound to go."""
        d = self._dims[dim]
        cap = d.floor[segment]
        bound = d.bound
        for u in self._upstream[segment]:
            b = self.confirmed(u) if dim == TIME and u in self._confirmed else bound[u]
            if cap is None or b < cap:
                cap = b
        assert cap is not None, "the constructor refuses a segment with neither upstream nor sources"
        return cap

    def time_finished(self) -> bool:
        """Every firing segment has handled the end of time (bounded input is all in)."""
        return all(self.confirmed(s) >= END_OF_TIME for s in self._confirmed)

    # ------------------------------------------------------------ events
    def receive(self, message: TrackerMessage, now: float) -> list[AgentNote]:
        """Apply one flush of a local tracker; return the notes it enables, in topological order."""
        if self.failed is not None:
            raise ProtocolError(MACHINE, "FAILED", f"TrackerMessage(from {message.sender!r})", self.failed)
        try:
            self._validate(message)
        except ProtocolError as exc:
            self.failed = str(exc)
            raise
        self._next_seq[message.sender] = message.seq + 1
        reports, promises, confirms = message.reports, message.promises, message.confirms
        dims = self._dims
        #: per dimension, the segments to advance; made on the first one (most promises need none)
        dirty: list[set[int]] | None = None
        #: the oldest epoch the message carries (``TrackerMessage.min_epoch``), found on the way
        low: int | None = None
        for r in reports:
            epoch, seg, dim = r.epoch, r.segment, r.dim
            if dim == EPOCHS and (low is None or epoch < low):
                low = epoch
            d = dims[dim]
            slots = d.slots[seg]
            slot = slots.get(epoch)
            if slot is None:
                slot = slots[epoch] = [r.xor, r.snd - r.rcv]
            else:
                slot[0] ^= r.xor
                slot[1] += r.snd - r.rcv
            if not slot[0] and not slot[1]:
                del slots[epoch]
                if epoch == d.bound[seg] + 1:
                    if dirty is None:
                        dirty = [set() for _ in dims]
                    dirty[dim].add(seg)
        full = not self.skip_idle_promises
        for p in promises:
            # a promise from a source above its segment's minimum leaves the cap, so the bound, as it is
            if dims[p.dim].promise(p.segment, p.source, p.epoch) or full:
                if dirty is None:
                    dirty = [set() for _ in dims]
                dirty[p.dim].add(p.segment)
            if p.dim == EPOCHS and (low is None or p.epoch < low):
                low = p.epoch
        for c in confirms:
            self._confirmed[c.segment][c.process] = c.label
            if dirty is None:
                dirty = [set() for _ in dims]
            dirty[TIME].update(self._downstream[c.segment])
        n_r, n_p, n_c = len(reports), len(promises), len(confirms)
        self.traffic.record(
            REPORT if n_r else PROMISE, message.sender, low,
            nbytes=_HEADER_BYTES + n_r * _REPORT_BYTES + n_p * _PROMISE_BYTES + n_c * _CONFIRM_BYTES,
            entries=n_r + n_p + n_c,
        )
        if dirty is None:
            return []
        return self._advance(dirty, now)

    def check_invariants(self) -> None:
        """Every slot is open and non-clear, and no bound can advance any further."""
        for d in self._dims:
            for s, slots in enumerate(d.slots):
                b = d.bound[s]
                assert all(e > b for e in slots), f"dim {d.dim} segment {s}: a slot at or below bound {b}"
                assert all(v != [0, 0] for v in slots.values()), f"dim {d.dim} segment {s}: a clear slot is stored"
                assert b <= self.cap(s, d.dim), f"dim {d.dim} segment {s}: bound {b} above its cap {self.cap(s, d.dim)}"
                assert self._reach(s, d.dim) == b, f"dim {d.dim} segment {s}: bound {b} could advance"
                values = list(d.promised[s].values())
                floor = min(values) if values else None
                assert (d.floor[s], d.at_floor[s]) == (floor, sum(v == floor for v in values)), \
                    f"dim {d.dim} segment {s}: kept minimum promise {d.floor[s]} x{d.at_floor[s]}, is {floor}"
        for s, procs in self._confirmed.items():
            assert max(procs.values()) <= self._dims[TIME].bound[s], f"segment {s}: confirmed beyond its bound"

    # ------------------------------------------------------------ internals
    def _reach(self, s: int, dim: int = EPOCHS) -> int:
        """The largest bound the current tables justify for ``s``."""
        cap = self.cap(s, dim)
        slots = self._dims[dim].slots[s]
        if slots:
            cap = min(cap, min(slots) - 1)
        return max(cap, self._dims[dim].bound[s])

    def _advance(self, dirty: list[set[int]], now: float) -> list[AgentNote]:
        # Segments are numbered topologically and an advance only dirties later segments,
        # so one pass in increasing order sees every upstream change before its consumers.
        # Epochs go first: a WindowEnd names the epoch after the segment's epoch bound,
        # and must follow the NEOSS of that bound on the FIFO link to the process.
        out: list[AgentNote] = []
        #: per note of this step: where it goes and its (epoch or None, bytes)
        sent: list[tuple[Sequence[Hashable], tuple[int | None, int]]] = []
        for d in self._dims:
            heap = list(dirty[d.dim])
            heapq.heapify(heap)
            last = -1
            while heap:
                s = heapq.heappop(heap)
                if s == last:
                    continue
                last = s
                b = self._reach(s, d.dim)
                if b <= d.bound[s]:
                    continue
                d.bound[s] = b
                if d.dim == EPOCHS:
                    note: AgentNote = NEOSS(s, b)
                    size = NEOSS_WIRE.size
                elif s in self._confirmed:
                    note = self._window_end(s, b)
                    size = WINDOW_END_WIRE.size
                else:
                    # nobody in s acts on time: the bound only feeds the caps downstream
                    for t in self._downstream[s]:
                        heapq.heappush(heap, t)
                    continue
                out.append(note)
                targets = self.processes.get(s, ()) if self.processes is not None else (("segment", s),)
                if targets:  # a source segment's NEOSS goes nowhere
                    sent.append((targets, (b if d.dim == EPOCHS else None, size)))
                if d.dim == EPOCHS or s not in self._confirmed:
                    for t in self._downstream[s]:
                        heapq.heappush(heap, t)
        if sent:
            self._account(sent)
        return out

    def _account(self, sent: list[tuple[Sequence[Hashable], tuple[int | None, int]]]) -> None:
        """The notes of one step travel together: one message per destination, one entry per note.
        When every note goes to the same processes (every segment runs on every worker), all of
        them get the same message, so it is counted once for all (the per-step cost at fine
        granularity was this accounting, once per destination)."""
        first = sent[0][0]
        if all(targets is first or targets == first for targets, _ in sent):
            groups: list[tuple[Sequence[Hashable], list[tuple[int | None, int]]]] = [(first, [e for _, e in sent])]
        else:
            bundles: dict[Hashable, list[tuple[int | None, int]]] = {}
            for targets, entry in sent:
                for p in targets:
                    bundles.setdefault(p, []).append(entry)
            groups = [((p,), entries) for p, entries in bundles.items()]
        for targets, entries in groups:
            epochs = [e for e, _ in entries if e is not None]
            self.traffic.record_each(NEOSS_KIND, targets, min(epochs) if epochs else None,
                                     nbytes=sum(n for _, n in entries), entries=len(entries))

    def _window_end(self, s: int, label: int) -> WindowEnd:
        """WindowEnd for firing segment ``s``, with one epoch token per process SNDed now."""
        epochs = self._dims[EPOCHS]
        e = epochs.bound[s] + 1
        tokens = tuple((p, next(self._tokens)) for p in self._confirmed[s])
        slot = epochs.slots[s].setdefault(e, [0, 0])
        for _p, token in tokens:
            slot[0] ^= token
            slot[1] += 1
        if slot == [0, 0]:
            del epochs.slots[s][e]
        return WindowEnd(s, label, e, tokens)

    def _validate(self, m: TrackerMessage) -> None:
        expected = self._next_seq.get(m.sender, 0)
        if m.seq != expected:
            raise ProtocolError(
                MACHINE, f"expecting message {expected} from {m.sender!r}", f"TrackerMessage(seq={m.seq})",
                "the link from a local tracker must be FIFO and lossless",
            )
        k = len(self._dims[EPOCHS].bound)
        n_dims = len(self._dims)
        dims = self._dims
        for r in m.reports:  # the common case first, cheaply: a report is checked once per flush entry
            seg, dim = r.segment, r.dim
            if type(seg) is int and 0 <= seg < k and 0 <= dim < n_dims and r.epoch > dims[dim].bound[seg] \
                    and 0 <= r.xor <= MAX_ID and r.snd >= 0 and r.rcv >= 0:
                continue
            event = f"Report(segment={r.segment}, epoch={r.epoch}, dim={r.dim}) from {m.sender!r}"
            if not (type(r.segment) is int and 0 <= r.segment < k):
                raise ProtocolError(MACHINE, "running", event, f"unknown segment (there are {k})")
            if not 0 <= r.dim < n_dims:
                raise ProtocolError(MACHINE, "running", event, "unknown dimension (is event time on?)")
            b = self._dims[r.dim].bound[r.segment]
            if r.epoch <= b:
                what = "epoch" if r.dim == EPOCHS else "time label"
                raise ProtocolError(
                    MACHINE, f"segment {r.segment} {list(self.segmentation.segments[r.segment])} notified up to {b}",
                    event, f"{what} {r.epoch} of segment {r.segment} is already closed: a record of a closed {what} "
                    "(broken promise, chain-rule violation or duplicate report)",
                )
            raise ProtocolError(MACHINE, "running", event, f"xor/snd/rcv out of range: {r}")
        promises = m.promises
        pending: dict[tuple[int, Hashable, int], int] | None = None
        for p in promises:  # as for reports: the common case cheaply, the reason only on a failure
            seg, dim, src = p.segment, p.dim, p.source
            if type(seg) is int and 0 <= seg < k and 0 <= dim < n_dims:
                last = dims[dim].promised[seg].get(src)
                if last is not None:
                    if pending is not None:
                        last = pending.get((seg, src, dim), last)
                    if p.epoch > last:
                        if len(promises) > 1:  # a later promise of the same message must exceed this one
                            if pending is None:
                                pending = {}
                            pending[(seg, src, dim)] = p.epoch
                        continue
            self._refuse_promise(m, p, pending or {})
        for c in m.confirms:
            event = f"Confirm(segment={c.segment}, label={c.label}, process={c.process!r}) from {m.sender!r}"
            procs = self._confirmed.get(c.segment)
            if procs is None or c.process not in procs:
                raise ProtocolError(MACHINE, "running", event, "not a process of a firing segment")
            if not procs[c.process] < c.label <= self._dims[TIME].bound[c.segment]:
                raise ProtocolError(
                    MACHINE, f"{c.process!r} confirmed {procs[c.process]}, bound {self._dims[TIME].bound[c.segment]}",
                    event, "a confirmation must increase and answer a WindowEnd that was sent",
                )

    def _refuse_promise(self, m: TrackerMessage, p: Promise,
                        pending: Mapping[tuple[int, Hashable, int], int]) -> NoReturn:
        """Raise the ``ProtocolError`` that promise ``p`` of ``m`` deserves (``_validate`` found it bad)."""
        k, n_dims = len(self._dims[EPOCHS].bound), len(self._dims)
        event = f"Promise(segment={p.segment}, epoch={p.epoch}, source={p.source!r}, dim={p.dim}) from {m.sender!r}"
        if not (type(p.segment) is int and 0 <= p.segment < k):
            raise ProtocolError(MACHINE, "running", event, f"unknown segment (there are {k})")
        if not 0 <= p.dim < n_dims:
            raise ProtocolError(MACHINE, "running", event, "unknown dimension (is event time on?)")
        promised = self._dims[p.dim].promised[p.segment]
        if p.source not in promised:
            raise ProtocolError(MACHINE, "running", event, f"not a source of segment {p.segment}")
        last = pending.get((p.segment, p.source, p.dim), promised[p.source])
        raise ProtocolError(MACHINE, f"source {p.source!r} promised {last}", event, "promises must increase")
