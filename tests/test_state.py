"""Keyed state: PyFlink-style handles and the captures of both keyed-state backends, the heap
(runtime/state.py, ``hashmap``) and RocksDB (backends/rocksdb_state.py): every test runs on each."""

from __future__ import annotations

import pickle
import shutil
import tempfile
import threading
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream.backends.objects import encode_state_counted
from epochstream.backends.rocksdb_state import RocksDBKeyedState
from epochstream.graph.keygroups import assign_to_key_group
from epochstream.runtime.context import Context
from epochstream.runtime.errors import StateSerializationError
from epochstream.runtime.state import (
    HeapKeyedState,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from pipelines import ROCKSDB_TEST_DIR

M = 128
#: the backend ``backend()`` builds in the running test (set by the ``state_backend_type`` fixture)
KIND = {"type": "hashmap"}


@pytest.fixture(autouse=True, params=["hashmap", "rocksdb"])
def state_backend_type(request, tmp_path):
    # DBs on tmpfs where there is one (pipelines.ROCKSDB_TEST_DIR: creating a DB fsyncs)
    where = tempfile.mkdtemp(dir=ROCKSDB_TEST_DIR) if ROCKSDB_TEST_DIR else str(tmp_path)
    KIND["type"], KIND["dir"] = request.param, where
    yield request.param
    KIND["type"] = "hashmap"
    shutil.rmtree(where, ignore_errors=True)


def backend(uid: str = "op-1") -> Any:
    if KIND["type"] == "rocksdb":
        return RocksDBKeyedState(uid, lambda k: assign_to_key_group(k, M), (0, M - 1), local_dir=KIND["dir"])
    return HeapKeyedState(uid, lambda k: assign_to_key_group(k, M), (0, M - 1))


def decode(capture) -> dict:
    """{(state, key): value or None (tombstone)} of a capture's rows."""
    return {(name, pickle.loads(kb)): None if vb is None else pickle.loads(vb) for _kg, kb, name, vb in capture.rows}


def rebuild(files: dict[int, object], chain: tuple[int, ...], kinds: dict[str, str]) -> Any:
    fresh = backend()
    for epoch in chain:
        fresh.restore_rows(files[epoch].rows, kinds)
    return fresh


# ---------------------------------------------------------------- handles


def test_value_state():
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    d = s.handle(ValueStateDescriptor("d", default=0))
    s.keys.key = "k1"
    assert v.value() is None and d.value() == 0
    v.update("x")
    d.update(d.value() + 5)
    assert v.value() == "x" and d.value() == 5
    s.keys.key = "k2"  # per-key isolation
    assert v.value() is None and d.value() == 0
    v.update("y")
    s.keys.key = "k1"
    assert v.value() == "x"
    v.clear()
    assert v.value() is None
    v.clear()  # clearing twice is fine
    v.update(None)  # None is a value, not a deletion
    assert s.as_dict()["v"] == {"k1": None, "k2": "y"}


def test_mutable_default_is_not_shared_between_keys():
    s = backend()
    acc = s.handle(ValueStateDescriptor("acc", default=[]))
    s.keys.key = "k1"
    a = acc.value()
    a.append(1)
    acc.update(a)
    s.keys.key = "k2"
    assert acc.value() == []
    b = acc.value()
    b.append(2)
    acc.update(b)
    s.keys.key = "k1"
    assert acc.value() == [1]


def test_list_state():
    s = backend()
    lst = s.handle(ListStateDescriptor("l"))
    s.keys.key = 1
    assert list(lst.get()) == []
    lst.add("a")
    lst.add("b")
    lst.add_all(["c", "d"])
    assert list(lst.get()) == ["a", "b", "c", "d"]
    s.keys.key = 2
    assert list(lst.get()) == []
    lst.update(["z"])
    assert list(lst.get()) == ["z"]
    s.keys.key = 1
    lst.update(["q", "r"])
    assert list(lst.get()) == ["q", "r"]
    lst.clear()
    assert list(lst.get()) == []
    s.keys.key = 2
    assert list(lst.get()) == ["z"]


def test_map_state():
    s = backend()
    m = s.handle(MapStateDescriptor("m"))
    s.keys.key = ("user", 1)
    assert m.get("a") is None and not m.contains("a") and m.is_empty()
    m.put("a", 1)
    m.put_all({"b": 2, "c": 3})
    assert m.get("a") == 1 and m.contains("b") and not m.is_empty()
    assert sorted(m.keys()) == ["a", "b", "c"]
    assert sorted(m.values()) == [1, 2, 3]
    assert sorted(m.items()) == [("a", 1), ("b", 2), ("c", 3)]
    # iterating while writing is safe: the views are snapshots
    for k in m.keys():
        m.remove(k) if k == "b" else m.put(k, 0)
    assert sorted(m.items()) == [("a", 0), ("c", 0)]
    m.remove("missing")  # no error
    s.keys.key = ("user", 2)
    assert m.is_empty() and list(m.items()) == []
    m.put("a", 9)
    s.keys.key = ("user", 1)
    assert m.get("a") == 0
    m.clear()
    assert m.is_empty()
    s.keys.key = ("user", 2)
    m.remove("a")  # removing the last entry removes the key
    assert s.as_dict() == {}


def test_handles_of_one_name_share_data_and_kinds_cannot_change():
    s = backend("my-op")
    a = s.handle(ValueStateDescriptor("count"))
    b = s.handle(ValueStateDescriptor("count"))
    s.keys.key = "k"
    a.update(3)
    assert b.value() == 3
    with pytest.raises(ValueError) as ei:
        s.handle(ListStateDescriptor("count"))
    msg = str(ei.value)
    assert "my-op" in msg and "count" in msg and "value" in msg and "list" in msg


def test_descriptor_needs_a_name():
    with pytest.raises(ValueError):
        ValueStateDescriptor("")


def test_context_exposes_pyflink_names():
    s = backend("ctx-op")
    ctx = Context(s, subtask_index=1, parallelism=4, operator_uid="ctx-op")
    v = ctx.get_state(ValueStateDescriptor("v"))
    lst = ctx.get_list_state(ListStateDescriptor("l"))
    m = ctx.get_map_state(MapStateDescriptor("m"))
    s.keys.key = "k"
    assert ctx.key == "k" == ctx.get_current_key()
    v.update(1)
    lst.add(2)
    m.put(3, 4)
    assert s.as_dict() == {"v": {"k": 1}, "l": {"k": [2]}, "m": {"k": {3: 4}}}


# ---------------------------------------------------------------- captures


def test_first_capture_is_full_then_only_dirty_keys_with_tombstones():
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    m = s.handle(MapStateDescriptor("m"))
    for k in ("a", "b", "c"):
        s.keys.key = k
        v.update(k * 2)
        m.put("n", k)
    first = s.capture(1)
    assert first.full and first.chain == (1,)
    assert first.operator_uid == "op-1" and first.key_group_range == (0, M - 1)
    assert dict(first.kinds) == {"v": "value", "m": "map"}
    assert decode(first) == {**{("v", k): k * 2 for k in "abc"}, **{("m", k): {"n": k} for k in "abc"}}

    s.keys.key = "a"
    v.update("changed")
    s.keys.key = "b"
    v.clear()  # tombstone
    m.remove("n")  # map emptied: tombstone
    s.keys.key = "c"
    assert v.value() == "cc"  # a read does not make a key dirty
    s.keys.key = "never-existed"
    v.clear()  # clearing nothing writes nothing
    second = s.capture(2)
    assert not second.full and second.chain == (1, 2)
    assert decode(second) == {("v", "a"): "changed", ("v", "b"): None, ("m", "b"): None}

    third = s.capture(3)  # nothing written since
    assert not third.full and third.chain == (1, 2, 3) and third.rows == []


def test_rows_carry_the_key_group_of_their_key():
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    keys = ["a", 17, ("t", 2), b"raw", None]
    for k in keys:
        s.keys.key = k
        v.update(1)
    rows = s.capture(1).rows
    assert len(rows) == len(keys)
    for kg, kb, _n, _v in rows:
        assert kg == assign_to_key_group(pickle.loads(kb), M)


@pytest.mark.parametrize("full_every", [1, 3, 10])
def test_full_capture_every_full_every(full_every):
    if KIND["type"] == "hashmap" and full_every > 1:
        pytest.skip("the heap spreads its materialisation: test_heap_materialises_in_rounds")
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    fulls = []
    for epoch in range(1, 13):
        s.keys.key = epoch % 2
        v.update(epoch)
        cap = s.capture(epoch, incremental=True, full_every=full_every)
        fulls.append(cap.full)
        assert cap.chain[0] == max(e for e, f in zip(range(1, epoch + 1), fulls, strict=True) if f)
        assert cap.chain == tuple(range(cap.chain[0], epoch + 1))
        assert len(cap.chain) <= full_every
    assert [e for e, f in zip(range(1, 13), fulls, strict=True) if f] == list(range(1, 13, full_every))


@pytest.mark.parametrize("full_every", [2, 3, 10])
def test_heap_materialises_in_rounds(full_every):
    """No capture after the first is full: once the chain has ``full_every`` links, each of the
    next ``full_every`` captures adds its share of the keys, and the links before that round
    are dropped; the chain stays under 2 * full_every and rebuilds the state."""
    if KIND["type"] != "hashmap":
        pytest.skip("RocksDB takes full captures (or shares SST files)")
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    n = 50
    for k in range(n):
        s.keys.key = k
        v.update(k)
    files = {}
    for epoch in range(1, 4 * full_every + 2):
        s.keys.key = epoch % n
        v.update(-epoch)  # one key written per epoch
        if epoch == 5:
            v.clear()
        cap = s.capture(epoch, incremental=True, full_every=full_every)
        files[epoch] = cap
        assert cap.full == (epoch == 1)
        assert len(cap.chain) < 2 * full_every and cap.chain[-1] == epoch
        if epoch > 1:  # the written key plus at most one share of the keys
            assert len(cap.rows) <= 1 + -(-n // full_every)
        assert rebuild(files, cap.chain, dict(cap.kinds)).as_dict() == s.as_dict()
    assert cap.chain[0] > 1  # the full capture was left behind


def test_non_incremental_captures_are_always_full():
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    s.keys.key = "k"
    v.update(1)
    s.capture(1, incremental=False)
    cap = s.capture(2, incremental=False)
    assert cap.full and cap.chain == (2,) and decode(cap) == {("v", "k"): 1}


def test_capture_is_a_copy_later_mutation_does_not_leak():
    s = backend()
    lst = s.handle(ListStateDescriptor("l"))
    s.keys.key = "k"
    lst.add([1])
    cap = s.capture(1)
    lst.get()[0].append(2)  # in-place mutation of the live value
    lst.add([3])
    assert decode(cap) == {("l", "k"): [[1]]}


def test_first_capture_after_restore_is_full():
    s = backend()
    v = s.handle(ValueStateDescriptor("v"))
    for k in "ab":
        s.keys.key = k
        v.update(k)
    files = {1: s.capture(1)}
    restored = rebuild(files, (1,), {"v": "value"})
    rv = restored.handle(ValueStateDescriptor("v"))
    restored.keys.key = "a"
    assert rv.value() == "a"
    rv.update("A")
    cap = restored.capture(2)
    assert cap.full and cap.chain == (2,)
    assert decode(cap) == {("v", "a"): "A", ("v", "b"): "b"}


def test_restore_creates_tables_of_the_recorded_kind():
    s = backend()
    m = s.handle(MapStateDescriptor("m"))
    s.keys.key = "k"
    m.put("x", 1)
    cap = s.capture(1)
    restored = rebuild({1: cap}, (1,), dict(cap.kinds))
    restored.handle(MapStateDescriptor("m"))  # same kind: fine
    with pytest.raises(ValueError, match="map"):
        restored.handle(ValueStateDescriptor("m"))


# ---------------------------------------------------------------- the property: chain rebuild == live state

KEYS = st.sampled_from(["a", 1, ("t", 1)])
VALS = st.integers(-3, 3)
OPS = st.one_of(
    st.tuples(st.just("v.update"), KEYS, VALS),
    st.tuples(st.just("v.clear"), KEYS, st.none()),
    st.tuples(st.just("l.add"), KEYS, VALS),
    st.tuples(st.just("l.update"), KEYS, st.lists(VALS, max_size=3)),
    st.tuples(st.just("l.clear"), KEYS, st.none()),
    st.tuples(st.just("m.put"), KEYS, st.tuples(st.sampled_from("xyz"), VALS)),
    st.tuples(st.just("m.remove"), KEYS, st.sampled_from("xyz")),
    st.tuples(st.just("m.clear"), KEYS, st.none()),
)
CAPTURE = ("capture", None, None)
#: a batch scope (``begin_batch``: RocksDB reads the keys at once and writes at ``end_batch``) over
#: some keys, not always the ones used next; a capture or a restore may come while one is open
SCOPE = st.one_of(st.tuples(st.just("begin_batch"), st.none(), st.lists(KEYS, unique=True, max_size=3)),
                  st.just(("end_batch", None, None)))
STEPS = st.one_of(OPS, OPS, st.just(CAPTURE), SCOPE)  # about one capture in four steps


@settings(max_examples=150, deadline=None)
@given(st.lists(STEPS, max_size=60), st.booleans(), st.integers(1, 4))
def test_rebuilding_from_the_captured_chain_reproduces_the_live_state(ops, incremental, full_every):
    if KIND["type"] == "rocksdb":
        pytest.skip("rocksdb: test_rebuilding_on_rocksdb draws fewer examples (a DB per rebuild)")
    rebuilding_reproduces_the_live_state(ops, incremental, full_every)


@settings(max_examples=30, deadline=None)
@given(st.lists(STEPS, max_size=60), st.booleans(), st.integers(1, 4))
def test_rebuilding_on_rocksdb_reproduces_the_live_state(ops, incremental, full_every):
    if KIND["type"] != "rocksdb":
        pytest.skip("the heap runs test_rebuilding_from_the_captured_chain_reproduces_the_live_state")
    rebuilding_reproduces_the_live_state(ops, incremental, full_every)


def rebuilding_reproduces_the_live_state(ops, incremental, full_every):
    s = backend()
    h = {
        "v": s.handle(ValueStateDescriptor("v")),
        "l": s.handle(ListStateDescriptor("l")),
        "m": s.handle(MapStateDescriptor("m")),
    }
    model: dict[str, dict] = {"v": {}, "l": {}, "m": {}}  # an independent reference
    files: dict[int, object] = {}
    epoch = 0
    for op, key, arg in ops + [CAPTURE]:
        if op == "capture":
            epoch += 1
            cap = s.capture(epoch, incremental, full_every)
            files[epoch] = cap
            assert cap.chain[-1] == epoch and all(files[e] is not None for e in cap.chain)
            assert not any(files[e].full for e in cap.chain[1:])
            # the heap spreads its materialisation over a round of captures (no full capture is due)
            assert files[cap.chain[0]].full or (KIND["type"] == "hashmap" and len(cap.chain) < 2 * full_every)
            restored = rebuild(files, cap.chain, dict(cap.kinds))
            assert restored.as_dict() == s.as_dict() == {n: t for n, t in model.items() if t}
            continue
        if op == "begin_batch":
            s.begin_batch(arg)
            continue
        if op == "end_batch":
            s.end_batch()
            continue
        name, method = op.split(".")
        s.keys.key = key
        table = model[name]
        if op == "m.put":
            getattr(h[name], method)(*arg)
        elif arg is None:
            getattr(h[name], method)()
        else:
            getattr(h[name], method)(arg)
        # the reference semantics
        if method == "clear":
            table.pop(key, None)
        elif op == "v.update":
            table[key] = arg
        elif op == "l.add":
            table.setdefault(key, []).append(arg)
        elif op == "l.update":
            table[key] = list(arg)
        elif op == "m.put":
            table.setdefault(key, {})[arg[0]] = arg[1]
        elif op == "m.remove":
            if arg in table.get(key, {}):
                del table[key][arg]
                if not table[key]:
                    del table[key]


# ---------------------------------------------------------------- serialization errors


def test_unpicklable_value_names_operator_state_and_key():
    s = backend("orders-by-user")
    v = s.handle(ValueStateDescriptor("last_seen"))
    s.keys.key = "user-42"
    with pytest.raises(StateSerializationError) as ei:  # heap: at the capture; rocksdb: at the write
        v.update(threading.Lock())
        s.capture(1)
    msg = str(ei.value)
    assert "'orders-by-user'" in msg and "'last_seen'" in msg and "'user-42'" in msg and "lock" in msg
    assert "picklable" in msg
    assert isinstance(ei.value.__cause__, Exception)


def test_unpicklable_value_nested_in_map_state_is_reported():
    s = backend("op")
    m = s.handle(MapStateDescriptor("cache"))
    s.keys.key = 7
    with pytest.raises(StateSerializationError, match=r"'op'.*'cache'.*key 7"):
        m.put("fn", lambda x: x)
        s.capture(1)


def test_unpicklable_value_in_an_incremental_capture_is_reported():
    s = backend("op")
    v = s.handle(ValueStateDescriptor("v"))
    s.keys.key = "fine"
    v.update(1)
    s.capture(1)
    s.keys.key = "bad"
    with pytest.raises(StateSerializationError, match="'bad'"):
        v.update(threading.Lock())
        s.capture(2)


# ---------------------------------------------------------------- the RocksDB backend's own duties


def rocks(tmp_path, memory_mb: int = 64, uid: str = "op-1") -> RocksDBKeyedState:
    return RocksDBKeyedState(uid, lambda k: assign_to_key_group(k, M), (0, M - 1), local_dir=str(tmp_path),
                             memory_mb=memory_mb)


def test_rocksdb_db_is_scratch_removed_on_close_and_left_by_dead_processes(state_backend_type, tmp_path):
    if state_backend_type != "rocksdb":
        pytest.skip("rocksdb only")
    import os
    import subprocess
    import sys

    s = rocks(tmp_path)
    assert os.path.isdir(s.path) and s.path.startswith(str(tmp_path))
    s.close()
    s.close()  # idempotent
    assert not os.path.exists(s.path)
    # a DB directory of a process that died without closing it (a killed worker)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "epochstream-rocksdb" / f"{int(dead.stdout)}-0123456789ab-op-0"
    stale.mkdir(parents=True)
    (stale / "CURRENT").write_text("MANIFEST-000001\n")
    fresh = rocks(tmp_path)
    assert not stale.exists(), "the next backend under the same local dir removes it"
    assert fresh.as_dict() == {}, "a new backend never reads an old DB"
    path = fresh.path
    del fresh  # garbage collected without close(): the finalizer removes the directory
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_rocksdb_keeps_more_state_than_its_memory_bound(state_backend_type, tmp_path):
    """8 MiB bound, ~25 MB of values: RocksDB's own memory (memtables + block cache) stays near the
    bound, every value reads back, and a full capture restores into a fresh DB."""
    if state_backend_type != "rocksdb":
        pytest.skip("rocksdb only")
    s = rocks(tmp_path, memory_mb=8)
    v = s.handle(ValueStateDescriptor("v"))
    n = 100_000
    for i in range(n):
        s.keys.key = i
        v.update(f"{i:0>240}")
    assert s.approximate_memory() <= 1.25 * (8 << 20)
    for i in range(0, n, 997):
        s.keys.key = i
        assert v.value() == f"{i:0>240}"
    cap = s.capture(1)
    s.keys.key = 0
    v.update("written after the capture")  # the capture is a RocksDB checkpoint of the epoch bound
    assert cap.full and len(cap.rows) == n
    assert [r[0] for r in cap.rows] == sorted(r[0] for r in cap.rows), "a full capture comes in key-group order"
    # the writer streams it in row groups into one Parquet state file (never a list of the whole state)
    data, count = encode_state_counted(cap.rows)
    table = pq.read_table(pa.BufferReader(data))
    assert count == table.num_rows == n and len(table.to_batches()) > 1
    assert pickle.loads(table.column("value")[0].as_py()) == f"{0:0>240}"
    again = rocks(tmp_path, memory_mb=8)
    again.restore_rows(cap.rows, dict(cap.kinds))
    av = again.handle(ValueStateDescriptor("v"))
    again.keys.key = n - 1
    assert av.value() == f"{n - 1:0>240}"
    assert len(again.keys_of("v")) == n


def test_rocksdb_needs_rocksdict_and_a_sane_memory_bound(state_backend_type, tmp_path, monkeypatch):
    if state_backend_type != "rocksdb":
        pytest.skip("rocksdb only")
    import sys

    from epochstream import CheckpointConfig
    from epochstream.backends.rocksdb_state import RocksDBStateError, keyed_state_factory
    from epochstream.runtime.errors import EpochStreamError

    with pytest.raises(ValueError, match="state_backend_type"):
        CheckpointConfig(state_backend_type="lsm")
    with pytest.raises(ValueError, match="rocksdb_memory_mb"):
        CheckpointConfig(state_backend_type="rocksdb", rocksdb_memory_mb=1)
    assert keyed_state_factory(CheckpointConfig()) is None  # hashmap: the chain's default
    make = keyed_state_factory(CheckpointConfig(state_backend_type="rocksdb", rocksdb_dir=str(tmp_path)))
    assert make is not None and type(make("op", lambda k: 0, (0, 0), None)).__name__ == "RocksDBKeyedState"
    monkeypatch.setitem(sys.modules, "rocksdict", None)  # as if not installed
    with pytest.raises(RocksDBStateError, match=r"epochstream\[rocksdb\]") as ei:
        rocks(tmp_path)
    assert isinstance(ei.value, EpochStreamError)


def test_rocksdb_batch_scope_stores_what_single_accesses_store(state_backend_type):
    """Keys written in a batch scope (their key groups hashed at once, ints encoded inline) land
    under the same DB keys and values as written one by one, and reads in the scope see writes."""
    if state_backend_type != "rocksdb":
        pytest.skip("rocksdb only")
    keys = [0, -1, 255, -129, 2**63 - 1, -(2**63), 2**70, "k", ("t", 1), 2.5, None, *range(100, 140)]
    one, scoped = backend("one"), backend("scoped")
    for s in (one, scoped):
        v = s.handle(ValueStateDescriptor("v", default=0))
        if s is scoped:
            s.begin_batch(keys)
        for k in keys + keys:  # every key twice: the second read sees the first write
            s.keys.key = k
            v.update(v.value() + 1)
        s.end_batch()
    assert list(one._db.items()) == list(scoped._db.items())
    assert scoped.as_dict() == {"v": dict.fromkeys(keys, 2)}
