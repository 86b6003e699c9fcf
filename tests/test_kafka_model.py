"""The simulator's model of Kafka (``backends.kafka.model``): the model's transactions, then
Kafka pipelines on ``deployment="sim"`` (``memory://`` clusters): the sink's commit protocol
with a failure injected at each step, in both modes, and the exactly-once oracle over a
Kafka source under random failures (aligned, tracker, unaligned).

The model is only the simulator's; every exactly-once claim about real Kafka is tested on a
real broker (tests/test_kafka.py)."""

from __future__ import annotations

import itertools
import json
import random
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from epochstream import FileSink, KafkaSink, Pipeline
from epochstream.backends.kafka.chaos import check_kafka_exactly_once
from epochstream.backends.kafka.model import ModelKafkaSink, ModelKafkaSource, model_cluster
from epochstream.deploy.failures import FailureSchedule, InjectedFailure
from epochstream.oracle import check_exactly_once
from epochstream.runtime.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).parent))
from pipelines import SOURCE_RATE, RunningCount, check_running_counts, make_pipeline, sim_run  # noqa: E402

N = 400
KEYS = 7
_names = itertools.count()


def _cluster_with_input(n: int = N, partitions: int = 3):
    """A fresh model cluster with topic ``in`` (n records keyed k0..k6, values the ids; some
    aborted transactions among them, which a read-committed source must skip) and ``out``."""
    name = f"memory://test-{next(_names)}"
    c = model_cluster(name)
    c.create_topic("in", partitions)
    c.create_topic("out", 2)
    for i in range(n):
        c.produce("in", str(i).encode(), key=f"k{i % KEYS}".encode(), partition=i % partitions)
        if i % 50 == 25:  # an aborted write in the middle of the input
            c.begin("junk")
            c.produce("in", b"-1", key=b"junk", partition=i % partitions, transactional_id="junk")
            c.abort("junk")
    return name, c


def _as_pair(r):
    return r["key"].decode(), int(r["value"])


# ---------------------------------------------------------------- the model


def test_read_committed_skips_aborted_records_and_stops_at_an_open_transaction():
    c = model_cluster(f"memory://test-{next(_names)}")
    c.create_topic("t", 1)
    c.produce("t", b"a")
    c.begin("x")
    c.produce("t", b"aborted", transactional_id="x")
    c.abort("x")  # offsets 1 (record) and 2 (marker)
    c.begin("y")
    c.produce("t", b"open", transactional_id="y")
    c.produce("t", b"after", partition=0)  # non-transactional, but behind the open transaction
    assert [e.value for _o, e in c.fetch("t", 0, 0, 10)[0]] == [b"a"]
    assert c.fetch("t", 0, 0, 10)[1] == 3  # up to the last stable offset, past the aborted record and marker
    assert [m["value"] for m in c.read("t", "read_uncommitted")] == [b"a", b"aborted", b"open", b"after"]
    c.init_transactions("y")  # a new producer for "y": the open transaction is aborted
    assert [m["value"] for m in c.read("t")] == [b"a", b"after"]
    assert c.open_transactions() == []


def test_offsets_sent_to_a_transaction_commit_with_it_and_only_then():
    c = model_cluster(f"memory://test-{next(_names)}")
    c.create_topic("t", 1)
    c.begin("tid")
    c.produce("t", b"r", transactional_id="tid")
    c.send_offsets("tid", "g", {("t", 0): 7})
    assert c.committed_offset("g", "t", 0) == -1
    c.abort("tid")
    assert c.committed_offset("g", "t", 0) == -1
    c.begin("tid")
    c.send_offsets("tid", "g", {("t", 0): 8})
    c.commit("tid")
    assert c.committed_offset("g", "t", 0) == 8


def test_from_kafka_and_kafka_sink_pick_the_model_and_other_drivers_refuse_it(tmp_path):
    name, _c = _cluster_with_input(10, 2)
    p = Pipeline("model", parallelism=1)
    s = p.from_kafka(name, "in", end="latest", uid="src")
    sink = KafkaSink(name, "out", staging=tmp_path / "staging")
    s.sink(sink, uid="out")
    assert isinstance(p.sources["src"], ModelKafkaSource) and isinstance(sink, ModelKafkaSink)
    assert p.sources["src"].partitions == [("in", 0), ("in", 1)]
    with pytest.raises(ConfigurationError, match="only the simulator"):
        p.run("local", checkpoint_dir=tmp_path / "chk")
    with pytest.raises(Exception, match="does not exist"):
        Pipeline("x").from_kafka(name, "missing")


# ---------------------------------------------------------------- the sink's commit protocol, in the simulator


class _CrashInTransaction:
    """Raise once between producing an epoch into a subtask's transaction and committing it (a
    worker dying after the manifest, before its sink's commit)."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, step: str) -> None:
        if step == "committing" and not self.done:
            self.done = True
            raise InjectedFailure("a sink subtask crashed inside Kafka's transaction")


FAILURES = {
    "worker-killed": FailureSchedule(kill_times=[0.004]),
    "after-manifest": FailureSchedule(fail_points={"after_manifest": {2}}),
    "in-kafka-transaction": None,
    "after-kafka-commit": FailureSchedule(fail_points={"after_commit": {2}}),
}


def _count_job(name: str, mode: str, staging: Path, emit_ids: bool = True) -> tuple[Pipeline, KafkaSink]:
    p = make_pipeline("model-count", mode=mode, interval=0.001, batch_size=16)
    sink = KafkaSink(name, "out", key=lambda r: r[0], staging=staging)
    (p.from_kafka(name, "in", end="latest", uid="src")
     .map(_as_pair)
     .key_by(lambda r: r[0])
     .process(RunningCount(emit_ids=emit_ids), uid="count")
     .sink(sink, uid="out"))
    return p, sink


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_model_sink_is_exactly_once_with_a_failure_at_each_commit_step(mode, failure, tmp_path):
    name, c = _cluster_with_input()
    p, sink = _count_job(name, mode, tmp_path / "staging")
    hook = None
    if failure == "in-kafka-transaction":
        hook = sink.fail_hook = _CrashInTransaction()
    res = sim_run(p, tmp_path / "chk", seed=1, failures=FAILURES[failure])
    assert res.restarts >= 1, f"the failure {failure} was not injected"
    got = [json.loads(m["value"]) for m in c.read("out")]
    assert check_running_counts(got, range(N)) == []
    raw = c.read("out", "read_uncommitted")
    if failure == "in-kafka-transaction":
        assert hook is not None and hook.done
        assert len(raw) > len(got), "the crash inside the transaction left no aborted records"
    assert c.open_transactions() == []  # nothing lingers to hold read_committed consumers back
    # each subtask's marker is the newest epoch Kafka committed for it, and one of them the last with output
    markers = [c.committed_offset(sink.marker_group("out", s), "out", 0) for s in range(2)]
    last_output = max(int(k) for k in _epochs_with_output(tmp_path / "chk"))
    assert max(markers) == last_output and all(0 < m <= max(res.completed_epochs) for m in markers)


def _epochs_with_output(chk: Path) -> set[int]:
    """Epochs whose manifest staged sink output (the last manifest retained names the latest)."""
    from epochstream.backends.kafka.transactions import staged_epoch_subtask

    out = set()
    for m in sorted(chk.glob("chk-*/_metadata.json")):
        for rel in json.loads(m.read_text())["sinks"]["out"]["staged"]:
            out.add(staged_epoch_subtask(rel)[0])
    return out


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_kafka_chaos_check_runs_a_model_job_in_the_simulator(mode, tmp_path):
    """``epochstream chaos``'s Kafka check (both runs into fresh topics, compared read
    committed) on a ``memory://`` job in the simulator, with a crash inside a transaction."""
    name, _c = _cluster_with_input()
    hooks: list[_CrashInTransaction] = []

    def build():
        # (key, n) without ids: the multiset of outputs does not depend on the interleaving
        p, sink = _count_job(name, mode, tmp_path / "staging", emit_ids=False)
        hooks.append(_CrashInTransaction())
        sink.fail_hook = hooks[-1]
        return p

    def run(p, chk, failing):
        if not failing:
            hooks[-1].done = True  # the reference run fails nowhere
        return sim_run(p, chk, seed=2, failures=FailureSchedule(kill_times=[0.004]) if failing else None)

    report = check_kafka_exactly_once(build, run, tmp_path / "work")
    assert report.ok, report.to_json()
    assert report.records_committed == report.records_expected == N
    assert report.aborted_visible > 0  # the crashed transaction's records, aborted


# ---------------------------------------------------------------- the oracle over a Kafka source


def _kafka_count(name: str, *, out=None, mode: str = "aligned", parallelism: int = 2,
                 records: str = "arrow") -> Pipeline:
    p = make_pipeline("model-oracle", mode=mode, parallelism=parallelism, interval=0.001, batch_size=8)
    sink = FileSink(out / "counts") if out is not None else FileSink(Path("/nonexistent-relocate-me") / "counts")
    (p.from_kafka(name, "in", end="latest", uid="src", records=records)
     .map(_as_pair)
     .key_by(lambda r: r[0])
     .process(RunningCount(), uid="count")
     .sink(sink, uid="counts"))
    return p


@pytest.mark.parametrize("records", ["arrow", "dict"])
@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_over_a_kafka_source_under_random_failures(mode, seed, records, tmp_path):
    """Kafka offsets (with gaps from aborted writes and their markers) in every manifest: each
    epoch's committed state equals the sequential reference over the records before them, with
    the records read as Arrow batches or as dicts."""
    name, _c = _cluster_with_input()
    rng = random.Random(seed)
    parallelism = 1 + seed
    schedule = FailureSchedule.random(rng, 3, N / (parallelism * SOURCE_RATE))

    def run(p, chk, failing):
        return sim_run(p, chk, seed=seed, failures=schedule if failing else None)

    report = check_exactly_once(partial(_kafka_count, name, mode=mode, parallelism=parallelism, records=records), run,
                                tmp_path)
    assert report.ok, report.to_json()
    assert report.epochs_checked >= 2 and report.records_committed == report.records_expected > 0


# ---------------------------------------------------------------- Arrow batches and from_json


def test_arrow_records_hold_the_dict_records_values():
    """``records="arrow"`` (the default without deserializers): one RecordBatch per read, the
    same keys, values, offsets (gaps from aborted writes and markers), timestamps and headers as
    the dict records; ``read_range`` cuts by Kafka offset."""
    import pyarrow as pa

    from epochstream.backends.kafka.records import kafka_schema, rows_of

    name, c = _cluster_with_input(130, 3)  # an aborted write on every partition
    c.produce("in", b"with-headers", key=b"h", partition=0, headers=[("trace", b"t1"), ("empty", None)])
    arrow = ModelKafkaSource(name, "in", end="latest")
    rows = ModelKafkaSource(name, "in", end="latest", records="dict")
    assert arrow.records == "arrow" and rows.records == "dict"
    assert ModelKafkaSource(name, "in", value_deserializer=int).records == "dict"
    with pytest.raises(ValueError, match="need records='dict'"):
        ModelKafkaSource(name, "in", value_deserializer=int, records="arrow")
    for split in (0, 1, 2):
        batch, after = arrow.read_next(split, 0, 1000)
        dicts, after_rows = rows.read_next(split, 0, 1000)
        assert isinstance(batch, pa.RecordBatch) and batch.schema == kafka_schema()
        assert after == after_rows == arrow.split_length(split)
        got = rows_of(batch)
        for g, d in zip(got, dicts, strict=True):
            assert {k: g[k] for k in d if k != "headers"} == {k: d[k] for k in d if k != "headers"}
            assert g["headers"] == ([{"key": k, "value": v} for k, v in d["headers"]] or None)
        offsets = batch.column("offset").to_pylist()
        assert offsets != list(range(len(offsets)))  # aborted writes and their markers left gaps
        part = arrow.read_range(split, offsets[3], offsets[7])
        assert part.column("offset").to_pylist() == offsets[3:7]
    assert rows_of(arrow.read_next(0, 0, 1000)[0])[-1]["headers"] == [{"key": "trace", "value": b"t1"},
                                                                       {"key": "empty", "value": None}]
    assert len(arrow.records_before({0: 10, 1: 5})) == len(rows.records_before({0: 10, 1: 5}))


def _json_input(n: int = N, partitions: int = 3, every: int = 9) -> tuple[str, Any, set[tuple[int, int]]]:
    """A model cluster whose topic ``in`` holds JSON ``{"k", "id"}`` records, every ``every``-th
    one malformed in a rotating way (and aborted writes between); returns the name, the cluster
    and the (partition, offset) of each bad record."""
    name = f"memory://test-{next(_names)}"
    c = model_cluster(name)
    c.create_topic("in", partitions)
    c.create_topic("out", 2)
    kinds = [b'{"k": "x", "id": "not a number"}', b"{broken", b'{"k": "x"}', b"", b"[1]"]
    bad: set[tuple[int, int]] = set()
    for i in range(n):
        part = i % partitions
        if i % every == every - 1:
            value = kinds[(i // every) % len(kinds)]
        else:
            value = json.dumps({"k": f"k{i % KEYS}", "id": i, "noise": [i]}).encode()
        _p, off = c.produce("in", value, key=f"k{i % KEYS}".encode(), partition=part)
        if i % every == every - 1:
            bad.add((part, off))
        if i % 50 == 25:
            c.begin("junk")
            c.produce("in", b"-1", key=b"junk", partition=part, transactional_id="junk")
            c.abort("junk")
    return name, c, bad


def _json_count(name: str, *, out=None, mode: str = "aligned", parallelism: int = 2, emit_ids: bool = False,
                dead=None) -> Pipeline:
    """Kafka (Arrow batches) -> from_json (dead letters to a FileSink) -> key_by("k") ->
    BatchRunningCount [uid "count"] -> FileSink "counts"."""
    from pipelines import BatchRunningCount

    p = make_pipeline("model-json", mode=mode, parallelism=parallelism, interval=0.001, batch_size=8)
    root = out if out is not None else Path("/nonexistent-relocate-me")
    (p.from_kafka(name, "in", end="latest", uid="src")
     .from_json("k string, id long NOT NULL", keep=("partition", "offset"), uid="json",
                dead_letter=dead if dead is not None else FileSink(root / "dead"))
     .map_batches(lambda b: b.rename_columns(["key", "id", "partition", "offset"]))
     .key_by("key")
     .process_batches(BatchRunningCount(emit_ids), uid="count")
     .sink(FileSink(root / "counts"), uid="counts"))
    return p


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_over_kafka_json_with_dead_letters_under_random_failures(mode, seed, tmp_path):
    """Kafka in as Arrow batches -> from_json with malformed records mixed in -> keyed running
    count, under random failures: each epoch's committed counts and dead letters equal the
    sequential reference over its input prefix; the chaos run's dead letters are exactly the
    bad records, each once, with topic, partition and offset."""
    name, _c, bad = _json_input()
    rng = random.Random(seed)
    parallelism = 1 + seed
    schedule = FailureSchedule.random(rng, 3, N / (parallelism * SOURCE_RATE))

    def run(p, chk, failing):
        return sim_run(p, chk, seed=seed, failures=schedule if failing else None)

    report = check_exactly_once(partial(_json_count, name, mode=mode, parallelism=parallelism), run, tmp_path)
    assert report.ok, report.to_json()
    assert report.epochs_checked >= 2 and report.records_committed == report.records_expected > 0
    dead = FileSink(tmp_path / "chaos" / "out" / "json-dead-letters").read()
    assert sorted((d["partition"], d["offset"]) for d in dead) == sorted(bad)
    assert all(d["topic"] == "in" and d["reason"] for d in dead)


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_kafka_json_counts_every_good_record_once_and_counts_dead_letters(mode, tmp_path):
    """The same job with ids in its output and a kill: every good id once, each key's counts
    1..n, every bad record once among the dead letters, and ``dead_letters`` in the metrics."""
    name, _c, bad = _json_input()
    p = _json_count(name, out=tmp_path / "out", mode=mode, emit_ids=True)
    res = sim_run(p, tmp_path / "chk", seed=3, failures=FailureSchedule(kill_times=[0.004]))
    assert res.restarts >= 1
    good_ids = [i for i in range(N) if i % 9 != 8]
    rows = [(r["key"], r["n"], r["id"]) for r in FileSink(tmp_path / "out" / "counts").read()]
    assert check_running_counts(rows, good_ids) == []
    dead = FileSink(tmp_path / "out" / "dead").read()
    assert sorted((d["partition"], d["offset"]) for d in dead) == sorted(bad)
    assert res.metrics["dead_letters"] >= len(bad)  # replays count again


def test_default_dead_letters_are_committed_under_the_checkpoint_dir_with_a_warning(tmp_path, caplog):
    """Without ``dead_letter=`` the dead letters go to JSON lines under
    ``<checkpoint_dir>/dead-letters/<uid>/``, committed with their epochs, and a WARNING names
    the first of each epoch; an OutputTag instead makes them a side output stream."""
    import logging

    from epochstream import OutputTag

    name, _c, bad = _json_input(200)
    p = make_pipeline("model-json-default", interval=0.001, batch_size=8)
    (p.from_kafka(name, "in", end="latest", uid="src").from_json("k string, id long NOT NULL", uid="decode")
     .sink(FileSink(tmp_path / "good"), uid="good"))
    with caplog.at_level(logging.WARNING, logger="epochstream.backends.sinks"):
        res = sim_run(p, tmp_path / "chk")
    dead = FileSink(tmp_path / "chk" / "dead-letters" / "decode").read()
    assert sorted((d["partition"], d["offset"]) for d in dead) == sorted(bad)
    assert res.metrics["dead_letters"] == len(bad)  # no failure: nothing counted twice
    assert len(FileSink(tmp_path / "good").read()) == 200 - len(bad)
    warned = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    assert warned and "topic 'in' partition" in warned[0] and str(tmp_path / "chk" / "dead-letters") in warned[0]
    assert len(warned) <= len(res.completed_epochs) * 2  # the first of each epoch per subtask, not each one

    tag = OutputTag("bad-json")
    p = make_pipeline("model-json-tag", interval=0.001, batch_size=8)
    good = p.from_kafka(name, "in", end="latest", uid="src").from_json("k string, id long NOT NULL",
                                                                        dead_letter=tag)
    good.sink(FileSink(tmp_path / "good2"), uid="good")
    good.get_side_output(tag).map(lambda d: [d["partition"], d["offset"], d["reason"]]).sink(
        FileSink(tmp_path / "dead2"), uid="dead")
    sim_run(p, tmp_path / "chk2")
    assert sorted((d[0], d[1]) for d in FileSink(tmp_path / "dead2").read()) == sorted(bad)
    assert not (tmp_path / "chk2" / "dead-letters").exists()
    with pytest.raises(TypeError, match="dead_letter must be an OutputTag or a sink"):
        p.from_kafka(name, "in", end="latest", uid="src2").from_json("k string", dead_letter="drop")


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_oracle_over_kafka_timestamps_on_arrow_batches(mode, tmp_path):
    """``timestamps="kafka"`` with bounded out-of-orderness on Arrow batches (labelled with
    Arrow) and late records to a side output: event-time windows and the late records committed
    per epoch equal the sequential reference, under failures."""
    from epochstream import OutputTag, TumblingEventTimeWindows

    name = f"memory://test-{next(_names)}"
    c = model_cluster(name)
    c.create_topic("in", 2)
    rng = random.Random(7)
    for i in range(N):
        part = i % 2
        behind = 9000 if i % 11 == 10 else rng.randrange(0, 2500)
        c.produce("in", str(i).encode(), key=f"k{i % KEYS}".encode(), partition=part,
                  timestamp=1_000_000 + i * 120 - behind)

    def build(out=None):
        root = out if out is not None else Path("/nonexistent-relocate-me")
        p = make_pipeline("model-times", mode=mode, interval=0.001, batch_size=8)
        tag = OutputTag("late")
        events = p.from_kafka(name, "in", end="latest", uid="src", timestamps="kafka", max_out_of_orderness=3.0,
                              late_records=tag)
        events.get_side_output(tag).map(lambda r: [r["partition"], r["offset"]]).sink(FileSink(root / "late"),
                                                                                      uid="late")
        (events.map(lambda r: (r["key"].decode(), r["timestamp"] / 1000))
         .key_by(lambda r: r[0])
         .window(TumblingEventTimeWindows.of(10.0, lambda r: r[1])).count(uid="win")
         .sink(FileSink(root / "wins"), uid="wins"))
        return p

    def run(p, chk, failing):
        return sim_run(p, chk, seed=5, failures=FailureSchedule(kill_times=[0.006]) if failing else None)

    report = check_exactly_once(build, run, tmp_path)
    assert report.ok, report.to_json()
    assert report.restarts >= 1 and report.epochs_checked >= 2
    assert FileSink(tmp_path / "chaos" / "out" / "late").read()


def test_arrow_batches_are_encoded_per_column_as_their_rows_would_be():
    """A KafkaSink takes an Arrow batch whole: values as one JSON object per row (encode_json),
    keys and values from named columns, the same bytes the row path makes; a function turns the
    batch into rows first."""
    import pyarrow as pa

    batch = pa.RecordBatch.from_pylist([{"k": "a", "n": 1, "x": 0.5, "s": 'q"\\\n'},
                                        {"k": "b", "n": None, "x": 2.0, "s": "é"}])
    rows = batch.to_pylist()
    name, _c = _cluster_with_input(4)
    for sink in (KafkaSink(name, "out"), KafkaSink(name, "out", key="k"), KafkaSink(name, "out", key="k", value="s"),
                 KafkaSink(name, "out", key=lambda r: r["k"].upper())):
        assert sink.encode_batch(batch) == [sink.encode(r) for r in rows]
    with pytest.raises(Exception, match="no column 'missing'"):
        KafkaSink(name, "out", key="missing").encode_batch(batch)
