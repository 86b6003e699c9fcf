"""Columnar batches: Arrow ``RecordBatch`` records in a ``Batch``, and the few kernels the
chain needs on them.

A ``Batch``'s records are either a Python list (the row path) or one ``pyarrow.RecordBatch``
(the columnar path). Row operators (``map``, ``filter``, ``flat_map``, keyed ``process``,
sinks) turn a RecordBatch into rows once per batch (``to_rows``: a dict per row); columnar
operators (``map_batches``, keyed batch functions) turn rows into a RecordBatch once per batch
(``from_rows``). Routing by column keys, per-key grouping and rebalancing use Arrow kernels
only: no Python call per row.

pyarrow is imported inside the functions: a job that never sees a RecordBatch never loads it.
"""

from __future__ import annotations

from typing import Any

from ..graph.keygroups import canonical_key, distinct_keys
from ..graph.plan import ColumnKey
from .errors import SchemaError, UserFunctionError


def is_columnar_batch(value: Any) -> bool:
    """Whether ``value`` is an Arrow RecordBatch (what columnar operators pass on)."""
    return hasattr(value, "schema") and hasattr(value, "num_rows") and hasattr(value, "column")


def to_rows(batch: Any) -> list[Any]:
    """The rows of a RecordBatch as dicts (column name -> Python value), map values as dicts
    as Spark and pandas users get them (Arrow's default is a list of key-value pairs); a map
    with a key twice is an error, as Spark's default ``mapKeyDedupPolicy`` makes it. The map
    option is asked for only when the schema has a map: it costs ~8x per row (pyarrow 26)."""
    rows: list[Any] = batch.to_pylist(maps_as_pydicts="strict") if _has_map(batch.schema) else batch.to_pylist()
    return rows


def _has_map(schema: Any) -> bool:
    return any(_type_has_map(f.type) for f in schema)


def _type_has_map(t: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_map(t):
        return True
    if pa.types.is_struct(t):
        return any(_type_has_map(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _type_has_map(t.value_type)
    if pa.types.is_dictionary(t):
        return _type_has_map(t.value_type)
    return False


def from_rows(rows: list[Any], where: str) -> Any:
    """A RecordBatch of dict rows (``where`` names the operator for the error)."""
    import pyarrow as pa

    if rows and not isinstance(rows[0], dict):
        raise SchemaError(
            f"{where}: a columnar operator needs dict records (column name -> value) or Arrow batches; "
            f"got a {type(rows[0]).__name__}: {rows[0]!r:.200}"
        )
    try:
        return pa.RecordBatch.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise SchemaError(f"{where}: Arrow cannot make a batch of these rows ({type(exc).__name__}: {exc})") from None


def as_record_batch(value: Any, where: str) -> Any:
    """What a columnar user function returned, as one RecordBatch (None: nothing)."""
    import pyarrow as pa

    if value is None or type(value) is pa.RecordBatch:
        return value
    if isinstance(value, pa.Table):
        return concat(value.to_batches()) if value.num_rows else None
    raise SchemaError(f"{where} must return a pyarrow RecordBatch or Table (or None), got {type(value).__name__}")


def concat(batches: list[Any]) -> Any:
    """One RecordBatch of ``batches`` (same schema), in order."""
    import pyarrow as pa

    if len(batches) == 1:
        return batches[0]
    if hasattr(pa, "concat_batches"):  # pyarrow >= 19
        return pa.concat_batches(batches)
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def to_ipc(batch: Any) -> bytes:
    """A RecordBatch as an Arrow IPC stream (schema + one batch): what crosses a process
    boundary. A slice carries only its own rows (pickling a slice ships its parent's buffers)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def from_ipc(data: bytes) -> Any:
    """The RecordBatch of ``to_ipc`` (zero-copy over ``data``)."""
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_next_batch()


def key_columns(batch: Any, key: ColumnKey, where: str) -> list[Any]:
    """The key columns of ``batch``; a SchemaError names ``where`` and any missing column."""
    names = batch.schema.names
    missing = [c for c in key.columns if c not in names]
    if missing:
        raise SchemaError(f"{where}: the batch has no column {missing[0]!r} (its columns: {names})")
    return [batch.column(c) for c in key.columns]


def keys_of(batch: Any, key: ColumnKey, where: str) -> list[Any]:
    """The key of every row, as ``key(row)`` gives it for the row's dict."""
    cols = [c.to_pylist() for c in key_columns(batch, key, where)]
    return list(zip(*cols, strict=True)) if key.tuple_key else cols[0]


def split_by_code(batch: Any, codes: Any) -> list[tuple[int, Any]]:
    """``batch`` cut into one slice per distinct ``codes`` value (an integer array, one per row):
    ``[(code, rows with that code)]`` in ascending code order, each slice in row order.

    One stable ``sort_indices``, one ``take`` and zero-copy slices, whatever the number of codes.
    """
    import pyarrow.compute as pc

    if batch.num_rows == 0:
        return []
    order = pc.sort_indices(codes)  # stable: rows of one code keep their order
    runs = pc.run_end_encode(codes.take(order))
    ends = runs.run_ends.to_pylist()
    values = runs.values.to_pylist()
    taken = batch.take(order)
    out, start = [], 0
    for code, end in zip(values, ends, strict=True):
        out.append((code, taken.slice(start, end - start)))
        start = end
    return out


def group_by_key(batch: Any, key: ColumnKey, where: str) -> list[tuple[Any, Any]]:
    """``[(key, the rows of that key)]`` for every distinct key of ``batch``, keys in order of
    first appearance, rows in batch order."""
    codes, keys = distinct_keys(key_columns(batch, key, where), key.tuple_key)
    if len(keys) == 1:
        return [(keys[0], batch)]
    return [(keys[c], part) for c, part in split_by_code(batch, codes)]


def even_slices(num_rows: int, parts: int, start: int) -> list[tuple[int, int, int]]:
    """Round robin for a columnar batch: ``(part, offset, length)`` slices of ``num_rows`` rows
    over ``parts`` parts, beginning at part ``start``; sizes differ by at most one, and the
    first ``num_rows % parts`` parts from ``start`` get the extra row."""
    base, extra = divmod(num_rows, parts)
    out, offset = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        if size:
            out.append(((start + k) % parts, offset, size))
            offset += size
    return out


class KeyedBatches:
    """The operator behind ``key_by(columns).process_batches(fn)``: one call of
    ``fn.process_batch(key, rows_of_that_key, ctx)`` per distinct key of a batch, with the
    key's state current (``ctx.state(...)`` handles), and the outputs concatenated.

    ``fn``: an object with ``process_batch(key, batch, ctx)`` and optional ``open(ctx)`` /
    ``close()`` (``api.functions.KeyedBatchFunction``), or a plain function of (key, batch, ctx).
    ``key``: the ``ColumnKey`` of the ``key_by`` before it.
    """

    #: the chain and the oracle dispatch on this, not on method names
    columnar_keyed = True

    def __init__(self, fn: Any, key: ColumnKey) -> None:
        self.fn = fn
        self.key = key
        self._call = fn.process_batch if hasattr(fn, "process_batch") else fn

    def __deepcopy__(self, memo: dict[int, Any]) -> "KeyedBatches":
        import copy

        return KeyedBatches(copy.deepcopy(self.fn, memo), self.key)

    def open(self, ctx: Any) -> None:
        if hasattr(self.fn, "open"):
            self.fn.open(ctx)

    def close(self) -> None:
        if hasattr(self.fn, "close"):
            self.fn.close()

    def apply(self, records: Any, keyslot: Any, ctx: Any, label: str, state: Any = None) -> Any:
        """Run a batch (RecordBatch, or dict rows) through the function; returns one
        RecordBatch of the outputs, or None. ``state``: the keyed-state backend, told the
        batch's keys first when it ``prefetches`` (RocksDB reads and writes them in one call
        each way: ``RocksDBKeyedState.begin_batch``)."""
        import pyarrow as pa

        where = f"process_batches {label!r}"
        batch = from_rows(records, where) if type(records) is list else records
        out = []
        call, record_batch = self._call, pa.RecordBatch
        # a NaN of this batch is a new object: the one NaN key
        groups = [(canonical_key(k), part) for k, part in group_by_key(batch, self.key, f"{where} (key_by {self.key})")]
        scoped = getattr(state, "prefetches", False)
        if scoped:
            state.begin_batch([k for k, _ in groups])
        try:
            for k, part in groups:
                keyslot.key = k
                try:
                    res = call(k, part, ctx)
                except Exception as exc:
                    raise UserFunctionError(f"{where} failed", exc, key=k) from exc
                if res is None:
                    continue
                if type(res) is not record_batch:
                    res = as_record_batch(res, where)
                if res is not None and res.num_rows:
                    out.append(res)
        finally:
            if scoped:
                state.end_batch()
        if not out:
            return None
        try:
            return concat(out)
        except Exception as exc:  # outputs of one batch must share a schema to travel as one batch
            raise SchemaError(f"{where}: the outputs for different keys have different schemas ({exc})") from None
