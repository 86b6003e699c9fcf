"""Columnar batches (issue 13): Arrow RecordBatches through sources, routers, operators and
the oracle, and the errors bad columnar input gets.

The exactly-once suites run their pipelines in a columnar layout too (``pipelines.LAYOUTS``,
tests/test_exactly_once.py); here: the pieces one by one, wired in memory, and small sim runs.
"""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream import (
    FileSink,
    KeyedBatchFunction,
    Pipeline,
    SchemaError,
    TrackerConfig,
    TumblingEventTimeWindows,
    ValueStateDescriptor,
)
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.failures import JobFailedError
from epochstream.deploy.sim import FailureSchedule
from epochstream.graph.keygroups import assign_to_key_group, key_group_table
from epochstream.graph.plan import ColumnKey
from epochstream.oracle import check_exactly_once, reference_run
from epochstream.runtime.chain import OutputBuffers
from epochstream.runtime.columns import even_slices, group_by_key, split_by_code
from epochstream.runtime.sources import ArrowSource, BatchGeneratorSource

sys.path.insert(0, str(Path(__file__).parent))
from pipelines import (  # noqa: E402
    BatchRunningCount,
    arrow_input,
    committed_output,
    gen_batch,
    make_pipeline,
    sim_run,
    without_fsync,
)


def _batch(n: int, keys: int = 5, start: int = 0) -> pa.RecordBatch:
    return arrow_input(n, keys, start).to_batches()[0]


# ---------------------------------------------------------------- kernels


def test_split_by_code_keeps_row_order_within_each_part():
    b = _batch(10)
    codes = pa.array([1, 0, 1, 2, 0, 1, 2, 2, 0, 1], pa.int32())
    parts = split_by_code(b, codes)
    assert [c for c, _ in parts] == [0, 1, 2]
    assert {c: p.column("id").to_pylist() for c, p in parts} == {0: [1, 4, 8], 1: [0, 2, 5, 9], 2: [3, 6, 7]}
    [(code, part)] = split_by_code(b, pa.array([3] * 10, pa.int32()))
    assert code == 3 and part.equals(b)
    assert split_by_code(b.slice(0, 0), pa.array([], pa.int32())) == []


def test_group_by_key_one_part_per_distinct_key_in_order_of_first_appearance():
    b = pa.record_batch({"k": ["b", "a", "b", None], "j": [1, 2, 1, 3], "v": [0, 1, 2, 3]})
    groups = group_by_key(b, ColumnKey(("k",)), "test")
    assert [(k, p.column("v").to_pylist()) for k, p in groups] == [("b", [0, 2]), ("a", [1]), (None, [3])]
    groups = group_by_key(b, ColumnKey(("k", "j"), tuple_key=True), "test")
    assert [(k, p.column("v").to_pylist()) for k, p in groups] == [(("b", 1), [0, 2]), (("a", 2), [1]),
                                                                   ((None, 3), [3])]
    assert [k for k, _ in group_by_key(b, ColumnKey(("j",), tuple_key=True), "t")] == [(1,), (2,), (3,)]
    with pytest.raises(SchemaError, match=r"test: the batch has no column 'x'"):
        group_by_key(b, ColumnKey(("x",)), "test")


@given(rows=st.integers(0, 50), parts=st.integers(1, 7), start=st.integers(0, 6))
def test_even_slices_cover_the_batch_once_and_differ_by_at_most_one(rows, parts, start):
    slices = even_slices(rows, parts, start % parts)
    assert sum(n for _p, _o, n in slices) == rows
    assert [o for _p, o, _n in slices] == sorted(o for _p, o, _n in slices)
    sizes = collections.Counter({p: n for p, _o, n in slices})
    assert max(sizes.values(), default=0) - min([sizes[p] for p in range(parts)]) <= 1


def test_output_buffers_keep_fifo_order_across_rows_and_batches():
    out = OutputBuffers([0, 1], keyed={1})
    out.records[0].extend([{"key": "r", "id": -1}])
    out.add_columns(0, _batch(2))
    out.add_columns(0, _batch(2, start=2))
    out.records[0].append({"key": "r", "id": -2})
    out.records[1].append("x")
    out.keys[1].append("kx")
    out.add_columns(1, _batch(1, start=9))
    assert out.pending() == 8
    drained = out.drain(epoch=4)
    assert out.pending() == 0 and not out.columns
    seen = collections.defaultdict(list)
    for ch, batch in drained:
        assert batch.epoch == 4
        recs = batch.records if type(batch.records) is list else batch.records.to_pylist()
        seen[ch].extend(r if not isinstance(r, dict) else r["id"] for r in recs)
        if ch == 1 and type(batch.records) is list:
            assert batch.keys == ["kx"]
    assert seen == {0: [-1, 0, 1, 2, 3, -2], 1: ["x", 9]}
    # the two RecordBatches in a row travel as one
    assert sum(1 for ch, b in drained if ch == 0 and type(b.records) is not list) == 1


# ---------------------------------------------------------------- sources


def test_arrow_source_splits_are_contiguous_and_cover_the_table():
    src = ArrowSource(arrow_input(10, 3), num_splits=3)
    assert [src.split_length(s) for s in range(3)] == [3, 3, 4]
    assert src.read(1, 1, 5).column("id").to_pylist() == [4, 5]
    assert src.read(1, 2, 5).num_rows == 1 and src.read(1, 3, 5) == []
    rows = src.records_before({0: 3, 1: 3, 2: 4})
    assert sorted(r["id"] for r in rows) == list(range(10))
    batches = arrow_input(6, 2).to_batches(max_chunksize=2)
    assert ArrowSource(batches, 2).read(0, 0, 10).column("id").to_pylist() == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(count=st.integers(0, 80), splits=st.integers(1, 5), block=st.integers(1, 9),
       reads=st.lists(st.integers(1, 12), min_size=1, max_size=30))
def test_generate_batches_reads_every_row_once_whatever_the_read_sizes(count, splits, block, reads):
    calls = []

    def fn(a, b):
        calls.append((a, b))
        return pa.record_batch({"i": pa.array(range(a, b), pa.int64())})

    src = BatchGeneratorSource(fn, count, splits, block_rows=block)
    assert sum(src.split_length(s) for s in range(splits)) == count
    got = []
    for s in range(splits):
        offset, k = 0, 0
        while offset < src.split_length(s):
            part = src.read(s, offset, reads[k % len(reads)])
            k += 1
            ids = part.column("i").to_pylist()
            # a replay from the same offset reads the same rows
            assert src.read(s, offset, len(ids)).column("i").to_pylist() == ids
            # rows of a split come in blocks dealt round robin
            assert all((i // block) % splits == s for i in ids)
            got.extend(ids)
            offset += len(ids)
        assert src.read(s, offset, 5) == []
    assert sorted(got) == list(range(count))
    assert all(b - a <= block for a, b in calls)


def test_generate_batches_unbounded_and_elastic():
    src = BatchGeneratorSource(lambda a, b: pa.record_batch({"i": pa.array(range(a, b))}), None, 2, block_rows=4,
                               elastic=True)
    assert src.split_length(0) is None and not src.bounded
    assert src.read(1, 6, 4).column("i").to_pylist() == [14, 15, 20, 21]
    src.resplit(3)
    assert src.num_splits == 3


# ---------------------------------------------------------------- bad input


def test_a_source_batch_with_another_schema_names_source_split_offset_and_column():
    def fn(a, b):
        cols = {"k": pa.array(["x"] * (b - a)), "v": pa.array(range(a, b), pa.int64())}
        if a >= 8:
            cols["v"] = pc.cast(cols["v"], pa.float64())
        return pa.record_batch(cols)

    src = BatchGeneratorSource(fn, 16, 1, block_rows=4)
    src.uid = "gen"
    assert src.read(0, 0, 8).num_rows == 8
    with pytest.raises(SchemaError) as exc:
        src.read(0, 6, 4)
    msg = str(exc.value)
    assert "source 'gen' split 0 offset 8" in msg and "column 'v' is double" in msg, msg
    with pytest.raises(SchemaError, match=r"returned 1 rows for rows \[0, 4\)"):
        BatchGeneratorSource(lambda a, b: pa.record_batch({"i": [a]}), 8, 1, block_rows=4).read(0, 0, 4)
    odd = [_batch(2), _batch(2).rename_columns(["key", "other"])]
    with pytest.raises(SchemaError, match=r"RecordBatch 1: column 'id' is missing"):
        ArrowSource(odd, 1)


def test_key_by_a_missing_column_of_an_arrow_source_fails_when_the_pipeline_is_built():
    p = Pipeline("x")
    with pytest.raises(SchemaError, match=r"key_by\(\['key', 'nope'\]\) after source 'src': no column 'nope'"):
        p.from_arrow(arrow_input(4, 2), uid="src").key_by(["key", "nope"])


def test_key_by_a_missing_column_fails_naming_operator_and_column_and_commits_nothing(tmp_path):
    p = make_pipeline("bad-column", parallelism=2, restart_attempts=1)
    (p.generate_batches(gen_batch(5, 0), count=200, uid="src", block_rows=16)
     .key_by("nope")
     .process_batches(BatchRunningCount(), uid="count")
     .sink(FileSink(tmp_path / "out"), uid="counts"))
    with pytest.raises(JobFailedError) as exc:
        sim_run(p, tmp_path / "chk", seed=1)
    msg = str(exc.value)
    assert "'nope'" in msg and "'count'" in msg and "its columns: ['key', 'id']" in msg, msg
    assert LocalCheckpointStorage(tmp_path / "chk").list_checkpoints() == []
    assert committed_output(tmp_path / "out") == []


def test_api_misuse_is_refused_when_the_pipeline_is_built():
    p = Pipeline("x")
    s = p.from_arrow(arrow_input(4, 2))
    with pytest.raises(TypeError, match="key_by"):
        s.process_batches(BatchRunningCount())
    with pytest.raises(TypeError, match="not a key function"):
        s.key_by(lambda r: r["key"]).process_batches(BatchRunningCount())
    with pytest.raises(ValueError, match="column names"):
        s.key_by([])
    with pytest.raises(TypeError, match="column name"):
        s.key_by(3)


# ---------------------------------------------------------------- pipelines (sim)


class SumPerKey(KeyedBatchFunction):
    """State: the sum of ``id`` per key; emits one row per input row with the running sum."""

    def open(self, ctx):
        self.total = ctx.state(ValueStateDescriptor("total", default=0))

    def process_batch(self, key, batch, ctx):
        assert ctx.key == key
        sums = pc.add(pc.cumulative_sum(batch.column("id")), self.total.value())
        self.total.update(sums[-1].as_py())
        return pa.record_batch({"key": pa.array([key] * batch.num_rows), "sum": sums})


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_columnar_pipeline_state_matches_the_reference_and_the_row_key_groups(tmp_path, mode):
    """from_arrow -> map_batches -> key_by("key") -> process_batches: committed state equals the
    oracle's sequential reference, and every key lives in the key group its Python value maps to."""
    p = make_pipeline("sums", parallelism=3, mode=mode, max_parallelism=16)
    (p.from_arrow(arrow_input(300, 7), uid="src")
     .map_batches(lambda b: b.filter(pc.not_equal(b.column("id"), 13)))
     .key_by("key")
     .process_batches(SumPerKey(), uid="sums")
     .sink(FileSink(tmp_path / "out"), uid="out"))
    sim_run(p, tmp_path / "chk", seed=2)
    want = {f"k{k}": sum(i for i in range(300) if i % 7 == k and i != 13) for k in range(7)}
    _sinks, ref_state = reference_run(p)
    assert ref_state["sums"]["total"] == want
    storage = LocalCheckpointStorage(tmp_path / "chk")
    manifest, root = storage.latest()
    import pickle

    table = key_group_table(16, 3)
    seen = {}
    for kg, kbytes, _name, vbytes in storage.read_operator_rows(manifest, root, "sums"):
        key = pickle.loads(kbytes)
        assert kg == assign_to_key_group(key, 16)
        seen[key] = pickle.loads(vbytes)
    assert seen == want
    assert {table[assign_to_key_group(k, 16)] for k in want} == {0, 1, 2}  # the keys spread over subtasks
    out = committed_output(tmp_path / "out")
    assert max(r["sum"] for r in out if r["key"] == "k0") == want["k0"]


def test_timestamps_column_on_a_columnar_source(tmp_path):
    """Event time on a columnar source (``timestamps="ts"``): records travel as dict rows and
    windows close as on the row path."""
    n = 200
    data = pa.table({"key": [f"k{i % 3}" for i in range(n)], "ts": [i * 0.3 for i in range(n)]})
    p = Pipeline("win", parallelism=2, mode="tracker", checkpoint_interval=0.002, batch_size=16,
                 tracker=TrackerConfig(time_slack=1.0), restart_delay=0)
    (p.from_arrow(data, uid="events", timestamps="ts")
     .key_by("key")
     .window(TumblingEventTimeWindows.of(10.0, lambda r: r["ts"]))
     .count(uid="win")
     .sink(FileSink(tmp_path / "out"), uid="windows"))
    sim_run(p, tmp_path / "chk", seed=3)
    want = collections.Counter()
    for i in range(n):
        start = math.floor(i * 0.3 / 10.0) * 10.0
        want[(f"k{i % 3}", start)] += 1
    got = {(k, s): c for k, s, _e, c in committed_output(tmp_path / "out")}
    assert got == dict(want)


def test_columnar_records_in_a_loop_go_round_as_rows(tmp_path):
    """A columnar source feeding a loop: the loop head logs rows (what the tail turns batches
    into), and every record leaves the loop once."""
    p = make_pipeline("loop", parallelism=2)
    loop = p.from_arrow(pa.table({"v": list(range(50))}), uid="src").iterate(uid="it")
    body = loop.map_batches(lambda b: b.set_column(0, "v", pc.subtract(b.column("v"), 7)))
    loop.close_with(body.filter(lambda r: r["v"] >= 0))
    body.filter(lambda r: r["v"] < 0).sink(FileSink(tmp_path / "out"), uid="out")
    sim_run(p, tmp_path / "chk", seed=4)
    got = sorted(r["v"] for r in committed_output(tmp_path / "out"))
    assert got == sorted(v - 7 * (v // 7 + 1) for v in range(50))


def test_map_columns_reach_row_operators_as_dicts(tmp_path):
    """A map column of a columnar source reaches a row function as a dict (as Spark and pandas
    give it), not as Arrow's list of key-value pairs."""
    tags = pa.array([[("a", i), ("b", -i)] for i in range(20)], pa.map_(pa.string(), pa.int64()))
    data = pa.table({"id": list(range(20)), "tags": tags})
    p = make_pipeline("maps", parallelism=2)
    (p.from_arrow(data, uid="src")
     .map(lambda r: {"id": r["id"], "a": r["tags"]["a"], "kind": type(r["tags"]).__name__})
     .sink(FileSink(tmp_path / "out"), uid="out"))
    sim_run(p, tmp_path / "chk", seed=5)
    got = sorted((r["id"], r["a"], r["kind"]) for r in committed_output(tmp_path / "out"))
    assert got == [(i, i, "dict") for i in range(20)]


@pytest.mark.parametrize("where", ["map_batches", "process_batches"])
def test_a_columnar_function_returning_something_else_names_the_operator(tmp_path, where):
    p = make_pipeline("bad-return", parallelism=1, restart_attempts=0)
    s = p.from_arrow(arrow_input(20, 2), uid="src")
    if where == "map_batches":
        s = s.map_batches(lambda b: b.to_pylist(), name="to-list")
    else:
        s = s.key_by("key").process_batches(lambda k, b, ctx: [k], uid="to-list")
    s.sink(FileSink(tmp_path / "out"), uid="out")
    with pytest.raises(JobFailedError, match=rf"{where} 'to-list' must return a pyarrow RecordBatch or Table"):
        sim_run(p, tmp_path / "chk", seed=1)


def test_columnar_batches_cross_the_wire_as_arrow_ipc():
    """deploy.worker: a data envelope's columnar batches travel as Arrow IPC frames (a slice
    only with its own rows), row batches and markers as they are."""
    import pickle

    from epochstream.deploy.worker import ArrowFrame, to_wire
    from epochstream.runtime.messages import Batch, Marker

    whole = _batch(1000)
    part = whole.slice(10, 5)
    rows = Batch(3, [("k", 1)], ["k"], 7, 0)
    envelope = [(0, Batch(3, part, None, 9, 2)), (1, rows), (0, Marker(3))]
    wire = pickle.loads(pickle.dumps(to_wire(envelope)))
    assert type(wire[0][1]) is ArrowFrame and wire[1][1] == rows and wire[2][1] == Marker(3)
    back = wire[0][1].batch()
    assert (back.epoch, back.id, back.time, back.keys) == (3, 9, 2, None)
    assert back.records.equals(part)
    assert len(pickle.dumps(wire[0][1])) < len(pickle.dumps(part)) / 10  # a pickled slice ships its parent
    assert to_wire([(1, rows)]) == [(1, rows)]


# ---------------------------------------------------------------- Parquet, and columnar rate / DataFrame records


def _write_parquet(folder: Path, n: int, files: int = 2, row_group: int = 40) -> None:
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    table = arrow_input(n, 7)
    step = math.ceil(n / files)
    for f in range(files):
        pq.write_table(table.slice(f * step, step), folder / f"part-{f}.parquet", row_group_size=row_group)


def test_parquet_row_groups_are_the_splits(tmp_path):
    from epochstream.deploy.sources import ParquetSource

    _write_parquet(tmp_path / "in", 150)
    src = ParquetSource(tmp_path / "in")
    assert [src.split_length(s) for s in range(src.num_splits)] == [40, 35, 40, 35]  # 75 rows per file
    ids = [i for s in range(src.num_splits) for i in src.read(s, 0, 100).column("id").to_pylist()]
    assert ids == list(range(150))
    assert src.read(3, 30, 100).column("id").to_pylist() == list(range(145, 150))
    assert ParquetSource(tmp_path / "in", columns=["id"]).read(0, 0, 2).schema.names == ["id"]
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": ["x"], "id": [1.5]}), tmp_path / "in" / "part-9.parquet")
    with pytest.raises(SchemaError, match=r"part-9.parquet: column 'id' is double"):
        ParquetSource(tmp_path / "in")
    with pytest.raises(SchemaError, match=r"no column 'nope'"):
        Pipeline("x").from_parquet(tmp_path / "in" / "part-0.parquet", uid="pq").key_by("nope")


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_from_parquet_exactly_once_under_failures(tmp_path, mode):
    _write_parquet(tmp_path / "in", 300, files=3, row_group=25)

    def build(**knobs):
        p = make_pipeline("parquet", parallelism=3, mode=mode, batch_size=16)
        (p.from_parquet(tmp_path / "in", uid="src")
         .key_by("key")
         .process_batches(BatchRunningCount(), uid="count")
         .sink(FileSink(tmp_path / "placeholder"), uid="counts"))
        return p

    def run(p, chk, failing):
        failures = FailureSchedule(kill_times=[0.002, 0.006], write_failures={4}) if failing else None
        return sim_run(p, chk, seed=6, failures=failures)

    with without_fsync():
        report = check_exactly_once(build, run, tmp_path / "work")
    assert report.ok and report.restarts >= 1 and report.epochs_checked >= 2, report.to_json()
    assert report.records_committed == report.records_expected == 300


def test_rate_source_in_arrow_records_equals_its_dict_records():
    from epochstream.deploy.sources import RateSource

    rows = RateSource(1000.0, 3, count=50, start=0.0)
    cols = RateSource(1000.0, 3, count=50, start=0.0, records="arrow")
    for split in range(3):
        assert cols.read(split, 2, 9).to_pylist() == rows.read(split, 2, 9)


def test_dataframe_snapshot_read_as_arrow_records(tmp_path):
    """DataFrameSource(records="arrow") slices its split files into Arrow batches (the Spark
    job that writes them is covered by the Spark suites; here the files are written directly)."""
    import pyarrow.parquet as pq

    from epochstream.deploy.sources import DataFrameSource

    pq.write_table(arrow_input(30, 3), tmp_path / "split-00000.parquet")
    src = object.__new__(DataFrameSource)
    src.__dict__.update(path=tmp_path, records="arrow", _lengths=[30], num_splits=1, columns=["key", "id"],
                        _tables={})
    assert src.read(0, 5, 4).to_pylist() == arrow_input(30, 3).slice(5, 4).to_pylist()
    assert src.read(0, 30, 4) == []
    assert [r["id"] for r in src.records_before({0: 3})] == [0, 1, 2]
