"""Declared types of keyed state (PyFlink's ``Types``), for typed columns in committed state.

State is always pickled for snapshots and restores: pickling is exact for any Python value.
A declared type adds a second, typed view where one is wanted: the Delta backend writes each
declared state as a typed column beside the pickled bytes, so Spark SQL can filter and
aggregate committed state without unpickling. A type is therefore a contract on the values,
checked when the state is captured (a value that does not fit fails the epoch with a clear
error, before anything is committed), not a serializer.

A type is kept in manifests as a small JSON tree (``to_json``/``from_json``): a primitive's
name, or ``{"list": t}``, ``{"map": [k, v]}``, ``{"row": [[name, t], ...]}``. Backends turn
that tree into their own types (Arrow, Spark SQL) without importing this package's callers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

_INT_RANGE = {"TINYINT": 1 << 7, "INT": 1 << 31, "BIGINT": 1 << 63}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class TypeInformation:
    """A declared type: ``name`` is its Spark SQL spelling for primitives, or list/map/row."""

    name: str
    args: tuple[Any, ...] = ()

    # ------------------------------------------------------------ spelling
    @property
    def sql(self) -> str:
        """The type in Spark SQL DDL (what a Delta table column is declared as)."""
        if self.name == "list":
            return f"ARRAY<{self.args[0].sql}>"
        if self.name == "map":
            return f"MAP<{self.args[0].sql}, {self.args[1].sql}>"
        if self.name == "row":
            return "STRUCT<" + ", ".join(f"{n}: {t.sql}" for n, t in self.args) + ">"
        return self.name

    def __repr__(self) -> str:
        return f"Types<{self.sql}>"

    def to_json(self) -> Any:
        if self.name == "list":
            return {"list": self.args[0].to_json()}
        if self.name == "map":
            return {"map": [self.args[0].to_json(), self.args[1].to_json()]}
        if self.name == "row":
            return {"row": [[n, t.to_json()] for n, t in self.args]}
        return self.name

    @staticmethod
    def from_json(spec: Any) -> "TypeInformation":
        if isinstance(spec, str) and spec in _PRIMITIVES:
            return TypeInformation(spec)
        if isinstance(spec, dict) and len(spec) == 1:
            (kind, arg), = spec.items()
            if kind == "list":
                return TypeInformation("list", (TypeInformation.from_json(arg),))
            if kind == "map" and isinstance(arg, list) and len(arg) == 2:
                return TypeInformation("map", (TypeInformation.from_json(arg[0]), TypeInformation.from_json(arg[1])))
            if kind == "row" and isinstance(arg, list):
                return Types.ROW_NAMED([n for n, _ in arg], [TypeInformation.from_json(t) for _, t in arg])
        raise ValueError(f"not a state type: {spec!r}")

    # ------------------------------------------------------------ values
    def check(self, value: Any) -> str | None:
        """Why ``value`` does not fit this type (None: it fits). ``None`` always fits (SQL NULL)."""
        if value is None:
            return None
        name = self.name
        if name == "STRING":
            return None if isinstance(value, str) else f"{type(value).__name__} is not a string"
        if name == "BOOLEAN":
            return None if isinstance(value, bool) else f"{type(value).__name__} is not a bool"
        if name in _INT_RANGE:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{type(value).__name__} is not an int"
            bound = _INT_RANGE[name]
            return None if -bound <= value < bound else f"{value} is out of the range of {name}"
        if name in ("FLOAT", "DOUBLE"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return None if ok else f"{type(value).__name__} is not a number"
        if name == "BINARY":
            return None if isinstance(value, (bytes, bytearray)) else f"{type(value).__name__} is not bytes"
        if name == "list":
            if not isinstance(value, (list, tuple)):
                return f"{type(value).__name__} is not a list"
            for i, v in enumerate(value):
                why = self.args[0].check(v)
                if why:
                    return f"element {i}: {why}"
            return None
        if name == "map":
            if not isinstance(value, Mapping):
                return f"{type(value).__name__} is not a dict"
            for k, v in value.items():
                if k is None:
                    return "a map key is None"
                why = self.args[0].check(k) or self.args[1].check(v)
                if why:
                    return f"entry {k!r}: {why}"
            return None
        if name == "row":
            fields = self.args
            if isinstance(value, Mapping):
                extra = set(value) - {n for n, _ in fields}
                if extra:
                    return f"unknown fields {sorted(map(str, extra))}"
                items = [(n, t, value.get(n)) for n, t in fields]
            elif isinstance(value, (tuple, list)) and len(value) == len(fields):
                items = [(n, t, v) for (n, t), v in zip(fields, value, strict=True)]
            else:
                return f"{type(value).__name__} is neither a dict nor a tuple of {len(fields)} fields"
            for n, t, v in items:
                why = t.check(v)
                if why:
                    return f"field {n!r}: {why}"
            return None
        return f"unknown type {name}"  # pragma: no cover - constructors only build the above

    def plain(self, value: Any) -> Any:
        """The value in the shape columnar writers take: rows as dicts, maps as (key, value) pairs."""
        if value is None:
            return None
        if self.name == "list":
            t = self.args[0]
            return [t.plain(v) for v in value]
        if self.name == "map":
            kt, vt = self.args
            return [(kt.plain(k), vt.plain(v)) for k, v in value.items()]
        if self.name == "row":
            if isinstance(value, Mapping):
                return {n: t.plain(value.get(n)) for n, t in self.args}
            return {n: t.plain(v) for (n, t), v in zip(self.args, value, strict=True)}
        if self.name in ("FLOAT", "DOUBLE"):
            return float(value)
        if self.name == "BINARY":
            return bytes(value)
        return value


_PRIMITIVES = ("STRING", "BOOLEAN", "TINYINT", "INT", "BIGINT", "FLOAT", "DOUBLE", "BINARY")


class Types:
    """PyFlink's type constructors, for the types a typed column can hold."""

    @staticmethod
    def STRING() -> TypeInformation:
        return TypeInformation("STRING")

    @staticmethod
    def BOOLEAN() -> TypeInformation:
        return TypeInformation("BOOLEAN")

    @staticmethod
    def BYTE() -> TypeInformation:
        return TypeInformation("TINYINT")

    @staticmethod
    def INT() -> TypeInformation:
        return TypeInformation("INT")

    @staticmethod
    def LONG() -> TypeInformation:
        return TypeInformation("BIGINT")

    @staticmethod
    def FLOAT() -> TypeInformation:
        return TypeInformation("FLOAT")

    @staticmethod
    def DOUBLE() -> TypeInformation:
        return TypeInformation("DOUBLE")

    @staticmethod
    def PRIMITIVE_ARRAY(element: TypeInformation) -> TypeInformation:
        """``PRIMITIVE_ARRAY(BYTE())`` is bytes (BINARY); any other element gives a list."""
        if element == TypeInformation("TINYINT"):
            return TypeInformation("BINARY")
        return Types.LIST(element)

    @staticmethod
    def LIST(element: TypeInformation) -> TypeInformation:
        return TypeInformation("list", (_type(element, "LIST element"),))

    @staticmethod
    def BASIC_ARRAY(element: TypeInformation) -> TypeInformation:
        return Types.LIST(element)

    @staticmethod
    def MAP(key: TypeInformation, value: TypeInformation) -> TypeInformation:
        return TypeInformation("map", (_type(key, "MAP key"), _type(value, "MAP value")))

    @staticmethod
    def ROW_NAMED(names: list[str], types: list[TypeInformation]) -> TypeInformation:
        if len(names) != len(types) or not names:
            raise ValueError(f"ROW_NAMED needs as many (and at least one) names as types, got {names!r}")
        for n in names:
            if not isinstance(n, str) or not _IDENTIFIER.match(n):
                raise ValueError(f"ROW_NAMED field name {n!r} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")
        if len(set(names)) != len(names):
            raise ValueError(f"ROW_NAMED field names repeat: {names!r}")
        fields = tuple((n, _type(t, f"ROW field {n!r}")) for n, t in zip(names, types, strict=True))
        return TypeInformation("row", fields)

    @staticmethod
    def PICKLED_BYTE_ARRAY() -> None:
        """Any picklable value, no typed column (the default)."""
        return None


def _type(t: Any, what: str) -> TypeInformation:
    if not isinstance(t, TypeInformation):
        raise TypeError(f"{what}: expected a type from epochstream.Types, got {t!r}")
    return t


def column_type(kind: str, type_info: Any) -> TypeInformation | None:
    """The type of a state's column from its descriptor: a value state holds the type, a list
    state a list of it, a map state a map of the (key, value) pair or of a ``Types.MAP``."""
    if type_info is None:
        return None
    if kind == "list":
        return Types.LIST(_type(type_info, "ListStateDescriptor element type"))
    if kind == "map":
        if isinstance(type_info, TypeInformation):
            if type_info.name != "map":
                raise TypeError(f"MapStateDescriptor type must be Types.MAP(k, v) or a (k, v) pair, got {type_info!r}")
            return type_info
        if isinstance(type_info, tuple) and len(type_info) == 2:
            return Types.MAP(*type_info)
        raise TypeError(f"MapStateDescriptor type must be Types.MAP(k, v) or a (k, v) pair, got {type_info!r}")
    return _type(type_info, "ValueStateDescriptor type")


def typed_column_name(state: str) -> str:
    """The typed column of a state; state names must then be identifiers (Delta column names)."""
    if not _IDENTIFIER.match(state):
        raise ValueError(
            f"state {state!r} declares a type, so it gets a typed column, and its name must be an identifier "
            f"([A-Za-z_][A-Za-z0-9_]*)"
        )
    return f"typed_{state}"
