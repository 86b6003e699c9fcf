"""Typed columns of committed state: declared state types (``runtime.types``) as Arrow and Spark.

The pickled key and value stay the record of truth (restores read them back exactly); the
typed columns are a decoded view for SQL. A typed column is ``typed_<state>`` for each
state that declares a type, and ``typed_key`` when the key does; a row of another state
holds NULL there. A value that does not fit its column (possible only when the type comes
from an older table and the running job no longer declares it, so no capture checked it)
becomes NULL with a warning: the commit of an epoch whose checkpoint is complete must not
fail on a view.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pyarrow as pa

from ..runtime.types import TypeInformation, typed_column_name

log = logging.getLogger(__name__)

TYPED_KEY = "typed_key"

_ARROW = {
    "STRING": pa.string(), "BOOLEAN": pa.bool_(), "TINYINT": pa.int8(), "INT": pa.int32(),
    "BIGINT": pa.int64(), "FLOAT": pa.float32(), "DOUBLE": pa.float64(), "BINARY": pa.binary(),
}


def arrow_type(t: TypeInformation) -> pa.DataType:
    if t.name == "list":
        return pa.list_(arrow_type(t.args[0]))
    if t.name == "map":
        return pa.map_(arrow_type(t.args[0]), arrow_type(t.args[1]))
    if t.name == "row":
        return pa.struct([pa.field(n, arrow_type(ft)) for n, ft in t.args])
    return _ARROW[t.name]


def spec_of_spark_type(dt: Any) -> Any:
    """A Spark column type as a ``runtime.types`` JSON spec (the inverse of ``TypeInformation.sql``)."""
    from pyspark.sql import types as T

    simple = {T.StringType: "STRING", T.BooleanType: "BOOLEAN", T.ByteType: "TINYINT", T.IntegerType: "INT",
              T.LongType: "BIGINT", T.FloatType: "FLOAT", T.DoubleType: "DOUBLE", T.BinaryType: "BINARY"}
    for cls, name in simple.items():
        if isinstance(dt, cls):
            return name
    if isinstance(dt, T.ArrayType):
        return {"list": spec_of_spark_type(dt.elementType)}
    if isinstance(dt, T.MapType):
        return {"map": [spec_of_spark_type(dt.keyType), spec_of_spark_type(dt.valueType)]}
    if isinstance(dt, T.StructType):
        return {"row": [[f.name, spec_of_spark_type(f.dataType)] for f in dt.fields]}
    raise ValueError(f"column type {dt.simpleString()} is not one epochstream writes")


def declared_columns(op_entry: dict[str, Any]) -> dict[str, TypeInformation]:
    """Typed columns an operator's manifest entry declares: column name -> type."""
    out = {}
    if op_entry.get("key_type") is not None:
        out[TYPED_KEY] = TypeInformation.from_json(op_entry["key_type"])
    for state, spec in sorted(op_entry.get("types", {}).items()):
        out[typed_column_name(state)] = TypeInformation.from_json(spec)
    seen: dict[str, str] = {}
    for col in out:  # Spark SQL resolves column names case-insensitively
        if col.lower() in seen:
            raise ValueError(f"typed columns {seen[col.lower()]!r} and {col!r} differ only in case; rename a state")
        seen[col.lower()] = col
    return out


def _decode(t: TypeInformation, data: bytes | None, what: str, warned: set[str]) -> Any:
    if data is None:
        return None
    value = pickle.loads(data)
    why = t.check(value)
    if why:
        if what not in warned:
            warned.add(what)
            log.warning("%s: a value does not fit the column type %s (%s); the typed column holds NULL there",
                        what, t.sql, why)
        return None
    return t.plain(value)


def typed_arrays(rows: pa.Table, columns: dict[str, TypeInformation], what: str) -> dict[str, pa.Array]:
    """The typed columns for ``rows`` (with ``key``, ``state``, ``value`` pickled columns)."""
    keys = rows.column("key").to_pylist()
    states = rows.column("state").to_pylist()
    values = rows.column("value").to_pylist()
    warned: set[str] = set()
    out = {}
    for col, t in columns.items():
        if col == TYPED_KEY:
            data = [_decode(t, k, f"{what}, key", warned) for k in keys]
        else:
            state = col[len("typed_"):]
            data = [_decode(t, v, f"{what}, state {state!r}", warned) if s == state else None
                    for s, v in zip(states, values, strict=True)]
        out[col] = pa.array(data, arrow_type(t))
    return out
