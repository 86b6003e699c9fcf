"""``spark.read.format("epochstream-state")``: Spark's state reader for epochstream checkpoints.

A PySpark Python data source with the options of Spark's own ``statestore`` source, so one
piece of code reads the state of a wrapped operator from either engine:

    from epochstream.pyspark.state_source import register
    register(spark)
    spark.read.format("epochstream-state").option("operatorUid", "op").option("stateVarName", "count").load(chk)

Options: ``operatorUid`` (the wrapper's ``uid``; Spark's ``operatorId``), ``stateVarName`` (a
state variable of a ``transform_with_state`` processor; without it, ``applyInPandasWithState``'s
``GroupState``), ``readRegisteredTimers`` (``"true"``: the registered timers), ``epoch`` (a
completed epoch in place of Spark's ``batchId``; default the newest). ``load(path)``: a checkpoint
dir (local or any URL the backends know), or one chk-N or savepoint folder. Only read-committed
state is read (``epochstream.state.query``, what ``epochstream state query`` prints).

Rows have Spark's layout: ``key`` (a struct of the grouping values), then ``value`` (value
state, ``GroupState``), ``list_element`` (one row per element) or ``user_map_key`` and
``user_map_value`` (one row per entry) or ``expiration_timestamp_ms`` (timers), and
``partition_id`` (the subtask holding the key). An entry with a TTL reads as Spark shows it,
``struct(value, expiration_timestamp_ms)``. Without ``.schema(...)`` the schema is inferred from
the stored values; struct fields are then ``_1``, ``_2``, ... (pass a schema for Spark's names).
"""

from __future__ import annotations

import datetime
import decimal
import pickle
from typing import Any, Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..runtime.errors import EpochStreamError

NAME = "epochstream-state"
TIMERS = "$timers"
GROUP_STATE = "$groupState"


class StateSourceError(EpochStreamError):
    """Options that do not name readable state (which option, which checkpoint)."""


def register(spark: Any) -> None:
    """Make ``format("epochstream-state")`` known to ``spark``."""
    spark.dataSource.register(EpochStreamStateSource)


def _bool(text: Any) -> bool:
    return str(text).lower() == "true"


def _lower(options: Any) -> dict[str, str]:
    """Spark hands a data source its options with lower-cased names (they are case-insensitive)."""
    return {str(k).lower(): v for k, v in dict(options).items()}


def state_rows(options: dict[str, str]) -> list[tuple]:
    """The rows ``options`` select, in Spark's statestore layout (Python values)."""
    from ..state import query

    options = _lower(options)
    path = options.get("path")
    uid = options.get("operatoruid") or options.get("operatorid")
    if not path:
        raise StateSourceError(f"{NAME}: load(path) needs a checkpoint dir")
    if not uid:
        raise StateSourceError(f"{NAME}: option operatorUid (the wrapper's uid) is required, reading {path}")
    timers = _bool(options.get("readregisteredtimers", "false"))
    var = options.get("statevarname")
    if timers and var:
        raise StateSourceError(f"{NAME}: readRegisteredTimers and stateVarName exclude each other")
    name = TIMERS if timers else (var or GROUP_STATE)
    epoch = options.get("epoch", options.get("batchid"))
    table = query(path, uid, epoch=int(epoch) if epoch is not None else None, state=name)
    keys = [pickle.loads(b) for b in table.column("key_pickle").to_pylist()]
    values = [pickle.loads(b) for b in table.column("value_pickle").to_pylist()]
    parts = table.column("subtask").to_pylist()
    out: list[tuple] = []
    for key, value, part in zip(keys, values, parts, strict=True):
        k = tuple(key) if isinstance(key, tuple) else (key,)
        if timers:
            out.extend((k, int(ts), part) for ts in value)
        elif name == GROUP_STATE:
            state, _timeout = value
            if state is not None:
                out.append((k, tuple(state), part))
        elif isinstance(value, list):  # list state: [(value, expiry)]
            out.extend((k, _entry(v, e), part) for v, e in value)
        elif isinstance(value, dict):  # map state: {user key: (value, expiry)}
            out.extend((k, tuple(uk), _entry(v, e), part) for uk, (v, e) in value.items())
        else:  # value state: (value, expiry)
            v, e = value
            out.append((k, _entry(v, e), part))
    return out


def _entry(value: tuple, expires: int | None) -> tuple:
    return tuple(value) if expires is None else (tuple(value), expires)


def _type_of(v: Any) -> DataType:
    if isinstance(v, bool):
        return BooleanType()
    if isinstance(v, int):
        return LongType()
    if isinstance(v, float):
        return DoubleType()
    if isinstance(v, bytes):
        return BinaryType()
    if isinstance(v, datetime.datetime):
        return TimestampType()
    if isinstance(v, datetime.date):
        return DateType()
    if isinstance(v, decimal.Decimal):
        return DecimalType(38, 18)
    if isinstance(v, tuple):
        return StructType([StructField(f"_{i + 1}", _type_of(x), True) for i, x in enumerate(v)])
    if isinstance(v, list):
        first = next((x for x in v if x is not None), None)
        return ArrayType(_type_of(first) if first is not None else StringType(), True)
    if isinstance(v, dict):
        k, x = next(iter(v.items()), ("", ""))
        return MapType(_type_of(k), _type_of(x), True)
    return StringType()


def infer_schema(options: dict[str, str], rows: list[tuple]) -> StructType:
    """Spark's statestore columns, typed from the first row (strings where nothing is stored)."""
    options = _lower(options)
    timers = _bool(options.get("readregisteredtimers", "false"))
    first = rows[0] if rows else None
    if timers:
        names = ["key", "expiration_timestamp_ms"]
    elif first is not None and len(first) == 4:
        names = ["key", "user_map_key", "user_map_value"]
    else:
        kind = options.get("statevarkind", "")
        names = ["key", "list_element"] if kind == "list" else ["key", "value"]
    fields = []
    for i, n in enumerate(names):
        if n == "expiration_timestamp_ms":
            t: DataType = LongType()
        elif first is not None:
            t = _type_of(first[i])
        else:
            t = StructType([StructField("_1", StringType(), True)])
        fields.append(StructField(n, t, True))
    fields.append(StructField("partition_id", IntegerType(), True))
    return StructType(fields)


class EpochStreamStateSource(DataSource):
    """``format("epochstream-state")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        opts = _lower(self.options)
        rows = state_rows(opts)
        if rows and len(rows[0]) == 3 and not _bool(opts.get("readregisteredtimers", "false")):
            # a list state reads one row per element: name the column as Spark does
            opts.setdefault("statevarkind", "list" if self._is_list(opts) else "value")
        return infer_schema(opts, rows)

    @staticmethod
    def _is_list(options: dict[str, str]) -> bool:
        from ..state import query

        name = options.get("statevarname")
        if not name:
            return False
        epoch = options.get("epoch", options.get("batchid"))
        table = query(options["path"], options.get("operatoruid") or options.get("operatorid") or "",
                      epoch=int(epoch) if epoch is not None else None, state=name)
        blobs = table.column("value_pickle").to_pylist()
        return bool(blobs) and isinstance(pickle.loads(blobs[0]), list)

    def reader(self, schema: StructType) -> DataSourceReader:
        return _Reader(_lower(self.options))


class _Reader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def read(self, partition: Any) -> Iterator[tuple]:
        yield from state_rows(self.options)
