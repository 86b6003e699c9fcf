"""Spark schemas without pyspark: DDL strings and ``StructType`` objects as Arrow schemas.

``from_json`` takes its schema as Spark's ``from_json`` does: a DDL string (``"k string, v
long NOT NULL, ts timestamp"``) or a ``pyspark.sql.types.StructType``. A row-only job must not
import pyspark (``tests/test_layers.py``), so this module parses DDL itself and reads a
``StructType`` through its ``jsonValue()`` (the JSON form Spark stores schemas in), never
importing pyspark. A pyarrow ``Schema`` is accepted as it is.

Types map as PySpark's Arrow conversion maps them (``pyspark.sql.pandas.types.to_arrow_type``
with the session time zone UTC): ``timestamp`` is ``timestamp[us, tz=UTC]``,
``timestamp_ntz`` ``timestamp[us]``, ``date`` ``date32``, ``decimal(p, s)`` ``decimal128(p, s)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import SchemaError

#: DDL type names -> (pyarrow type constructor name, arguments)
_ATOMIC: dict[str, tuple[str, tuple[Any, ...]]] = {
    "string": ("string", ()), "varchar": ("string", ()), "char": ("string", ()),
    "int": ("int32", ()), "integer": ("int32", ()),
    "long": ("int64", ()), "bigint": ("int64", ()),
    "short": ("int16", ()), "smallint": ("int16", ()),
    "byte": ("int8", ()), "tinyint": ("int8", ()),
    "double": ("float64", ()), "float": ("float32", ()), "real": ("float32", ()),
    "boolean": ("bool_", ()), "bool": ("bool_", ()),
    "binary": ("binary", ()), "date": ("date32", ()),
    "timestamp": ("timestamp", ("us", "UTC")), "timestamp_ltz": ("timestamp", ("us", "UTC")),
    "timestamp_ntz": ("timestamp", ("us",)),
}

_TOKEN = re.compile(r"\s*(<|>|\(|\)|,|:|`(?:[^`]|``)*`|'(?:[^'\\]|\\.)*'|[A-Za-z_][A-Za-z0-9_]*|\d+)")


@dataclass(frozen=True)
class Field:
    """One field of a parsed schema: its name, Arrow type, nullability and Spark type name."""

    name: str
    type: Any
    nullable: bool
    #: the type as Spark spells it (``long``, ``array<string>``), named in dead-letter reasons
    spark: str


def arrow_schema(schema: Any, what: str = "schema") -> Any:
    """A ``pyarrow.Schema`` for a DDL string, a ``StructType`` (anything with ``jsonValue()``)
    or a pyarrow Schema; a bad schema is a ``SchemaError`` naming ``what``."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, f.type, f.nullable) for f in fields(schema, what)])


def fields(schema: Any, what: str = "schema") -> list[Field]:
    """The top-level fields of ``schema`` (see ``arrow_schema``)."""
    import pyarrow as pa

    if isinstance(schema, pa.Schema):
        return [Field(f.name, f.type, f.nullable, spark_name(f.type)) for f in schema]
    if isinstance(schema, str):
        return _Parser(schema, what).schema()
    json_value = getattr(schema, "jsonValue", None)
    if callable(json_value):
        doc = json_value()
        if not (isinstance(doc, dict) and doc.get("type") == "struct"):
            raise SchemaError(f"{what}: a {type(schema).__name__} is not a struct type; give a StructType or a "
                              f"DDL string of fields")
        return [_json_field(f, what) for f in doc["fields"]]
    raise SchemaError(f"{what} must be a Spark DDL string, a pyspark StructType or a pyarrow Schema, "
                      f"got {type(schema).__name__}")


def spark_name(t: Any) -> str:
    """How Spark spells an Arrow type (for messages)."""
    import pyarrow as pa

    simple = {pa.string(): "string", pa.large_string(): "string", pa.int32(): "int", pa.int64(): "long",
              pa.int16(): "short", pa.int8(): "byte", pa.float64(): "double", pa.float32(): "float",
              pa.bool_(): "boolean", pa.binary(): "binary", pa.large_binary(): "binary", pa.date32(): "date"}
    if t in simple:
        return simple[t]
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"array<{spark_name(t.value_type)}>"
    if pa.types.is_map(t):
        return f"map<{spark_name(t.key_type)},{spark_name(t.item_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{t.field(i).name}:{spark_name(t.field(i).type)}"
                                    for i in range(t.num_fields)) + ">"
    return str(t)


def _arrow(name: str, args: tuple[Any, ...]) -> Any:
    import pyarrow as pa

    return getattr(pa, name)(*args)


# ---------------------------------------------------------------- DDL strings


class _Parser:
    """``name type [NOT NULL] [COMMENT '...'], ...``, types as Spark's DDL spells them."""

    def __init__(self, text: str, what: str) -> None:
        self.text, self.what = text, what
        self.tokens = self._tokens(text)
        self.i = 0

    def _tokens(self, text: str) -> list[str]:
        out, pos = [], 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise SchemaError(f"{self.what} {self.text!r}: cannot parse at {text[pos:]!r}")
            out.append(m.group(1))
            pos = m.end()
        return out

    def _fail(self, why: str) -> SchemaError:
        return SchemaError(f"{self.what} {self.text!r}: {why}")

    def _next(self) -> str:
        if self.i >= len(self.tokens):
            raise self._fail("ends too early")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _expect(self, tok: str) -> None:
        got = self._next()
        if got != tok:
            raise self._fail(f"expected {tok!r}, found {got!r}")

    def schema(self) -> list[Field]:
        if not self.tokens:
            raise self._fail("names no field")
        if self.tokens[0].lower() == "struct" and self._peek_at(1) == "<":  # "struct<a:int,b:string>"
            self.i = 2
            out = self._fields(">")
        else:
            out = self._fields(None)
        if self.i != len(self.tokens):
            raise self._fail(f"unexpected {self.tokens[self.i]!r}")
        names = [f.name for f in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise self._fail(f"field {dup[0]!r} appears twice")
        return out

    def _peek_at(self, k: int) -> str | None:
        return self.tokens[k] if k < len(self.tokens) else None

    def _fields(self, end: str | None) -> list[Field]:
        out = []
        while True:
            tok = self._next()
            if tok in "<>(),:" or tok.startswith("'"):
                raise self._fail(f"expected a field name, found {tok!r}")
            name = tok[1:-1].replace("``", "`") if tok.startswith("`") else tok
            if self._peek() == ":":
                self.i += 1
            typ, spark = self._type()
            nullable = True
            while self._peek() is not None and self._peek().lower() in ("not", "comment"):  # type: ignore[union-attr]
                word = self._next().lower()
                if word == "not":
                    if (self._peek() or "").lower() != "null":
                        raise self._fail(f"expected NULL after NOT in field {name!r}")
                    self.i += 1
                    nullable = False
                else:
                    text = self._next()
                    if not text.startswith("'"):
                        raise self._fail(f"expected a quoted comment for field {name!r}, found {text!r}")
            out.append(Field(name, typ, nullable, spark))
            if self._peek() == ",":
                self.i += 1
                continue
            break
        if end is not None:
            self._expect(end)
        return out

    def _type(self) -> tuple[Any, str]:
        import pyarrow as pa

        name = self._next().lower()
        if name in _ATOMIC:
            if self._peek() == "(":  # char(10), varchar(10)
                self.i += 1
                self._next()
                self._expect(")")
            return _arrow(*_ATOMIC[name]), name
        if name in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self._peek() == "(":
                self.i += 1
                precision = int(self._next())
                if self._peek() == ",":
                    self.i += 1
                    scale = int(self._next())
                self._expect(")")
            if not 1 <= precision <= 38 or not 0 <= scale <= precision:
                raise self._fail(f"decimal({precision},{scale}) needs 1 <= precision <= 38 and 0 <= scale <= precision")
            return pa.decimal128(precision, scale), f"decimal({precision},{scale})"
        if name == "array":
            self._expect("<")
            elem, spark = self._type()
            self._expect(">")
            return pa.list_(elem), f"array<{spark}>"
        if name == "map":
            self._expect("<")
            k, ks = self._type()
            self._expect(",")
            v, vs = self._type()
            self._expect(">")
            return pa.map_(k, v), f"map<{ks},{vs}>"
        if name == "struct":
            self._expect("<")
            inner = self._fields(">")
            typ = pa.struct([pa.field(f.name, f.type, f.nullable) for f in inner])
            return typ, "struct<" + ",".join(f"{f.name}:{f.spark}" for f in inner) + ">"
        raise self._fail(f"unknown type {name!r}")


# ---------------------------------------------------------------- StructType.jsonValue()

_DECIMAL = re.compile(r"decimal\((\d+),\s*(\d+)\)$")
_SIZED = re.compile(r"(?:var)?char\(\d+\)$")


def _json_field(doc: dict[str, Any], what: str) -> Field:
    typ, spark = _json_type(doc["type"], what)
    return Field(str(doc["name"]), typ, bool(doc.get("nullable", True)), spark)


def _json_type(doc: Any, what: str) -> tuple[Any, str]:
    import pyarrow as pa

    if isinstance(doc, str):
        if doc in _ATOMIC:
            return _arrow(*_ATOMIC[doc]), doc
        if _SIZED.match(doc):
            return pa.string(), "string"
        m = _DECIMAL.match(doc)
        if m:
            p, s = int(m.group(1)), int(m.group(2))
            return pa.decimal128(p, s), f"decimal({p},{s})"
        raise SchemaError(f"{what}: Spark type {doc!r} has no Arrow type here")
    kind = doc.get("type")
    if kind == "array":
        elem, spark = _json_type(doc["elementType"], what)
        return pa.list_(elem), f"array<{spark}>"
    if kind == "map":
        k, ks = _json_type(doc["keyType"], what)
        v, vs = _json_type(doc["valueType"], what)
        return pa.map_(k, v), f"map<{ks},{vs}>"
    if kind == "struct":
        inner = [_json_field(f, what) for f in doc["fields"]]
        typ = pa.struct([pa.field(f.name, f.type, f.nullable) for f in inner])
        return typ, "struct<" + ",".join(f"{f.name}:{f.spark}" for f in inner) + ">"
    raise SchemaError(f"{what}: Spark type {doc!r} has no Arrow type here")
