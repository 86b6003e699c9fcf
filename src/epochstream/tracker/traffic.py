"""Service-traffic accounting: how many control messages (and bytes) a mode costs.

The paper's Figure 10 compares modes by the number of service messages; this module counts
them and their bytes per kind, per epoch and per process. ``ServiceTraffic`` is a plain
counter both modes can feed: the tracking agent records every ``TrackerMessage`` it receives
and every NEOSS it sends; an aligned-mode driver records its markers.

Kinds (choose one per message, so totals never double count):

- ``report``: a local tracker's flush holding at least one report (it may carry promises);
  without aggregation, one per SND/RCV event;
- ``promise``: a flush holding promises only;
- ``neoss``: one NEOSS delivered to one process (a NEOSS for a segment of p processes is p
  messages);
- ``marker``: one barrier on one data channel (aligned mode).

A message is attributed wholly to the oldest epoch it carries, so sums over epochs,
kinds or processes all equal the total. Bytes follow the wire layouts in ``messages.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence, TypeVar

REPORT, PROMISE, NEOSS_KIND, MARKER = "report", "promise", "neoss", "marker"


@dataclass
class Tally:
    messages: int = 0
    bytes: int = 0
    #: entries carried (reports + promises of a flush; 1 for a NEOSS or a marker)
    entries: int = 0

    def add(self, messages: int, nbytes: int, entries: int) -> None:
        self.messages += messages
        self.bytes += nbytes
        self.entries += entries

    def as_dict(self) -> dict[str, int]:
        return {"messages": self.messages, "bytes": self.bytes, "entries": self.entries}


class ServiceTraffic:
    """Counters of service messages by kind, by process and by epoch."""

    def __init__(self) -> None:
        self.total = Tally()
        self.by_kind: dict[str, Tally] = {}
        self.by_process: dict[Hashable, Tally] = {}
        #: epoch None = a message that carries no epoch
        self.by_epoch: dict[int | None, Tally] = {}

    def record(
        self, kind: str, process: Hashable, epoch: int | None, *, nbytes: int, messages: int = 1, entries: int = 1
    ) -> None:
        # written out: the agent records every message it receives, and calls cost more than the sums
        t = self.by_kind.get(kind)
        if t is None:
            t = self.by_kind[kind] = Tally()
        t.messages += messages
        t.bytes += nbytes
        t.entries += entries
        t = self.by_process.get(process)
        if t is None:
            t = self.by_process[process] = Tally()
        t.messages += messages
        t.bytes += nbytes
        t.entries += entries
        t = self.by_epoch.get(epoch)
        if t is None:
            t = self.by_epoch[epoch] = Tally()
        t.messages += messages
        t.bytes += nbytes
        t.entries += entries
        t = self.total
        t.messages += messages
        t.bytes += nbytes
        t.entries += entries

    def record_each(self, kind: str, processes: Sequence[Hashable], epoch: int | None, *, nbytes: int,
                    entries: int = 1) -> None:
        """``record`` of the same message to each of ``processes`` (a NEOSS bundle fanned out),
        with one update of the kind, epoch and total counters."""
        n = len(processes)
        if not n:
            return
        by_process = self.by_process
        for p in processes:
            t = by_process.get(p)
            if t is None:
                t = by_process[p] = Tally()
            t.messages += 1
            t.bytes += nbytes
            t.entries += entries
        _tally(self.by_kind, kind).add(n, n * nbytes, n * entries)
        _tally(self.by_epoch, epoch).add(n, n * nbytes, n * entries)
        self.total.add(n, n * nbytes, n * entries)

    def messages(self, kind: str | None = None) -> int:
        if kind is None:
            return self.total.messages
        tally = self.by_kind.get(kind)
        return tally.messages if tally else 0

    def bytes(self, kind: str | None = None) -> int:
        if kind is None:
            return self.total.bytes
        tally = self.by_kind.get(kind)
        return tally.bytes if tally else 0

    def merge(self, other: "ServiceTraffic") -> None:
        """Add ``other``'s counts (e.g. per-worker marker counts into the job's)."""
        for kind, t in other.by_kind.items():
            _tally(self.by_kind, kind).add(t.messages, t.bytes, t.entries)
        for process, t in other.by_process.items():
            _tally(self.by_process, process).add(t.messages, t.bytes, t.entries)
        for epoch, t in other.by_epoch.items():
            _tally(self.by_epoch, epoch).add(t.messages, t.bytes, t.entries)
        self.total.add(other.total.messages, other.total.bytes, other.total.entries)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: keys become strings, epochs sorted."""
        return {
            "total": self.total.as_dict(),
            "by_kind": {k: t.as_dict() for k, t in sorted(self.by_kind.items())},
            "by_process": {str(p): t.as_dict() for p, t in self.by_process.items()},
            "by_epoch": {
                ("none" if e is None else str(e)): t.as_dict()
                for e, t in sorted(self.by_epoch.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
            },
        }


K = TypeVar("K", bound=Hashable)


def _tally(table: dict[K, Tally], key: K) -> Tally:
    tally = table.get(key)
    if tally is None:
        tally = table[key] = Tally()
    return tally
