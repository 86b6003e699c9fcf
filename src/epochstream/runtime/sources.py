"""Replayable sources: a fixed set of splits, each read from an offset.

A source's only state is one offset per split, so rewinding to an epoch is exact. Splits
are assigned to subtasks by ``split % parallelism``, which restoring at another
parallelism simply recomputes: the offsets travel with their splits.

The number of splits is fixed for the life of a job's state (like a topic's partitions): a
checkpoint names offsets per split. A source built without an explicit split count is
*elastic*: its count is settled when a job starts fresh (to the job's parallelism, so no
worker idles) and adopted from the checkpoint when it restores (``resplit``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class Source:
    """Base of replayable sources: ``num_splits`` splits of records addressed by offset."""

    num_splits: int = 1
    #: event time of a record (set by ``Pipeline.from_source(timestamps=...)``), or None
    timestamp: Callable[[Any], Any] | None = None
    #: the split count was not chosen by the user: a fresh start sets it to the parallelism,
    #: a restore to the checkpoint's count
    elastic: bool = False

    def resplit(self, num_splits: int) -> None:
        """Change the number of splits (elastic sources only, before the job reads anything)."""
        raise ValueError(f"{type(self).__name__} has a fixed number of splits ({self.num_splits})")

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        """Up to ``count`` records of ``split`` starting at ``offset``; [] when exhausted."""
        raise NotImplementedError

    def split_length(self, split: int) -> int | None:
        """Records in the split, or None if unbounded."""
        raise NotImplementedError

    @property
    def bounded(self) -> bool:
        return all(self.split_length(s) is not None for s in range(self.num_splits))

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        """All records before ``offsets`` (split -> offset): the input prefix an epoch names."""
        out: list[Any] = []
        for split in range(self.num_splits):
            out.extend(self.read(split, 0, offsets.get(split, 0)))
        return out


class CollectionSource(Source):
    """A Python collection cut into round-robin splits (record i belongs to split i % n)."""

    def __init__(self, items: Sequence[Any], num_splits: int, elastic: bool = False) -> None:
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        self.items = list(items)
        self.elastic = elastic
        self.resplit(num_splits, force=True)

    def resplit(self, num_splits: int, force: bool = False) -> None:
        if not (self.elastic or force):
            super().resplit(num_splits)
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        self.num_splits = num_splits
        self._splits = [self.items[s::num_splits] for s in range(num_splits)]

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        return self._splits[split][offset : offset + count]

    def split_length(self, split: int) -> int | None:
        return len(self._splits[split])


class GeneratorSource(Source):
    """Record i is ``fn(i)``; split s holds i = s, s + n, s + 2n, ...; unbounded if count is None."""

    def __init__(self, fn: Callable[[int], Any], count: int | None, num_splits: int, elastic: bool = False) -> None:
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        if count is not None and count < 0:
            raise ValueError(f"count must be >= 0 or None, got {count}")
        self.fn = fn
        self.count = count
        self.num_splits = num_splits
        self.elastic = elastic

    def resplit(self, num_splits: int) -> None:
        if not self.elastic:
            super().resplit(num_splits)
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        self.num_splits = num_splits

    def split_length(self, split: int) -> int | None:
        if self.count is None:
            return None
        n = self.num_splits
        return (self.count - split + n - 1) // n if self.count > split else 0

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        length = self.split_length(split)
        stop = offset + count if length is None else min(offset + count, length)
        n, fn = self.num_splits, self.fn
        return [fn(j * n + split) for j in range(offset, stop)]
