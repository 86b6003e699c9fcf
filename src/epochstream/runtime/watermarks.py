"""Per-split watermarks under bounded out-of-orderness (Flink's
``WatermarkStrategy.forBoundedOutOfOrderness(max_delay)``), and idleness.

Theory of operation. A split's watermark is ``max timestamp seen - max_delay``: the source
bets that no record of the split comes more than ``max_delay`` seconds behind the newest
one. Event time travels as coarse labels ``floor(ts / slack)`` (``runtime.eventtime``), so
the split's *label bound* is ``floor((max_ts - max_delay) / slack)``: the lowest label it
may still send. Every label below it is complete as far as the split goes.

A record whose label is below its split's bound when it is read is *late*: it is dropped
(and counted) at the source, before anything downstream could see it. That decision is a
pure function of the split's record sequence (the records before it, in offset order), so a
replay after a restore drops exactly the same records and the exactly-once oracle can
replay it (``oracle.Reference``). Flink instead judges lateness at each window operator
against that operator's watermark, which depends on how the channels interleave; it keeps
more records but the set it drops is not reproducible. Judging on labels never drops a
record that is within ``max_delay`` of the newest one (``label bound * slack <= max_ts -
max_delay``).

A split that brought no record for ``idleness`` seconds (Flink's ``withIdleness``) is
*idle*: it no longer holds the reader's watermark back, until it brings a record again.
When every split of a reader is idle, the idle splits that brought records decide (their
minimum), so a source whose partitions all went quiet still lets the windows of what it
read close; a split that never brought a record holds nothing back once idle. A record an
idle split brings may then be behind time the reader already promised; it is late too
(the reader drops it). Idleness depends on wall-clock time, so with idleness on the set of
late records is no longer reproducible, as in Flink.

A source built with ``late_records=OutputTag(...)`` (or a sink) keeps its late records
instead: the reader sends each one on, wrapped in ``LateRecord`` and labelled with the
split's current bound (a label nothing was promised for yet), and the two operators the API
puts behind the source split the wrapped records (the side output) from the others
(``runtime.sideoutput``: an Arrow batch holds none and passes the main output whole). They
are ordinary records from there on, in the epoch of the read, so a side output is as
exactly-once as the main one, and the rule above decides which records go there.

Sans-IO and pure: times come in as arguments.
"""

from __future__ import annotations

import math
from typing import Iterable

#: a split that saw no record yet: no timestamp bounds its labels
NO_TIMESTAMP = -math.inf


class LateRecord:
    """A record the late-record rule judged late, on its way to the source's side output
    (``late_records=OutputTag(...)``); the API's operators behind the source unwrap it."""

    __slots__ = ("record",)

    def __init__(self, record: object) -> None:
        self.record = record

    def __reduce__(self) -> tuple[type, tuple[object]]:
        return (LateRecord, (self.record,))

    def __eq__(self, other: object) -> bool:
        return type(other) is LateRecord and other.record == self.record

    def __hash__(self) -> int:
        return hash(("LateRecord", self.record))

    def __repr__(self) -> str:
        return f"LateRecord({self.record!r})"


class SplitWatermarks:
    """Max timestamp, label bound and idleness of the splits one source subtask reads."""

    __slots__ = ("slack", "max_delay", "idleness", "max_ts", "_bound", "_last_record", "late")

    def __init__(self, slack: float, max_delay: float, splits: Iterable[int],
                 restored: dict[int, float] | None = None, idleness: float | None = None) -> None:
        if not max_delay >= 0:
            raise ValueError(f"max_out_of_orderness must be >= 0 seconds, got {max_delay!r}")
        if idleness is not None and not idleness > 0:
            raise ValueError(f"idleness must be > 0 seconds or None, got {idleness!r}")
        self.slack = slack
        self.max_delay = max_delay
        self.idleness = idleness
        restored = restored or {}
        #: newest timestamp seen per split (``NO_TIMESTAMP``: none yet); only grows; restored
        #: from the manifest so a restore resumes the watermark where the epoch left it
        self.max_ts: dict[int, float] = {s: float(restored.get(s, NO_TIMESTAMP)) for s in splits}
        self._bound: dict[int, int] = {s: self._label_bound(t) for s, t in self.max_ts.items()}
        #: when each split last brought a record (idleness); None: not asked yet (the clock
        #: starts at the first question, so a split is active when the reader starts)
        self._last_record: dict[int, float | None] = dict.fromkeys(self.max_ts)
        #: records dropped as late, over the life of this object
        self.late = 0

    def _label_bound(self, max_ts: float) -> int:
        if max_ts == NO_TIMESTAMP:
            return 0  # timestamps are >= 0: label 0 may still come
        return max(0, math.floor((max_ts - self.max_delay) / self.slack))

    def add_split(self, split: int, max_ts: float | None = None) -> None:
        """A split added while running (a new Kafka partition), or restored later."""
        self.max_ts[split] = NO_TIMESTAMP if max_ts is None else float(max_ts)
        self._bound[split] = self._label_bound(self.max_ts[split])
        self._last_record[split] = None

    def bound(self, split: int) -> int:
        """The lowest time label ``split`` may still send."""
        return self._bound[split]

    def admit(self, split: int, ts: float, label: int, promised: int) -> bool:
        """A record of ``split`` with timestamp ``ts`` (label ``label``) was read: True if it
        goes on, False if it is late (below the split's bound, or at or below the label the
        reader already ``promised``); it is counted then.

        >>> w = SplitWatermarks(1.0, 2.0, [0])
        >>> [w.admit(0, t, int(t), -1) for t in (5.0, 3.5, 2.9, 9.0, 6.0, 7.2)]
        [True, True, False, True, False, True]
        """
        if label < self._bound[split] or label <= promised:
            self.late += 1
            return False
        if ts > self.max_ts[split]:
            self.max_ts[split] = ts
            self._bound[split] = self._label_bound(ts)
        return True

    def seen(self, split: int) -> bool:
        """``split`` brought a record (or was restored with a timestamp)."""
        return self.max_ts[split] != NO_TIMESTAMP

    def advance(self, split: int, max_ts: float, late: int) -> None:
        """What a reader's inlined ``admit`` loop found: the split's newest timestamp and how
        many records it dropped as late."""
        if max_ts > self.max_ts[split]:
            self.max_ts[split] = max_ts
            self._bound[split] = self._label_bound(max_ts)
        self.late += late

    def touched(self, split: int, now: float) -> None:
        """``split`` brought records at ``now`` (late ones too: it is not idle)."""
        self._last_record[split] = now

    def idle(self, split: int, now: float) -> bool:
        """No record for ``idleness`` seconds (never, without idleness)."""
        if self.idleness is None:
            return False
        last = self._last_record[split]
        if last is None:
            self._last_record[split] = now
            return False
        return now - last >= self.idleness

    def state(self) -> dict[int, float]:
        """Split -> max timestamp, for the manifest (splits that saw a record)."""
        return {s: t for s, t in self.max_ts.items() if t != NO_TIMESTAMP}
