"""PySpark stateful code in epochstream and in Spark Structured Streaming, on one machine in one run.

Three workloads, each run on both systems (``local[2]`` / parallelism 2, RocksDB state store):

1. **Spark's own keyed count**: ``count(key, pdfs, state)`` below, unchanged, through
   ``applyInPandasWithState`` at each ``--keys`` count (100 and 10,000).

   - Spark: a ``rate-micro-batch`` source of ``--spark-rows-per-batch`` rows (key = value % K),
     1 s processing-time trigger, noop sink. The plain ``rate`` source (``--spark-source rate``,
     ``rowsPerSecond``) makes its first batch after the 15-40 s warm-up hold rowsPerSecond x the
     warm-up, so batch sizes swing; ``rate-micro-batch`` gives Spark equal batches back to back
     as soon as a batch takes longer than the trigger (saturated; the CSV notes when it did not).
     Throughput = input rows / wall seconds of the micro-batches after ``--skip-batches`` warm-up
     batches (query progress events: numInputRows, timestamp, triggerExecution); latency =
     each steady batch's triggerExecution.
   - epochstream: local driver, p=2, 1 s epochs, ``generate_batches`` (Arrow batches of
     ``--batch-size`` rows, columns id and k = id % K), ``apply_in_pandas_with_state(count, ...)``,
     a DiscardingSink that logs, per worker process, the rows counted so far (the sum of each
     key's latest ``c``). Throughput = rows counted / seconds after the first ``--warmup``
     seconds of output (steady state, as for Spark); the wall figure is rows / run seconds with
     worker start-up. Latency = each completed epoch's trigger-to-commit after the first
     ``--skip-batches`` epochs (warm-up, as Spark's batches; ``latency_p99_all_ms`` and
     ``epoch_ms`` keep every epoch). The committed counts are checked against the input.
   - With ``--es-rates`` epochstream also runs paced: Spark's ``rate`` source (Arrow) at each given
     rows/s for ``--es-rate-seconds`` of input, so the epoch p99 is read at a load below capacity.
     A rate written ``x1.05`` is that multiple of Spark's rows/s at the same key count in the same
     run (Spark then runs first for that key count): the target is the epoch p99 at >= 1.0x
     Spark's rate, and Spark's own rate moves between runs with the machine.
   - With ``--batch-rows`` / ``--batch-linger`` the epochstream Pipeline gets the batching policy
     (``Pipeline(batch_rows=..., batch_linger=...)``) when its signature takes them; otherwise
     the run says they were ignored.

2. **The StatefulProcessor workload** (count, sum and a MapState histogram per key through
   ``transformWithStateInPandas``; ``--records`` rows ``{"k": "k{i % keys}", "v": i % 100}``):
   epochstream on dict rows (``from_collection``) and on Arrow (``from_arrow``) against Spark
   reading the rows as ``--files`` JSON files, one per micro-batch, ``availableNow``. Spark's
   throughput is records / the micro-batches' busy time (its start-up excluded, which favours
   Spark); epochstream's is records / run seconds. Both final states are checked.

3. **Real-time Mode side by side**: the keyed count carrying the newest input timestamp
   (``count_ts``) at ``--rtm-rate`` rows/s. Spark 4.2 enables Real-time Mode with
   ``trigger(realTime="5 seconds")``; of the built-in sources only Kafka and the in-JVM
   ``LowLatencyMemoryStream`` support it, and the latter is fed here from the driver (py4j)
   with rows stamped at insertion. Spark first runs with its allowlist check on (its refusal is
   recorded), then with ``spark.sql.streaming.realTimeMode.allowlistCheck=false``, the setting
   its refusal names, and a ``foreach`` sink (allowlisted) that logs now - ts per output row.
   epochstream runs the same function on its ``rate`` source (Arrow) at the same rate and logs
   now - ts per output row at the sink, plus its epochs' trigger-to-commit (when output is
   committed exactly-once; Real-time Mode's output is visible before its batch commits).

Writes benchmarks/results/pyspark_stateful.csv and .png (with the load average at each run),
prints progress and a summary table. Each keyed-count row also says how busy the whole machine
was while it was measured (``cpu_busy_pct``, ``cpu_steal_pct``, and ``cpu_saturated_pct``: the
share of its seconds with no CPU left; Spark's from the end of its warm-up batches): an epoch
p99 read while the machine had no CPU to spare is the machine's as much as the job's.
``--quick`` is a smaller run (about 3 minutes); ``--profile`` also writes a cProfile of the
epochstream keyed count (simulator: one process, the same operator code). Not a test: nothing
asserts timings.

    python benchmarks/spark/pyspark_stateful.py [--quick] [--keys 100,10000] [--batch-size 65536]
        [--batch-rows N --batch-linger S] [--micro-batch epoch,batch] [--max-rows-per-trigger N]
        [--name pyspark_stateful] [--no-processor] [--no-real-time] [--profile]

``--micro-batch`` runs the epochstream keyed count once per cut (``epoch``: one call per key
per epoch, Spark's granularity, the default; ``batch``: one per key per runtime batch).
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.streaming.state import GroupStateTimeout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, T0, MachineCpu, log, percentile, pyplot, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, Pipeline  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

OUTPUT = "k string, n long"


# ---------------------------------------------------------------- the user code, as Spark users write it


def count(key, pdfs, state):
    c = state.get[0] if state.exists else 0
    for pdf in pdfs:
        c += len(pdf)
    state.update((c,))
    yield pd.DataFrame({"k": [key[0]], "c": [c]})


def count_ts(key, pdfs, state):
    """``count`` that also emits the newest input timestamp it saw, to time output rows."""
    c = state.get[0] if state.exists else 0
    ts = 0.0
    for pdf in pdfs:
        c += len(pdf)
        ts = max(ts, float(pdf["ts"].max()))
    state.update((c,))
    yield pd.DataFrame({"k": [key[0]], "c": [c], "ts": [ts]})


class CountSumHistogram(StatefulProcessor):
    def init(self, handle):
        self.stats = handle.getValueState("stats", "n long, total long")
        self.hist = handle.getMapState("hist", "bucket long", "n long")

    def handleInputRows(self, key, rows, timerValues):
        n, total = self.stats.get() or (0, 0)
        for pdf in rows:
            n += len(pdf)
            total += int(pdf["v"].sum())
            for bucket, c in (pdf["v"] // 10).value_counts().items():
                old = self.hist.getValue((int(bucket),))
                self.hist.updateValue((int(bucket),), ((old[0] if old else 0) + int(c),))
        self.stats.update((n, total))
        yield pd.DataFrame({"k": [key[0]], "n": [n]})


# ---------------------------------------------------------------- helpers


def result(workload: str, keys: int, system: str, variant: str, **fields: Any) -> dict:
    row = {"workload": workload, "keys": keys, "system": system, "variant": variant, "rows": 0,
           "seconds": float("nan"), "rows_per_s": float("nan"), "rows_per_s_wall": float("nan"), "batches": 0,
           "latency_kind": "", "latency_p50_ms": float("nan"), "latency_p99_ms": float("nan"),
           "latency_p99_all_ms": float("nan"), "epoch_ms": "", "state_ok": "",
           "load_1min": round(os.getloadavg()[0], 2), "cpu_busy_pct": float("nan"),
           "cpu_steal_pct": float("nan"), "cpu_saturated_pct": float("nan"), "note": ""}
    row.update(fields)
    return row


def batching_kwargs(args) -> tuple[dict, str]:
    """``batch_rows``/``batch_linger`` for the Pipeline, if it takes them (the batching policy)."""
    wanted = {"batch_rows": args.batch_rows, "batch_linger": args.batch_linger}
    wanted = {k: v for k, v in wanted.items() if v is not None}
    params = inspect.signature(Pipeline.__init__).parameters
    taken = {k: v for k, v in wanted.items() if k in params}
    ignored = sorted(set(wanted) - set(taken))
    label = ", ".join(f"{k}={v}" for k, v in taken.items())
    if ignored:
        label += (", " if label else "") + f"ignored (Pipeline has no {'/'.join(ignored)})"
    return taken, label


class _ProbeWriter:
    """Per-subtask writer of ``ProbeSink``: appends one line per write call to a file of its
    worker process. ``count``: the rows counted so far by this process's keys (each key's
    latest ``c``; keys are disjoint across subtasks); ``latency``: now - ts of each row."""

    latest: dict[Any, int] = {}  # per process (the local driver forks workers): key -> latest count
    total = [0]

    def __init__(self, log_dir: str, what: str) -> None:
        self.path = os.path.join(log_dir, f"{what}-{os.getpid()}.log")
        self.what = what

    def write(self, records) -> None:
        if isinstance(records, (pa.RecordBatch, pa.Table)):
            records = records.to_pylist()
        now = time.time()
        if self.what == "latency":
            lines = "".join(f"{now:.6f} {now - r['ts']:.6f}\n" for r in records)
        else:
            latest, total = _ProbeWriter.latest, _ProbeWriter.total
            for r in records:
                total[0] += r["c"] - latest.get(r["k"], 0)
                latest[r["k"]] = r["c"]
            lines = f"{now:.6f} {total[0]}\n"
        with open(self.path, "a") as f:
            f.write(lines)

    def take(self) -> list:
        return []


class ProbeSink(DiscardingSink):
    """A DiscardingSink (two-phase commit, output dropped) whose writers log progress or latency."""

    def __init__(self, log_dir: str, what: str) -> None:
        self.log_dir, self.what = log_dir, what

    def writer(self) -> _ProbeWriter:  # type: ignore[override]
        return _ProbeWriter(self.log_dir, self.what)


def steady_rate(log_dir: str, warmup: float) -> tuple[float, float, int]:
    """Rows/s counted after the first ``warmup`` s of output, from the ProbeSink logs: (rate, seconds, rows)."""
    series = []
    for path in glob.glob(os.path.join(log_dir, "count-*.log")):
        with open(path) as f:
            series.append([(float(t), int(n)) for t, n in (line.split() for line in f)])
    series = [s for s in series if s]
    if not series:
        return float("nan"), float("nan"), 0
    t_first = min(s[0][0] for s in series)
    t_a, t_b = t_first + warmup, max(s[-1][0] for s in series)

    def counted(t: float) -> int:
        return sum(max((n for ts, n in s if ts <= t), default=0) for s in series)

    if t_b - t_a < 1.0:  # too short a run for a steady window: use all of it
        t_a = t_first
    rows = counted(t_b) - counted(t_a)
    return (rows / (t_b - t_a) if t_b > t_a else float("nan")), t_b - t_a, rows


def epoch_latencies(res) -> list[float]:
    return [e["trigger_to_commit_seconds"] * 1000 for e in res.metrics.get("epochs", [])
            if e.get("state") == "completed"]


# ---------------------------------------------------------------- epochstream


def keyed_count_pipeline(keys: int, rows: int, args, sink, func=count, extra: dict | None = None,
                         micro_batch: str = "epoch", rate: float | None = None) -> Pipeline:
    """The keyed count; ``rate`` (rows/s) paces the source (Spark's ``rate``, Arrow batches) instead
    of generating as fast as the job takes rows."""
    def events(start: int, stop: int):
        ids = pa.array(range(start, stop), pa.int64())
        return pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys))})

    def with_key(batch):
        ids = batch.column("value")
        return pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys))})

    p = Pipeline("keyed-count", parallelism=2, max_parallelism=128,
                 checkpoint=CheckpointConfig(interval=getattr(args, "interval", 1.0)),
                 batch_size=args.batch_size, **(extra or {}))
    if rate is None:
        source = p.generate_batches(events, count=rows, num_splits=2, uid="events", block_rows=args.batch_size)
    else:
        source = p.rate(rate, count=rows, uid="events", records="arrow").map_batches(with_key)
    (source
      .apply_in_pandas_with_state(func, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout,
                                  key="k", uid="count", **cut_kwargs(args, micro_batch))
      .sink(sink, uid="out"))
    return p


def cut_kwargs(args, micro_batch: str) -> dict:
    """``micro_batch``/``max_rows_per_trigger`` for the wrapper, if it takes them."""
    from epochstream.api.pipeline import Stream

    params = inspect.signature(Stream.apply_in_pandas_with_state).parameters
    if "micro_batch" not in params:
        return {}
    kw: dict = {"micro_batch": micro_batch}
    if args.max_rows_per_trigger is not None:
        kw["max_rows_per_trigger"] = args.max_rows_per_trigger
    return kw


def es_keyed_count(keys: int, rows: int, args, micro_batch: str = "epoch", rate: float | None = None) -> dict:
    """One epochstream run of the keyed count: saturated (``rate`` None: rows/s is its capacity) or
    paced at ``rate`` rows/s (its p99 is the latency at that load)."""
    extra, label = batching_kwargs(args)
    cut = cut_kwargs(args, micro_batch)
    cut_label = ", ".join(f"{k}={v}" for k, v in cut.items())
    source = (f"generate_batches {args.batch_size}" if rate is None
              else f"rate {rate:,.0f} rows/s (paced, arrow)")
    variant = (f"local p=2, {args.interval:g} s epochs, {source}"
               + (f", {label}" if label else "")
               + (f", {cut_label}" if cut_label else ""))
    with tempfile.TemporaryDirectory(prefix="es-keyed-count-") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        p = keyed_count_pipeline(keys, rows, args, ProbeSink(str(logs), "count"), extra=extra,
                                 micro_batch=micro_batch, rate=rate)
        load = os.getloadavg()[0]
        machine = MachineCpu()
        t0 = time.perf_counter()
        res = p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        wall = time.perf_counter() - t0
        cpu = machine.stop()
        rate, steady_s, steady_rows = steady_rate(str(logs), args.warmup)
        storage = LocalCheckpointStorage(Path(tmp) / "chk")
        manifest, root = storage.latest()
        state = committed_state(storage, manifest, root)["count"]["$groupState"]
        total = sum(v[0][0] for v in state.values())
    every = epoch_latencies(res)
    # the first --skip-batches epochs are warm-up, as Spark's first micro-batches are (a paced
    # run's first epoch holds the records that came due while the workers started); the p99
    # over every epoch and each epoch's latency are in the row too
    lat = every[args.skip_batches:] or every
    return result("keyed count", keys, "epochstream", variant, rows=rows, seconds=round(wall, 2),
                  rows_per_s=rate, rows_per_s_wall=rows / wall, batches=len(lat),
                  latency_kind="epoch trigger-to-commit", latency_p50_ms=percentile(lat, 0.5),
                  latency_p99_ms=percentile(lat, 0.99),
                  latency_p99_all_ms=percentile(every, 0.99), epoch_ms=" ".join(f"{v:.0f}" for v in every),
                  state_ok=total == rows and len(state) == keys, load_1min=round(load, 2), **cpu,
                  note=f"steady window {steady_s:.1f} s, {steady_rows} rows")


def es_processor(data: list[dict], args, work: Path, layout: str) -> dict:
    p = Pipeline("pyspark-bench", parallelism=2, max_parallelism=128,
                 checkpoint=CheckpointConfig(interval=1.0), batch_size=1024)
    if layout == "arrow":
        src = p.from_arrow(pa.Table.from_pylist(data), num_splits=2, uid="rows")
    else:
        src = p.from_collection(data, splits=2, uid="rows")
    (src.transform_with_state(CountSumHistogram(), OUTPUT, "None", key="k", uid="stats")
        .sink(DiscardingSink(), uid="out"))
    chk = work / f"es-chk-{layout}"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = p.run(deployment="local", checkpoint_dir=str(chk))
    seconds = time.perf_counter() - t0
    storage = LocalCheckpointStorage(chk)
    manifest, root = storage.latest()
    stats = committed_state(storage, manifest, root)["stats"]["stats"]
    got = {k[0]: v[0][0] for k, v in stats.items()}
    lat = epoch_latencies(res)
    return result("StatefulProcessor", args.processor_keys, "epochstream",
                  f"local p=2, 1 s epochs, {'from_arrow' if layout == 'arrow' else 'from_collection (rows)'}",
                  rows=len(data), seconds=round(seconds, 2), rows_per_s=len(data) / seconds,
                  rows_per_s_wall=len(data) / seconds, batches=len(lat), latency_kind="epoch trigger-to-commit",
                  latency_p50_ms=percentile(lat, 0.5), latency_p99_ms=percentile(lat, 0.99),
                  state_ok=got == expected_counts(len(data), args.processor_keys), load_1min=round(load, 2))


def es_latency(args) -> dict:
    """The timestamped keyed count on the rate source at ``--rtm-rate``: now - ts at the sink."""
    keys = args.rtm_keys

    def with_key(batch):
        ts = batch.column("timestamp")
        k = pc.subtract(batch.column("value"), pc.multiply(pc.divide(batch.column("value"), keys), keys))
        return pa.record_batch({"ts": ts, "k": k})

    rows = int(args.rtm_rate * args.rtm_seconds)
    extra, label = batching_kwargs(args)
    with tempfile.TemporaryDirectory(prefix="es-latency-") as tmp:
        p = Pipeline("latency", parallelism=2, max_parallelism=128, checkpoint=CheckpointConfig(interval=1.0),
                     batch_size=args.batch_size, **extra)
        (p.rate(args.rtm_rate, count=rows, uid="rate", records="arrow").map_batches(with_key)
          .apply_in_pandas_with_state(count_ts, "k long, c long, ts double", "c long", "Update",
                                      GroupStateTimeout.NoTimeout, key="k", uid="count")
          .sink(ProbeSink(tmp, "latency"), uid="out"))
        load = os.getloadavg()[0]
        t0 = time.time()
        res = p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        lat = read_latencies(tmp, "latency-*.log", t0 + args.warmup)
    epochs = epoch_latencies(res)
    return result("real-time latency", keys, "epochstream",
                  f"local p=2, 1 s epochs, rate {args.rtm_rate:g}/s (arrow)" + (f", {label}" if label else ""),
                  rows=rows, seconds=args.rtm_seconds, batches=len(lat), latency_kind="input to sink (output row)",
                  latency_p50_ms=percentile(lat, 0.5), latency_p99_ms=percentile(lat, 0.99), load_1min=round(load, 2),
                  note=(f"epoch trigger-to-commit p50 {percentile(epochs, 0.5):.0f} ms, "
                        f"p99 {percentile(epochs, 0.99):.0f} ms over {len(epochs)} epochs (exactly-once output)"))


def read_latencies(folder: str, pattern: str, after: float) -> list[float]:
    """Latencies (ms) logged as ``<wall time> <seconds>`` lines, of rows written after ``after``."""
    out = []
    for path in glob.glob(os.path.join(folder, pattern)):
        with open(path) as f:
            for line in f:
                t, s = line.split()
                if float(t) >= after:
                    out.append(float(s) * 1000)
    return out


# ---------------------------------------------------------------- Spark


def spark_session(extra: dict[str, str] | None = None, app_name: str = "pyspark-stateful-bench"):
    """``local[2]``, 2 shuffle partitions, RocksDB state store; ``extra``: more settings
    (``spark.jars`` for a connector, ...)."""
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master("local[2]").appName(app_name)
               .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")  # the bar garbles the progress lines
               .config("spark.sql.streaming.stateStore.providerClass",
                       "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"))
    for k, v in (extra or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("FATAL")  # stopping a query mid-batch logs aborts
    return spark


def _ts(progress: dict) -> float:
    return datetime.fromisoformat(progress["timestamp"].replace("Z", "+00:00")).timestamp()


def spark_keyed_count(spark, keys: int, args, work: Path) -> dict:
    if args.spark_source == "rate":
        df = (spark.readStream.format("rate").option("rowsPerSecond", args.spark_rows_per_batch)
              .option("numPartitions", 2).load())
    else:
        df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", args.spark_rows_per_batch)
              .option("numPartitions", 2).load())
    df = df.selectExpr("value AS id", f"value % {keys} AS k")
    out = df.groupBy("k").applyInPandasWithState(count, "k long, c long", "c long", "Update",
                                                 GroupStateTimeout.NoTimeout)
    chk = work / f"spark-keyed-{keys}"
    load = os.getloadavg()[0]
    q = (out.writeStream.format("noop").outputMode("update").option("checkpointLocation", str(chk))
         .trigger(processingTime="1 second").start())
    want = args.skip_batches + args.spark_batches
    deadline = time.monotonic() + args.spark_timeout
    seen = 0
    machine = None  # the machine's CPU over the steady batches (from the end of the warm-up)
    try:
        while q.isActive and time.monotonic() < deadline:
            done = [p for p in q.recentProgress if p["numInputRows"] > 0]
            for p in done[seen:]:
                log(f"  spark keys={keys} batch {p['batchId']}: {p['numInputRows']:,} rows in "
                    f"{p['durationMs']['triggerExecution']} ms")
            seen = len(done)
            if machine is None and seen >= args.skip_batches:
                machine = MachineCpu()
            if seen >= want:
                break
            time.sleep(0.5)
        error = q.exception()
    finally:
        q.stop()
    cpu = machine.stop() if machine is not None else {}
    variant = (f"local[2], {args.spark_source} {args.spark_rows_per_batch:,}"
               f"{'/s' if args.spark_source == 'rate' else '/batch'}, 1 s trigger, RocksDB, noop")
    if error is not None:
        return result("keyed count", keys, "spark", variant, note=f"failed: {str(error).splitlines()[0][:300]}")
    done = [p for p in q.recentProgress if p["numInputRows"] > 0]
    steady = done[args.skip_batches:] or done[-1:]
    if not steady:
        return result("keyed count", keys, "spark", variant, note=f"no batch finished in {args.spark_timeout} s")
    rows = sum(p["numInputRows"] for p in steady)
    wall = _ts(steady[-1]) + steady[-1]["durationMs"]["triggerExecution"] / 1000 - _ts(steady[0])
    lat = [p["durationMs"]["triggerExecution"] for p in steady]
    notes = [f"{len(steady)} steady batches after {len(done) - len(steady)} warm-up"]
    if statistics.median(lat) < 1000:
        notes.append("not saturated: batches shorter than the trigger; raise --spark-rows-per-batch")
    state_ok: Any = ""
    try:  # every committed batch counted once: Spark's state holds the committed input rows
        state = spark.read.format("statestore").load(str(chk))
        committed = state.selectExpr(f"sum({_field_path(state.schema, 'c')}) AS n").collect()[0]["n"]
        state_ok = committed == sum(p["numInputRows"] for p in done)
    except Exception as exc:  # the reader may not know this operator's state layout: say so
        notes.append(f"state not read: {str(exc).splitlines()[0][:120]}")
    return result("keyed count", keys, "spark", variant, rows=rows, seconds=round(wall, 2), rows_per_s=rows / wall,
                  rows_per_s_wall=rows / wall, batches=len(steady), latency_kind="micro-batch duration",
                  latency_p50_ms=percentile(lat, 0.5), latency_p99_ms=percentile(lat, 0.99), state_ok=state_ok,
                  load_1min=round(load, 2), **cpu, note="; ".join(notes))


def _field_path(schema, name: str, prefix: str = "") -> str:
    """The dotted path of the first field ``name`` in a (nested) Spark schema: the state
    source nests applyInPandasWithState's state in ``value`` (as ``groupState``)."""
    from pyspark.sql.types import StructType

    for f in schema.fields:
        if f.name == name:
            return prefix + f.name
        if isinstance(f.dataType, StructType):
            try:
                return _field_path(f.dataType, name, f"{prefix}{f.name}.")
            except KeyError:
                continue
    raise KeyError(f"no field {name!r} in {schema.simpleString()}")


def expected_counts(records: int, keys: int) -> dict[str, int]:
    return {f"k{k}": records // keys + (1 if k < records % keys else 0) for k in range(keys)}


def write_files(data: list[dict], files: int, folder: Path) -> None:
    folder.mkdir(parents=True)
    per = -(-len(data) // files)
    for f in range(files):
        path = folder / f"part-{f:04d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in data[f * per:(f + 1) * per]))
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))  # oldest first: file order


def spark_processor(spark, src: Path, args, work: Path) -> dict:
    df = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).json(str(src))
    out = df.groupBy("k").transformWithStateInPandas(CountSumHistogram(), OUTPUT, "Update", "None")
    chk = work / "spark-chk"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    q = out.writeStream.format("noop").option("checkpointLocation", str(chk)).outputMode("update") \
        .trigger(availableNow=True).start()
    q.awaitTermination()
    wall = time.perf_counter() - t0
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    lat = [p["durationMs"]["triggerExecution"] for p in progress]
    busy = sum(lat) / 1000
    state = spark.read.format("statestore").option("stateVarName", "stats").load(str(chk))
    got = {r["key"][0]: r["value"][0] for r in state.collect()}
    return result("StatefulProcessor", args.processor_keys, "spark",
                  "local[2], JSON files, 1 per batch, availableNow, RocksDB, noop", rows=args.records,
                  seconds=round(busy, 2), rows_per_s=args.records / busy, rows_per_s_wall=args.records / wall,
                  batches=len(lat), latency_kind="micro-batch duration", latency_p50_ms=percentile(lat, 0.5),
                  latency_p99_ms=percentile(lat, 0.99),
                  state_ok=got == expected_counts(args.records, args.processor_keys), load_1min=round(load, 2),
                  note="rows/s = records / busy time (start-up excluded)")


def _spark_message(error: Any) -> str:
    """Spark's error message on one line, without the query dump it appends."""
    return " ".join(str(error).split("=== Streaming Query ===")[0].split())[:1500]


class LatencyWriter:
    """Spark ``foreach`` writer: one line ``<now> <now - ts>`` per output row, a file per task."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def open(self, partition_id, epoch_id):
        self.f = open(os.path.join(self.folder, f"spark-{os.getpid()}-{partition_id}-{epoch_id}.log"), "a")
        return True

    def process(self, row):
        now = time.time()
        self.f.write(f"{now:.6f} {now - row.ts:.6f}\n")
        self.f.flush()

    def close(self, error):
        self.f.close()


def spark_real_time(spark, args, work: Path, allowlist_check: bool) -> dict:
    """The timestamped keyed count in Real-time Mode over a LowLatencyMemoryStream fed from here."""
    from py4j.java_collections import ListConverter
    from pyspark.sql import DataFrame

    keys = args.rtm_keys
    spark.conf.set("spark.sql.streaming.realTimeMode.allowlistCheck", str(allowlist_check).lower())
    variant = (f"real-time mode 5 s, LowLatencyMemoryStream {args.rtm_rate:g}/s, foreach sink, "
               f"allowlistCheck={str(allowlist_check).lower()}")
    jvm = spark._jvm
    stream = jvm.org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream.apply(
        spark._jsparkSession, 2, jvm.org.apache.spark.sql.Encoders.LONG())
    df = DataFrame(stream.toDF(), spark).selectExpr("value / 1e6 AS ts", f"value % {keys} AS k")
    out = df.groupBy("k").applyInPandasWithState(count_ts, "k long, c long, ts double", "c long", "Update",
                                                 GroupStateTimeout.NoTimeout)
    folder = work / f"rtm-{allowlist_check}"
    folder.mkdir()
    load = os.getloadavg()[0]
    t0 = time.time()
    try:
        q = (out.writeStream.foreach(LatencyWriter(str(folder))).outputMode("update")
             .option("checkpointLocation", str(work / f"rtm-chk-{allowlist_check}"))
             .trigger(realTime="5 seconds").start())
    except Exception as exc:
        return result("real-time latency", keys, "spark", variant, state_ok="",
                      note=f"refused at start: {_spark_message(exc)}")
    stop = threading.Event()
    fed = [0]

    def feed() -> None:
        client = spark.sparkContext._gateway._gateway_client
        per_tick = max(1, int(args.rtm_rate / 100))
        while not stop.is_set():
            now = int(time.time() * 1e6)
            stream.addData(jvm.scala.jdk.javaapi.CollectionConverters.asScala(
                ListConverter().convert([now + i for i in range(per_tick)], client)))
            fed[0] += per_tick
            time.sleep(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    deadline = time.monotonic() + args.rtm_spark_seconds
    error = None
    while time.monotonic() < deadline:
        error = q.exception()
        if error is not None or not q.isActive:
            break
        time.sleep(1)
        lat_now = read_latencies(str(folder), "spark-*.log", 0)
        if int(time.monotonic() - T0) % 10 == 0:
            log(f"  spark real-time mode: {fed[0]:,} rows fed, {len(lat_now):,} output rows")
    stop.set()
    feeder.join()
    progress = list(q.recentProgress)
    try:
        q.stop()
    except Exception:  # stopping a failed query re-raises its error, kept below
        pass
    if error is not None:
        return result("real-time latency", keys, "spark", variant, state_ok="", load_1min=round(load, 2),
                      note=f"failed while running: {_spark_message(error)}")
    lat = read_latencies(str(folder), "spark-*.log", t0 + args.warmup)
    batches = "; ".join(f"batch {p['batchId']}: {p['numInputRows']} rows, {p['durationMs'].get('triggerExecution')} ms"
                        for p in progress[:4])
    note = f"accepted; {fed[0]:,} rows fed in {args.rtm_spark_seconds} s; {batches or 'no batch completed'}"
    if not lat:
        note += "; no output row reached the sink"
    return result("real-time latency", keys, "spark", variant, rows=fed[0], seconds=args.rtm_spark_seconds,
                  batches=len(lat), latency_kind="input to sink (output row)", latency_p50_ms=percentile(lat, 0.5),
                  latency_p99_ms=percentile(lat, 0.99), load_1min=round(load, 2), note=note)


# ---------------------------------------------------------------- profile


def profile_keyed_count(args, out: Path) -> None:
    """cProfile of the epochstream keyed count on the simulator (one process: the same operators,
    chain and state code as a local worker, without the pipes)."""
    import cProfile
    import io
    import pstats

    keys = int(args.keys.split(",")[0])
    rows = min(int(str(args.es_rows).split(",")[0]), 1_000_000)
    with tempfile.TemporaryDirectory(prefix="es-profile-") as tmp:
        p = keyed_count_pipeline(keys, rows, args, DiscardingSink(), extra=batching_kwargs(args)[0])
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        p.run(deployment="sim", checkpoint_dir=str(Path(tmp) / "chk"))
        prof.disable()
        seconds = time.perf_counter() - t0
    text = io.StringIO()
    text.write(f"keyed count, {keys} keys, {rows:,} rows, batch {args.batch_size}, simulator, one process: "
               f"{seconds:.1f} s ({rows / seconds:,.0f} rows/s under the profiler)\n\n")
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    (out / "pyspark_stateful_profile.txt").write_text(text.getvalue())
    log(f"profile written to {out / 'pyspark_stateful_profile.txt'}")


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (about 3 minutes)")
    ap.add_argument("--keys", default="100,10000", help="keyed count: comma list of key counts")
    ap.add_argument("--es-rows", default=None,
                    help="keyed count: epochstream input rows, one per key count (comma list; the last repeats)")
    ap.add_argument("--es-rates", default=None,
                    help="keyed count: also run epochstream paced at these rows/s, one entry per key count "
                         "(comma list; the last repeats), each entry one rate or several joined by '/'; "
                         "x1.05: that multiple of Spark's rows/s at the same key count, in this run")
    ap.add_argument("--es-rate-seconds", type=float, default=30.0,
                    help="keyed count: seconds of input of each paced run")
    ap.add_argument("--batch-size", type=int, default=65536, help="epochstream: rows per source read")
    ap.add_argument("--batch-rows", type=int, default=None, help="epochstream batching policy, if the Pipeline has it")
    ap.add_argument("--batch-linger", type=float, default=None, help="epochstream batching policy (seconds)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of output not counted as steady state")
    ap.add_argument("--spark-source", default="rate-micro-batch", choices=["rate-micro-batch", "rate"])
    ap.add_argument("--spark-rows-per-batch", type=int, default=None,
                    help="Spark: rowsPerBatch (rate-micro-batch) or rowsPerSecond (rate)")
    ap.add_argument("--skip-batches", type=int, default=2, help="Spark: warm-up micro-batches not counted")
    ap.add_argument("--spark-batches", type=int, default=None, help="Spark: steady micro-batches measured")
    ap.add_argument("--spark-timeout", type=float, default=None, help="Spark: seconds at most per key count")
    ap.add_argument("--records", type=int, default=None, help="StatefulProcessor workload: input records")
    ap.add_argument("--processor-keys", type=int, default=1_000)
    ap.add_argument("--files", type=int, default=None, help="StatefulProcessor workload: Spark's micro-batches")
    ap.add_argument("--rtm-rate", type=float, default=1000.0, help="real-time comparison: rows per second")
    ap.add_argument("--rtm-keys", type=int, default=100)
    ap.add_argument("--rtm-seconds", type=float, default=None, help="epochstream's rate source run, seconds")
    ap.add_argument("--rtm-spark-seconds", type=float, default=None, help="Spark real-time mode run, seconds")
    ap.add_argument("--no-keyed-count", action="store_true")
    ap.add_argument("--no-processor", action="store_true", help="skip the StatefulProcessor workload")
    ap.add_argument("--no-real-time", action="store_true", help="skip the Real-time Mode comparison")
    ap.add_argument("--profile", action="store_true", help="also cProfile the epochstream keyed count")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--interval", type=float, default=1.0,
                    help="epochstream keyed count: checkpoint interval (seconds between epochs)")
    ap.add_argument("--name", default="pyspark_stateful", help="base name of the CSV and PNG written")
    ap.add_argument("--micro-batch", default="epoch",
                    help="epochstream keyed count: comma list of the wrapper's micro_batch cuts (epoch, batch)")
    ap.add_argument("--max-rows-per-trigger", type=int, default=None,
                    help="epochstream keyed count: the wrapper's max_rows_per_trigger (default: its own)")
    args = ap.parse_args()
    quick = args.quick
    defaults = {"es_rows": "1000000,150000" if quick else "10000000,1000000", "spark_rows_per_batch": 1_500_000,
                "spark_batches": 2 if quick else 6, "spark_timeout": 120 if quick else 300,
                "records": 3_000 if quick else 20_000, "files": 2 if quick else 10,
                "rtm_seconds": 8 if quick else 30, "rtm_spark_seconds": 20 if quick else 60}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if quick:
        args.skip_batches = min(args.skip_batches, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key_counts = [int(k) for k in args.keys.split(",")]
    es_rows = [int(n) for n in str(args.es_rows).split(",")]
    es_rows = dict(zip(key_counts, es_rows + es_rows[-1:] * len(key_counts), strict=False))
    paced = str(args.es_rates).split(",") if args.es_rates else []
    es_rates = dict(zip(key_counts, [e.split("/") for e in paced + paced[-1:] * len(key_counts)],
                        strict=False)) if paced else {}
    for spec in (r for rates in es_rates.values() for r in rates):  # before Spark starts, not mid-run
        try:
            if float(spec[1:] if spec.startswith("x") else spec) <= 0:
                raise ValueError
        except ValueError:
            ap.error(f"--es-rates: {spec!r} is neither rows/s nor a multiple of Spark's rate like x1.05")
    uptime = os.popen("uptime").read().strip()
    log(f"start: {uptime}")

    results: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="pyspark-bench-"))
    spark = None
    try:
        log("starting the SparkSession (local[2], RocksDB state store) ...")
        spark = spark_session()
        if not args.no_keyed_count:
            for keys in key_counts:  # interleaved, so machine noise hits both alike
                for micro_batch in args.micro_batch.split(","):
                    log(f"keyed count, {keys} keys: epochstream ({micro_batch}), {es_rows[keys]:,} rows ...")
                    results.append(es_keyed_count(keys, es_rows[keys], args, micro_batch))
                    r = results[-1]
                    log(f"  -> {r['rows_per_s']:,.0f} rows/s steady, p99 epoch {r['latency_p99_ms']:.0f} ms")
                rates = es_rates.get(keys, [])
                relative = any(r.startswith("x") for r in rates)  # multiples of Spark's rate: Spark first
                spark_rps = None
                if relative:
                    spark_rps = _spark_keyed_count_logged(spark, keys, args, work, results)
                for spec in rates:
                    rate = float(spec[1:]) * (spark_rps or float("nan")) if spec.startswith("x") else float(spec)
                    if rate != rate:  # Spark's run failed: no rate to pace at
                        log(f"keyed count, {keys} keys: no Spark rate for {spec}; skipped")
                        continue
                    rows = int(rate * args.es_rate_seconds)
                    log(f"keyed count, {keys} keys: epochstream paced at {rate:,.0f} rows/s"
                        f"{f' ({spec} Spark)' if spec.startswith('x') else ''}, {rows:,} rows ...")
                    results.append(es_keyed_count(keys, rows, args, args.micro_batch.split(",")[0], rate=rate))
                    r = results[-1]
                    log(f"  -> {r['rows_per_s']:,.0f} rows/s steady, p99 epoch {r['latency_p99_ms']:.0f} ms")
                if not relative:
                    _spark_keyed_count_logged(spark, keys, args, work, results)
        if not args.no_processor:
            data = [{"k": f"k{i % args.processor_keys}", "v": i % 100} for i in range(args.records)]
            write_files(data, args.files, work / "in")
            for layout in ("rows", "arrow"):
                log(f"StatefulProcessor, {args.records:,} records: epochstream ({layout}) ...")
                results.append(es_processor(data, args, work, layout))
            log("StatefulProcessor: Spark micro-batch ...")
            results.append(spark_processor(spark, work / "in", args, work))
        if not args.no_real_time:
            log(f"real-time latency at {args.rtm_rate:g} rows/s: epochstream ...")
            results.append(es_latency(args))
            for check in (True, False):
                log(f"real-time latency: Spark real-time mode, allowlistCheck={check} ...")
                results.append(spark_real_time(spark, args, work, check))
                log(f"  -> {results[-1]['note'][:200]}")
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.profile:
        log("profiling the epochstream keyed count (simulator) ...")
        profile_keyed_count(args, out)
    uptime_end = os.popen("uptime").read().strip()
    log(f"end: {uptime_end}")

    fields = list(results[0]) if results else []
    csv_path, png_path = out / f"{args.name}.csv", out / f"{args.name}.png"
    write_csv(csv_path, [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in results],
              fields, notes=(f"uptime at start: {uptime}", f"uptime at end: {uptime_end}"))
    summary(results)
    plot(results, png_path)
    print(f"wrote {csv_path} and {png_path}")


def _spark_keyed_count_logged(spark, keys: int, args, work: Path, results: list[dict]) -> float:
    """Spark's keyed count at ``keys`` keys, appended to ``results``; its rows/s."""
    log(f"keyed count, {keys} keys: Spark, {args.skip_batches} + {args.spark_batches} batches ...")
    results.append(spark_keyed_count(spark, keys, args, work))
    log(f"  -> {results[-1]['rows_per_s']:,.0f} rows/s, p50 batch {results[-1]['latency_p50_ms']:.0f} ms")
    return results[-1]["rows_per_s"]


def summary(results: list[dict]) -> None:
    print(f"\n{'workload':<18} {'keys':>6} {'system':<12} {'rows/s':>10} {'wall r/s':>10} {'n':>5} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'cpu busy/sat %':>14} {'state':<6} variant / note")
    for r in results:
        cpu = (f"{r['cpu_busy_pct']:.0f} / {r['cpu_saturated_pct']:.0f}"
               if r.get("cpu_busy_pct") == r.get("cpu_busy_pct") else "")  # NaN: not sampled
        print(f"{r['workload']:<18} {r['keys']:>6} {r['system']:<12} {r['rows_per_s']:>10,.0f} "
              f"{r['rows_per_s_wall']:>10,.0f} {r['batches']:>5} {r['latency_p50_ms']:>8.0f} "
              f"{r['latency_p99_ms']:>8.0f} {cpu:>14} "
              f"{str(r['state_ok']):<6} {r['variant']} | {r['note'][:160]}")
    print()
    for workload in ("keyed count", "StatefulProcessor"):
        for keys in dict.fromkeys(r["keys"] for r in results if r["workload"] == workload):
            es = [r for r in results if (r["workload"], r["keys"], r["system"]) == (workload, keys, "epochstream")]
            sp = [r for r in results if (r["workload"], r["keys"], r["system"]) == (workload, keys, "spark")]
            if not es or not sp or sp[0]["rows_per_s"] != sp[0]["rows_per_s"]:
                continue
            target = 1.0 if workload == "keyed count" else 2.0
            for e in es:
                ratio = e["rows_per_s"] / sp[0]["rows_per_s"]
                p99, every = e["latency_p99_ms"], e["latency_p99_all_ms"]
                print(f"{workload}, {keys} keys, {e['variant'][:60]}: epochstream / Spark = {ratio:.2f}x "
                      f"(target >= {target:.1f}x: {'met' if ratio >= target else 'NOT met'})"
                      + (f"; epoch p99 {p99:.0f} ms after warm-up (target <= 1000: "
                         f"{'met' if p99 <= 1000 else 'NOT met'}; every epoch: {every:.0f} ms)"
                         if workload == "keyed count" else ""))


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    color = {"epochstream": "C0", "spark": "C1"}
    for ax, workload in zip(axes[:2], ("keyed count", "StatefulProcessor"), strict=True):
        shown = [r for r in results if r["workload"] == workload and r["rows_per_s"] == r["rows_per_s"]]
        ax.bar(range(len(shown)), [r["rows_per_s"] / 1000 for r in shown], color=[color[r["system"]] for r in shown])
        ax.set_xticks(range(len(shown)), [f"{r['system']}\n{r['keys']} keys\n{r['variant'].split(',')[-1][:18]}"
                                          for r in shown], fontsize=7)
        ax.set_ylabel("thousand rows / s")
        ax.set_title(f"{workload}: throughput (steady state)" if workload == "keyed count"
                     else f"{workload}: throughput")
    ax = axes[2]
    shown = [r for r in results if r["latency_p50_ms"] == r["latency_p50_ms"]
             and r["workload"] in ("keyed count", "real-time latency")]
    ax.bar(range(len(shown)), [r["latency_p50_ms"] for r in shown], color=[color[r["system"]] for r in shown],
           yerr=[[0] * len(shown), [max(0.0, r["latency_p99_ms"] - r["latency_p50_ms"]) for r in shown]])
    kind = {"epoch trigger-to-commit": "epoch", "micro-batch duration": "batch"}
    ax.set_xticks(range(len(shown)), [f"{r['system']}\n{r['workload'].split()[0]} {r['keys']}\n"
                                      f"{kind.get(r['latency_kind'], 'row to sink')}" for r in shown], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (bar p50, whisker to p99)")
    ax.set_title("latency")
    fig.suptitle("PySpark stateful code: epochstream (local, p=2) against Spark Structured Streaming (local[2])")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
