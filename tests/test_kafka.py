"""Kafka in, Kafka out, on a real broker (``kafkaserver.kafka``: KRaft, one per session).

Sources read Arrow batches (``records="arrow"``, the default) unless a test says otherwise.
The source: one split per partition, Kafka offsets in the manifest, bounded by ``end``, group
offsets committed after epochs; bad input (a missing topic, an unreachable broker, a record
the deserializer rejects) is a clear error naming topic, partition and offset.

The exactly-once sink: a failure injected at each step of its commit (a worker killed before
its output is staged, after it is staged; the job master crashing after the manifest, in the
middle of Kafka's transaction, after Kafka's commit), in both modes, and the output topic read
at ``read_committed`` holds every input's result exactly once (``check_running_counts``: each
id once, each key's counts exactly 1..n), checked independently of the sink's own marker.
Where the crash fell inside a Kafka transaction, ``read_uncommitted`` shows the aborted writes.
"""

from __future__ import annotations

import collections
import json
import math
import re
import time
from pathlib import Path

import pytest

from epochstream import KafkaSink, Pipeline
from epochstream.backends.kafka import KafkaSinkError, KafkaSourceError, read_topic
from epochstream.deploy.failures import FailureSchedule, InjectedFailure
from epochstream.runtime.errors import ConfigurationError
from kafkaserver import new_topic, produce
from pipelines import BatchRunningCount, RunningCount, check_running_counts, make_pipeline

pytestmark = pytest.mark.slow

N = 1200
KEYS = 7


def _fill(kafka, n: int = N, partitions: int = 3) -> str:
    topic = new_topic(kafka, "in", partitions)
    produce(kafka, topic, [(f"k{i % KEYS}", str(i)) for i in range(n)])
    return topic


def _as_pair(r):
    return r["key"].decode(), int(r["value"])


def _slow(pair):
    time.sleep(0.0004)  # so a run lasts long enough for kills to land mid-run
    return pair


def _count_job(kafka, src_topic, out_topic, mode="aligned", staging=None, **knobs):
    p = make_pipeline("kafka-count", mode=mode, interval=0.1, batch_size=16, **knobs)
    sink = KafkaSink(kafka.bootstrap_servers, out_topic, key=lambda r: r[0], staging=staging)
    (
        p.from_kafka(kafka.bootstrap_servers, src_topic, end="latest", uid="src")
        .map(_as_pair).map(_slow)
        .key_by(lambda r: r[0])
        .process(RunningCount(emit_ids=True), uid="count")
        .sink(sink, uid="out")
    )
    return p, sink


def _committed(kafka, topic, isolation="read_committed"):
    return [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, topic, isolation)]


# ---------------------------------------------------------------- source


def test_source_reads_every_partition_once_and_commits_group_offsets(kafka, tmp_path):
    from confluent_kafka import Consumer, TopicPartition

    topic = _fill(kafka, 300)
    p = Pipeline("kafka-read", parallelism=2)
    got = []
    from epochstream import FileSink

    (p.from_kafka(kafka.bootstrap_servers, topic, end="latest", uid="src", group_id="g-read")
     .map(lambda r: {k: (v.decode() if isinstance(v, bytes) else v) for k, v in r.items()})
     .sink(FileSink(tmp_path / "out"), uid="out"))
    assert p.sources["src"].records == "arrow"  # the default: batches, made into rows for the map
    res = p.run("local", checkpoint_dir=tmp_path / "chk")
    got = FileSink(tmp_path / "out").read()
    assert sorted(int(r["value"]) for r in got) == list(range(300))
    r0 = got[0]
    assert set(r0) == {"key", "value", "topic", "partition", "offset", "timestamp", "headers"}
    assert r0["topic"] == topic and r0["timestamp"] > 0
    # the manifest holds Kafka offsets per split; the group has them too (after the epoch completed)
    assert res.completed_epochs
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "g-read", "log_level": 3})
    committed = c.committed([TopicPartition(topic, i) for i in range(3)], timeout=10)
    c.close()
    per_partition = {i: sum(1 for r in got if r["partition"] == i) for i in range(3)}
    assert {tp.partition: tp.offset for tp in committed} == per_partition
    # the run closed the clients it opened in this process (its offset committer): none is left
    # reconnecting to a broker that goes away after the job
    src = p.sources["src"]
    assert src._committer is None and src._consumers == {}


def test_source_start_and_end_offsets(kafka):
    from epochstream.backends.kafka import KafkaSource

    topic = _fill(kafka, 30, partitions=1)
    src = KafkaSource(kafka.bootstrap_servers, topic, start={0: 10}, end={0: 20}, records="dict")
    assert (src.start_offset(0), src.split_length(0)) == (10, 20)
    recs, after = [], 10
    while after < 20:
        got, after = src.read_next(0, after, 100)
        recs += got
    assert [int(r["value"]) for r in recs] == list(range(10, 20))
    latest = KafkaSource(kafka.bootstrap_servers, topic, start="latest")
    assert latest.start_offset(0) == 30 and latest.split_length(0) is None
    future = KafkaSource(kafka.bootstrap_servers, topic, start=int(time.time() * 1000) + 3_600_000)
    assert future.start_offset(0) == 30  # nothing that late: the end
    pattern = KafkaSource(kafka.bootstrap_servers, re.compile(re.escape(topic)))
    assert list(pattern.partitions.values()) == [(topic, 0)]
    src.close()


def test_source_bad_input_names_topic_partition_offset(kafka, tmp_path):
    with pytest.raises(KafkaSourceError, match="topic 'no-such-topic' does not exist"):
        Pipeline("x").from_kafka(kafka.bootstrap_servers, "no-such-topic")
    with pytest.raises(KafkaSourceError, match="cannot reach the Kafka cluster"):
        from epochstream.backends.kafka import KafkaSource

        KafkaSource("127.0.0.1:1", "t", timeout=1.0)
    topic = new_topic(kafka, "bad", 1)
    produce(kafka, topic, [("a", "1"), ("b", "oops"), ("c", "3")])
    p = Pipeline("kafka-bad", parallelism=1, restart_attempts=0)
    (p.from_kafka(kafka.bootstrap_servers, topic, end="latest", uid="src", value_deserializer=lambda b: int(b))
     .sink(KafkaSink(kafka.bootstrap_servers, topic), uid="out"))
    with pytest.raises(Exception, match=rf"topic '{topic}' partition 0 offset 1") as info:
        p.run("local", checkpoint_dir=tmp_path / "chk")
    assert "deserializer" in str(info.value)
    assert len(read_topic(kafka.bootstrap_servers, topic)) == 3  # nothing of the failed job was committed


# ---------------------------------------------------------------- sink


def test_sink_encodings_and_at_least_once(kafka, tmp_path):
    out = new_topic(kafka, "alo", 1)
    p = Pipeline("kafka-alo", parallelism=2)
    (p.from_collection([b"raw", "text", {"n": 1}], uid="src")
     .sink(KafkaSink(kafka.bootstrap_servers, out, guarantee="at-least-once",
                     headers=lambda r: [("kind", type(r).__name__.encode())]), uid="out"))
    p.run("local", checkpoint_dir=tmp_path / "chk")
    values = sorted(m["value"] for m in read_topic(kafka.bootstrap_servers, out))
    assert values == sorted([b"raw", b"text", b'{"n":1}'])


def test_sink_rejects_a_broker_transaction_timeout_too_short(kafka, tmp_path):
    out = new_topic(kafka, "tmo", 1)
    sink = KafkaSink(kafka.bootstrap_servers, out, transaction_timeout=4000.0, staging=tmp_path / "st")
    with pytest.raises(ConfigurationError, match=r"transaction.max.timeout.ms is \d+ ms, below"):
        sink.start("out", "job", None)
    with pytest.raises(Exception, match="topic 'missing-out' does not exist"):
        KafkaSink(kafka.bootstrap_servers, "missing-out", staging=tmp_path / "st").start("out", "job", None)


def test_sink_recovery_produces_exactly_the_epochs_kafka_lacks(kafka, tmp_path):
    """The sink's verbs driven by hand. A subtask produces each epoch into its own open
    transaction at pre-commit and commits it when told the manifest exists; a subtask that dies
    in between leaves it open, recovery aborts it (fencing the producer) and produces the
    manifest's epoch again from the staged copy; an epoch Kafka has is not produced again."""
    out = new_topic(kafka, "rec", 1)
    staging = tmp_path / "st"
    sink = KafkaSink(kafka.bootstrap_servers, out, staging=staging)
    sink.start("out", "job", None)
    sink.pre_commit("out", 0, 1, "a", ["e1-r0", "e1-r1"])
    assert read_topic(kafka.bootstrap_servers, out) == []  # produced, not committed: read_committed waits
    sink.commit_subtask("out", 0, 1)
    sink.pre_commit("out", 0, 2, "a", ["e2-r0"])
    sink.pre_commit("out", 1, 2, "a", ["e2-s1"])  # a second subtask, in the same process here

    def crash(step):
        if step == "committing":
            raise InjectedFailure("the subtask dies after the manifest, inside Kafka's transaction")

    sink.fail_hook = crash
    with pytest.raises(InjectedFailure):
        sink.commit_subtask("out", 0, 2)
    sink.fail_hook = None
    sink.commit_subtask("out", 1, 2)  # subtask 1 was told in time
    # subtask 0's open transaction holds read_committed readers back at its first record
    assert [m["value"] for m in read_topic(kafka.bootstrap_servers, out)] == [b"e1-r0", b"e1-r1"]
    sink.pre_commit("out", 1, 3, "a", ["never-in-a-manifest"])  # epoch 3 gets no manifest
    # a new master restores epoch 2: it fences subtask 0's producers and produces its epoch 2 again
    fresh = KafkaSink(kafka.bootstrap_servers, out, staging=staging)
    fresh.start("out", "job", None)
    fresh.recover("out", [], epoch=2, previous=2, parallelism=2)
    for s in range(2):  # the new attempt's subtasks open their producers, fencing the old ones
        fresh.open_subtask("out", s)
    assert fresh.read_marker("out", 0) == 2 and fresh.read_marker("out", 1) == 2
    got = [m["value"] for m in read_topic(kafka.bootstrap_servers, out)]
    assert sorted(got) == [b"e1-r0", b"e1-r1", b"e2-r0", b"e2-s1"]
    uncommitted = [m["value"] for m in read_topic(kafka.bootstrap_servers, out, "read_uncommitted")]
    assert uncommitted.count(b"e2-r0") == 2  # the aborted write is there, and only read_committed hides it
    assert b"never-in-a-manifest" in uncommitted and b"never-in-a-manifest" not in got
    assert not list(fresh.store.keys(fresh.store.root, "_staging/"))  # epoch 3 (no manifest) and the rest are gone
    # the old producers are fenced: a zombie of the old attempt cannot commit its epoch 3
    with pytest.raises(KafkaSinkError, match="fenced"):
        sink.commit_subtask("out", 1, 3)
    assert b"never-in-a-manifest" not in [m["value"] for m in read_topic(kafka.bootstrap_servers, out)]
    # recovering again is idempotent
    fresh.recover("out", [], epoch=2, previous=2, parallelism=2)
    assert len(read_topic(kafka.bootstrap_servers, out)) == 4
    sink.close()


def test_read_topic_waits_out_commit_markers_and_skips_an_open_transaction(kafka):
    """``read_topic`` at read_committed sees every transaction committed before it is called
    (the commit markers land a moment after ``commit_transaction`` returns: once, in session 32,
    it read an empty topic right after a commit), and one left open neither shows nor holds the
    read back for longer than ``READ_GRACE``."""
    from confluent_kafka import Producer

    out = new_topic(kafka, "lso", 1)
    p = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"lso-{out}", "log_level": 3})
    p.init_transactions(30)
    for epoch in range(5):
        p.begin_transaction()
        p.produce(out, f"v{epoch}".encode())
        p.flush(10)  # at the broker before the commit, as when the master's commit flushes a big epoch
        if epoch == 0:
            assert read_topic(kafka.bootstrap_servers, out) == []  # open: held back, not read
        p.commit_transaction(30)
        assert [m["value"] for m in read_topic(kafka.bootstrap_servers, out)] == \
            [f"v{i}".encode() for i in range(epoch + 1)]
    p.begin_transaction()
    p.produce(out, b"open")
    p.flush(10)
    assert len(read_topic(kafka.bootstrap_servers, out)) == 5  # the open transaction is not read
    assert read_topic(kafka.bootstrap_servers, out, "read_uncommitted")[-1]["value"] == b"open"
    p.abort_transaction(30)


# failure points of the commit: (kill moment of a worker | fail point of the master)
FAILURES = {
    "worker-before-staging": FailureSchedule(kill_times=[0.4], kill_moments=["now"]),
    "worker-after-staging": FailureSchedule(kill_times=[0.4], kill_moments=["snapshot_write"]),
    "after-manifest": FailureSchedule(fail_points={"after_manifest": {2}}),
    # the manifest exists and reached the worker; its epoch's transaction is open, not committed
    "in-kafka-transaction": FailureSchedule(kill_times=[0.4], kill_moments=["sink_commit"]),
    "after-master-commit": FailureSchedule(fail_points={"after_commit": {2}}),
}


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_exactly_once_under_failures(kafka, tmp_path, mode, failure):
    src = _fill(kafka)
    out = new_topic(kafka, "out", 2)
    p, sink = _count_job(kafka, src, out, mode=mode, staging=tmp_path / "staging")
    res = p.run("local", checkpoint_dir=tmp_path / "chk", failures=FAILURES[failure])
    assert res.restarts >= 1, f"the failure {failure} was not injected"
    got = _committed(kafka, out)
    assert check_running_counts(got, range(N)) == []
    raw = _committed(kafka, out, "read_uncommitted")
    if failure == "in-kafka-transaction":
        assert [k["moment"] for k in res.metrics["kills"]] == ["sink_commit"], res.metrics["kills"]
        assert len(raw) > len(got), "the crash inside the transaction left no aborted records"
    assert len(raw) >= len(got)
    # the subtasks committed (both markers moved); the job master produced nothing
    assert min(sink.read_marker("out", s) for s in range(2)) > 0


def test_a_rescale_across_the_commit_window_keeps_every_output_once(kafka, tmp_path):
    """A job at parallelism 2 dies right after a manifest (its subtasks never commit that epoch in
    Kafka) and the restart strategy gives up; the job is started again at parallelism 3 from that
    checkpoint. Recovery fences the old subtasks' producers and produces their staged epoch again
    under their own markers, then the rescaled job (a worker killed between a manifest and its
    sink commit, too) finishes the input: every input's result once at read_committed."""
    from epochstream.deploy.failures import JobFailedError

    src = _fill(kafka)
    out = new_topic(kafka, "rescaled", 2)
    staging = tmp_path / "staging"
    p, sink = _count_job(kafka, src, out, staging=staging, restart_attempts=0)
    with pytest.raises(JobFailedError, match="after_manifest"):
        p.run("local", checkpoint_dir=tmp_path / "chk", failures=FailureSchedule(fail_points={"after_manifest": {2}}))
    assert any(staging.rglob("*.msgs")), "the crash left no staged epoch for recovery to produce"
    before = len(_committed(kafka, out))
    p3, sink3 = _count_job(kafka, src, out, staging=staging, parallelism=3)
    res = p3.run("local", checkpoint_dir=tmp_path / "chk", restore="latest",
                 failures=FailureSchedule(kill_times=[0.3], kill_moments=["sink_commit"]))
    assert res.restarts >= 1 and [k["moment"] for k in res.metrics["kills"]] == ["sink_commit"]
    assert check_running_counts(_committed(kafka, out), range(N)) == []
    assert len(_committed(kafka, out)) > before
    assert not any(staging.rglob("*.msgs"))  # every staged epoch is in Kafka now
    del sink, sink3


# ---------------------------------------------------------------- three brokers, one killed


class _HoldUntilKilled:
    """A batch step that, at the first batch holding an id >= ``at``, says so (file ``held``) and
    waits until the test has killed a broker (file ``killed``): the kill is armed by the job's
    progress and lands mid-run, whatever the machine's speed."""

    def __init__(self, folder: Path, at: int):
        self.held, self.killed, self.at = folder / "held", folder / "killed", at

    def __call__(self, batch):
        import pyarrow.compute as pc

        if batch.num_rows and not self.killed.exists() and pc.max(batch.column("id")).as_py() >= self.at:
            self.held.touch()
            deadline = time.monotonic() + 120
            while not self.killed.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the test never killed the broker")
                time.sleep(0.02)
        time.sleep(0.0004 * batch.num_rows)  # so the run goes on for a while after the kill
        return batch


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_when_a_broker_dies(kafka3, tmp_path, mode):
    """Three brokers, topics with replication 3 and min.insync.replicas 2; Kafka JSON (Arrow
    batches) -> ``from_json`` with dead letters -> keyed running count -> Kafka. Once the job
    has read half its input, one broker is SIGKILLed (and started again after the job): the
    output at read_committed still holds every good record's result exactly once, and every
    bad record is once among the dead letters."""
    from test_kafka_arrow import MAX_RECORD_BYTES, SCHEMA, _json_topic

    src, bad, good_ids = _json_topic(kafka3)
    out = new_topic(kafka3, "out", 2)
    dead_topic = new_topic(kafka3, "dead", 1)
    victim = 1 if mode == "aligned" else 2
    gate = _HoldUntilKilled(tmp_path, at=N // 2)
    killed: list[int] = []

    def kill_when_held():
        deadline = time.monotonic() + 120
        while not gate.held.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if gate.held.exists():
            kafka3.kill(victim)
            killed.append(victim)
        gate.killed.touch()

    import threading

    killer = threading.Thread(target=kill_when_held, daemon=True)
    p = make_pipeline("kafka-broker-kill", mode=mode, interval=0.1, batch_size=16)
    (p.from_kafka(kafka3.bootstrap_servers, src, end="latest", uid="src")
     .from_json(SCHEMA, uid="json", max_record_bytes=MAX_RECORD_BYTES,
                dead_letter=KafkaSink(kafka3.bootstrap_servers, dead_topic, staging=tmp_path / "staging-dead"))
     .map_batches(gate)
     .key_by("key")
     .process_batches(BatchRunningCount(emit_ids=True), uid="count")
     .sink(KafkaSink(kafka3.bootstrap_servers, out, key=lambda r: r["key"], staging=tmp_path / "staging"),
           uid="out"))
    killer.start()
    try:
        res = p.run("local", checkpoint_dir=tmp_path / "chk")
    finally:
        gate.killed.touch()
        killer.join()
        for node in killed:
            kafka3.restart(node)
    assert killed, "the job never reached the kill point"
    assert res.completed_epochs
    counts = [json.loads(m["value"]) for m in read_topic(kafka3.bootstrap_servers, out)]
    assert check_running_counts([(r["key"], r["n"], r["id"]) for r in counts], good_ids) == []
    dead = collections.Counter((d["partition"], d["offset"]) for d in (
        json.loads(m["value"]) for m in read_topic(kafka3.bootstrap_servers, dead_topic)))
    assert set(dead) == bad and set(dead.values()) == {1}


# ---------------------------------------------------------------- event time from Kafka timestamps

WINDOW_S = 10.0
MAX_DELAY_S = 3.0


def _produce_out_of_order(kafka, topic: str, partitions: int, per_partition: int, base_ms: int):
    """Records whose Kafka timestamps are out of order within each partition: each up to
    ``MAX_DELAY_S`` behind the partition's pace, every 7th one 9 s behind (late). Returns
    per partition the (key, timestamp ms) pairs in offset order (one idempotent producer)."""
    import random

    from confluent_kafka import Producer

    rng = random.Random(5)
    prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3, "linger.ms": 5,
                     "enable.idempotence": True})
    sent: dict[int, list[tuple[str, int]]] = {p: [] for p in range(partitions)}
    for i in range(per_partition):
        for part in range(partitions):
            behind = 9000 if i % 7 == 6 else rng.randrange(0, int(MAX_DELAY_S * 1000))
            ts = base_ms + i * 300 + part * 50 - behind
            key = f"k{rng.randrange(KEYS)}"
            prod.produce(topic, key=key, value=str(i), partition=part, timestamp=ts)
            sent[part].append((key, ts))
            prod.poll(0)
    assert prod.flush(30) == 0
    return sent


def _late(sent) -> collections.Counter:
    """(partition, offset, key, timestamp ms) of the records the lateness rule leaves out."""
    late: collections.Counter = collections.Counter()
    for part, records in sent.items():
        newest = None
        for offset, (key, ts_ms) in enumerate(records):
            ts = ts_ms / 1000
            if newest is not None and math.floor(ts) < math.floor(newest - MAX_DELAY_S):
                late[(part, offset, key, ts_ms)] += 1
                continue
            newest = ts if newest is None else max(newest, ts)
    return late


def _expected_windows(sent) -> collections.Counter:
    """The documented lateness rule, per partition in offset order: a record is late when its
    second (time label) is below floor(newest earlier timestamp of its partition - max delay)."""
    counts: collections.Counter = collections.Counter()
    for records in sent.values():
        newest = None
        for key, ts_ms in records:
            ts = ts_ms / 1000
            if newest is not None and math.floor(ts) < math.floor(newest - MAX_DELAY_S):
                continue
            newest = ts if newest is None else max(newest, ts)
            start = math.floor(ts / WINDOW_S) * WINDOW_S
            counts[(key, start, start + WINDOW_S)] += 1
    return collections.Counter({(k, s, e, v): 1 for (k, s, e), v in counts.items()})


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_kafka_timestamps_drive_per_partition_watermarks_exactly_once_with_a_kill(kafka, tmp_path, mode):
    """``timestamps="kafka"`` with ``max_out_of_orderness``: event-time windows over three
    out-of-order partitions, a worker killed mid-run; the output topic at read_committed
    holds exactly the windows of the records the per-partition rule keeps, and the late
    records go to a side output written to a second topic by its own transactional sink:
    each exactly once there."""
    from epochstream import OutputTag, TumblingEventTimeWindows

    src = new_topic(kafka, "times", 3)
    out = new_topic(kafka, "wins", 1)
    late_topic = new_topic(kafka, "late", 1)
    base_ms = int(time.time() * 1000) - 600_000
    sent = _produce_out_of_order(kafka, src, 3, 400, base_ms)
    p = make_pipeline("kafka-windows", mode=mode, interval=0.1, batch_size=16)
    sink = KafkaSink(kafka.bootstrap_servers, out, staging=tmp_path / "staging")
    tag = OutputTag("late")
    events = p.from_kafka(kafka.bootstrap_servers, src, end="latest", uid="src", timestamps="kafka",
                          max_out_of_orderness=MAX_DELAY_S, late_records=tag)
    (events.get_side_output(tag).map(lambda r: [r["partition"], r["offset"], r["key"].decode(), r["timestamp"]])
     .sink(KafkaSink(kafka.bootstrap_servers, late_topic, staging=tmp_path / "staging-late"), uid="late"))
    (events
     .map(lambda r: (r["key"].decode(), r["timestamp"] / 1000)).map(_slow)
     .key_by(lambda r: r[0])
     .window(TumblingEventTimeWindows.of(WINDOW_S, lambda r: r[1])).count(uid="win")
     .sink(sink, uid="out"))
    assert p.sources["src"].records == "arrow" and p.sources["src"].timestamp_column == ("timestamp", 1000.0)
    res = p.run("local", checkpoint_dir=tmp_path / "chk",
                failures=FailureSchedule(kill_times=[0.4], kill_moments=["now"]))
    assert res.restarts >= 1
    got = collections.Counter(tuple(r) for r in _committed(kafka, out))
    assert got == _expected_windows(sent)
    late = collections.Counter(tuple(r) for r in _committed(kafka, late_topic))
    assert late == _late(sent) and late
    assert res.metrics["late_records_dropped"] == 0  # sent to the side output instead


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_an_idle_partition_stops_holding_windows_back(kafka, tmp_path, mode):
    """An unbounded source over two partitions, one of which never gets a record: without
    ``idleness`` no window can close; with it the windows of the busy partition close while
    the job runs."""
    from epochstream import CheckpointConfig, FileSink, TumblingEventTimeWindows
    from epochstream.backends.local import LocalCheckpointStorage

    src = new_topic(kafka, "idle", 2)
    base_ms = 1_000_000_000_000 + int(time.time() * 1000) % 1000  # any time, far from a window edge
    from confluent_kafka import Producer

    prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
    for i in range(60):  # 30 s of event time on partition 0 only
        prod.produce(src, key=b"k", value=str(i), partition=0, timestamp=base_ms + i * 500)
    assert prod.flush(30) == 0
    windows = {}
    for idleness in (None, 0.3):
        p = Pipeline(f"idle-{idleness}", parallelism=1, mode=mode, checkpoint=CheckpointConfig(interval=0.2))
        (p.from_kafka(kafka.bootstrap_servers, src, uid="src", timestamps="kafka", max_out_of_orderness=0.0,
                      idleness=idleness)
         .key_by(lambda r: r["key"])
         .window(TumblingEventTimeWindows.of(WINDOW_S, lambda r: r["timestamp"] / 1000)).count(uid="win")
         .map(lambda r: [r[1], r[3]])
         .sink(FileSink(tmp_path / f"out-{idleness}"), uid="out"))
        res = p.run("local", checkpoint_dir=tmp_path / f"chk-{idleness}", duration=4.0)
        manifest, _root = LocalCheckpointStorage(tmp_path / f"chk-{idleness}").latest()
        assert manifest["sources"]["src"]["offsets"] == {"0": 60, "1": 0}, res.completed_epochs  # all read
        windows[idleness] = FileSink(tmp_path / f"out-{idleness}").read()
    assert windows[None] == []
    assert len(windows[0.3]) >= 2 and all(count > 0 for _start, count in windows[0.3])


# ---------------------------------------------------------------- partitions added while running


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_partitions_added_while_running_are_read_exactly_once(kafka, tmp_path, mode):
    """An unbounded source over a topic of 2 partitions; 2 more are created mid-run
    (``AdminClient.create_partitions``) and records go to all four; a worker is killed after
    that. Every record's result is in the output at read_committed exactly once, and the
    manifest holds offsets of the new partitions."""
    import threading

    from confluent_kafka import Producer
    from confluent_kafka.admin import NewPartitions

    from epochstream.backends.kafka.client import admin
    from epochstream.backends.local import LocalCheckpointStorage

    first, second = 400, 600
    src = new_topic(kafka, "grow", 2)
    out = new_topic(kafka, "grown", 2)
    produce(kafka, src, [(f"k{i % KEYS}", str(i)) for i in range(first)])

    def grow():
        client = admin(kafka.bootstrap_servers)
        client.create_partitions([NewPartitions(src, 4)])[src].result(30)
        prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
        for i in range(first, first + second):
            prod.produce(src, key=f"k{i % KEYS}", value=str(i), partition=i % 4)
        assert prod.flush(30) == 0

    p = make_pipeline("kafka-grow", mode=mode, interval=0.1, batch_size=16, parallelism=2)
    sink = KafkaSink(kafka.bootstrap_servers, out, key=lambda r: r[0], staging=tmp_path / "staging")
    (p.from_kafka(kafka.bootstrap_servers, src, uid="src", partition_discovery_interval=0.3)
     .map(_as_pair)
     .key_by(lambda r: r[0])
     .process(RunningCount(emit_ids=True), uid="count")
     .sink(sink, uid="out"))
    grower = threading.Timer(1.5, grow)
    grower.start()
    try:
        res = p.run("local", checkpoint_dir=tmp_path / "chk", duration=7.0,
                    failures=FailureSchedule(kill_times=[4.0], kill_moments=["now"]))
    finally:
        grower.join()
    assert res.restarts >= 1
    assert check_running_counts(_committed(kafka, out), range(first + second)) == []
    manifest, _root = LocalCheckpointStorage(tmp_path / "chk").latest()
    assert set(manifest["sources"]["src"]["offsets"]) == {"0", "1", "2", "3"}


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_a_pattern_source_discovers_new_partitions_and_new_topics_exactly_once(kafka, tmp_path, mode):
    """An unbounded source over a pattern matching two topics; mid-run one topic gets a third
    partition and a new matching topic is created, records go to all of them, then a worker
    is killed. Every record's result is in the output at read_committed exactly once, and the
    manifest names its splits by (topic, partition) (``split_id``)."""
    import threading
    import uuid

    from confluent_kafka import Producer
    from confluent_kafka.admin import NewPartitions

    from epochstream.backends.kafka.client import admin
    from epochstream.backends.kafka.source import split_id
    from epochstream.backends.local import LocalCheckpointStorage

    base = f"pat{uuid.uuid4().hex[:6]}"
    a, b = new_topic(kafka, f"{base}-a", 2), new_topic(kafka, f"{base}-b", 1)
    out = new_topic(kafka, "pat-out", 2)
    first, second = 300, 450
    produce(kafka, a, [(f"k{i % KEYS}", str(i)) for i in range(0, first, 2)])
    produce(kafka, b, [(f"k{i % KEYS}", str(i)) for i in range(1, first, 2)])
    created: list[str] = []

    def grow():
        client = admin(kafka.bootstrap_servers)
        client.create_partitions([NewPartitions(a, 3)])[a].result(30)
        created.append(new_topic(kafka, f"{base}-c", 2))
        prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
        for i in range(first, first + second):
            topic, part = [(a, 2), (created[0], 0), (created[0], 1), (b, 0)][i % 4]
            prod.produce(topic, key=f"k{i % KEYS}", value=str(i), partition=part)
        assert prod.flush(30) == 0

    p = make_pipeline("kafka-pattern", mode=mode, interval=0.1, batch_size=16, parallelism=2)
    sink = KafkaSink(kafka.bootstrap_servers, out, key=lambda r: r[0], staging=tmp_path / "staging")
    (p.from_kafka(kafka.bootstrap_servers, re.compile(rf"{base}-.*"), uid="src", partition_discovery_interval=0.3)
     .map(_as_pair)
     .key_by(lambda r: r[0])
     .process(RunningCount(emit_ids=True), uid="count")
     .sink(sink, uid="out"))
    grower = threading.Timer(0.8, grow)
    grower.start()
    try:  # the run must outlast a restart on a loaded machine and a discovery after it
        res = p.run("local", checkpoint_dir=tmp_path / "chk", duration=9.0,
                    failures=FailureSchedule(kill_times=[2.5], kill_moments=["now"]))
    finally:
        grower.join()
    assert res.restarts >= 1
    assert check_running_counts(_committed(kafka, out), range(first + second)) == []
    manifest, _root = LocalCheckpointStorage(tmp_path / "chk").latest()
    want = {(a, 0), (a, 1), (a, 2), (b, 0), (created[0], 0), (created[0], 1)}
    assert set(manifest["sources"]["src"]["offsets"]) == {str(split_id(t, q)) for t, q in want}


def test_an_older_multi_topic_checkpoint_keeps_its_split_ids(kafka):
    """Checkpoints written before splits were named hold ids 0..n-1 in (topic, partition)
    order for a multi-topic source: a restore reads them so, and the source does not grow."""
    from epochstream.backends.kafka.source import KafkaSource, split_id

    a, b = new_topic(kafka, "old-a", 2), new_topic(kafka, "old-b", 1)
    src = KafkaSource(kafka.bootstrap_servers, [a, b])
    assert src.named_splits and src.grows
    assert src.split_ids() == [split_id(a, 0), split_id(a, 1), split_id(b, 0)]
    assert {src.owner(s, 2) for s in src.split_ids()} == {0, 1}
    src.adopt_checkpoint([str(split_id(a, 0))])  # a named checkpoint: nothing changes
    assert src.named_splits
    src.adopt_checkpoint(["0", "1", "2"])
    assert not src.named_splits and not src.grows
    assert src.partitions == {0: (a, 0), 1: (a, 1), 2: (b, 0)} and src.split_ids() == [0, 1, 2]
    assert src.start_offsets == {0: 0, 1: 0, 2: 0}


# ---------------------------------------------------------------- an unreachable cluster on the sink side


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_sink_names_an_unreachable_cluster_and_commits_nothing(tmp_path, guarantee):
    from epochstream.deploy.failures import JobFailedError

    p = Pipeline("unreachable", parallelism=1, restart_attempts=0)
    p.from_collection(list(range(10)), uid="src").sink(
        KafkaSink("127.0.0.1:1", "out-topic", guarantee=guarantee, staging=tmp_path / "staging"), uid="out")
    with pytest.raises(JobFailedError) as info:
        p.run("sim", checkpoint_dir=tmp_path / "chk")
    why = str(info.value)
    assert "KafkaSinkError" in why and "'127.0.0.1:1'" in why and "'out-topic'" in why and "'out'" in why, why
    assert not list((tmp_path / "chk").glob("chk-*"))  # no epoch completed


# ---------------------------------------------------------------- epochstream chaos of a Kafka job


def test_cli_chaos_accepts_a_kafka_job(kafka, tmp_path):
    """``epochstream chaos --deployment local`` on Kafka -> keyed count -> Kafka: both runs write
    fresh topics; the chaos run's topic at read_committed equals the failure-free run's, and at
    read_uncommitted it shows the writes the killed attempts aborted."""
    import os
    import subprocess
    import sys
    import textwrap

    src = _fill(kafka, 3000)
    out = new_topic(kafka, "chaos-out", 2)
    job = tmp_path / "kafkajob.py"
    job.write_text(textwrap.dedent(f'''
        import time
        from epochstream import KafkaSink, Pipeline
        from epochstream.api.functions import KeyedProcessFunction
        from epochstream.runtime.state import ValueStateDescriptor

        class Count(KeyedProcessFunction):
            def open(self, ctx):
                self.n = ctx.state(ValueStateDescriptor("n", default=0))

            def process(self, pair, ctx):
                time.sleep(0.0005)
                self.n.update(self.n.value() + 1)
                yield [ctx.key, pair[1], self.n.value()]

        def job():
            p = Pipeline("kafka-chaos", parallelism=2, mode="aligned", checkpoint_interval=0.1)
            (p.from_kafka({kafka.bootstrap_servers!r}, {src!r}, end="latest", uid="src")
             .map(lambda r: (r["key"].decode(), int(r["value"])))
             .key_by(lambda r: r[0]).process(Count(), uid="count")
             .sink(KafkaSink({kafka.bootstrap_servers!r}, {out!r}, key=lambda r: r[0]), uid="out"))
            return p
    '''))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "epochstream.cli", "chaos", f"{job}:job", "--json", "--deployment",
                           "local", "--kills", "2", "--seed", "3", "--workdir", str(tmp_path / "work")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["lost"] == 0 and doc["duplicated"] == 0, doc
    assert doc["records_expected"] == doc["records_committed"] == 3000
    assert doc["restarts"] >= 1, doc
    assert set(doc["topics"]["out"]) == {"reference", "chaos"}
