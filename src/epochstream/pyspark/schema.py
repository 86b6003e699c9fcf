"""Spark schemas for the wrappers: DDL strings without a JVM, Arrow conversion of batches.

PySpark parses DDL strings (``"id long, name string"``) in the JVM; the wrappers run
without a SparkSession, so this module parses the common subset itself and accepts any
``StructType`` (or other ``DataType``) as is. Batches move between epochstream records and
pandas through Arrow, as PySpark's Arrow serializers move them between the JVM and Python.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    Row,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

_ATOMIC = {
    "string": StringType, "varchar": StringType, "char": StringType,
    "int": IntegerType, "integer": IntegerType,
    "long": LongType, "bigint": LongType,
    "short": ShortType, "smallint": ShortType,
    "byte": ByteType, "tinyint": ByteType,
    "double": DoubleType, "float": FloatType, "real": FloatType,
    "boolean": BooleanType, "bool": BooleanType,
    "binary": BinaryType, "date": DateType,
    "timestamp": TimestampType, "timestamp_ntz": TimestampNTZType,
}

_TOKEN = re.compile(r"\s*(<|>|\(|\)|,|:|`[^`]*`|[A-Za-z_][A-Za-z0-9_]*|\d+)")


class SchemaError(ValueError):
    """A schema string this module cannot parse, or a value that does not fit its schema."""


def parse_schema(schema: DataType | str, what: str = "schema") -> DataType:
    """A ``DataType`` from a DDL string (``"a long, b string"``, ``"long"``,
    ``"array<string>"``); ``DataType`` objects pass through."""
    if isinstance(schema, DataType):
        return schema
    if not isinstance(schema, str):
        raise SchemaError(f"{what} must be a pyspark DataType or a DDL string, got {type(schema).__name__}")
    tokens = _tokens(schema, what)
    parser = _Parser(tokens, schema, what)
    # a bare type ("long") or a field list ("a long, b string")
    if len(tokens) >= 2 and tokens[1] not in ("<", "(") and tokens[0].lower() not in ("struct",):
        result: DataType = parser.fields(end=None)
    else:
        result = parser.type_()
    if parser.i != len(tokens):
        raise SchemaError(f"{what} {schema!r}: unexpected {tokens[parser.i]!r}")
    return result


def struct_schema(schema: DataType | str, what: str) -> StructType:
    """Like ``parse_schema``, but a bare type becomes a one-field struct named ``value``
    (Spark's state variables are rows)."""
    parsed = parse_schema(schema, what)
    if isinstance(parsed, StructType):
        return parsed
    return StructType([StructField("value", parsed, True)])


def _tokens(text: str, what: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise SchemaError(f"{what} {text!r}: cannot parse at {text[pos:]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str], text: str, what: str) -> None:
        self.t, self.i, self.text, self.what = tokens, 0, text, what

    def _next(self) -> str:
        if self.i >= len(self.t):
            raise SchemaError(f"{self.what} {self.text!r}: ends too early")
        tok = self.t[self.i]
        self.i += 1
        return tok

    def _expect(self, tok: str) -> None:
        got = self._next()
        if got != tok:
            raise SchemaError(f"{self.what} {self.text!r}: expected {tok!r}, found {got!r}")

    def _peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def fields(self, end: str | None) -> StructType:
        fields = []
        while True:
            name = self._next().strip("`")
            if self._peek() == ":":
                self.i += 1
            fields.append(StructField(name, self.type_(), True))
            if self._peek() == ",":
                self.i += 1
                continue
            break
        if end is not None:
            self._expect(end)
        return StructType(fields)

    def type_(self) -> DataType:
        name = self._next().lower()
        if name in _ATOMIC:
            if self._peek() == "(":  # char(10), varchar(10)
                self.i += 1
                self._next()
                self._expect(")")
            return _ATOMIC[name]()
        if name in ("decimal", "dec", "numeric"):
            if self._peek() == "(":
                self.i += 1
                p = int(self._next())
                s = 0
                if self._peek() == ",":
                    self.i += 1
                    s = int(self._next())
                self._expect(")")
                return DecimalType(p, s)
            return DecimalType()
        if name == "array":
            self._expect("<")
            elem = self.type_()
            self._expect(">")
            return ArrayType(elem, True)
        if name == "map":
            self._expect("<")
            k = self.type_()
            self._expect(",")
            v = self.type_()
            self._expect(">")
            return MapType(k, v, True)
        if name == "struct":
            self._expect("<")
            return self.fields(end=">")
        raise SchemaError(
            f"{self.what} {self.text!r}: unknown type {name!r}; pass a pyspark.sql.types DataType instead"
        )


# ---------------------------------------------------------------- values


def to_python(v: Any) -> Any:
    """numpy and pandas scalars -> plain Python, as PySpark normalises state values."""
    if v is None:
        return None
    t = type(v)
    if t in (int, str, float, bool, bytes):
        return v
    if hasattr(v, "item") and hasattr(v, "dtype"):  # numpy scalar
        return v.item()
    if hasattr(v, "to_pydatetime"):
        return v.to_pydatetime()
    if hasattr(v, "to_pytimedelta"):
        return v.to_pytimedelta()
    if isinstance(v, Row):
        if named_row(v):
            return Row(**{k: to_python(x) for k, x in v.asDict().items()})
        return Row(*[to_python(x) for x in v])
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple takes its fields positionally
        return type(v)(*[to_python(x) for x in v])
    if isinstance(v, (list, tuple)):
        return type(v)(to_python(x) for x in v)
    if isinstance(v, dict):
        return {to_python(k): to_python(x) for k, x in v.items()}
    return v


def named_row(v: Any) -> bool:
    """Whether ``v`` is a Row with field names (``Row(a=1)``, not ``Row(1)``). Not by
    ``hasattr``: an unnamed Row's ``__getattr__`` raises a PySparkAttributeError whose message
    is formatted from Spark's error catalogue, which made every ``GroupState.update`` (it
    stores ``Row(*value)``) cost tens of microseconds."""
    return isinstance(v, Row) and "__fields__" in getattr(v, "__dict__", ())


def _plain(v: Any, dtype: DataType, what: str) -> Any:
    """A value of ``dtype`` in the form state stores it: structs as tuples in field order
    (accepted as tuples, lists, Rows, NamedTuples, dicts or objects with attributes, as
    ``StructType.toInternal`` accepts them), arrays as lists, maps as dicts, scalars as plain
    Python (numpy and pandas scalars converted, as PySpark's ``normalize_value``)."""
    if v is None:
        return None
    if isinstance(dtype, StructType):
        fields = dtype.fields
        if isinstance(v, dict):
            items = [v.get(f.name) for f in fields]
        elif named_row(v):
            d = v.asDict()
            items = [d.get(f.name) for f in fields]
        elif isinstance(v, (tuple, list)):  # tuples, NamedTuples, unnamed Rows: by position
            if len(v) != len(fields):
                raise SchemaError(f"{what}: value {tuple(v)!r} has {len(v)} item(s), schema "
                                  f"{dtype.simpleString()} has {len(fields)}")
            items = list(v)
        elif hasattr(v, "__dict__"):
            items = [getattr(v, f.name, None) for f in fields]
        else:
            raise SchemaError(f"{what}: a {type(v).__name__} does not fit struct {dtype.simpleString()}")
        return tuple(_plain(x, f.dataType, f"{what}.{f.name}") for x, f in zip(items, fields, strict=True))
    if isinstance(dtype, ArrayType):
        return [_plain(x, dtype.elementType, what) for x in v]
    if isinstance(dtype, MapType):
        items_ = v.items() if isinstance(v, dict) else v
        return {_plain(k, dtype.keyType, what): _plain(x, dtype.valueType, what) for k, x in items_}
    return to_python(v)


def _spark(v: Any, dtype: DataType) -> Any:
    """A stored value as PySpark hands it out: structs as ``Row``s with their field names at
    every depth (Spark unpickles the JVM's rows so), arrays as lists, maps as dicts."""
    if v is None:
        return None
    if isinstance(dtype, StructType):
        return Row(**{f.name: _spark(x, f.dataType) for x, f in zip(v, dtype.fields, strict=True)})
    if isinstance(dtype, ArrayType):
        return [_spark(x, dtype.elementType) for x in v]
    if isinstance(dtype, MapType):
        return {_spark(k, dtype.keyType): _spark(x, dtype.valueType) for k, x in v.items()}
    return v


def _needs_rows(dtype: DataType) -> bool:
    if isinstance(dtype, StructType):
        return True
    if isinstance(dtype, ArrayType):
        return _needs_rows(dtype.elementType)
    if isinstance(dtype, MapType):
        return _needs_rows(dtype.keyType) or _needs_rows(dtype.valueType)
    return False


def state_tuple(value: Any, schema: StructType, what: str) -> tuple:
    """A state value as stored: a tuple with one item per schema field, nested structs as
    tuples too (so checkpoints hold plain Python), normalised through the schema."""
    if value is None:
        raise SchemaError(f"{what}: a state value cannot be None (Spark: ILLEGAL_STATE_STORE_VALUE.NULL_VALUE)")
    t = type(value)
    if (t is tuple or (t is Row and "__fields__" not in value.__dict__)) and len(value) == _atomic_width(schema) \
            and _PLAIN.issuperset(map(type, value)):
        # what GroupState.update stores (an unnamed Row of plain values) and what handles get
        # (plain tuples) for a schema of scalars: _plain would give the same tuple, at about 25 us a call
        return value if t is tuple else tuple(value)
    if not isinstance(value, (tuple, list, dict, Row)) and not hasattr(value, "__dict__"):
        raise SchemaError(f"{what}: state values are tuples matching {schema.simpleString()}, "
                          f"got {type(value).__name__}")
    plain: tuple = _plain(value, schema, what)
    return plain


#: scalar types ``_plain`` passes through unchanged
_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})


def _atomic_fields(schema: StructType) -> bool:
    """Whether no field of ``schema`` is a struct, array or map (cached on the schema object)."""
    flag = schema.__dict__.get("_epochstream_atomic")
    if flag is None:
        flag = not any(isinstance(f.dataType, (StructType, ArrayType, MapType)) for f in schema.fields)
        schema.__dict__["_epochstream_atomic"] = flag
    return bool(flag)


def _atomic_width(schema: StructType) -> int:
    """The number of fields of ``schema`` when none is a struct, array or map, else -1
    (cached on the schema object: ``state_tuple`` asks on every state write)."""
    width = schema.__dict__.get("_epochstream_width")
    if width is None:
        width = len(schema.fields) if _atomic_fields(schema) else -1
        schema.__dict__["_epochstream_width"] = width
    return int(width)


def state_value(stored: tuple, schema: StructType) -> tuple:
    """A stored state tuple as Spark's state variables return it: a tuple at the top, a
    ``Row`` for every nested struct (``value[0].x`` works as in Spark)."""
    rows = schema.__dict__.get("_epochstream_rows")
    if rows is None:  # cached on the schema object: asked on every state read
        rows = schema.__dict__["_epochstream_rows"] = any(_needs_rows(f.dataType) for f in schema.fields)
    if not rows:
        return stored
    return tuple(_spark(x, f.dataType) for x, f in zip(stored, schema.fields, strict=True))


def group_state_row(stored: tuple, schema: StructType) -> Any:
    """A stored ``GroupState`` value as Spark's ``state.get`` returns it: a ``Row`` of the
    state schema with named fields, nested structs as ``Row``s too."""
    if _atomic_fields(schema):  # Row(**dict(zip(names, stored))) without the dict
        row = tuple.__new__(Row, stored)
        row.__fields__ = schema.names[:]
        return row
    return _spark(stored, schema)


# ---------------------------------------------------------------- batches


def arrow_schema(schema: StructType):
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def as_dicts(records: Sequence[Any], input_schema: StructType | None) -> list[dict]:
    first = records[0]
    if isinstance(first, dict):
        return records  # type: ignore[return-value]
    if named_row(first):
        return [r.asDict() for r in records]
    if input_schema is None:
        raise SchemaError("tuple records need input_schema=... to name their columns")
    names = input_schema.names
    for r in records:
        if len(r) != len(names):
            raise SchemaError(f"a tuple record has {len(r)} fields where input_schema names {len(names)}: {r!r}")
    return [dict(zip(names, r, strict=True)) for r in records]


def to_pandas(rows: list[dict], schema) -> Any:
    """Rows -> one pandas DataFrame through Arrow (``schema``: an Arrow schema or None to infer)."""
    import pyarrow as pa

    return spark_pandas(pa.Table.from_pylist(rows, schema=schema))


def spark_pandas(data: Any) -> Any:
    """An Arrow Table or RecordBatch -> the pandas DataFrame a user function gets, through
    PySpark's own conversion (``ArrowBatchTransformer.to_pandas``, as its
    ``TransformWithStateInPandasSerializer`` calls it): timestamps ``datetime64[ns]``
    (``coerce_temporal_nanoseconds``) tz-naive in the session time zone (UTC here), dates as
    ``datetime.date``, decimals as ``Decimal``, structs and maps as dicts, integer columns
    with nulls as Spark makes them."""
    import pandas as pd
    from pyspark.sql.conversion import ArrowBatchTransformer

    if data.num_columns == 0:
        return pd.DataFrame(index=range(data.num_rows))
    series = ArrowBatchTransformer.to_pandas(data, timezone="UTC", struct_in_pandas="dict")
    return pd.concat(series, axis=1)


def conform(batch: Any, schema: Any, what: str) -> Any:
    """A RecordBatch in the Arrow ``schema`` (or as it is when ``schema`` is None): its fields
    in order, each column cast to its type, a column the batch lacks all null, as
    ``Table.from_pylist(rows, schema=schema)`` makes the row path's batch."""
    import pyarrow as pa

    if schema is None or batch.schema == schema:
        return batch
    cols = []
    for f in schema:
        i = batch.schema.get_field_index(f.name)
        col = batch.column(i) if i >= 0 else pa.nulls(batch.num_rows, f.type)
        if col.type != f.type:
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise SchemaError(f"{what}: column {f.name!r} ({col.type}) does not fit input schema "
                                  f"type {f.type}: {exc}") from None
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def pandas_groups(batch: Any, key_columns: Sequence[str], schema: Any, what: str) -> list[tuple[tuple, Any]]:
    """A RecordBatch grouped by ``key_columns`` with Arrow kernels: ``[(key tuple, pandas
    DataFrame of that key's rows)]``, keys in order of first appearance, rows in batch order,
    each frame what ``spark_pandas`` makes of the key's rows alone (``schema``: the Arrow
    input schema or None for the batch's own types). No Python call per row: the keys are
    found once (those ``tuple(row[c] for c in key_columns)`` gives for ``batch.to_pylist()``
    rows) and ``keyed_frames`` cuts the frames."""
    from ..graph.keygroups import distinct_keys

    names = batch.schema.names
    missing = [c for c in key_columns if c not in names]
    if missing:
        raise SchemaError(f"{what}: the batch has no grouping column {missing[0]!r} (its columns: {names})")
    if batch.num_rows == 0:
        return []
    codes, keys = distinct_keys([batch.column(c) for c in key_columns], as_tuple=True)
    return keyed_frames(conform(batch, schema, what), codes.to_numpy(zero_copy_only=False), keys)


def row_groups(rows: list[dict], keys: list[Any], key_columns: Sequence[str], schema: Any,
               what: str) -> list[tuple[Any, Any]]:
    """Dict rows and their keys (``tuple(row[c] for c in key_columns)``) -> ``[(key, frame)]``,
    each frame what ``to_pandas`` makes of the key's rows alone (``schema``: the Arrow input
    schema, or None to infer types from the values), keys in first-appearance order, rows in
    arrival order: the rows become one RecordBatch in one ``from_pylist`` and ``keyed_frames``
    cuts it, instead of an Arrow and a pandas conversion per key. Key columns of ints or
    strings are numbered with Arrow (``distinct_keys``), others by their Python keys.

    Without a schema a key's own rows could infer other types than all the rows together:
    so the rows take that path only when each column holds one Python type whose inferred
    Arrow type no subset changes (int, float, str, bool, bytes, date, timedelta, datetimes
    all naive or all of one zone); a key whose first row names other columns than the first
    row of all (Arrow takes the columns from the first row) is converted alone. Anything else
    (several types in a column, nested values, decimals, numpy scalars, rows Arrow refuses
    together) is converted key by key, as each key's rows alone give it."""
    import numpy as np
    import pyarrow as pa

    try:
        data = pa.RecordBatch.from_pylist(rows, schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return _frames_key_by_key(rows, keys, schema, what)
    names = data.schema.names
    types = {n: _types_of(rows, n) for n in (names if schema is None else key_columns)}
    if schema is None and not _inferred_alike(types, rows):
        return _frames_key_by_key(rows, keys, schema, what)
    codes, uniq = _key_codes(data, keys, key_columns, types)
    if schema is not None or len(uniq) == 1:
        return keyed_frames(data, codes, uniq)
    running = np.maximum.accumulate(codes)
    firsts = np.flatnonzero(np.concatenate(([True], running[1:] > running[:-1]))).tolist()
    want = tuple(names)
    alone_codes = [c for c, i in enumerate(firsts) if tuple(rows[i]) != want]

    def alone(at: list[int]) -> Any:
        return to_pandas([rows[i] for i in at], None)

    return keyed_frames(data, codes, uniq, inferred=True, alone=alone, alone_codes=alone_codes)


def _types_of(rows: list[dict], name: str) -> set[type]:
    """The Python types of column ``name`` of dict rows (NoneType for a missing or null value)."""
    import itertools

    return set(map(type, map(dict.get, rows, itertools.repeat(name))))


def _key_codes(data: Any, keys: list[Any], key_columns: Sequence[str], types: dict[str, set[type]]
               ) -> tuple[Any, list[Any]]:
    """``row_groups``' key numbers (first-appearance order) and keys. From the batch's key
    columns with Arrow where each holds only ints or only strings (nulls aside) and stays an
    integer or string column: their Arrow values are then the Python values, so equal keys
    get equal numbers as in a dict. Otherwise from the Python keys, through a dict."""
    import collections
    import itertools

    import numpy as np
    import pyarrow.types as pt

    from ..graph.keygroups import distinct_keys

    none = type(None)
    if all(c in types and (types[c] - {none} <= {int} or types[c] - {none} <= {str}) for c in key_columns):
        columns = [data.column(c) for c in key_columns]
        if all(pt.is_integer(col.type) or pt.is_string(col.type) or pt.is_large_string(col.type)
               or pt.is_null(col.type) for col in columns):
            codes, uniq = distinct_keys(columns, as_tuple=True)
            return codes.to_numpy(zero_copy_only=False), uniq
    index: collections.defaultdict[Any, int] = collections.defaultdict(itertools.count().__next__)
    numbered = np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))
    return numbered, list(index)


def _frames_key_by_key(rows: list[dict], keys: list[Any], schema: Any, what: str) -> list[tuple[Any, Any]]:
    """``row_groups`` one key at a time: each key's rows through ``to_pandas`` alone."""
    import pyarrow as pa

    per_key: dict[Any, list[dict]] = {}
    for r, k in zip(rows, keys, strict=True):
        group = per_key.get(k)
        if group is None:
            per_key[k] = [r]
        else:
            group.append(r)
    out = []
    for k, group in per_key.items():
        try:
            out.append((k, to_pandas(group, schema)))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            fit = " into the input schema" if schema is not None else ""
            raise SchemaError(f"{what}: the rows of key {k!r} do not convert to Arrow{fit}: "
                              f"{type(exc).__name__}: {exc}") from None
    return out


#: Python types whose inferred Arrow type is the same for any subset of a column's values
_ALIKE_TYPES = frozenset({int, float, str, bool, bytes})


def _inferred_alike(types: dict[str, set[type]], rows: list[dict]) -> bool:
    """Whether Arrow infers each column's type from any key's rows as from all of them
    (``types``: each column's Python types): one type per column (None aside) among
    ``_ALIKE_TYPES``, dates, timedeltas, or datetimes all naive or all of one time zone."""
    import datetime

    none = type(None)
    for name, seen in types.items():
        kinds = seen - {none}
        if not kinds:
            continue
        if len(kinds) > 1:
            return False
        (kind,) = kinds
        if kind in _ALIKE_TYPES or kind is datetime.date or kind is datetime.timedelta:
            continue
        if kind is not datetime.datetime:
            return False
        # the first value's zone is the column's (PySpark shows wall times in it): one zone, or all naive
        if len({v.tzinfo for v in map(dict.get, rows, [name] * len(rows)) if v is not None}) > 1:
            return False
    return True


#: ``keyed_frames``' state of a column with nulls in one key: none in the key's rows, some,
#: or all of them (the last only where types are inferred from Python values)
_NO_NULLS, _SOME_NULLS, _ALL_NULLS = 0, 1, 2


def keyed_frames(data: Any, codes: Any, keys: list[Any], inferred: bool = False,
                 alone: Callable[[list[int]], Any] | None = None,
                 alone_codes: Sequence[int] = ()) -> list[tuple[Any, Any]]:
    """``[(key, frame)]`` of a RecordBatch whose row ``i`` belongs to ``keys[codes[i]]``
    (``codes``: a numpy int array numbered in order of first appearance), keys in that order,
    a key's rows in batch order; each frame is what ``spark_pandas`` makes of the key's rows
    alone, with a 0-based index.

    One stable sort puts each key's rows together and each key gets a slice (``row_slicer``)
    of one pandas conversion. A column's dtype can depend on the key's own rows: an integer
    column is ``int64`` for a key without nulls and ``float64`` for one with some, a boolean
    ``bool`` or ``object``; where types are ``inferred`` from Python values (the row path
    without an input schema) a column all null in a key has Arrow's null type (``object``).
    So the keys are sorted first by the state (``_null_states``) each has in each such
    column, and each group of keys alike is converted once: without nulls, or with nulls
    only in columns whose dtype does not follow them, that is one conversion. Integer or
    boolean values with nulls inside lists (the lists' arrays become ``object``) and types
    this does not know convert key by key. ``alone_codes`` are keys whose frame
    ``alone(row indices)`` makes instead (``row_groups``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n_keys = len(keys)
    if n_keys == 1 and not alone_codes:
        return [(keys[0], spark_pandas(data))]
    counts = np.bincount(codes, minlength=n_keys)
    columns, states, by_key = _null_states(data, codes, counts, inferred)
    if states is None:
        group_of_key = np.zeros(n_keys, np.int64)
        nulled: list[tuple[int, ...]] = [()]
    else:
        uniq, inverse = np.unique(states, axis=0, return_inverse=True)
        group_of_key = inverse.reshape(-1).astype(np.int64)
        nulled = [tuple(c for c, s in zip(columns, row, strict=True) if s == _ALL_NULLS) for row in uniq.tolist()]
    alone_group = -1
    if alone_codes:
        alone_group = len(nulled)
        group_of_key[np.asarray(alone_codes, dtype=np.int64)] = alone_group
    groups = int(group_of_key.max()) + 1
    if groups == 1:  # Arrow's stable sort: several times numpy's on dense codes
        order = pc.sort_indices(pa.array(codes)).to_numpy()
        key_order = np.arange(n_keys)
    else:  # by group, then key, then arrival (lexsort is stable)
        order = np.lexsort((codes, group_of_key[codes]))
        key_order = np.argsort(group_of_key, kind="stable")
    sizes = counts[key_order]
    starts = np.empty(n_keys, np.int64)
    starts[key_order] = np.cumsum(sizes) - sizes
    start_of, count_of = starts.tolist(), counts.tolist()
    members: list[list[int]] = [[] for _ in range(groups)]
    for code, group in zip(key_order.tolist(), group_of_key[key_order].tolist(), strict=True):
        members[group].append(code)
    original, data = data, data.take(pa.array(order))
    frames: list[Any] = [None] * n_keys
    for group, codes_in in enumerate(members):
        if group == alone_group:
            assert alone is not None, "alone_codes come with alone"
            for code in codes_in:
                s = start_of[code]
                frames[code] = alone(order[s:s + count_of[code]].tolist())
        elif by_key:  # each key's rows taken alone: a slice of a map column still holds every key's values
            for code in codes_in:
                s = start_of[code]
                own = original.take(pa.array(order[s:s + count_of[code]]))
                frames[code] = spark_pandas(_nulled(own, nulled[group]))
        elif codes_in:
            first = start_of[codes_in[0]]
            cut = row_slicer(spark_pandas(_nulled(data.slice(first, sum(count_of[c] for c in codes_in)),
                                                  nulled[group])))
            for code in codes_in:
                s = start_of[code] - first
                frames[code] = cut(s, s + count_of[code])
    return list(zip(keys, frames, strict=True))


def _null_states(data: Any, codes: Any, counts: Any, inferred: bool) -> tuple[list[int], Any, bool]:
    """For ``keyed_frames``: the columns whose pandas dtype follows a key's nulls, a
    ``(keys, columns)`` int8 matrix of each key's state in each (``_NO_NULLS``, ``_SOME_NULLS``,
    ``_ALL_NULLS``; None without such columns), and whether the batch must be converted key
    by key (nulls in a list's integer or boolean values, or in a type not known here)."""
    import numpy as np
    import pyarrow.types as pt

    columns: list[int] = []
    states: list[Any] = []
    by_key = False
    for i, col in enumerate(data.columns):
        t = col.type
        if _nested(t) and _list_leaf_nulls(col):
            by_key = True
        if col.null_count == 0 or pt.is_null(t):
            continue
        sensitive = pt.is_integer(t) or pt.is_boolean(t)
        if not sensitive and not _null_blind(t):
            by_key = True
            continue
        if not sensitive and not inferred:
            continue
        nulls = np.bincount(codes[col.is_null().to_numpy(zero_copy_only=False)], minlength=len(counts))
        state = np.where(nulls == 0, _NO_NULLS, _SOME_NULLS).astype(np.int8)
        if inferred:
            if not sensitive:
                state[:] = _NO_NULLS
            state[nulls == counts] = _ALL_NULLS
        columns.append(i)
        states.append(state)
    return columns, (np.stack(states, axis=1) if states else None), by_key


def _nested(t: Any) -> bool:
    import pyarrow.types as pt

    return pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t) or pt.is_map(t) or pt.is_struct(t)


def _null_blind(t: Any) -> bool:
    """Whether a column of Arrow type ``t`` has the same pandas dtype with nulls as without
    (floats NaN, timestamps NaT, the rest ``object`` either way)."""
    import pyarrow.types as pt

    return (pt.is_floating(t) or pt.is_string(t) or pt.is_large_string(t) or pt.is_binary(t)
            or pt.is_large_binary(t) or pt.is_date(t) or pt.is_timestamp(t) or pt.is_duration(t)
            or pt.is_decimal(t) or pt.is_time(t) or _nested(t))


def _list_leaf_nulls(arr: Any, under_list: bool = False) -> bool:
    """Whether an integer or boolean value inside a list of ``arr`` is null: pandas then
    makes the list's values an ``object`` array, so a key's lists follow nulls in other
    keys' rows (lists in maps too). Struct children carry their parent's nulls
    (``flatten``) and a map's keys and items are all of its children, which can only say yes
    where a key-by-key conversion was not needed, never the reverse."""
    import pyarrow.types as pt

    t = arr.type
    if pt.is_map(t):  # its values become Python objects, lists in them arrays
        return _list_leaf_nulls(arr.keys, False) or _list_leaf_nulls(arr.items, False)
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _list_leaf_nulls(arr.flatten(), True)
    if pt.is_struct(t):
        return any(_list_leaf_nulls(child, under_list) for child in arr.flatten())
    return under_list and arr.null_count > 0 and (pt.is_integer(t) or pt.is_boolean(t))


def _nulled(batch: Any, columns: tuple[int, ...]) -> Any:
    """``batch`` with ``columns`` replaced by Arrow's null type (what a key's rows alone infer
    for a column all null in them)."""
    import pyarrow as pa

    for i in columns:
        batch = batch.set_column(i, batch.schema.field(i).name, pa.nulls(batch.num_rows))
    return batch


def row_slicer(df: Any) -> Callable[[int, int], Any]:
    """``cut(start, stop)``: rows ``start:stop`` of ``df`` as a DataFrame of their own with a
    0-based RangeIndex, what ``df.iloc[start:stop].reset_index(drop=True)`` gives, as views of
    ``df``'s blocks (the groups of a batch do not overlap, so no copy is needed). Through the
    block manager where pandas has one: ``iloc`` and ``reset_index`` cost about 4x more per
    key, which at 10K keys a micro-batch was a fifth of each call. Each frame is built from
    its blocks' row slices, its own columns and ``RangeIndex`` (a user renaming one frame's
    index or columns touches no other key's) and a manager made without re-validating what
    the slices already satisfy, about half of ``get_slice`` + ``set_axis`` + ``RangeIndex(n)``."""
    import pandas as pd

    mgr = getattr(df, "_mgr", None)
    from_mgr = getattr(pd.DataFrame, "_from_mgr", None)
    if mgr is None or from_mgr is None or mgr.ndim != 2:
        return lambda start, stop: df.iloc[start:stop].reset_index(drop=True)
    fast = _block_slicer(mgr, from_mgr, pd)
    if fast is not None:
        return fast
    if not hasattr(mgr, "get_slice") or not hasattr(mgr, "set_axis"):
        return lambda start, stop: df.iloc[start:stop].reset_index(drop=True)
    get_slice, range_index = mgr.get_slice, pd.RangeIndex

    def cut(start: int, stop: int) -> Any:
        part = get_slice(slice(start, stop), axis=1)
        part.set_axis(1, range_index(stop - start))
        return from_mgr(part, axes=part.axes)

    return cut


def _block_slicer(mgr: Any, from_mgr: Any, pd: Any) -> Callable[[int, int], Any] | None:
    """``row_slicer``'s cut from pandas' internals (``Block.slice_block_rows``, a manager
    without integrity checks, ``RangeIndex._simple_new``), or None where this pandas lacks
    one of them (then ``get_slice`` is used). Checked once on ``mgr``: a slice must equal
    ``get_slice``'s."""
    blocks = tuple(getattr(mgr, "blocks", ()))
    simple_index = getattr(pd.RangeIndex, "_simple_new", None)
    if not blocks or simple_index is None or not all(hasattr(b, "slice_block_rows") for b in blocks):
        return None
    make = type(mgr)
    columns = mgr.axes[0]
    shallow = getattr(columns, "_view", None)
    if shallow is None:
        return None

    def cut(start: int, stop: int) -> Any:
        rows = slice(start, stop)
        part = make(tuple([b.slice_block_rows(rows) for b in blocks]),
                    [shallow(), simple_index(range(stop - start))], verify_integrity=False)
        return from_mgr(part, axes=part.axes)

    try:  # the same frame as the checked path, or not used
        probe = cut(0, min(2, len(mgr.axes[1])))
        ref = mgr.get_slice(slice(0, min(2, len(mgr.axes[1]))), axis=1)
        ok = probe._mgr.nblocks == ref.nblocks and probe.columns.equals(ref.axes[0]) \
            and list(probe.dtypes) == list(ref.get_dtypes())
    except Exception:  # noqa: BLE001 - an internals change: take the public path instead
        return None
    return cut if ok else None


def frames_to_records(frames: Iterable[Any], schema: StructType, arrow_out, what: str) -> list[dict]:
    """The pandas DataFrames a user function yielded -> records (dicts in schema order).

    As in Spark, columns match the schema by name when the frame's labels are strings,
    by position otherwise."""
    import pandas as pd
    import pyarrow as pa

    out: list[dict] = []
    names = schema.names
    for df in frames:
        if not isinstance(df, pd.DataFrame):
            raise SchemaError(f"{what} must yield pandas DataFrames, got {type(df).__name__}")
        if len(df) == 0:
            continue
        if not all(isinstance(c, str) for c in df.columns):
            if len(df.columns) != len(names):
                raise SchemaError(f"{what}: a frame with {len(df.columns)} unnamed columns "
                                  f"for schema {schema.simpleString()}")
            df = df.set_axis(names, axis=1)
        missing = [n for n in names if n not in df.columns]
        if missing:
            raise SchemaError(f"{what}: output frame lacks column(s) {missing} of schema {schema.simpleString()}")
        try:
            table = pa.Table.from_pandas(df[names], schema=arrow_out, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise SchemaError(f"{what}: output does not fit schema {schema.simpleString()}: {exc}") from exc
        out.extend(table.to_pylist(maps_as_pydicts="strict"))
    return out


class Frame(NamedTuple):
    """A frame a user call yielded, checked (named columns, each label once, the schema's
    columns present) but not yet converted. ``batches_of`` converts the frames of one input
    batch together, as Spark's serializer does: it concatenates a batch's output frames
    (``pd.concat``) and converts them once, instead of paying the per-frame cost of an Arrow
    conversion for every key's one-row frame."""

    df: Any
    schema: StructType
    what: str
    #: column labels and dtypes: only frames that agree are concatenated (pandas would make
    #: an int column beside a float one float, and 2**60 + 1 would not survive)
    layout: tuple


def take_frames(frames: Iterable[Any], schema: StructType, arrow_out, what: str) -> list[Any]:
    """Consume what a user call yielded (its code runs now, in its own phase): ``Frame``s
    for frames whose columns match by name, RecordBatches for the rest (matched by position,
    or a label twice), converted at once as ``frames_to_batches`` does. Errors name ``what``."""
    data_frame = _pandas_frame()
    out: list[Any] = []
    names = tuple(schema.names)
    for df in frames:
        if type(df) is not data_frame and not isinstance(df, data_frame):
            raise SchemaError(f"{what} must yield pandas DataFrames, got {type(df).__name__}")
        if len(df) == 0:
            continue
        layout = _layout(df)
        try:
            named = _named_columns(layout[0], names)
        except TypeError:  # an unhashable label
            named = False
        if named:
            out.append(Frame(df, schema, what, layout))
            continue
        labels = df.columns
        if all(isinstance(c, str) for c in labels) and labels.is_unique:
            missing = [n for n in names if n not in labels]
            raise SchemaError(f"{what}: output frame lacks column(s) {missing} of schema {schema.simpleString()}")
        out.extend(frames_to_batches([df], schema, arrow_out, what))
    return out


@functools.lru_cache(maxsize=1)
def _pandas_frame() -> Any:
    """``pandas.DataFrame``, imported once (this module imports pandas only where it is used)."""
    import pandas as pd

    return pd.DataFrame


@functools.lru_cache(maxsize=256)
def _named_columns(labels: tuple, names: tuple) -> bool:
    """Whether a frame with column ``labels`` matches the schema ``names`` by name: string
    labels, each once, every name among them. Cached: a function yields frames of the same
    columns call after call."""
    return all(isinstance(c, str) for c in labels) and len(set(labels)) == len(labels) \
        and all(n in labels for n in names)


def _layout(df: Any) -> tuple:
    """A frame's column labels and dtypes. From pandas' block manager where it has one:
    ``df[name].dtype`` makes a Series per column, which for a one-row frame costs about as
    much as the user's own ``pd.DataFrame(...)`` call. A frame of one block (every column of
    one numpy dtype, what ``pd.DataFrame({"k": [..], "c": [..]})`` of ints makes) has that
    block's dtype in every column, without ``get_dtypes``' per-manager block-number map."""
    labels = tuple(df.columns.tolist())
    mgr = getattr(df, "_mgr", None)
    blocks = getattr(mgr, "blocks", None)
    if type(blocks) is tuple and len(blocks) == 1:
        return labels, (blocks[0].dtype,) * len(labels)
    get_dtypes = getattr(mgr, "get_dtypes", None)
    if get_dtypes is not None:
        return labels, tuple(get_dtypes().tolist())
    return labels, tuple(df.dtypes.tolist())


def batches_of(items: list[Any], arrow_out) -> list[Any]:
    """``take_frames`` output -> RecordBatches of ``arrow_out``, in order: each run of
    ``Frame``s of the same dtypes concatenated and converted once. A run that does not convert
    as a whole is converted frame by frame, so the result and any error are those of
    ``frames_to_batches``."""
    import warnings

    import pandas as pd

    if not any(type(it) is Frame for it in items):
        return items
    out: list[Any] = []
    run: list[Frame] = []

    def flush() -> None:
        if len(run) > 1 and _numpy_layout(run[0].layout):
            try:
                out.append(_stack_frames(run, arrow_out))
            except SchemaError:
                out.extend(_frame_batch(f.df, f.schema, arrow_out, f.what) for f in run)
        elif len(run) > 1:
            with warnings.catch_warnings():  # all-NA columns: the dtype is the schema's anyway
                warnings.simplefilter("ignore", FutureWarning)
                merged = pd.concat([f.df for f in run], ignore_index=True, copy=False)
            try:
                out.append(_frame_batch(merged, run[0].schema, arrow_out, run[0].what))
            except SchemaError:
                out.extend(_frame_batch(f.df, f.schema, arrow_out, f.what) for f in run)
        elif run:
            out.append(_frame_batch(run[0].df, run[0].schema, arrow_out, run[0].what))
        run.clear()

    for it in items:
        if type(it) is Frame:
            if run and it.layout != run[0].layout:
                flush()
            run.append(it)
        else:
            flush()
            out.append(it)
    flush()
    return out


def _numpy_layout(layout: tuple) -> bool:
    """Whether every column of a ``Frame.layout`` is a plain numpy dtype (no extension types)."""
    import numpy as np

    return all(type(d) is not object and isinstance(d, np.dtype) for d in layout[1])


def _stack_frames(run: list[Frame], arrow_out) -> Any:
    """Frames of one numpy layout -> one RecordBatch: each schema column's values of all the
    frames joined with ``numpy.concatenate`` and converted once, as ``pd.concat`` then
    ``_frame_batch`` would (same dtypes, so the same values), without ``pd.concat``'s per-frame
    index and block work, which at one one-row frame per key cost about as much as the call."""
    import numpy as np
    import pyarrow as pa

    first = run[0]
    labels = first.layout[0]
    at = [labels.index(n) for n in first.schema.names]
    columns = _block_columns(run, at)
    if columns is None:
        try:
            columns = [np.concatenate([f.df._mgr.iget_values(i) for f in run]) for i in at]
        except AttributeError:  # a pandas without the block manager accessor
            columns = [np.concatenate([f.df.iloc[:, i].to_numpy() for f in run]) for i in at]
    try:
        arrays = [pa.array(values, type=field.type, from_pandas=True, safe=True)
                  for values, field in zip(columns, arrow_out, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=arrow_out)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as exc:
        raise SchemaError(f"{first.what}: output does not fit schema {first.schema.simpleString()}: {exc}") from exc


def _block_columns(run: list[Frame], at: list[int]) -> list[Any] | None:
    """``_stack_frames``' columns (``at``: label positions) joined a block at a time: when
    every frame of the run has the same blocks, each a 2-D numpy array (or a tz-naive
    datetime or timedelta array over one) placed on the same columns (a slice), the blocks
    are joined along the rows with one ``numpy.concatenate`` each, and a column is a row of
    its block: one step per frame instead of one per column and frame. None when the frames'
    blocks differ (then the columns are joined one by one)."""
    import numpy as np

    try:
        blocks = [f.df._mgr.blocks for f in run]
        first = blocks[0]
        sig = tuple(b.mgr_locs.indexer for b in first)
        if not all(type(s) is slice and s.start is not None and s.stop is not None for s in sig):
            return None
        kinds = tuple(type(b.values) for b in first)
        if any(_block_array(b) is None for b in first):
            return None
        n = len(sig)
        if n == 1:
            one, kind = sig[0], kinds[0]
            if not all(len(bs) == 1 and bs[0].mgr_locs.indexer == one and type(bs[0].values) is kind
                       for bs in blocks):
                return None
        elif not all(len(bs) == n and tuple(b.mgr_locs.indexer for b in bs) == sig
                     and tuple(type(b.values) for b in bs) == kinds for bs in blocks):
            return None
    except AttributeError:  # a pandas without these internals
        return None
    where: dict[int, tuple[int, int]] = {}  # label position -> (block, row in it)
    for j, s in enumerate(sig):
        for r, pos in enumerate(range(s.start, s.stop, s.step or 1)):
            where[pos] = (j, r)
    joined: dict[int, Any] = {}
    out = []
    for i in at:
        j, r = where[i]
        if j not in joined:
            joined[j] = np.concatenate([_block_array(bs[j]) for bs in blocks], axis=1)
        out.append(joined[j][r])
    return out


def _block_array(block: Any) -> Any:
    """A block's values as a 2-D numpy array of the block's dtype: the array itself, or the
    one a tz-naive datetime or timedelta array wraps; None for anything else."""
    import numpy as np

    values = block.values
    if type(values) is not np.ndarray:
        values = getattr(values, "_ndarray", None)
        if type(values) is not np.ndarray:
            return None
    return values if values.ndim == 2 and values.dtype == block.dtype else None


def _frame_batch(df: Any, schema: StructType, arrow_out, what: str) -> Any:
    """A frame with the schema's columns by name -> one RecordBatch, column by column with
    the conversion ``Table.from_pandas(df, schema=arrow_out)`` applies to each column."""
    import pyarrow as pa

    try:
        arrays = [pa.array(df[n], type=f.type, from_pandas=True, safe=True)
                  for n, f in zip(schema.names, arrow_out, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=arrow_out)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as exc:
        raise SchemaError(f"{what}: output does not fit schema {schema.simpleString()}: {exc}") from exc


def frames_to_batches(frames: Iterable[Any], schema: StructType, arrow_out, what: str) -> list[Any]:
    """``frames_to_records`` for the columnar path: the frames as RecordBatches of ``arrow_out``
    (one per non-empty frame), made column by column with the conversion
    ``Table.from_pandas(df, schema=arrow_out)`` applies to each column (``pa.array(column,
    type, from_pandas=True)``), without the per-frame column selection and pandas metadata.
    Columns match by name when the labels are unique strings, by position when none is a
    string, with the same errors as ``frames_to_records``."""
    import pandas as pd
    import pyarrow as pa

    out: list[Any] = []
    names = schema.names
    fields = list(arrow_out)
    for df in frames:
        if not isinstance(df, pd.DataFrame):
            raise SchemaError(f"{what} must yield pandas DataFrames, got {type(df).__name__}")
        if len(df) == 0:
            continue
        labels = list(df.columns)
        if not all(isinstance(c, str) for c in labels):
            if len(labels) != len(names):
                raise SchemaError(f"{what}: a frame with {len(labels)} unnamed columns "
                                  f"for schema {schema.simpleString()}")
            columns = [df.iloc[:, i] for i in range(len(names))]
        else:
            missing = [n for n in names if n not in labels]
            if missing:
                raise SchemaError(f"{what}: output frame lacks column(s) {missing} of schema {schema.simpleString()}")
            if not df.columns.is_unique:  # a label twice: as frames_to_records converts it
                out.extend(pa.Table.from_pylist(frames_to_records([df], schema, arrow_out, what),
                                                schema=arrow_out).to_batches())
                continue
            out.append(_frame_batch(df, schema, arrow_out, what))
            continue
        try:
            arrays = [pa.array(c, type=f.type, from_pandas=True, safe=True) for c, f in zip(columns, fields,
                                                                                           strict=True)]
            out.append(pa.RecordBatch.from_arrays(arrays, schema=arrow_out))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as exc:
            raise SchemaError(f"{what}: output does not fit schema {schema.simpleString()}: {exc}") from exc
    return out


def batches_to_records(batches: list[Any], arrow_out) -> list[dict]:
    """RecordBatches of ``arrow_out`` -> records (dicts in schema order), in order; map
    columns as dicts (``maps_as_pydicts``), as Spark hands a row sink its map values."""
    import pyarrow as pa

    if not batches:
        return []
    table = pa.Table.from_batches(batches_of(batches, arrow_out), schema=arrow_out)
    records: list[dict] = table.to_pylist(maps_as_pydicts="strict")
    return records


def concat_output(batches: list[Any], arrow_out, columnar: bool) -> Any:
    """The output of one input batch: one RecordBatch of ``arrow_out`` (``columnar``), or
    records (Row mode)."""
    import pyarrow as pa

    if not columnar:
        return batches_to_records(batches, arrow_out)
    if not batches:
        return []
    batches = batches_of(batches, arrow_out)
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


def rows_to_records(rows: Iterable[Any], schema: StructType, what: str) -> list[dict]:
    """Rows a Row-mode processor yielded -> records (dicts in schema order)."""
    out: list[dict] = []
    names = schema.names
    for r in rows:
        if named_row(r):
            d = r.asDict()
        elif isinstance(r, dict):
            d = r
        elif isinstance(r, (tuple, list)) and len(r) == len(names):
            d = dict(zip(names, r, strict=True))
        else:
            raise SchemaError(f"{what} must yield pyspark Rows, got {type(r).__name__}")
        try:
            out.append({n: to_python(d[n]) for n in names})
        except KeyError as exc:
            raise SchemaError(f"{what}: output row {r!r} lacks field {exc} of schema {schema.simpleString()}") from None
    return out
