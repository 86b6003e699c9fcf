"""Flow control between workers: a credit window per link, backpressure per worker, buffer debloating.

Sans-IO: every object here takes events (and, where it matters, the time) and returns a
decision or a ``deploy.protocol`` link message to send; none holds a lock, a thread or a
clock. ``deploy.worker`` drives them from its loop and its links' sender threads, and
``deploy.sim`` drives the same objects on its virtual network (``SimConfig.flow``).

Theory of operation. Rules, one object each:

1. **Credits (per link, ``SendWindow`` and ``ReceiveWindow``).** A sender has at most
   ``window`` data envelopes the receiver has not yet credited back; the rest wait in the
   link's queue. The receiver counts the envelopes it delivered into its mailboxes and hands
   them back as one ``Credit`` once half a window is owed, unless its mailboxes (work it can
   do now) are long (``Pressure.withholds_credit``): a slow receiver stops its senders
   instead of having its memory filled.
2. **Control first.** ``Credit``, ``Backpressure`` and ``PriorityMarker`` leave ahead of the
   data waiting for credit and need none, so they are never stuck behind it.
3. **Overtaking (unaligned mode).** A marker joining a link's queue leaves ahead of it as a
   ``PriorityMarker`` (``alignment.overtaking``).
4. **Pressure (per worker, ``Pressure``).** A worker whose backlog (mailboxes, held messages,
   envelopes queued for its peers) goes over ``high`` messages, or with debloating holds more
   rows than its consuming tasks get through in the target's seconds, tells its peers; its
   sources stop reading while it or any peer is over, and resume once it is under ``low``
   (and a quarter of the row bound). This bounds what alignment holds back.

Why loops cannot deadlock on either. A worker never blocks: a link queues envelopes without
limit while it waits for credit, so a task's step always completes. Mailboxes always drain
(a blocked channel's messages move to ``held``, which credit ignores), so withheld credit
always comes back and a marker behind data always gets through. Only sources are
throttled; a loop head is not a source, and the phantom channel (loop tail -> head) is a
hand-over inside one worker, so a loop's feedback keeps moving while the sources pause,
and it drains (ARCHITECTURE.md §6a). ``tests/test_flow.py`` checks this on the simulator
with cycles, small windows and random schedules.

Buffer debloating (``Debloater``).

Why. A worker throttles the sources while its backlog (rows in its mailboxes, held by an
epoch gate, or queued for its peers) is over a bound. A bound in messages lets the queue in
front of a slow operator hold minutes of work when batches are large or the operator is
slow, and an epoch's marker (aligned) or NEOSS (trAcker) waits behind all of it: epochs grow
with the queue, the top complaint of Flink users under backpressure. Sized by time, the
bound is what the worker's consuming tasks get through in ``target`` seconds, so a marker
waits about ``target`` seconds behind a full queue however slow the operator is.

How. The throughput is measured as Flink's debloater measures it: rows consumed per second
of *work* (the loop's busy time of the consuming tasks, ``runtime.meters``), not per second
of wall time, so a worker that idles because the sources are throttled does not read its
own throttling as a slow operator and shrink the bound further. The estimate is an
exponential average over periods of at least ``period`` seconds with some work in them. The
bound never goes below ``floor`` rows (one source read, ``Pipeline.batch_rows``), which is
also its value until the first measurement, and is only ever tighter than the worker's
message bound, which stays.

Why reads are not shrunk (Flink shrinks its buffers, not only their number). A read is the
smallest unit throttling can stop, so the queue is at least a read long whatever the target.
Shrinking reads to fit the target was tried: it made a row pipeline's epochs 4x shorter, and
a keyed pandas function 12x slower, since its cost is per key per batch: smaller batches
measured as a slower operator, which shrank the reads again. The batch size stays the user's
(``batch_rows``: latency against throughput, docs/OPERATIONS.md).

Sans-IO: ``observe`` takes the counters and the time; ``limit`` answers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..alignment.overtaking import Envelope, overtake
from ..runtime.errors import ProtocolError
from .protocol import Backpressure, Credit, PriorityMarker

#: data envelopes a sender may have outstanding per link
WINDOW = 16
#: backlog (messages) over which a worker throttles the sources, and under which it resumes
HIGH_WATERMARK = 32
LOW_WATERMARK = 8
#: mailbox messages at or above which a receiver keeps the credits it owes
CREDIT_HOLD = 64
#: seconds between two counts of the backlog's rows (debloating)
ROWS_EVERY = 0.005

MACHINE = "flow"


@dataclass(frozen=True, slots=True)
class FlowLimits:
    """The bounds of flow control (a worker uses the defaults; ``SimConfig.flow`` sets its own)."""

    #: data envelopes a sender may have outstanding per link (>= 1)
    window: int = WINDOW
    #: backlog in messages: pressure turns on above ``high`` and off below ``low`` (1 <= low <= high:
    #: with low = 0 pressure would never turn off, the backlog is never below 0)
    high: int = HIGH_WATERMARK
    low: int = LOW_WATERMARK
    #: mailbox messages at or above which a receiver keeps the credit it owes (>= 1)
    hold: int = CREDIT_HOLD

    def __post_init__(self) -> None:
        if self.window < 1 or self.hold < 1 or not 1 <= self.low <= self.high:
            raise ValueError(f"flow limits need window >= 1, hold >= 1 and 1 <= low <= high, got {self}")


class SendWindow:
    """The sender side of one link: its queues and its credit; ``next_envelope`` says what
    leaves next (rules 1-3). The driver writes what it returns to the connection.

    Invariant: ``credit`` + data envelopes handed out and not yet credited back == ``window``.
    """

    def __init__(self, window: int = WINDOW, overtake: bool = False) -> None:
        self.window = window
        #: data envelopes that may leave before the receiver hands credit back (0 .. window)
        self.credit = window
        #: unaligned mode: markers leave ahead of the queued data (``alignment.overtaking``)
        self.overtake = overtake
        #: data envelopes waiting for credit, oldest first
        self.data: deque[Envelope] = deque()
        #: link messages waiting for nothing but the connection, oldest first
        self.control: deque[Any] = deque()

    def queue_data(self, envelope: Envelope) -> Envelope:
        """Queue a data envelope; returns what joined the data queue (its overtaking markers
        left it for the control queue; empty: nothing joined)."""
        if self.overtake:
            envelope, ahead = overtake(self.data, envelope)
            for channel, marker in ahead:
                self.control.append(PriorityMarker(channel, marker))
        if envelope:
            self.data.append(envelope)
        return envelope

    def queue_control(self, message: Any) -> None:
        """Queue a link message (``deploy.protocol.ON_LINKS``): it needs no credit."""
        self.control.append(message)

    def on_credit(self, credit: Credit) -> None:
        """The receiver credited back ``credit.envelopes`` data envelopes."""
        n = credit.envelopes
        if n < 1 or self.credit + n > self.window:
            raise ProtocolError(MACHINE, f"credit {self.credit} of {self.window}", f"Credit({n})",
                                "the peer credited back envelopes it was never sent")
        self.credit += n

    def next_envelope(self) -> tuple[Any, bool] | None:
        """What leaves now and whether it is data (it takes one credit): a control message
        first, else the oldest data envelope if there is credit; None: nothing may leave."""
        if self.control:
            return self.control.popleft(), False
        if self.data and self.credit > 0:
            self.credit -= 1
            return self.data.popleft(), True
        return None

    @property
    def stalled(self) -> bool:
        """Data waits for credit."""
        return self.credit <= 0 and bool(self.data)


class ReceiveWindow:
    """The receiver side of one link: data envelopes delivered and not yet credited back,
    handed back half a window at a time (one ``Credit`` per half window, not one per envelope).

    Invariant: 0 <= ``owed`` <= ``window`` (a sender that exceeds its window is a protocol error).
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.batch = max(1, window // 2)
        self.owed = 0

    def on_data(self) -> None:
        """A data envelope of this link was delivered into its tasks' mailboxes."""
        if self.owed >= self.window:
            raise ProtocolError(MACHINE, f"owed {self.owed} of {self.window}", "data envelope",
                                "the peer sent beyond its credit window")
        self.owed += 1

    def grant(self) -> Credit | None:
        """The credit to hand back now (call it only while the worker does not withhold credit)."""
        if self.owed < self.batch:
            return None
        n, self.owed = self.owed, 0
        return Credit(n)


class Pressure:
    """One worker's backpressure: hysteresis over its backlog, and its peers' signals (rule 4).

    The driver reports the backlog with ``on_backlog`` (and with debloating, the rows in it
    with ``on_rows`` whenever ``count_rows`` says so: counting rows walks the mailboxes) and
    sends a ``Backpressure`` it returns to every peer; it passes its peers' signals to
    ``on_signal``. Its sources read only while not ``throttled``.
    """

    def __init__(self, high: int = HIGH_WATERMARK, low: int = LOW_WATERMARK, hold: int = CREDIT_HOLD,
                 rows_every: float = ROWS_EVERY) -> None:
        self.high, self.low, self.hold = high, low, hold
        #: seconds between two counts of the backlog's rows (debloating)
        self.rows_every = rows_every
        #: this worker is over its bound (and told its peers so)
        self.pressured = False
        #: peers that said they are over theirs
        self.peers: set[int] = set()
        #: the last count of the backlog's rows: over the row bound, under a quarter of it, and
        #: the mailboxes alone over it (then credit is withheld); reset while the backlog is empty
        self.rows_over = False
        self.rows_under = True
        self.inbound_over = False
        self._rows_at = 0.0

    @property
    def throttled(self) -> bool:
        """Sources must not read: this worker or a peer is over its bound."""
        return self.pressured or bool(self.peers)

    def on_signal(self, peer: int, signal: Backpressure) -> None:
        (self.peers.add if signal.on else self.peers.discard)(peer)

    def count_rows(self, now: float, backlog: int) -> bool:
        """Debloating: is a count of the backlog's rows due (then call ``on_rows``)?"""
        return backlog > 0 and now - self._rows_at >= self.rows_every

    def on_rows(self, now: float, inbound: int, total: int, limit: int) -> None:
        """Rows in the mailboxes (``inbound``) and in the whole backlog, against the row bound."""
        self._rows_at = now
        self.rows_over, self.rows_under = total > limit, total < limit // 4
        self.inbound_over = inbound > limit

    def on_backlog(self, backlog: int) -> Backpressure | None:
        """The backlog in messages: the signal for the peers if pressure turned on or off."""
        if not backlog:
            self.rows_over, self.rows_under, self.inbound_over = False, True, False
        if not self.pressured and (backlog > self.high or self.rows_over):
            self.pressured = True
        elif self.pressured and backlog < self.low and self.rows_under:
            self.pressured = False
        else:
            return None
        return Backpressure(self.pressured)

    def withholds_credit(self, mailbox: int) -> bool:
        """Keep the credit owed while the mailboxes hold ``mailbox`` messages? Only the
        mailboxes count: they always drain, so withheld credit always comes back."""
        return self.inbound_over or mailbox >= self.hold


#: seconds of in-flight data the bound allows by default (Flink: buffer-debloat.target, 1 s)
DEFAULT_TARGET = 1.0


class Debloater:
    """The backlog bound, in rows, of one worker's consuming tasks."""

    def __init__(self, target: float, floor: int, period: float = 0.2, min_busy: float = 0.02,
                 smoothing: float = 0.3) -> None:
        if not target > 0:
            raise ValueError(f"the debloating target must be seconds > 0, got {target!r}")
        self.target = target
        self.floor = max(1, floor)
        self.period = period
        self.min_busy = min_busy
        self.smoothing = smoothing
        #: rows consumed per busy second (None until the first period with work)
        self.throughput: float | None = None
        self._mark: tuple[float, int, float] | None = None  # (time, rows, busy seconds) at the period's start

    def observe(self, now: float, rows: int, busy: float) -> None:
        """Cumulative ``rows`` consumed and ``busy`` seconds worked by the consuming tasks."""
        if self._mark is None:
            self._mark = (now, rows, busy)
            return
        t0, r0, b0 = self._mark
        if now - t0 < self.period:
            return
        worked = busy - b0
        if worked < self.min_busy:  # idle: nothing to learn about the consumers' speed
            self._mark = (now, rows, busy) if rows == r0 else (t0, r0, b0)
            return
        rate = max(0, rows - r0) / worked
        self.throughput = rate if self.throughput is None else (
            self.smoothing * rate + (1 - self.smoothing) * self.throughput)
        self._mark = (now, rows, busy)

    def rows_in(self, seconds: float, most: int, unmeasured: int | None = None) -> int:
        """Rows the consumers get through in ``seconds`` (1 .. ``most``; ``unmeasured``, by
        default ``most``, until the first measurement)."""
        if self.throughput is None:
            return most if unmeasured is None else unmeasured
        return max(1, min(most, int(self.throughput * seconds)))

    def limit(self) -> int:
        """Rows the backlog may hold: ``floor`` until the first measurement (a job starts with
        a short queue and lets it grow to the target, never the other way round: a queue filled
        before the first measurement would take its own length to drain)."""
        if self.throughput is None:
            return self.floor
        return max(self.floor, int(self.throughput * self.target))
