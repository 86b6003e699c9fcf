"""Kafka -> keyed count -> Kafka, exactly once: records/s and end-to-end latency, on a real broker.

One KRaft broker (``epochstream.deploy.kafka_broker``), 2 workers (parallelism 2), input topic
of 4 partitions, output topic of 2, 100 keys. For each system and epoch interval (100 ms, 1 s):

- **throughput** (max records/s): the input topic is filled with ``--records`` records first; the
  job reads it to its end (bounded) and writes one running count per record. records/s leaves
  start-up out on both sides: epochstream's input of the epochs after the first that read any,
  over the time from that epoch's commit to the last one's; Spark's rows over the trigger
  execution time of the micro-batches after the first (``maxOffsetsPerTrigger`` = records / 5).
  ``records_per_s_with_startup``: records / the whole run (epochstream from the job's start,
  Spark from the query's start, both after their interpreter or JVM is up).
- **latency**: once the job runs (epochstream: its first epoch committed group offsets), a
  separate process produces at ``--load`` (default 50%) of the rate with start-up, open loop for
  ``--seconds``, each record stamped with the moment it was due (Kafka timestamp); another
  reads the output topic at ``read_committed``; each output record carries its input's
  timestamp, so latency = visible at read_committed - due. The first ``--warmup`` seconds are
  dropped. p50 and p99. Spark's update-mode output has one record per key per micro-batch
  carrying the *newest* input timestamp of that key: its latencies are of the newest record
  (favourable to Spark).

Systems: epochstream (local driver, aligned and tracker modes, ``KafkaSink`` exactly-once) and,
when its connector jars are in ``jars/kafka-spark/lib`` (scripts/setup.sh), Spark Structured
Streaming's own Kafka source and sink (micro-batch, trigger = epoch interval, at-least-once:
Spark's Kafka sink has no transactions), side by side in one run. ``--real-time`` adds Spark's
Real-time Mode (``trigger(realTime="5 seconds")``, ``local[6]``: a task slot for each of its
four source and two shuffle partitions, which it needs at once) on the same query at the micro-batch latency
run's input rate: first with its operator allowlist check, whose refusal of the aggregation is
kept word for word in the CSV's ``note``, then with ``realTimeMode.allowlistCheck=false``, the
setting that refusal names (an error while it runs is kept too), then, for Real-time Mode's
own latency, the records passed through without the count, which it accepts (no records/s:
Real-time Mode has no bounded run). ``--pyflink`` adds PyFlink (apache-flink 2.3 in
benchmarks/.venv-pyflink, Flink's Kafka connector from jars/kafka-flink, both made on first use):
Flink's Kafka source -> key_by -> running count in Python -> ``KafkaSink`` with
``DeliveryGuarantee.EXACTLY_ONCE``, checkpoints at the interval, so its output is visible at
``read_committed`` only once a checkpoint commits its transactions
(benchmarks/peers/pyflink_kafka_count.py). Its records/s: the bounded run's records over first record
in the Python count -> job finished (final checkpoint and commit in); its latency load is a fraction
of that steady rate, as Spark's; a job that fails keeps its cause in ``note``. Writes
benchmarks/results/<--name>.csv and .png and prints a table with the targets
(records/s >= 1.5x Spark's at an equal or lower p99; p99 <= 2 x interval + 100 ms). The latency
rows of epochstream and Spark also say how busy the whole machine was while the load ran
(``cpu_busy_pct``, ``cpu_steal_pct``, ``cpu_saturated_pct``: the share of its seconds with no CPU
left, broker, load generator and reader included). Not a test.

    flock /work/wt/bench.lock python benchmarks/kafka/kafka.py --intervals 0.1 --name kafka_count_100ms
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, MachineCpu, pyplot, write_csv  # noqa: E402
from benchmarks.kafka import topics  # noqa: E402
from benchmarks.kafka.topics import KEYS, spark_jars  # noqa: E402
from benchmarks.peers.run_peers import flink_error, last_json  # noqa: E402

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
    prod = ctx.Process(target=topics.produce_bulk, args=(cluster.bootstrap_servers, src, n))
    prod.start()
    prod.join()
    with tempfile.TemporaryDirectory() as d:
        job = epochstream_job(cluster.bootstrap_servers, src, out, mode, interval, True, d + "/st")
        res = job.run("local", checkpoint_dir=d + "/chk")
    rps_total = n / res.metrics["run_seconds"]
    rps = topics.steady_rate(res.metrics.get("epochs", [])) or rps_total
    # latency at `load` of that throughput
    src2, out2 = src + "-lat", out + "-lat"
    cluster.create_topic(src2, 4)
    cluster.create_topic(out2, 2)
    # the latency load is a fraction of the rate WITH start-up: the steady rate over-reads a
    # saturated run (its first epoch commits late, so the span after it is short), and 50% of
    # it was more than the job sustains beside the loader and reader (kafka_count_100ms_2026-11-26)
    rate = max(100.0, load * rps_total)
    q = ctx.Queue()
    # the loader starts once the job completed its first epoch (its group has offsets): start-up
    # is not latency; the job runs until every loaded record had time to come out
    reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out2, seconds + 16, q))
    reader.start()
    loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src2, rate, seconds, "epochstream-src"))
    with tempfile.TemporaryDirectory() as d:
        job = epochstream_job(cluster.bootstrap_servers, src2, out2, mode, interval, False, d + "/st")
        loader.start()
        machine = MachineCpu(duration=seconds)  # while the load runs
        res2 = job.run("local", checkpoint_dir=d + "/chk", duration=seconds + 10)
    loader.join()
    lat = q.get()
    reader.join()
    return rps, rps_total, rate, topics.latency_percentiles(lat, warmup), len(res2.completed_epochs), machine.stop()


# ---------------------------------------------------------------- Spark Structured Streaming


def _spark_run(bootstrap: str, src: str, out: str, interval: float, bounded: bool, seconds: float, queue,
               max_offsets: int = 0, real_time: str | None = None, allowlist_check: bool = True,
               stateless: bool = False) -> None:
    """Spark's Kafka source -> groupBy(key).count() (update mode) -> Spark's Kafka sink; run in
    its own process. Bounded: availableNow; reports the run's seconds. ``real_time``: Real-time
    Mode with that batch duration instead of micro-batches (``allowlist_check`` False is the
    setting Spark's refusal names for the aggregation); a refusal is put on the queue as text,
    and so is a query that failed while running. ``stateless``: the records passed through
    without the count (what Real-time Mode accepts with its check on)."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    # Real-time Mode runs every stage's tasks at once for a whole batch: it needs a task slot per
    # source partition (4) and shuffle partition (2), or the later tasks wait a batch (5 s)
    spark = (SparkSession.builder.master("local[6]" if real_time else "local[2]").appName("kafka-bench-spark")
             .config("spark.jars", ",".join(spark_jars()))
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    if real_time is not None:
        spark.conf.set("spark.sql.streaming.realTimeMode.allowlistCheck", str(allowlist_check).lower())
    chk = tempfile.mkdtemp()
    reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", src)
              .option("startingOffsets", "earliest"))
    if bounded:  # several micro-batches, so the steady rate leaves the first one's start-up out
        reader = reader.option("maxOffsetsPerTrigger", str(max(1000, max_offsets)))
    df = reader.load()
    if stateless:  # each record passed through with its timestamp: no count, no state
        counts = df.select(F.col("key").cast("string").alias("k"), F.lit(1).alias("n"),
                           F.col("timestamp").cast("double").alias("ts"))
    else:
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
        # Spark's rate without its start-up: the micro-batches after the first (which plans and
        # compiles the query), rows over their trigger execution time
        progress = [p for p in q.recentProgress if p["numInputRows"]]
        later = progress[1:] or progress
        rows = sum(p["numInputRows"] for p in later)
        busy = sum(p["durationMs"]["triggerExecution"] for p in later) / 1000.0
        queue.put({"seconds": time.time() - t0, "steady_rps": rows / busy if busy else float("nan"),
                   "batches": len(progress)})
        spark.stop()
        return
    elif real_time is not None:
        q = writer.trigger(realTime=real_time).start()
        # one long-running batch per ``real_time``: no progress before the first ends, so the
        # query counts as up once its batch is active, a refusal once it has terminated
        while not q.status["isTriggerActive"] and q.exception() is None and q.isActive:
            time.sleep(0.2)
        time.sleep(2.0)
        if q.exception() is not None or not q.isActive:
            queue.put({"refused": str(q.exception() or q.status["message"]).splitlines()[0]})
            spark.stop()
            return
        queue.put("ready")
    else:
        q = writer.trigger(processingTime=f"{int(interval * 1000)} milliseconds").start()
        while q.lastProgress is None:  # the first (empty) micro-batch ran: Spark is up
            time.sleep(0.2)
        queue.put("ready")
    time.sleep(seconds)
    failed = q.exception()
    q.stop()
    if failed is not None:
        queue.put({"failed": str(failed).splitlines()[0]})
        spark.stop()
        return
    queue.put(time.time() - t0)
    spark.stop()


def run_spark(cluster, interval: float, n: int, load: float, seconds: float, warmup: float):
    ctx = mp.get_context("spawn")
    src = f"spark-in-{interval}-{time.time_ns()}"
    out = src.replace("-in-", "-out-")
    cluster.create_topic(src, 4)
    cluster.create_topic(out, 2)
    prod = ctx.Process(target=topics.produce_bulk, args=(cluster.bootstrap_servers, src, n))
    prod.start()
    prod.join()
    q = ctx.Queue()
    # records/s: Spark's steady micro-batch rate (its first batch, query start-up, left out)
    proc = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src, out, interval, True, 0, q, n // 5))
    proc.start()
    got = q.get()
    proc.join()
    rps = got["steady_rps"]
    rps_total = n / got["seconds"]
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
    reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out2, seconds + 8, lq))
    reader.start()
    loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src2, rate, seconds))
    loader.start()
    machine = MachineCpu(duration=seconds)
    loader.join()
    cpu = machine.stop()
    sq.get()
    job.join()
    lat = lq.get()
    reader.join()
    return rps, rps_total, rate, topics.latency_percentiles(lat, warmup), got["batches"], cpu


def run_spark_real_time(cluster, rate: float, seconds: float, warmup: float, allowlist_check: bool,
                        batch: str = "5 seconds", stateless: bool = False) -> dict:
    """The same query in Spark's Real-time Mode, at the micro-batch latency run's input rate
    (Real-time Mode has no bounded run, so no records/s of its own); its refusal, if any."""
    ctx = mp.get_context("spawn")
    src = f"rtm-in-{time.time_ns()}"
    out = src.replace("-in-", "-out-")
    cluster.create_topic(src, 4)
    cluster.create_topic(out, 2)
    sq, lq = ctx.Queue(), ctx.Queue()
    job = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src, out, 0.0, False, seconds + 8, sq),
                      kwargs={"real_time": batch, "allowlist_check": allowlist_check, "stateless": stateless})
    job.start()
    got = sq.get(timeout=600)
    if got != "ready":
        job.join()
        return {"refused": got["refused"]}
    reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out, seconds + 8, lq))
    reader.start()
    loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src, rate, seconds))
    loader.start()
    loader.join()
    end = sq.get()
    job.join()
    lat = lq.get()
    reader.join()
    out_: dict = {"percentiles": topics.latency_percentiles(lat, warmup)}
    if isinstance(end, dict):
        out_.update(end)
    return out_


# ---------------------------------------------------------------- PyFlink with KafkaSink EXACTLY_ONCE


def _pyflink_setup() -> tuple[str, Path]:
    """The PyFlink venv's python and the peer script (both made or fetched on first use)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers.run_peers import PEERS_DIR, ensure_flink_kafka_jars, ensure_venv

    ensure_flink_kafka_jars()
    return str(ensure_venv("pyflink")), PEERS_DIR / "pyflink_kafka_count.py"


def run_pyflink(cluster, interval: float, n: int, load: float, seconds: float, warmup: float,
                python_mode: str = "process") -> dict:
    """PyFlink: Flink's Kafka source -> key_by -> running count in Python -> ``KafkaSink``
    EXACTLY_ONCE (benchmarks/peers/pyflink_kafka_count.py, in the PyFlink venv), checkpoints every
    ``interval``. Records/s as for the others, on a bounded run; latency on a running job, loaded
    once its first checkpoint completed. A job that fails is kept as an
    ``error`` (its cause's line), not turned into a number."""
    import queue as queue_mod
    import subprocess

    python, script = _pyflink_setup()
    common = ["--bootstrap", cluster.bootstrap_servers, "--interval", str(interval), "--python-mode", python_mode]
    src = f"pyflink-in-{interval}-{time.time_ns()}"
    out = src.replace("-in-", "-out-")
    cluster.create_topic(src, 4)
    cluster.create_topic(out, 2)
    ctx = mp.get_context("spawn")
    prod = ctx.Process(target=topics.produce_bulk, args=(cluster.bootstrap_servers, src, n))
    prod.start()
    prod.join()
    t_run = time.time()
    bounded = subprocess.run([python, str(script), *common, "--source-topic", src, "--sink-topic", out,
                              "--group", f"{src}-g", "--bounded"], capture_output=True, text=True, timeout=420)
    print(f"pyflink {python_mode} {interval}: bounded run {time.time() - t_run:.1f} s (JVM start-up in)",
          file=sys.stderr, flush=True)
    got = last_json(bounded.stdout)
    if bounded.returncode != 0 or got is None:
        return {"error": flink_error(bounded.stderr + bounded.stdout)}
    # every input must come out once, visible at read_committed: the sink's transactions were committed
    committed: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
    topics.reader(cluster.bootstrap_servers, out, 5.0, committed)
    outputs = len(committed.get())
    res: dict = {"rps": n / got["seconds_steady"], "rps_total": n / got["seconds_execute"],
                 "checkpoints": got["checkpoints"], "outputs": outputs, "version": got["version"]}
    src2, out2 = src + "-lat", out + "-lat"
    cluster.create_topic(src2, 4)
    cluster.create_topic(out2, 2)
    group = f"{src2}-g"
    # the rate of the latency run: a fraction of the steady rate, as for Spark (PyFlink's start-up,
    # JVM and Python workers, is seconds: a fraction of the rate with it would be a trickle)
    rate = res["rate"] = max(100.0, load * res["rps"])
    with tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen([python, str(script), *common, "--source-topic", src2, "--sink-topic", out2,
                                "--group", group], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               text=True)
        assert job.stdin is not None and job.stdout is not None
        try:
            t_wait = time.time()
            first = job.stdout.readline()  # {"running": job id} once a checkpoint completed; "" if it died
            if not first.startswith("{"):
                job.wait(timeout=60)
                err.seek(0)
                res["error"] = flink_error(err.read() + first)
                return res
            print(f"pyflink {python_mode} {interval}: latency job ready after {time.time() - t_wait:.1f} s",
                  file=sys.stderr, flush=True)
            lq = ctx.Queue()
            reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out2,
                                                       seconds + 8 + 2 * interval, lq))
            reader.start()
            loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src2, rate, seconds))
            loader.start()
            loader.join()
            lat = lq.get()
            reader.join()
            job.stdin.write("stop\n")
            job.stdin.flush()
            rest, _ = job.communicate(timeout=120)
        except BaseException:
            job.kill()
            job.wait()
            raise
        end = last_json(rest)
        if job.returncode != 0 or end is None:
            err.seek(0)
            res["error"] = f"latency run: {flink_error(err.read() + rest)}"
    res["percentiles"] = topics.latency_percentiles(lat, warmup)
    res["latency_checkpoints"] = end["checkpoints"] if end else None
    res["latency_seconds"] = end["seconds_execute"] if end else None
    res["expected_samples"] = int(rate * max(0.0, seconds - warmup))
    return res


def _pyflink_row(got: dict, interval: float, n: int, python_mode: str) -> dict:
    """The CSV row of one PyFlink run: its numbers, or the error it ended with in ``note``."""
    row = {"system": f"pyflink-kafkasink-{python_mode}", "guarantee": "exactly-once", "interval_s": interval,
           "records_per_s": "", "records_per_s_with_startup": "", "latency_rate": "", "p50_ms": "",
           "p99_ms": "", "latency_samples": 0, "epochs": "", "note": ""}
    notes = []
    if "rps" in got:
        row.update(records_per_s=round(got["rps"]), records_per_s_with_startup=round(got["rps_total"]),
                   epochs=got["checkpoints"])
        notes.append(f"apache-flink {got['version']}, flink-sql-connector-kafka 5.0.0-2.2, "
                     f"{python_mode} mode, bundles of 1000 records or 1 s (Flink's defaults)")
        if got["outputs"] != n:
            notes.append(f"{got['outputs']} outputs read at read_committed for {n} inputs")
    if "percentiles" in got:
        p50, p99, n_lat = got["percentiles"]
        row.update(latency_rate=round(got["rate"]), p50_ms=round(p50, 1), p99_ms=round(p99, 1), latency_samples=n_lat)
        if got.get("latency_checkpoints") is not None:
            notes.append(f"latency run: {got['latency_checkpoints']} checkpoints completed in "
                         f"{got['latency_seconds']:.0f} s")
        if n_lat < 0.9 * got["expected_samples"]:
            notes.append(f"only {n_lat} of ~{got['expected_samples']} outputs read after warm-up: the job fell "
                         f"behind, the latency of the rest is not in p99")
    if "error" in got:
        notes.append(f"failed: {got['error']}")
    row["note"] = "; ".join(notes)
    return row


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    # the local driver forks its workers from this process: load pyarrow.parquet (state files)
    # and pandas (pyarrow imports it on the first Table it builds) once here, or every worker
    # pays the imports (seconds on a loaded machine) inside its first epochs
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000, help="input records of the throughput run")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the latency run")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of the latency run left out")
    ap.add_argument("--load", type=float, default=0.5, help="latency run's rate, as a fraction of max throughput")
    ap.add_argument("--intervals", default="0.1,1.0", help="epoch intervals (s), comma-separated")
    ap.add_argument("--modes", default="aligned,tracker")
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--real-time", action="store_true",
                    help="also Spark's Real-time Mode (with its allowlist check, then without) at the "
                         "micro-batch latency run's rate")
    ap.add_argument("--pyflink", nargs="?", const="process", default="",
                    help="also PyFlink with KafkaSink EXACTLY_ONCE, Python in these modes (comma-separated: "
                         "process, thread; default process, Flink's own); its venv and Flink's Kafka "
                         "connector are made or fetched on first use")
    ap.add_argument("--quick", action="store_true", help="50k records, 10 s latency runs")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="kafka", help="results file name (CSV and PNG)")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.seconds, args.warmup = 50_000, 10.0, 3.0
    from epochstream.deploy.kafka_broker import KafkaCluster

    intervals = [float(x) for x in args.intervals.split(",")]
    rows = []
    with KafkaCluster(1) as cluster:
        for interval in intervals:
            for mode in filter(None, args.modes.split(",")):
                rps, total, rate, (p50, p99, n_lat), epochs, cpu = run_epochstream(
                    cluster, mode, interval, args.records, args.load, args.seconds, args.warmup)
                rows.append({"system": f"epochstream-{mode}", "guarantee": "exactly-once", "interval_s": interval,
                             "records_per_s": round(rps), "records_per_s_with_startup": round(total),
                             "latency_rate": round(rate), "p50_ms": round(p50, 1),
                             "p99_ms": round(p99, 1), "latency_samples": n_lat, "epochs": epochs, **cpu})
                print(rows[-1], flush=True)
            if not args.no_spark and spark_jars():
                rps, total, rate, (p50, p99, n_lat), batches, cpu = run_spark(
                    cluster, interval, args.records, args.load, args.seconds, args.warmup)
                rows.append({"system": "spark-structured-streaming", "guarantee": "at-least-once",
                             "interval_s": interval, "records_per_s": round(rps),
                             "records_per_s_with_startup": round(total), "latency_rate": round(rate),
                             "p50_ms": round(p50, 1), "p99_ms": round(p99, 1), "latency_samples": n_lat,
                             "epochs": batches, **cpu})
                print(rows[-1], flush=True)
                if args.real_time and not any(r["system"].startswith("spark-real-time") for r in rows):
                    rows.extend(_real_time_rows(cluster, interval, rate, args))  # once: it has no interval
            elif not args.no_spark:
                print("spark peer skipped: no jars in jars/kafka-spark/lib (bash scripts/setup.sh)", file=sys.stderr)
            for python_mode in filter(None, args.pyflink.split(",")):
                got = run_pyflink(cluster, interval, args.records, args.load, args.seconds, args.warmup, python_mode)
                rows.append(_pyflink_row(got, interval, args.records, python_mode))
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    for r in rows:
        r["load_avg_1m"] = round(load[0], 2)
        for k in ("cpu_busy_pct", "cpu_steal_pct", "cpu_saturated_pct"):  # sampled for the latency runs
            r.setdefault(k, "")
        r.setdefault("note", "")
    _summary(rows)
    write_csv(out / f"{args.name}.csv", rows)
    _plot(rows, out / f"{args.name}.png")
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"wrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def _real_time_rows(cluster, interval: float, rate: float, args) -> list[dict]:
    """Spark Real-time Mode rows: with the allowlist check (Spark's answer, kept as it is) and
    without it, the setting that answer names."""
    rows = []
    for check, stateless, label in ((True, False, ""), (False, False, " (allowlistCheck=false)"),
                                    (True, True, " stateless, no count")):
        got = run_spark_real_time(cluster, rate, args.seconds, args.warmup, check, stateless=stateless)
        row = {"system": f"spark-real-time{label}",
               "guarantee": "at-least-once", "interval_s": interval, "records_per_s": "",
               "records_per_s_with_startup": "", "latency_rate": round(rate), "p50_ms": "", "p99_ms": "",
               "latency_samples": 0, "epochs": "", "note": "real-time mode, batch duration 5 s"}
        if "refused" in got:
            row["note"] = f"refused: {got['refused']}"
        else:
            p50, p99, n_lat = got["percentiles"]
            row.update(p50_ms=round(p50, 1), p99_ms=round(p99, 1), latency_samples=n_lat)
            produced = int(rate * max(0.0, args.seconds - args.warmup))
            if "failed" in got:
                row["note"] = f"failed while running: {got['failed']}"
            elif n_lat < 0.5 * min(produced, KEYS * (args.seconds - args.warmup)):
                # fewer outputs than one per key per second: the query stopped producing
                row["note"] = (f"output stalled: {n_lat} records read after warm-up for {produced} produced "
                               f"(see Spark's log)")
        rows.append(row)
        print(row, flush=True)
    return rows


def _summary(rows: list[dict]) -> None:
    """The table, and the targets per epochstream row: records/s >= 1.5x Spark's at an
    equal or lower p99 (same interval), and p99 <= 2 x interval + 100 ms at the latency load."""
    print(f"\n{'system':28} {'interval':>8} {'records/s':>10} {'w/ start':>9} {'load/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'x Spark':>8} {'>=1.5x & p99<=Spark':>20} {'p99<=2i+100ms':>14} {'cpu busy/sat %':>14}")
    spark = {r["interval_s"]: r for r in rows if r["system"] == "spark-structured-streaming"}
    for r in rows:
        ratio = target1 = target2 = ""
        if r["system"].startswith("epochstream"):
            sp = spark.get(r["interval_s"])
            if sp is not None and sp["records_per_s"]:
                x = r["records_per_s"] / sp["records_per_s"]
                ratio = f"{x:.2f}"
                target1 = "yes" if x >= 1.5 and r["p99_ms"] <= sp["p99_ms"] else "no"
            target2 = "yes" if r["p99_ms"] <= 2000 * r["interval_s"] + 100 else "no"
            r.update(x_spark=ratio, target_throughput=target1, target_p99=target2)
        cpu = f"{r['cpu_busy_pct']:.0f} / {r['cpu_saturated_pct']:.0f}" if r.get("cpu_busy_pct") != "" else ""
        print(f"{r['system']:28} {r['interval_s']:>8} {r['records_per_s']:>10} {r['records_per_s_with_startup']:>9} "
              f"{r['latency_rate']:>8} {r['p50_ms']:>8} {r['p99_ms']:>8} {ratio:>8} {target1:>20} {target2:>14} "
              f"{cpu:>14}")
    for r in rows:
        r.setdefault("x_spark", "")
        r.setdefault("target_throughput", "")
        r.setdefault("target_p99", "")


def _plot(rows, path: Path) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    systems = sorted({r["system"] for r in rows})
    intervals = sorted({r["interval_s"] for r in rows})
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(intervals))]
        get = {r["interval_s"]: r for r in rows if r["system"] == s}
        a.bar(xs, [get[iv]["records_per_s"] or 0 if iv in get else 0 for iv in intervals], width, label=s)
        b.bar(xs, [get[iv]["p99_ms"] or 0 if iv in get else 0 for iv in intervals], width, label=s)
    for ax, title in ((a, "records/s (bounded input, start-up left out)"),
                      (b, "p99 latency, ms (produce -> read_committed)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(intervals))], [f"{iv:g} s epochs" for iv in intervals])
        ax.set_title(title)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
