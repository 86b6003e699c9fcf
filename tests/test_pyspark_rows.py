"""Row input (dicts, Rows, tuples) into the PySpark wrappers' pandas frames.

Kept rows become Arrow once per run of row batches (``schema.row_groups``) and are cut per
key as Arrow batches are (``schema.keyed_frames``). Each key must still get the frame its
rows alone give (``to_pandas`` of the key's rows, what the row path converted per key): the
same dtypes (an int column with nulls in one key only, a column all null in one key, ints
with nulls inside lists), the same values, columns and 0-based index; and the Arrow path
must give the frames the row path gives for the same input.
"""

from __future__ import annotations

import datetime
import decimal
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row
from pyspark.sql.streaming.state import GroupStateTimeout

from epochstream.pyspark.operators import ApplyInPandasWithState
from epochstream.pyspark.schema import (
    SchemaError,
    arrow_schema,
    pandas_groups,
    parse_schema,
    row_groups,
    spark_pandas,
    to_pandas,
)
from epochstream.runtime.context import Context
from epochstream.runtime.state import HeapKeyedState, OperatorStateBackend

UTC = datetime.timezone.utc
PARIS = datetime.timezone(datetime.timedelta(hours=1))


# ---------------------------------------------------------------- comparing frames


def _value(v):
    """A value of a frame, comparable with its type at every depth (numpy arrays keep their
    dtype: an int list is not an object list)."""
    if isinstance(v, np.ndarray):
        return ("ndarray", str(v.dtype), [_value(x) for x in v])
    if isinstance(v, dict):
        return ("dict", [(_value(k), _value(x)) for k, x in v.items()])
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_value(x) for x in v])
    if v is pd.NaT:
        return ("NaT",)
    if isinstance(v, float) and math.isnan(v):
        return (type(v).__name__, "nan")
    return (type(v).__name__, v)


def assert_same_frame(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    assert [str(d) for d in got.dtypes] == [str(d) for d in want.dtypes]
    assert isinstance(got.index, pd.RangeIndex) and got.index.equals(want.index)
    for c in want.columns:
        assert [_value(v) for v in got[c]] == [_value(v) for v in want[c]], c


def per_key_reference(rows: list[dict], keys: list, schema) -> list:
    """Each key's rows converted alone, keys in first-appearance order: the frames the row
    path must give."""
    groups: dict = {}
    for r, k in zip(rows, keys, strict=True):
        groups.setdefault(k, []).append(r)
    return [(k, to_pandas(g, schema)) for k, g in groups.items()]


def assert_same_groups(got: list, want: list) -> None:
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert_same_frame(g, w)


# ---------------------------------------------------------------- through the operator


def frames_seen(batches: list, input_schema) -> list:
    """The (key, frame) pairs an ``applyInPandasWithState`` function gets for ``batches`` (lists
    of dict rows, or RecordBatches) fed as runtime batches of one epoch."""
    calls: list = []

    def spy(key, pdf_iter, state):
        for pdf in pdf_iter:
            calls.append((key, pdf))
        return iter([])

    state = HeapKeyedState("op", lambda k: 0, (0, 0))
    ctx = Context(state, 0, 1, "op", None, OperatorStateBackend("op", 0))
    op = ApplyInPandasWithState(spy, "k string", "n long", "Update", GroupStateTimeout.NoTimeout, "k",
                                input_schema=input_schema, clock=lambda: 1_000)
    op.open(ctx)
    for b in batches:
        if isinstance(b, list):
            assert op.apply_batch(b, [op.key_of(r) for r in b], ctx) is None
        else:
            assert op.apply_batch(b, None, ctx) is None
    op.on_epoch_end(1, ctx)
    return calls


SCHEMA = ("k string, n long, x double, s string, t timestamp, flag boolean, "
          "m map<string,long>, st struct<a:long,b:string>, l array<long>")


def _rows(null_in_list: bool) -> list[dict]:
    """Keys with different nulls: 'a' has an int null and a bool null, 'b' none, 'c' one
    row, 'd' all of its n null; maps with a null value, structs with a null field,
    timestamps in two zones and naive."""
    t0 = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    out = []
    for i in range(12):
        k = "abd"[i % 3]
        out.append({
            "k": k, "n": None if (k == "d" or (k == "a" and i == 3)) else i, "x": i / 4,
            "s": None if i == 4 else f"s{i}",
            "t": (t0 + datetime.timedelta(minutes=i)).astimezone(PARIS if i % 2 else UTC),
            "flag": None if (k == "a" and i == 6) else i % 2 == 0,
            "m": {"u": i, "v": None} if i % 4 else {}, "st": {"a": i, "b": None if i % 5 else "five"},
            "l": [i, None] if (null_in_list and k == "b") else [i, i + 1],
        })
    out.insert(5, {"k": "c", "n": 7, "x": None, "s": "one", "t": datetime.datetime(2026, 1, 1), "flag": True,
                   "m": {"w": 1}, "st": None, "l": []})
    return out


@pytest.mark.parametrize("null_in_list", [False, True], ids=["lists-without-nulls", "a-null-inside-a-list"])
def test_the_row_path_and_the_arrow_path_give_each_key_the_same_frames(null_in_list):
    """The same rows, as dict batches and as Arrow batches of the input schema, in two runtime
    batches of one epoch: every key gets one frame, equal on both paths and equal to its rows
    converted alone (dtypes per key: 'a' float64 n and object flag, 'b' int64 and bool)."""
    rows = _rows(null_in_list)
    schema = arrow_schema(parse_schema(SCHEMA))
    halves = [rows[:7], rows[7:]]
    by_rows = frames_seen(halves, SCHEMA)
    by_arrow = frames_seen([pa.RecordBatch.from_pylist(h, schema=schema) for h in halves], SCHEMA)
    want = per_key_reference(rows, [(r["k"],) for r in rows], schema)
    assert [k for k, _ in want] == [("a",), ("b",), ("d",), ("c",)]
    assert_same_groups(by_rows, want)
    assert_same_groups(by_arrow, want)
    frames = dict(want)
    assert str(frames[("a",)]["n"].dtype) == "float64" and str(frames[("b",)]["n"].dtype) == "int64"
    assert str(frames[("a",)]["flag"].dtype) == "object" and str(frames[("b",)]["flag"].dtype) == "bool"
    assert frames[("d",)]["n"].isna().all() and len(frames[("c",)]) == 1
    assert frames[("b",)]["m"].iloc[0] == {"u": 1, "v": None}  # maps as dicts, a null value kept
    assert str(frames[("b",)]["t"].dtype) == "datetime64[ns]"
    assert frames[("b",)]["t"].iloc[0] == pd.Timestamp("2026-03-01 12:01")  # an aware time in UTC, naive
    list_dtype = frames[("b",)]["l"].iloc[0].dtype
    assert str(list_dtype) == ("object" if null_in_list else "int64")
    assert str(frames[("a",)]["l"].iloc[0].dtype) == "int64"  # another key's null in a list is not its own


def test_rows_tuples_and_row_objects_reach_the_user_as_the_same_frames():
    """pyspark Rows and tuples (with input_schema) become the frames their dicts give."""
    dicts = [{"k": "ab"[i % 2], "n": None if i == 2 else i, "x": i / 2} for i in range(7)]
    schema = "k string, n long, x double"
    want = frames_seen([dicts], schema)
    assert_same_groups(frames_seen([[Row(**d) for d in dicts]], schema), want)
    assert_same_groups(frames_seen([[(d["k"], d["n"], d["x"]) for d in dicts]], schema), want)


INFERRED = {
    # each: rows whose keys' own rows infer what all the rows infer, or do not
    "a key all null in a column": [{"k": "a", "v": 1.5}, {"k": "b", "v": None}, {"k": "a", "v": None},
                                   {"k": "b", "v": None}],
    "ints with a null in one key": [{"k": "a", "v": 1}, {"k": "b", "v": 2}, {"k": "a", "v": None}],
    "ints in one key, floats in another": [{"k": "a", "v": 1}, {"k": "b", "v": 2.5}, {"k": "a", "v": 3}],
    "a key whose first row has other columns": [{"k": "a", "v": 1, "w": "x"}, {"k": "b", "w": "y", "v": 2},
                                                {"k": "a", "v": 3, "w": "z"}, {"k": "c", "v": 4}],
    "naive and aware timestamps in other keys": [
        {"k": "a", "t": datetime.datetime(2026, 1, 1, 10)},
        {"k": "b", "t": datetime.datetime(2026, 1, 1, 10, tzinfo=PARIS)},
        {"k": "a", "t": None}],
    "aware timestamps in two zones": [
        {"k": "a", "t": datetime.datetime(2026, 1, 1, 10, tzinfo=UTC)},
        {"k": "b", "t": datetime.datetime(2026, 1, 1, 10, tzinfo=PARIS)},
        {"k": "a", "t": datetime.datetime(2026, 1, 1, 11, tzinfo=PARIS)}],
    "dicts with other fields per key": [{"k": "a", "d": {"p": 1}}, {"k": "b", "d": {"q": "x"}},
                                        {"k": "a", "d": {"p": 2}}],
    "lists of ints and floats": [{"k": "a", "l": [1, 2]}, {"k": "b", "l": [1.5]}, {"k": "a", "l": []}],
    "decimals of other scales": [{"k": "a", "d": decimal.Decimal("1.5")}, {"k": "b", "d": decimal.Decimal("2.25")}],
    "ints and strings in other keys": [{"k": "a", "v": 1}, {"k": "b", "v": "one"}],
    "numpy scalars": [{"k": "a", "v": np.int32(1)}, {"k": "b", "v": 2}, {"k": "a", "v": np.int32(3)}],
    "bools, bytes, dates, timedeltas and a single-row key": [
        {"k": "a", "b": True, "y": b"\x00", "d": datetime.date(2026, 1, 1), "td": datetime.timedelta(1)},
        {"k": "b", "b": None, "y": b"z", "d": None, "td": None},
        {"k": "a", "b": False, "y": None, "d": datetime.date(2026, 1, 2), "td": datetime.timedelta(2)}],
}


@pytest.mark.parametrize("name", list(INFERRED))
def test_without_an_input_schema_each_key_gets_the_types_its_own_rows_infer(name):
    rows = INFERRED[name]
    keys = [(r["k"],) for r in rows]
    assert_same_groups(row_groups(rows, keys, ["k"], None, "f"), per_key_reference(rows, keys, None))
    # and through the operator, in two runtime batches of one epoch
    assert_same_groups(frames_seen([rows[:1], rows[1:]], None), per_key_reference(rows, keys, None))


def test_rows_that_do_not_fit_the_input_schema_name_the_operator_and_the_key():
    schema = arrow_schema(parse_schema("k string, n long"))
    rows = [{"k": "a", "n": 1}, {"k": "b", "n": "two"}]
    with pytest.raises(SchemaError, match=r"count: the rows of key \('b',\) do not convert to Arrow into the input "
                                          r"schema"):
        row_groups(rows, [(r["k"],) for r in rows], ["k"], schema, "count")


# ---------------------------------------------------------------- any rows


_KINDS = {
    # column kind -> (values, the declared type for it)
    "int": (st.one_of(st.none(), st.integers(-(2**40), 2**40)), "long"),
    "float": (st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=False, width=64)), "double"),
    "int-or-float": (st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([0.5, -1.25])), "double"),
    "str": (st.one_of(st.none(), st.text(max_size=3)), "string"),
    "bool": (st.one_of(st.none(), st.booleans()), "boolean"),
    "naive-ts": (st.one_of(st.none(), st.datetimes(datetime.datetime(2000, 1, 1), datetime.datetime(2030, 1, 1))),
                 "timestamp"),
    "aware-ts": (st.one_of(st.none(), st.datetimes(datetime.datetime(2000, 1, 1), datetime.datetime(2030, 1, 1),
                                                   timezones=st.sampled_from([UTC, PARIS]))), "timestamp"),
    "list": (st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 9)), max_size=3)), "array<long>"),
    "struct": (st.one_of(st.none(), st.fixed_dictionaries({"a": st.one_of(st.none(), st.integers(0, 9))})),
               "struct<a:long>"),
    "map": (st.one_of(st.none(), st.dictionaries(st.sampled_from("pq"), st.one_of(
        st.none(), st.lists(st.one_of(st.none(), st.integers(0, 9)), max_size=2)), max_size=2)),
        "map<string,array<long>>"),
    "map-of-longs": (st.one_of(st.none(), st.dictionaries(st.sampled_from("pq"), st.one_of(
        st.none(), st.integers(0, 9)), max_size=2)), "map<string,long>"),
    "none": (st.none(), "long"),
}


@st.composite
def _row_sets(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(_KINDS)), min_size=1, max_size=4))
    names = [f"c{i}" for i in range(len(kinds))]
    n = draw(st.integers(1, 14))
    rows = []
    for _ in range(n):
        row = {"k": draw(st.sampled_from("abcd"))}
        for name, kind in zip(names, kinds, strict=True):
            if draw(st.integers(0, 9)) > 0:  # now and then a row lacks a column
                row[name] = draw(_KINDS[kind][0])
        if draw(st.booleans()):
            row = dict(reversed(list(row.items())))  # other column order
        rows.append(row)
    ddl = ", ".join(["k string"] + [f"{n} {_KINDS[k][1]}" for n, k in zip(names, kinds, strict=True)])
    return rows, ddl


def _outcome(fn):
    try:
        return fn()
    except (SchemaError, pa.ArrowException, TypeError, ValueError, OverflowError):
        return "error"


@given(_row_sets(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_any_rows_give_each_key_the_frame_its_rows_alone_give(case, declared):
    """Random rows (nulls, missing columns, other column orders, mixed types, timestamps in
    zones, lists with nulls, structs): one conversion of all the rows gives each key what
    its rows alone give, with or without an input schema; where the rows alone fail, so does it."""
    rows, ddl = case
    schema = arrow_schema(parse_schema(ddl)) if declared else None
    keys = [(r["k"],) for r in rows]
    want = _outcome(lambda: per_key_reference(rows, keys, schema))
    got = _outcome(lambda: row_groups(rows, keys, ["k"], schema, "f"))
    if want == "error":
        assert got == "error"
        return
    assert got != "error"
    assert_same_groups(got, want)
    if declared:  # the Arrow path cuts the batch of the same rows into the same frames
        batch = pa.RecordBatch.from_pylist(rows, schema=schema)
        assert_same_groups(pandas_groups(batch, ["k"], None, "f"), want)


def test_an_arrow_batch_with_nulls_converts_once_per_group_of_keys_alike(monkeypatch):
    """Keys with and without nulls in an int column: two conversions (one per group of keys
    alike), not one per key, and each key's frame is its rows alone."""
    from epochstream.pyspark import schema as schema_mod

    batch = pa.RecordBatch.from_pylist([{"k": i % 50, "n": None if i % 50 < 5 and i % 3 == 0 else i}
                                        for i in range(500)])
    calls = []
    real = schema_mod.spark_pandas

    def counting(data):
        calls.append(data.num_rows)
        return real(data)

    monkeypatch.setattr(schema_mod, "spark_pandas", counting)
    groups = pandas_groups(batch, ["k"], None, "f")
    assert len(calls) == 2 and sum(calls) == 500
    monkeypatch.setattr(schema_mod, "spark_pandas", real)
    keys = pa.array([k for (k,), _ in groups])
    assert keys.to_pylist() == list(range(50))
    for (k,), pdf in groups:
        assert_same_frame(pdf, spark_pandas(batch.filter(pc.equal(batch.column("k"), k))))
    assert str(dict(groups)[(0,)]["n"].dtype) == "float64" and str(dict(groups)[(9,)]["n"].dtype) == "int64"
