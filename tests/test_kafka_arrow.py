"""Kafka as Arrow batches and JSON decoded in the stream, on a real broker (``kafkaserver.kafka``).

``records="arrow"`` is the default, so tests/test_kafka.py's source, discovery, watermark and
exactly-once tests already read Arrow batches; here: a batch holds what the dict records hold
(offsets with transaction gaps, timestamps, headers, tombstones), and the pipeline PySpark users
run, Kafka -> ``from_json`` with malformed records mixed in -> keyed running count -> Kafka, with
the dead letters to a second topic, exactly once with a worker killed, in both modes: every good
input once in the output with each key's counts 1..n, every bad input exactly once among the dead
letters with its topic, partition and offset.
"""

from __future__ import annotations

import collections
import json
import time

import pyarrow as pa
import pytest

from epochstream import KafkaSink
from epochstream.backends.kafka import KafkaSource, read_topic
from epochstream.backends.kafka.records import kafka_schema, rows_of
from epochstream.deploy.failures import FailureSchedule
from kafkaserver import new_topic
from pipelines import BatchRunningCount, check_running_counts, make_pipeline

pytestmark = pytest.mark.slow

N = 1200
KEYS = 7
SCHEMA = "key string, id long NOT NULL"
#: what a bad record looks like, in turn (a value of the wrong type, not JSON, a NOT NULL field
#: missing, empty, not an object, valid but larger than ``MAX_RECORD_BYTES``)
BAD_VALUES = [b'{"key": "k1", "id": "seven"}', b'{"key": "k1", "id": 7', b'{"key": "k1"}', b"", b"[7]",
              b'{"key": "k1", "id": 7, "note": "' + b"x" * 300 + b'"}']
#: the jobs' ``from_json(max_record_bytes=)``: the good records are below it
MAX_RECORD_BYTES = 200


def _value(i: int) -> bytes:
    if i % 13 == 12:
        return BAD_VALUES[(i // 13) % len(BAD_VALUES)]
    return json.dumps({"key": f"k{i % KEYS}", "id": i, "note": "x" * (i % 5)}).encode()


def _json_topic(kafka, n: int = N, partitions: int = 3) -> tuple[str, set[tuple[int, int]], list[int]]:
    """A topic of JSON records written in transactions, one of them aborted (its records and
    the markers leave gaps in the offsets); returns it, the (partition, offset) of every bad
    record as read back at read_committed, and the good ids."""
    from confluent_kafka import Producer

    topic = new_topic(kafka, "json", partitions)
    prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"fill-{topic}",
                     "log_level": 3, "linger.ms": 5})
    prod.init_transactions(30)
    for chunk in range(0, n, 200):
        prod.begin_transaction()
        for i in range(chunk, min(n, chunk + 200)):
            prod.produce(topic, key=f"k{i % KEYS}", value=_value(i), partition=i % partitions,
                         headers=[("n", str(i).encode())] if i % 100 == 0 else None)
        prod.commit_transaction(30)
        if chunk == 400:
            prod.begin_transaction()
            for j in range(30):
                prod.produce(topic, value=b'{"key": "junk", "id": -1}', partition=j % partitions)
            prod.abort_transaction(30)
    bad = {(m["partition"], m["offset"]) for m in read_topic(kafka.bootstrap_servers, topic) if
           m["value"] in BAD_VALUES}
    assert len(bad) == n // 13
    return topic, bad, [i for i in range(n) if i % 13 != 12]


def test_arrow_batches_hold_what_the_dict_records_hold(kafka):
    topic, _bad, _ids = _json_topic(kafka, 600)
    from confluent_kafka import Producer

    prod = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 3})
    prod.produce(topic, key=b"gone", value=None, partition=0)  # a tombstone
    assert prod.flush(30) == 0
    arrow = KafkaSource(kafka.bootstrap_servers, topic, end="latest")
    dicts = KafkaSource(kafka.bootstrap_servers, topic, end="latest", records="dict")
    assert arrow.records == "arrow" and dicts.records == "dict"
    try:
        for split in arrow.split_ids():
            start, end = arrow.start_offset(split), arrow.split_length(split)
            batch = arrow.read_range(split, start, end)
            rows = dicts.read_range(split, start, end)
            assert isinstance(batch, pa.RecordBatch) and batch.schema == kafka_schema()
            offsets = batch.column("offset").to_pylist()
            assert offsets == [r["offset"] for r in rows] and offsets[-1] < end
            assert offsets != list(range(start, start + len(offsets)))  # gaps: markers, the aborted records
            for got, want in zip(rows_of(batch), rows, strict=True):
                assert {k: got[k] for k in want if k != "headers"} == {k: v for k, v in want.items() if k != "headers"}
                assert got["headers"] == ([{"key": k, "value": v} for k, v in want["headers"]] or None)
            assert all(r["timestamp"] > 0 for r in rows)
        first: list | pa.RecordBatch = []
        while not len(first):  # partition 0's offsets 1..50 are ids 3..150: none of them has headers
            first, after = arrow.read_next(0, 1, 50)
        assert first.column("headers").null_count == first.num_rows > 0
        assert after == first["offset"][-1].as_py() + 1
        assert rows_of(arrow.read_range(0, 0, arrow.split_length(0)))[-1]["value"] is None
    finally:
        arrow.close()
        dicts.close()


def _slow_batch(batch):
    time.sleep(0.0004 * batch.num_rows)  # so a run lasts long enough for kills to land mid-run
    return batch


KILLS = {"aligned": FailureSchedule(kill_times=[0.4], kill_moments=["snapshot_write"]),
         "tracker": FailureSchedule(kill_times=[0.4], kill_moments=["now"])}


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_kafka_json_to_keyed_counts_to_kafka_exactly_once_with_dead_letters(kafka, tmp_path, mode):
    src, bad, good_ids = _json_topic(kafka)
    out = new_topic(kafka, "counts", 2)
    dead_topic = new_topic(kafka, "dead", 1)
    p = make_pipeline("kafka-json", mode=mode, interval=0.1, batch_size=16)
    (p.from_kafka(kafka.bootstrap_servers, src, end="latest", uid="src")
     .from_json(SCHEMA, keep=("partition", "offset"), uid="json", max_record_bytes=MAX_RECORD_BYTES,
                dead_letter=KafkaSink(kafka.bootstrap_servers, dead_topic, staging=tmp_path / "staging-dead"))
     .map_batches(_slow_batch)
     .key_by("key")
     .process_batches(BatchRunningCount(emit_ids=True), uid="count")
     .sink(KafkaSink(kafka.bootstrap_servers, out, key=lambda r: r["key"], staging=tmp_path / "staging"),
           uid="out"))
    res = p.run("local", checkpoint_dir=tmp_path / "chk", failures=KILLS[mode])
    assert res.restarts >= 1
    counts = [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, out)]
    assert check_running_counts([(r["key"], r["n"], r["id"]) for r in counts], good_ids) == []
    dead = [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, dead_topic)]
    seen = collections.Counter((d["partition"], d["offset"]) for d in dead)
    assert set(seen) == bad and set(seen.values()) == {1}
    assert all(d["topic"] == src and d["reason"] for d in dead)
    assert res.metrics["dead_letters"] >= len(bad)  # replays count again
