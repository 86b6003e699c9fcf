"""The transactional FileSink (backends/sinks.py): stage, commit, abort, recover."""

from __future__ import annotations

import pytest

from epochstream.backends.sinks import STAGING, FileSink


@pytest.fixture
def sink(tmp_path):
    return FileSink(tmp_path / "out")


def staged_files(sink: FileSink) -> set[str]:
    root = sink.path / STAGING
    if not root.is_dir():
        return set()
    return {p.relative_to(sink.path).as_posix() for p in root.rglob("*") if p.is_file()}


def test_pre_commit_stages_invisibly(sink):
    rel = sink.pre_commit("out", 0, 1, "0", [{"a": 1}, [2, "x"], "s"])
    assert rel == f"{STAGING}/out/e1-s0-a0.jsonl"
    assert (sink.path / rel).read_text().splitlines() == ['{"a":1}', '[2,"x"]', '"s"']
    assert sink.read() == []
    assert sink.committed_files() == []
    assert staged_files(sink) == {rel}  # durable, and no temp file left


def test_commit_makes_output_visible(sink):
    rel = sink.pre_commit("out", 0, 1, "0", [1, 2, 3])
    assert sink.commit([rel]) == 1
    assert sink.read() == [1, 2, 3]
    assert [p.name for p in sink.committed_files()] == ["part-e00000001-out-s0.jsonl"]
    assert staged_files(sink) == set()


def test_commit_twice_is_a_no_op(sink):
    rels = [sink.pre_commit("out", s, 1, "0", [s, s + 10]) for s in (0, 1)]
    assert sink.commit(rels) == 2
    before = sink.read()
    files_before = {p.name: p.read_bytes() for p in sink.committed_files()}
    assert sink.commit(rels) == 0  # re-issued after a crash between manifest and commit
    assert sink.read() == before == [0, 10, 1, 11]
    assert {p.name: p.read_bytes() for p in sink.committed_files()} == files_before


def test_commit_of_a_partially_committed_epoch_finishes_it(sink):
    a = sink.pre_commit("out", 0, 3, "0", ["a"])
    b = sink.pre_commit("out", 1, 3, "0", ["b"])
    sink.commit([a])  # crash in the middle of the commit
    assert sink.commit([a, b]) == 1
    assert sink.read() == ["a", "b"]


def test_read_returns_epochs_in_order(sink):
    for epoch in (10, 2, 1):
        sink.commit([sink.pre_commit("out", 0, epoch, "0", [epoch])])
    assert sink.read() == [1, 2, 10]


def test_empty_record_list_stages_nothing(sink):
    assert sink.pre_commit("out", 0, 1, "0", []) is None
    assert staged_files(sink) == set()
    assert sink.commit([]) == 0
    assert sink.read() == []


def test_commit_of_vanished_never_committed_file_raises_clearly(sink):
    rel = sink.pre_commit("out", 0, 1, "0", [1])
    (sink.path / rel).unlink()
    with pytest.raises(FileNotFoundError) as ei:
        sink.commit([rel])
    msg = str(ei.value)
    assert rel in msg and "never committed" in msg and str(sink.path) in msg


def test_commit_of_a_path_that_is_not_a_staged_file_raises(sink):
    with pytest.raises(ValueError, match="not a staged file"):
        sink.commit(["somewhere/else.txt"])


def test_abort_drops_staged_output(sink):
    rel = sink.pre_commit("out", 0, 1, "0", [1])
    sink.abort([rel])
    sink.abort([rel])  # idempotent
    assert staged_files(sink) == set()
    assert sink.read() == []


def test_recover_commits_listed_files_and_drops_other_staged_files_of_that_uid(sink):
    e1 = sink.pre_commit("out", 0, 1, "0", ["e1"])
    e2 = sink.pre_commit("out", 0, 2, "0", ["e2"])  # epoch 2 never completed
    e2_retry = sink.pre_commit("out", 0, 2, "1", ["e2-retry"])
    other = sink.pre_commit("audit", 0, 2, "0", ["other uid"])
    sink.recover("out", [e1])
    assert sink.read() == ["e1"]
    assert staged_files(sink) == {other}  # another uid's staged output is not ours to drop
    # the other uid recovers on its own
    sink.recover("audit", [])
    assert staged_files(sink) == set()
    assert sink.read() == ["e1"]
    assert not (sink.path / e2).exists() and not (sink.path / e2_retry).exists()


def test_recover_after_the_commit_already_happened_is_a_no_op(sink):
    e1 = sink.pre_commit("out", 0, 1, "0", ["e1"])
    sink.commit([e1])
    sink.recover("out", [e1])
    sink.recover("out", [e1])
    assert sink.read() == ["e1"]


def test_recover_drops_leftover_temp_files(sink):
    sink.pre_commit("out", 0, 1, "0", ["x"])
    tmp = sink.path / STAGING / "out" / ".e2-s0-a0.jsonl.tmp-99"
    tmp.write_text("half a reco")
    sink.recover("out", [])
    assert staged_files(sink) == set()


def test_recover_with_nothing_staged(sink):
    sink.recover("out", [])
    assert sink.read() == []


def test_custom_encoder_and_decoder(tmp_path):
    s = FileSink(tmp_path / "csv", encoder=lambda r: f"{r[0]},{r[1]}",
                 decoder=lambda line: tuple(line.strip().split(",")))
    s.commit([s.pre_commit("out", 0, 1, "0", [("a", 1), ("b", 2)])])
    assert s.read() == [("a", "1"), ("b", "2")]


def test_default_encoder_keeps_non_json_values_readable(sink):
    sink.commit([sink.pre_commit("out", 0, 1, "0", [{1, 2}, ("t", 1)])])
    assert sink.read() == ["{1, 2}", ["t", 1]]


def test_sink_uids_that_differ_only_in_unsafe_characters_do_not_share_files(sink):
    a = sink.pre_commit("out 1", 0, 1, "0", ["from out 1"])
    b = sink.pre_commit("out_1", 0, 1, "0", ["from out_1"])
    sink.recover("out 1", [a])
    assert (sink.path / b).exists(), "recover of one uid deleted another uid's staged output"
    sink.commit([b])
    assert sorted(sink.read()) == ["from out 1", "from out_1"]


def test_read_orders_subtasks_numerically(sink):
    for subtask in (2, 10):
        sink.commit([sink.pre_commit("out", subtask, 1, "0", [f"s{subtask}"])])
    assert sink.read() == ["s2", "s10"]


# ---------------------------------------------------------------- both formats (JSON lines and Parquet)

ROWS = [{"k": "a", "n": 1}, {"k": "b", "n": 2}]


@pytest.fixture(params=["jsonl", "parquet"])
def any_sink(request, tmp_path):
    return FileSink(tmp_path / "out", format=request.param)


def test_two_phase_commit_in_both_formats(any_sink):
    rel = any_sink.pre_commit("out", 0, 1, "0", ROWS)
    assert rel == f"{STAGING}/out/e1-s0-a0.{any_sink.format}"
    assert any_sink.read() == [] and staged_files(any_sink) == {rel}
    assert any_sink.commit([rel]) == 1
    assert any_sink.commit([rel]) == 0  # re-issued: nothing added
    assert any_sink.read() == ROWS
    assert [p.name for p in any_sink.committed_files()] == [f"part-e00000001-out-s0.{any_sink.format}"]
    assert staged_files(any_sink) == set()


def test_recover_in_both_formats(any_sink):
    e1 = any_sink.pre_commit("out", 0, 1, "0", ROWS[:1])
    any_sink.pre_commit("out", 0, 2, "0", ROWS[1:])  # epoch 2 never completed
    any_sink.recover("out", [e1])
    any_sink.recover("out", [e1])
    assert any_sink.read() == ROWS[:1] and staged_files(any_sink) == set()


def test_writer_output_stages_in_both_formats(any_sink):
    import pyarrow as pa

    w = any_sink.writer()
    w.write(ROWS[:1])
    if hasattr(w, "write_batch"):
        w.write_batch(pa.RecordBatch.from_pylist(ROWS[1:]))
    else:
        w.write(ROWS[1:])
    any_sink.commit([any_sink.pre_commit("out", 0, 1, "0", w.take())])
    assert any_sink.read() == ROWS
    assert any_sink.pre_commit("out", 0, 2, "0", w.take()) is None  # take emptied the writer


# ---------------------------------------------------------------- Parquet


def test_parquet_output_is_a_dataset_folder_pandas_and_pyarrow_read(tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.dataset as ds

    sink = FileSink(tmp_path / "out", format="parquet")
    for epoch in (1, 2):
        for s in (0, 1):
            w = sink.writer()
            w.write_batch(pa.record_batch({"k": [f"e{epoch}s{s}"] * 3, "n": [1, 2, 3]}))
            sink.commit([sink.pre_commit("out", s, epoch, "0", w.take())])
    sink.pre_commit("out", 0, 3, "0", [{"k": "staged", "n": 9}])  # staged, not committed: invisible
    table = ds.dataset(sink.path, format="parquet").to_table()
    assert table.num_rows == 12 and set(table.column("k").to_pylist()) == {"e1s0", "e1s1", "e2s0", "e2s1"}
    frame = pd.read_parquet(sink.path)
    assert len(frame) == 12 and "staged" not in set(frame["k"])


def test_parquet_records_become_columns(tmp_path):
    sink = FileSink(tmp_path / "t", format="parquet")
    sink.commit([sink.pre_commit("out", 0, 1, "0", [("a", 1), ("b", 2)])])
    assert sink.read() == [{"_1": "a", "_2": 1}, {"_1": "b", "_2": 2}]  # Spark's names for tuple fields
    named = FileSink(tmp_path / "n", format="parquet", schema=[("k", "string"), ("n", "int64")])
    named.commit([named.pre_commit("out", 0, 1, "0", [("a", 1), {"k": "b", "n": 2}])])
    assert named.read() == [{"k": "a", "n": 1}, {"k": "b", "n": 2}]
    atoms = FileSink(tmp_path / "v", format="parquet")
    atoms.commit([atoms.pre_commit("out", 0, 1, "0", [1, 2])])
    assert atoms.read() == [{"value": 1}, {"value": 2}]
    # the oracle's comparison: a written record and the row read back encode alike
    assert [sink.encoder(r) for r in [("a", 1), ("b", 2)]] == sink.read_lines(sink.committed_files()[0])


def test_parquet_sink_bad_input_names_the_sink_and_column(tmp_path):
    import pyarrow as pa

    from epochstream.runtime.errors import ConfigurationError, SchemaError

    with pytest.raises(ConfigurationError, match="format 'csv'"):
        FileSink(tmp_path / "x", format="csv")
    sink = FileSink(tmp_path / "x", format="parquet", schema=[("k", "string"), ("n", "int64")])
    w = sink.writer()
    with pytest.raises(SchemaError, match=r"no column 'n'"):
        w.write_batch(pa.record_batch({"k": ["a"]}))
    with pytest.raises(SchemaError, match=r"column 'n' of type string"):
        w.write_batch(pa.record_batch({"k": ["a"], "n": ["not a number"]}))
    with pytest.raises(SchemaError, match="has 3 fields"):
        w.write([("a", 1, 2)])
    mixed = FileSink(tmp_path / "m", format="parquet").writer()
    mixed.write([{"k": "a"}])
    mixed.write([{"k": 1}])
    with pytest.raises(SchemaError, match="pass schema="):
        mixed.take()


def test_parquet_sink_takes_columnar_batches_whole(tmp_path):
    """A columnar pipeline hands its RecordBatches to a Parquet sink's writer as they are: no rows."""
    import pyarrow as pa

    from epochstream import Pipeline
    from pipelines import sim_run

    taken: list[int] = []

    class SpyWriter:
        def __init__(self, inner):
            self.inner = inner

        def write_batch(self, batch):
            assert isinstance(batch, pa.RecordBatch)
            taken.append(batch.num_rows)
            self.inner.write_batch(batch)

        def write(self, records):
            raise AssertionError(f"rows reached the Parquet writer: {records[:2]}")

        def take(self):
            return self.inner.take()

    class Spy(FileSink):
        def writer(self):
            return SpyWriter(super().writer())

    p = Pipeline("parquet-columns", parallelism=2, batch_size=16)
    table = pa.table({"key": [f"k{i % 5}" for i in range(300)], "id": list(range(300))})
    p.from_arrow(table, uid="src").map_batches(lambda b: b).sink(Spy(tmp_path / "out", format="parquet"),
                                                                 uid="out")
    sim_run(p, tmp_path / "chk", seed=3)
    assert sum(taken) == 300
    got = FileSink(tmp_path / "out", format="parquet").read()
    assert sorted(r["id"] for r in got) == list(range(300))


class _JsonArraySink:
    """A sink written as docs/API.md's "Writing a sink" says: any object with the verbs, no base
    class and no ``commits_in_subtasks`` (the job master commits it)."""

    def __init__(self, path):
        self.path = path

    def pre_commit(self, uid, subtask, epoch, attempt, records):
        import json

        if not records:
            return None
        staged = self.path / "staged" / f"{uid}-e{epoch}-s{subtask}-a{attempt}.json"
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(json.dumps(records))
        return staged.name

    def commit(self, staged):
        for name in staged:
            src = self.path / "staged" / name
            if src.exists():
                src.replace(self.path / name)

    def recover(self, uid, staged):
        self.commit(staged)
        for leftover in (self.path / "staged").glob(f"{uid}-*") if (self.path / "staged").is_dir() else []:
            leftover.unlink()

    def abort(self, staged):
        for name in staged:
            (self.path / "staged" / name).unlink(missing_ok=True)

    def read(self):
        import json

        return [r for f in sorted(self.path.glob("*.json")) for r in json.loads(f.read_text())]


@pytest.mark.parametrize("deployment", ["sim", "local"])
def test_a_sink_without_the_base_class_commits_exactly_once_under_a_kill(tmp_path, deployment):
    from epochstream.deploy.failures import FailureSchedule
    from pipelines import PacedSource, RunningCount, _key, check_running_counts, input_records, make_pipeline, sim_run

    out = _JsonArraySink(tmp_path / "out")
    records = input_records(300, 5)
    if deployment == "sim":  # virtual time: the run lasts about 0.012 s
        p = make_pipeline("duck-sink")
        p.from_collection(records, uid="src").key_by(_key).process(RunningCount(emit_ids=True), uid="count") \
            .sink(out, uid="out")
        res = sim_run(p, tmp_path / "chk", failures=FailureSchedule(kill_times=[0.006]))
    else:  # paced, so the run lasts long enough for the kill on any machine
        p = make_pipeline("duck-sink", interval=0.05)
        p.from_source(PacedSource(records, 2, pause=0.02), uid="src").key_by(_key).process(
            RunningCount(emit_ids=True), uid="count").sink(out, uid="out")
        res = p.run("local", checkpoint_dir=tmp_path / "chk",
                    failures=FailureSchedule(kill_times=[0.3], kill_moments=["snapshot_write"]))
    assert res.restarts >= 1
    assert check_running_counts(out.read(), range(300)) == []
