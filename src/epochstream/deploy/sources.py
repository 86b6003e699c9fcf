"""Sources that need I/O or a clock: Parquet files, a Spark DataFrame, and a rate generator.

Both are replayable in the sense of ``runtime.sources.Source``: a split's records are a pure
function of (split, offset), so rewinding to an epoch's offsets replays exactly.

- ``DataFrameSource``: any Spark DataFrame (Parquet, JSON, Delta, JDBC, ...) as a bounded
  source whose *partitions are the splits*. When it is built it runs one Spark job that
  writes each partition, as Arrow, to its own Parquet file (``mapInArrow``, so rows never
  pass through the driver). That snapshot is what the job reads and what a replay after a
  failure reads again, even if the underlying table changes meanwhile. Workers open a split's
  file on first use and slice it by offset. On a cluster ``path`` must be storage every
  executor reads (a shared filesystem); the default is a local temporary folder.
- ``ParquetSource``: Parquet files as a bounded columnar source whose *row groups are the
  splits* (files in sorted path order, row groups in file order); a worker reads a split's
  row group on first use and slices it by offset. Records are Arrow batches.
- ``RateSource``: Spark's ``rate`` source, replayable: record i is ``{"timestamp": start + i /
  rows_per_second, "value": i}``, and a read returns only records whose timestamp has come
  (wall clock), so the source paces itself. Unbounded unless ``count`` is given.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ..runtime.errors import SchemaError
from ..runtime.sources import ColumnarSource, Source, schema_difference


class ParquetSource(ColumnarSource):
    """Parquet files as a bounded columnar source (see the module docstring).

    ``path``: a file, a folder (every ``*.parquet`` under it) or a list of files; ``columns``:
    the columns to read (None: all). Every file must have the first file's schema; a file
    that differs is named when the source is built. Files must stay as they are while a job's
    checkpoints need them (a replay reads them again).
    """

    schema_known_when_built = True

    def __init__(self, path: Any, columns: list[str] | None = None) -> None:
        import pyarrow.parquet as pq

        if isinstance(path, (list, tuple)):
            files = [Path(f) for f in path]
        elif Path(path).is_dir():
            files = sorted(Path(path).rglob("*.parquet"))
        else:
            files = [Path(path)]
        if not files:
            raise FileNotFoundError(f"from_parquet: no *.parquet files under {path}")
        self.columns = None if columns is None else list(columns)
        #: (file, row group, rows) per split
        self.splits: list[tuple[str, int, int]] = []
        first = None
        for f in files:
            try:
                meta = pq.ParquetFile(f).metadata
            except (OSError, ValueError) as exc:
                raise FileNotFoundError(f"from_parquet: {f} cannot be read ({type(exc).__name__}: {exc})") from None
            schema = meta.schema.to_arrow_schema()
            if self.columns is not None:
                missing = [c for c in self.columns if c not in schema.names]
                if missing:
                    raise SchemaError(f"from_parquet: {f} has no column {missing[0]!r} (its columns: {schema.names})")
                schema = pa_schema_select(schema, self.columns)
            if first is None:
                first = schema
            elif schema != first:
                raise SchemaError(f"from_parquet: {f}: {schema_difference(first, schema)} (schema of {files[0]}: "
                                  f"{first})")
            self.splits.extend((str(f), rg, meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups))
        self._schema = first
        self.num_splits = len(self.splits)
        self._open: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}  # row groups are read again where the source is read

    def split_length(self, split: int) -> int | None:
        return self.splits[split][2]

    def schema(self) -> Any:
        return self._schema

    def _read_batch(self, split: int, offset: int, count: int) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = self._open.get(split)
        if table is None:
            file, rg, _rows = self.splits[split]
            try:
                table = pq.ParquetFile(file).read_row_group(rg, columns=self.columns).combine_chunks()
            except (OSError, ValueError) as exc:
                raise FileNotFoundError(
                    f"source {self.uid!r} split {split}: {file} row group {rg} cannot be read "
                    f"({type(exc).__name__}: {exc}); a replay needs the files the job started with"
                ) from None
            self._open = {split: table}  # one row group open at a time per source instance
        part = table.slice(offset, count)
        if offset + count >= table.num_rows:
            self._open.pop(split, None)  # read to its end: a replay opens it again
        batches = part.to_batches()
        if not batches:
            return pa.RecordBatch.from_pylist([], schema=table.schema)
        return batches[0] if len(batches) == 1 else part.combine_chunks().to_batches()[0]


def pa_schema_select(schema: Any, columns: list[str]) -> Any:
    import pyarrow as pa

    return pa.schema([schema.field(c) for c in columns])


class DataFrameSource(Source):
    """A Spark DataFrame's partitions as splits (see the module docstring).

    ``records``: ``"dict"`` (a dict per row, column name -> value), ``"tuple"``, or ``"arrow"``
    (one Arrow RecordBatch per read: columnar records).
    """

    def __init__(self, df, path: str | os.PathLike[str] | None = None, records: str = "dict") -> None:
        if records not in ("dict", "tuple", "arrow"):
            raise ValueError(f"records must be 'dict', 'tuple' or 'arrow', got {records!r}")
        self.records = records
        self.path = Path(path if path is not None else tempfile.mkdtemp(prefix="epochstream-df-")).resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        if any(self.path.glob("split-*.parquet")):
            raise ValueError(f"{self.path} already holds a DataFrame snapshot; give each source its own folder")
        self._lengths = _materialize(df, str(self.path))
        self.num_splits = len(self._lengths)
        self.columns = list(df.columns)
        self._tables: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tables"] = {}  # opened again where the source is read
        return state

    def split_length(self, split: int) -> int | None:
        return self._lengths[split]

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        table = self._tables.get(split)
        if table is None:
            import pyarrow.parquet as pq

            file = self.path / f"split-{split:05d}.parquet"
            try:
                table = self._tables[split] = pq.read_table(file)
            except (OSError, ValueError) as exc:
                raise FileNotFoundError(
                    f"DataFrame source snapshot {file} cannot be read ({type(exc).__name__}: {exc}); it was written "
                    f"when the source was built, and the job cannot replay without it"
                ) from None
        part = table.slice(offset, count)
        if self.records == "arrow":
            if part.num_rows == 0:
                return []
            batch = part.combine_chunks().to_batches()[0]
            return batch.to_pylist() if self.rows_for_event_time else batch  # a timestamp function reads rows
        if self.records == "dict":
            return part.to_pylist()
        cols = [c.to_pylist() for c in part.columns]
        return list(zip(*cols, strict=True)) if cols else [() for _ in range(part.num_rows)]


    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        out: list[Any] = []
        for split in range(self.num_splits):
            if offsets.get(split, 0):
                part: Any = self.read(split, 0, offsets[split])
                out.extend(part if type(part) is list else part.to_pylist())
        return out


def _materialize(df, path: str) -> list[int]:
    """Write partition i of ``df`` to ``path/split-<i>.parquet``; return the row counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(df.schema)

    def write(batches):
        from pyspark import TaskContext

        split = TaskContext.get().partitionId()
        final = os.path.join(path, f"split-{split:05d}.parquet")
        tmp = f"{final}.{TaskContext.get().attemptNumber()}.tmp"
        rows = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            for b in batches:
                rows += b.num_rows
                writer.write_batch(b)
        os.replace(tmp, final)  # a retried task overwrites a partial file atomically
        yield pa.RecordBatch.from_pydict({"split": [split], "rows": [rows]})

    counts = df.mapInArrow(write, "split long, rows long").collect()
    lengths = {r["split"]: r["rows"] for r in counts}
    n = df.rdd.getNumPartitions()
    if sorted(lengths) != list(range(n)):
        raise RuntimeError(f"DataFrame snapshot in {path}: partitions {sorted(lengths)} of {n} were written")
    return [lengths[i] for i in range(n)]


class RateSource(Source):
    """Spark's ``rate`` source, replayable (see the module docstring)."""

    live = True  # a read takes the records due so far: re-reading at once finds a handful

    def __init__(self, rows_per_second: float, num_splits: int, count: int | None = None,
                 start: float | None = None, records: str = "dict") -> None:
        if records not in ("dict", "arrow"):
            raise ValueError(f"records must be 'dict' or 'arrow', got {records!r}")
        #: "dict": a dict per record; "arrow": one RecordBatch (timestamp float64, value int64) per read
        self.records = records
        if rows_per_second <= 0:
            raise ValueError(f"rows_per_second must be > 0, got {rows_per_second}")
        if num_splits < 1:
            raise ValueError(f"a source needs at least one split, got {num_splits}")
        if count is not None and count < 0:
            raise ValueError(f"count must be >= 0 or None, got {count}")
        self.rate = float(rows_per_second)
        self.num_splits = num_splits
        self.count = count
        #: wall-clock time of record 0; fixed when built, so replays produce the same records
        self.start = time.time() if start is None else start

    def split_length(self, split: int) -> int | None:
        if self.count is None:
            return None
        n = self.num_splits
        return (self.count - split + n - 1) // n if self.count > split else 0

    def _due(self, split: int) -> int:
        """Records of ``split`` whose timestamp has come."""
        total = math.floor((time.time() - self.start) * self.rate) + 1
        if self.count is not None:
            total = min(total, self.count)
        return max(0, (total - split + self.num_splits - 1) // self.num_splits)

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        stop = min(offset + count, self._due(split))
        n, start, rate = self.num_splits, self.start, self.rate
        if self.records == "arrow" and not self.rows_for_event_time and stop > offset:
            import pyarrow as pa
            import pyarrow.compute as pc

            values = pc.add(pc.multiply(pa.array(range(offset, stop), pa.int64()), n), split)
            stamps = pc.add(pc.divide(pc.cast(values, pa.float64()), rate), start)
            return pa.record_batch({"timestamp": stamps, "value": values})
        return [{"timestamp": start + i / rate, "value": i} for i in (j * n + split for j in range(offset, stop))]

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        n, start, rate = self.num_splits, self.start, self.rate
        return [{"timestamp": start + i / rate, "value": i}
                for s, off in offsets.items() for i in (j * n + s for j in range(off))]
