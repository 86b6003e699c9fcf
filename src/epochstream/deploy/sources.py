"""Sources that need I/O or a clock: a Spark DataFrame, and a rate generator.

Both are replayable in the sense of ``runtime.sources.Source``: a split's records are a pure
function of (split, offset), so rewinding to an epoch's offsets replays exactly.

- ``DataFrameSource``: any Spark DataFrame (Parquet, JSON, Delta, JDBC, ...) as a bounded
  source whose *partitions are the splits*. When it is built it runs one Spark job that
  writes each partition, as Arrow, to its own Parquet file (``mapInArrow``, so rows never
  pass through the driver). That snapshot is what the job reads and what a replay after a
  failure reads again, even if the underlying table changes meanwhile. Workers open a split's
  file on first use and slice it by offset. On a cluster ``path`` must be storage every
  executor reads (a shared filesystem); the default is a local temporary folder.
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

from ..runtime.sources import Source


class DataFrameSource(Source):
    """A Spark DataFrame's partitions as splits (see the module docstring).

    ``records``: ``"dict"`` (a dict per row, column name -> value) or ``"tuple"``.
    """

    def __init__(self, df, path: str | os.PathLike[str] | None = None, records: str = "dict") -> None:
        if records not in ("dict", "tuple"):
            raise ValueError(f"records must be 'dict' or 'tuple', got {records!r}")
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
        if self.records == "dict":
            return part.to_pylist()
        cols = [c.to_pylist() for c in part.columns]
        return list(zip(*cols)) if cols else [() for _ in range(part.num_rows)]


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

    def __init__(self, rows_per_second: float, num_splits: int, count: int | None = None,
                 start: float | None = None) -> None:
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
        return [{"timestamp": start + i / rate, "value": i} for i in (j * n + split for j in range(offset, stop))]

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        n, start, rate = self.num_splits, self.start, self.rate
        return [{"timestamp": start + i / rate, "value": i}
                for s, off in offsets.items() for i in (j * n + s for j in range(off))]
