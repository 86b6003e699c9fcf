"""Transactional sinks: output is staged per epoch (pre-commit) and made visible on commit.

A FileSink writes each subtask's output of epoch n to
``PATH/_staging/<uid>/e<n>-s<subtask>-a<attempt>.<ext>`` when the epoch's snapshot is taken,
and moves it to ``PATH/part-e<n>-<uid>-s<subtask>.<ext>`` when the epoch commits. ``<ext>`` is
``jsonl`` (one encoded line per record, the default) or ``parquet`` (``format="parquet"``: one
Parquet file per subtask per epoch, so ``PATH`` is a dataset folder that pandas, pyarrow and
Spark read as it is). A Parquet sink takes Arrow batches whole (``write_batch``) and makes
rows into Arrow once per batch.
Readers (Spark, pandas, ``FileSink.read``) skip ``_``-prefixed folders, as Hadoop does, so
they only ever see committed output. ``PATH`` is a local folder or an S3 prefix
(``s3://bucket/prefix``): the sink works on the same ``ObjectStore`` as checkpoint storage.
A local move is a rename; on S3 it is a copy and then a delete, and a crash between the two
leaves the staged object, so moving again finishes the job with the same bytes under the
same name. Commit is therefore idempotent: re-issuing it after a failure adds nothing, and
recovery commits what the restored manifest names and deletes other staged files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any, Callable, Iterable

from ..runtime.errors import ConfigurationError, SchemaError
from .base import TransactionalSink
from .objects import parquet_table
from .objects import safe_name as _safe

STAGING = "_staging"
#: where ``roll_back`` sets aside committed output of epochs newer than a restored one
ROLLED_BACK = "_rolled_back"
_PART = re.compile(r"part-e(\d+)-(.*)-s(\d+)\.(jsonl|parquet)$")
#: the file formats a FileSink writes, by extension
FORMATS = ("jsonl", "parquet")

log = logging.getLogger(__name__)


def _default_encoder(record: Any) -> str:
    """Standard JSON (RFC 8259), one line: NaN and infinities, which JSON cannot spell, become
    ``null`` (as Spark's ``to_json`` and pandas' ``to_json`` write them); values JSON has no
    type for are written as their ``repr``."""
    try:
        return json.dumps(record, default=repr, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere inside
        return json.dumps(_finite_or_null(record), default=repr, separators=(",", ":"), allow_nan=False)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


class FileSink(TransactionalSink):
    """Exactly-once files, one per subtask per epoch: JSON lines (or a custom line format), or
    Parquet (``format="parquet"``).

    ``path`` is a local folder or ``s3://bucket/prefix`` (credentials and endpoint from the
    usual boto3 chain, e.g. ``AWS_ENDPOINT_URL``).

    Parquet records are Arrow batches (taken whole), dicts (column -> value), tuples or lists
    (columns ``_1``, ``_2``, ... as Spark names them, or ``schema``'s names in order) or
    single values (column ``value``). ``schema`` (a pyarrow schema or (name, type) pairs)
    fixes the columns and types; without it they are inferred per epoch and file.
    """

    def __init__(self, path: Any, encoder: Callable[[Any], str] | None = None,
                 decoder: Callable[[str], Any] | None = None, format: str = "jsonl",
                 schema: Any = None) -> None:
        from . import open_objects

        if format not in FORMATS:
            raise ConfigurationError(f"FileSink({str(path)!r}): format {format!r} is not one of {FORMATS}")
        if format == "parquet" and (encoder is not None or decoder is not None):
            raise ConfigurationError(f"FileSink({str(path)!r}): a Parquet sink writes columns; an encoder or "
                                     f"decoder applies to the jsonl format only")
        self.store = open_objects(path)
        self.path = self.store.root
        self.format = format
        self.schema = _arrow_schema(schema)
        if format == "parquet":
            self.encoder: Callable[[Any], str] = self._canonical
            self.decoder: Callable[[str], Any] = json.loads
        else:
            self.encoder = encoder or _default_encoder
            self.decoder = decoder or json.loads
        self._encoder, self._decoder = encoder, decoder

    def __repr__(self) -> str:
        extra = "" if self.format == "jsonl" else f", format={self.format!r}"
        return f"FileSink({str(self.path)!r}{extra})"

    def relocated(self, path: Any) -> "FileSink":
        """The same sink writing elsewhere (the oracle runs a job twice)."""
        return type(self)(path, self._encoder, self._decoder, self.format, self.schema)

    def writer(self) -> "_LineWriter | _ColumnWriter":
        """Per-subtask writer: encodes records as they arrive (strings, not tuples, wait for
        the epoch's end: less memory, and nothing for the garbage collector to scan); a
        Parquet sink's writer keeps Arrow batches (rows become one batch per call)."""
        if self.format == "parquet":
            return _ColumnWriter(self._row, self.schema, repr(self))
        return _LineWriter(self.encoder)

    # ------------------------------------------------------------ records as columns
    def _row(self, record: Any) -> dict[str, Any]:
        """A record as a Parquet row (column -> value)."""
        if isinstance(record, dict):
            return record
        names = self.schema.names if self.schema is not None else None
        if isinstance(record, (tuple, list)):
            if names is None:
                return {f"_{i}": v for i, v in enumerate(record, 1)}
            if len(record) != len(names):
                raise SchemaError(f"{self!r}: record {record!r:.200} has {len(record)} fields, the schema "
                                  f"{names}")
            return dict(zip(names, record, strict=True))
        if names is not None and len(names) != 1:
            raise SchemaError(f"{self!r}: record {record!r:.200} is one value, the schema has columns {names}")
        return {names[0] if names else "value": record}

    def _canonical(self, record: Any) -> str:
        """The text of a record as a Parquet row: what the oracle compares (written record
        against the row read back)."""
        return json.dumps(self._row(record), sort_keys=True, default=repr, separators=(",", ":"))

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Stage an epoch's output durably (encoded lines or an Arrow table from ``writer``, or
        records); returns the staged path relative to the sink root (None if empty)."""
        if records is None or not len(records):
            return None
        if self.format == "parquet":
            data = self._parquet_bytes(records)
        else:
            lines = records.lines if isinstance(records, _Lines) else list(map(self.encoder, records))
            data = ("\n".join(lines) + "\n").encode("utf-8")
        rel = f"{STAGING}/{_safe(uid)}/e{epoch}-s{subtask}-a{attempt}.{self.format}"
        self.store.put(self.path / rel, data)
        return rel

    def _parquet_bytes(self, records: Any) -> bytes:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not isinstance(records, pa.Table):  # records handed over without this sink's writer
            w = _ColumnWriter(self._row, self.schema, repr(self))
            w.write(list(records))
            records = w.take()
        out = pa.BufferOutputStream()
        pq.write_table(records, out, compression="zstd")
        return bytes(out.getvalue().to_pybytes())

    def final_name(self, staged: str) -> str:
        m = re.search(r"/([^/]+)/e(\d+)-s(\d+)-a[^/]+\.(jsonl|parquet)$", staged)
        if not m:
            raise ValueError(f"not a staged file of this sink: {staged}")
        uid, epoch, subtask = m.group(1), int(m.group(2)), int(m.group(3))
        return f"part-e{epoch:08d}-{uid}-s{subtask}.{m.group(4)}"

    def commit(self, staged: Iterable[str]) -> int:
        """Make staged files visible; idempotent. Returns how many were moved now."""
        moved = 0
        for rel in staged:
            src = self.path / rel
            dst = self.path / self.final_name(rel)
            try:
                self.store.move(src, dst)  # no existence check first: one request less on S3
                moved += 1
            except FileNotFoundError:
                if not self.store.exists(dst):
                    raise FileNotFoundError(
                        f"sink {self.path}: staged output {rel} is gone and was never committed; the epoch's "
                        f"output is lost (was the staging folder deleted by hand?)"
                    ) from None
        return moved

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.path / rel)

    def recover(self, uid: str, committed: Iterable[str]) -> None:
        """Re-issue the commit of the restored epoch and drop staged files of later epochs.

        A staged file that is neither here nor committed here means the sink's folder moved
        since the checkpoint: that output was committed (or is still staged) in the old
        folder. It cannot be recovered here, so it is reported, not treated as fatal.
        """
        keep = set(committed)
        for rel in sorted(keep):
            if not self.store.exists(self.path / rel) and not self.store.exists(self.path / self.final_name(rel)):
                log.warning("sink %s: output %s of the restored checkpoint is not in this folder (did the sink "
                            "move?); it stays wherever the earlier run wrote it", self.path, rel)
                continue
            self.commit([rel])
        folder = f"{STAGING}/{_safe(uid)}/"
        for key in list(self.store.keys(self.path, folder)):
            if key not in keep:
                self.store.delete(self.path / key)

    def roll_back(self, uid: str, restored_epoch: int) -> list[int]:
        """Set aside this sink's committed output of epochs after ``restored_epoch``.

        Recovery calls it when it restores an epoch older than output that was already
        committed (a newer checkpoint's manifest is damaged, or an older checkpoint or
        savepoint is restored into the same sink): the replay writes those epochs again, so
        leaving their parts would duplicate them. The parts move to
        ``PATH/_rolled_back/after-e<restored>-<token>/`` (readers skip ``_`` folders), nothing
        is deleted. Returns the epochs set aside."""
        import secrets

        name = _safe(uid)
        newer = []
        for key in self.store.keys(self.path, "part-"):
            m = _PART.match(key)
            if "/" not in key and m and m.group(2) == name and int(m.group(1)) > restored_epoch:
                newer.append((int(m.group(1)), key))
        if not newer:
            return []
        aside = f"{ROLLED_BACK}/after-e{restored_epoch}-{secrets.token_hex(3)}"
        for _epoch, key in sorted(newer):
            self.store.move(self.path / key, self.path / aside / key)
        epochs = sorted({e for e, _ in newer})
        log.warning("sink %s (%s): restored epoch %d is older than its committed output of epochs %s; moved %d "
                    "part files to %s, the replay writes those epochs again", self.path, uid, restored_epoch,
                    epochs, len(newer), self.path / aside)
        return epochs

    # ------------------------------------------------------------ reading committed output
    def committed_files(self) -> list[Any]:
        """Locations of committed files (``Path`` or ``S3Path``), in epoch, uid, subtask order."""
        def order(key: str):
            m = _PART.match(key)
            return (int(m.group(1)), m.group(2), int(m.group(3))) if m else (1 << 62, key, 0)

        # every part file a dataset reader would read, named as this sink names them or not
        keys = [k for k in self.store.keys(self.path, "part-")
                if "/" not in k and k.endswith(tuple(f".{f}" for f in FORMATS))]
        return [self.path / k for k in sorted(keys, key=order)]

    def read_lines(self, loc: Any) -> list[str]:
        """The encoded lines of one committed file (a Parquet file's rows as canonical text)."""
        if str(loc).endswith(".parquet"):
            return [self._canonical(row) for row in self.read_table(loc).to_pylist()]
        return [line for line in self.store.get(loc).decode("utf-8").split("\n") if line.strip()]

    def read_table(self, loc: Any) -> Any:
        """One committed Parquet file as an Arrow table."""
        return parquet_table(self.store.get(loc))

    def read(self) -> list[Any]:
        """All committed records (epoch order, then subtask); Parquet rows as dicts."""
        dec = self.decoder
        out: list[Any] = []
        for loc in self.committed_files():
            if str(loc).endswith(".parquet"):
                out.extend(self.read_table(loc).to_pylist())
            else:
                out.extend(dec(line) for line in self.read_lines(loc))
        return out


class DeadLetterFiles(FileSink):
    """``from_json``'s dead letters when no ``dead_letter=`` is given: JSON lines committed
    exactly once with their epoch, under ``<checkpoint dir>/dead-letters/<name>/``. The folder is
    known only when the job runs: ``Pipeline.run`` binds it (``bind_checkpoint_root``) before
    the driver starts. Each subtask's writer logs a WARNING naming the first dead letter of
    every epoch it writes (the others are in the files, and counted in ``dead_letters``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.store: Any = None
        self.path: Any = None
        self.format = "jsonl"
        self.schema = None
        self.encoder = _default_encoder
        self.decoder = json.loads
        self._encoder = self._decoder = None

    def bind_checkpoint_root(self, root: Any) -> None:
        """Write under ``root / "dead-letters" / name`` (``root``: the checkpoint storage's)."""
        from . import open_objects

        self.store = open_objects(root / "dead-letters" / _safe(self.name))
        self.path = self.store.root

    def __repr__(self) -> str:
        where = "not yet placed: runs put it under the checkpoint dir" if self.path is None else str(self.path)
        return f"DeadLetterFiles({self.name!r}, {where})"

    def relocated(self, path: Any) -> FileSink:
        return FileSink(path)

    def writer(self) -> "_WarningLineWriter":
        if self.store is None:
            raise ConfigurationError(f"{self!r}: run the pipeline with Pipeline.run, which places it under the "
                                     f"checkpoint dir, or give from_json a dead_letter= sink")
        return _WarningLineWriter(self.encoder, self.name, str(self.path))


class _Lines(list):
    """Encoded output lines of one epoch (a list, so emptiness and len work)."""

    @property
    def lines(self) -> list[str]:
        return self


class _LineWriter:
    __slots__ = ("encoder", "buf")

    def __init__(self, encoder: Callable[[Any], str]) -> None:
        self.encoder = encoder
        self.buf = _Lines()

    def write(self, records: list[Any]) -> None:
        self.buf.extend(map(self.encoder, records))

    def take(self) -> "_Lines":
        out, self.buf = self.buf, _Lines()
        return out


class _WarningLineWriter(_LineWriter):
    """A dead-letter writer that logs the first record of each epoch (between two ``take``s)."""

    __slots__ = ("name", "where", "warned")

    def __init__(self, encoder: Callable[[Any], str], name: str, where: str) -> None:
        super().__init__(encoder)
        self.name, self.where, self.warned = name, where, False

    def write(self, records: list[Any]) -> None:
        if records and not self.warned:
            self.warned = True
            first = records[0]
            at = ""
            if isinstance(first, dict) and first.get("offset") is not None:
                at = f" topic {first.get('topic')!r} partition {first.get('partition')} offset {first['offset']}"
            why = first.get("reason") if isinstance(first, dict) else first
            log.warning("from_json %s: a record%s does not decode (%s); it and any others of this epoch go to the "
                        "dead letters under %s", self.name, at, why, self.where)
        super().write(records)

    def take(self) -> "_Lines":
        self.warned = False
        return super().take()


class _ColumnWriter:
    """A Parquet sink's buffer of one epoch: Arrow batches as they came, rows made into one
    batch per ``write`` call; ``take`` hands over one Arrow table (types unified), or an empty list."""

    __slots__ = ("row", "schema", "what", "batches", "rows")

    def __init__(self, row: Callable[[Any], dict[str, Any]], schema: Any, what: str) -> None:
        self.row, self.schema, self.what = row, schema, what
        self.batches: list[Any] = []
        self.rows = 0

    def write(self, records: list[Any]) -> None:
        import pyarrow as pa

        if not records:
            return
        try:
            batch = pa.RecordBatch.from_pylist([self.row(r) for r in records], schema=self.schema)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise SchemaError(f"{self.what}: Arrow cannot make Parquet rows of records like {records[0]!r:.200} "
                              f"({type(exc).__name__}: {exc})") from None
        self.write_batch(batch)

    def write_batch(self, batch: Any) -> None:
        """A columnar batch, taken whole (no row is made)."""
        if self.schema is not None and batch.schema != self.schema:
            batch = _conform(batch, self.schema, self.what)
        if batch.num_rows:
            self.batches.append(batch)
            self.rows += batch.num_rows

    def take(self) -> Any:
        import pyarrow as pa

        batches, self.batches, self.rows = self.batches, [], 0
        if not batches:
            return []
        try:
            return pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="permissive")
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise SchemaError(f"{self.what}: the epoch's batches have columns that do not fit one Parquet file "
                              f"({type(exc).__name__}: {exc}); pass schema= to the sink") from None


def _arrow_schema(schema: Any) -> Any:
    if schema is None:
        return None
    import pyarrow as pa

    return schema if isinstance(schema, pa.Schema) else pa.schema(schema)


def _conform(batch: Any, schema: Any, what: str) -> Any:
    """A batch with ``schema``'s columns in its order and types, or a ``SchemaError`` naming the column."""
    import pyarrow as pa

    missing = [n for n in schema.names if n not in batch.schema.names]
    if missing:
        raise SchemaError(f"{what}: a batch has no column {missing[0]!r} (it has {batch.schema.names})")
    cols = []
    for field in schema:
        col = batch.column(field.name)
        try:
            cols.append(col if col.type == field.type else col.cast(field.type))
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise SchemaError(f"{what}: column {field.name!r} of type {col.type} does not convert to "
                              f"{field.type} ({exc})") from None
    return pa.RecordBatch.from_arrays(cols, schema=schema)


class _DropWriter:
    __slots__ = ()

    def write(self, records: list[Any]) -> None:
        return None

    def take(self) -> list[Any]:
        return []


class DiscardingSink(TransactionalSink):
    """Accepts records and drops them (Flink's DiscardingSink): for benchmarks and dry runs.

    It takes part in the two-phase commit like any sink, so a job with it measures the
    protocol's cost without the cost of writing output.
    """

    encoder = staticmethod(_default_encoder)

    def writer(self) -> _DropWriter:
        return _DropWriter()

    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: list[Any]) -> str | None:
        return None

    def commit(self, staged: Iterable[str]) -> int:
        return 0

    def abort(self, staged: Iterable[str]) -> None:
        return None

    def recover(self, uid: str, committed: Iterable[str]) -> None:
        return None

    def relocated(self, path: str | os.PathLike[str]) -> "DiscardingSink":
        return self
