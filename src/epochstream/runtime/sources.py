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

from .columns import to_rows
from .errors import SchemaError, UserFunctionError


class Source:
    """Base of replayable sources: ``num_splits`` splits of records addressed by offset."""

    num_splits: int = 1
    #: event time of a record (set by ``Pipeline.from_source(timestamps=...)``), or None
    timestamp: Callable[[Any], Any] | None = None
    #: event time as a column of Arrow reads: (column, units per second), set with ``timestamp``
    #: when it reads a column (``timestamps="col"``, Kafka's ``timestamps="kafka"``): the reader
    #: labels a RecordBatch with Arrow instead of making rows of it (``runtime.reader``)
    timestamp_column: tuple[str, float] | None = None
    #: seconds a record may come behind the newest of its split (None: not at all; set by
    #: ``Pipeline.from_source(max_out_of_orderness=...)``; ``runtime.watermarks``)
    max_out_of_orderness: float | None = None
    #: seconds without records after which a split stops holding the watermark back (None: never)
    idleness: float | None = None
    #: late records go on wrapped in ``LateRecord`` to a side output instead of being dropped
    #: (set by ``Pipeline.from_source(late_records=...)``; ``runtime.watermarks``)
    late_output: bool = False
    #: the split count was not chosen by the user: a fresh start sets it to the parallelism,
    #: a restore to the checkpoint's count
    elastic: bool = False
    #: the uid of the source operator (set by ``Pipeline.from_source``), named in errors
    uid: str | None = None
    #: splits may be added while the job runs (``discover``; a Kafka topic's new partitions):
    #: new splits get the next indices, a checkpoint may hold fewer splits than the source has
    grows: bool = False
    #: records become due with time (``rate``): a read that returns fewer than asked has caught
    #: up, and when the pipeline has a ``batch_linger`` a worker waits a moment (its loop's idle
    #: timeout, the linger or the next message) before reading again, instead of turning its
    #: loop for the few records due since the last read
    live: bool = False

    @property
    def rows_for_event_time(self) -> bool:
        """Event time is on and read by a function of rows: a columnar read must hand rows."""
        return self.timestamp is not None and self.timestamp_column is None

    def discover(self, now: float, force: bool = False) -> None:
        """Look for new splits (a growing source, at most once per its interval unless
        ``force``) and add them at the end: ``num_splits`` grows, nothing else changes."""

    def discovered_start_offset(self, split: int) -> int:
        """Where a split that a restored checkpoint does not name starts (a growing source:
        it was created after the checkpoint, so from its beginning)."""
        return self.start_offset(split)

    def resplit(self, num_splits: int) -> None:
        """Change the number of splits (elastic sources only, before the job reads anything).

        Enough for a source whose splits are computed from the count (generators, row
        ranges); one that stores its splits also rebuilds them."""
        if not self.elastic:
            raise ValueError(f"{type(self).__name__} has a fixed number of splits ({self.num_splits})")
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        self.num_splits = num_splits

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        """Up to ``count`` records of ``split`` starting at ``offset``; [] when exhausted."""
        raise NotImplementedError

    def split_ids(self) -> list[int]:
        """The ids of the splits: 0..num_splits-1, unless a source names its splits (a Kafka
        source over several topics: ids from (topic, partition), ``backends.kafka.source``)."""
        return list(range(self.num_splits))

    def owner(self, split: int, parallelism: int) -> int:
        """The source subtask that reads ``split`` (``split % parallelism`` unless the source says)."""
        return split % parallelism

    def split_length(self, split: int) -> int | None:
        """Records in the split, or None if unbounded."""
        raise NotImplementedError

    def start_offset(self, split: int) -> int:
        """Where a fresh start reads ``split`` from (a Kafka source: its resolved ``start``)."""
        return 0

    def read_next(self, split: int, offset: int, count: int) -> tuple[list[Any], int]:
        """``read`` plus the offset after the records. Offsets count records unless a source
        says otherwise: a Kafka source's are Kafka offsets, which have gaps (transaction markers)."""
        records = self.read(split, offset, count)
        return records, offset + len(records)

    def read_range(self, split: int, start: int, stop: int) -> list[Any]:
        """The records of ``split`` at offsets [start, stop) (the oracle's reference reads an
        epoch's input with it; a source whose offsets have gaps cuts by offset)."""
        return self.read(split, start, stop - start)

    @property
    def bounded(self) -> bool:
        return all(self.split_length(s) is not None for s in self.split_ids())

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
        if force and num_splits >= 1:
            self.num_splits = num_splits
        else:
            super().resplit(num_splits)
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


# ---------------------------------------------------------------- columnar sources


class ColumnarSource(Source):
    """A source whose reads return one Arrow RecordBatch (offsets still count rows, so
    checkpoints, replay and rescaling are as for any source).

    Every batch must have the schema of the source's *first batch* (the one holding record 0 of
    split 0; ``schema()``); a batch that differs raises a ``SchemaError`` naming the source uid,
    split, offset and the differing column. With event time from a column (``timestamps="col"``)
    reads stay batches (the reader labels them with Arrow); with a timestamp function they return
    rows (dicts), which the task labels one by one.

    Subclasses implement ``_read_batch(split, offset, count)`` (a RecordBatch, possibly empty)
    and ``schema()``.
    """

    #: ``schema()`` is known when the pipeline is built, without user code (``key_by`` checks
    #: its columns then)
    schema_known_when_built = False

    def schema(self) -> Any:
        raise NotImplementedError

    def _read_batch(self, split: int, offset: int, count: int) -> Any:
        raise NotImplementedError

    def read(self, split: int, offset: int, count: int) -> Any:
        batch = self._read_batch(split, offset, count)
        if batch.num_rows == 0:
            return []
        expected = self.schema()
        if batch.schema != expected:
            raise SchemaError(
                f"source {self.uid!r} split {split} offset {offset}: {schema_difference(expected, batch.schema)} "
                f"(every batch must have the schema of the source's first batch: {expected})"
            )
        return to_rows(batch) if self.rows_for_event_time else batch

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        out: list[Any] = []
        for split in range(self.num_splits):
            if offsets.get(split, 0):
                part = self.read(split, 0, offsets[split])
                out.extend(part if type(part) is list else to_rows(part))
        return out


def schema_difference(expected: Any, got: Any) -> str:
    """The first difference between two Arrow schemas, in words naming the column."""
    names = set(got.names)
    for field in expected:
        if field.name not in names:
            return f"column {field.name!r} is missing"
        other = got.field(field.name)
        if other.type != field.type:
            return f"column {field.name!r} is {other.type}, the first batch's is {field.type}"
    for field in got:
        if field.name not in expected.names:
            return f"column {field.name!r} is new"
    return f"the columns are in another order ({got.names} instead of {expected.names})"


class ArrowSource(ColumnarSource):
    """An Arrow Table (or RecordBatches) cut into contiguous row ranges: split s of n holds rows
    [s * N // n, (s + 1) * N // n). Reads are zero-copy slices."""

    schema_known_when_built = True

    def __init__(self, data: Any, num_splits: int, elastic: bool = False) -> None:
        import pyarrow as pa

        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        elif not isinstance(data, pa.Table):
            batches = list(data)
            if not batches:
                raise ValueError("from_arrow needs a Table or at least one RecordBatch")
            first = batches[0].schema
            for i, b in enumerate(batches):
                if b.schema != first:
                    raise SchemaError(f"from_arrow: RecordBatch {i}: {schema_difference(first, b.schema)}")
            data = pa.Table.from_batches(batches)
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        #: one chunk per column, so a split's read is one slice of one RecordBatch
        self.table = data.combine_chunks()
        self.elastic = elastic
        self.num_splits = num_splits

    def _bounds(self, split: int) -> tuple[int, int]:
        n, rows = self.num_splits, self.table.num_rows
        return split * rows // n, (split + 1) * rows // n

    def split_length(self, split: int) -> int | None:
        start, stop = self._bounds(split)
        return stop - start

    def schema(self) -> Any:
        return self.table.schema

    def _read_batch(self, split: int, offset: int, count: int) -> Any:
        import pyarrow as pa

        start, stop = self._bounds(split)
        part = self.table.slice(start + offset, max(0, min(count, stop - start - offset)))
        batches = part.to_batches()
        if not batches:
            return pa.RecordBatch.from_pylist([], schema=self.table.schema)
        return batches[0] if len(batches) == 1 else part.combine_chunks().to_batches()[0]


class BatchGeneratorSource(ColumnarSource):
    """Vectorised generator: record i is row i of ``fn(start, stop)``, a RecordBatch of rows
    [start, stop) that must depend on nothing but (start, stop).

    Rows are dealt to splits in blocks of ``block_rows``: block b = rows [b * B, (b + 1) * B)
    belongs to split b % n. Offset j of split s is row ((j // B) * n + s) * B + j % B, so a
    split's records are a pure function of (split, offset) and a replay reads exactly what the
    first run read; a read of up to B rows from a block boundary is one call of ``fn``. A bigger
    ``block_rows`` means fewer, larger calls; a smaller one spreads a short input over more
    splits. Unbounded if ``count`` is None. The split count and ``block_rows`` are fixed for the
    life of a job's state (a checkpoint's offsets count rows per split).
    """

    def __init__(self, fn: Callable[[int, int], Any], count: int | None, num_splits: int, block_rows: int = 1024,
                 elastic: bool = False) -> None:
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        if count is not None and count < 0:
            raise ValueError(f"count must be >= 0 or None, got {count}")
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.fn = fn
        self.count = count
        self.block_rows = block_rows
        self.num_splits = num_splits
        self.elastic = elastic
        self._schema = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_schema": None}  # worked out again where the source is read

    def split_length(self, split: int) -> int | None:
        if self.count is None:
            return None
        n, b = self.num_splits, self.block_rows
        full, rest = divmod(self.count, b)
        owned = (full - split + n - 1) // n if full > split else 0
        return owned * b + (rest if rest and full % n == split else 0)

    def schema(self) -> Any:
        if self._schema is None:
            self._schema = self._call(0, 1, 0, 0).schema
        return self._schema

    def _call(self, start: int, stop: int, split: int, offset: int) -> Any:
        try:
            batch = self.fn(start, stop)
        except Exception as exc:
            raise UserFunctionError(
                f"generate_batches function of source {self.uid!r} failed on rows [{start}, {stop}): {exc!r}"
            ) from exc
        import pyarrow as pa

        if isinstance(batch, pa.Table):
            batch = pa.Table.combine_chunks(batch).to_batches()[0] if batch.num_rows else None
        if not isinstance(batch, pa.RecordBatch) or batch.num_rows != stop - start:
            got = f"{batch.num_rows} rows" if isinstance(batch, pa.RecordBatch) else type(batch).__name__
            raise SchemaError(
                f"source {self.uid!r} split {split} offset {offset}: the generate_batches function returned {got} "
                f"for rows [{start}, {stop}); it must return a RecordBatch of exactly {stop - start} rows"
            )
        return batch

    def _read_batch(self, split: int, offset: int, count: int) -> Any:
        import pyarrow as pa

        length = self.split_length(split)
        stop_at = offset + count if length is None else min(offset + count, length)
        n, b = self.num_splits, self.block_rows
        parts, j = [], offset
        while j < stop_at:
            block, within = divmod(j, b)
            start = (block * n + split) * b + within
            take = min(b - within, stop_at - j)
            part = self._call(start, start + take, split, j)
            if part.schema != self.schema():  # checked per call: name the offset where it changed
                raise SchemaError(f"source {self.uid!r} split {split} offset {j}: "
                                  f"{schema_difference(self.schema(), part.schema)} (every batch must have the "
                                  f"schema of the source's first batch: {self.schema()})")
            parts.append(part)
            j += take
        if not parts:
            return pa.RecordBatch.from_pylist([], schema=self.schema())
        if len(parts) == 1:
            return parts[0]
        return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
