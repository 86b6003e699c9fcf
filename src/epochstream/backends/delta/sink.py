"""``DeltaSink``: exactly-once output to a Delta table, ONE append transaction per epoch.

Commits go through delta-rs (no JVM); Spark with delta-spark reads the table (SQL, time
travel per epoch). Records may be Arrow batches (taken whole by the writer: no rows are
made), dicts or tuples in column order.

The sink's side of the two-phase commit (thesis Table 4.1, Delta as the commit log):

* **begin** (``start``, at every (re)start): the table is created, or checked to be ours
  and to have the sink's columns; the transaction id continues the restored run's lineage
  or starts a new one (``txnAppId`` = job, sink uid, lineage).
* **pre-commit** (workers): an epoch's records are staged as a Parquet file under
  ``<table>/_epochstream_staging/<uid>/`` (``tables.STAGING``: Delta readers and VACUUM
  ignore ``_`` folders), its row count and size in its name. Nothing is visible in the table yet.
* **commit point**: the manifest names the table and the app id (``manifest_entry``).
* **commit** (job master, after the manifest, ``commit_epoch``): the epoch's staged files are
  moved into the table's folder under data-file names (a rename; a server-side copy on S3)
  and added by reference as the transaction (app id, epoch): the master never reads a record.
  A re-issue finds the transaction in the table's ``txn`` record and adds nothing; one after a
  crash between the moves and the commit finds the files moved and commits them.
* **recover**: the restored epoch's commit is re-issued, later staged output dropped.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from ...runtime.errors import SchemaError
from ...snapshot.manifest import CheckpointError
from .. import spark_session
from ..base import TransactionalSink
from ..objects import safe_name
from . import tables
from .tables import SINK_FORMAT, STAGING, DeltaTables, is_delta_table, version_of_epoch

log = logging.getLogger(__name__)


class DeltaSink(TransactionalSink):
    """Exactly-once output to a Delta table: one append transaction per epoch.

    ``schema`` is a pyarrow schema (or a list of (name, type) pairs); records are Arrow
    batches, tuples in column order or dicts. Output is staged as Parquet by the workers
    (pre-commit) and added to the table by the job master after the epoch's manifest (the
    files moved in, committed by reference), with ``txnAppId`` = job, sink uid and run lineage
    and ``txnVersion`` = epoch, so a re-issued commit is skipped by Delta.
    ``path`` is a local path or an S3 URL (``s3://`` or ``s3a://``).
    """

    #: the job master commits this sink once per epoch (``commit_epoch``), not file by file
    epoch_transactions = True

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema | list[tuple[str, pa.DataType]],
                 table_properties: dict[str, str] | None = None) -> None:
        from .. import location

        self.path = str(location(path))
        if tables.is_remote(self.path):
            spark_session.need_s3a()  # Spark reads the table (SQL, time travel): its session needs S3A
        self.schema = schema if isinstance(schema, pa.Schema) else pa.schema(schema)
        self.table_properties = dict(table_properties or {})
        #: sink uid -> the app id of its Delta transactions (the run lineage), set by ``start``
        self._app_ids: dict[str, str] = {}
        self._store: Any = None
        #: whether this sink checked (or created) its table
        self.tables = DeltaTables()

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _store=None)  # connections are opened again where the sink runs

    @property
    def store(self) -> Any:
        if self._store is None:
            from .. import open_objects

            self._store = open_objects(self.path)
        return self._store

    def relocated(self, path: Any) -> DeltaSink:
        return type(self)(path, self.schema, self.table_properties)

    # ------------------------------------------------------------ records
    def _row(self, record: Any) -> dict[str, Any]:
        if isinstance(record, dict):
            return {n: record.get(n) for n in self.schema.names}
        if isinstance(record, (tuple, list)) and len(record) == len(self.schema):
            return dict(zip(self.schema.names, record, strict=True))
        raise SchemaError(f"Delta sink {self.path}: record {record!r:.200} does not match the columns "
                          f"{self.schema.names}")

    def encoder(self, record: Any) -> str:
        """The canonical text of a record (the oracle compares outputs through it)."""
        return json.dumps(self._row(record), sort_keys=True, default=repr, separators=(",", ":"))

    def writer(self) -> _ArrowWriter:
        return _ArrowWriter(self)

    def _table_of(self, records: Any) -> pa.Table:
        """An epoch's records (Arrow batches and rows, in order) as one table of the sink's schema."""
        parts = []
        rows: list[dict[str, Any]] = []
        for r in records:
            if isinstance(r, pa.RecordBatch):
                if rows:
                    parts.append(self._rows_table(rows))
                    rows = []
                parts.append(pa.Table.from_batches([self._conform(r)]))
            else:
                rows.append(self._row(r))
        if rows:
            parts.append(self._rows_table(rows))
        return pa.concat_tables(parts) if parts else self.schema.empty_table()

    def _rows_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        try:
            return pa.Table.from_pylist(rows, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise SchemaError(f"Delta sink {self.path}: records do not fit the schema {self.schema}: {exc}") from exc

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A columnar batch as the sink's columns (selected and cast), or a ``SchemaError`` naming the column."""
        if batch.schema.equals(self.schema):
            return batch
        cols = []
        for field in self.schema:
            if field.name not in batch.schema.names:
                raise SchemaError(f"Delta sink {self.path}: a batch has no column {field.name!r} "
                                  f"(it has {batch.schema.names})")
            col = batch.column(field.name)
            try:
                cols.append(col if col.type == field.type else col.cast(field.type))
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise SchemaError(f"Delta sink {self.path}: column {field.name!r} of type {col.type} does not "
                                  f"convert to {field.type} ({exc})") from None
        return pa.RecordBatch.from_arrays(cols, schema=self.schema)

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Stage an epoch's output as Parquet (workers); returns the path relative to the table."""
        if not records:
            return None
        table = self._table_of(records)
        if not table.num_rows:
            return None
        body = tables.parquet_bytes(table)
        rel = f"{STAGING}/{safe_name(uid)}/e{epoch}-s{subtask}-a{attempt}-n{table.num_rows}-b{len(body)}.parquet"
        self.store.put(self.store.root / rel, body)
        return rel

    def start(self, uid: str, job: str, manifest: dict[str, Any] | None) -> None:
        """At (re)start: continue the restored run's transaction ids, or start a new lineage;
        create the table (or check that it is ours) before any output is staged in it."""
        entry = (manifest or {}).get("sinks", {}).get(uid, {}).get("delta")
        if entry and entry.get("app_id"):
            self._app_ids[uid] = entry["app_id"]
        else:
            self._app_ids[uid] = f"epochstream/{job}/sink/{uid}/{secrets.token_hex(4)}"
        self._check_table(self._app_ids[uid])
        if not is_delta_table(self.path):
            self._create(self._app_ids[uid])

    def manifest_entry(self, uid: str) -> dict[str, Any]:
        return {"table": self.path, "app_id": self._app_ids[uid]}

    def _check_table(self, app_id: str) -> None:
        """Refuse a table that is not this sink's (other format, other columns) or a folder of other files."""
        if is_delta_table(self.path):
            self.tables.check_owned(self.path, SINK_FORMAT, {}, f"Delta sink {self.path}", app_id)
            have = tables.arrow_schema_of(self.path).names
            if have != self.schema.names:
                raise CheckpointError(
                    f"Delta sink {self.path}: the table has columns {have}, the sink writes {self.schema.names}; "
                    f"nothing was written to it"
                )
        elif tables.path_has_files(self.path):
            raise CheckpointError(f"Delta sink {self.path}: the folder holds files but is not a Delta table; "
                                  f"nothing was written to it")

    def _create(self, app_id: str) -> None:
        tables.create(self.path, self.schema, {tables.FORMAT_PROPERTY: SINK_FORMAT, **self.table_properties}, app_id)
        self.tables.mark_owned(self.path, SINK_FORMAT)

    def commit_epoch(self, uid: str, epoch: int, staged: list[str]) -> int | None:
        """Add the epoch's staged files to the table in ONE transaction, by reference (moved
        into the table's folder first); a re-issue is a no-op."""
        app_id = self._app_ids.get(uid)
        if app_id is None:
            raise CheckpointError(f"Delta sink {self.path}: commit of {uid!r} before start()")
        root = self.store.root
        done = version_of_epoch(self.path, app_id, epoch)
        if done is not None:
            self.abort([rel for rel in staged if self.store.exists(root / rel)])
            return done
        files = []
        for rel in staged:
            name, size, rows = data_file(rel)
            try:
                have = self.store.size(root / rel)
            except FileNotFoundError:
                if not self.store.exists(root / name):  # moved by a commit that crashed before the log
                    raise CheckpointError(
                        f"Delta sink {self.path}: staged output {rel} of epoch {epoch} is gone and was never "
                        f"committed; the epoch's output is lost (was the staging folder deleted by hand?)"
                    ) from None
            else:
                if have != size:
                    raise CheckpointError(f"Delta sink {self.path}: staged output {rel} is damaged ({have} bytes, "
                                          f"{size} when staged); nothing of epoch {epoch} was added")
                self.store.move(root / rel, root / name)
            files.append((name, size, rows))
        tables.add_files(files, self.path, app_id, epoch,
                         lambda exc: f"Delta sink {self.path}: epoch {epoch} kept conflicting: {exc}", checked=True)
        return version_of_epoch(self.path, app_id, epoch)

    def commit(self, staged: Iterable[str]) -> int:
        raise CheckpointError("DeltaSink commits once per epoch (commit_epoch); the job master calls it")

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.store.root / rel)

    def recover(self, uid: str, committed: Iterable[str], epoch: int | None = None) -> None:
        """Re-issue the restored epoch's commit (a no-op if it happened), drop later staged output."""
        keep = list(committed)
        if epoch is not None:
            version = self.commit_epoch(uid, epoch, keep)
            if version is not None:
                self._roll_back(uid, epoch, version)
        folder = self.store.root / STAGING / safe_name(uid)
        for key in list(self.store.keys(folder)):
            self.store.delete(folder / key)

    def _roll_back(self, uid: str, epoch: int, version: int) -> None:
        """After a fallback restore (the restored epoch is older than the table's newest):
        RESTORE the table to the restored epoch's version, and go on under a new app id if
        the old one ever committed a later epoch (Delta would skip the replay as done, and
        one transaction version would name two contents). See ``tables.roll_back``."""
        app_id = self._app_ids[uid]
        if tables.committed_txn(self.path, app_id) <= epoch:
            return  # nothing newer was ever committed under this lineage: the usual recovery
        new_app_id = f"{app_id.rsplit('/', 1)[0]}/{secrets.token_hex(4)}"
        epochs, self._app_ids[uid] = tables.roll_back(self.path, version, app_id, new_app_id, epoch,
                                                      f"Delta sink {self.path}")
        log.warning("Delta sink %s (%s): restored epoch %d is older than the table's epochs %s; %s; later epochs "
                    "commit as transaction %s", self.path, uid, epoch, epochs if epochs is not None else
                    "(taken back already)", f"restored the table to version {version}" if epochs is not None
                    else "its content already is that version's", self._app_ids[uid])

    # ------------------------------------------------------------ reading committed output
    def read(self, version: int | None = None) -> list[dict[str, Any]]:
        """Committed rows (optionally as of a Delta version), read by delta-rs."""
        if not is_delta_table(self.path):
            return []
        rows: list[dict[str, Any]] = tables.open_table(self.path, version).to_pyarrow_table().to_pylist()
        return rows

    def committed_lines_by_epoch(self) -> dict[int, collections.Counter[str]]:
        """Encoded output committed by each epoch (each epoch's version minus the one before)."""
        out: dict[int, collections.Counter[str]] = {}
        prev: collections.Counter[str] = collections.Counter()
        for epoch, version in self.epochs():
            cur = collections.Counter(map(self.encoder, self.read(version)))
            out[epoch] = out.get(epoch, collections.Counter()) + (cur - prev)
            prev = cur
        return out

    def epochs(self) -> list[tuple[int, int]]:
        """(epoch, Delta version) of every committed epoch, oldest first."""
        if not is_delta_table(self.path):
            return []
        # epoch 0 is the table's creation (CREATE and its properties), no epoch's output; epochs
        # a rollback took back (a fallback restore) are not in the table's content
        return tables.live_epochs(tables.history(self.path),
                                  lambda m: isinstance(m, dict) and "/sink/" in str(m.get("epochstream")))


_STAGED = re.compile(r"/([^/]+)/e(\d+)-s(\d+)-a(.+)-n(\d+)-b(\d+)\.parquet$")


def data_file(staged: str) -> tuple[str, int, int]:
    """The table's data file a staged file becomes at commit: (name in the table's folder,
    bytes, rows). Names carry the attempt, so a replayed epoch never reuses one."""
    m = _STAGED.search("/" + staged)
    if m is None:
        raise CheckpointError(f"not a staged file of a Delta sink: {staged!r}")
    uid, epoch, subtask, attempt, rows, size = m.groups()
    return f"part-e{int(epoch):08d}-s{subtask}-a{attempt}-{uid}.zstd.parquet", int(size), int(rows)


class _ArrowWriter:
    """A worker's buffer of one epoch's output (``TransactionalSink.writer``): Arrow batches
    taken whole (``write_batch``, selected and cast to the sink's columns on arrival, so a bad
    batch fails the epoch in the operator that wrote it) and rows as they came."""

    __slots__ = ("sink", "buf")

    def __init__(self, sink: DeltaSink) -> None:
        self.sink = sink
        self.buf: list[Any] = []

    def write(self, records: list[Any]) -> None:
        self.buf.extend(records)

    def write_batch(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self.buf.append(self.sink._conform(batch))

    def take(self) -> list[Any]:
        out, self.buf = self.buf, []
        return out
