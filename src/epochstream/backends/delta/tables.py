"""Delta table access: paths, the commit log, idempotent transactions, table ownership.

Both Delta writers of epochstream (the state backend and the sink) commit through this
module, so the rules that make their commits exactly-once are written once. Commits go
through ``deltalake`` (delta-rs, no JVM); Spark with delta-spark reads the same tables
(SQL, ``VERSION AS OF`` per epoch), and ``spark_uri`` gives the path it takes.

* **Idempotent transactions.** A MERGE or an append carries Delta's app transaction
  (``txn`` action: ``appId`` = app id, ``version`` = epoch, delta-rs
  ``CommitProperties(app_transactions=...)``) and ``userMetadata``
  ``{"epochstream": app_id, "epoch": n}``. Before each attempt the table's transaction
  version for the app id is read: an epoch it already holds is not written again, so a
  commit re-issued after a crash, or retried after an answer that was lost, adds nothing.
  ``version_of_epoch`` finds the version that holds an epoch in the table's history.
* **Conflicts and transient faults.** delta-rs rebases a commit over concurrent appends
  itself; a conflict it cannot resolve (``CommitFailedError``) and transient object-store
  faults are retried a few times (tenacity), then reported as ``DeltaConflictError`` or
  ``DeltaCommitError`` naming the table and epoch.
* **S3.** delta-rs 1.x commits a version with a conditional put (``If-None-Match: *``) of
  its log file, so concurrent writers cannot overwrite each other's commit without a
  locking provider or ``AWS_S3_ALLOW_UNSAFE_RENAME``; moto honours the condition (a test
  shows a second writer of the same version refused). Credentials and the endpoint come
  from the usual ``AWS_*`` variables (``storage_options``).
* **Ownership.** A table at a target path that epochstream did not create for that purpose
  (``epochstream.format`` and the other properties) is refused before anything is written.
  delta-rs refuses unknown properties at CREATE, so they are set by a second commit of the
  same transaction; a table left between the two (a crash) is finished by ``ensure_owned``.
* **Paths.** Local paths and ``file:`` URLs are read directly where that is cheaper (the
  ``_delta_log`` JSON files); object stores go through delta-rs.

What a process learns about tables (which ones it checked, their typed columns) is held by a
``DeltaTables`` object, one per storage or sink, not by the module.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from ...runtime.types import TypeInformation
from ...snapshot.manifest import CheckpointError
from .. import scheme_of

#: table property naming what wrote a table; anything else at the path is refused
FORMAT_PROPERTY = "epochstream.format"
#: a state table's layout: v2 is an append-only changelog (one append per epoch, compacted in the
#: background); v1 (epochstream before the changelog) was the state itself, MERGEd each epoch.
#: A v1 table is a fully compacted changelog, so it is read as it is and upgraded in place.
STATE_FORMAT = "keyed-state-v2"
STATE_FORMAT_V1 = "keyed-state-v1"
#: the ``userMetadata`` key of a compaction commit (the version it folded): not an epoch's transaction
COMPACTED = "compacted"
SINK_FORMAT = "sink-v1"
#: where a Delta sink stages an epoch's output inside its table's folder (Delta ignores ``_`` folders)
STAGING = "_epochstream_staging"


class DeltaConflictError(CheckpointError):
    """Another writer changed a Delta table epochstream commits to."""


class DeltaCommitError(CheckpointError):
    """A Delta commit failed (after retries of transient faults); nothing of it is in the table."""


# ---------------------------------------------------------------- paths


def is_remote(path: Any) -> bool:
    """Whether a table path is on an object store (``s3://``...) rather than a local path or ``file:``."""
    return scheme_of(str(path)) != "file"


def spark_uri(path: str) -> str:
    """The form Spark's Hadoop filesystems take: s3:// becomes s3a:// (the S3A connector)."""
    if path.startswith("s3://"):
        return "s3a://" + path[len("s3://"):]
    return path if "://" in path else str(Path(path).resolve())


def table_uri(path: str) -> str:
    """The form delta-rs takes: ``s3://`` for S3 (also given as s3a://), an absolute local path."""
    path = str(path)
    if path.startswith("s3a://"):
        return "s3://" + path[len("s3a://"):]
    if is_remote(path):
        return path
    return str(Path(path.removeprefix("file://").removeprefix("file:")).resolve())


def storage_options(path: str) -> dict[str, str] | None:
    """delta-rs's object-store settings for a table path, from the ``AWS_*`` variables boto3
    reads too (None for a local path). An ``http://`` endpoint (moto, MinIO) needs
    ``AWS_ALLOW_HTTP``. No locking setting: delta-rs 1.x commits with a conditional put."""
    if not is_remote(path):
        return None
    env = os.environ
    opts = {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN") if env.get(k)}
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        opts["AWS_REGION"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            opts["AWS_ALLOW_HTTP"] = "true"
    return opts


def open_table(path: str, version: int | None = None) -> Any:
    """The delta-rs ``DeltaTable`` at a path (at ``version``: time travel)."""
    from deltalake import DeltaTable

    return DeltaTable(table_uri(path), version=version, storage_options=storage_options(path))


def is_delta_table(path: str) -> bool:
    """Whether a Delta log is at ``path`` (on S3: a listing of ``_delta_log/`` through boto3;
    delta-rs's own check keeps Python's GIL while it waits, which stalls an S3 server that
    runs in the same process, as the tests' moto does)."""
    if is_remote(path):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        store = _remote_store(table_uri(path), endpoint)
        return any(True for _ in store.keys(store.root / "_delta_log"))
    return (Path(path.removeprefix("file:")) / "_delta_log").is_dir()


@functools.lru_cache(maxsize=64)
def _remote_store(uri: str, endpoint: str | None) -> Any:
    """One object-store client per table (and endpoint): a boto3 client costs tens of ms to make."""
    from .. import open_objects

    return open_objects(uri)


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


def put_file(table: str, name: str, body: bytes) -> None:
    """Write a file into a table's folder (not yet part of the table: a commit adds it)."""
    if is_remote(table):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        store = _remote_store(table_uri(table), endpoint)
        store.put(store.root / name, body)
        return
    (Path(table_uri(table)) / name).write_bytes(body)


def read_version(path: str, version: int, columns: list[str] | None = None) -> pa.Table:
    """A table's rows at a Delta version (time travel), as Arrow; transient faults are retried,
    a version that is gone (VACUUMed, log cleaned) is a ``CheckpointError`` naming it."""
    try:
        table: pa.Table = _retry_commit(lambda: open_table(path, version).to_pyarrow_table(columns=columns))()
    except Exception as exc:
        raise CheckpointError(f"Delta table {path}: version {version} cannot be read ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); was the table's history cleaned (VACUUM, log retention)?"
                              ) from exc
    return table


# ---------------------------------------------------------------- the commit log


def commit_meta(app_id: str, epoch: int, extra: dict[str, Any] | None = None) -> str:
    """The ``userMetadata`` of the transaction (app_id, epoch): how ``history`` recognises it
    (``extra``: what else the commit says about itself, e.g. ``replaced``)."""
    return json.dumps({**(extra or {}), "epochstream": app_id, "epoch": epoch}, sort_keys=True)


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
    elsewhere (object stores) delta-rs reads the history.
    """
    log_dir = _local_log(table)
    out = _log_history(log_dir) if log_dir is not None else []
    return out or _rs_history(table)


def _log_history(log_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(log_dir.glob("[0-9]*.json"), reverse=True):
        st = f.stat()
        entry = _commit_entry(str(f), st.st_mtime_ns, st.st_size)
        out.append({**entry, "meta": json.loads(entry["meta"]) if entry["meta"] is not None else None})
    return out


@functools.lru_cache(maxsize=65536)
def _commit_entry(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """One commit file's version, operation and metadata (as JSON text: the cache hands out
    copies). A Delta commit file never changes once written, so it is read once per process;
    the file's mtime and size are part of the key, so a table deleted and made again is read
    afresh. Every epoch reads the history a few times: without this, all of it each time."""
    info: dict[str, Any] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if '"commitInfo"' in line:
                info = json.loads(line).get("commitInfo", {})
                break
    meta = _parse_meta(info.get("userMetadata"))
    return {"version": int(Path(path).stem), "operation": info.get("operation"),
            "meta": json.dumps(meta) if meta is not None else None}


def _rs_history(table: str) -> list[dict[str, Any]]:
    if not is_delta_table(table):
        return []
    rows = open_table(table).history()
    return sorted(({"version": int(r["version"]), "operation": r.get("operation"),
                    "meta": _parse_meta(r.get("userMetadata"))} for r in rows),
                  key=lambda h: -h["version"])


def is_transaction(meta: Any, app_id: str, epoch: int | None = None) -> bool:
    """Whether a commit's metadata is our transaction ``app_id`` (at ``epoch``, if given).

    A compaction commit carries the app id and the epoch it follows (so the newest commit
    still names the table's epoch) but is not that epoch's transaction: with ``epoch`` given
    it does not count."""
    return isinstance(meta, dict) and meta.get("epochstream") == app_id and (
        epoch is None or (meta.get("epoch") == epoch and COMPACTED not in meta))


def is_compaction(meta: Any) -> bool:
    """Whether a commit's metadata is a compaction's (``changelog.compact``)."""
    return isinstance(meta, dict) and "epochstream" in meta and COMPACTED in meta


def version_of_epoch(table: str, app_id: str, epoch: int) -> int | None:
    """The Delta version whose commit is the transaction (app_id, epoch), if any."""
    for h in history(table):
        if is_transaction(h["meta"], app_id, epoch):
            return int(h["version"])
    return None


def content_version(hist: list[dict[str, Any]], version: int) -> int:
    """The version whose content the table has at ``version``: a rollback commit (RESTORE,
    ``restored_to`` in its metadata) has the content of the version it restored."""
    metas = {int(h["version"]): h["meta"] for h in hist}
    seen = set()
    while isinstance(metas.get(version), dict) and "restored_to" in metas[version] and version not in seen:
        seen.add(version)
        version = int(metas[version]["restored_to"])
    return version


def live_epochs(hist: list[dict[str, Any]], owns: Callable[[Any], bool]) -> list[tuple[int, int]]:
    """(epoch, version) of the transactions ``owns`` accepts whose output is in the table's
    current content, oldest first: commits a rollback took back are left out."""
    kept: list[tuple[int, int]] = []
    for h in sorted(hist, key=lambda h: h["version"]):
        m = h["meta"]
        if not owns(m) or is_compaction(m):
            continue
        if "restored_to" in m:
            kept = [(e, v) for e, v in kept if v <= int(m["restored_to"])]
        elif int(m.get("epoch", 0)) > 0:
            kept.append((int(m["epoch"]), int(h["version"])))
    return kept


def roll_back(table: str, version: int, app_id: str, new_app_id: str, epoch: int, what: str
              ) -> tuple[list[int] | None, str]:
    """Make a table's content its content at ``version`` again, after a fallback restore.

    Recovery restored epoch ``epoch`` (transaction ``app_id``, committed at ``version``) while
    the table holds newer epochs of ``app_id``: the replay would write them again. Delta
    RESTORE (delta-rs, one commit) takes their output back; the commit is labelled as
    transaction (``new_app_id``, ``epoch``) with ``restored_to``, so ``history`` tells what
    happened and ``live_epochs``/``content_version`` skip what it took back. Returns the
    epochs rolled back and the app id later epochs carry. When the newest commit already is
    such a rollback to ``version`` (recovery failed again before a new epoch committed), its
    app id is taken over and nothing is written (epochs: None). A commit after ``version``
    that epochstream did not make is not taken back: ``DeltaConflictError``.

    Why a new app id: Delta keeps an app's ``txn`` version across RESTORE (measured on
    delta-rs 1.6.6), so the replayed epochs under the old id would be skipped as done; and
    an app transaction version must never name two contents. Epoch numbers stay (barriers,
    NEOSS and gates count epochs one by one), the app id moves on.
    """
    from deltalake import CommitProperties, Transaction

    hist = history(table)
    newest = hist[0]
    m = newest["meta"]
    if (isinstance(m, dict) and "restored_to" in m and content_version(hist, int(newest["version"])) == version
            and int(m.get("epoch", -1)) == epoch and committed_txn(table, str(m["epochstream"])) <= epoch):
        return None, str(m["epochstream"])
    later = [h for h in hist if int(h["version"]) > version]
    foreign = [h for h in later if not (isinstance(h["meta"], dict) and "epochstream" in h["meta"])]
    if foreign:
        raise DeltaConflictError(
            f"{what}: restoring epoch {epoch} (Delta version {version} of {table}) needs the commits after it "
            f"taken back, but version {foreign[0]['version']} ({foreign[0]['operation']}) was written by another "
            f"writer; epochstream does not undo it. Restore the table yourself (RESTORE TABLE ... TO VERSION AS "
            f"OF {version}) or restore into a new location"
        )
    epochs = sorted({int(h["meta"].get("epoch", 0)) for h in later
                     if "restored_to" not in h["meta"] and int(h["meta"].get("epoch", 0)) > epoch})
    meta = json.dumps({"epochstream": new_app_id, "epoch": epoch, "restored_to": version,
                       "rolled_back": epochs, "from_app": app_id}, sort_keys=True)
    props = CommitProperties(custom_metadata={"userMetadata": meta}, app_transactions=[Transaction(new_app_id, epoch)])

    def run() -> None:
        if committed_txn(table, new_app_id) < epoch:  # a retry after a lost answer finds it done
            open_table(table).restore(version, commit_properties=props)

    try:
        _retry_commit(run)()
    except Exception as exc:
        raise DeltaCommitError(f"{what}: rolling {table} back to version {version} (epoch {epoch}) failed "
                               f"({type(exc).__name__}: {str(exc)[:300]}); recovery tries again") from exc
    return epochs, new_app_id


# ---------------------------------------------------------------- transactions


def is_conflict(exc: BaseException) -> bool:
    """A Delta commit lost to another writer (delta-rs ``CommitFailedError``, Spark's Concurrent*)."""
    name = type(exc).__name__ + " " + str(exc)[:400]
    return ("CommitFailed" in name or "Concurrent" in name or "DELTA_CONCURRENT" in name
            or "Failed to commit transaction" in name)


def is_transient(exc: BaseException) -> bool:
    """An object-store fault worth another try (timeouts, 5xx, dropped connections)."""
    if is_conflict(exc):
        return True
    text = str(exc)[:600].lower()
    return isinstance(exc, OSError) or any(w in text for w in (
        "timed out", "timeout", "connection", "internalerror", "slowdown", "503", "500 internal",
        "service unavailable", "broken pipe", "reset by peer"))


def commit_properties(app_id: str, epoch: int, extra: dict[str, Any] | None = None) -> Any:
    """delta-rs commit properties of the transaction (app_id, epoch): the ``txn`` action and
    the ``userMetadata`` label."""
    from deltalake import CommitProperties, Transaction

    return CommitProperties(custom_metadata={"userMetadata": commit_meta(app_id, epoch, extra)},
                            app_transactions=[Transaction(app_id, epoch)])


#: retries of one commit: Delta conflicts delta-rs could not rebase, and transient store faults
_retry_commit = retry(
    retry=retry_if_exception(is_transient),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2.0),
    reraise=True,
)
#: the same retries, for the commits other modules make (``changelog.commit``)
retry_commit = _retry_commit


def committed_txn(table: str, app_id: str) -> int:
    """The newest epoch of transaction ``app_id`` in the table (-1: none): Delta's ``txn`` record."""
    version = open_table(table).transaction_version(app_id)
    return -1 if version is None else int(version)


def transact(table: str, app_id: str, epoch: int, action: Callable[[Any], None],
             conflict: Callable[[BaseException], str], extra: dict[str, Any] | None = None,
             checked: bool = False, writes_version: bool = False) -> None:
    """Run one commit of the transaction (app_id, epoch) unless the table holds it already.

    ``action(props)`` makes the commit with ``commit_properties``. Each attempt first reads
    the table's transaction version, so a retry after a commit whose answer was lost does
    not commit twice. A conflict that persists is a ``DeltaConflictError`` (``conflict(exc)``
    words it); another failure a ``DeltaCommitError``.

    ``checked``: the caller has just read the log and found no commit of the transaction, so
    the first attempt skips that read; ``writes_version``: the action always writes a version
    (an append of rows), so no read after it looks for one. Each read loads the table (its log
    since the last checkpoint): two of the three loads an epoch's append made.
    """
    tries = [0]

    def attempt() -> None:
        tries[0] += 1
        if not (checked and tries[0] == 1) and committed_txn(table, app_id) >= epoch:
            return  # re-issued, or an earlier attempt landed
        action(commit_properties(app_id, epoch, extra))
        if not writes_version and committed_txn(table, app_id) < epoch:
            # delta-rs writes no version for a MERGE that changes nothing: commit the
            # transaction alone, so every epoch has its version (time travel per epoch)
            dt = open_table(table)
            dt.create_write_transaction([], mode="append", schema=dt.schema(),
                                        commit_properties=commit_properties(app_id, epoch, extra))

    try:
        _retry_commit(attempt)()
    except CheckpointError:
        raise
    except Exception as exc:
        if is_conflict(exc):
            raise DeltaConflictError(conflict(exc)) from exc
        raise DeltaCommitError(f"Delta commit of epoch {epoch} to {table} failed ({type(exc).__name__}: "
                               f"{str(exc)[:300]}); nothing of it is in the table, and recovery re-issues it"
                               ) from exc


def append(data: pa.Table, table: str, app_id: str, epoch: int, conflict: Callable[[BaseException], str],
           evolve: bool = False, replace: bool = False, checked: bool = False) -> None:
    """Append Arrow rows to a Delta table as the transaction (app_id, epoch); ``evolve``: the
    rows bring new columns, added to the table's schema in the same commit; ``replace``: the
    rows replace the table's content (an overwrite, labelled ``"replaced": true``); ``checked``:
    the caller found no commit of the transaction in the log just before (``transact``)."""
    from deltalake import write_deltalake

    def run(props: Any) -> None:
        write_deltalake(table_uri(table), data, mode="overwrite" if replace else "append",
                        storage_options=storage_options(table), commit_properties=props,
                        schema_mode="merge" if evolve else None)

    transact(table, app_id, epoch, run, conflict, {"replaced": True} if replace else None, checked=checked,
             writes_version=data.num_rows > 0)


def add_files(files: list[tuple[str, int, int]], table: str, app_id: str, epoch: int,
              conflict: Callable[[BaseException], str], checked: bool = False) -> None:
    """Commit data files already in the table's folder (``(name, bytes, rows)``, written by the
    workers) as the transaction (app_id, epoch): one Delta version that adds them, so no record
    passes through the committing process. Without files the transaction is committed alone
    (every epoch has its version)."""
    from deltalake.transaction import AddAction

    def run(props: Any) -> None:
        if not files:
            return  # ``transact`` commits the transaction alone
        now = int(time.time() * 1000)
        actions = [AddAction(name, size, {}, now, True, json.dumps({"numRecords": rows}))
                   for name, size, rows in files]
        dt = open_table(table)
        dt.create_write_transaction(actions, mode="append", schema=dt.schema(), commit_properties=props)

    transact(table, app_id, epoch, run, conflict, checked=checked, writes_version=bool(files))


def create(table: str, schema: pa.Schema, properties: dict[str, str], app_id: str) -> None:
    """Create a Delta table as the transaction (app_id, 0), its properties set in a second
    commit of the same transaction (delta-rs refuses unknown properties at CREATE)."""
    from deltalake import DeltaTable

    uri, opts = table_uri(table), storage_options(table)

    def run() -> None:
        if not is_delta_table(table):
            DeltaTable.create(uri, schema, mode="ignore", storage_options=opts,
                              commit_properties=commit_properties(app_id, 0))
        set_properties(table, properties, app_id)

    try:
        _retry_commit(run)()  # both steps check first: a retry redoes only what is missing
    except Exception as exc:
        raise DeltaCommitError(f"Delta table {table}: creating it failed ({type(exc).__name__}: {str(exc)[:300]}); "
                               f"nothing was written to it but possibly the empty table") from exc


def set_properties(table: str, properties: dict[str, str], app_id: str) -> None:
    """Set table properties as a commit of the transaction (app_id, 0), unless they are set."""
    dt = open_table(table)
    have = dt.metadata().configuration
    if all(have.get(k) == v for k, v in properties.items()):
        return
    dt.alter.set_table_properties(properties, raise_if_not_exists=False,
                                  commit_properties=commit_properties(app_id, 0))


def properties(table: str) -> dict[str, str]:
    return dict(open_table(table).metadata().configuration)


def arrow_schema_of(table: str) -> pa.Schema:
    """A table's schema as Arrow."""
    return pa.schema(open_table(table).schema().to_arrow())


def spec_of_arrow_type(dt: pa.DataType) -> Any:
    """An Arrow column type as a ``runtime.types`` JSON spec (the inverse of ``typed.arrow_type``)."""
    t = pa.types
    if t.is_string(dt) or t.is_large_string(dt) or t.is_string_view(dt):
        return "STRING"
    if t.is_binary(dt) or t.is_large_binary(dt) or t.is_binary_view(dt):
        return "BINARY"
    simple = {pa.bool_(): "BOOLEAN", pa.int8(): "TINYINT", pa.int32(): "INT", pa.int64(): "BIGINT",
              pa.float32(): "FLOAT", pa.float64(): "DOUBLE"}
    if dt in simple:
        return simple[dt]
    if t.is_map(dt):
        return {"map": [spec_of_arrow_type(dt.key_type), spec_of_arrow_type(dt.item_type)]}
    if t.is_list(dt) or t.is_large_list(dt) or t.is_list_view(dt):
        return {"list": spec_of_arrow_type(dt.value_type)}
    if t.is_struct(dt):
        return {"row": [[dt.field(i).name, spec_of_arrow_type(dt.field(i).type)] for i in range(dt.num_fields)]}
    raise ValueError(f"column type {dt} is not one epochstream writes")


# ---------------------------------------------------------------- what a writer knows about its tables


class DeltaTables:
    """What one Delta writer (a state backend or a sink) has learned about its tables.

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

    # ------------------------------------------------------------ ownership
    def check_owned(self, table: str, fmt: str, props: dict[str, str], what: str,
                    app_id: str | None = None) -> None:
        """Refuse a table at ``table`` that epochstream did not create for this purpose
        (checked once per table and writer; later foreign commits show in the history).

        A table whose only commit is our creation (``app_id``, epoch 0) but whose properties
        are missing was left by a crash between CREATE and its properties: they are set now.
        """
        if (table, fmt) in self._owned:
            return
        detail = properties(table)
        if detail.get(FORMAT_PROPERTY) is None and app_id is not None:
            hist = history(table)
            if hist and all(is_transaction(h["meta"], app_id, 0) for h in hist):
                set_properties(table, {FORMAT_PROPERTY: fmt, **props}, app_id)
                detail = properties(table)
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

    def is_owned(self, table: str, fmt: str) -> bool:
        """Whether this writer checked (or created) the table as epochstream's with format ``fmt``."""
        return (table, fmt) in self._owned

    def mark_owned(self, table: str, fmt: str) -> None:
        """This writer created the table with format ``fmt``: no need to check it."""
        self._owned.add((table, fmt))

    # ------------------------------------------------------------ typed columns
    def typed_columns(self, table: str, version: int) -> dict[str, TypeInformation]:
        """The typed columns (``typed_*``) of a state table whose newest version is ``version``."""
        entry = self._typed.get(table)
        if entry is None or entry[0] != version:
            schema = pa.schema(open_table(table, version).schema().to_arrow())
            entry = (version, {f.name: TypeInformation.from_json(spec_of_arrow_type(f.type))
                               for f in schema if f.name.startswith("typed_")})
            self._typed[table] = entry
        return dict(entry[1])

    def keep_columns(self, table: str, before: int, after: int) -> None:
        """This writer's commit ``after`` follows ``before`` directly and left the schema alone:
        the columns known at ``before`` hold at ``after`` (saves a schema read per epoch)."""
        entry = self._typed.get(table)
        if entry is not None and entry[0] == before and after == before + 1:
            self._typed[table] = (after, entry[1])
