"""The same PySpark StatefulProcessor in epochstream and in Spark Structured Streaming.

Workload: ``records`` rows ``{"k": "k{i % keys}", "v": i % 100}``; one processor class
(transformWithStateInPandas, time mode None) keeps per key a running count and sum
(ValueState) and a histogram of ``v // 10`` (MapState), and emits one row per key per call
with the key's count so far. The processor is vectorised over each key's DataFrame, as
pandas users write them.

- **epochstream**: local driver, parallelism 2, aligned epochs every ``--interval`` s, a
  DiscardingSink; throughput = records / run seconds (start-up of the two worker
  processes included); per-epoch latency = trigger-to-commit seconds of every epoch.
- **Spark micro-batch**: ``local[2]``, two shuffle partitions, RocksDB state store, the
  rows in ``--files`` JSON files read one file per micro-batch, ``trigger(availableNow)``,
  a noop sink; throughput = records / sum of the micro-batches' ``triggerExecution``
  (the JVM and session start-up are excluded, which favours Spark), and records / wall
  seconds of the query; per-batch latency = each micro-batch's ``triggerExecution``.
- **Spark Real-time Mode**: the same query with ``trigger(realTime=...)``; the error is
  recorded when Spark refuses it (Real-time Mode needs sources and sinks that support it).

Each system's final state is checked against the expected per-key counts. Writes
benchmarks/results/pyspark_stateful.csv and .png and prints a summary table. Not a test:
nothing asserts timings.

    python benchmarks/pyspark_stateful.py [--records 200000] [--keys 1000] [--repeats 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from pyspark.sql.streaming import StatefulProcessor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from epochstream import CheckpointConfig, DiscardingSink, Pipeline  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

OUTPUT = "k string, n long"


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


def rows(records: int, keys: int) -> list[dict]:
    return [{"k": f"k{i % keys}", "v": i % 100} for i in range(records)]


def expected_counts(records: int, keys: int) -> dict[str, int]:
    return {f"k{k}": records // keys + (1 if k < records % keys else 0) for k in range(keys)}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------- epochstream


def run_epochstream(data: list[dict], args, work: Path) -> dict:
    p = Pipeline("pyspark-bench", parallelism=2, max_parallelism=128,
                 checkpoint=CheckpointConfig(interval=args.interval), batch_size=args.batch_size)
    (p.from_collection(data, splits=2, uid="rows")
      .transform_with_state(CountSumHistogram(), OUTPUT, "None", key="k", uid="stats")
      .sink(DiscardingSink(), uid="out"))
    t0 = time.perf_counter()
    result = p.run(deployment="local", checkpoint_dir=str(work / "es-chk"))
    seconds = time.perf_counter() - t0
    storage = LocalCheckpointStorage(work / "es-chk")
    manifest, root = storage.latest()
    stats = committed_state(storage, manifest, root)["stats"]["stats"]
    got = {k[0]: v[0][0] for k, v in stats.items()}
    ok = got == expected_counts(args.records, args.keys)
    lat = [e["trigger_to_commit_seconds"] * 1000 for e in result.metrics.get("epochs", [])
           if e.get("state") == "completed"]
    return {"system": "epochstream", "variant": f"local p=2, epochs every {args.interval}s",
            "seconds": seconds, "records_per_s": args.records / seconds, "records_per_s_wall": args.records / seconds,
            "batches": len(lat), "latency_median_ms": statistics.median(lat) if lat else float("nan"),
            "latency_p95_ms": pct(lat, 0.95), "state_ok": ok, "note": ""}


# ---------------------------------------------------------------- Spark


def spark_session():
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master("local[2]").appName("pyspark-stateful-bench")
            .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false")
            .config("spark.sql.streaming.stateStore.providerClass",
                    "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
            .getOrCreate())


def write_files(data: list[dict], files: int, folder: Path) -> None:
    folder.mkdir(parents=True)
    per = -(-len(data) // files)
    for f in range(files):
        path = folder / f"part-{f:04d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in data[f * per:(f + 1) * per]))
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))  # oldest first: file order


def run_spark(spark, src: Path, args, work: Path, real_time: bool) -> dict:
    df = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).json(str(src))
    out = df.groupBy("k").transformWithStateInPandas(CountSumHistogram(), OUTPUT, "Update", "None")
    chk = work / ("spark-rtm-chk" if real_time else "spark-chk")
    writer = out.writeStream.format("noop").option("checkpointLocation", str(chk)).outputMode("update")
    variant = "real-time mode" if real_time else "micro-batch, availableNow, 1 file per batch"
    t0 = time.perf_counter()
    try:
        q = writer.trigger(realTime="5 seconds").start() if real_time else writer.trigger(availableNow=True).start()
        if real_time:
            deadline = time.monotonic() + 300
            while q.isActive and sum(p["numInputRows"] for p in q.recentProgress) < args.records:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            q.stop()
        else:
            q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
    except Exception as exc:  # Spark refused the query: record why
        first = str(exc).strip().splitlines()[0][:300]
        return {"system": "spark", "variant": variant, "seconds": float("nan"), "records_per_s": float("nan"),
                "records_per_s_wall": float("nan"), "batches": 0, "latency_median_ms": float("nan"),
                "latency_p95_ms": float("nan"), "state_ok": False, "note": f"not accepted: {first}"}
    wall = time.perf_counter() - t0
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    lat = [p["durationMs"]["triggerExecution"] for p in progress]
    busy = sum(lat) / 1000
    state = spark.read.format("statestore").option("stateVarName", "stats").load(str(chk))
    got = {r["key"][0]: r["value"][0] for r in state.collect()}
    return {"system": "spark", "variant": variant, "seconds": busy, "records_per_s": args.records / busy,
            "records_per_s_wall": args.records / wall, "batches": len(lat),
            "latency_median_ms": statistics.median(lat) if lat else float("nan"), "latency_p95_ms": pct(lat, 0.95),
            "state_ok": got == expected_counts(args.records, args.keys), "note": ""}


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--keys", type=int, default=1_000)
    ap.add_argument("--files", type=int, default=10, help="Spark: input files = micro-batches")
    ap.add_argument("--interval", type=float, default=1.0, help="epochstream: seconds between epochs")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-real-time", action="store_true", help="skip the Real-time Mode attempt")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()

    data = rows(args.records, args.keys)
    results: list[dict] = []
    spark = spark_session()
    try:
        for rep in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix="pyspark-bench-"))
            try:
                write_files(data, args.files, work / "in")
                print(f"[{rep + 1}/{args.repeats}] epochstream ...", flush=True)
                results.append({"repeat": rep, **run_epochstream(data, args, work)})
                print(f"[{rep + 1}/{args.repeats}] spark micro-batch ...", flush=True)
                results.append({"repeat": rep, **run_spark(spark, work / "in", args, work, real_time=False)})
                if not args.no_real_time:
                    print(f"[{rep + 1}/{args.repeats}] spark real-time mode ...", flush=True)
                    results.append({"repeat": rep, **run_spark(spark, work / "in", args, work, real_time=True)})
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        spark.stop()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = ["repeat", "system", "variant", "seconds", "records_per_s", "records_per_s_wall", "batches",
              "latency_median_ms", "latency_p95_ms", "state_ok", "note"]
    with open(out / "pyspark_stateful.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in results:
            w.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})

    print(f"\n{args.records} records, {args.keys} keys, parallelism 2, one machine, one run")
    print(f"{'system':<12} {'variant':<46} {'rec/s':>9} {'rec/s wall':>10} {'n':>4} "
          f"{'median ms':>10} {'p95 ms':>8} state")
    for r in results:
        print(f"{r['system']:<12} {r['variant'][:46]:<46} {r['records_per_s']:>9.0f} {r['records_per_s_wall']:>10.0f} "
              f"{r['batches']:>4} {r['latency_median_ms']:>10.0f} {r['latency_p95_ms']:>8.0f} "
              f"{'ok' if r['state_ok'] else 'BAD'} {r['note'][:80]}")
    es = [r for r in results if r["system"] == "epochstream"]
    sp = [r for r in results if r["system"] == "spark" and r["variant"].startswith("micro")]
    if es and sp:
        ratio = statistics.median(r["records_per_s"] for r in es) / statistics.median(r["records_per_s"] for r in sp)
        print(f"throughput ratio epochstream / Spark micro-batch (Spark busy time): {ratio:.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["records_per_s"] == r["records_per_s"]]  # drop NaN (refused)
    labels = [f"{r['system']}\n{r['variant'].split(',')[0]}" for r in shown]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["C0" if r["system"] == "epochstream" else "C1" for r in shown]
    a.bar(range(len(shown)), [r["records_per_s"] for r in shown], color=colors)
    a.set_xticks(range(len(shown)), labels, fontsize=8)
    a.set_ylabel("records / s")
    a.set_title("throughput (Spark: busy time)")
    b.bar(range(len(shown)), [r["latency_median_ms"] for r in shown], yerr=[
        [0] * len(shown), [max(0.0, r["latency_p95_ms"] - r["latency_median_ms"]) for r in shown]],
        color=["C0" if r["system"] == "epochstream" else "C1" for r in shown])
    b.set_xticks(range(len(shown)), labels, fontsize=8)
    b.set_ylabel("ms (median, bar to p95)")
    b.set_title("per-epoch / per-micro-batch latency")
    fig.suptitle(f"one StatefulProcessor, {args.records} records, {args.keys} keys, parallelism 2")
    fig.tight_layout()
    fig.savefig(out / "pyspark_stateful.png", dpi=110)
    print(f"wrote {out / 'pyspark_stateful.csv'} and {out / 'pyspark_stateful.png'}")


if __name__ == "__main__":
    main()
