"""Kafka JSON -> parse -> PySpark pandas state -> Kafka: the pipeline users run, on epochstream and Spark.

Workload: one KRaft broker (``epochstream.deploy.kafka_broker``), an input topic of 4 partitions holding
``--records`` JSON records ``{"k": "k<i % KEYS>", "v": i, "ts": <ms>}`` (Kafka key = k), for each of
``--keys`` (default 1,000 and 100,000), produced once and read by every system in the same run. Each
system parses the JSON, runs one of two user functions, written as Spark users write them and run
unchanged on both sides (``--functions``; benchmarks/kafka/kafka_json_workload.py), and writes one JSON row
``{"k", "c", "ts"}`` per key per micro-batch (the key's running count and the newest ``ts`` of its rows in
the batch) to an output topic of 2 partitions (``--delta``: to a Delta table instead):

- ``apply``: ``applyInPandasWithState`` with ``count_ts`` of benchmarks/spark/pyspark_stateful.py (the running
  count of ``count`` that also carries the newest ts);
- ``transform``: ``transformWithStateInPandas`` with a ``StatefulProcessor`` holding a ValueState (the
  count) and a MapState (a histogram of ``v % 10``).

Systems:

- **epochstream**: local driver, parallelism 2, 1 s epochs, ``--modes`` aligned and tracker,
  ``KafkaSink(guarantee="exactly-once")`` (``DeltaSink`` with ``--delta``). Path ``rows`` (``--paths``):
  ``from_kafka`` dict records (``records="dict"`` where ``from_kafka`` has ``records``) ->
  ``map(json.loads)`` -> the wrapper with ``input_schema``. Path ``arrow``:
  ``from_kafka(records="arrow")`` -> ``from_json(schema)`` -> the same wrapper; run only where the
  installed epochstream has both (feature-detected, so the same script measures before and after),
  otherwise its rows say why in ``note``. Paths ``dicts`` and ``batches`` feed the same records without
  Kafka (Python dicts from a collection source; Arrow batches built by hand), throughput only, for the
  ratios to Spark's Kafka run of the same function.
- **Spark Structured Streaming** (``local[2]``, 2 shuffle partitions, RocksDB state store): its Kafka
  source, ``from_json`` with the same schema, ``groupBy("k")`` + the same function, 1 s processing-time
  trigger, its Kafka sink (``--delta``: its Delta sink, append mode). Spark's Kafka sink is at-least-once:
  it has no transactions (epochstream's and PyFlink's output is exactly-once, visible when committed).
- **PyFlink** (``--pyflink``, apache-flink 2.3 in benchmarks/.venv-pyflink with Flink's Kafka connector,
  made on first use): PyFlink cannot run PySpark's functions, so the same logic runs in its keyed API
  (benchmarks/peers/pyflink_kafka_json_state.py: JSON parsed by its Kafka table source, a Python
  ``KeyedProcessFunction``, one row per key per second, ``KafkaSink`` ``EXACTLY_ONCE``, checkpoints every
  second). A failure to install or run is kept in ``note``.

Figures per system, keys, function and mode/path (a CSV row each, per ``--repeats``):

- ``rows_per_s``: input rows/s on the pre-produced topic with start-up left out the same way for every
  system, as benchmarks/kafka/kafka.py does: epochstream's input of the epochs after the first that read any,
  over the time from that epoch's commit to the last one's; Spark's rows of the micro-batches after the
  first, over the time from the end of the first to the end of the last (``maxOffsetsPerTrigger`` =
  records / 35, at least 10,000, or ``--spark-max-offsets``: >= 30 batches, each more than a second of
  work, saturated; ``note`` says if it was not, and has the median batch's parts from Spark's progress).
  Spark pays its pandas calls per key per batch, so its rows/s grows with the batch size this sets;
  PyFlink's records over first record in its Python function -> job finished.
  ``rows_per_s_with_startup``: records over the whole run (epochstream from the job's start, Spark from
  the query's start, PyFlink from ``execute()``; all after their interpreter or JVM is up).
- ``epoch_p50_ms`` / ``epoch_p99_ms`` on that saturated run, over the epochs that read input after the
  first ``--skip-batches`` (warm-up): epochstream's trigger-to-commit of each completed epoch (the job's
  epoch log), Spark's ``triggerExecution`` of each micro-batch, PyFlink's checkpoint durations.
  ``epochs_measured`` says how many (>= 30 wanted: a smaller count is noted). ``lat_epoch_p99_ms``: the
  same at the latency run's load.
- ``p50_ms`` / ``p99_ms``: end-to-end latency at ``--load`` (50%) of each system's own steady rate: a
  separate open-loop load generator process (benchmarks/kafka/kafka.py's) produces for ``--seconds`` once the job
  runs, each record's ``ts`` the moment it was due; a reader process (kafka.py's) takes each output row
  when it first is visible at ``read_committed``: latency = then - ts, the first ``--warmup`` seconds
  left out. Each output row carries the newest input ts of its key in its micro-batch, so the latency is
  that of the newest row: this favours per-key-per-batch outputs, equally on both sides. With ``--delta``
  a row is visible when the log entry of its table version exists (its modification time).
  ``generator_lag_ms``: how far the load generator fell behind its schedule (it is one Python process; at
  a few hundred thousand JSON records/s on two cores it cannot keep up, and its delay is in the latency:
  ``note`` says so above a second). ``same_load_*`` (epochstream): a second latency run at Spark's load
  (50% of Spark's rate), the comparison the targets use: both systems under the same load.
- ``--spark-records``: Spark reads only that prefix of the topic, and paths ``dicts`` and ``batches`` are fed
  that many records: the topic is sized so epochstream's saturated run has >= 30 epochs, which at
  Spark's rate would take tens of minutes for a rate that is steady after a few micro-batches.
  ``cpu_busy_pct`` / ``cpu_steal_pct`` / ``cpu_saturated_pct``: how busy the whole machine was while the
  load ran (``MachineCpu``; broker, load generator and reader included). ``load_avg_start`` /
  ``load_avg_1m``: the machine's load average when the saturated run started / when the row was done.
- ``master_cpu_s`` and ``master_cpu_s_per_m_out`` (epochstream): the job master's own CPU seconds over the
  saturated run (the driver process, ``getrusage(RUSAGE_SELF)`` around ``Pipeline.run``; its worker
  processes are not in it), and per million output records (counted in the topic). ``--master-cpu`` adds
  saturated runs at parallelism 1 (the p=2 rows have it anyway).

Checks: epochstream's committed output must hold the expected running counts: per key the counts strictly
increase in output order (no output committed twice, no state replayed), each count carries the ts of the
key's record it ends at (each increment is exactly the key's next records) and the last is the key's
input count. A failed check, or an epochstream job that failed (one restart is allowed), is kept in
``check`` and ``note`` and makes the exit code 1. Spark's (and
PyFlink's) output is checked for complete final counts (``check``), not failed on.

Writes benchmarks/results/<--name>.csv and .png (default ``kafka_json_pandas``) and prints a summary with
epochstream / Spark rows/s and the targets: rows/s >= 3x Spark's at 1,000 keys (and below), >= 2x above;
epoch p99 <= 1 s at 1 s epochs (on the saturated run); end-to-end p99 below Spark's at the same load
(Spark's latency run's). At 100,000 keys an epoch's pandas calls can outlast the worker step timeout (120 s by default:
the worker is declared stuck and the job fails over; the row says so): ``--step-timeout`` raises it.
With ``--repeats N`` every measurement runs N times and the summary quotes the worst repeat
(lowest ratio, highest p99). ``--quick`` is a smoke run of a few minutes. Not a test: nothing asserts a
timing.

    PYTHONPATH=$PWD/src nice -n 5 python benchmarks/kafka/kafka_json_pandas.py --keys 1000 \\
        --functions apply --modes aligned --paths rows --name kafka_json_pandas_baseline
    PYTHONPATH=$PWD/src python benchmarks/kafka/kafka_json_pandas.py --quick     # a smoke run, ~4 minutes
"""

from __future__ import annotations

import argparse
import csv
import inspect
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, MachineCpu  # noqa: E402
from benchmarks.kafka import topics  # noqa: E402
from benchmarks.kafka.kafka_json_workload import (  # noqa: E402
    FUNCTIONS,
    SCHEMA,
    JsonRecord,
    check_counts,
    env_with_repository,
    generator_lag_ms,
    output_key,
    parse_json,
    read_delta,
    read_topic,
    ts_of_count,
)
from benchmarks.peers.run_peers import flink_error, last_json  # noqa: E402

INTERVAL = 1.0
#: records of the pre-produced topic by key count: >= 30 epochs' input at the rate the faster system may
#: reach (1,000 keys: 60K rows/s for 40 s; 100,000 keys: 10K rows/s for 30 s, 3 records a key; on the
#: 2-core machine today's rows path did 14K and 0.8K rows/s, Spark 10.6K and ~0.3K)
DEFAULT_RECORDS = {1_000: 2_400_000, 100_000: 300_000}
QUICK_RECORDS = 60_000
MIN_EPOCHS = 30
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:5.0f}s] {msg}", flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------- the new path, where it exists


def arrow_path_missing() -> str | None:
    """Why path ``arrow`` cannot run on the installed epochstream (None: it can)."""
    from epochstream import Pipeline
    from epochstream.api.pipeline import Stream

    missing = []
    if "records" not in inspect.signature(Pipeline.from_kafka).parameters:
        missing.append('from_kafka(records="arrow")')
    if not hasattr(Stream, "from_json"):
        missing.append("Stream.from_json")
    return f"this epochstream has no {' and no '.join(missing)}" if missing else None


# ---------------------------------------------------------------- epochstream


def _fed_dicts(p: Any, n: int, keys: int, base_ms: int) -> Any:
    """Path ``dicts``: the workload's records as Python dicts in a collection source (two splits:
    record i in split i % 2, so a key's records keep their order)."""
    return p.from_collection([{"k": f"k{i % keys}", "v": i, "ts": base_ms + i} for i in range(n)], splits=2,
                             uid="src")


def _fed_batches(p: Any, n: int, keys: int, base_ms: int) -> Any:
    """Path ``batches``: the workload's records as Arrow batches built by hand (``generate_batches``)."""
    import numpy as np
    import pyarrow as pa

    names = np.array([f"k{j}" for j in range(keys)], dtype=object)

    def make(start: int, stop: int) -> Any:
        i = np.arange(start, stop, dtype=np.int64)
        return pa.RecordBatch.from_arrays([pa.array(names[i % keys], pa.string()), pa.array(i),
                                           pa.array(base_ms + i)], names=["k", "v", "ts"])

    return p.generate_batches(make, count=n, num_splits=2, uid="src", block_rows=65536)


#: paths that feed the same records without Kafka: Python dict records, and Arrow batches
FED = {"dicts": _fed_dicts, "batches": _fed_batches}


def es_pipeline(bootstrap: str, src: str, out: str, *, mode: str, parallelism: int, path: str, function: str,
                bounded: bool, staging: str, delta: str | None, args):
    """The job: Pipeline defaults but for parallelism, mode, 1 s epochs, one restart (a run that fails
    over is reported, not retried ten times) and ``--batch-rows`` / ``--step-timeout`` when given."""
    from epochstream import KafkaSink, Pipeline

    extra: dict[str, Any] = {}
    if args.step_timeout is not None:
        from epochstream.deploy.liveness import HeartbeatConfig

        extra["heartbeat"] = HeartbeatConfig(step_timeout=args.step_timeout)
    p = Pipeline(f"kafka-json-pandas-{mode}-{path}", parallelism=parallelism, mode=mode,
                 checkpoint_interval=INTERVAL, batch_rows=args.batch_rows, restart_attempts=1, **extra)
    end = "latest" if bounded else None
    if path in FED:  # the same records, not from Kafka: Python dicts from a collection, or Arrow batches
        parsed = FED[path](p, args.fed_records, args.fed_keys, args.fed_base_ms)
    elif path == "arrow":  # the new path (arrow_path_missing says whether this epochstream has it)
        batches = p.from_kafka(bootstrap, src, end=end, uid="src", records="arrow")  # type: ignore[call-arg]
        parsed = batches.from_json(SCHEMA)
    else:  # today's path: a dict per record (asked for where from_kafka can also make Arrow batches)
        dicts = {"records": "dict"} if "records" in inspect.signature(Pipeline.from_kafka).parameters else {}
        parsed = p.from_kafka(bootstrap, src, end=end, uid="src", **dicts).map(parse_json)
    fn = FUNCTIONS[function]
    result = fn.epochstream(parsed, "Append" if delta else "Update")
    if delta:
        import pyarrow as pa

        from epochstream.backends.delta.sink import DeltaSink

        ts_type = pa.float64() if fn.output_schema.endswith("double") else pa.int64()
        sink: Any = DeltaSink(delta, pa.schema([("k", pa.string()), ("c", pa.int64()), ("ts", ts_type)]))
    else:
        # the key as a column where the sink encodes Arrow batches per column (else a function of a row)
        key: Any = "k" if hasattr(KafkaSink, "encode_batch") else output_key
        sink = KafkaSink(bootstrap, out, guarantee="exactly-once", key=key, staging=staging)
    result.sink(sink, uid="out")
    return p


class Progress:
    """A line every ``every`` seconds while a job runs: its newest completed epoch and the records
    read by then (from its checkpoint folder: no Kafka client in the driver process, which forks the
    workers). ``ready`` is set at the first completed epoch (the job runs)."""

    def __init__(self, label: str, chk: Path, total: int | None, every: float = 15.0) -> None:
        self.label, self.chk, self.total, self.every = label, chk, total, every
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _latest(self) -> tuple[int, int] | None:
        from epochstream.backends.local import LocalCheckpointStorage

        try:
            got = LocalCheckpointStorage(self.chk).latest() if self.chk.exists() else None
        except Exception:  # a checkpoint being written or discarded: next time
            return None
        if got is None:
            return None
        manifest = got[0]
        read = sum(int(o) for s in manifest.get("sources", {}).values() for o in s.get("offsets", {}).values())
        return int(manifest["epoch"]), read

    def _run(self) -> None:
        t_line = time.time()
        while not self._stop.wait(0.2):
            latest = self._latest() if (not self.ready.is_set() or time.time() - t_line >= self.every) else None
            if latest is None:
                continue
            self.ready.set()
            if time.time() - t_line >= self.every:
                t_line = time.time()
                of = f" of {self.total:,}" if self.total else ""
                log(f"    {self.label}: epoch {latest[0]} committed, {latest[1]:,}{of} records read")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def job_error(exc: BaseException) -> str:
    """A failed job's error on one line."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def data_epochs(res) -> list[dict]:
    return [e for e in res.metrics.get("epochs", []) if e.get("state") == "completed" and e.get("records")]


def es_throughput(cluster, src: str, n: int, keys: int, base_ms: int, function: str, mode: str, path: str,
                  parallelism: int, args) -> dict:
    """The saturated run on the pre-produced topic: rows/s, epoch latencies, master CPU, the check."""
    out = f"{src}-es-{function}-{mode}-{path}-p{parallelism}-{time.time_ns()}"
    if not args.delta:
        cluster.create_topic(out, 2)
    label = f"epochstream {mode}/{path} p={parallelism}"
    load = os.getloadavg()[0]
    args.fed_records, args.fed_keys, args.fed_base_ms = n, keys, base_ms
    with tempfile.TemporaryDirectory(prefix="kjp-es-") as d:
        delta = f"{d}/table" if args.delta else None
        job = es_pipeline(cluster.bootstrap_servers, src, out, mode=mode, parallelism=parallelism, path=path,
                          function=function, bounded=True, staging=f"{d}/st", delta=delta, args=args)
        progress = Progress(label, Path(d, "chk"), n)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        try:
            res = job.run("local", checkpoint_dir=f"{d}/chk")
        except Exception as exc:  # a job that failed is a result too, loudly
            return {"failed": True, "check": "JOB FAILED", "notes": [f"saturated run failed: {job_error(exc)}"]}
        finally:
            progress.stop()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        outputs = read_delta(delta)[0] if delta else read_topic(cluster.bootstrap_servers, out)
    master = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    # a key's records reach its subtask in order from Kafka (one partition) and the collection (one
    # split); generated batches deal blocks to both splits, so only counts are checked there
    ordered = path != "batches"
    check = check_counts(outputs, n, keys, ts_of=ts_of_count(keys, base_ms) if ordered else None)
    epochs = data_epochs(res)
    lat = [e["trigger_to_commit_seconds"] * 1000 for e in epochs][args.skip_batches:]
    rps_total = n / res.metrics["run_seconds"]
    notes = [f"check {check.text()}"]
    if res.restarts:
        notes.append(f"{res.restarts} restarts")
    if len(lat) < MIN_EPOCHS:
        notes.append(f"only {len(lat)} epochs measured (raise --records for >= {MIN_EPOCHS})")
    steady = topics.steady_rate(res.metrics.get("epochs", []))
    if steady is None:
        notes.append("too few epochs for a steady rate: rows_per_s is the rate with start-up")
    return {"rows_per_s": steady or rps_total,
            "rows_per_s_with_startup": rps_total, "epochs_measured": len(lat), "epoch_p50_ms": pct(lat, 0.5),
            "epoch_p99_ms": pct(lat, 0.99), "master_cpu_s": master, "output_records": check.outputs,
            "master_cpu_s_per_m_out": master / check.outputs * 1e6 if check.outputs else float("nan"),
            "check": "ok" if check.ok else "FAILED", "load_avg_start": round(load, 2), "failed": not check.ok,
            "notes": notes}


def es_latency(cluster, keys: int, function: str, mode: str, path: str, rate: float, args) -> dict:
    """The job at ``rate`` rows/s of open-loop load: end-to-end latency, epoch latencies, machine CPU."""
    tag = f"{function}-{mode}-{path}-{time.time_ns()}"
    src, out = f"lat-in-{tag}", f"lat-out-{tag}"
    cluster.create_topic(src, 4)
    if not args.delta:
        cluster.create_topic(out, 2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = int(rate * args.seconds)
    reader = None
    if not args.delta:
        reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out, args.seconds + 30, q))
        reader.start()
    # the loader starts once the job committed its first epoch (its source group has offsets)
    lag_file = tempfile.mktemp(prefix="kjp-lag-")
    loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src, rate, args.seconds,
                                                   "epochstream-src", JsonRecord(keys, lag_file=lag_file)))
    label = f"epochstream {mode}/{path} at {rate:,.0f} rows/s"
    with tempfile.TemporaryDirectory(prefix="kjp-es-lat-") as d:
        delta = f"{d}/table" if args.delta else None
        job = es_pipeline(cluster.bootstrap_servers, src, out, mode=mode, parallelism=2, path=path,
                          function=function, bounded=False, staging=f"{d}/st", delta=delta, args=args)
        loader.start()
        progress = Progress(label, Path(d, "chk"), None)
        machine: list[MachineCpu] = []

        def sample_once_ready() -> None:  # the machine while the load runs, not the job's start-up
            if progress.ready.wait(120):
                machine.append(MachineCpu(duration=args.seconds))

        threading.Thread(target=sample_once_ready, daemon=True).start()
        try:
            res = job.run("local", checkpoint_dir=f"{d}/chk", duration=args.seconds + 20)
        except Exception as exc:
            loader.kill()
            loader.join()
            if reader is not None:  # its result first: a process that put much on a queue joins after the get
                q.get()
                reader.join()
            return {"latency_rate": rate, "failed": True, "check": "JOB FAILED",
                    "notes": [f"latency run failed: {job_error(exc)}"]}
        finally:
            progress.stop()
        if delta:
            outputs, visible = read_delta(delta)
            lat = [(r["ts"], at * 1000 - r["ts"]) for r, at in zip(outputs[0], visible, strict=True)]
        else:
            outputs = read_topic(cluster.bootstrap_servers, out)
    loader.join()
    if reader is not None:
        lat = q.get()
        reader.join()
    check = check_counts(outputs, n, keys, complete=False)
    epochs = [e["trigger_to_commit_seconds"] * 1000 for e in data_epochs(res)][args.skip_batches:]
    p50, p99, samples = topics.latency_percentiles(lat, args.warmup)
    notes = [f"latency run check {check.text()}"] + ([f"latency run: {res.restarts} restarts"] if res.restarts else [])
    lag = generator_lag_ms(lag_file)
    notes += lag_note(lag, rate)
    if check.keys_complete < check.keys_expected:
        notes.append(f"latency run: {check.keys_expected - check.keys_complete} keys short of their input "
                     f"count when the job stopped (it had not caught up)")
    return {"latency_rate": rate, "p50_ms": p50, "p99_ms": p99, "latency_samples": samples, "generator_lag_ms": lag,
            "lat_epoch_p99_ms": pct(epochs, 0.99), **(machine[0].stop() if machine else {}),
            "failed": not check.ok and any("duplicate" in p or "not in the input" in p for p in check.problems),
            "notes": notes}


# ---------------------------------------------------------------- Spark Structured Streaming


def _spark_progress(q) -> list[dict]:
    from datetime import datetime

    out = []
    for p in q.recentProgress:
        ts = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
        parts = {k: v for k, v in p["durationMs"].items() if k in SPARK_PARTS}
        state = p.get("stateOperators") or [{}]
        parts["stateCommit"] = sum(op.get("commitTimeMs", 0) for op in state)
        out.append({"batch": p["batchId"], "rows": p["numInputRows"], "start": ts,
                    "ms": p["durationMs"].get("triggerExecution", 0), "parts": parts})
    return out


#: the parts of a micro-batch's time kept from Spark's progress (``durationMs``)
SPARK_PARTS = ("addBatch", "queryPlanning", "walCommit", "commitOffsets", "latestOffset", "getBatch")


def spark_breakdown(batches: list[dict]) -> str:
    """The median of each part of the micro-batches' time, as a note."""
    if not batches:
        return ""
    names = [*SPARK_PARTS, "stateCommit"]
    med = {k: statistics.median(b["parts"].get(k, 0) for b in batches) for k in names}
    return ("median micro-batch " + f"{statistics.median(b['ms'] for b in batches):,.0f} ms: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in med.items() if v))


def _spark_run(bootstrap: str, src: str, out: str, function: str, n: int, max_offsets: int, seconds: float,
               queue, delta: str | None, t0: float, extra: dict[str, str]) -> None:
    """Spark's query in its own process. ``n`` > 0: the saturated run, until ``n`` rows were read;
    otherwise the latency run: "ready" once the first (empty) micro-batch ran, then ``seconds`` more.
    Puts {"start": query start, "progress": [...], "error": ..., "settings": ...} on ``queue``."""
    global T0
    T0 = t0
    # PySpark's own serializer warns about pandas once per call in every worker: not this run's news
    os.environ["PYTHONWARNINGS"] = "ignore::FutureWarning"
    got: dict[str, Any] = {"start": time.time(), "progress": [], "error": None, "settings": {}}
    try:
        _spark_query(bootstrap, src, out, function, n, max_offsets, seconds, queue, delta, got, extra)
    except Exception as exc:  # the parent waits on the queue: always answer
        got["error"] = got["error"] or f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}"
    queue.put(got)


def _spark_query(bootstrap: str, src: str, out: str, function: str, n: int, max_offsets: int, seconds: float,
                 queue, delta: str | None, got: dict, extra: dict[str, str]) -> None:
    from pyspark.sql import functions as F

    from benchmarks.spark.pyspark_stateful import spark_session

    conf = {"spark.jars": ",".join(topics.spark_jars()), "spark.sql.streaming.numRecentProgressUpdates": "10000",
            "spark.sql.session.timeZone": "UTC", **extra}
    if delta:
        from epochstream.backends import spark_session as es_spark

        conf.update(es_spark.delta_conf())  # its spark.jars (Delta's alone) is replaced by both sets
        conf["spark.jars"] = ",".join(topics.spark_jars() + es_spark.spark_jars(s3a=False))
    spark = spark_session(conf, app_name="kafka-json-pandas-spark")
    try:
        reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
                  .option("subscribe", src).option("startingOffsets", "earliest"))
        if n:
            reader = reader.option("maxOffsetsPerTrigger", str(max_offsets))
        parsed = reader.load().select(F.from_json(F.col("value").cast("string"), SCHEMA).alias("r")).select("r.*")
        result = FUNCTIONS[function].spark(parsed.groupBy("k"), "Append" if delta else "Update")
        chk = tempfile.mkdtemp(prefix="kjp-spark-chk-")
        trigger = f"{int(INTERVAL * 1000)} milliseconds"
        if delta:
            writer = (result.writeStream.format("delta").outputMode("append").option("checkpointLocation", chk)
                      .trigger(processingTime=trigger))
            got["start"] = time.time()
            q = writer.start(delta)
        else:
            value = F.to_json(F.struct("k", "c", "ts"))
            writer = (result.select(F.col("k").alias("key"), value.alias("value")).writeStream.format("kafka")
                      .option("kafka.bootstrap.servers", bootstrap).option("topic", out)
                      .option("checkpointLocation", chk).outputMode("update").trigger(processingTime=trigger))
            got["start"] = time.time()
            q = writer.start()
        try:
            if n:
                _until_read(q, n, got)
            else:
                while q.lastProgress is None and q.isActive:
                    time.sleep(0.2)
                if not q.isActive:
                    return
                queue.put("ready")
                time.sleep(seconds)
            if q.exception() is not None:
                got["error"] = str(q.exception()).splitlines()[0][:500]
            got["progress"] = _spark_progress(q)
            got["settings"] = {k: _spark_setting(spark, k) for k in dict.fromkeys([*SPARK_SHOWN, *extra])}
        finally:
            if q.exception() is not None and not got["error"]:
                got["error"] = str(q.exception()).splitlines()[0][:500]
            q.stop()
    finally:
        spark.stop()


#: Spark settings a row's note states (they move its figures; ``--spark-conf`` sets any)
SPARK_SHOWN = ("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
               "spark.sql.execution.arrow.maxRecordsPerBatch", "spark.sql.shuffle.partitions")


def _spark_setting(spark, key: str) -> str:
    """A setting's value in the session: set, else Spark's default (``SET key`` names it)."""
    try:
        return str(spark.conf.get(key))
    except Exception:  # not a registered SQL setting and not set: its module's default applies
        got = spark.sql(f"SET {key}").collect()
        value = got[0][1] if got else "<undefined>"
        return "default" if value == "<undefined>" else str(value)


def _until_read(q, n: int, got: dict) -> None:
    """Wait until the query has read ``n`` rows (a progress line every 15 s)."""
    t_line = time.time()
    limit = max(900.0, n / 100)  # a guard against a hung query: 100 rows/s is slower than any run seen
    deadline = time.time() + limit
    while q.isActive and time.time() < deadline:
        progress = _spark_progress(q)
        read = sum(p["rows"] for p in progress)
        if read >= n:
            return
        if time.time() - t_line >= 15:
            t_line = time.time()
            last = progress[-1] if progress else None
            log(f"    spark: {len(progress)} micro-batches, {read:,} of {n:,} rows read"
                + (f", last {last['rows']:,} rows in {last['ms']:,} ms" if last else ""))
        time.sleep(0.5)
    if q.isActive:  # the batches done are still measured; the check says the output is short
        got["stopped"] = f"stopped after {limit:.0f} s, before it read all {n:,} rows"


def spark_throughput(cluster, src: str, n: int, keys: int, function: str, args, topic_records: int) -> dict:
    out = f"{src}-spark-{function}-{time.time_ns()}"
    if not args.delta:
        cluster.create_topic(out, 2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    max_offsets = args.spark_max_offsets or max(10_000, n // (MIN_EPOCHS + args.skip_batches + 3))
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kjp-spark-") as d:
        delta = f"{d}/table" if args.delta else None
        proc = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src, out, function, n, max_offsets,
                                                    0.0, q, delta, T0, args.spark_conf))
        proc.start()
        got = q.get()
        proc.join()
        batches = [p for p in got["progress"] if p["rows"]]
        if got["error"] or not batches:
            return {"failed": False, "notes": [f"spark failed: {got['error'] or 'no micro-batch read input'}"]}
        outputs = read_delta(delta)[0] if delta else read_topic(cluster.bootstrap_servers, out)
    read = sum(p["rows"] for p in got["progress"])
    # a prefix of the topic (--spark-records): the counts are checked, not that they are final
    check = check_counts(outputs, n, keys, ts_of=ts_of_count(keys, args.base_ms[keys]),
                         complete=read >= topic_records)
    end = batches[-1]["start"] + batches[-1]["ms"] / 1000
    later = batches[1:]
    first_end = batches[0]["start"] + batches[0]["ms"] / 1000
    rps = sum(p["rows"] for p in later) / (end - first_end) if later and end > first_end else float("nan")
    lat = [p["ms"] for p in batches][args.skip_batches:]
    notes = [f"maxOffsetsPerTrigger {max_offsets:,}", spark_breakdown(batches[args.skip_batches:]),
             f"check {check.text()}",
             "settings " + ", ".join(f"{'.'.join(k.split('.')[-2:])}={v}" for k, v in got["settings"].items())]
    if got.get("stopped"):
        notes.append(f"spark {got['stopped']}: rows/s from its {len(batches)} micro-batches")
    if lat and statistics.median(lat) < INTERVAL * 1000:
        notes.append("not saturated: micro-batches shorter than the trigger (raise --spark-max-offsets)")
    if len(lat) < MIN_EPOCHS:
        notes.append(f"only {len(lat)} micro-batches measured (raise --records for >= {MIN_EPOCHS})")
    return {"rows_per_s": rps, "rows_per_s_with_startup": read / (end - got["start"]), "epochs_measured": len(lat),
            "epoch_p50_ms": pct(lat, 0.5), "epoch_p99_ms": pct(lat, 0.99), "output_records": check.outputs,
            "check": ("complete" if check.keys_complete == check.keys_expected
                      else "prefix" if topic_records > n and not check.problems else "INCOMPLETE"),
            "load_avg_start": round(load, 2), "failed": False, "notes": notes}


def spark_latency(cluster, keys: int, function: str, rate: float, args) -> dict:
    tag = f"spark-{function}-{time.time_ns()}"
    src, out = f"lat-in-{tag}", f"lat-out-{tag}"
    cluster.create_topic(src, 4)
    if not args.delta:
        cluster.create_topic(out, 2)
    ctx = mp.get_context("spawn")
    sq, lq = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kjp-spark-lat-") as d:
        delta = f"{d}/table" if args.delta else None
        job = ctx.Process(target=_spark_run, args=(cluster.bootstrap_servers, src, out, function, 0, 0,
                                                   args.seconds + 20, sq, delta, T0, args.spark_conf))
        job.start()
        first = sq.get(timeout=900)
        if first != "ready":  # failed before its first micro-batch
            job.join()
            return {"latency_rate": rate, "failed": False,
                    "notes": [f"spark latency run failed: {first['error'] or 'the query stopped'}"]}
        reader = None
        if not delta:
            reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out, args.seconds + 20, lq))
            reader.start()
        lag_file = f"{d}/lag"
        loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src, rate, args.seconds, None,
                                                 JsonRecord(keys, lag_file=lag_file)))
        loader.start()
        machine = MachineCpu(duration=args.seconds)
        loader.join()
        lag = generator_lag_ms(lag_file)
        cpu = machine.stop()
        got = sq.get()
        job.join()
        if delta:
            outputs, visible = read_delta(delta)
            lat = [(r["ts"], at * 1000 - r["ts"]) for r, at in zip(outputs[0], visible, strict=True)]
        else:
            lat = lq.get()
            reader.join()  # type: ignore[union-attr]
    batches = [p for p in got["progress"] if p["rows"]][args.skip_batches:]
    p50, p99, samples = topics.latency_percentiles(lat, args.warmup)
    notes = [f"latency run: {spark_breakdown(batches)}"] if batches else []
    if got["error"]:
        notes.append(f"spark latency run failed: {got['error']}")
    notes += lag_note(lag, rate)
    return {"latency_rate": rate, "p50_ms": p50, "p99_ms": p99, "latency_samples": samples, "generator_lag_ms": lag,
            "lat_epoch_p99_ms": pct([p["ms"] for p in batches], 0.99), **cpu, "failed": False, "notes": notes}


# ---------------------------------------------------------------- PyFlink


def pyflink_setup() -> tuple[str, Path]:
    from benchmarks.peers.run_peers import PEERS_DIR, ensure_flink_kafka_jars, ensure_venv

    ensure_flink_kafka_jars()
    return str(ensure_venv("pyflink")), PEERS_DIR / "pyflink_kafka_json_state.py"


def pyflink_runs(cluster, src: str, n: int, keys: int, function: str, args) -> dict:
    """PyFlink's saturated run on the pre-produced topic, then its latency run at ``--load`` of its rate."""
    try:
        python, script = pyflink_setup()
    except Exception as exc:  # no venv, no connector: say why and go on
        return {"failed": False, "notes": [f"pyflink not run: {type(exc).__name__}: {exc}"]}
    common = ["--bootstrap", cluster.bootstrap_servers, "--interval", str(INTERVAL), "--function", function]
    out = f"{src}-pyflink-{function}-{time.time_ns()}"
    cluster.create_topic(out, 2)
    log(f"    pyflink {function}: saturated run")
    load = os.getloadavg()[0]
    try:
        bounded = subprocess.run([python, str(script), *common, "--source-topic", src, "--sink-topic", out,
                                  "--group", f"{out}-g", "--bounded"], capture_output=True, text=True,
                                 timeout=max(900.0, n / 500))
    except subprocess.TimeoutExpired as exc:
        return {"failed": False, "notes": [f"pyflink: saturated run timed out after {exc.timeout:.0f} s"]}
    got = last_json(bounded.stdout)
    if bounded.returncode != 0 or got is None or not got.get("seconds_steady"):
        return {"failed": False, "notes": [f"pyflink failed: {flink_error(bounded.stderr + bounded.stdout)}"]}
    check = check_counts(read_topic(cluster.bootstrap_servers, out), n, keys,
                         ts_of=ts_of_count(keys, args.base_ms[keys]))
    lat_ms = got["checkpoint_ms"][args.skip_batches:]
    row: dict = {"rows_per_s": n / got["seconds_steady"], "rows_per_s_with_startup": n / got["seconds_execute"],
                 "epochs_measured": len(lat_ms), "epoch_p50_ms": pct(lat_ms, 0.5), "epoch_p99_ms": pct(lat_ms, 0.99),
                 "output_records": check.outputs,
                 "check": "complete" if check.keys_complete == check.keys_expected else "INCOMPLETE",
                 "load_avg_start": round(load, 2), "failed": False,
                 "notes": [f"apache-flink {got['version']}, process mode, one row per key per second",
                           f"check {check.text()}", "epoch = checkpoint duration"]}
    rate = row["latency_rate"] = max(100.0, args.load * row["rows_per_s"])
    tag = f"pyflink-{function}-{time.time_ns()}"
    src2, out2 = f"lat-in-{tag}", f"lat-out-{tag}"
    cluster.create_topic(src2, 4)
    cluster.create_topic(out2, 2)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen([python, str(script), *common, "--source-topic", src2, "--sink-topic", out2,
                                "--group", f"{src2}-g"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               text=True)
        assert job.stdin is not None and job.stdout is not None
        try:
            first = job.stdout.readline()
            if not first.startswith("{"):
                job.wait(timeout=60)
                err.seek(0)
                row["notes"].append(f"pyflink latency run failed: {flink_error(err.read() + first)}")
                return row
            lq = ctx.Queue()
            reader = ctx.Process(target=topics.reader, args=(cluster.bootstrap_servers, out2, args.seconds + 15, lq))
            reader.start()
            loader = ctx.Process(target=topics.load, args=(cluster.bootstrap_servers, src2, rate, args.seconds, None,
                                                     JsonRecord(keys)))
            loader.start()
            machine = MachineCpu(duration=args.seconds)
            loader.join()
            row.update(machine.stop())
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
    p50, p99, samples = topics.latency_percentiles(lat, args.warmup)
    row.update(p50_ms=p50, p99_ms=p99, latency_samples=samples,
               lat_epoch_p99_ms=pct((end or {}).get("checkpoint_ms", [])[args.skip_batches:], 0.99))
    return row


# ---------------------------------------------------------------- the run


COLUMNS = ["repeat", "keys", "function", "system", "mode", "path", "parallelism", "guarantee", "sink", "records",
           "rows_per_s", "rows_per_s_with_startup", "epochs_measured", "epoch_p50_ms", "epoch_p99_ms",
           "latency_rate", "p50_ms", "p99_ms", "latency_samples", "generator_lag_ms", "lat_epoch_p99_ms",
           "same_load_rate", "same_load_p50_ms", "same_load_p99_ms", "same_load_generator_lag_ms", "cpu_busy_pct",
           "cpu_steal_pct", "cpu_saturated_pct", "master_cpu_s", "output_records", "master_cpu_s_per_m_out",
           "check", "load_avg_start", "load_avg_1m", "note"]


#: columns rounded to whole numbers
WHOLE = ("rows_per_s", "rows_per_s_with_startup", "latency_rate", "same_load_rate")


def lag_note(lag: int | None, rate: float) -> list[str]:
    """A note when the open-loop generator fell behind its schedule by more than a second: the
    latency measured at that load then holds the generator's own delay (the machine could not
    produce, run the job and read at once at that rate)."""
    if lag is None or lag <= 1000:
        return []
    return [f"the load generator fell up to {lag:,} ms behind its schedule at {rate:,.0f} rows/s: latency at this "
            f"load includes that delay"]


def same_load(part: dict) -> dict:
    """A latency run at Spark's load, as the ``same_load_*`` columns of the row."""
    notes = [f"at Spark's load: {n}" for n in part.get("notes", [])]
    return {"same_load_rate": part.get("latency_rate", ""), "same_load_p50_ms": part.get("p50_ms", ""),
            "same_load_p99_ms": part.get("p99_ms", ""), "same_load_generator_lag_ms": part.get("generator_lag_ms", ""),
            "failed": part.get("failed", False), "notes": notes}


def few_samples(part: dict) -> str | None:
    """A note for a latency run that timed no output row (its percentiles are empty)."""
    if "latency_rate" in part and part.get("latency_samples", 0) == 0 and "p50_ms" in part:
        return "latency run: no output row visible after the warm-up while the run lasted"
    return None


def make_row(repeat: int, keys: int, function: str, system: str, mode: str, path: str, parallelism: int,
             records: int, args, *parts: dict) -> dict:
    row: dict[str, Any] = {c: "" for c in COLUMNS}
    guarantee = "at-least-once" if system == "spark" else "exactly-once"
    row.update(repeat=repeat, keys=keys, function=FUNCTIONS[function].label, system=system, mode=mode, path=path,
               parallelism=parallelism, guarantee=guarantee, sink="delta" if args.delta else "kafka",
               records=records)
    notes: list[str] = []
    failed = False
    for part in parts:
        notes += part.get("notes", [])
        short_of = few_samples(part)
        if short_of:
            notes.append(short_of)
        failed = failed or part.get("failed", False)
        row.update({k: v for k, v in part.items() if k in COLUMNS})
    for k, v in row.items():
        if isinstance(v, float):
            row[k] = "" if v != v else round(v) if k in WHOLE else round(v, 2 if k.startswith("master") else 1)
    row["load_avg_1m"] = round(os.getloadavg()[0], 2)  # at the end; load_avg_start: at the saturated run's start
    row["note"] = "; ".join(notes)
    row["_failed"] = failed
    return row


def short(row: dict) -> str:
    got = [f"{row['rows_per_s']:,} rows/s" if row["rows_per_s"] != "" else "no rows/s"]
    if row["epoch_p99_ms"] != "":
        got.append(f"epoch p99 {row['epoch_p99_ms']:,} ms")
    if row["p99_ms"] != "":
        got.append(f"p50/p99 {row['p50_ms']:,}/{row['p99_ms']:,} ms at {row['latency_rate']:,}/s")
    if row["same_load_p99_ms"] != "":
        got.append(f"at Spark's load p50/p99 {row['same_load_p50_ms']:,}/{row['same_load_p99_ms']:,} ms "
                   f"at {row['same_load_rate']:,}/s")
    if row["check"]:
        got.append(f"check {row['check']}")
    return ", ".join(got)


def run_spark(rows: list[dict], cluster, repeat: int, keys: int, function: str, src: str, n: int,
              args, topic_records: int) -> float | None:
    """Spark's saturated and latency runs of one function, as a row; returns its latency run's load."""
    label = FUNCTIONS[function].label
    if not topics.spark_jars():
        rows.append(make_row(repeat, keys, function, "spark", "micro-batch", "", 2, n, args,
                             {"notes": ["no jars in jars/kafka-spark/lib (scripts/setup.sh)"]}))
        return None
    log(f"{keys:,} keys, {label}, spark: saturated run")
    tput = spark_throughput(cluster, src, n, keys, function, args, topic_records)
    parts = [tput]
    rate = None
    if tput.get("rows_per_s") and not args.no_latency:
        rate = max(100.0, args.load * tput["rows_per_s"])
        log(f"{keys:,} keys, {label}, spark: latency run at {rate:,.0f} rows/s")
        parts.append(spark_latency(cluster, keys, function, rate, args))
    rows.append(make_row(repeat, keys, function, "spark", "micro-batch", "", 2, n, args, *parts))
    log(f"  -> {short(rows[-1])}")
    return rate


def run_all(args) -> list[dict]:
    from epochstream.deploy.kafka_broker import KafkaCluster

    rows: list[dict] = []
    why_no_arrow = arrow_path_missing()
    args.base_ms = {}
    with KafkaCluster(1) as cluster:
        bs = cluster.bootstrap_servers
        for repeat in range(1, args.repeats + 1):
            for keys in args.keys:
                n = args.records_for[keys]
                src = f"in-{keys}-r{repeat}-{time.time_ns()}"
                cluster.create_topic(src, 4)
                base_ms = args.base_ms[keys] = int(time.time() * 1000)
                log(f"repeat {repeat}, {keys:,} keys: producing {n:,} JSON records into {src} ...")
                ctx = mp.get_context("spawn")
                prod = ctx.Process(target=topics.produce_bulk, args=(bs, src, n, JsonRecord(keys, base_ms)))
                prod.start()
                prod.join()
                for function in args.functions:
                    label = FUNCTIONS[function].label
                    # Spark first: its latency run's load is also epochstream's second latency run ("same load")
                    n_spark = args.spark_records_for[keys]
                    spark_rate = None if args.no_spark else run_spark(rows, cluster, repeat, keys, function, src,
                                                                      n_spark, args, topic_records=n)
                    for mode in args.modes:
                        for path in args.paths:
                            if path == "arrow" and why_no_arrow:
                                rows.append(make_row(repeat, keys, function, "epochstream", mode, path, 2, n, args,
                                                     {"notes": [f"path arrow not run: {why_no_arrow}"]}))
                                log(f"{keys:,} keys, {label}, epochstream {mode}/arrow: skipped ({why_no_arrow})")
                                continue
                            for par in ([1, 2] if args.master_cpu else [2]):
                                log(f"{keys:,} keys, {label}, epochstream {mode}/{path} p={par}: saturated run")
                                n_run = n_spark if path in FED else n  # fed paths: the records Spark read
                                tput = es_throughput(cluster, src, n_run, keys, base_ms, function, mode, path, par,
                                                     args)
                                parts = [tput]
                                if par == 2 and not args.no_latency and tput.get("rows_per_s") and path not in FED:
                                    rate = max(100.0, args.load * tput["rows_per_s"])
                                    log(f"{keys:,} keys, {label}, epochstream {mode}/{path}: latency run at "
                                        f"{rate:,.0f} rows/s")
                                    parts.append(es_latency(cluster, keys, function, mode, path, rate, args))
                                    if spark_rate:
                                        log(f"{keys:,} keys, {label}, epochstream {mode}/{path}: latency run at "
                                            f"Spark's load, {spark_rate:,.0f} rows/s")
                                        parts.append(same_load(es_latency(cluster, keys, function, mode, path,
                                                                          spark_rate, args)))
                                rows.append(make_row(repeat, keys, function, "epochstream", mode, path, par, n_run,
                                                     args, *parts))
                                log(f"  -> {short(rows[-1])}")
                    if args.pyflink:
                        log(f"{keys:,} keys, {label}, pyflink")
                        if args.delta:
                            got = {"notes": ["pyflink not run: no Delta sink in this PyFlink set-up"]}
                        else:
                            got = pyflink_runs(cluster, src, n, keys, function, args)
                        rows.append(make_row(repeat, keys, function, "pyflink", "checkpoints", "", 2, n, args, got))
                        log(f"  -> {short(rows[-1])}")
    return rows


# ---------------------------------------------------------------- summary and plot


def target_ratio(keys: int, path: str) -> float:
    """The rows/s target against Spark: the pipeline >= 3x at 1,000 keys and >= 2x above, fed
    Python dicts >= 1x, fed Arrow batches >= 3x."""
    if path == "dicts":
        return 1.0
    if path == "batches":
        return 3.0
    return 3.0 if keys <= 1_000 else 2.0


def num(v: Any) -> float:
    return float(v) if v not in ("", None) else float("nan")


def summary(rows: list[dict]) -> list[str]:
    """The table of every row, then per epochstream configuration the worst repeat against Spark's and
    the targets; returns the summary lines (also printed)."""
    print(f"\n{'rep':>3} {'keys':>7} {'function':<27} {'system':<11} {'mode/path':<17} {'p':>1} {'rows/s':>9} "
          f"{'w/ start':>9} {'epochs':>6} {'ep p99':>7} {'load/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'busy/sat %':>10} {'mCPU s/M':>9} check")
    for r in rows:
        cpu = f"{r['cpu_busy_pct']:.0f}/{r['cpu_saturated_pct']:.0f}" if r["cpu_busy_pct"] != "" else ""
        mp_ = f"{r['mode']}/{r['path']}" if r["path"] else r["mode"]
        print(f"{r['repeat']:>3} {r['keys']:>7} {r['function']:<27} {r['system']:<11} {mp_:<17} "
              f"{r['parallelism']:>1} {r['rows_per_s']:>9} {r['rows_per_s_with_startup']:>9} "
              f"{r['epochs_measured']:>6} {r['epoch_p99_ms']:>7} {r['latency_rate']:>8} {r['p50_ms']:>8} "
              f"{r['p99_ms']:>8} {cpu:>10} {r['master_cpu_s_per_m_out']:>9} {r['check']}")
    lines = []
    configs = dict.fromkeys((r["keys"], r["function"], r["mode"], r["path"]) for r in rows
                            if r["system"] == "epochstream" and r["parallelism"] == 2 and r["rows_per_s"] != "")
    for keys, function, mode, path in configs:
        es = [r for r in rows if (r["keys"], r["function"], r["mode"], r["path"], r["parallelism"], r["system"])
              == (keys, function, mode, path, 2, "epochstream")]
        sp = {r["repeat"]: r for r in rows if (r["keys"], r["function"], r["system"]) == (keys, function, "spark")}
        worst_rps = min(num(r["rows_per_s"]) for r in es)
        worst_epoch = max(num(r["epoch_p99_ms"]) for r in es)
        worst_p99 = max(num(r["p99_ms"]) for r in es)
        ratios = [num(r["rows_per_s"]) / num(sp[r["repeat"]]["rows_per_s"]) for r in es
                  if r["repeat"] in sp and num(sp[r["repeat"]]["rows_per_s"]) > 0]
        lower = [num(r["same_load_p99_ms"]) < num(sp[r["repeat"]]["p99_ms"]) for r in es if r["repeat"] in sp]
        same = [num(r["same_load_p99_ms"]) for r in es if r["same_load_p99_ms"] != ""]
        want = target_ratio(keys, path)
        head = (f"{keys:,} keys, {function}, epochstream {mode}/{path} (worst of {len(es)}): "
                f"{worst_rps:,.0f} rows/s, epoch p99 {worst_epoch:,.0f} ms")
        if path not in FED:
            head += f", e2e p99 {worst_p99:,.0f} ms at 50% of its own rate"
        if ratios:
            worst_sp_p99 = max(num(r["p99_ms"]) for r in sp.values())
            head += f"; x Spark {min(ratios):.2f} (target >= {want:g}x: {'met' if min(ratios) >= want else 'NOT met'})"
        if ratios and path not in FED:
            head += (f"; e2e p99 at Spark's load {max(same) if same else float('nan'):,.0f} ms, below Spark's "
                     f"({worst_sp_p99:,.0f} ms worst): {'met' if same and lower and all(lower) else 'NOT met'}")
        elif not ratios:
            head += "; no Spark figure to compare"
        epoch_target = ("no epochs measured" if worst_epoch != worst_epoch
                        else "met" if worst_epoch <= INTERVAL * 1000 else "NOT met")
        head += f"; epoch p99 <= {INTERVAL * 1000:.0f} ms: {epoch_target}"
        lines.append(head)
    print()
    for line in lines:
        print(line)
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["rows_per_s"] != "" and r["parallelism"] == 2]
    configs = list(dict.fromkeys((r["keys"], r["function"], r["system"], r["mode"], r["path"]) for r in shown))

    def worst(cfg, field, pick):
        vals = [num(r[field]) for r in shown if (r["keys"], r["function"], r["system"], r["mode"], r["path"]) == cfg
                and r[field] != ""]
        return pick(vals) if vals else 0.0

    short_name = {f.label: name for name, f in FUNCTIONS.items()}
    labels = [f"{c[2]}\n{c[3]}{'/' + c[4] if c[4] else ''}\n{c[0]:,} keys\n{short_name[c[1]]}" for c in configs]
    colors = [{"epochstream": "C0", "spark": "C1", "pyflink": "C2"}[c[2]] for c in configs]
    fig, grid = plt.subplots(2, 2, figsize=(max(12.0, 0.9 * len(configs) + 3), 10.0))
    axes = grid.flatten()
    xs = range(len(configs))
    axes[0].bar(xs, [worst(c, "rows_per_s", min) / 1000 for c in configs], color=colors)
    axes[0].set_title("thousand rows/s\n(saturated, start-up left out)", fontsize=9)
    axes[1].bar(xs, [worst(c, "epoch_p99_ms", max) for c in configs], color=colors)
    axes[1].axhline(INTERVAL * 1000, color="grey", lw=0.8, ls="--")
    axes[1].set_title("epoch / micro-batch p99, ms\n(saturated run)", fontsize=9)
    p50 = [worst(c, "p50_ms", max) for c in configs]
    p99 = [worst(c, "p99_ms", max) for c in configs]
    axes[2].bar(xs, p50, color=colors, yerr=[[0] * len(configs), [max(0.0, b - a) for a, b in zip(p50, p99,
                                                                                                   strict=True)]])
    axes[2].set_title("end-to-end p50 (bar) to p99 (whisker), ms\nat 50% of each system's rate", fontsize=9)
    # at the same load: Spark's latency run, and epochstream's run at Spark's load
    s50 = [worst(c, "same_load_p50_ms" if c[2] == "epochstream" else "p50_ms", max) for c in configs]
    s99 = [worst(c, "same_load_p99_ms" if c[2] == "epochstream" else "p99_ms", max) for c in configs]
    axes[3].bar(xs, s50, color=colors, yerr=[[0] * len(configs), [max(0.0, b - a) for a, b in zip(s50, s99,
                                                                                                   strict=True)]])
    axes[3].set_title("end-to-end p50 to p99, ms\nat Spark's load (50% of Spark's rate)", fontsize=9)
    for ax in axes:
        ax.set_xticks(list(xs), [lab.replace("\n", " ") for lab in labels], fontsize=7, rotation=90)
    fig.suptitle("Kafka JSON -> PySpark pandas state -> Kafka (worst repeat): epochstream (local, p=2, "
                 "exactly-once), Spark Structured Streaming (local[2], at-least-once)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default=None, help="key counts, comma-separated (default 1000,100000; quick 1000)")
    ap.add_argument("--records", default=None,
                    help="records of the pre-produced topic, one per key count (comma list; the last repeats)")
    ap.add_argument("--spark-records", default=None,
                    help="records Spark reads of the topic (a prefix; comma list per key count; default all) and "
                         "the dicts/batches paths are fed: Spark's rate is steady long before epochstream has "
                         "the >= 30 epochs its topic is sized for")
    ap.add_argument("--functions", default=None,
                    help="apply (applyInPandasWithState), transform (transformWithStateInPandas); "
                         "default both (quick: apply)")
    ap.add_argument("--modes", default=None, help="epochstream modes (default aligned,tracker; quick aligned)")
    ap.add_argument("--paths", default="rows,arrow", help="epochstream paths: rows, arrow (where it exists); "
                    "dicts (the same records as Python dicts from a collection source) and batches (as Arrow "
                    "batches built by hand), throughput only, compared with Spark's Kafka run")
    ap.add_argument("--seconds", type=float, default=None, help="latency run's load, seconds (default 45)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of the latency load left out (default 5)")
    ap.add_argument("--load", type=float, default=0.5, help="latency run's rate as a fraction of the steady rate")
    ap.add_argument("--skip-batches", type=int, default=None,
                    help="warm-up epochs / micro-batches left out of the epoch percentiles (default 2)")
    ap.add_argument("--spark-max-offsets", type=int, default=None,
                    help="Spark's maxOffsetsPerTrigger in the saturated run (default records / 35)")
    ap.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting for both of Spark's runs (repeatable), e.g. "
                         "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled=true")
    ap.add_argument("--batch-rows", type=int, default=None, help="epochstream Pipeline(batch_rows=...)")
    ap.add_argument("--step-timeout", type=float, default=None,
                    help="epochstream HeartbeatConfig(step_timeout=...) seconds (default: the Pipeline's, 120 s): "
                         "how long one step, e.g. an epoch's pandas calls, may run before its worker is failed")
    ap.add_argument("--master-cpu", action="store_true", help="also saturated epochstream runs at parallelism 1")
    ap.add_argument("--delta", action="store_true", help="write a Delta table instead of the output topic")
    ap.add_argument("--pyflink", action="store_true", help="also PyFlink (venv and connector made on first use)")
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--no-epochstream", action="store_true", help="the peers only")
    ap.add_argument("--no-latency", action="store_true", help="saturated runs only")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="kafka_json_pandas", help="results file name (CSV and PNG)")
    args = ap.parse_args(argv)
    q = args.quick
    for item in args.spark_conf:
        if "=" not in item:
            ap.error(f"--spark-conf: {item!r} is not KEY=VALUE")
    args.spark_conf = dict(item.split("=", 1) for item in args.spark_conf)
    args.keys = [int(k) for k in (args.keys or ("1000" if q else "1000,100000")).split(",")]
    args.modes = [] if args.no_epochstream else [
        m for m in (args.modes or ("aligned" if q else "aligned,tracker")).split(",") if m]
    args.paths = [p for p in args.paths.split(",") if p]
    args.functions = [f for f in (args.functions or ("apply" if q else "apply,transform")).split(",") if f]
    for f in args.functions:
        if f not in FUNCTIONS:
            ap.error(f"--functions: {f!r} is not one of {', '.join(FUNCTIONS)}")
    for p in args.paths:
        if p not in ("rows", "arrow", *FED):
            ap.error(f"--paths: {p!r} is not rows, arrow, dicts or batches")
    if args.seconds is None:
        args.seconds = 10.0 if q else 45.0
    if args.warmup is None:
        args.warmup = 3.0 if q else 5.0
    if args.skip_batches is None:
        args.skip_batches = 1 if q else 2
    given = [int(n) for n in args.records.split(",")] if args.records else []
    args.records_for = {}
    for i, keys in enumerate(args.keys):
        if given:
            args.records_for[keys] = given[min(i, len(given) - 1)]
        else:
            args.records_for[keys] = QUICK_RECORDS if q else DEFAULT_RECORDS.get(keys, 2_400_000)
    spark_given = [int(n) for n in args.spark_records.split(",")] if args.spark_records else []
    args.spark_records_for = {keys: min(args.records_for[keys], spark_given[min(i, len(spark_given) - 1)])
                              if spark_given else args.records_for[keys] for i, keys in enumerate(args.keys)}
    return args


def main(argv: list[str] | None = None) -> int:
    # the local driver forks its workers from this process: pandas, pyarrow.parquet and pyspark's
    # wrappers loaded once here (imported above through the workload), not inside each worker's first epoch
    import pyarrow.parquet  # noqa: F401

    import epochstream.pyspark.operators  # noqa: F401

    args = parse_args(argv)
    env_with_repository(ROOT)  # Spark's Python workers import benchmarks.kafka.kafka_json_workload
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    uptime = os.popen("uptime").read().strip()
    log(f"start: {uptime}; keys {args.keys}, records {args.records_for}, functions {args.functions}, "
        f"modes {args.modes}, paths {args.paths}, repeats {args.repeats}")
    rows = run_all(args)
    uptime_end = os.popen("uptime").read().strip()
    log(f"end: {uptime_end}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if r.pop("_failed")]
    lines = summary(rows)
    csv_path, png_path = out / f"{args.name}.csv", out / f"{args.name}.png"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
        f.write(f"# command: {' '.join(sys.argv)}\n# uptime at start: {uptime}\n# uptime at end: {uptime_end}\n")
        f.write(f"# run seconds: {time.time() - T0:.0f}\n")
        for line in lines:
            f.write(f"# {line}\n")
    plot(rows, png_path)
    print(f"wrote {csv_path} and {png_path} ({time.time() - T0:.0f} s)")
    if failed:
        print(f"CHECK FAILED in {len(failed)} rows: " + " | ".join(r["note"] for r in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
