"""Kafka -> keyed count -> Kafka, exactly once: records/s and end-to-end latency, on a real broker.

One KRaft broker (``epochstream.deploy.kafka_broker``), 2 workers (parallelism 2), input topic
of 4 partitions, output topic of 2, 100 keys. For each system and epoch interval (100 ms, 1 s):

- **throughput**: the input topic is filled with ``--records`` records first; the job reads it
  to its end (bounded) and writes one running count per record; records/s = records / the
  job's run time (after start-up).
- **latency**: a separate process produces at ``--load`` of that throughput (open loop, for
  ``--seconds``); another reads the output topic at ``read_committed``; each output record
  carries its input's produce timestamp, so latency = visible at read_committed - produced.
  The first ``--warmup`` seconds are dropped. p50 and p99.

Systems: epochstream (local driver, aligned and tracker modes, ``KafkaSink`` exactly-once) and,
when its connector jars are in ``jars/kafka-spark/lib`` (scripts/setup.sh), Spark Structured
Streaming's own Kafka source and sink (micro-batch, trigger = epoch interval, at-least-once:
Spark's Kafka sink has no transactions), side by side in one run. Writes
benchmarks/results/kafka.csv and .png and prints a table. Not a test.

    python benchmarks/kafka.py [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

KEYS = 100


# ---------------------------------------------------------------- load and reader processes


def _produce_bulk(bootstrap: str, topic: str, n: int) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000, "log_level": 3})
    for i in range(n):
        while True:
            try:
                p.produce(topic, key=f"k{i % KEYS}".encode(), value=str(i).encode())
                break
            except BufferError:
                p.poll(0.01)
    p.flush(60)


def _load(bootstrap: str, topic: str, rate: float, seconds: float) -> None:
    """Open-loop producer: record i is due at t0 + i / rate."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "log_level": 3})
    t0 = time.time()
    i = 0
    while True:
        now = time.time()
        if now - t0 >= seconds:
            break
        due = t0 + i / rate
        if due > now:
            time.sleep(min(due - now, 0.002))
            continue
        p.produce(topic, key=f"k{i % KEYS}".encode(), value=str(i).encode())
        p.poll(0)
        i += 1
    p.flush(30)


def _reader(bootstrap: str, topic: str, seconds: float, queue) -> None:
    """Read the output at read_committed; latency (ms) per record from the produce timestamp it carries."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{time.time()}", "auto.offset.reset": "earliest",
                  "isolation.level": "read_committed", "enable.auto.commit": False, "fetch.wait.max.ms": 5,
                  "log_level": 3})
    c.subscribe([topic])
    lat: list[tuple[float, float]] = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        for m in c.consume(10000, timeout=0.05):
            if m.error() is not None:
                continue
            now = time.time() * 1000
            try:
                produced = float(json.loads(m.value())["ts"])
            except (ValueError, KeyError, TypeError):
                continue
            lat.append((produced, now - produced))
    c.close()
    queue.put(lat)


# ---------------------------------------------------------------- epochstream


def _to_pair(r):
    return r["key"].decode(), r["timestamp"]


def epochstream_job(bootstrap: str, src: str, out: str, mode: str, interval: float, bounded: bool, staging: str):
    from epochstream import KafkaSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

    class Count(KeyedProcessFunction):
        def open(self, ctx):
            self.n = ctx.state(ValueStateDescriptor("n", default=0))

        def process(self, pair, ctx):
            n = self.n.value() + 1
            self.n.update(n)
            yield {"key": ctx.key, "n": n, "ts": pair[1]}

    p = Pipeline(f"kafka-bench-{mode}", parallelism=2, mode=mode, checkpoint_interval=interval, batch_size=256)
    (p.from_kafka(bootstrap, src, end="latest" if bounded else None, uid="src")
     .map(_to_pair)
     .key_by(lambda r: r[0])
     .process(Count(), uid="count")
     .sink(KafkaSink(bootstrap, out, key=lambda r: r["key"], staging=staging), uid="out"))
    return p


def run_epochstream(cluster, mode: str, interval: float, n: int, load: float, seconds: float, warmup: float):
    src = f"in-{mode}-{interval}-{time.time_ns()}"
    cluster.create_topic(src, 4)
    out = src.replace("in-", "out-")
    cluster.create_topic(out, 2)
    ctx = mp.get_context("spawn")
    prod = ctx.Process(target=_produce_bulk, args=(cluster.bootstrap_servers, src, n))
    prod.start()
    prod.join()
    with tempfile.TemporaryDirectory() as d:
        job = epochstream_job(cluster.bootstrap_servers, src, out, mode, interval, True, d + "/st")
        res = job.run("local", checkpoint_dir=d + "/chk")
    rps = n / res.metrics["run_seconds"]
    # latency at `load` of that throughput
    src2, out2 = src + "-lat", out + "-lat"
    cluster.create_topic(src2, 4)
    cluster.create_topic(out2, 2)
    rate = max(100.0, load * rps)
    q = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(cluster.bootstrap_servers, out2, seconds + 6, q))
    reader.start()
    loader = ctx.Process(target=_load, args=(cluster.bootstrap_servers, src2, rate, seconds))
    with tempfile.TemporaryDirectory() as d:
        job = epochstream_job(cluster.bootstrap_servers, src2, out2, mode, interval, False, d + "/st")
        loader.start()
        res2 = job.run("local", checkpoint_dir=d + "/chk", duration=seconds + 2)
    loader.join()
    lat = q.get()
    reader.join()
    return rps, rate, _percentiles(lat, warmup), len(res2.completed_epochs)


def _percentiles(lat: list[tuple[float, float]], warmup: float) -> tuple[float, float, int]:
    if not lat:
        return float("nan"), float("nan"), 0
    t0 = min(p for p, _ in lat)
    vals = sorted(v for p, v in lat if p - t0 >= warmup * 1000)
    if not vals:
        return float("nan"), float("nan"), 0
    return vals[len(vals) // 2], vals[min(len(vals) - 1, int(len(vals) * 0.99))], len(vals)


# ---------------------------------------------------------------- Spark Structured Streaming


def spark_jars() -> list[str]:
    lib = ROOT / "jars" / "kafka-spark" / "lib"
    return sorted(str(p) for p in lib.glob("*.jar"))


def _spark_run(bootstrap: str, src: str, out: str, interval: float, bounded: bool, seconds: float, queue) -> None:
    """Spark's Kafka source -> groupBy(key).count() (update mode) -> Spark's Kafka sink; run in
    its own process. Bounded: availableNow; reports the run's seconds."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("kafka-bench-spark")
             .config("spark.jars", ",".join(spark_jars()))
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    chk = tempfile.mkdtemp()
    df = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", src)
          .option("startingOffsets", "earliest").load())
    counts = (df.groupBy(F.col("key").cast("string").alias("k"))
              .agg(F.count(F.lit(1)).alias("n"), F.max(F.col("timestamp").cast("double")).alias("ts")))
    out_df = counts.select(F.col("k").alias("key"),
                           F.to_json(F.struct(F.col("k").alias("key"), "n", (F.col("ts") * 1000).alias("ts")))
                           .alias("value"))
    writer = (out_df.writeStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("topic", out)
              .option("checkpointLocation", chk).outputMode("update"))
    t0 = time.time()
    if bounded:
        q = writer.trigger(availableNow=True).start()
        q.awaitTermination()
    else:
        q = writer.trigger(processingTime=f"{int(interval * 1000)} milliseconds").start()
        while q.lastProgress is None:  # the first (empty) micro-batch ran: Spark is up
            time.sleep(0.2)
        queue.put("ready")
        time.sleep(seconds)
        q.stop()
    queue.put(time.time() - t0)
    spark.stop()


def run_spark(cluster, interval: float, n: int, load: float, seconds: float, warmup: float):
    ctx = mp.get_context("spawn")
    src = f"spark-in-{interval}-{time.time_ns()}"
    out = src.replace("-in-", "-out-")
    cluster.create_topic(src, 4)
    cluster.create_topic(out, 2)
    prod = ctx.Process(target=_produce_bulk, args=(cluster.bootstrap_servers, src, n))
    prod.start()
    prod.join()
    q = ctx.Queue()
    # warm-up run on a small topic is not separated: Spark's start-up is part of its bounded run,
    # as the JVM start is excluded: the run time is taken inside the process after getOrCreate
    proc = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src, out, interval, True, 0, q))
    proc.start()
    secs = q.get()
    proc.join()
    rps = n / secs
    src2, out2 = src + "-lat", out + "-lat"
    cluster.create_topic(src2, 4)
    cluster.create_topic(out2, 2)
    rate = max(100.0, load * rps)
    lq = ctx.Queue()
    sq = ctx.Queue()
    job = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src2, out2, interval, False, seconds + 8,
                                               sq))
    job.start()
    assert sq.get(timeout=600) == "ready"  # the load starts once Spark's query runs
    reader = ctx.Process(target=_reader, args=(cluster.bootstrap_servers, out2, seconds + 8, lq))
    reader.start()
    loader = ctx.Process(target=_load, args=(cluster.bootstrap_servers, src2, rate, seconds))
    loader.start()
    loader.join()
    sq.get()
    job.join()
    lat = lq.get()
    reader.join()
    return rps, rate, _percentiles(lat, warmup), None


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    # the local driver forks its workers from this process: load pyarrow.parquet (state files)
    # once here, or every worker pays its import (seconds on a loaded machine) in its first epoch
    import pyarrow.parquet  # noqa: F401

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=100_000, help="input records of the throughput run")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the latency run")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of the latency run left out")
    ap.add_argument("--load", type=float, default=0.5, help="latency run's rate, as a fraction of max throughput")
    ap.add_argument("--intervals", default="0.1,1.0", help="epoch intervals (s), comma-separated")
    ap.add_argument("--modes", default="aligned,tracker")
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--quick", action="store_true", help="20k records, 10 s latency runs")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.seconds, args.warmup = 20_000, 10.0, 3.0
    from epochstream.deploy.kafka_broker import KafkaCluster

    intervals = [float(x) for x in args.intervals.split(",")]
    rows = []
    with KafkaCluster(1) as cluster:
        for interval in intervals:
            for mode in args.modes.split(","):
                rps, rate, (p50, p99, n_lat), epochs = run_epochstream(cluster, mode, interval, args.records,
                                                                       args.load, args.seconds, args.warmup)
                rows.append({"system": f"epochstream-{mode}", "guarantee": "exactly-once", "interval_s": interval,
                             "records_per_s": round(rps), "latency_rate": round(rate), "p50_ms": round(p50, 1),
                             "p99_ms": round(p99, 1), "latency_samples": n_lat, "epochs": epochs})
                print(rows[-1], flush=True)
            if not args.no_spark and spark_jars():
                rps, rate, (p50, p99, n_lat), _ = run_spark(cluster, interval, args.records, args.load, args.seconds,
                                                            args.warmup)
                rows.append({"system": "spark-structured-streaming", "guarantee": "at-least-once",
                             "interval_s": interval, "records_per_s": round(rps), "latency_rate": round(rate),
                             "p50_ms": round(p50, 1), "p99_ms": round(p99, 1), "latency_samples": n_lat,
                             "epochs": ""})
                print(rows[-1], flush=True)
            elif not args.no_spark:
                print("spark peer skipped: no jars in jars/kafka-spark/lib (bash scripts/setup.sh)", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kafka.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"\n{'system':28} {'interval':>8} {'records/s':>10} {'load/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['system']:28} {r['interval_s']:>8} {r['records_per_s']:>10} {r['latency_rate']:>8} "
              f"{r['p50_ms']:>8} {r['p99_ms']:>8}")
    _plot(rows, out / "kafka.png")
    print(f"\nwrote {out / 'kafka.csv'} and {out / 'kafka.png'}")
    return 0


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    systems = sorted({r["system"] for r in rows})
    intervals = sorted({r["interval_s"] for r in rows})
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(intervals))]
        get = {r["interval_s"]: r for r in rows if r["system"] == s}
        a.bar(xs, [get[iv]["records_per_s"] if iv in get else 0 for iv in intervals], width, label=s)
        b.bar(xs, [get[iv]["p99_ms"] if iv in get else 0 for iv in intervals], width, label=s)
    for ax, title in ((a, "records/s (bounded input)"), (b, "p99 latency, ms (produce -> read_committed)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(intervals))], [f"{iv:g} s epochs" for iv in intervals])
        ax.set_title(title)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
