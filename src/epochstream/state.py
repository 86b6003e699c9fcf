"""Read-committed state queries: the keyed state of an operator as of a completed epoch.

A manifest is the commit point of its epoch, so reading state only through manifests is
read-committed by construction (thesis 003, section 4.3.1): files of an epoch that is
prepared but not yet completed are named by no manifest and are never read, and each
query reads ONE manifest, so it never mixes epochs. ``epoch=None`` reads the newest
completed epoch; any retained epoch (``num_retained``) or a savepoint folder can be read.

    >>> import epochstream.state
    >>> t = epochstream.state.query("/tmp/chk", "count", key="k1")      # doctest: +SKIP
    >>> t.column_names                                                   # doctest: +SKIP
    ['epoch', 'operator', 'state', 'key_group', 'subtask', 'key', 'value', 'key_pickle', 'value_pickle']

Columns: ``key`` and ``value`` are the unpickled Python values as an Arrow column when Arrow
can type every value of the column (ints, strings, lists, dicts of one shape, ...), and
their JSON text otherwise (``repr`` for what JSON cannot hold); ``key_pickle`` and
``value_pickle`` keep the exact pickled bytes, so nothing is lost to the conversion.
``subtask`` is the subtask that held the key at the epoch's parallelism (the key-group
formula), ``key_group`` the key's key group. A key or state that declares a type
(``key_by(..., key_type=)``, ``ValueStateDescriptor(name, Types.LONG())``) adds the typed
columns ``typed_key`` / ``typed_<state>`` of exactly that Arrow type, as in a Delta state table.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pyarrow as pa

from .graph.keygroups import assign_to_key_group, operator_index_for_key_group
from .snapshot.manifest import CheckpointError
from .snapshot.manifest_view import ManifestView

__all__ = ["query", "query_df", "ALL"]


class _All:
    def __repr__(self) -> str:
        return "ALL"


#: ``key=ALL`` (the default) returns every key; ``key=None`` looks up the key ``None``
ALL: Any = _All()

SCHEMA_FIXED = [("epoch", pa.int64()), ("operator", pa.string()), ("state", pa.string()),
                ("key_group", pa.int32()), ("subtask", pa.int32())]


def _open(where: Any, epoch: int | None, storage=None):
    """(storage, manifest, root) for a checkpoint dir + epoch, or one chk-N / savepoint folder."""
    from .backends import location, open_object_storage, open_storage
    from .backends.objects import METADATA

    loc = location(where)
    if storage is None:
        parent = open_object_storage(str(loc.parent))
        if loc.name == METADATA or parent.store.exists(loc / METADATA):
            if epoch is not None:
                raise CheckpointError(f"{loc} is one checkpoint or savepoint: pass its checkpoint dir to choose "
                                      f"an epoch")
            return parent, *parent.load_manifest(str(loc))
        storage = open_storage(str(loc))
    if not storage.exists():
        raise CheckpointError(f"checkpoint dir {storage.root} does not exist")
    if epoch is None:
        found = storage.latest()
        if found is None:
            raise CheckpointError(f"checkpoint dir {storage.root} holds no completed checkpoint "
                                  "(nothing is committed yet)")
        return storage, *found
    retained = storage.list_checkpoints()
    if epoch not in retained:
        raise CheckpointError(
            f"epoch {epoch} is not retained in {storage.root} (retained epochs: {retained[-10:] or 'none'}); "
            f"raise num_retained to keep more epochs queryable"
        )
    return storage, *storage.load_manifest(epoch)


def _rows(storage, manifest: dict[str, Any], root: Any, operator: str, key: Any, state: str | None):
    view = ManifestView.of(manifest)
    if operator not in view.operators:
        raise CheckpointError(
            f"operator uid {operator!r} has no keyed state in epoch {view.epoch} of job {view.job!r} "
            f"(operators with state: {sorted(view.operators) or 'none'})"
        )
    m = view.max_parallelism
    groups = None
    if key is not ALL:
        kg = assign_to_key_group(key, m)
        groups = (kg, kg)  # only the files of the subtask that owned the key are opened
    latest: dict[tuple[str, Any], tuple[int, Any, bytes, bytes]] = {}
    for kg, kbytes, name, vbytes in storage.read_operator_rows(manifest, root, operator, groups):
        if state is not None and name != state:
            continue
        k = pickle.loads(kbytes)
        if key is not ALL and k != key:
            continue
        if vbytes is None:
            latest.pop((name, k), None)
        else:
            latest[(name, k)] = (kg, k, kbytes, vbytes)
    return latest


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return pa.array([_text(v) for v in values], pa.string())


def _text(v: Any) -> str:
    try:
        return json.dumps(v, default=repr, sort_keys=True)
    except TypeError:  # a dict with keys JSON cannot hold (a PySpark map state's tuple keys)
        return repr(v)


def query(checkpoint_dir: Any, operator_uid: str, key: Any = ALL, epoch: int | None = None,
          state: str | None = None, storage=None) -> pa.Table:
    """Committed keyed state of ``operator_uid`` as a pyarrow Table (one row per state and key).

    ``checkpoint_dir``: a checkpoint dir, local or any URL the backends know (then ``epoch``:
    None for the newest completed epoch, or any retained one), or one chk-N or savepoint
    folder; or pass ``storage`` (a ``CheckpointStorage``) instead. ``key``: one key (only
    the files of the key's key group are read). ``state``: one state name.
    """
    for attempt in range(3):
        store, manifest, root = _open(checkpoint_dir, epoch, storage)
        try:
            latest = _rows(store, manifest, root, operator_uid, key, state)
            break
        except CheckpointError:
            # the newest epoch may have been retired (retention) between listing and reading: read the new newest
            if epoch is not None or attempt == 2 or ManifestView.of(manifest).epoch in store.list_checkpoints():
                raise
    view = ManifestView.of(manifest)
    p, m = view.parallelism, view.max_parallelism
    items = sorted(latest.items(), key=lambda kv: (kv[0][0], kv[1][0], repr(kv[0][1])))
    n = len(items)
    values = [pickle.loads(v[3]) for _, v in items]
    typed = _typed(manifest["operators"][operator_uid], items, operator_uid)
    return pa.table({
        "epoch": pa.array([view.epoch] * n, pa.int64()),
        "operator": pa.array([operator_uid] * n, pa.string()),
        "state": pa.array([s for (s, _k), _ in items], pa.string()),
        "key_group": pa.array([v[0] for _, v in items], pa.int32()),
        "subtask": pa.array([operator_index_for_key_group(m, p, v[0]) for _, v in items], pa.int32()),
        "key": _column([v[1] for _, v in items]),
        "value": _column(values),
        "key_pickle": pa.array([v[2] for _, v in items], pa.binary()),
        "value_pickle": pa.array([v[3] for _, v in items], pa.binary()),
        **typed,
    })


def _typed(entry: dict[str, Any], items: list, operator_uid: str) -> dict[str, pa.Array]:
    """The declared typed columns (``backends.typed``) for the query's rows."""
    from .backends.typed import declared_columns, typed_arrays

    columns = declared_columns(entry)
    if not columns:
        return {}
    rows = pa.table({"key": pa.array([v[2] for _, v in items], pa.binary()),
                     "state": pa.array([s for (s, _k), _ in items], pa.string()),
                     "value": pa.array([v[3] for _, v in items], pa.binary())})
    return typed_arrays(rows, columns, f"operator {operator_uid!r}")


def query_df(checkpoint_dir: str | os.PathLike[str], operator_uid: str, key: Any = ALL, epoch: int | None = None,
             state: str | None = None, spark=None):
    """``query`` as a Spark DataFrame (the active SparkSession unless ``spark`` is given)."""
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise RuntimeError("query_df needs a SparkSession: pass spark=... or create one first")
    return spark.createDataFrame(query(checkpoint_dir, operator_uid, key, epoch, state))
