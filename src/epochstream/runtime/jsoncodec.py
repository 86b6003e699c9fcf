"""JSON in and out of Arrow batches, vectorised: Spark's ``from_json`` and ``to_json``.

Decoding (``JsonDecoder``, behind ``Stream.from_json``). Theory of operation. A batch's JSON
values (a binary or string column: a Kafka ``value``) become typed columns in one call of
pyarrow's JSON reader: the values joined by newlines, read with the schema as
``explicit_schema`` (fields the schema does not name are ignored, missing nullable fields are
null, as in Spark) in one block, so no record straddles two. Newline-delimited reading maps
line i to row i only when every value is one JSON object on one line, so a cheap vectorised
screen runs first: null, empty and oversized values are dead at once; a value whose first byte
is not ``{`` or that holds a raw newline (``\\n`` or ``\\r``, which the reader takes as a line
end) is looked at alone (a valid object spread over lines has its newlines replaced by spaces,
which inside JSON are whitespace, never string content: ``json.loads`` in strict mode has
rejected raw control characters in strings by then). After that every line starts with ``{``,
so each gives at least one row or an error; the read is accepted only if it gives exactly one
row per value, which then proves the mapping (a line that held two objects would need another
to give none).

If the read fails (malformed JSON, a value of the wrong type, a NOT NULL field missing or
null, a line of two objects), the failing values are found without giving up the one call per
batch on the good path: runs larger than ``SCREEN_ROWS`` are halved and read again; a failing
run of at most ``SCREEN_ROWS`` values is looked at value by value in Python (``problem``:
``json.loads`` and a check of each field's JSON kind against its type, which names the field),
each value it flags is confirmed by a read of its own, and the rest is read in one call (halved
further should it still fail). A value's fate is decided by the value alone (by the screen,
or by a read of it alone), never by the rest of its batch, so a replay that cuts batches
elsewhere decides alike. A dead value goes to the dead-letter output with the reason and the topic, partition and
offset of its row when the batch has those columns. Rows carry over the ``keep`` columns (key,
timestamp...). Dates are read as strings and cast (Arrow's JSON reader reads dates only as day
numbers); maps and binary fields are refused when the schema is given (Arrow's reader has no
maps; Spark reads binary as base64). Invalid UTF-8 is found with one validating cast (Arrow's
reader would let it into string columns).

Encoding (``encode_json``): the JSON text of every row built column by column with
pyarrow.compute string kernels (casts, ``replace_substring`` escapes, one
``binary_join_element_wise``). See its docstring for the exact format.

pyarrow is imported inside the functions: a row-only job never loads it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, Sequence

from . import ddl
from .errors import SchemaError

#: records larger than this (bytes) are dead letters by default: Kafka's default
#: ``message.max.bytes`` (1 MiB and a little) lets nothing larger reach a topic anyway
MAX_RECORD_BYTES = 1 << 20
#: the Kafka columns a dead letter names when the input has them
LOCATING_COLUMNS = ("topic", "partition", "offset")
#: a failed read of at most this many values looks at them one by one in Python (larger runs
#: are halved first): a JSON read has a fixed cost of ~0.2 ms, Python ~3 us per value
SCREEN_ROWS = 512
#: bytes one JSON read takes at most (pyarrow's block size is an int32); larger runs are halved
_MAX_BLOCK = 1 << 30


class DeadLetter:
    """A record ``from_json`` could not decode, on its way to the dead-letter output; the API's
    operator behind the decoder unwraps it (as ``runtime.watermarks.LateRecord``)."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def __reduce__(self) -> tuple[type, tuple[Any]]:
        return (DeadLetter, (self.record,))

    def __eq__(self, other: object) -> bool:
        return type(other) is DeadLetter and other.record == self.record

    def __hash__(self) -> int:
        return hash(("DeadLetter", repr(self.record)))

    def __repr__(self) -> str:
        return f"DeadLetter({self.record!r})"


class _Unreadable(Exception):
    """A run of values the reader could not turn into one good row each."""


class JsonDecoder:
    """Spark's ``from_json`` for batches: ``decode(records)`` -> (good RecordBatch or None, dead
    letters as dicts). ``records``: a RecordBatch, or dict rows (the columns are made once per
    batch). See the module docstring."""

    def __init__(self, schema: Any, column: str = "value", keep: Sequence[str] = (),
                 max_record_bytes: int | None = MAX_RECORD_BYTES, what: str = "from_json") -> None:
        import pyarrow as pa

        self.what = what
        self.fields = ddl.fields(schema, f"{what} schema")
        for f in self.fields:
            _check_readable(f.type, f"{what}: field {f.name!r} ({f.spark})")
        if isinstance(keep, str):
            keep = (keep,)
        self.column = column
        self.keep = tuple(keep)
        names = {f.name for f in self.fields}
        clash = sorted(names & set(self.keep))
        if clash:
            raise SchemaError(f"{what}: keep column {clash[0]!r} is also a field of the schema; rename one")
        if len(set(self.keep)) != len(self.keep):
            raise SchemaError(f"{what}: keep names a column twice: {list(self.keep)}")
        if max_record_bytes is not None and (isinstance(max_record_bytes, bool) or not isinstance(
                max_record_bytes, int) or max_record_bytes < 2):
            raise ValueError(f"{what}: max_record_bytes must be an int >= 2 or None, got {max_record_bytes!r}")
        self.max_record_bytes = max_record_bytes
        #: what the reader is asked for (dates as strings) and what the output holds
        self.read_schema = pa.schema([pa.field(f.name, _read_type(f.type)) for f in self.fields])
        self.schema = pa.schema([pa.field(f.name, f.type, f.nullable) for f in self.fields])
        self._casts = [i for i, f in enumerate(self.fields) if _read_type(f.type) != f.type]
        self._required = [f.name for f in self.fields if not f.nullable]
        self._parse_options = _parse_options(self.read_schema)
        self._checks = [_kind_check(f.type) for f in self.fields]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_parse_options", "_checks")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._parse_options = _parse_options(self.read_schema)
        self._checks = [_kind_check(f.type) for f in self.fields]

    # ------------------------------------------------------------ the operator
    #: the chain hands it records as they come (a RecordBatch, or rows) (``ChainRuntime``)
    takes_any_records = True
    counter: str | None = None

    def __call__(self, records: Any) -> tuple[Any, list[DeadLetter] | None]:
        """The operator behind ``Stream.from_json``: the good batch and the dead letters,
        wrapped for the side output (``runtime.sideoutput``)."""
        good, dead = self.decode(records)
        return good, [DeadLetter(d) for d in dead] if dead else None

    def __repr__(self) -> str:
        return f"JsonDecoder({[f'{f.name} {f.spark}' for f in self.fields]}, column={self.column!r})"

    # ------------------------------------------------------------ the batch
    def decode(self, records: Any) -> tuple[Any, list[dict[str, Any]]]:
        """The good rows as one RecordBatch (schema fields, then ``keep`` columns; None if no
        row is good) and the dead letters, in input order."""
        import pyarrow as pa
        import pyarrow.compute as pc

        reasons: dict[int, str] = {}
        if type(records) is list:
            batch = self._batch_of_rows(records, reasons)
        else:
            batch = records
        n = batch.num_rows
        if n == 0:
            return None, []
        names = batch.schema.names
        missing = [c for c in (self.column, *self.keep) if c not in names]
        if missing:
            raise SchemaError(f"{self.what}: the batch has no column {missing[0]!r} (its columns: {names})")
        values = _as_binary(batch.column(self.column), self.what, self.column)
        odd = _odd_values(values, self.max_record_bytes)
        try:  # JSON is UTF-8; Arrow's reader would let invalid bytes into string columns
            values.cast(pa.string() if values.type == pa.binary() else pa.large_string())
        except pa.ArrowInvalid:
            for i, v in enumerate(values.to_pylist()):
                if v is not None and i not in reasons:
                    try:
                        v.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        reasons[i] = f"not valid UTF-8 (byte {exc.start})"
        fixed = False
        if odd.any():
            for i in odd.nonzero()[0].tolist():
                if i in reasons:
                    continue
                why, needs_fix = self._screen(values[i].as_py())
                if why is not None:
                    reasons[i] = why
                fixed = fixed or needs_fix
        good = [i for i in range(n) if i not in reasons] if reasons else None
        cand = values if good is None else values.take(pa.array(good, pa.int64()))
        if fixed:  # valid objects over several lines: their newlines are whitespace
            cand = pc.replace_substring(pc.replace_substring(cand, "\n", " "), "\r", " ")
        parts: list[Any] = []
        bad: dict[int, str] = {}
        if len(cand):
            self._read_some(cand, list(range(len(cand))), parts, bad, screened=False)
        if bad:
            positions = good if good is not None else list(range(n))
            for j, why in bad.items():
                reasons[positions[j]] = why
            good = [i for i in range(n) if i not in reasons]
        out = None
        if parts:
            decoded = parts[0] if len(parts) == 1 else pa.concat_batches(parts)
            keep_cols = [batch.column(c) for c in self.keep]
            if good is not None:
                idx = pa.array(good, pa.int64())
                keep_cols = [c.take(idx) for c in keep_cols]
            out = pa.RecordBatch.from_arrays(
                [*decoded.columns, *keep_cols],
                schema=pa.schema([*self.schema, *(batch.schema.field(c) for c in self.keep)]))
        return out, self._dead_letters(batch, values, reasons) if reasons else []

    def _screen(self, value: bytes | None) -> tuple[str | None, bool]:
        """A value the vectorised screen singled out: (reason it is dead or None, whether its
        newlines must become spaces)."""
        if value is None:
            return "the value is null", False
        if not value:
            return "the value is empty", False
        if self.max_record_bytes is not None and len(value) > self.max_record_bytes:
            return f"the value is {len(value)} bytes, more than max_record_bytes={self.max_record_bytes}", False
        if not value.lstrip(b" \t\r\n").startswith(b"{"):
            return self.problem(value) or "not a JSON object", False
        if b"\n" in value or b"\r" in value:
            try:
                json.loads(value)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return self.problem(value) or "malformed JSON", False
            return None, True
        return None, False

    def _read_some(self, values: Any, pos: list[int], parts: list[Any], bad: dict[int, str], screened: bool) -> None:
        """Read the values at positions ``pos`` (ascending) into ``parts`` in order, finding the
        ones that fail: a run of at most ``SCREEN_ROWS`` is looked at value by value in Python
        first (each value it flags is confirmed by a read of its own, so a value's fate never
        depends on its neighbours), larger runs are halved."""
        import pyarrow as pa

        contiguous = pos[-1] - pos[0] + 1 == len(pos)
        seg = values.slice(pos[0], len(pos)) if contiguous else values.take(pa.array(pos, pa.int64()))
        err = None
        if len(pos) == 1 or _data_bytes(seg) <= _MAX_BLOCK:
            try:
                parts.append(self._read(seg))
                return
            except _Unreadable as exc:
                err = str(exc)
        if len(pos) == 1:
            bad[pos[0]] = self.problem(seg[0].as_py()) or _explain(err or "", self._field_types)
            return
        if not screened and len(pos) <= SCREEN_ROWS:
            rest = []
            for p, v in zip(pos, seg.to_pylist(), strict=True):
                why = self.problem(v)
                if why is not None and not self._reads_alone(v):
                    bad[p] = why
                else:
                    rest.append(p)
            if rest:
                self._read_some(values, rest, parts, bad, screened=True)
            return
        mid = len(pos) // 2
        self._read_some(values, pos[:mid], parts, bad, screened)
        self._read_some(values, pos[mid:], parts, bad, screened)

    def _reads_alone(self, value: bytes) -> bool:
        import pyarrow as pa

        try:
            self._read(pa.array([value], pa.binary()))
            return True
        except _Unreadable:
            return False

    def _read(self, values: Any) -> Any:
        """One good row per value as a RecordBatch of ``schema``, or ``_Unreadable``."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pj

        joined = pc.binary_join_element_wise(values, pa.scalar(b"\n", values.type), pa.scalar(b"", values.type))
        size = _data_bytes(joined)
        data = joined.buffers()[2].slice(0, size)
        try:
            table = pj.read_json(pa.BufferReader(data),
                                 read_options=pj.ReadOptions(use_threads=False, block_size=max(size + 1, 1 << 16)),
                                 parse_options=self._parse_options)
        except (pa.ArrowException, ValueError, UnicodeDecodeError, OverflowError) as exc:
            raise _Unreadable(str(exc)) from None
        if table.num_rows != len(values):
            raise _Unreadable(f"{table.num_rows} rows for {len(values)} values")
        batch = table.combine_chunks().to_batches()
        cols = list(batch[0].columns) if batch else [pa.array([], f.type) for f in self.read_schema]
        for i in self._casts:
            try:
                cols[i] = cols[i].cast(self.schema.field(i).type)
            except (pa.ArrowException, ValueError) as exc:
                raise _Unreadable(str(exc)) from None
        for name in self._required:
            if cols[self.schema.get_field_index(name)].null_count:
                raise _Unreadable(f"field {name!r} is null")
        return pa.RecordBatch.from_arrays(cols, schema=self.schema)

    # ------------------------------------------------------------ dead letters
    def problem(self, value: bytes | str | None) -> str | None:
        """What is wrong with one value, found in Python (None: nothing found): not UTF-8, not
        JSON, not an object, a NOT NULL field missing or null, a field whose JSON kind the
        schema's type never takes (a string for a long, 1.5 for an int, a number out of range).
        Runs per suspect value, never per record of a good batch."""
        if value is None:
            return "the value is null"
        if isinstance(value, bytes):
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"not valid UTF-8 (byte {exc.start})"
        else:
            text = value
        if not text.strip():
            return "the value is empty" if not text else "the value is blank"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg == "Extra data":
                return f"more than one JSON value (more after character {exc.pos})"
            return f"malformed JSON: {exc.msg.removesuffix(' at')} (character {exc.pos})"
        except RecursionError:
            return "malformed JSON: nested too deeply"
        if not isinstance(obj, dict):
            return f"a JSON {_json_kind(obj)}, not an object"
        for f, check in zip(self.fields, self._checks, strict=True):
            v = obj.get(f.name)
            if v is None:
                if not f.nullable:
                    return f"field {f.name!r} ({f.spark} NOT NULL) is {'missing' if f.name not in obj else 'null'}"
                continue
            why = check(v)
            if why is not None:
                return f"field {f.name!r} ({f.spark}): {why}"
        return None

    @property
    def _field_types(self) -> dict[str, str]:
        return {f.name: f.spark for f in self.fields}

    def _dead_letters(self, batch: Any, values: Any, reasons: dict[int, str]) -> list[dict[str, Any]]:
        import pyarrow as pa

        order = sorted(reasons)
        idx = pa.array(order, pa.int64())
        names = batch.schema.names
        located = {c: batch.column(c).take(idx).to_pylist() for c in LOCATING_COLUMNS if c in names}
        raw = values.take(idx).to_pylist()
        out = []
        for j, i in enumerate(order):
            rec: dict[str, Any] = {c: located[c][j] for c in located}
            rec["reason"] = reasons[i]
            v = raw[j]
            rec["value"] = None if v is None else v.decode("utf-8", "backslashreplace")
            out.append(rec)
        return out

    # ------------------------------------------------------------ rows in
    def _batch_of_rows(self, rows: list[Any], reasons: dict[int, str]) -> Any:
        """The columns ``decode`` needs, made of dict rows (once per batch); a row that has no
        such column, or is not a dict, is a dead letter (its reason in ``reasons``)."""
        import pyarrow as pa

        col = self.column
        values: list[Any] = []
        for i, r in enumerate(rows):
            if type(r) is not dict:
                reasons[i] = f"the record is a {type(r).__name__}, not a dict with column {col!r}"
                values.append(repr(r).encode("utf-8"))
                continue
            v = r.get(col, _MISSING)
            if v is _MISSING:
                reasons[i] = f"the record has no column {col!r}"
                v = repr(r).encode("utf-8")
            elif v is not None and type(v) is not bytes:
                if type(v) is str:
                    v = v.encode("utf-8")
                else:
                    reasons[i] = f"column {col!r} is a {type(v).__name__}, not bytes or str"
                    v = repr(v).encode("utf-8")
            values.append(v)
        arrays = {col: pa.array(values, pa.binary())}
        wanted = [c for c in (*self.keep, *LOCATING_COLUMNS) if c not in arrays]
        for c in dict.fromkeys(wanted):
            column = [r.get(c) if type(r) is dict else None for r in rows]
            if c not in self.keep and all(v is None for v in column):
                continue
            try:
                arrays[c] = pa.array(column, _ROW_TYPES.get(c))
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise SchemaError(f"{self.what}: column {c!r} of the rows has no Arrow type "
                                  f"({type(exc).__name__}: {exc})") from None
        return pa.RecordBatch.from_pydict(arrays)


_MISSING = object()


class _RowTypes(dict[str, Any]):
    """The Arrow types of the columns a Kafka record's dict shares with its batch form
    (``backends.kafka.records.kafka_schema``, which must agree), made on first use: rows of
    different reads then give batches of one schema."""

    def get(self, key: Any, default: Any = None) -> Any:
        if not self:
            import pyarrow as pa

            self.update({"key": pa.binary(), "topic": pa.string(), "partition": pa.int32(), "offset": pa.int64(),
                         "timestamp": pa.int64(), "headers": pa.list_(pa.struct([
                             pa.field("key", pa.string()), pa.field("value", pa.binary())]))})
        return super().get(key, default)


_ROW_TYPES = _RowTypes()


def _parse_options(schema: Any) -> Any:
    import pyarrow.json as pj

    return pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")


def _type_word(message: str) -> str:
    m = re.search(r"of type (\w+)", message)
    return {"date32": "date", "timestamp": "timestamp"}.get(m.group(1), m.group(1)) if m else "value of its type"


Check = Callable[[Any], "str | None"]


def _kind_check(t: Any) -> Check:
    """A check of a JSON value (as ``json.loads`` gives it) against Arrow type ``t``: why it can
    never be read as ``t``, or None (it may be; the read decides). Built once per field, so a
    suspect value costs a few type tests per field. Conservative: a value it flags is read alone
    to confirm."""
    import pyarrow as pa

    spark = ddl.spark_name(t)
    if pa.types.is_integer(t):
        lo, hi = _INT_RANGES[t.bit_width] if pa.types.is_signed_integer(t) else (0, (1 << t.bit_width) - 1)

        def integer(v: Any) -> str | None:
            if type(v) is int:
                return None if lo <= v <= hi else f"{v} is out of range for {spark}"
            if type(v) is float:
                return f"{json.dumps(v)[:60]} is not an integer"
            return f"a JSON {_json_kind(v)}, not a number"

        return integer
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        numbers = (int, float, str) if pa.types.is_decimal(t) else (int, float)
        return lambda v: None if type(v) in numbers else f"a JSON {_json_kind(v)}, not a number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_timestamp(t) or pa.types.is_date(t):
        return lambda v: None if type(v) is str else f"a JSON {_json_kind(v)}, not a string"
    if pa.types.is_boolean(t):
        return lambda v: None if type(v) is bool else f"a JSON {_json_kind(v)}, not true or false"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = _kind_check(t.value_type)

        def array(v: Any) -> str | None:
            if type(v) is not list:
                return f"a JSON {_json_kind(v)}, not an array"
            for i, x in enumerate(v):
                why = None if x is None else item(x)
                if why is not None:
                    return f"item {i}: {why}"
            return None

        return array
    if pa.types.is_struct(t):
        subs = [(t.field(i).name, _kind_check(t.field(i).type)) for i in range(t.num_fields)]

        def struct(v: Any) -> str | None:
            if type(v) is not dict:
                return f"a JSON {_json_kind(v)}, not an object"
            for name, check in subs:
                x = v.get(name)
                why = None if x is None else check(x)
                if why is not None:
                    return f"field {name!r}: {why}"
            return None

        return struct
    return lambda v: None


_INT_RANGES = {b: (-(1 << (b - 1)), (1 << (b - 1)) - 1) for b in (8, 16, 32, 64)}


def _check_readable(t: Any, what: str) -> None:
    """Refuse types Arrow's JSON reader cannot give (when the schema is given, not per record)."""
    import pyarrow as pa

    if pa.types.is_map(t):
        raise SchemaError(f"{what}: map types cannot be read from JSON here (Arrow's JSON reader has none); "
                          f"use a struct of the keys, or read the field as a string")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        raise SchemaError(f"{what}: binary fields cannot be read from JSON here (Spark reads them base64-encoded); "
                          f"read the field as a string")
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        _check_readable(t.value_type, what)
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            _check_readable(t.field(i).type, what)


def _read_type(t: Any) -> Any:
    """What the JSON reader is asked for: ``t`` with dates as strings (cast afterwards)."""
    import pyarrow as pa

    if pa.types.is_date32(t) or pa.types.is_date64(t):
        return pa.string()
    if pa.types.is_list(t):
        return pa.list_(_read_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, _read_type(t.field(i).type)) for i in range(t.num_fields)])
    return t


def _as_binary(values: Any, what: str, column: str) -> Any:
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    t = values.type
    if pa.types.is_dictionary(t):
        values = values.cast(t.value_type)
        t = values.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return values.cast(pa.binary())
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return values.cast(pa.large_binary())
    raise SchemaError(f"{what}: column {column!r} is {t}; JSON comes as binary or string")


def _odd_values(values: Any, max_bytes: int | None) -> Any:
    """The vectorised screen (a numpy bool per value): null, empty, larger than ``max_bytes``,
    not starting with ``{``, or holding a raw newline. Works on the array's buffers: one pass
    over the bytes, not a kernel call per value."""
    import numpy as np

    n = len(values)
    wide = values.type.id != _binary_type_id()
    bufs = values.buffers()
    offs = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[values.offset: values.offset + n + 1]
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offs)
    odd = lengths == 0
    if values.null_count:
        odd |= values.is_null().to_numpy(zero_copy_only=False)
    if max_bytes is not None:
        odd |= lengths > max_bytes
    present = ~odd
    odd[present] |= data[offs[:-1][present]] != 0x7B  # "{"
    body = data[offs[0]:offs[-1]]
    if (body < 0x0E).any():  # a control byte somewhere (rare in JSON text): find the line breaks
        breaks = np.flatnonzero((body == 0x0A) | (body == 0x0D))
        if breaks.size:
            odd[np.searchsorted(offs, breaks + offs[0], side="right") - 1] = True
    return odd


def _binary_type_id() -> int:
    import pyarrow as pa

    return int(pa.binary().id)


def _data_bytes(values: Any) -> int:
    """The bytes of a binary array's values (its offsets' span)."""
    import pyarrow.compute as pc

    total = pc.sum(pc.binary_length(values)).as_py()
    return int(total or 0)


def _json_kind(obj: Any) -> str:
    if isinstance(obj, list):
        return "array"
    if isinstance(obj, str):
        return "string"
    if isinstance(obj, bool):
        return "boolean"
    if obj is None:
        return "null"
    return "number"


_CHANGED = re.compile(r"Column\(/([^)]*)\) changed from (\w+) to (\w+)")
_NO_PARSE = re.compile(r"couldn't parse:(.*)$", re.S)
_COLUMN = re.compile(r"Column\(/([^)]*)\)")


_NOT_A = re.compile(r"Failed to parse string: '(.*)' as a scalar of type", re.S)


def _explain(message: str, types: dict[str, str]) -> str:
    """A pyarrow JSON or cast error as a short reason (``types``: field -> Spark type)."""
    m = _CHANGED.search(message)
    if m:
        where = m.group(1).replace("/", ".")
        top = where.split(".")[0]
        return f"field {top!r} ({types.get(top, '?')}): a JSON {m.group(3)} where the schema wants a JSON " \
               f"{m.group(2)}" + (f" (at {where})" if "." in where else "")
    m = _NO_PARSE.search(message)
    if m:
        return f"{m.group(1).strip()[:80]} does not fit its field's type"
    m = _NOT_A.search(message)
    if m:
        return f"{m.group(1)[:80]!r} is not a {_type_word(message)}"
    text = message.replace("JSON parse error: ", "")
    text = re.sub(r" in row \d+", "", text)
    text = _COLUMN.sub(lambda m: f"field {m.group(1).replace('/', '.')!r}", text)
    return text.strip().rstrip(".")


# ---------------------------------------------------------------- encoding

#: control characters JSON must escape, with the short forms ``json.dumps`` writes
_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def encode_json(batch: Any) -> Any:
    """The rows of a RecordBatch (or Table) as JSON objects: a ``pyarrow.BinaryArray`` of UTF-8
    text, one object per row (``.cast(pa.string())`` makes it text at no cost).

    Each object is what ``json.dumps(row, separators=(",", ":"), ensure_ascii=False)`` writes for
    the row's dict (``batch.to_pylist()``): keys in column order, strings escaped as JSON requires
    (quotes, backslashes, control characters; other characters, non-ASCII too, as UTF-8), ints
    exact, floats as Python's ``repr``, ``true``/``false``, ``null``. Where ``json.dumps`` has no
    form, as Spark's ``to_json`` writes it: NaN and infinities ``null`` (standard JSON has no
    spelling for them; Spark writes a non-standard ``NaN``), timestamps
    ``2024-01-02T03:04:05.123Z`` (milliseconds, UTC; ``timestamp_ntz`` without the ``Z``), dates
    ``2024-01-02``, decimals as plain numbers, binary as base64 strings. Flat columns are made
    with pyarrow.compute kernels; floats outside [1e-4, 1e16) (where Python writes an exponent)
    and nested or other columns (lists, structs, maps, times) are written value by value.
    """
    import pyarrow as pa

    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks()
        batches = batch.to_batches()
        batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=batch.schema)
    n = batch.num_rows
    pieces: list[Any] = []
    for i, field in enumerate(batch.schema):
        key = json.dumps(field.name, ensure_ascii=False) + ":"
        pieces.append(pa.scalar(("{" if i == 0 else ",") + key, pa.string()))
        pieces.append(_json_text(batch.column(i), n))
    if not pieces:
        return pa.array([b"{}"] * n, pa.binary())
    pieces.append(pa.scalar("}", pa.string()))
    import pyarrow.compute as pc

    out = pc.binary_join_element_wise(*pieces, pa.scalar("", pa.string()))
    if not isinstance(out, pa.Array):  # every piece a scalar: a batch of no columns is handled above
        out = pa.array([out.as_py()] * n, pa.string())
    return out.cast(pa.binary())


def _json_text(col: Any, n: int) -> Any:
    """One column as JSON text per row (a string array without nulls)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = col.type
    null = pa.scalar("null", pa.string())
    if pa.types.is_null(t):
        return pa.array(["null"] * n, pa.string())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pc.fill_null(_quoted(col.cast(pa.string())), null)
    if pa.types.is_boolean(t):
        return pc.fill_null(pc.if_else(col, pa.scalar("true"), pa.scalar("false")), null)
    if pa.types.is_integer(t):
        return pc.fill_null(col.cast(pa.string()), null)
    if pa.types.is_floating(t):
        return _floats(col.cast(pa.float64()))
    if pa.types.is_decimal(t):
        return pc.fill_null(col.cast(pa.string()), null)
    if pa.types.is_timestamp(t):
        text = pc.strftime(_floor_millis(col), format="%Y-%m-%dT%H:%M:%S")  # "...:05.123"
        if t.tz is not None:
            text = pc.binary_join_element_wise(text, pa.scalar("Z"), pa.scalar(""))
        return pc.fill_null(_quoted(text), null)
    if pa.types.is_date(t):
        return pc.fill_null(_quoted(col.cast(pa.date32()).cast(pa.string())), null)
    # nested and other types: value by value, as json.dumps writes them
    return pa.array([_dumps(v) for v in col.to_pylist(maps_as_pydicts="strict")], pa.string())


def _floor_millis(col: Any) -> Any:
    """A timestamp column at millisecond precision, rounded down as Spark formats it (a cast
    truncates toward 1970), in UTC (naive timestamps stay naive)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = col.type
    per_ms = {"s": 0, "ms": 1, "us": 1000, "ns": 1_000_000}[t.unit]
    raw = col.cast(pa.int64())
    if per_ms == 0:
        ms = pc.multiply(raw, 1000)
    elif per_ms == 1:
        ms = raw
    else:
        q = pc.divide(raw, per_ms)  # truncates; one less where a negative value had a remainder
        ms = pc.if_else(pc.and_kleene(pc.less(raw, 0), pc.not_equal(pc.multiply(q, per_ms), raw)),
                        pc.subtract(q, 1), q)
    return ms.cast(pa.timestamp("ms", "UTC" if t.tz is not None else None))


def _quoted(s: Any) -> Any:
    """Strings as JSON string literals (escaped, in quotes); nulls stay null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pc.any(pc.match_substring(s, "\\")).as_py():
        s = pc.replace_substring(s, "\\", "\\\\")
    if pc.any(pc.match_substring(s, '"')).as_py():
        s = pc.replace_substring(s, '"', '\\"')
    if pc.any(pc.match_substring_regex(s, "[\x00-\x1f]")).as_py():
        for code in range(32):
            c = chr(code)
            if pc.any(pc.match_substring(s, c)).as_py():
                s = pc.replace_substring(s, c, _SHORT_ESCAPES.get(c, f"\\u{code:04x}"))
    return pc.binary_join_element_wise(pa.scalar('"'), s, pa.scalar('"'), pa.scalar(""))


#: where Python's ``repr`` of a float is positional (and Arrow's cast gives the same digits)
_FIXED_LOW, _FIXED_HIGH = 1e-4, 1e16


def _floats(col: Any) -> Any:
    """float64 values as ``repr`` writes them; NaN and infinities (and nulls) as ``null``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = col.cast(pa.string())
    absval = pc.abs(col)
    finite = pc.is_finite(col)
    fixed = pc.and_kleene(finite, pc.or_kleene(pc.equal(col, 0.0), pc.and_kleene(
        pc.greater_equal(absval, _FIXED_LOW), pc.less(absval, _FIXED_HIGH))))
    # Arrow writes the shortest digits like repr, but "1" for 1.0 and sometimes an exponent
    fixed = pc.and_kleene(fixed, pc.invert(pc.match_substring(text, "e")))
    integral = pc.invert(pc.match_substring(text, "."))
    text = pc.if_else(integral, pc.binary_join_element_wise(text, pa.scalar(".0"), pa.scalar("")), text)
    other = pc.and_kleene(finite, pc.invert(fixed))
    if pc.any(other).as_py():  # repr of the rest, value by value
        idx = pc.indices_nonzero(other)
        reprs = pa.array([repr(v) for v in col.take(idx).to_pylist()], pa.string())
        text = pc.replace_with_mask(text, pc.fill_null(other, False), reprs)
    return pc.if_else(pc.fill_null(finite, False), text, pa.scalar("null"))


def _dumps(value: Any) -> str:
    return json.dumps(_jsonable(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                      default=_spark_text)


def _jsonable(value: Any) -> Any:
    import decimal

    if isinstance(value, decimal.Decimal):  # a number, as Spark writes it (inside nested values: as a float)
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k if isinstance(k, str) else _dumps(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _spark_text(value: Any) -> Any:
    """Values JSON has no type for, as Spark's ``to_json`` writes them (datetimes recognised by
    their methods: this sans-IO package imports no clock module)."""
    import base64

    if hasattr(value, "utcoffset") and hasattr(value, "hour"):  # a datetime
        offset = value.utcoffset()
        if offset is not None:
            value = (value - offset).replace(tzinfo=None)
        text = value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}"
        return text + "Z" if offset is not None else text
    if hasattr(value, "isoformat") and hasattr(value, "year"):  # a date
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def decode_json(records: Any, schema: Any, column: str = "value", keep: Iterable[str] = (),
                max_record_bytes: int | None = MAX_RECORD_BYTES) -> tuple[Any, list[dict[str, Any]]]:
    """``JsonDecoder(schema, column, keep, max_record_bytes).decode(records)``: one batch decoded
    outside a pipeline (good RecordBatch or None, dead-letter dicts)."""
    return JsonDecoder(schema, column, tuple(keep), max_record_bytes).decode(records)
