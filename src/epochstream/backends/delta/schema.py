"""The columns of a Delta state table, defined once: names, Spark SQL types, nullability.

Everything else is derived from ``COLUMNS``: the names the backend selects, the Spark DDL of
the table, and the Arrow schema of an epoch's appended rows (what ``DeltaCheckpointStorage`` folds
from state files). Key and value are pickled bytes, as in the state files
(``objects.STATE_SCHEMA`` holds the first four columns); ``value`` NULL is a tombstone: the
key's state was deleted in that row's epoch (the table is a changelog, ``changelog.fold``). A
state or key that declares a type adds a ``typed_*`` column (``backends.typed``), which is not
part of this fixed schema.

Pure data, no Spark: importing it starts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from ...runtime.types import TypeInformation
from ..typed import arrow_type


@dataclass(frozen=True)
class Column:
    """One fixed column of a state table."""

    name: str
    #: its Spark SQL type (``TypeInformation`` spelling, so ``backends.typed`` maps it to Arrow)
    sql: str
    #: whether the Delta table allows NULL there
    nullable: bool = False

    @property
    def arrow(self) -> pa.DataType:
        return arrow_type(TypeInformation.from_json(self.sql))

    @property
    def ddl(self) -> str:
        return f"{self.name} {self.sql}" + ("" if self.nullable else " NOT NULL")


#: the fixed columns, in table order
COLUMNS: tuple[Column, ...] = (
    Column("key_group", "INT"),
    Column("key", "BINARY"),
    Column("state", "STRING"),
    Column("value", "BINARY", nullable=True),
    Column("epoch", "BIGINT"),
)

#: all fixed column names, in table order
NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
#: the columns of a committed-state row (``backends.base.Row``): what a restore reads back
ROW_NAMES: tuple[str, ...] = NAMES[:4]
#: the columns that identify a row: the fold keeps the newest row per key of them
ROW_KEY: tuple[str, ...] = ("key_group", "key", "state")
#: the table's fixed columns as Spark DDL (``CREATE TABLE t (<DDL>) USING DELTA``)
DDL = ", ".join(c.ddl for c in COLUMNS)


def arrow_schema(names: tuple[str, ...] = NAMES) -> pa.Schema:
    """The Arrow schema of the named columns, as an epoch's appended rows hold them.

    All its fields are nullable, as Arrow builds them; null values are tombstones. The table's
    own nullability is ``DDL``'s.
    """
    by_name = {c.name: c for c in COLUMNS}
    return pa.schema([pa.field(n, by_name[n].arrow) for n in names])
