"""Kafka topics for the Kafka benchmarks: filling, open-loop load, reading at read_committed, and timing.

``kafka.py`` and ``kafka_json_pandas.py`` measure with the same processes, so their latencies compare: records
are stamped with the moment they were due (no coordinated omission) and timed when first readable.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.harness import percentile

ROOT = Path(__file__).resolve().parents[2]
#: keys of the keyed count's records (``count_message``, ``load``'s default records)
KEYS = 100


def count_message(i: int, due_ms: int) -> tuple[bytes, bytes]:
    """The keyed count's record ``i``: key ``k<i % KEYS>``, value ``i``."""
    return f"k{i % KEYS}".encode(), str(i).encode()


def produce_bulk(bootstrap: str, topic: str, n: int, message=None) -> None:
    """``n`` records into ``topic``, as fast as the broker takes them. ``message(i, due_ms)`` gives
    record ``i``'s (key, value) (default ``count_message``; ``due_ms`` is the produce start, ms).
    Idempotent: a retried batch cannot reorder a partition (checks may rely on the order)."""
    from confluent_kafka import Producer

    message = message or count_message
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000, "log_level": 3,
                  "enable.idempotence": True})
    t0 = int(time.time() * 1000)
    for i in range(n):
        key, value = message(i, t0)
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.01)
    p.flush(60)


def wait_ready(bootstrap: str, topic: str, group: str | None, timeout: float = 120.0) -> None:
    """Until the job under test runs: epochstream's source commits a completed epoch's offsets
    to its group (``group``); Spark's query is ready when this is called (group None)."""
    if group is None:
        return
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "log_level": 3})
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            got = c.committed([TopicPartition(topic, 0)], timeout=5)
            if got and got[0].offset >= 0:
                return
            time.sleep(0.1)
    finally:
        c.close()


def load(bootstrap: str, topic: str, rate: float, seconds: float, group: str | None = None,
          message=None) -> None:
    """Open-loop producer: record i is due at t0 + i / rate, and carries that moment as its
    Kafka timestamp, so a producer that falls behind does not hide the delay (no coordinated
    omission). Records due are produced in bursts every ~2 ms. Starts once the job runs.
    ``message(i, due_ms)``: record i's (key, value), default key ``k<i % KEYS>``, value ``i``."""
    from confluent_kafka import Producer

    wait_ready(bootstrap, topic, group)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "log_level": 3})
    keys = [f"k{i}".encode() for i in range(KEYS)]
    t0 = time.time()
    i = 0
    total = int(rate * seconds)
    while i < total:
        due_now = min(total, int((time.time() - t0) * rate) + 1)
        while i < due_now:
            due_ms = int((t0 + i / rate) * 1000)
            if message is None:
                key, value = keys[i % KEYS], str(i).encode()
            else:
                key, value = message(i, due_ms)
            try:
                p.produce(topic, value, key, timestamp=due_ms)
            except BufferError:
                p.poll(0.01)
                continue
            i += 1
        p.poll(0)
        time.sleep(0.002)
    p.flush(30)


def reader(bootstrap: str, topic: str, seconds: float, queue) -> None:
    """Read the output at read_committed; latency (ms) per record from the produce timestamp it
    carries (its ``"ts"`` field).

    A record is timed when it first can be read: ``poll`` returns as soon as one is, then what
    else has arrived is drained without waiting. ``consume(n, timeout)`` would not do: it
    returns only when it has ``n`` records or the timeout has passed, so a transaction's
    records waited for the rest of the 50 ms window, and every system's latency read that much
    too high (from a transaction's commit to its records read: 31 ms against 4 ms at the median,
    one broker, 2,500 records committed every 100 ms)."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{time.time()}", "auto.offset.reset": "earliest",
                  "isolation.level": "read_committed", "enable.auto.commit": False, "fetch.wait.max.ms": 5,
                  "log_level": 3})
    c.subscribe([topic])
    lat: list[tuple[float, float]] = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        first = c.poll(0.05)
        if first is None:
            continue
        msgs = [first, *c.consume(10000, timeout=0)]
        now = time.time() * 1000
        for m in msgs:
            v = m.value()
            if m.error() is not None or v is None:
                continue
            at = v.find(b'"ts":')
            if at < 0:
                continue
            stop = v.find(b",", at)
            if stop < 0:
                stop = v.find(b"}", at)
            try:
                produced = float(v[at + 5:stop])
            except ValueError:
                continue
            lat.append((produced, now - produced))
    c.close()
    queue.put(lat)


def steady_rate(epochs: list[dict]) -> float | None:
    """Records/s without start-up, as Spark's is taken: the input of the epochs after the first
    that read any, over the time from that first one's commit to the last one's."""
    done = [e for e in epochs if e.get("state") == "completed" and e.get("time") is not None]
    first = next((i for i, e in enumerate(done) if e.get("records")), None)
    if first is None or first == len(done) - 1:
        return None
    span = done[-1]["time"] - done[first]["time"]
    return sum(e["records"] for e in done[first + 1:]) / span if span > 0 else None


def latency_percentiles(lat: list[tuple[float, float]], warmup: float) -> tuple[float, float, int]:
    """p50, p99 and count of the latencies (ms) of ``reader``'s (produced, latency) pairs, leaving out the
    first ``warmup`` seconds of produce time."""
    if not lat:
        return float("nan"), float("nan"), 0
    t0 = min(p for p, _ in lat)
    vals = [v for p, v in lat if p - t0 >= warmup * 1000]
    if not vals:
        return float("nan"), float("nan"), 0
    return percentile(vals, 0.5), percentile(vals, 0.99), len(vals)


def spark_jars() -> list[str]:
    """Spark's Kafka connector jars (made by scripts/setup.sh; none when it has not run)."""
    lib = ROOT / "jars" / "kafka-spark" / "lib"
    return sorted(str(p) for p in lib.glob("*.jar"))

