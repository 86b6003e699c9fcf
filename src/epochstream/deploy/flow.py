"""Buffer debloating: in-flight data sized by time, not by count (Flink's buffer debloating).

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
