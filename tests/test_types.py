"""Declared state types (``epochstream.Types``): the contract checked at capture, the manifest
entry that carries them, and the typed columns of read-committed queries. No Spark here;
the typed Delta columns are tested in ``test_delta_typed.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import epochstream.state
from epochstream import ListStateDescriptor, MapStateDescriptor, Types, ValueStateDescriptor
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.backends.rocksdb_state import RocksDBKeyedState
from epochstream.backends.typed import arrow_type, declared_columns, typed_arrays
from epochstream.deploy.failures import JobFailedError
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import StateSerializationError
from epochstream.runtime.state import HeapKeyedState
from epochstream.runtime.types import TypeInformation, column_type
from pipelines import TypedProfile, input_records, make_pipeline, sim_run, typed_profile, without_fsync


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


ROW = Types.ROW_NAMED(["id", "even"], [Types.LONG(), Types.BOOLEAN()])
ALL_TYPES = [Types.STRING(), Types.BOOLEAN(), Types.BYTE(), Types.INT(), Types.LONG(), Types.FLOAT(),
             Types.DOUBLE(), Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.LIST(Types.STRING()),
             Types.MAP(Types.STRING(), Types.LIST(Types.LONG())), ROW,
             Types.ROW_NAMED(["inner"], [Types.MAP(Types.INT(), ROW)])]


# ---------------------------------------------------------------- the types themselves


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.sql)
def test_a_type_survives_the_manifest_and_names_its_spark_and_arrow_types(t):
    assert TypeInformation.from_json(t.to_json()) == t
    assert isinstance(arrow_type(t), pa.DataType)
    assert "<" in t.sql or t.sql.isupper()


def test_sql_spelling_of_nested_types():
    assert Types.MAP(Types.STRING(), Types.LIST(Types.LONG())).sql == "MAP<STRING, ARRAY<BIGINT>>"
    assert ROW.sql == "STRUCT<id: BIGINT, even: BOOLEAN>"
    assert Types.PRIMITIVE_ARRAY(Types.BYTE()).sql == "BINARY"
    assert Types.PICKLED_BYTE_ARRAY() is None


@pytest.mark.parametrize("t, good, bad", [
    (Types.STRING(), "x", 1),
    (Types.BOOLEAN(), True, 1),
    (Types.INT(), 2**31 - 1, 2**31),
    (Types.LONG(), -(2**63), 2**63),
    (Types.LONG(), 5, True),
    (Types.DOUBLE(), 3, "3"),
    (Types.PRIMITIVE_ARRAY(Types.BYTE()), b"\x00", "bytes"),
    (Types.LIST(Types.LONG()), [1, 2], [1, "2"]),
    (Types.MAP(Types.STRING(), Types.LONG()), {"a": 1}, {"a": 1.5}),
    (Types.MAP(Types.STRING(), Types.LONG()), {"a": 1}, {None: 1}),
    (ROW, (1, False), (1, False, 3)),
    (ROW, {"id": 1}, {"id": 1, "odd": True}),
])
def test_check_accepts_what_fits_and_says_why_the_rest_does_not(t, good, bad):
    assert t.check(good) is None
    assert t.check(None) is None  # SQL NULL fits every column
    why = t.check(bad)
    assert isinstance(why, str) and why


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=5), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4), max_size=4))
def test_values_that_fit_convert_to_their_arrow_type_exactly(value):
    t = Types.MAP(Types.STRING(), Types.LIST(Types.LONG()))
    assert t.check(value) is None
    arr = pa.array([t.plain(value)], arrow_type(t))
    assert dict(arr.to_pylist()[0]) == value


def test_bad_declarations_are_clear_errors():
    with pytest.raises(TypeError, match="epochstream.Types"):
        Types.LIST(int)
    with pytest.raises(ValueError, match="identifier"):
        Types.ROW_NAMED(["a b"], [Types.LONG()])
    with pytest.raises(ValueError, match="repeat"):
        Types.ROW_NAMED(["a", "a"], [Types.LONG(), Types.LONG()])
    with pytest.raises(TypeError, match="MapStateDescriptor"):
        column_type("map", Types.LONG())
    assert column_type("map", (Types.STRING(), Types.LONG())) == Types.MAP(Types.STRING(), Types.LONG())
    assert column_type("list", Types.STRING()) == Types.LIST(Types.STRING())
    with pytest.raises(TypeError, match="key_type"):
        make_pipeline("x").from_collection([1]).key_by(lambda r: r, key_type=str)
    with pytest.raises(ValueError, match="not a state type"):
        TypeInformation.from_json({"set": "STRING"})
    with pytest.raises(ValueError, match="differ only in case"):
        declared_columns({"types": {"Count": "BIGINT", "count": "BIGINT"}})


# ---------------------------------------------------------------- the contract at capture


#: the keyed-state backend ``backend()`` builds in the running test (``kind`` fixture)
KIND = {"type": "hashmap", "dir": None}


@pytest.fixture(params=["hashmap", "rocksdb"])
def kind(request, tmp_path):
    """Declared types are checked at the capture on both keyed-state backends."""
    KIND["type"], KIND["dir"] = request.param, str(tmp_path)
    yield request.param
    KIND["type"] = "hashmap"


def backend(key_type=None) -> Any:
    if KIND["type"] == "rocksdb":
        return RocksDBKeyedState("profile", lambda k: 0, (0, 0), key_type, local_dir=KIND["dir"])
    return HeapKeyedState("profile", lambda k: 0, (0, 0), key_type)


def test_capture_carries_declared_types_and_checks_values(kind):
    s = backend(Types.STRING())
    count = s.handle(ValueStateDescriptor("count", Types.LONG(), default=0))
    recent = s.handle(ListStateDescriptor("recent", Types.STRING()))
    s.handle(MapStateDescriptor("buckets", (Types.STRING(), Types.LONG())))
    s.handle(ValueStateDescriptor("seen"))
    s.keys.key = "k1"
    count.update(3)
    recent.add("a")
    cap = s.capture(1)
    assert dict(cap.types) == {
        "count": "BIGINT", "recent": {"list": "STRING"}, "buckets": {"map": ["STRING", "BIGINT"]}}
    assert cap.key_type == "STRING"
    recent.add(7)  # breaks ARRAY<STRING>
    with pytest.raises(StateSerializationError) as ei:
        s.capture(2)
    msg = str(ei.value)
    assert "'profile'" in msg and "'recent'" in msg and "'k1'" in msg and "ARRAY<STRING>" in msg and "element 1" in msg


def test_a_key_that_breaks_the_declared_key_type_is_named(kind):
    s = backend(Types.LONG())
    v = s.handle(ValueStateDescriptor("v"))
    s.keys.key = "not-a-long"
    v.update(1)
    with pytest.raises(StateSerializationError, match=r"key 'not-a-long' does not fit the declared key type BIGINT"):
        s.capture(1)


def test_one_state_declared_with_two_types_is_refused(kind):
    s = backend()
    s.handle(ValueStateDescriptor("v", Types.LONG()))
    s.handle(ValueStateDescriptor("v"))  # an untyped handle on a typed state is fine
    with pytest.raises(ValueError, match="BIGINT and again with STRING"):
        s.handle(ValueStateDescriptor("v", Types.STRING()))
    with pytest.raises(ValueError, match="identifier"):
        s.handle(ValueStateDescriptor("my state", Types.LONG()))


def test_restored_state_takes_its_type_from_the_declaration(kind):
    s = backend()
    v = s.handle(ValueStateDescriptor("v", Types.LONG()))
    s.keys.key = "k"
    v.update(1)
    rows = s.capture(1).rows
    r = backend()
    r.restore_rows(rows, {"v": "value"})
    assert r.capture(2).types == ()  # nothing declared yet: a restored table is untyped
    r.handle(ValueStateDescriptor("v", Types.LONG()))
    assert dict(r.capture(3).types) == {"v": "BIGINT"}


# ---------------------------------------------------------------- jobs: manifest, failure, queries


class BreaksItsType(TypedProfile):
    """Writes an int into the STRING state ``note`` for one key after a while."""

    def open(self, ctx) -> None:
        super().open(ctx)
        self.note = ctx.state(ValueStateDescriptor("note", Types.STRING()))

    def process(self, value, ctx):
        self.note.update(42 if ctx.key == "k2" and value[1] > 120 else "fine")
        return super().process(value, ctx)


def test_manifest_records_declared_types(tmp_path):
    chk = tmp_path / "chk"
    sim_run(typed_profile(out=tmp_path / "out"), chk, seed=1)
    manifest, _root = LocalCheckpointStorage(chk).latest()
    entry = manifest["operators"]["profile"]
    assert entry["key_type"] == "STRING"
    assert entry["types"] == {
        "count": "BIGINT", "total": "DOUBLE", "recent": {"list": "STRING"}, "buckets": {"map": ["STRING", "BIGINT"]},
        "last": {"row": [["id", "BIGINT"], ["even", "BOOLEAN"]]},
    }
    assert "seen" in entry["states"] and "seen" not in entry["types"]


def test_a_value_that_breaks_its_type_fails_the_job_and_loses_nothing(tmp_path):
    from epochstream import FileSink

    out, chk = tmp_path / "out", tmp_path / "chk"

    def build(fn):  # keyed state in RocksDB: its captures check declared types too
        p = make_pipeline("typed-profile", restart_attempts=1, state_backend_type="rocksdb")
        (p.from_collection(input_records(200, 5), uid="src").key_by(lambda r: r[0], key_type=Types.STRING())
         .process(fn, uid="profile").sink(FileSink(out / "counts"), uid="counts"))
        return p

    with pytest.raises(JobFailedError) as exc:
        sim_run(build(BreaksItsType()), chk, seed=1, source_rate=400.0)
    msg = str(exc.value)
    assert "'note'" in msg and "'k2'" in msg and "STRING" in msg and "int is not a string" in msg
    storage = LocalCheckpointStorage(chk)
    before = storage.list_checkpoints()
    assert before, "the scenario needs an epoch completed before the bad value"
    # the fixed job finishes from the last completed epoch, every count exactly once
    sim_run(build(TypedProfile()), chk, seed=2, restore="latest")
    table = epochstream.state.query(chk, "profile", state="count")
    assert dict(zip(table.column("key").to_pylist(), table.column("typed_count").to_pylist(), strict=True)) == {
        f"k{i}": 40 for i in range(5)}


def _reference(n: int, keys: int) -> dict[str, dict]:
    ref: dict[str, dict] = {}
    for key, i in input_records(n, keys):
        r = ref.setdefault(key, {"count": 0, "total": 0.0, "buckets": {}})
        r["count"] += 1
        r["total"] += i * 0.5
        r["buckets"][f"b{i % 3}"] = r["buckets"].get(f"b{i % 3}", 0) + 1
    return ref


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_typed_state(mode, tmp_path):
    """The oracle on typed state under kills and failed writes (the types change nothing it sees)."""
    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=[0.004], write_failures={3}, fail_points={"after_manifest": {2}})
        return sim_run(p, chk, seed=5, failures=failures if failing else None)

    backend = "rocksdb" if mode == "tracker" else "hashmap"
    report = check_exactly_once(lambda: typed_profile(mode=mode, state_backend_type=backend), run, tmp_path)
    assert report.ok, report.to_json()
    assert report.restarts >= 2 and report.epochs_checked >= 2


def test_query_returns_the_declared_typed_columns(tmp_path):
    chk = tmp_path / "chk"
    sim_run(typed_profile(out=tmp_path / "out"), chk, seed=1)
    t = epochstream.state.query(chk, "profile")
    assert t.schema.field("typed_key").type == pa.string()
    assert t.schema.field("typed_count").type == pa.int64()
    assert t.schema.field("typed_buckets").type == pa.map_(pa.string(), pa.int64())
    assert t.schema.field("typed_last").type == pa.struct([("id", pa.int64()), ("even", pa.bool_())])
    assert "typed_seen" not in t.column_names
    rows = t.to_pylist()
    ref = _reference(200, 5)
    for r in rows:
        assert r["typed_key"] == r["key"]
        got = {"count": r["typed_count"], "total": r["typed_total"], "buckets": r["typed_buckets"]}[r["state"]] \
            if r["state"] in ("count", "total", "buckets") else None
        if r["state"] == "count":
            assert got == ref[r["key"]]["count"]
        elif r["state"] == "total":
            assert math.isclose(got, ref[r["key"]]["total"])
        elif r["state"] == "buckets":
            assert dict(got) == ref[r["key"]]["buckets"]
        else:  # another state's row holds NULL in these columns
            assert r["typed_count"] is None and r["typed_buckets"] is None
    # every typed state row has its own column set, and only that one
    for r in rows:
        own = f"typed_{r['state']}"
        for col in ("typed_count", "typed_total", "typed_recent", "typed_buckets", "typed_last"):
            assert (r[col] is not None) == (col == own), (r["state"], col)


def test_typed_arrays_write_null_for_a_value_that_does_not_fit(caplog):
    import pickle

    rows = pa.table({"key": [pickle.dumps("k")], "state": ["count"], "value": [pickle.dumps("x")]})
    arrays = typed_arrays(rows, {"typed_count": Types.LONG()}, "operator 'op'")
    assert arrays["typed_count"].to_pylist() == [None]
    assert "does not fit the column type BIGINT" in caplog.text
