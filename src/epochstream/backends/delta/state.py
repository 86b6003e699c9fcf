"""The Delta state backend: committed keyed state as one Delta table per stateful operator.

``DeltaCheckpointStorage`` is the object-store backend (local folder or S3) plus the tables:
it owns the state side of the two-phase commit (thesis Table 4.1, Delta as the commit log):

* **pre-commit** (workers, no Spark): a task's capture is written as a Parquet state file,
  exactly as in the object-store backends. Nothing is visible in any Delta table yet.
* **manifest** (driver, ``commit``): the checkpoint's commit point, as for every backend. It
  names the state files and, per operator, the Delta transaction it owes: ``txnAppId``
  (job and operator uid), ``txnVersion`` (the epoch), the Delta version that transaction
  will have and the typed columns it writes (``manifest["delta"]["state"][uid]``). The table
  is created, or checked to be ours, here: a foreign table fails the epoch before it exists.
* **commit** (driver, after the manifest, ``commit_epoch``): per operator ONE Delta append
  through delta-rs (no JVM) of the epoch's changes: a row per changed (key group, key, state)
  with the epoch, a delete as a tombstone (NULL value), and for full captures tombstones of
  the keys gone from the captured key-group range; it carries the app transaction (job and
  operator, epoch) and is skipped if the table holds it already (re-issued after a crash); a
  commit that lands at another version than the manifest recorded means another writer was
  there (``DeltaConflictError``).
* **compaction** (job master, in the background, ``compact``): once a table holds
  ``compact_every`` appends since its last compaction, it is folded into one file, committed
  as its own Delta version when no manifest waits for an append to it (``changelog``).
* **recover** (``recover_epoch``): the restored manifest's commits are re-issued (no-ops if
  they happened), the operator state is read back from the table at the recorded version
  (time travel, delta-rs), folded (``changelog.fold``), and handed to the workers as one
  Parquet file per operator.

Why a changelog and not a MERGE per epoch (the layout before, ``keyed-state-v1``): delta-rs's
MERGE is copy-on-write and rewrote about the whole table each epoch at 100K keys (1.9 s against
0.31 s for an append of the same rows), and the job master waits for the commit. The price is
on the read side: the table is the state only once folded (``read_state`` for Spark SQL,
``state_at`` without Spark), which compaction keeps cheap.

Layout under the checkpoint dir::

    ROOT/delta/<operator uid>/            Delta table of one operator's committed state (a changelog)
    ROOT/delta/_restore/<table>-v<N>.parquet   state read back for a restore
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ...runtime.types import TypeInformation
from ...snapshot.failpoints import FailPointName
from ...snapshot.manifest import CheckpointError, StateFileRef
from .. import spark_session
from ..base import Row
from ..objects import ObjectCheckpointStorage, parquet_table, safe_name
from ..typed import arrow_type, declared_columns, typed_arrays
from . import changelog, tables
from .schema import COLUMNS, ROW_KEY, ROW_NAMES, arrow_schema
from .tables import (
    STATE_FORMAT,
    STATE_FORMAT_V1,
    DeltaConflictError,
    DeltaTables,
    is_delta_table,
    version_of_epoch,
)

log = logging.getLogger(__name__)

#: the appended rows' columns while folding state files: the row columns and the link each came from
_FOLD_SCHEMA = arrow_schema(ROW_NAMES).append(pa.field("link", pa.int32()))


def _what(uid: str) -> str:
    return f"committed state of operator {uid!r}"


class DeltaCheckpointStorage(ObjectCheckpointStorage):
    """Checkpoints whose committed keyed state is also a Delta table per operator.

    State files and manifests live under ``root`` as with the object-store backends (local
    folder or S3: they are the pre-commit and the commit point); the Delta tables under
    ``root/delta`` are the committed state: Spark SQL reads them, with ``VERSION AS OF`` per
    epoch, and a restore reads them back by time travel.
    """

    def __init__(self, where: Any, compact_every: int = 10, compact_in_background: bool = True) -> None:
        from .. import open_objects

        super().__init__(open_objects(where))
        #: compact a table once its changelog holds this many epoch appends since the last
        #: compaction (0: never)
        self.compact_every = compact_every
        #: compact on a thread of the job master (True), or inline after the epoch's commit
        #: (the simulator: one thread, deterministic, and its fail points reach compaction)
        self.compact_in_background = compact_in_background
        #: orders compaction commits with the epochs': held while a manifest names the versions
        #: its epoch's appends will have, and by a compaction's commit
        self._lock = threading.Condition(threading.RLock())
        #: table path -> the epoch whose manifest names its next version, until that epoch's
        #: append is in (a compaction commit in between would take that version)
        self._owed: dict[str, int] = {}
        #: table path -> whether its changelog is due for compaction (set by its latest append)
        self._due: dict[str, bool] = {}
        #: moved on by a recovery: a compaction waiting to commit from before it gives up
        self._generation = 0
        #: the background compactor (one thread, one compaction at a time) and its running work
        self._compactor: ThreadPoolExecutor | None = None
        self._running: dict[str, Future[Any]] = {}
        #: the tables this storage checked and their typed columns
        self.tables = DeltaTables()
        #: operator uid -> the app id its commits carry, when not ``app_id(job, uid)``: continued
        #: from the restored manifest, or a new one after a rollback (``recover_epoch``)
        self._lineage: dict[str, str] = {}
        if tables.is_remote(self.root):
            spark_session.need_s3a()  # Spark reads its tables (SQL, time travel): its session needs S3A

    def __repr__(self) -> str:
        return f"DeltaCheckpointStorage({str(self.root)!r})"

    def __getstate__(self) -> dict[str, Any]:
        """What travels to Spark tasks (which write state files, never commit): not the job
        master's lock, compactor thread and per-epoch bookkeeping, which a copy starts afresh."""
        state = dict(self.__dict__)
        for name in ("_lock", "_compactor", "_running", "_owed", "_due"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Condition(threading.RLock())
        self._compactor = None
        self._running = {}
        self._owed = {}
        self._due = {}

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
        with self._lock:  # no compaction commit between reading the versions and the epoch's appends
            for uid in sorted(manifest["operators"]):
                state[uid] = self._owed_transaction(manifest, uid)
                self._owed[self.table_path(uid)] = int(manifest["epoch"])
            try:
                return super().commit(manifest)
            except BaseException:
                for uid in state:
                    self._owed.pop(self.table_path(uid), None)
                raise

    def _owed_transaction(self, manifest: dict[str, Any], uid: str) -> dict[str, Any]:
        """The manifest entry of the Delta transaction operator ``uid`` is owed for the epoch."""
        epoch, job = int(manifest["epoch"]), manifest["job"]
        table, app_id = self.table_path(uid), self._lineage.get(uid) or self.app_id(job, uid)
        try:
            declared = declared_columns(manifest["operators"][uid])
        except ValueError as exc:
            raise CheckpointError(f"{_what(uid)}: {exc}") from None
        self._ensure_table(table, job, uid, app_id, declared)
        hist = tables.history(table)
        columns = self._typed_columns(table, uid, declared, hist[0]["version"])
        last = self._last_epoch(hist, app_id, table, _what(uid))
        if last >= epoch:
            raise CheckpointError(
                f"{_what(uid)}: the Delta table {table} already holds epoch {last}, newer than the epoch "
                f"{epoch} being checkpointed; it belongs to another run of job {job!r} (restore into a new "
                f"checkpoint dir, or remove the table)"
            )
        entry = {"table": f"delta/{safe_name(uid)}", "app_id": app_id, "txn_version": epoch,
                 "version": hist[0]["version"] + 1}
        if columns:
            entry["columns"] = {c: t.to_json() for c, t in columns.items()}
        return entry

    def _typed_columns(self, table: str, uid: str, declared: dict[str, TypeInformation],
                       version: int) -> dict[str, TypeInformation]:
        """The typed columns the epoch's commit writes: the table's (at ``version``) and the newly
        declared ones.

        A column keeps its type for the table's life: a state declared with another type than
        its column has is refused here, before the checkpoint exists (nothing is lost: the
        epoch fails). A column the job no longer declares keeps being filled from its type.
        """
        have = self.tables.typed_columns(table, version)
        for col, t in declared.items():
            if col in have and have[col] != t:
                raise CheckpointError(
                    f"{_what(uid)}: {col} is declared as {t.sql}, but the Delta table {table} "
                    f"holds it as {have[col].sql}; a typed column keeps its type. Declare {have[col].sql}, or "
                    f"restore into a new checkpoint dir (its tables start afresh)"
                )
        return {**have, **declared}

    def _ensure_table(self, table: str, job: str, uid: str, app_id: str,
                      declared: dict[str, TypeInformation] | None = None) -> None:
        """Create the operator's table, or check that the one at its path is ours."""
        props = {"epochstream.job": job, "epochstream.operator": uid}
        if is_delta_table(table):
            self._upgrade_v1(table, props, app_id, uid)
            self.tables.check_owned(table, STATE_FORMAT, props, _what(uid), app_id)
            return
        if tables.path_has_files(table):
            raise CheckpointError(f"{_what(uid)}: {table} holds files but is not a Delta table; nothing was "
                                  f"written to it")
        self._create_table(table, props, app_id, declared or {})

    def _upgrade_v1(self, table: str, props: dict[str, str], app_id: str, uid: str) -> None:
        """A table of the MERGE layout (``keyed-state-v1``: the state itself, one row per key) is
        a changelog folded already: it becomes ``keyed-state-v2`` in place, by one commit
        labelled as a compaction of its newest version (so no epoch counts it as its own).
        Versions before it read as they did: their fold is their content."""
        if self.tables.is_owned(table, STATE_FORMAT):
            return
        have = tables.properties(table)
        if have.get(tables.FORMAT_PROPERTY) != STATE_FORMAT_V1 or any(have.get(k) != v for k, v in props.items()):
            return  # not a v1 table of this job and operator: check_owned says what it is
        hist = tables.history(table)
        last = self._last_epoch(hist, app_id, table, _what(uid))
        meta = json.dumps({"epochstream": app_id, "epoch": last, tables.COMPACTED: int(hist[0]["version"]),
                           "upgraded_from": STATE_FORMAT_V1}, sort_keys=True)
        from deltalake import CommitProperties

        tables.open_table(table).alter.set_table_properties(
            {tables.FORMAT_PROPERTY: STATE_FORMAT}, raise_if_not_exists=False,
            commit_properties=CommitProperties(custom_metadata={"userMetadata": meta}))
        log.warning("%s: the Delta table %s had the MERGE layout (%s); it is now an append-only changelog (%s)",
                    _what(uid), table, STATE_FORMAT_V1, STATE_FORMAT)

    def _create_table(self, table: str, props: dict[str, str], app_id: str,
                      declared: dict[str, TypeInformation]) -> None:
        """Create a state table (as the transaction (app_id, 0), so it counts as ours in its history)."""
        fields = [pa.field(c.name, c.arrow, nullable=c.nullable) for c in COLUMNS]
        fields += [pa.field(name, arrow_type(t), nullable=True) for name, t in declared.items()]
        tables.create(table, pa.schema(fields), {tables.FORMAT_PROPERTY: STATE_FORMAT, **props}, app_id)
        self.tables.mark_owned(table, STATE_FORMAT)

    # ------------------------------------------------------------ commit
    def commit_epoch(self, manifest: dict[str, Any], fail_point: Callable[[str], None] | None = None,
                     root: Any = None, only: set[str] | None = None, compact: bool = True) -> dict[str, int]:
        """One Delta transaction per operator for the manifest's epoch; idempotent. Then the
        tables whose changelog is due are compacted (``compact``: not during a recovery).

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
                    f"{_what(uid)}: epoch {manifest['epoch']} landed at Delta version {version} of {table}, the "
                    f"manifest recorded {entry['version']}: another writer committed to the table in between"
                )
            versions[uid] = version
            with self._lock:
                if self._owed.get(table, -1) <= int(manifest["epoch"]):
                    self._owed.pop(table, None)
                self._lock.notify_all()
            if fail_point is not None:
                fail_point(FailPointName.MID_COMMIT)
        for uid, entry in sorted(manifest.get("delta", {}).get("state", {}).items()):
            table = str(root / entry["table"])
            if compact and uid in versions and str(root) == str(self.root) and self._due.pop(table, False):
                self._compact_later(table, self._lineage.get(uid) or entry["app_id"], fail_point)
        return versions

    # ------------------------------------------------------------ compaction
    def _compact_later(self, table: str, app_id: str, fail_point: Callable[[str], None] | None) -> None:
        """Compact a table whose changelog is due: on the compactor thread, or now (inline)."""
        if not self.compact_in_background:
            self.compact(table, app_id, fail_point)
            return
        running = self._running.get(table)
        if running is not None and not running.done():
            return  # one at a time per table: the next epoch finds it due again
        if self._compactor is None:
            self._compactor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epochstream-compact")
        self._running[table] = self._compactor.submit(self._compact_quietly, table, app_id)

    def _compact_quietly(self, table: str, app_id: str) -> int | None:
        try:
            return self.compact(table, app_id)
        except Exception as exc:  # an optimisation: the table is whole without it, the next one retries
            log.warning("compaction of %s failed (%s: %s); the changelog stays as it is", table,
                        type(exc).__name__, str(exc)[:300])
            return None

    def compact(self, table: str, app_id: str, fail_point: Callable[[str], None] | None = None,
                wait: float = 120.0) -> int | None:
        """Fold the table's changelog into one file, as its own Delta version (``changelog``).

        The fold and the file are made without the lock; the commit waits (up to ``wait``
        seconds) until no epoch's manifest has named the table's next version, and holds the
        lock so that no manifest does meanwhile. Returns the compaction's version, or None
        when there was nothing to do or the table moved on (a rollback, a foreign commit).
        """
        if fail_point is not None:
            fail_point(FailPointName.BEFORE_COMPACTION)
        plan = changelog.plan(table, app_id)
        if plan is None:
            return None
        if fail_point is not None:
            fail_point(FailPointName.COMPACTION)  # the folded file is written, not committed: Delta ignores it
        with self._lock:
            generation = self._generation
            if not self._lock.wait_for(lambda: table not in self._owed or self._generation != generation,
                                       timeout=wait) or self._generation != generation:
                log.info("compaction of %s skipped: an epoch's commit to it is pending", table)
                return None
            version = changelog.commit(plan)
        if version is not None:
            log.info("compacted %s: %d rows at version %d (epoch %d) folded to %d, as version %d", table,
                     plan.rows_before, plan.base_version, plan.epoch, plan.rows_after, version)
        return version

    def wait_for_compactions(self) -> None:
        """Wait until background compactions finish (before a recovery touches the tables)."""
        for fut in list(self._running.values()):
            fut.result()
        self._running.clear()

    def close(self) -> None:
        """Let a running compaction finish and stop the compactor thread."""
        self.wait_for_compactions()
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)
            self._compactor = None

    def _commit_operator(self, manifest: dict[str, Any], uid: str, table: str, app_id: str, root: Any,
                         columns: dict[str, TypeInformation] | None = None) -> int:
        """ONE append of the operator's changes since the table's epoch (the changelog); the
        version holding the epoch."""
        epoch = int(manifest["epoch"])
        if not is_delta_table(table):
            raise CheckpointError(f"{_what(uid)}: the Delta table {table} is gone; the checkpoint of epoch {epoch} "
                                  f"cannot be committed to it")
        hist = tables.history(table)
        done = next((int(h["version"]) for h in hist if tables.is_transaction(h["meta"], app_id, epoch)), None)
        if done is not None:  # re-issued (after a crash, or a rollback since): the transaction is there
            return done
        last = self._last_epoch(hist, app_id, table, _what(uid))
        if last >= epoch:  # re-issued after a crash: the transaction is there already
            return self._reissued_version(hist, app_id, epoch, last, table, uid, manifest["job"])
        columns = columns or {}
        before = hist[0]["version"]
        # a typed column new to the table is filled for every row: the whole state is written
        new = sorted(set(columns) - set(self.tables.typed_columns(table, before)))
        source, full_ranges, replace = self._changes(manifest, uid, 0 if new else last, root)
        if replace:  # the whole state: it replaces the table's content, so no tombstone is needed
            source = source.filter(pc.is_valid(source.column("value")))
        else:
            source = self._with_tombstones(table, source, full_ranges, epoch)
        for col, arr in typed_arrays(source, columns, _what(uid)).items():
            source = source.append_column(col, arr)
        tables.append(source, table, app_id, epoch, lambda exc: (
            f"{_what(uid)}: Delta commit of epoch {epoch} to {table} kept conflicting with another writer "
            f"({type(exc).__name__}); the checkpoint stays complete and the commit is re-issued on recovery"),
            evolve=bool(new), replace=replace, checked=True)
        version = version_of_epoch(table, app_id, epoch)
        if version is None:  # pragma: no cover - Delta skipped a transaction we did not make
            raise CheckpointError(f"{_what(uid)}: Delta reports no transaction for epoch {epoch} in {table}")
        if not new:
            self.tables.keep_columns(table, before, version)
        self._due[table] = changelog.changelog_length(hist) + 1 >= self.compact_every > 0
        return version

    @staticmethod
    def _with_tombstones(table: str, source: pa.Table, full_ranges: list[tuple[int, int]] | None,
                         epoch: int) -> pa.Table:
        """The epoch's changes plus a tombstone for every key the table holds in a key-group range
        captured whole (``full_ranges``; None: all) that the capture no longer has."""
        if full_ranges is not None and not full_ranges:
            return source
        gone = changelog.missing_keys(table, full_ranges, source)
        if not gone.num_rows:
            return source
        n = gone.num_rows
        tomb = pa.table({"key_group": gone.column("key_group"), "key": gone.column("key"),
                         "state": gone.column("state"), "value": pa.nulls(n, pa.binary()),
                         "epoch": pa.nulls(n, pa.int64()).fill_null(epoch)}).cast(source.schema)
        return pa.concat_tables([source, tomb])

    @staticmethod
    def _reissued_version(hist: list[dict[str, Any]], app_id: str, epoch: int, last: int, table: str,
                          uid: str, job: str) -> int:
        """The version of a transaction already in the table (a commit re-issued after a crash)."""
        version = next((h["version"] for h in hist if tables.is_transaction(h["meta"], app_id, epoch)), None)
        if version is None:
            raise CheckpointError(
                f"{_what(uid)}: the Delta table {table} holds epoch {last} but no transaction for epoch {epoch}; "
                f"it was written by another run of job {job!r} (restore into a new checkpoint dir)"
            )
        return int(version)

    @staticmethod
    def _last_epoch(hist: list[dict[str, Any]], app_id: str, table: str, what: str) -> int:
        """The epoch the table holds, from its newest commit; a commit by anyone else is an error."""
        newest = hist[0]
        meta = newest["meta"]
        if not tables.is_transaction(meta, app_id):
            raise DeltaConflictError(
                f"{what}: the Delta table {table} was changed by another writer (version {newest['version']}, "
                f"{newest['operation']}); its content no longer matches the checkpoints, so epochstream does not "
                f"commit on top of it. Restore the table (RESTORE TABLE ... TO VERSION AS OF) or use a new "
                f"checkpoint dir"
            )
        return int(meta["epoch"])

    def _changes(self, manifest: dict[str, Any], uid: str, last: int, root: Any
                 ) -> tuple[pa.Table, list[tuple[int, int]] | None, bool]:
        """The operator's changes after epoch ``last``, folded to one row per (key group, key, state).

        Returns the rows (null value = delete), the key-group ranges captured wholesale
        (None: all of them, the table holds nothing of this lineage yet), and whether the rows
        are the whole state (every subtask's changes start with a full capture, or ``last`` is
        0): then the epoch's commit replaces the table's content instead of appending, which
        compacts the changelog for free (a full snapshot is the materialisation, as in FLIP-158).
        """
        by_subtask: dict[int, list[StateFileRef]] = {}
        for ref in map(StateFileRef.from_json, manifest["operators"][uid]["files"]):
            by_subtask.setdefault(ref.subtask, []).append(ref)
        full_ranges: list[tuple[int, int]] | None = [] if last > 0 else None
        todos = {s: [r for r in chain if r.epoch > last] for s, chain in sorted(by_subtask.items())}
        # one capture per subtask, all of one epoch (the usual epoch): its rows are unique per
        # (key, state) and the subtasks own disjoint key groups, so there is nothing to fold
        single = len({r.epoch for todo in todos.values() for r in todo}) <= 1 and all(
            len(todo) <= 1 for todo in todos.values())
        whole = full_ranges is None or (bool(todos) and all(todo and todo[0].full for todo in todos.values()))
        links: list[pa.Table] = []
        for todo in todos.values():
            if todo and full_ranges is not None and todo[0].full:
                lo, hi = todo[0].key_group_range
                full_ranges.append((lo, hi))
            for ref in todo:
                t = self.read_state(ref, root)
                links.append(t.append_column("link", changelog.constant(t.num_rows, len(links), pa.int32())))
        if single and links:
            rows = pa.concat_tables([t.select(_FOLD_SCHEMA.names).cast(_FOLD_SCHEMA) for t in links])
        else:
            rows = self._fold(links)
        rows = rows.select(list(ROW_NAMES))
        epochs = changelog.constant(rows.num_rows, int(manifest["epoch"]), arrow_schema(("epoch",)).field("epoch").type)
        return rows.append_column("epoch", epochs), full_ranges, whole

    @staticmethod
    def _fold(links: list[pa.Table]) -> pa.Table:
        """State-file links in apply order, folded: the last row per (key group, key, state) wins."""
        if not links:
            return _FOLD_SCHEMA.empty_table()
        rows = pa.concat_tables([t.select(_FOLD_SCHEMA.names).cast(_FOLD_SCHEMA) for t in links])
        if not rows.num_rows:
            return rows
        rows = rows.append_column("i", changelog.row_numbers(rows.num_rows))
        last_i = rows.group_by(list(ROW_KEY), use_threads=False).aggregate([("i", "max")])
        return rows.take(last_i.column("i_max"))

    # ------------------------------------------------------------ recovery and reading back
    def recover_epoch(self, manifest: dict[str, Any], root: Any,
                      fail_point: Callable[[str], None] | None = None) -> None:
        """Re-issue the restored epoch's Delta commits, then read its state back for the workers."""
        entries = manifest.get("delta", {}).get("state", {})
        if not entries:
            return
        # a checkpoint copied away from its tables (a relocated savepoint) restores from its
        # state files, which are complete; its new epochs go to new tables under this root
        present = {uid for uid, e in entries.items() if is_delta_table(str(root / e["table"]))}
        for uid in sorted(set(entries) - present):
            log.warning("checkpoint chk-%s: the Delta table of operator %r is not at %s; restoring it from the "
                        "checkpoint's state files", manifest["epoch"], uid, root / entries[uid]["table"])
        self.commit_epoch(manifest, fail_point, root, only=present, compact=False)
        self._lineage = {}
        if str(root) == str(self.root):  # another dir's tables are not ours to roll back: ours start afresh
            self._lineage = {uid: entries[uid]["app_id"] for uid in present}
            for uid in sorted(present):
                self._roll_back(manifest, uid, entries[uid], root)
        self._fill_restore_cache(root, [entries[uid] for uid in present])

    def _roll_back(self, manifest: dict[str, Any], uid: str, entry: dict[str, Any], root: Any) -> None:
        """After a fallback restore (a newer checkpoint's manifest damaged, or an older one
        restored into the same dir): the table holds epochs after the restored one. RESTORE it
        to the restored epoch's version, and commit later epochs under a new app id, since
        Delta would skip the replayed epochs as done under the old one (``tables.roll_back``)."""
        epoch, table, app_id = int(manifest["epoch"]), str(root / entry["table"]), entry["app_id"]
        if tables.committed_txn(table, app_id) <= epoch:
            return  # nothing after the restored epoch was ever committed under this app id
        new_app_id = f"{self.app_id(manifest['job'], uid)}/r{secrets.token_hex(4)}"
        epochs, self._lineage[uid] = tables.roll_back(table, int(entry["version"]), app_id, new_app_id, epoch,
                                                      _what(uid))
        log.warning("%s: restored epoch %d is older than the Delta table's epochs %s; %s; later epochs commit "
                    "as transaction %s", _what(uid), epoch, epochs if epochs is not None else "(taken back already)",
                    f"restored {table} to version {entry['version']}" if epochs is not None else
                    "its content already is that version's", self._lineage[uid])

    def recover(self, restored_epoch: int | None) -> None:
        with self._lock:  # a compaction waiting for an epoch that failed gives up
            self._generation += 1
            self._lock.notify_all()
        self.wait_for_compactions()  # a recovery may roll tables back: no compaction in flight
        with self._lock:
            self._owed.clear()
            self._due.clear()
        if restored_epoch is None:
            self._lineage = {}  # a fresh start: every operator's commits carry app_id(job, uid)
        super().recover(restored_epoch)

    def _fill_restore_cache(self, root: Any, entries: list[dict[str, Any]]) -> None:
        """Read each table back at its recorded version into ``delta/_restore``; drop older reads."""
        keep = set()
        for entry in entries:
            loc = self._cache_location(root, entry)
            keep.add(loc.name)
            if not self.store.exists(loc):
                self.store.put(loc, tables.parquet_bytes(self._read_table(
                    str(root / entry["table"]), entry["version"], int(entry["txn_version"]))))
        cache = self.root / "delta" / "_restore"
        for key in list(self.store.keys(cache)):
            if key not in keep:
                self.store.delete(cache / key)

    def _cache_location(self, root: Any, entry: dict[str, Any]) -> Any:
        digest = hashlib.sha1(str(root / entry["table"]).encode()).hexdigest()[:12]
        return self.root / "delta" / "_restore" / f"{digest}-v{entry['version']}.parquet"

    @staticmethod
    def _read_table(table: str, version: int, epoch: int) -> pa.Table:
        """An operator's committed state at epoch ``epoch``, committed as Delta version ``version``:
        the changelog read at that version (time travel, delta-rs), folded (``changelog.fold``).
        The version holds no later epoch; the bound makes the read say what it means."""
        rows = tables.read_version(table, int(version), [*ROW_NAMES, "epoch"])
        return changelog.fold(rows, epoch).select(list(ROW_NAMES)).cast(arrow_schema(ROW_NAMES))

    def native_checkpoint(self, manifest: dict[str, Any], root: Any, operator: str,
                          key_groups: tuple[int, int]) -> tuple[StateFileRef, bytes, Any] | None:
        if manifest.get("delta", {}).get("state", {}).get(operator) is not None:
            return None  # the committed state is the Delta table's
        return super().native_checkpoint(manifest, root, operator, key_groups)

    def read_operator_rows(self, manifest: dict[str, Any], root: Any, operator: str,
                           key_groups: tuple[int, int] | None = None) -> Iterable[Row]:
        """Rows of an operator's committed state: from its Delta table at the epoch's version."""
        entry = manifest.get("delta", {}).get("state", {}).get(operator)
        root = self.root if root is None else root
        table = None if entry is None else self._committed_state(manifest, root, operator, entry)
        if table is None:  # a checkpoint of the files backend, an operator without state, or copied away
            yield from super().read_operator_rows(manifest, root, operator, key_groups)
            return
        cols = [table.column(n).to_pylist() for n in ROW_NAMES]
        for row in zip(*cols, strict=True):
            if key_groups is None or key_groups[0] <= row[0] <= key_groups[1]:
                yield row

    def _committed_state(self, manifest: dict[str, Any], root: Any, operator: str,
                         entry: dict[str, Any]) -> pa.Table | None:
        """An operator's state at the checkpoint: the restore's read-back, else its table (None: the
        checkpoint was copied away from its tables, and its state files are complete)."""
        cache = self._cache_location(root, entry)
        if self.store.exists(cache):
            return parquet_table(self.store.get(cache))
        table_path = str(root / entry["table"])
        if not is_delta_table(table_path):
            return None
        if version_of_epoch(table_path, entry["app_id"], int(entry["txn_version"])) is None:
            raise CheckpointError(
                f"checkpoint chk-{manifest['epoch']}: the Delta commit of operator {operator!r} has not "
                f"happened yet; restore the job (recovery re-issues it) before reading its state"
            )
        return self._read_table(table_path, entry["version"], int(entry["txn_version"]))
