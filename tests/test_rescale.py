"""Rescaling through key groups, in the style of Flink's RescalingITCase (simulator, fast).

Run a job at parallelism p1, stop it with a savepoint, restore the savepoint at p2 and run
it to the end of its input: every key's final state and the multiset of committed output
equal a run without rescaling, and the state of each key is found exactly at the subtask
the key-group formula names (``kg * p // M``), both in the restored tasks and in every
record the key produced. Max parallelism is 13 (as in Flink's test): not a power of two,
so uneven key-group ranges are exercised. Both exactly-once modes run.

Also here: operator (non-keyed) state in its three modes, source splits dealt to
subtasks, savepoints triggered on a running job and restored after being moved, and the
pure redistribution functions (``snapshot.rescale``). The exactly-once oracle over
restore-with-rescale under injected failures is in ``test_exactly_once.py``.
"""

from __future__ import annotations

import collections
import json
import pickle
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream import FileSink, KeyedProcessFunction, ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.assembly import build_tasks
from epochstream.deploy.restore import find_restore, resolve_sources
from epochstream.deploy.sim import SimConfig
from epochstream.graph.keygroups import assign_key_to_operator, key_group_range
from epochstream.oracle import reference_run
from epochstream.snapshot.rescale import redistribute, splits_of
from pipelines import input_records, make_pipeline, sim_run, without_fsync

M = 13
N = 400
KEYS = 23
#: records/s per source subtask in phase 1: slow enough that a stop lands mid-input even when
#: the final epoch waits for the one in flight
SLOW_RATE = 5_000.0
PAIRS = [(1, 3), (4, 2), (3, 7), (7, 3)]
#: keyed-state backends of (phase 1, phase 2) per pair: each mode rescales on every backend and
#: across them (a savepoint of one restores into the other) without running any pair twice
BACKENDS = {(1, 3): ("hashmap", "rocksdb"), (4, 2): ("rocksdb", "rocksdb"), (3, 7): ("rocksdb", "hashmap"),
            (7, 3): ("hashmap", "hashmap")}
MODES = ("aligned", "tracker", "unaligned")


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


class KeySum(KeyedProcessFunction):
    """Per key: ``n`` (count) and ``sum`` (of ids); emits ``(key, n, subtask)``.

    The (key, n) pairs form the multiset {(key, 1..n_key)} whatever the arrival order; the
    subtask shows where the key was processed."""

    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))
        self.sum = ctx.state(ValueStateDescriptor("sum", default=0))
        self.subtask = ctx.subtask_index

    def process(self, value, ctx):
        n = self.n.value() + 1
        self.n.update(n)
        self.sum.update(self.sum.value() + value[1])
        return ((ctx.key, n, self.subtask),)


def half(parallelism: int) -> float:
    """Virtual seconds in which ``parallelism`` source subtasks read about half of the input."""
    return 0.5 * N / (parallelism * SLOW_RATE)


def key_sum(out: Path, parallelism: int, mode: str = "aligned", n: int = N, backend: str = "hashmap"):
    p = make_pipeline("rescaling", parallelism=parallelism, max_parallelism=M, mode=mode, interval=0.0005,
                      batch_size=4, state_backend_type=backend)
    p.from_collection(input_records(n, KEYS), uid="src").key_by(lambda r: r[0]).process(
        KeySum(), uid="sum").sink(FileSink(out), uid="out")
    return p


def committed(out: Path) -> list[tuple[int, list]]:
    """(epoch, record) of every committed record (the epoch is in the part file's name)."""
    rows = []
    for f in sorted(out.glob("part-*.jsonl")):
        epoch = int(f.name.split("-")[1][1:])
        rows += [(epoch, json.loads(line)) for line in f.read_text().splitlines() if line]
    return rows


def final_state(chk: Path, uid: str = "sum") -> dict:
    storage = LocalCheckpointStorage(chk)
    manifest, root = storage.latest()
    out: dict = {}
    for _kg, kb, name, vb in storage.read_operator_rows(manifest, root, uid):
        slot = (name, pickle.loads(kb))
        if vb is None:
            out.pop(slot, None)
        else:
            out[slot] = pickle.loads(vb)
    return out


def expected_state() -> dict:
    _sinks, states = reference_run(key_sum(Path("/nonexistent"), 1))
    return {(name, k): v for name, d in states["sum"].items() for k, v in d.items()}


def rescale_run(tmp_path: Path, p1: int, p2: int, mode: str, seed: int = 1) -> tuple[str, Path]:
    """Phase 1 at p1 until a stop-with-savepoint; phase 2 restores it at p2 and finishes."""
    out = tmp_path / "out"
    b1, b2 = BACKENDS.get((p1, p2), ("hashmap", "hashmap"))
    first = sim_run(key_sum(out, p1, mode, backend=b1), tmp_path / "chk1", seed=seed, duration=half(p1),
                    source_rate=SLOW_RATE, savepoint_dir=str(tmp_path / "sp"), stop_with_savepoint=True)
    assert first.savepoints, "phase 1 wrote no savepoint"
    savepoint = first.savepoints[-1]
    manifest = json.loads((Path(savepoint) / "_metadata.json").read_text())
    consumed = sum(manifest["sources"]["src"]["offsets"].values())
    assert 0 < consumed < N, f"the savepoint must cut the input ({consumed} of {N} read)"
    second = sim_run(key_sum(out, p2, mode, backend=b2), tmp_path / "chk2", seed=seed + 1, restore=savepoint)
    assert second.metrics["parallelism"] == p2
    return savepoint, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p1, p2", PAIRS)
def test_rescaled_run_equals_a_run_without_rescaling(tmp_path, p1, p2, mode):
    savepoint, out = rescale_run(tmp_path, p1, p2, mode)
    sp_epoch = json.loads((Path(savepoint) / "_metadata.json").read_text())["epoch"]
    # every key's final state equals the sequential reference (a run without rescaling)
    assert final_state(tmp_path / "chk2") == expected_state()
    # the committed output, both phases together, is {(key, 1..n_key)}: nothing lost or doubled
    records = committed(out)
    got = collections.Counter((r[0], r[1]) for _e, r in records)
    want = collections.Counter((f"k{k}", i + 1) for k in range(KEYS) for i in range(sum(
        1 for j in range(N) if j % KEYS == k)))
    assert got == want
    # each record was produced at the subtask the key-group formula names for its phase
    wrong = [(e, r) for e, r in records
             if r[2] != assign_key_to_operator(r[0], M, p1 if e <= sp_epoch else p2)]
    assert not wrong, wrong[:5]
    assert {e for e, _r in records if e > sp_epoch}, "phase 2 committed nothing"


@pytest.mark.parametrize("p1, p2", PAIRS)
def test_restored_state_sits_at_the_subtask_the_formula_names(tmp_path, p1, p2):
    """Tasks built from a savepoint at p2: subtask s holds exactly the keys whose key group is
    in s's range, and together they hold the savepoint's state; state files written after the
    restore carry only their subtask's key groups."""
    savepoint, _out = rescale_run(tmp_path, p1, p2, "aligned")
    pipeline = key_sum(tmp_path / "unused", p2, backend=BACKENDS[p1, p2][1])
    plan = pipeline.plan()
    storage = LocalCheckpointStorage(tmp_path / "chk-build")
    restored = find_restore(storage, savepoint)
    resolve_sources(plan, pipeline, restored)
    tasks = build_tasks(pipeline, plan, None, storage, restored)
    union: dict = {}
    for (_chain, subtask), task in tasks.items():
        st_ = task.chain.states.get("sum")
        if st_ is None:
            continue
        # the chosen backend holds the restored state (a savepoint of either restores into either)
        assert type(st_).__name__ == {"hashmap": "HeapKeyedState", "rocksdb": "RocksDBKeyedState"}[BACKENDS[p1, p2][1]]
        lo, hi = key_group_range(M, p2, subtask)
        for name, values in st_.as_dict().items():
            for key in values:
                assert assign_key_to_operator(key, M, p2) == subtask, (key, subtask)
                union[(name, key)] = values[key]
        assert st_.key_group_range == (lo, hi)
    want = {}
    sp_storage = LocalCheckpointStorage(Path(savepoint).parent)
    m, root = sp_storage.load_manifest(savepoint)
    for _kg, kb, name, vb in sp_storage.read_operator_rows(m, root, "sum"):
        want[(name, pickle.loads(kb))] = pickle.loads(vb)
    assert union == want and union
    # files of phase 2 (written at p2) hold only their subtask's key groups
    m2, root2 = LocalCheckpointStorage(tmp_path / "chk2").latest()
    assert m2["parallelism"] == p2
    for f in m2["operators"]["sum"]["files"]:
        assert tuple(f["key_group_range"]) == key_group_range(M, p2, f["subtask"])


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@pytest.mark.parametrize("p1, p2, b2", [(2, 3, "rocksdb"), (3, 2, "hashmap")])
def test_rescale_from_an_incremental_rocksdb_checkpoint(tmp_path, p1, p2, b2, mode):
    """Restore a retained checkpoint (not a savepoint) whose RocksDB state is shared SST files at
    another parallelism: each new subtask reads its key-group range out of the old subtasks'
    SST files, on either backend, and the run ends with the reference state, nothing lost or doubled."""
    out = tmp_path / "out"
    sim_run(key_sum(out, p1, mode, backend="rocksdb"), tmp_path / "chk1", seed=2, duration=half(p1),
            source_rate=SLOW_RATE)
    m1, _root = LocalCheckpointStorage(tmp_path / "chk1").latest()
    files = m1["operators"]["sum"]["files"]
    assert files and all(f["format"] == "rocksdb" and f["shared"] for f in files), files
    assert 0 < sum(m1["sources"]["src"]["offsets"].values()) < N, "phase 1 must stop mid-input"
    sim_run(key_sum(out, p2, mode, backend=b2), tmp_path / "chk2", seed=3,
            restore=str(tmp_path / "chk1" / f"chk-{m1['epoch']}"))
    assert final_state(tmp_path / "chk2") == expected_state()
    got = collections.Counter((r[0], r[1]) for _e, r in committed(out))
    want = collections.Counter((f"k{k}", i + 1) for k in range(KEYS) for i in range(sum(
        1 for j in range(N) if j % KEYS == k)))
    assert got == want


def test_source_splits_follow_the_parallelism(tmp_path):
    """An elastic source gets one split per subtask on a fresh start (no idle worker, even with
    a parallelism override), and keeps its splits, dealt by ``split % p``, on a restore."""
    out = tmp_path / "out"
    p = key_sum(out, 2)
    r = sim_run(p, tmp_path / "chk", seed=3, parallelism=5)
    assert p.sources["src"].num_splits == 5
    m, _ = LocalCheckpointStorage(tmp_path / "chk").latest()
    assert m["sources"]["src"]["splits"] == 5 and len(m["sources"]["src"]["offsets"]) == 5
    assert all(int(v) > 0 for v in m["sources"]["src"]["offsets"].values()), "a source subtask idled"
    assert r.completed_epochs
    assert splits_of(5, 3, 0) == [0, 3] and splits_of(5, 3, 2) == [2] and splits_of(2, 3, 2) == []


# ---------------------------------------------------------------- operator state


class WithOperatorState(KeyedProcessFunction):
    """Keyed count plus operator state of every mode:

    - ``seen`` (split): the ids this subtask processed; all subtasks together: every id once;
    - ``restored`` (union): on open, how many entries each subtask had in total across the job;
    - ``rules`` (broadcast): the same small dict on every subtask."""

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))
        self.seen = ctx.operator_state(ListStateDescriptor("seen"), mode="split")
        self.union = ctx.operator_state(ListStateDescriptor("union"), mode="union")
        self.rules = ctx.broadcast_state(MapStateDescriptor("rules"))
        if not self.rules.contains("threshold"):
            self.rules.put("threshold", 3)
        self.subtask = ctx.subtask_index

    def process(self, value, ctx):
        self.count.update(self.count.value() + 1)
        self.seen.add(value[1])
        if value[1] % 50 == 0:
            self.union.add(value[1])
        return ((ctx.key, value[1]),)


def op_state_pipeline(out: Path, parallelism: int, mode: str = "aligned"):
    p = make_pipeline("op-state", parallelism=parallelism, max_parallelism=M, mode=mode, interval=0.0005,
                      batch_size=4)
    p.from_collection(input_records(N, KEYS), uid="src").key_by(lambda r: r[0]).process(
        WithOperatorState(), uid="ops").sink(FileSink(out), uid="out")
    return p


def _parts(manifest: dict, name: str) -> dict[int, object]:
    st_ = manifest["operators"]["ops"]["operator_state"][name]
    import base64
    return {int(s): pickle.loads(base64.b64decode(d)) for s, d in st_["parts"].items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p1, p2", [(3, 2), (2, 5)])
def test_operator_state_is_redistributed_by_its_mode(tmp_path, p1, p2, mode):
    out = tmp_path / "out"
    first = sim_run(op_state_pipeline(out, p1, mode), tmp_path / "chk1", seed=5, duration=half(p1),
                    source_rate=SLOW_RATE, savepoint_dir=str(tmp_path / "sp"), stop_with_savepoint=True)
    sp = first.savepoints[-1]
    sp_manifest = json.loads((Path(sp) / "_metadata.json").read_text())
    seen_at_sp = [x for part in _parts(sp_manifest, "seen").values() for x in part]
    consumed = sum(sp_manifest["sources"]["src"]["offsets"].values())
    assert len(seen_at_sp) == consumed == len(set(seen_at_sp)) > 0
    assert set(_parts(sp_manifest, "rules")) == {0}, "only subtask 0's broadcast copy is checkpointed"
    # restored tasks at p2: split = even chunks of all entries, union = all entries, broadcast = a copy each
    pipeline = op_state_pipeline(tmp_path / "unused", p2)  # tasks built without trackers: aligned
    plan = pipeline.plan()
    storage = LocalCheckpointStorage(tmp_path / "chk-build")
    restored = find_restore(storage, sp)
    resolve_sources(plan, pipeline, restored)
    tasks = build_tasks(pipeline, plan, None, storage, restored)
    ops = {tid[1]: t.chain.operator_states["ops"].as_dict() for tid, t in tasks.items()
           if "ops" in t.chain.operator_states}
    union_all = sorted(x for part in _parts(sp_manifest, "union").values() for x in part)
    sizes = [len(ops[s]["seen"]) for s in range(p2)]
    assert sorted(x for s in range(p2) for x in ops[s]["seen"]) == sorted(seen_at_sp)
    assert max(sizes) - min(sizes) <= 1
    assert all(sorted(ops[s]["union"]) == union_all for s in range(p2))
    assert all(ops[s]["rules"] == {"threshold": 3} for s in range(p2))
    # and the job finishes at p2 with every id in the split state exactly once
    sim_run(op_state_pipeline(out, p2, mode), tmp_path / "chk2", seed=6, restore=sp)
    m, _ = LocalCheckpointStorage(tmp_path / "chk2").latest()
    seen = collections.Counter(x for part in _parts(m, "seen").values() for x in part)
    assert seen == collections.Counter(range(N))


def test_operator_state_modes_are_checked():
    from epochstream.runtime.state import OperatorStateBackend

    b = OperatorStateBackend("ops", 0)
    b.handle(ListStateDescriptor("x"), "split")
    with pytest.raises(ValueError, match="'x' is declared with mode 'split' and again with 'union'"):
        b.handle(ListStateDescriptor("x"), "union")
    with pytest.raises(ValueError, match="mode must be one of"):
        b.handle(ListStateDescriptor("y"), "round-robin")


@settings(max_examples=200, deadline=None)
@given(parts=st.dictionaries(st.integers(0, 7), st.lists(st.integers(), max_size=6), max_size=8),
       new_p=st.integers(1, 9))
def test_redistribute_keeps_every_entry(parts, new_p):
    old_p = max(parts, default=0) + 1
    flat = sorted(x for v in parts.values() for x in v)
    split = redistribute("split", parts, old_p, new_p)
    assert len(split) == new_p and sorted(x for v in split for x in v) == flat
    if old_p != new_p:
        sizes = [len(v) for v in split]
        assert max(sizes) - min(sizes) <= 1
    else:
        assert split == [parts.get(i, []) for i in range(new_p)]
    union = redistribute("union", parts, old_p, new_p)
    assert all(sorted(v) == flat for v in union)
    bcast = redistribute("broadcast", {0: {"a": 1}, 1: {"a": 1}}, 2, new_p)
    assert bcast == [{"a": 1}] * new_p and len({id(v) for v in bcast}) == new_p  # copies, not one shared dict
    with pytest.raises(ValueError):
        redistribute("round-robin", parts, old_p, new_p)


# ---------------------------------------------------------------- savepoints on a running job


def test_savepoint_of_a_running_job_restores_after_a_move(tmp_path):
    """A savepoint triggered mid-run (the job goes on to its end) is full and self-contained:
    moved to another folder, with the job's checkpoints gone, it still restores at another
    parallelism and the job finishes with the reference state."""
    out = tmp_path / "out"
    first = key_sum(out, 2).run(deployment="sim", checkpoint_dir=str(tmp_path / "chk1"), seed=8,
                                savepoint_dir=str(tmp_path / "sp"),
                                sim=SimConfig(source_rate=SLOW_RATE, savepoints_at=(half(2),)))
    assert len(first.savepoints) == 1
    sp = Path(first.savepoints[0])
    m = json.loads((sp / "_metadata.json").read_text())
    assert m["kind"] == "savepoint" and m["self_contained"] and m["job_id"] == first.metrics["job_id"]
    assert all(f["full"] and not Path(f["path"]).is_absolute() for op in m["operators"].values() for f in op["files"])
    assert m["epoch"] < first.completed_epochs[-1], "the job went on after the savepoint"
    moved = tmp_path / "elsewhere" / "my-savepoint"
    shutil.copytree(sp, moved)
    shutil.rmtree(tmp_path / "sp")
    shutil.rmtree(tmp_path / "chk1")
    out2 = tmp_path / "out2"
    sim_run(key_sum(out2, 3), tmp_path / "chk2", seed=9, restore=str(moved))
    assert final_state(tmp_path / "chk2") == expected_state()


def test_incremental_chains_are_compacted_into_the_savepoint(tmp_path):
    """A savepoint of an incremental checkpoint holds one full file per operator subtask whose
    rows equal the chain applied in order."""
    out = tmp_path / "out"
    p = key_sum(out, 2)
    p.checkpoint.full_every = 100  # long chains of increments
    first = sim_run(p, tmp_path / "chk1", seed=4, duration=0.008, savepoint_dir=str(tmp_path / "sp"),
                    stop_with_savepoint=True)
    storage = LocalCheckpointStorage(tmp_path / "chk1")
    cm, croot = storage.latest()
    assert any(not f["full"] for f in cm["operators"]["sum"]["files"]), "the checkpoint should be incremental"
    sp = first.savepoints[-1]
    sm = json.loads((Path(sp) / "_metadata.json").read_text())
    assert len(sm["operators"]["sum"]["files"]) == 2 and all(f["full"] for f in sm["operators"]["sum"]["files"])
    assert final_state(tmp_path / "chk1") == {
        k: v for k, v in _rows_of(LocalCheckpointStorage(Path(sp).parent), sp).items()}


def _rows_of(storage, location) -> dict:
    m, root = storage.load_manifest(location)
    out = {}
    for _kg, kb, name, vb in storage.read_operator_rows(m, root, "sum"):
        assert vb is not None, "a savepoint holds no tombstones"
        out[(name, pickle.loads(kb))] = pickle.loads(vb)
    return out

