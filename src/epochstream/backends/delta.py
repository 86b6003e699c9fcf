"""Delta Lake: committed keyed state and sink output as Delta tables, one transaction per epoch.

Theory of operation (two-phase commit, thesis Table 4.1, with Delta as the commit log):

* **pre-commit** (workers, no Spark): a task's capture is written as a Parquet state file,
  exactly as in the local backend (``LocalCheckpointStorage``); sink output is staged as a
  Parquet file under ``<sink table>/_epochstream_staging`` (Delta readers and VACUUM ignore
  ``_``-prefixed folders). Nothing is visible in any Delta table yet.
* **manifest** (driver): the checkpoint's commit point, as for every backend. It names the
  state files and, for each Delta table, the idempotency key of the transaction it owes:
  ``txnAppId`` (job, operator or sink uid, run lineage for sinks) and ``txnVersion`` (the epoch).
* **commit** (driver, after the manifest): per stateful operator ONE Delta MERGE that makes the
  table equal the operator's committed state at the epoch (upserts, deletes of tombstoned
  keys, and for full captures deletes of keys gone from the captured key-group range); per
  Delta sink ONE append of the epoch's staged files. Both carry ``txnAppId``/``txnVersion``,
  so Delta itself skips a commit re-issued after a crash. The Delta version that holds the
  epoch is then written into the manifest (``manifest["delta"]["state"][uid]["version"]``).
* **recover**: the restored manifest's commits are re-issued (no-ops if they happened), the
  operator state is read back from the Delta table at the recorded version (time travel) and
  handed to the workers as one Parquet file per operator (workers need no Spark).

Who else writes a table is checked before anything is written: a table at the target path
that epochstream did not create (other schema, no ``epochstream.*`` properties, other job or
operator) is refused with a CheckpointError; a commit by another writer between two epochs
is reported the same way (the committed state would no longer be what the checkpoints say).

Layout under the checkpoint dir::

    ROOT/delta/<operator uid>/            Delta table of one operator's committed state
    ROOT/delta/_restore/<table>-v<N>.parquet   state read back for a restore
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from ..snapshot.manifest import CheckpointError, StateFileRef
from ..runtime.types import TypeInformation
from . import scheme_of, spark_session
from .base import Row, TransactionalSink
from .objects import ObjectCheckpointStorage, safe_name
from .typed import declared_columns, spec_of_spark_type, typed_arrays

log = logging.getLogger(__name__)

#: table property naming what wrote a table; anything else at the path is refused
FORMAT_PROPERTY = "epochstream.format"
STATE_FORMAT = "keyed-state-v1"
SINK_FORMAT = "sink-v1"
#: where a Delta sink stages an epoch's output inside its table's folder (Delta ignores ``_`` folders)
STAGING = "_epochstream_staging"

_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


class DeltaConflictError(CheckpointError):
    """Another writer changed a Delta table epochstream commits to."""


def _is_conflict(exc: BaseException) -> bool:
    name = type(exc).__name__ + " " + str(exc)[:400]
    return "Concurrent" in name or "ConcurrentModification" in name or "DELTA_CONCURRENT" in name


#: Delta's optimistic concurrency: a conflicting transaction fails and is retried a few times
_retry_conflicts = retry(
    retry=retry_if_exception(_is_conflict),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2.0),
    reraise=True,
)


def _is_remote(path: Any) -> bool:
    """Whether a table path is on an object store (``s3://``...) rather than a local path or ``file:``."""
    return scheme_of(str(path)) != "file"


def _uri(path: str) -> str:
    """The form Spark's Hadoop filesystems take: s3:// becomes s3a:// (the S3A connector)."""
    if path.startswith("s3://"):
        return "s3a://" + path[len("s3://"):]
    return path if "://" in path else str(Path(path).resolve())


def _is_delta_table(path: str) -> bool:
    if _is_remote(path):
        from delta.tables import DeltaTable

        return DeltaTable.isDeltaTable(spark_session.get_spark(), _uri(path))
    return (Path(path) / "_delta_log").is_dir()


def _path_has_files(path: str) -> bool:
    if _is_remote(path):
        return False  # object stores: only a Delta log counts (checked by _is_delta_table)
    p = Path(path)
    return p.is_dir() and any(c.name != STAGING for c in p.iterdir())


def _commit_meta(app_id: str, epoch: int) -> str:
    return json.dumps({"epochstream": app_id, "epoch": epoch}, sort_keys=True)


class _Txn:
    """Session settings that make the next Delta DML/write idempotent and labelled."""

    def __init__(self, spark: Any, app_id: str, epoch: int) -> None:
        self.spark, self.app_id, self.epoch = spark, app_id, epoch

    def __enter__(self) -> None:
        conf = self.spark.conf
        conf.set(_TXN_APP, self.app_id)
        conf.set(_TXN_VERSION, str(self.epoch))
        conf.set(_USER_METADATA, _commit_meta(self.app_id, self.epoch))

    def __exit__(self, *exc: Any) -> None:
        for k in (_TXN_APP, _TXN_VERSION, _USER_METADATA):
            self.spark.conf.unset(k)


def _local_log(table: str) -> Path | None:
    if _is_remote(table):
        return None
    log_dir = Path(table.removeprefix("file:")) / "_delta_log"
    return log_dir if log_dir.is_dir() else None


def history(table: str) -> list[dict[str, Any]]:
    """Commits of a Delta table, newest first: version, operation, our metadata (or None).

    On a local path the commit files of ``_delta_log`` are read directly (Delta's own
    protocol: one JSON file per version, its ``commitInfo`` carrying ``userMetadata``);
    that takes milliseconds where ``DESCRIBE HISTORY`` runs Spark jobs. Elsewhere
    (object stores), Spark's history is used.
    """
    log_dir = _local_log(table)
    if log_dir is not None:
        out = []
        for f in sorted(log_dir.glob("[0-9]*.json"), reverse=True):
            info: dict[str, Any] = {}
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    if '"commitInfo"' in line:
                        info = json.loads(line).get("commitInfo", {})
                        break
            meta = None
            if info.get("userMetadata"):
                try:
                    meta = json.loads(info["userMetadata"])
                except ValueError:
                    meta = None
            out.append({"version": int(f.stem), "operation": info.get("operation"), "meta": meta})
        if out:
            return out
    from delta.tables import DeltaTable

    spark = spark_session.get_spark()
    rows = DeltaTable.forPath(spark, _uri(table)).history().select("version", "operation", "userMetadata").collect()
    out = []
    for r in rows:
        meta = None
        if r["userMetadata"]:
            try:
                meta = json.loads(r["userMetadata"])
            except ValueError:
                meta = None
        out.append({"version": int(r["version"]), "operation": r["operation"], "meta": meta})
    return out


def version_of_epoch(table: str, app_id: str, epoch: int) -> int | None:
    """The Delta version whose commit is the transaction (app_id, epoch), if any."""
    for h in history(table):
        m = h["meta"]
        if isinstance(m, dict) and m.get("epochstream") == app_id and m.get("epoch") == epoch:
            return h["version"]
    return None


_owned: set[tuple[str, str]] = set()
#: table -> its typed columns, as read from its schema (only epochstream changes them: MERGE
#: schema evolution, after which the entry is dropped)
_schemas: dict[str, dict[str, TypeInformation]] = {}


def _table_columns(table: str) -> dict[str, TypeInformation]:
    """The typed columns (``typed_*``) a state table has now."""
    if table not in _schemas:
        from delta.tables import DeltaTable

        schema = DeltaTable.forPath(spark_session.get_spark(), _uri(table)).toDF().schema
        _schemas[table] = {f.name: TypeInformation.from_json(spec_of_spark_type(f.dataType))
                           for f in schema.fields if f.name.startswith("typed_")}
    return dict(_schemas[table])


def _check_owned(table: str, fmt: str, props: dict[str, str], what: str) -> None:
    """Refuse a table at ``table`` that epochstream did not create for this purpose
    (checked once per table and process; later foreign commits show in the history)."""
    from delta.tables import DeltaTable

    if (table, fmt) in _owned:
        return

    spark = spark_session.get_spark()
    detail = DeltaTable.forPath(spark, _uri(table)).detail().select("properties").collect()[0]["properties"] or {}
    if detail.get(FORMAT_PROPERTY) != fmt:
        raise CheckpointError(
            f"{what}: the Delta table at {table} was not created by epochstream (table property "
            f"{FORMAT_PROPERTY}={detail.get(FORMAT_PROPERTY)!r}, expected {fmt!r}); nothing was written to it. "
            f"Point the job at another path, or move that table away"
        )
    for k, v in props.items():
        if detail.get(k) != v:
            raise CheckpointError(
                f"{what}: the Delta table at {table} belongs to {k}={detail.get(k)!r}, not {v!r}; nothing was "
                f"written to it"
            )
    _owned.add((table, fmt))


class DeltaCheckpointStorage(ObjectCheckpointStorage):
    """Checkpoints whose committed keyed state is also a Delta table per operator.

    State files and manifests live under ``root`` as with the object-store backends (local
    folder or S3: they are the pre-commit and the commit point); the Delta tables under
    ``root/delta`` are the committed state: Spark SQL reads them, with ``VERSION AS OF`` per
    epoch, and a restore reads them back by time travel.
    """

    def __init__(self, where: Any) -> None:
        from . import open_objects

        super().__init__(open_objects(where))
        if _is_remote(self.root):
            spark_session.need_s3a()  # its tables live on S3: the session must carry the S3A jars

    def __repr__(self) -> str:
        return f"DeltaCheckpointStorage({str(self.root)!r})"

    # ------------------------------------------------------------ naming
    def table_path(self, operator: str, root: Any = None) -> str:
        """The Delta table of one operator's committed state (a plain Delta table)."""
        return str((self.root if root is None else root) / "delta" / safe_name(operator))

    @staticmethod
    def app_id(job: str, operator: str) -> str:
        return f"epochstream/{job}/state/{operator}"

    # ------------------------------------------------------------ commit point
    def commit(self, manifest: dict[str, Any]) -> Any:
        """Write the manifest, naming for each operator the Delta transaction it is owed and
        the Delta version that transaction will have.

        epochstream is the table's only writer (its job master commits in epoch order), so
        the version is the table's next one; a commit that lands elsewhere means someone else
        wrote to the table, and is refused (``DeltaConflictError``). The table is created (or
        checked) here, before the checkpoint exists: a foreign table fails the epoch early.
        """
        state = manifest.setdefault("delta", {}).setdefault("state", {})
        epoch = int(manifest["epoch"])
        for uid in sorted(manifest["operators"]):
            table = self.table_path(uid)
            app_id = self.app_id(manifest["job"], uid)
            try:
                declared = declared_columns(manifest["operators"][uid])
            except ValueError as exc:
                raise CheckpointError(f"committed state of operator {uid!r}: {exc}") from None
            self._ensure_table(table, manifest["job"], uid, app_id, declared)
            columns = self._typed_columns(table, uid, declared)
            hist = history(table)
            last = self._last_epoch(hist, app_id, table, f"committed state of operator {uid!r}")
            if last >= epoch:
                raise CheckpointError(
                    f"committed state of operator {uid!r}: the Delta table {table} already holds epoch {last}, "
                    f"newer than the epoch {epoch} being checkpointed; it belongs to another run of job "
                    f"{manifest['job']!r} (restore into a new checkpoint dir, or remove the table)"
                )
            state[uid] = {"table": f"delta/{safe_name(uid)}", "app_id": app_id, "txn_version": epoch,
                          "version": hist[0]["version"] + 1}
            if columns:
                state[uid]["columns"] = {c: t.to_json() for c, t in columns.items()}
        return super().commit(manifest)

    def _typed_columns(self, table: str, uid: str, declared: dict[str, TypeInformation]) -> dict[str, TypeInformation]:
        """The typed columns the epoch's commit writes: the table's and the newly declared ones.

        A column keeps its type for the table's life: a state declared with another type than
        its column has is refused here, before the checkpoint exists (nothing is lost: the
        epoch fails). A column the job no longer declares keeps being filled from its type.
        """
        have = _table_columns(table)
        for col, t in declared.items():
            if col in have and have[col] != t:
                raise CheckpointError(
                    f"committed state of operator {uid!r}: {col} is declared as {t.sql}, but the Delta table {table} "
                    f"holds it as {have[col].sql}; a typed column keeps its type. Declare {have[col].sql}, or "
                    f"restore into a new checkpoint dir (its tables start afresh)"
                )
        return {**have, **declared}

    def _ensure_table(self, table: str, job: str, uid: str, app_id: str,
                      declared: dict[str, TypeInformation] | None = None) -> None:
        from delta.tables import DeltaTable

        what = f"committed state of operator {uid!r}"
        props = {"epochstream.job": job, "epochstream.operator": uid}
        if _is_delta_table(table):
            _check_owned(table, STATE_FORMAT, props, what)
            return
        if _path_has_files(table):
            raise CheckpointError(f"{what}: {table} holds files but is not a Delta table; nothing was written to it")
        spark = spark_session.get_spark()
        builder = DeltaTable.createIfNotExists(spark).location(_uri(table))
        for name, typ in (("key_group", "INT"), ("key", "BINARY"), ("state", "STRING"), ("value", "BINARY"),
                          ("epoch", "BIGINT")):
            builder = builder.addColumn(name, typ, nullable=name == "value")
        for name, t in (declared or {}).items():
            builder = builder.addColumn(name, t.sql, nullable=True)
        builder = builder.property(FORMAT_PROPERTY, STATE_FORMAT)
        for k, v in props.items():
            builder = builder.property(k, v)
        with _Txn(spark, app_id, 0):
            builder.execute()
        _owned.add((table, STATE_FORMAT))
        _schemas.pop(table, None)

    def commit_epoch(self, manifest: dict[str, Any], fail_point: Callable[[str], None] | None = None,
                     root: Any = None, only: set[str] | None = None) -> dict[str, int]:
        """One Delta transaction per operator for the manifest's epoch; idempotent.

        Returns uid -> the Delta version holding the epoch (the one the manifest recorded).
        """
        root = self.root if root is None else root
        versions: dict[str, int] = {}
        for uid, entry in sorted(manifest.get("delta", {}).get("state", {}).items()):
            if only is not None and uid not in only:
                continue
            table = str(root / entry["table"])
            columns = {c: TypeInformation.from_json(t) for c, t in entry.get("columns", {}).items()}
            version = self._commit_operator(manifest, uid, table, entry["app_id"], root, columns)
            if entry.get("version") is not None and version != entry["version"]:
                raise DeltaConflictError(
                    f"committed state of operator {uid!r}: epoch {manifest['epoch']} landed at Delta version "
                    f"{version} of {table}, the manifest recorded {entry['version']}: another writer committed "
                    f"to the table in between"
                )
            versions[uid] = version
            if fail_point is not None:
                fail_point("mid_commit")
        return versions

    def _commit_operator(self, manifest: dict[str, Any], uid: str, table: str, app_id: str, root: Any,
                         columns: dict[str, TypeInformation] | None = None) -> int:
        from delta.tables import DeltaTable

        spark = spark_session.get_spark()
        epoch = int(manifest["epoch"])
        what = f"committed state of operator {uid!r}"
        if not _is_delta_table(table):
            raise CheckpointError(f"{what}: the Delta table {table} is gone; the checkpoint of epoch {epoch} "
                                  f"cannot be committed to it")
        hist = history(table)
        last = self._last_epoch(hist, app_id, table, what)
        if last >= epoch:  # re-issued after a crash: the transaction is there already
            version = next((h["version"] for h in hist if (h["meta"] or {}).get("epochstream") == app_id
                            and (h["meta"] or {}).get("epoch") == epoch), None)
            if version is None:
                raise CheckpointError(
                    f"{what}: the Delta table {table} holds epoch {last} but no transaction for epoch {epoch}; "
                    f"it was written by another run of job {manifest['job']!r} (restore into a new checkpoint dir)"
                )
            return version
        columns = columns or {}
        # a typed column new to the table is filled for every row: the whole state is written
        new = sorted(set(columns) - set(_table_columns(table)))
        source, full_ranges = self._changes(manifest, uid, 0 if new else last, root)
        for col, arr in typed_arrays(source, columns, what).items():
            source = source.append_column(col, arr)
        df = spark.createDataFrame(source)
        cond = "t.key_group = s.key_group AND t.key = s.key AND t.state = s.state"
        merge = DeltaTable.forPath(spark, _uri(table)).alias("t").merge(df.alias("s"), cond)
        if new:  # the columns are added by this same transaction (MERGE schema evolution)
            merge = merge.withSchemaEvolution()
        merge = (
            merge.whenMatchedDelete("s.value IS NULL")
            .whenMatchedUpdateAll()
            .whenNotMatchedInsertAll("s.value IS NOT NULL")
        )
        if full_ranges is None:  # the whole state is replaced (the table holds none of this lineage)
            merge = merge.whenNotMatchedBySourceDelete()
        elif full_ranges:
            merge = merge.whenNotMatchedBySourceDelete(
                " OR ".join(f"(t.key_group BETWEEN {lo} AND {hi})" for lo, hi in full_ranges))

        @_retry_conflicts
        def run() -> None:
            with _Txn(spark, app_id, epoch):
                merge.execute()

        try:
            run()
        except Exception as exc:
            if _is_conflict(exc):
                raise DeltaConflictError(
                    f"{what}: Delta commit of epoch {epoch} to {table} kept conflicting with another writer "
                    f"({type(exc).__name__}); the checkpoint stays complete and the commit is re-issued on recovery"
                ) from exc
            raise
        if new:
            _schemas.pop(table, None)
        version = version_of_epoch(table, app_id, epoch)
        if version is None:  # pragma: no cover - Delta skipped a transaction we did not make
            raise CheckpointError(f"{what}: Delta reports no transaction for epoch {epoch} in {table}")
        return version

    @staticmethod
    def _last_epoch(hist: list[dict[str, Any]], app_id: str, table: str, what: str) -> int:
        """The epoch the table holds, from its newest commit; a commit by anyone else is an error."""
        newest = hist[0]
        meta = newest["meta"]
        if not isinstance(meta, dict) or meta.get("epochstream") != app_id:
            raise DeltaConflictError(
                f"{what}: the Delta table {table} was changed by another writer (version {newest['version']}, "
                f"{newest['operation']}); its content no longer matches the checkpoints, so epochstream does not "
                f"commit on top of it. Restore the table (RESTORE TABLE ... TO VERSION AS OF) or use a new "
                f"checkpoint dir"
            )
        return int(meta["epoch"])

    def _changes(self, manifest: dict[str, Any], uid: str, last: int, root: Any
                 ) -> tuple[pa.Table, list[tuple[int, int]] | None]:
        """The operator's changes after epoch ``last``, folded to one row per (key group, key, state).

        Returns the rows (null value = delete) and the key-group ranges replaced wholesale
        (None: all of them, the table holds nothing of this lineage yet).
        """
        files = [StateFileRef.from_json(f) for f in manifest["operators"][uid]["files"]]
        by_subtask: dict[int, list[StateFileRef]] = {}
        for ref in files:
            by_subtask.setdefault(ref.subtask, []).append(ref)
        full_ranges: list[tuple[int, int]] | None = [] if last > 0 else None
        tables = []
        for subtask, chain in sorted(by_subtask.items()):
            todo = [r for r in chain if r.epoch > last]
            if todo and full_ranges is not None and todo[0].full:
                full_ranges.append(tuple(todo[0].key_group_range))
            for ref in todo:
                t = self.read_state(ref, root)
                tables.append(t.append_column("link", pa.array([len(tables)] * t.num_rows, pa.int32())))
        schema = pa.schema([("key_group", pa.int32()), ("key", pa.binary()), ("state", pa.string()),
                            ("value", pa.binary()), ("link", pa.int32())])
        rows = pa.concat_tables([t.select(schema.names).cast(schema) for t in tables]) if tables else schema.empty_table()
        if rows.num_rows:
            # later links win: number the rows in apply order and keep the last per (key group, key, state)
            rows = rows.append_column("i", pa.array(range(rows.num_rows), pa.int64()))
            last_i = rows.group_by(["key_group", "key", "state"], use_threads=False).aggregate([("i", "max")])
            rows = rows.take(last_i.column("i_max"))
        rows = rows.select(["key_group", "key", "state", "value"])
        rows = rows.append_column("epoch", pa.array([int(manifest["epoch"])] * rows.num_rows, pa.int64()))
        return rows, full_ranges

    # ------------------------------------------------------------ recovery and reading back
    def recover_epoch(self, manifest: dict[str, Any], root: Any,
                      fail_point: Callable[[str], None] | None = None) -> None:
        """Re-issue the restored epoch's Delta commits, then read its state back for the workers."""
        entries = manifest.get("delta", {}).get("state", {})
        if not entries:
            return
        # a checkpoint copied away from its tables (a relocated savepoint) restores from its
        # state files, which are complete; its new epochs go to new tables under this root
        present = {uid for uid, e in entries.items() if _is_delta_table(str(root / e["table"]))}
        for uid in sorted(set(entries) - present):
            log.warning("checkpoint chk-%s: the Delta table of operator %r is not at %s; restoring it from the "
                        "checkpoint's state files", manifest["epoch"], uid, root / entries[uid]["table"])
        self.commit_epoch(manifest, fail_point, root, only=present)
        cache = self.root / "delta" / "_restore"
        keep = set()
        for uid, entry in entries.items():
            if uid not in present:
                continue
            loc = self._cache_location(root, entry)
            keep.add(loc.name)
            if not self.store.exists(loc):
                self.store.put(loc, _parquet_bytes(self._read_table(str(root / entry["table"]), entry["version"])))
        for key in list(self.store.keys(cache)):
            if key not in keep:
                self.store.delete(cache / key)

    def _cache_location(self, root: Any, entry: dict[str, Any]) -> Any:
        digest = hashlib.sha1(str(root / entry["table"]).encode()).hexdigest()[:12]
        return self.root / "delta" / "_restore" / f"{digest}-v{entry['version']}.parquet"

    @staticmethod
    def _read_table(table: str, version: int) -> pa.Table:
        """An operator's committed state at a Delta version (time travel), as Arrow."""
        spark = spark_session.get_spark()
        df = spark.read.format("delta").option("versionAsOf", int(version)).load(_uri(table))
        return df.select("key_group", "key", "state", "value").toArrow()

    def read_operator_rows(self, manifest: dict[str, Any], root: Any, operator: str,
                           key_groups: tuple[int, int] | None = None) -> Iterable[Row]:
        """Rows of an operator's committed state: from its Delta table at the epoch's version."""
        entry = manifest.get("delta", {}).get("state", {}).get(operator)
        if entry is None:  # a checkpoint of the files backend, or an operator without state
            yield from super().read_operator_rows(manifest, root, operator, key_groups)
            return
        root = self.root if root is None else root
        cache = self._cache_location(root, entry)
        if self.store.exists(cache):
            table = pq.read_table(pa.BufferReader(self.store.get(cache)))
        else:
            table_path = str(root / entry["table"])
            if not _is_delta_table(table_path):  # copied away from its tables: the state files are complete
                yield from super().read_operator_rows(manifest, root, operator, key_groups)
                return
            if version_of_epoch(table_path, entry["app_id"], int(entry["txn_version"])) is None:
                raise CheckpointError(
                    f"checkpoint chk-{manifest['epoch']}: the Delta commit of operator {operator!r} has not "
                    f"happened yet; restore the job (recovery re-issues it) before reading its state"
                )
            table = self._read_table(table_path, entry["version"])
        cols = [table.column(n).to_pylist() for n in ("key_group", "key", "state", "value")]
        for row in zip(*cols):
            if key_groups is None or key_groups[0] <= row[0] <= key_groups[1]:
                yield row


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


# ---------------------------------------------------------------- sink


class DeltaSink(TransactionalSink):
    """Exactly-once output to a Delta table: one append transaction per epoch.

    ``schema`` is a pyarrow schema (or a list of (name, type) pairs); records are tuples in
    column order or dicts. Output is staged as Parquet by the workers (pre-commit) and
    appended by the job master after the epoch's manifest, with ``txnAppId`` = job, sink
    uid and run lineage and ``txnVersion`` = epoch, so a re-issued commit is skipped by Delta.
    ``path`` is a local path or an S3 URL (``s3://`` or ``s3a://``).
    """

    #: the job master commits this sink once per epoch (``commit_epoch``), not file by file
    epoch_transactions = True

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema | list[tuple[str, pa.DataType]],
                 table_properties: dict[str, str] | None = None) -> None:
        from . import location

        self.path = str(location(path))
        if _is_remote(self.path):
            spark_session.need_s3a()
        self.schema = schema if isinstance(schema, pa.Schema) else pa.schema(schema)
        self.table_properties = dict(table_properties or {})
        self._app_ids: dict[str, str] = {}
        self._store: Any = None

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _store=None)  # connections are opened again where the sink runs

    @property
    def store(self) -> Any:
        if self._store is None:
            from . import open_objects

            self._store = open_objects(self.path)
        return self._store

    def relocated(self, path: Any) -> "DeltaSink":
        return type(self)(path, self.schema, self.table_properties)

    # ------------------------------------------------------------ records
    def _row(self, record: Any) -> dict[str, Any]:
        if isinstance(record, dict):
            return {n: record.get(n) for n in self.schema.names}
        if isinstance(record, (tuple, list)) and len(record) == len(self.schema):
            return dict(zip(self.schema.names, record))
        raise TypeError(f"sink {self.path}: record {record!r} does not match the columns {self.schema.names}")

    def encoder(self, record: Any) -> str:
        """The canonical text of a record (the oracle compares outputs through it)."""
        return json.dumps(self._row(record), sort_keys=True, default=repr, separators=(",", ":"))

    def writer(self) -> "_RowWriter":
        return _RowWriter()

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Stage an epoch's output as Parquet (workers); returns the path relative to the table."""
        if not records:
            return None
        rows = [self._row(r) for r in records]
        try:
            table = pa.Table.from_pylist(rows, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise TypeError(f"sink {self.path}: records do not fit the schema {self.schema}: {exc}") from exc
        rel = f"{STAGING}/{safe_name(uid)}/e{epoch}-s{subtask}-a{attempt}.parquet"
        self.store.put(self.store.root / rel, _parquet_bytes(table))
        return rel

    def start(self, uid: str, job: str, manifest: dict[str, Any] | None) -> None:
        """At (re)start: continue the restored run's transaction ids, or start a new lineage;
        create the table (or check that it is ours) before any output is staged in it."""
        entry = (manifest or {}).get("sinks", {}).get(uid, {}).get("delta")
        if entry and entry.get("app_id"):
            self._app_ids[uid] = entry["app_id"]
        else:
            self._app_ids[uid] = f"epochstream/{job}/sink/{uid}/{secrets.token_hex(4)}"
        self._check_table()
        if not _is_delta_table(self.path):
            self._create(spark_session.get_spark())

    def manifest_entry(self, uid: str) -> dict[str, Any]:
        return {"table": self.path, "app_id": self._app_ids[uid]}

    def _check_table(self) -> None:
        if _is_delta_table(self.path):
            _check_owned(self.path, SINK_FORMAT, {}, f"Delta sink {self.path}")
            from delta.tables import DeltaTable

            spark = spark_session.get_spark()
            have = [f.name for f in DeltaTable.forPath(spark, _uri(self.path)).toDF().schema.fields]
            if have != self.schema.names:
                raise CheckpointError(
                    f"Delta sink {self.path}: the table has columns {have}, the sink writes {self.schema.names}; "
                    f"nothing was written to it"
                )
        elif _path_has_files(self.path):
            raise CheckpointError(f"Delta sink {self.path}: the folder holds files but is not a Delta table; "
                                  f"nothing was written to it")

    def _create(self, spark: Any) -> None:
        from delta.tables import DeltaTable

        empty = spark.createDataFrame(self.schema.empty_table())
        builder = DeltaTable.createIfNotExists(spark).location(_uri(self.path)).addColumns(empty.schema)
        builder = builder.property(FORMAT_PROPERTY, SINK_FORMAT)
        for k, v in self.table_properties.items():
            builder = builder.property(k, v)
        builder.execute()
        _owned.add((self.path, SINK_FORMAT))

    def commit_epoch(self, uid: str, epoch: int, staged: list[str]) -> int | None:
        """Append the epoch's staged files in ONE transaction; a re-issue is a no-op."""
        app_id = self._app_ids.get(uid)
        if app_id is None:
            raise CheckpointError(f"Delta sink {self.path}: commit of {uid!r} before start()")
        spark = spark_session.get_spark()
        root = self.store.root
        present = [rel for rel in staged if self.store.exists(root / rel)]
        done = version_of_epoch(self.path, app_id, epoch)
        if done is not None:
            self.abort(present)
            return done
        if len(present) != len(staged):
            missing = sorted(set(staged) - set(present))
            raise CheckpointError(
                f"Delta sink {self.path}: staged output {missing[:3]} of epoch {epoch} is gone and was never "
                f"committed; the epoch's output is lost (was the staging folder deleted by hand?)"
            )
        spark_schema = spark.createDataFrame(self.schema.empty_table()).schema
        if present:
            df = spark.read.schema(spark_schema).parquet(*[_uri(str(root / rel)) for rel in present])
        else:
            df = spark.createDataFrame([], spark_schema)

        @_retry_conflicts
        def run() -> None:
            (df.write.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", epoch)
             .option("userMetadata", _commit_meta(app_id, epoch)).save(_uri(self.path)))

        try:
            run()
        except Exception as exc:
            if _is_conflict(exc):
                raise DeltaConflictError(f"Delta sink {self.path}: epoch {epoch} kept conflicting: {exc}") from exc
            raise
        self.abort(present)
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
            self.commit_epoch(uid, epoch, keep)
        folder = self.store.root / STAGING / safe_name(uid)
        for key in list(self.store.keys(folder)):
            self.store.delete(folder / key)

    # ------------------------------------------------------------ reading committed output
    def read(self, version: int | None = None) -> list[dict[str, Any]]:
        """Committed rows (optionally as of a Delta version)."""
        if not _is_delta_table(self.path):
            return []
        spark = spark_session.get_spark()
        reader = spark.read.format("delta")
        if version is not None:
            reader = reader.option("versionAsOf", int(version))
        return reader.load(_uri(self.path)).toArrow().to_pylist()

    def committed_lines_by_epoch(self) -> dict[int, "collections.Counter[str]"]:
        """Encoded output committed by each epoch (each epoch's version minus the one before)."""
        out: dict[int, collections.Counter] = {}
        prev: collections.Counter = collections.Counter()
        for epoch, version in self.epochs():
            cur = collections.Counter(map(self.encoder, self.read(version)))
            out[epoch] = out.get(epoch, collections.Counter()) + (cur - prev)
            prev = cur
        return out

    def epochs(self) -> list[tuple[int, int]]:
        """(epoch, Delta version) of every committed epoch, oldest first."""
        if not _is_delta_table(self.path):
            return []
        out = []
        for h in history(self.path):
            m = h["meta"]
            if isinstance(m, dict) and "/sink/" in str(m.get("epochstream")):
                out.append((int(m["epoch"]), h["version"]))
        return sorted(out, key=lambda ev: ev[1])


class _RowWriter:
    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf: list[Any] = []

    def write(self, records: list[Any]) -> None:
        self.buf.extend(records)

    def take(self) -> list[Any]:
        out, self.buf = self.buf, []
        return out
