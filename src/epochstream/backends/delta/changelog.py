"""A state table as an append-only changelog: folding it to state, and compacting it.

Each epoch appends its changes to the operator's table (one Delta version per epoch): one row
per changed (key group, key, state) with the epoch that wrote it, ``value`` NULL for a delete
(a tombstone). The committed state at epoch n is therefore

    the newest row per (key group, key, state) with epoch <= n, tombstones dropped

(``fold``), read from the Delta version that holds epoch n (time travel). An append costs
what the epoch changed; a MERGE rewrote every file holding a changed key, about the whole
table at 100K keys (1.9 s against 0.31 s).

An epoch whose captures are all full (the first, after a restore or rescale, every
``full_every``-th) holds the whole state: its commit replaces the table's content instead
(``"replaced": true``), a compaction for free, as a full snapshot is a materialisation in
Flink's changelog state backend (FLIP-158).

**Compaction** keeps reads short between those: it folds the table as of one version V (the newest, epoch
n) into one file and commits, as its own Delta version, the removal of V's files and the
addition of that file. Rows appended after V stay (their files are not removed), so the fold
of the compacted table equals the fold of the changelog for every epoch >= n; epochs before
n are read at their own versions, whose files Delta keeps (nothing here VACUUMs). The heavy
part (read, fold, write the file) needs no lock; only the commit is ordered with the epochs
(``DeltaCheckpointStorage``), because the manifest names the version an epoch will get.

A compaction commit carries ``userMetadata`` ``{"epochstream": app_id, "epoch": n,
"compacted": V, "token": ...}`` and no app transaction: ``tables.is_transaction`` with an
epoch skips it, and the newest commit still names the table's epoch. The token makes a
retried commit (a lost answer) find itself in the history instead of committing twice.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ...snapshot.manifest import CheckpointError
from . import tables
from .schema import ROW_KEY

#: columns whose min/max a compacted file's Delta stats record (Spark and delta-rs skip files by them)
_STAT_COLUMNS = ("key_group", "epoch")


def fold(rows: pa.Table, upto: int | None = None) -> pa.Table:
    """The state a changelog holds at epoch ``upto`` (None: its newest): the newest row per
    (key group, key, state) with ``epoch <= upto``, tombstones (NULL value) dropped.

    Within one epoch a key has one row (``DeltaCheckpointStorage._changes`` folds an epoch's
    captures), so the newest row is unique. Keeps every column of ``rows``.
    """
    if upto is not None:
        rows = rows.filter(pc.less_equal(rows.column("epoch"), upto))
    if not rows.num_rows:
        return rows
    ordered = rows.sort_by([("epoch", "ascending")])  # stable: equal epochs keep their order
    ordered = ordered.append_column("_i", row_numbers(ordered.num_rows))
    newest = ordered.group_by(list(ROW_KEY), use_threads=False).aggregate([("_i", "max")]).column("_i_max")
    latest = ordered.take(pc.take(newest, pc.sort_indices(newest)))  # in epoch order: deterministic
    latest = latest.filter(pc.is_valid(latest.column("value")))
    return latest.drop_columns(["_i"])


def constant(n: int, value: int, type: pa.DataType) -> pa.Array:
    """``n`` copies of ``value``, built in Arrow (no Python list)."""
    return pa.nulls(n, type).fill_null(pa.scalar(value, type))


def row_numbers(n: int) -> pa.Array:
    """0..n-1 as int64, built in Arrow (``pa.array(range(n))`` costs ~1.5 us a row in Python)."""
    return pc.subtract(pc.cumulative_sum(pc.cast(pc.is_null(pa.nulls(n, pa.int8())), pa.int64())), 1)


def missing_keys(table: str, ranges: list[tuple[int, int]] | None, have: pa.Table) -> pa.Table:
    """The distinct (key group, key, state) of a state table's newest version, within the
    key-group ``ranges`` (None: all), that ``have`` (an epoch's rows) does not hold: what a
    full capture of those ranges must tombstone. Keys deleted already are included (a second
    tombstone is harmless, and compaction drops both); no fold is needed, so this is a read
    of the key columns and one hash anti-join."""
    rows = pa.table(tables.open_table(table).to_pyarrow_table(columns=list(ROW_KEY)))
    if ranges is not None:
        kg = rows.column("key_group")
        mask = None
        for lo, hi in ranges:
            m = pc.and_(pc.greater_equal(kg, lo), pc.less_equal(kg, hi))
            mask = m if mask is None else pc.or_(mask, m)
        rows = rows.filter(mask) if mask is not None else rows.slice(0, 0)
    if not rows.num_rows:
        return rows
    keys = rows.group_by(list(ROW_KEY), use_threads=False).aggregate([]).select(list(ROW_KEY))
    have = have.select(list(ROW_KEY)).cast(keys.schema)
    return keys.join(have, list(ROW_KEY), join_type="left anti", use_threads=False)


@dataclass
class CompactionPlan:
    """A compaction prepared off the epochs' path: the folded file written, not yet committed."""

    table: str
    app_id: str
    #: the version folded, and the epoch it holds
    base_version: int
    epoch: int
    #: (path, size) of the data files of ``base_version``: the commit removes them
    files: list[tuple[str, int]]
    #: the compacted file (relative path), its size and Delta stats; None: the fold is empty
    added: tuple[str, int, str] | None
    rows_before: int
    rows_after: int
    token: str = field(default_factory=lambda: secrets.token_hex(6))

    def meta(self) -> str:
        return json.dumps({"epochstream": self.app_id, "epoch": self.epoch, tables.COMPACTED: self.base_version,
                           "token": self.token, "rows": [self.rows_before, self.rows_after]}, sort_keys=True)


def plan(table: str, app_id: str) -> CompactionPlan | None:
    """Fold the table's newest version into one file (written into the table's folder, not
    yet part of the table). None: nothing to gain (one file without superseded rows), or the
    newest commit is not ours (a foreign writer: the next epoch reports it)."""
    hist = tables.history(table)
    newest = hist[0]
    if not tables.is_transaction(newest["meta"], app_id):
        return None
    version, epoch = int(newest["version"]), int(newest["meta"]["epoch"])
    dt = tables.open_table(table, version)
    actions = pa.table(dt.get_add_actions(flatten=True))
    files = list(zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(), strict=True))
    schema = pa.schema(dt.schema().to_arrow())
    data = pa.table(dt.to_pyarrow_table())
    folded = fold(data)
    if len(files) <= 1 and folded.num_rows == data.num_rows:
        return None
    added = None
    if folded.num_rows:
        folded = folded.select(schema.names).cast(schema)
        name = f"part-00000-compacted-v{version}-{secrets.token_hex(8)}.zstd.parquet"
        body = tables.parquet_bytes(folded)
        tables.put_file(table, name, body)
        added = (name, len(body), _stats(folded))
    return CompactionPlan(table, app_id, version, epoch, files, added, data.num_rows, folded.num_rows)


def _stats(rows: pa.Table) -> str:
    """Delta file statistics of a compacted file: record count, min/max and null counts of the
    columns readers skip files by (exact: a wrong bound would hide rows from them)."""
    mins, maxs, nulls = {}, {}, {}
    for c in _STAT_COLUMNS:
        col = rows.column(c)
        mm = pc.min_max(col).as_py()
        mins[c], maxs[c] = mm["min"], mm["max"]
        nulls[c] = col.null_count
    nulls["value"] = rows.column("value").null_count
    return json.dumps({"numRecords": rows.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def commit(p: CompactionPlan) -> int | None:
    """Commit a prepared compaction as one Delta version: V's files removed, the folded file
    added; files appended after V are left alone. Returns the version, or None when the table
    moved in a way the plan does not cover (a rollback, another compaction, a foreign commit):
    the written file is then left unreferenced (Delta ignores it; VACUUM removes it).

    The caller orders this with the epochs' commits (no epoch owed to the table).
    """
    from deltalake import CommitProperties
    from deltalake.transaction import AddAction, RemoveAction

    hist = tables.history(p.table)
    done = next((h for h in hist if isinstance(h["meta"], dict) and h["meta"].get("token") == p.token), None)
    if done is not None:
        return int(done["version"])
    later = [h for h in hist if int(h["version"]) > p.base_version]
    if not all(tables.is_transaction(h["meta"], p.app_id) and not tables.is_compaction(h["meta"])
               and "restored_to" not in h["meta"] for h in later):
        return None
    now = int(time.time() * 1000)
    actions: list[Any] = [RemoveAction(path, True, now, size=size, partition_values={}) for path, size in p.files]
    if p.added is not None:
        name, size, stats = p.added
        actions.append(AddAction(name, size, {}, now, True, stats))
    props = CommitProperties(custom_metadata={"userMetadata": p.meta()})

    def run() -> None:
        if any(isinstance(h["meta"], dict) and h["meta"].get("token") == p.token for h in tables.history(p.table)):
            return  # a retry after a lost answer: the commit is there
        dt = tables.open_table(p.table)
        dt.create_write_transaction(actions, mode="append", schema=dt.schema(), commit_properties=props)

    try:
        tables.retry_commit(run)()
    except Exception as exc:
        if tables.is_conflict(exc):
            raise tables.DeltaConflictError(
                f"compaction of {p.table} (version {p.base_version}, epoch {p.epoch}) conflicted with another "
                f"writer ({type(exc).__name__}); nothing of it is in the table") from exc
        raise CheckpointError(f"compaction of {p.table} failed ({type(exc).__name__}: {str(exc)[:300]}); "
                              f"nothing of it is in the table") from exc
    found = next((h for h in tables.history(p.table) if isinstance(h["meta"], dict)
                  and h["meta"].get("token") == p.token), None)
    return None if found is None else int(found["version"])


def changelog_length(hist: list[dict[str, Any]]) -> int:
    """Epoch appends since the table's last compaction (or creation, rollback, or an epoch that
    replaced the whole content): how far the changelog has grown past its compact form."""
    n = 0
    for h in hist:
        m = h["meta"]
        if (not isinstance(m, dict) or tables.is_compaction(m) or "restored_to" in m or m.get("replaced")
                or int(m.get("epoch", 0)) <= 0):
            break
        n += 1
    return n


def epoch_version(table: Any, epoch: int | None = None) -> tuple[int, int] | None:
    """(epoch, Delta version) of the committed epoch ``epoch`` of a state table (None: its
    newest), from the history: rolled-back epochs and compactions do not count. None: the
    table holds no such epoch."""
    live = tables.live_epochs(tables.history(str(table)), lambda m: isinstance(m, dict) and "epochstream" in m)
    if epoch is None:
        return live[-1] if live else None
    return next(((e, v) for e, v in reversed(live) if e == epoch), None)


def state_at(table: Any, epoch: int | None = None) -> pa.Table:
    """The committed state of a state table at an epoch (None: its newest) without Spark: the
    changelog read at the epoch's Delta version (delta-rs) and folded. Every column, typed
    ones included."""
    table = str(table)
    found = epoch_version(table, epoch)
    if found is None:
        raise CheckpointError(f"Delta state table {table}: no committed epoch {epoch if epoch is not None else ''}"
                              .rstrip() + " in its history")
    e, version = found
    return fold(tables.read_version(table, version), e)


#: the Spark SQL that reads a state table's committed state (fill in the path and the version of
#: the epoch, ``epoch_version``; without ``VERSION AS OF``: the newest state). ``read_state`` runs it.
STATE_SQL = """
SELECT * EXCEPT (_newest) FROM (
  SELECT *, row_number() OVER (PARTITION BY key_group, key, state ORDER BY epoch DESC) AS _newest
  FROM delta.`{path}` VERSION AS OF {version}
) WHERE _newest = 1 AND value IS NOT NULL
"""


def read_state(spark: Any, path: Any, epoch: int | None = None, version: int | None = None) -> Any:
    """The committed state of a Delta state table as a Spark DataFrame, one row per (key group,
    key, state) with its typed columns: at ``epoch`` (None: the newest), or at a Delta
    ``version`` an epoch committed as (a manifest's ``delta.state.<uid>.version``).

    The table is a changelog (``fold``): this is the newest row per key with epoch <= the
    epoch, tombstones dropped, read at the epoch's version by time travel (``STATE_SQL``)."""
    path = str(path)
    if version is None:
        found = epoch_version(path, epoch)
        if found is None:
            raise CheckpointError(f"Delta state table {path}: no committed epoch "
                                  f"{epoch if epoch is not None else '(empty table)'} in its history")
        version = found[1]
    return spark.sql(STATE_SQL.format(path=tables.spark_uri(path), version=int(version)))
