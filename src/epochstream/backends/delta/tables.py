"""Delta table access: paths, the commit log, idempotent transactions, table ownership.

Both Delta writers of epochstream (the state backend and the sink) commit through this
module, so the rules that make their commits exactly-once are written once:

* **Idempotent transactions.** A MERGE or an append runs as the Delta transaction
  (``txnAppId``, ``txnVersion``) = (app id, epoch) and carries ``userMetadata``
  ``{"epochstream": app_id, "epoch": n}``; Delta skips a transaction it has already seen, and
  ``version_of_epoch`` finds the version that holds an epoch in the table's history.
* **Conflicts.** Delta's optimistic-concurrency failures are retried a few times, then
  reported as ``DeltaConflictError``.
* **Ownership.** A table at a target path that epochstream did not create for that purpose
  (``epochstream.format`` and the other properties) is refused before anything is written.
* **Paths.** Local paths and ``file:`` URLs are read directly where that is cheaper (the
  ``_delta_log`` JSON files); object stores (``s3://``, reached by Spark as ``s3a://``) go
  through Spark.

What a process learns about tables (which ones it checked, their typed columns) is held by a
``DeltaTables`` object, one per storage or sink, not by the module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from ...runtime.types import TypeInformation
from ...snapshot.manifest import CheckpointError
from .. import scheme_of, spark_session
from ..typed import spec_of_spark_type

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


# ---------------------------------------------------------------- paths


def is_remote(path: Any) -> bool:
    """Whether a table path is on an object store (``s3://``...) rather than a local path or ``file:``."""
    return scheme_of(str(path)) != "file"


def spark_uri(path: str) -> str:
    """The form Spark's Hadoop filesystems take: s3:// becomes s3a:// (the S3A connector)."""
    if path.startswith("s3://"):
        return "s3a://" + path[len("s3://"):]
    return path if "://" in path else str(Path(path).resolve())


def is_delta_table(path: str) -> bool:
    if is_remote(path):
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(spark_session.get_spark(), spark_uri(path)))
    return (Path(path) / "_delta_log").is_dir()


def path_has_files(path: str) -> bool:
    """Whether a local folder holds anything but a sink's staged output (object stores: never)."""
    if is_remote(path):
        return False  # object stores: only a Delta log counts (checked by is_delta_table)
    p = Path(path)
    return p.is_dir() and any(c.name != STAGING for c in p.iterdir())


def _local_log(table: str) -> Path | None:
    if is_remote(table):
        return None
    log_dir = Path(table.removeprefix("file:")) / "_delta_log"
    return log_dir if log_dir.is_dir() else None


def parquet_bytes(table: pa.Table) -> bytes:
    """An Arrow table as Parquet (zstd): a sink's staged output, a restore's read-back state."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return bytes(sink.getvalue().to_pybytes())


# ---------------------------------------------------------------- the commit log


def commit_meta(app_id: str, epoch: int) -> str:
    """The ``userMetadata`` of the transaction (app_id, epoch): how ``history`` recognises it."""
    return json.dumps({"epochstream": app_id, "epoch": epoch}, sort_keys=True)


def _parse_meta(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def history(table: str) -> list[dict[str, Any]]:
    """Commits of a Delta table, newest first: version, operation, our metadata (or None).

    On a local path the commit files of ``_delta_log`` are read directly (Delta's own
    protocol: one JSON file per version, its ``commitInfo`` carrying ``userMetadata``);
    that takes milliseconds where ``DESCRIBE HISTORY`` runs Spark jobs. Elsewhere
    (object stores), Spark's history is used.
    """
    log_dir = _local_log(table)
    out = _log_history(log_dir) if log_dir is not None else []
    return out or _spark_history(table)


def _log_history(log_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(log_dir.glob("[0-9]*.json"), reverse=True):
        info: dict[str, Any] = {}
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if '"commitInfo"' in line:
                    info = json.loads(line).get("commitInfo", {})
                    break
        out.append({"version": int(f.stem), "operation": info.get("operation"),
                    "meta": _parse_meta(info.get("userMetadata"))})
    return out


def _spark_history(table: str) -> list[dict[str, Any]]:
    from delta.tables import DeltaTable

    spark = spark_session.get_spark()
    rows = DeltaTable.forPath(spark, spark_uri(table)).history().select(
        "version", "operation", "userMetadata").collect()
    return [{"version": int(r["version"]), "operation": r["operation"], "meta": _parse_meta(r["userMetadata"])}
            for r in rows]


def is_transaction(meta: Any, app_id: str, epoch: int | None = None) -> bool:
    """Whether a commit's metadata is our transaction ``app_id`` (at ``epoch``, if given)."""
    return isinstance(meta, dict) and meta.get("epochstream") == app_id and (
        epoch is None or meta.get("epoch") == epoch)


def version_of_epoch(table: str, app_id: str, epoch: int) -> int | None:
    """The Delta version whose commit is the transaction (app_id, epoch), if any."""
    for h in history(table):
        if is_transaction(h["meta"], app_id, epoch):
            return int(h["version"])
    return None


# ---------------------------------------------------------------- transactions


def is_conflict(exc: BaseException) -> bool:
    name = type(exc).__name__ + " " + str(exc)[:400]
    return "Concurrent" in name or "ConcurrentModification" in name or "DELTA_CONCURRENT" in name


#: Delta's optimistic concurrency: a conflicting transaction fails and is retried a few times
_retry_conflicts = retry(
    retry=retry_if_exception(is_conflict),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2.0),
    reraise=True,
)


class AppTransaction:
    """Session settings that make the next Delta DML (MERGE, CREATE) the transaction
    (app_id, epoch), labelled with ``commit_meta``; unset on exit."""

    def __init__(self, spark: Any, app_id: str, epoch: int) -> None:
        self.spark, self.app_id, self.epoch = spark, app_id, epoch

    def __enter__(self) -> None:
        conf = self.spark.conf
        conf.set(_TXN_APP, self.app_id)
        conf.set(_TXN_VERSION, str(self.epoch))
        conf.set(_USER_METADATA, commit_meta(self.app_id, self.epoch))

    def __exit__(self, *exc: object) -> None:
        for k in (_TXN_APP, _TXN_VERSION, _USER_METADATA):
            self.spark.conf.unset(k)


def _commit(action: Callable[[], None], conflict: Callable[[BaseException], str]) -> None:
    """Run a Delta commit, retrying conflicts; one that persists is a ``DeltaConflictError``."""
    try:
        _retry_conflicts(action)()
    except Exception as exc:
        if is_conflict(exc):
            raise DeltaConflictError(conflict(exc)) from exc
        raise


def merge(spark: Any, builder: Any, app_id: str, epoch: int, conflict: Callable[[BaseException], str]) -> None:
    """Execute a ``DeltaMergeBuilder`` as the transaction (app_id, epoch); ``conflict(exc)`` words
    the error if Delta's conflicts persist."""
    def run() -> None:
        with AppTransaction(spark, app_id, epoch):
            builder.execute()

    _commit(run, conflict)


def append(df: Any, table: str, app_id: str, epoch: int, conflict: Callable[[BaseException], str]) -> None:
    """Append a DataFrame to a Delta table as the transaction (app_id, epoch)."""
    def run() -> None:
        (df.write.format("delta").mode("append")
         .option("txnAppId", app_id).option("txnVersion", epoch)
         .option("userMetadata", commit_meta(app_id, epoch)).save(spark_uri(table)))

    _commit(run, conflict)


# ---------------------------------------------------------------- what a writer knows about its tables


class DeltaTables:
    """The Spark session handle of one Delta writer (a state backend or a sink), and what it has
    learned about its tables.

    Owned by the writer, so two writers (or two tests) in one process share nothing. Both
    caches are safe to keep for the writer's life: ``_owned`` only skips a repeated read of
    a table's properties (a later foreign commit shows in the history), and ``_typed`` is
    tied to the table version it was read at.
    """

    def __init__(self) -> None:
        #: (table, format) pairs checked (or created) as epochstream's in this writer
        self._owned: set[tuple[str, str]] = set()
        #: table -> (Delta version, its typed columns at that version); moved to the next version
        #: by ``keep_columns`` when this writer commits without changing the schema
        self._typed: dict[str, tuple[int, dict[str, TypeInformation]]] = {}

    @property
    def spark(self) -> Any:
        """The driver's Spark session (``spark_session.get_spark``: started on first use)."""
        return spark_session.get_spark()

    def open(self, table: str) -> Any:
        """The ``DeltaTable`` at a path."""
        from delta.tables import DeltaTable

        return DeltaTable.forPath(self.spark, spark_uri(table))

    # ------------------------------------------------------------ ownership
    def check_owned(self, table: str, fmt: str, props: dict[str, str], what: str) -> None:
        """Refuse a table at ``table`` that epochstream did not create for this purpose
        (checked once per table and writer; later foreign commits show in the history)."""
        if (table, fmt) in self._owned:
            return
        detail = self.open(table).detail().select("properties").collect()[0]["properties"] or {}
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
        self.mark_owned(table, fmt)

    def mark_owned(self, table: str, fmt: str) -> None:
        """This writer created the table with format ``fmt``: no need to check it."""
        self._owned.add((table, fmt))

    # ------------------------------------------------------------ typed columns
    def typed_columns(self, table: str, version: int) -> dict[str, TypeInformation]:
        """The typed columns (``typed_*``) of a state table whose newest version is ``version``."""
        entry = self._typed.get(table)
        if entry is None or entry[0] != version:
            schema = self.open(table).toDF().schema
            entry = (version, {f.name: TypeInformation.from_json(spec_of_spark_type(f.dataType))
                               for f in schema.fields if f.name.startswith("typed_")})
            self._typed[table] = entry
        return dict(entry[1])

    def keep_columns(self, table: str, before: int, after: int) -> None:
        """This writer's commit ``after`` follows ``before`` directly and left the schema alone:
        the columns known at ``before`` hold at ``after`` (saves a schema read per epoch)."""
        entry = self._typed.get(table)
        if entry is not None and entry[0] == before and after == before + 1:
            self._typed[table] = (after, entry[1])
