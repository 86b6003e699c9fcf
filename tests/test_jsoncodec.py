"""JSON in and out of Arrow batches (``runtime.jsoncodec``), Spark schemas without pyspark
(``runtime.ddl``) and event time read from a column of Arrow batches (``runtime.reader``).

Decoding: every kind of bad input is a dead letter naming its topic, partition, offset and what
is wrong; a record's fate never depends on the other records of its batch (decoding a batch
equals decoding each value alone); unknown fields are ignored and missing nullable ones null,
as in Spark. Encoding: the text ``json.dumps`` writes for the row dicts, for random rows, and a
round trip back through ``from_json``. Event time: a RecordBatch labelled with Arrow gives the
runs, late records and watermarks the row path gives.
"""

from __future__ import annotations

import datetime
import json
import math
import operator
import random

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochstream import SchemaError
from epochstream.runtime import ddl
from epochstream.runtime.columns import to_rows
from epochstream.runtime.errors import EpochStreamError
from epochstream.runtime.jsoncodec import JsonDecoder, decode_json, encode_json
from epochstream.runtime.reader import SplitReader
from epochstream.runtime.sources import ArrowSource
from epochstream.runtime.watermarks import LateRecord

SCHEMA = "k string, v long NOT NULL, ts timestamp, d date, score double, tags array<string>, s struct<x: int>"


def _kafka_batch(values: list[bytes | None], start: int = 100) -> pa.RecordBatch:
    n = len(values)
    return pa.record_batch({
        "key": pa.array([b"key"] * n, pa.binary()), "value": pa.array(values, pa.binary()),
        "topic": pa.array(["events"] * n), "partition": pa.array([3] * n, pa.int32()),
        "offset": pa.array(range(start, start + n), pa.int64()), "timestamp": pa.array([1_700_000_000_000] * n)})


def _ok(i: int, **extra) -> bytes:
    return json.dumps({"k": f"k{i}", "v": i, **extra}).encode()


# ---------------------------------------------------------------- schemas


def test_ddl_strings_map_to_the_arrow_types_pyspark_uses():
    from pyspark.sql.types import ArrayType, LongType, MapType, StringType, StructField, StructType, TimestampType

    from epochstream.pyspark.schema import arrow_schema as pyspark_arrow

    got = ddl.arrow_schema("k string, v long NOT NULL, ts timestamp, n timestamp_ntz, d date, x decimal(10,2), "
                           "a array<int>, s struct<x: double, y: string>, m map<string,int>, `odd name` bigint "
                           "COMMENT 'a, b'")
    assert [(f.name, str(f.type), f.nullable) for f in got] == [
        ("k", "string", True), ("v", "int64", False), ("ts", "timestamp[us, tz=UTC]", True),
        ("n", "timestamp[us]", True), ("d", "date32[day]", True), ("x", "decimal128(10, 2)", True),
        ("a", "list<item: int32>", True), ("s", "struct<x: double, y: string>", True),
        ("m", "map<string, int32>", True), ("odd name", "int64", True)]
    st_ = StructType([StructField("k", StringType()), StructField("v", LongType(), False),
                      StructField("a", ArrayType(TimestampType())),
                      StructField("m", MapType(StringType(), LongType()))])
    assert ddl.arrow_schema(st_).equals(pyspark_arrow(st_))  # read through jsonValue(): no pyspark import
    assert ddl.arrow_schema("struct<a:int,b:string>").names == ["a", "b"]
    for bad, why in [("", "names no field"), ("k strin", "unknown type 'strin'"), ("a int, a long", "appears twice"),
                     ("k string NOT", "expected NULL"), ("x decimal(40,2)", "precision"), ("x int y long", "'y'")]:
        with pytest.raises(SchemaError, match=why):
            ddl.arrow_schema(bad)


def test_from_json_refuses_what_it_cannot_read_when_built():
    with pytest.raises(SchemaError, match="map types"):
        JsonDecoder("m map<string,int>")
    with pytest.raises(SchemaError, match="binary fields"):
        JsonDecoder("b binary")
    with pytest.raises(SchemaError, match="keep column 'k' is also a field"):
        JsonDecoder("k string", keep=("k",))
    with pytest.raises(ValueError, match="max_record_bytes"):
        JsonDecoder("k string", max_record_bytes=0)
    d = JsonDecoder("k string")
    with pytest.raises(SchemaError, match="no column 'value'"):
        d.decode(pa.record_batch({"other": [b"{}"]}))
    with pytest.raises(SchemaError, match="column 'value' is int64"):
        d.decode(pa.record_batch({"value": [1]}))


# ---------------------------------------------------------------- decoding


def test_decodes_typed_columns_as_sparks_from_json():
    values = [
        _ok(1, ts="2024-01-02T03:04:05.123Z", d="2024-01-02", score=1, tags=["a", None], s={"x": 5, "zz": 1},
            unknown={"deep": [1]}),
        _ok(2),  # missing nullable fields: null
        b'  {"k": "k3",\n "v": 3}',  # leading blanks and a newline between tokens: still one record
    ]
    good, dead = JsonDecoder(SCHEMA, keep=("key", "offset")).decode(_kafka_batch(values))
    assert dead == []
    assert good.schema.names == ["k", "v", "ts", "d", "score", "tags", "s", "key", "offset"]
    assert good.schema.field("v").nullable is False
    rows = good.to_pylist()
    assert rows[0]["ts"] == datetime.datetime(2024, 1, 2, 3, 4, 5, 123000, tzinfo=datetime.timezone.utc)
    assert (rows[0]["d"], rows[0]["score"], rows[0]["tags"], rows[0]["s"]) == \
        (datetime.date(2024, 1, 2), 1.0, ["a", None], {"x": 5})
    assert rows[1] == {"k": "k2", "v": 2, "ts": None, "d": None, "score": None, "tags": None, "s": None,
                       "key": b"key", "offset": 101}
    assert (rows[2]["k"], rows[2]["v"], rows[2]["offset"]) == ("k3", 3, 102)


#: (value, what its dead letter's reason says)
BAD = [
    (b'{"k": "a", "v": "7"}', "field 'v' (long): a JSON string, not a number"),
    (b'{"k": "a", "v": 1.5}', "field 'v' (long): 1.5 is not an integer"),
    (b'{"k": "a", "v": 99999999999999999999}', "out of range for long"),
    (b'{"k": "a"}', "field 'v' (long NOT NULL) is missing"),
    (b'{"k": "a", "v": null}', "field 'v' (long NOT NULL) is null"),
    (b'{"k": 5, "v": 1}', "field 'k' (string): a JSON number, not a string"),
    (b'{"v": 1, "ts": 1700000000}', "field 'ts' (timestamp): a JSON number, not a string"),
    (b'{"v": 1, "ts": "yesterday"}', "yesterday"),
    (b'{"v": 1, "d": "2024-13-01"}', "'2024-13-01' is not a date"),
    (b'{"v": 1, "tags": ["a", 2]}', "field 'tags' (array<string>): item 1: a JSON number, not a string"),
    (b'{"v": 1, "s": {"x": "no"}}', "field 's' (struct<x:int>): field 'x': a JSON string, not a number"),
    (b'{"k": "a", "v": 1', "malformed JSON"),
    (b"not json at all", "malformed JSON"),
    (b"[1, 2]", "a JSON array, not an object"),
    (b'"text"', "a JSON string, not an object"),
    (b"42", "a JSON number, not an object"),
    (b"null", "a JSON null, not an object"),
    (b"", "the value is empty"),
    (None, "the value is null"),
    (b'{"v": 1}{"v": 2}', "more than one JSON value"),
    (b'{"v": 1} null', "more than one JSON value"),
    (b'{"k": "a\nb", "v": 1}', "malformed JSON: Invalid control character"),  # a raw newline inside a string
    (b'{"k": "\xff", "v": 1}', "not valid UTF-8"),
    (b'{"k": "a", "k": "b", "v": 1}', "field 'k' was specified twice"),
    (b'{"v": 1, "k": "' + b"x" * 300 + b'"}', "more than max_record_bytes=200"),
]


def test_every_bad_record_is_a_dead_letter_naming_topic_partition_offset_and_why():
    """Bad values mixed between good ones: the good ones decode in order (the 1:1 mapping of
    lines to rows survives values of two objects, of none, of several lines), and every bad one
    is a dead letter with its topic, partition, offset, a reason naming field and problem, and
    its value."""
    values: list[bytes | None] = []
    expect = {}
    for i, (bad, why) in enumerate(BAD):
        values.append(_ok(i))
        expect[100 + len(values)] = (bad, why)
        values.append(bad)
    values.append(_ok(999))
    good, dead = JsonDecoder(SCHEMA, keep=("offset",), max_record_bytes=200).decode(_kafka_batch(values))
    assert [r["v"] for r in good.to_pylist()] == [*range(len(BAD)), 999]
    assert [r["offset"] for r in good.to_pylist()] == [100 + 2 * i for i in range(len(BAD) + 1)]
    assert [d["offset"] for d in dead] == sorted(expect)
    for d in dead:
        bad, why = expect[d["offset"]]
        assert (d["topic"], d["partition"]) == ("events", 3)
        assert why in d["reason"], (bad, d["reason"])
        assert d["value"] == (None if bad is None else bad.decode("utf-8", "backslashreplace"))
        assert set(d) == {"topic", "partition", "offset", "reason", "value"}


def test_rows_decode_as_their_batch_does():
    values = [_ok(1), b"oops", _ok(2, ts="2024-01-02T00:00:00Z"), None]
    batch = _kafka_batch(values)
    rows = to_rows(batch) + [{"no_value": 1}, "a string record"]
    g1, d1 = JsonDecoder(SCHEMA, keep=("key", "offset", "timestamp")).decode(batch)
    g2, d2 = JsonDecoder(SCHEMA, keep=("key", "offset", "timestamp")).decode(rows)
    assert g2.equals(g1)
    assert d2[:2] == d1
    assert [d["reason"] for d in d2[2:]] == ["the record has no column 'value'",
                                             "the record is a str, not a dict with column 'value'"]


#: good values the screen looks at alone: blanks before the object, newlines between its tokens
ODD_GOOD = [b' \t{"k": "w", "v": 1}', b'{"k": "n",\r\n "v": 2}\n', b'{"v": 3, "ts": "2024-01-02T03:04:05Z"}']


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(range(len(BAD) + len(ODD_GOOD) + 3)), min_size=1, max_size=40))
def test_a_records_fate_does_not_depend_on_its_batch(picks):
    """The same values decoded as one batch and one by one: the same good rows, the same dead
    letters (so a replay that cuts batches elsewhere decides alike)."""
    pool = [v for v, _why in BAD] + ODD_GOOD
    values = [pool[p] if p < len(pool) else _ok(p) for p in picks]
    decoder = JsonDecoder(SCHEMA, keep=("offset",), max_record_bytes=200)
    good, dead = decoder.decode(_kafka_batch(values))
    alone_good, alone_dead = [], []
    for i, v in enumerate(values):
        g, d = decoder.decode(_kafka_batch([v], start=100 + i))
        alone_good += g.to_pylist() if g is not None else []
        alone_dead += d
    assert (good.to_pylist() if good is not None else []) == alone_good
    assert dead == alone_dead


def test_many_bad_records_in_a_large_batch_are_all_found():
    rng = random.Random(4)
    values = [_ok(i) for i in range(3000)]
    bad = sorted(rng.sample(range(3000), 40))
    for i in bad:
        values[i] = BAD[i % (len(BAD) - 1)][0]  # not the oversized one: the default limit is 1 MiB
    good, dead = decode_json(_kafka_batch(values, start=0), SCHEMA, keep=("offset",))
    assert [d["offset"] for d in dead] == bad
    assert good.num_rows == 3000 - len(bad)
    assert good.column("v").to_pylist() == [i for i in range(3000) if i not in set(bad)]


# ---------------------------------------------------------------- encoding


def _dumps(row: dict, names=("s", "i", "f", "b")) -> bytes:
    clean = {k: (None if isinstance(row[k], float) and not math.isfinite(row[k]) else row[k]) for k in names}
    return json.dumps(clean, separators=(",", ":"), ensure_ascii=False).encode()


_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
_ROW = st.fixed_dictionaries({
    "s": st.one_of(st.none(), _TEXT),
    "i": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "f": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    "b": st.one_of(st.none(), st.booleans()),
})


@settings(max_examples=150, deadline=None)
@given(st.lists(_ROW, min_size=1, max_size=30))
def test_encode_json_writes_what_json_dumps_writes_for_flat_rows(rows):
    schema = pa.schema([("s", pa.string()), ("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_())])
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    assert encode_json(batch).to_pylist() == [_dumps(r) for r in rows]


@settings(max_examples=80, deadline=None)
@given(st.lists(_ROW, min_size=1, max_size=30))
def test_encode_then_from_json_gives_the_rows_back(rows):
    schema = pa.schema([("s", pa.string()), ("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_())])
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    good, dead = decode_json(pa.record_batch({"value": encode_json(batch)}), schema)
    assert dead == []
    want = [{**r, "f": r["f"] if r["f"] is None or math.isfinite(r["f"]) else None} for r in rows]
    assert good.to_pylist() == want


def test_encode_json_special_values_as_spark_writes_them():
    ts = [datetime.datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=datetime.timezone.utc),
          datetime.datetime(1960, 1, 2, 3, 4, 5, 999999, tzinfo=datetime.timezone.utc), None]
    batch = pa.record_batch({
        "ts": pa.array(ts, pa.timestamp("us", "UTC")),
        "ntz": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5)] * 3, pa.timestamp("us")),
        "d": pa.array([datetime.date(2024, 1, 2), None, datetime.date(1999, 12, 31)]),
        "f": pa.array([float("nan"), float("inf"), 1e16]),
        "f32": pa.array([0.1, None, 2.5], pa.float32()),
        "tags": pa.array([["a", "b\n"], None, []]),
        "st": pa.array([{"x": 1.5, "y": None}, None, {"x": float("nan"), "y": "é"}]),
        "bin": pa.array([b"hi", None, b""]),
        "cat": pa.array(["x", None, "x"]).dictionary_encode(),
        "nothing": pa.nulls(3),
    })
    got = [json.loads(b) for b in encode_json(batch).to_pylist()]
    assert [g["ts"] for g in got] == ["2024-01-02T03:04:05.123Z", "1960-01-02T03:04:05.999Z", None]
    assert got[0]["ntz"] == "2024-01-02T03:04:05.000" and [g["d"] for g in got] == ["2024-01-02", None, "1999-12-31"]
    assert [g["f"] for g in got] == [None, None, 1e16]  # NaN and infinities: null
    assert [g["f32"] for g in got] == [float(pa.scalar(0.1, pa.float32()).as_py()), None, 2.5]
    assert [g["tags"] for g in got] == [["a", "b\n"], None, []]
    assert [g["st"] for g in got] == [{"x": 1.5, "y": None}, None, {"x": None, "y": "é"}]
    assert [g["bin"] for g in got] == ["aGk=", None, ""] and [g["cat"] for g in got] == ["x", None, "x"]
    assert [g["nothing"] for g in got] == [None] * 3
    assert encode_json(pa.table({"a": [1, 2]})).to_pylist() == [b'{"a":1}', b'{"a":2}']
    assert encode_json(pa.record_batch({"a": pa.array([], pa.int64())})).to_pylist() == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=50))
def test_floats_are_written_as_python_repr_writes_them(values):
    text = encode_json(pa.record_batch({"f": pa.array(values, pa.float64())})).to_pylist()
    assert text == [f'{{"f":{v!r}}}'.encode() for v in values]


# ---------------------------------------------------------------- event time from a column


def _readers(table: pa.Table, slack: float, delay: float | None, side: bool) -> list[SplitReader]:
    out = []
    for column in (("ts", 1.0), None):
        src = ArrowSource(table, 2)
        src.uid = "src"
        src.timestamp = operator.itemgetter("ts")
        src.timestamp_column = column  # None: the row path, a timestamp function
        src.max_out_of_orderness = delay
        src.late_output = side
        out.append(SplitReader(src, "src", [0, 1], {}, slack))
    return out


def _flat(runs) -> list[tuple]:
    out = []
    for label, records, _offset in runs:
        rows = records if type(records) is list else to_rows(records)
        out += [(label, r.record["id"], "late") if type(r) is LateRecord else (label, r["id"]) for r in rows]
    return out


@pytest.mark.parametrize("seed", range(60))
def test_arrow_batches_are_labelled_as_rows_are(seed):
    """Random timestamps (in order, or out of order with late records dropped or sent on), read
    in reads of varying size: runs, labels, time promises, late counts and per-split newest
    timestamps are the row path's, while in-order runs stay RecordBatch slices."""
    rng = random.Random(seed)
    n = rng.randint(1, 250)
    slack = rng.choice([1.0, 0.5, 0.1, 3.0])
    delay = rng.choice([None, 0.0, 1.0, 2.5])
    t, ts = 1000.0, []
    for _ in range(n):
        t += rng.random() * 0.4
        ts.append(t - (rng.random() * 1.5 * delay if delay else 0.0))
    if rng.random() < 0.3:
        ts = [int(x) for x in ts]
    if delay is None:
        ts.sort()
    side = delay is not None and rng.random() < 0.5
    results = []
    kinds = set()
    for reader in _readers(pa.table({"id": list(range(n)), "ts": ts}), slack, delay, side):
        got, promises, step = [], [], 0
        while reader.has_more():
            runs = reader.read(3 + step % 17, 0.0)
            kinds |= {type(r[1]).__name__ for r in runs}
            got += _flat(runs)
            promises.append(reader.next_time_promise(0.0))
            step += 1
        results.append((got, promises, reader.late_records, reader.late_sent,
                        reader.watermarks.state() if reader.watermarks else None))
    assert results[0] == results[1]
    if delay is None and n > 40 and slack >= 1.0:
        assert "RecordBatch" in kinds


def test_a_bad_timestamp_column_is_named():
    src = ArrowSource(pa.table({"id": [0, 1, 2], "ts": [5.0, 4.0, 6.0]}), 1)
    src.uid, src.timestamp, src.timestamp_column = "src", operator.itemgetter("ts"), ("ts", 1.0)
    with pytest.raises(EpochStreamError, match=r"split 0 offset 1: timestamp 4.0 \(time label 4\) is before label 5"):
        SplitReader(src, "src", [0], {}, 1.0).read(10)
    src = ArrowSource(pa.table({"id": [0, 1], "ts": pa.array([1, None], pa.int64())}), 1)
    src.uid, src.timestamp, src.timestamp_column = "src", operator.itemgetter("ts"), ("ts", 1.0)
    with pytest.raises(EpochStreamError, match="offset 1: column 'ts' holds None; event timestamps must be numbers"):
        SplitReader(src, "src", [0], {}, 1.0).read(10)
