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


def _kafka_count(name: str, *, out=None, mode: str = "aligned", parallelism: int = 2) -> Pipeline:
    p = make_pipeline("model-oracle", mode=mode, parallelism=parallelism, interval=0.001, batch_size=8)
    sink = FileSink(out / "counts") if out is not None else FileSink(Path("/nonexistent-relocate-me") / "counts")
    (p.from_kafka(name, "in", end="latest", uid="src")
     .map(_as_pair)
     .key_by(lambda r: r[0])
     .process(RunningCount(), uid="count")
     .sink(sink, uid="counts"))
    return p


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_over_a_kafka_source_under_random_failures(mode, seed, tmp_path):
    """Kafka offsets (with gaps from aborted writes and their markers) in every manifest: each
    epoch's committed state equals the sequential reference over the records before them."""
    name, _c = _cluster_with_input()
    rng = random.Random(seed)
    parallelism = 1 + seed
    schedule = FailureSchedule.random(rng, 3, N / (parallelism * SOURCE_RATE))

    def run(p, chk, failing):
        return sim_run(p, chk, seed=seed, failures=schedule if failing else None)

    report = check_exactly_once(partial(_kafka_count, name, mode=mode, parallelism=parallelism), run, tmp_path)
    assert report.ok, report.to_json()
    assert report.epochs_checked >= 2 and report.records_committed == report.records_expected > 0
