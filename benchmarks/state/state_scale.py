"""Keyed state at scale: the files backend against the Delta backend (delta-rs commits), and the
heap (``hashmap``) keyed-state backend against RocksDB (``rocksdb``), per epoch.

Workload: a ``rate`` source at ``--rate`` rows/s for ``--seconds`` (the same input for every
backend), keyed by ``value % --keys``, a running count in ValueState emitting ``(key, n)``,
a discarding sink; local driver, ``--parallelism`` workers, aligned epochs every
``--interval`` seconds, incremental snapshots.

For every completed epoch the job master's epoch log gives:

* ``trigger_to_manifest_s``: trigger until the manifest is written (the checkpoint exists);
* ``commit_s``: the commits after the manifest (for Delta: one changelog append per stateful operator
  through delta-rs, then the sinks);
* ``trigger_to_commit_s`` = the two added: trigger until the epoch's state is visible to
  readers (Delta: the table version holding the epoch). This is the figure compared.

Per run also: records/s (records in / run wall time), the peak RSS of each worker process
(sampled every 0.2 s from /proc), and with ``--restore`` the wall time of a second run that
restores the final checkpoint (its sources are exhausted: reading the state into the keyed-state
backend is the work). ``--state-backend-types hashmap,rocksdb`` runs every checkpoint backend
with each keyed-state backend (``CheckpointConfig.state_backend_type``; ``--rocksdb-memory-mb``),
and ``--incremental-modes on,off`` each with incremental checkpoints (RocksDB: only new SST
files uploaded, ``backends/rocksdb_checkpoint.py``) and without (every capture in full).
Per epoch also ``checkpoint_bytes``: what the epoch wrote to checkpoint storage.

Writes ``benchmarks/results/<name>.csv`` (one row per epoch), ``<name>_rss.csv`` (every
worker's RSS every 0.2 s of every run) and ``<name>.png`` (trigger->commit, bytes written per
epoch, worker RSS over time); prints a summary table with p50/p99 per backend and the
Delta/files ratio of the p99. Each run is checked: the final committed state holds every
key's exact count. Not a test.

Several ``--keys`` (``10000,1000000``) run one after another; the summary then states the
targets this run measured (``targets``: Delta/files p99 per key count, the heap's p99 against
the interval, the heap's records/s at the largest key count against the smallest) and writes
them to ``<name>_targets.csv``.

``--spark`` also runs Spark Structured Streaming's grouped count on its RocksDB state store
(``RocksDBStateStoreProvider``, memory bounded to ``--rocksdb-memory-mb`` per partition) at each
key count with the same rows per second and seconds (``rate-micro-batch``, a micro-batch every
``--interval``, ``local[--parallelism]``), after the epochstream runs, in its own process:
records/s over the micro-batches after the first, micro-batch duration p50/p99 (Spark commits
state and offsets at a micro-batch's end), state rows checked against the keys, the JVM's peak
RSS and checkpoint size. Written to ``<name>_spark.csv`` and printed under the table.

    python benchmarks/state/state_scale.py [--keys 100000[,1000000]] [--rate 50000] [--seconds 40]
        [--backends files,delta] [--state-backend-types hashmap,rocksdb] [--incremental-modes on,off] [--restore]
        [--spark] [--name state_scale]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, children_rss_mb, percentile, private_mb, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    KeyedProcessFunction,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.oracle import committed_state  # noqa: E402


class RunningCount(KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        return ((ctx.key, n),)


class KeyOf:
    """``value % keys`` (a class, so it pickles to the workers by reference)."""

    def __init__(self, keys: int) -> None:
        self.keys = keys

    def __call__(self, record: dict[str, Any]) -> int:
        return int(record["value"]) % self.keys


def build(backend: str, keys: int, rate: float, seconds: float, interval: float, parallelism: int,
          state_type: str = "hashmap", memory_mb: int = 64, incremental: bool = True) -> Pipeline:
    p = Pipeline(f"state-scale-{backend}", parallelism=parallelism,
                 checkpoint=CheckpointConfig(interval=interval, incremental=incremental, state_backend_type=state_type,
                                             rocksdb_memory_mb=memory_mb))
    p.checkpoint.state_backend = backend
    (
        p.rate(rate, count=int(rate * seconds), uid="src")
        .key_by(KeyOf(keys))
        .process(RunningCount(), uid="count")
        .sink(DiscardingSink(), uid="out")
    )
    return p


def _spark_count(keys: int, rate: float, seconds: float, interval: float, parallelism: int, memory_mb: int,
                 queue: Any) -> None:
    """Spark Structured Streaming's grouped count on its RocksDB state store, in this (spawned)
    process: ``rate-micro-batch`` with ``rate * interval`` rows per micro-batch, key ``value %
    keys``, ``groupBy(k).count()`` in update mode to a ``noop`` sink, a micro-batch every
    ``interval``. Puts one dict on ``queue``: every micro-batch's progress and the peak RSS of
    the JVM (this process's children, sampled every 0.2 s)."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(children_rss_mb().values()))
            time.sleep(0.2)

    chk = tempfile.mkdtemp(prefix="spark-state-scale-")
    spark = (SparkSession.builder.master(f"local[{parallelism}]").appName("state-scale-spark")
             .config("spark.sql.shuffle.partitions", str(parallelism))
             .config("spark.sql.streaming.stateStore.providerClass",
                     "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
             .config("spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage", "true")
             .config("spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB", str(memory_mb * parallelism))
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    threading.Thread(target=sample, daemon=True).start()
    batches = max(2, round(seconds / interval))
    per_batch = max(1, int(rate * interval))
    df = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", per_batch)
          .option("numPartitions", parallelism).load())
    q = (df.groupBy((F.col("value") % keys).alias("k")).count()
         .writeStream.format("noop").outputMode("update").option("checkpointLocation", chk)
         .trigger(processingTime=f"{int(interval * 1000)} milliseconds").start())
    t0 = time.time()
    while True:
        done = [p for p in q.recentProgress if p["numInputRows"]]
        if len(done) >= batches + 1 or q.exception() is not None or time.time() - t0 > 40 * seconds + 600:
            break
        time.sleep(0.5)
    failed = q.exception()
    progress = [p for p in q.recentProgress if p["numInputRows"]]
    q.stop()
    stop.set()
    folder = sum(f.stat().st_size for f in Path(chk).rglob("*") if f.is_file())
    spark.stop()
    shutil.rmtree(chk, ignore_errors=True)
    queue.put({"progress": progress, "peak_rss_mb": peak[0], "checkpoint_mib": folder / 2**20,
               "failed": None if failed is None else str(failed).splitlines()[0], "wall_s": time.time() - t0})


def run_spark(keys: int, args: argparse.Namespace) -> dict[str, Any]:
    """One Spark run at ``keys`` (its own process), summarised as the epochstream runs are:
    records/s over the micro-batches after the first (Spark's start-up left out, as it compiles
    the query there), micro-batch duration p50/p99 (a micro-batch commits its state and offsets
    when it ends: Spark's trigger -> commit), state rows against ``keys``, JVM peak RSS."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_spark_count, args=(keys, args.rate, args.seconds, args.interval, args.parallelism,
                                                   args.rocksdb_memory_mb, q))
    load = os.getloadavg()[0]
    proc.start()
    got = q.get()
    proc.join()
    prog = got["progress"]
    later = prog[1:] or prog
    busy = sum(p["durationMs"]["triggerExecution"] for p in later) / 1000.0
    durations = [p["durationMs"]["triggerExecution"] / 1000.0 for p in later]
    state_rows = prog[-1]["stateOperators"][0]["numRowsTotal"] if prog and prog[-1].get("stateOperators") else None
    return {"backend": "spark-rocksdb", "keys": keys, "micro_batches": len(prog),
            "rows": sum(p["numInputRows"] for p in prog),
            "records_per_s": round(sum(p["numInputRows"] for p in later) / busy) if busy else None,
            "batch_p50_s": round(percentile(durations, 0.5), 3), "batch_p99_s": round(percentile(durations, 0.99), 3),
            "state_rows": state_rows, "state_ok": state_rows == min(keys, sum(p["numInputRows"] for p in prog)),
            "peak_rss_mb_jvm": round(got["peak_rss_mb"]), "checkpoint_mib": round(got["checkpoint_mib"], 1),
            "failed": got["failed"] or "", "load1": round(load, 2),
            "settings": f"local[{args.parallelism}], rate-micro-batch {int(args.rate * args.interval)} rows per "
                        f"micro-batch every {args.interval:g} s, RocksDB state store bounded to "
                        f"{args.rocksdb_memory_mb * args.parallelism} MB, noop sink, update mode"}


def _run_sampled(p: Pipeline, trace: list[tuple[float, int, float, float]] | None = None,
                 **kw: Any) -> tuple[Any, float, list[float]]:
    """Run ``p`` on the local driver: (result, wall seconds, peak RSS MB per worker process);
    ``trace`` gets (seconds since the start, worker pid, RSS MB) of every sample."""
    peaks: dict[int, float] = {}
    stop = threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        while not stop.wait(0.2):
            now = time.perf_counter() - start
            for pid, mb in children_rss_mb().items():
                peaks[pid] = max(peaks.get(pid, 0.0), mb)
                if trace is not None:
                    trace.append((now, pid, mb, private_mb(pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        result = p.run(deployment="local", **kw)
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
    # the job master runs in this process; its children are the workers (and nothing else here)
    return result, wall, sorted(peaks.values(), reverse=True)


def run_one(backend: str, args: argparse.Namespace, work: Path, state_type: str = "hashmap",
            incremental: bool = True, trace: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    chk = work / f"chk-{backend}"
    label = (backend if state_type == "hashmap" else f"{backend}+{state_type}") + ("" if incremental else "-full")
    p = build(backend, args.keys, args.rate, args.seconds, args.interval, args.parallelism, state_type,
              args.rocksdb_memory_mb, incremental)
    samples: list[tuple[float, int, float, float]] = []
    result, wall, rss = _run_sampled(p, samples, checkpoint_dir=str(chk))
    if trace is not None:
        trace += [{"backend": label, "keys": args.keys, "t_s": round(t, 2), "pid": pid, "rss_mb": round(mb, 1),
                   "private_mb": round(priv, 1)} for t, pid, mb, priv in samples]
    check(backend, chk, args)
    restore_s = float("nan")
    if args.restore:  # the sources are exhausted: the restored run only reads the state back
        again = build(backend, args.keys, args.rate, args.seconds, args.interval, args.parallelism, state_type,
                      args.rocksdb_memory_mb, incremental)
        _res, restore_s, _rss = _run_sampled(again, checkpoint_dir=str(chk), restore="latest")
    rows = []
    load1 = os.getloadavg()[0]
    for e in result.metrics.get("epochs", []):
        if e.get("state") != "completed":
            continue
        t2m = float(e["trigger_to_commit_seconds"])
        commit = float(e["commit_seconds"])
        rows.append({
            "backend": label, "state_backend_type": state_type, "keys": args.keys, "rate": args.rate,
            "interval_s": args.interval, "parallelism": args.parallelism, "epoch": e["epoch"], "kind": e.get("kind"),
            "trigger_to_manifest_s": round(t2m, 4), "commit_s": round(commit, 4),
            "trigger_to_commit_s": round(t2m + commit, 4), "run_wall_s": round(wall, 2),
            "incremental": incremental, "checkpoint_bytes": int(e.get("bytes", 0)),
            "rocksdb_memory_mb": args.rocksdb_memory_mb if state_type == "rocksdb" else "",
            "records_in": result.records_in, "records_per_s": round(result.records_in / wall),
            "peak_rss_mb_per_worker": ";".join(f"{m:.0f}" for m in rss), "restore_run_s": round(restore_s, 2),
            "load1": round(load1, 2),
        })
    return rows


def check(backend: str, chk: Path, args: argparse.Namespace) -> None:
    """The newest checkpoint's committed state holds every key's exact count (for Delta: read
    back from the table at the recorded version, by delta-rs)."""
    from epochstream.backends.local import LocalCheckpointStorage

    if backend == "delta":
        from epochstream.backends.delta import DeltaCheckpointStorage

        storage: Any = DeltaCheckpointStorage(str(chk))
    else:
        storage = LocalCheckpointStorage(chk)
    latest = storage.latest()
    if latest is None:
        raise SystemExit(f"{backend}: no checkpoint")
    manifest, root = latest
    counts = committed_state(storage, manifest, root)["count"].get("count", {})
    total = int(args.rate * args.seconds)
    want = {k: total // args.keys + (1 if k < total % args.keys else 0) for k in range(min(args.keys, total))}
    if counts != want:
        raise SystemExit(f"{backend}: committed counts are wrong ({len(counts)} keys, {sum(counts.values())} counts)")


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for b, k in dict.fromkeys((r["backend"], r["keys"]) for r in rows):
        xs = [r for r in rows if r["backend"] == b and r["keys"] == k]
        t2c = [r["trigger_to_commit_s"] for r in xs]
        out.append({
            "backend": b, "keys": k, "epochs": len(xs), "run_wall_s": xs[0]["run_wall_s"] if xs else float("nan"),
            "t2c_p50": percentile(t2c, 0.5), "t2c_p99": percentile(t2c, 0.99),
            "t2c_max": max(t2c) if t2c else float("nan"),
            "commit_p50": percentile([r["commit_s"] for r in xs], 0.5),
            "commit_p99": percentile([r["commit_s"] for r in xs], 0.99),
            "t2m_p50": percentile([r["trigger_to_manifest_s"] for r in xs], 0.5),
            "mean": statistics.fmean(t2c) if t2c else float("nan"),
            "records_per_s": xs[0]["records_per_s"] if xs else 0, "rss": xs[0]["peak_rss_mb_per_worker"] if xs else "",
            "restore_s": xs[0]["restore_run_s"] if xs else float("nan"), "load1": xs[0]["load1"] if xs else 0.0,
            "bytes_p50": percentile([r["checkpoint_bytes"] for r in xs], 0.5),
            "bytes_max": max((r["checkpoint_bytes"] for r in xs), default=0),
        })
    return out


def targets(table: list[dict[str, Any]], interval: float, path: Path) -> list[dict[str, Any]]:
    """The targets that this run measured, as ratios within the run: Delta's p99 within
    1.2x of the files backend's per key count; the heap's p99 <= 2x the interval; the heap's
    records/s at its largest key count >= 0.7x of its smallest. Printed and written as CSV."""
    by = {(r["backend"], r["keys"]): r for r in table}
    out = []
    for (b, k), r in by.items():
        f = by.get(("files", k))
        if b == "delta" and f is not None:
            ratio = r["t2c_p99"] / f["t2c_p99"]
            out.append({"target": f"delta p99 / files p99 at {k:,} keys", "value": round(ratio, 2),
                        "bound": "<= 1.2", "holds": ratio <= 1.2})
        if b in ("files", "delta"):  # the heap (hashmap) keyed-state backend
            ratio = r["t2c_p99"] / interval
            out.append({"target": f"{b} (heap) p99 / interval at {k:,} keys", "value": round(ratio, 2),
                        "bound": "<= 2 (the target is set at 5M keys)", "holds": ratio <= 2})
    for b in dict.fromkeys(b for b, _k in by):
        ks = sorted(k for bb, k in by if bb == b)
        if b in ("files", "delta") and len(ks) > 1:
            ratio = by[(b, ks[-1])]["records_per_s"] / by[(b, ks[0])]["records_per_s"]
            out.append({"target": f"{b} (heap) records/s at {ks[-1]:,} / at {ks[0]:,} keys", "value": round(ratio, 2),
                        "bound": ">= 0.7", "holds": ratio >= 0.7})
    if out:
        print(f"\n{'target':<48} {'value':>6}  {'bound':<24} holds")
        for t in out:
            print(f"{t['target']:<48} {t['value']:>6}  {t['bound']:<24} {'yes' if t['holds'] else 'NO'}")
        write_csv(path, out)
    return out


def plot(rows: list[dict[str, Any]], path: Path, trace: list[dict[str, Any]] | None = None) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    ax, bx, cx = axes
    colors = {"files": "tab:blue", "delta": "tab:orange", "files+rocksdb": "tab:green", "delta+rocksdb": "tab:red",
              "files+rocksdb-full": "tab:olive", "files-full": "tab:cyan"}
    several = len({r["keys"] for r in rows}) > 1
    for b, k, rep in dict.fromkeys((r["backend"], r["keys"], r.get("repeat", 0)) for r in rows):
        xs = [r for r in rows if r["backend"] == b and r["keys"] == k and r.get("repeat", 0) == rep]
        ax.plot([r["epoch"] for r in xs], [r["trigger_to_commit_s"] for r in xs], marker="o", ms=3,
                color=None if several else colors.get(b), alpha=0.8,
                label=f"{b}{f' {k:,} keys' if several else ''} (run {int(rep) + 1})")
        bx.plot([r["epoch"] for r in xs], [r.get("checkpoint_bytes", 0) / 2**20 for r in xs], marker="o", ms=3,
                color=colors.get(b), alpha=0.8, label=b)
    ax.set_xlabel("epoch")
    ax.set_ylabel("trigger -> commit (s)")
    k = rows[0]["keys"] if rows else 0
    ax.set_title(f"keyed running count, {k:,} keys, local driver p={rows[0]['parallelism'] if rows else 0}")
    bx.set_xlabel("epoch")
    bx.set_ylabel("checkpoint bytes written (MiB)")
    bx.set_title("bytes written per epoch")
    for b in dict.fromkeys(t["backend"] for t in trace or []):
        pts = [t for t in trace or [] if t["backend"] == b]
        by_t: dict[float, float] = {}
        priv: dict[float, float] = {}
        for t in pts:  # the largest worker at each sample
            by_t[t["t_s"]] = max(by_t.get(t["t_s"], 0.0), t["rss_mb"])
            priv[t["t_s"]] = max(priv.get(t["t_s"], 0.0), t.get("private_mb", 0.0))
        cx.plot(list(by_t), list(by_t.values()), color=colors.get(b), label=f"{b} RSS", alpha=0.5)
        cx.plot(list(priv), list(priv.values()), color=colors.get(b), label=f"{b} private", linestyle="--")
    mem = next((r.get("rocksdb_memory_mb") for r in rows if r.get("rocksdb_memory_mb")), None)
    cx.set_xlabel("seconds since the run started")
    cx.set_ylabel("memory of the largest worker (MB)")
    cx.set_title("worker RSS over time" + (f" (rocksdb_memory_mb={mem} per subtask)" if mem else ""))
    for a in axes:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default="100000",
                    help="distinct keys; several (10000,1000000) run one after another in this run")
    ap.add_argument("--rate", type=float, default=50_000, help="rows/s of the rate source")
    ap.add_argument("--seconds", type=float, default=40, help="input length in seconds at --rate")
    ap.add_argument("--interval", type=float, default=1.0, help="checkpoint interval (s)")
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--backends", default="files,delta")
    ap.add_argument("--state-backend-types", default="hashmap",
                    help="keyed-state backends to run each checkpoint backend with: hashmap, rocksdb or both")
    ap.add_argument("--rocksdb-memory-mb", type=int, default=64, help="rocksdb: memory bound per operator subtask")
    ap.add_argument("--incremental-modes", default="on",
                    help="incremental checkpoints: on, off or on,off (each keyed-state backend runs with each)")
    ap.add_argument("--restore", action="store_true", help="time a restore of each run's final checkpoint")
    ap.add_argument("--repeats", type=int, default=1, help="runs per backend, interleaved")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="state_scale")
    ap.add_argument("--spark", action="store_true",
                    help="also Spark Structured Streaming's grouped count on its RocksDB state store at each "
                         "key count, same input (<name>_spark.csv)")
    args = ap.parse_args(argv)
    key_counts = [int(k) for k in str(args.keys).split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    trace: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="state-scale-"))
    try:
        for rep in range(args.repeats):
            combos = [(k, b, t, inc == "on") for k in key_counts for t in args.state_backend_types.split(",")
                      for inc in args.incremental_modes.split(",") for b in args.backends.split(",")]
            for keys, b, state_type, incremental in combos:
                one = argparse.Namespace(**{**vars(args), "keys": keys})
                got = run_one(b, one, work, state_type, incremental, trace)
                for r in got:
                    r["repeat"] = rep
                rows += got
                g = got[0] if got else {}
                print(f"{b}/{state_type}{'' if incremental else '/full'} {keys} keys repeat {rep}: {len(got)} epochs, "
                      f"run {g.get('run_wall_s')} s, "
                      f"{g.get('records_per_s')} records/s, peak RSS per worker {g.get('peak_rss_mb_per_worker')} MB, "
                      f"restore run {g.get('restore_run_s')} s, load {os.getloadavg()[0]:.1f}", flush=True)
                shutil.rmtree(work / f"chk-{b}", ignore_errors=True)
                write_csv(out / f"{args.name}.csv", rows)
                write_csv(out / f"{args.name}_rss.csv", trace,
                          ["backend", "keys", "t_s", "pid", "rss_mb", "private_mb"])
        spark_rows = []
        for keys in key_counts if args.spark else ():
            spark_rows.append(run_spark(keys, args))
            print(f"spark-rocksdb {keys} keys: {spark_rows[-1]}", flush=True)
            write_csv(out / f"{args.name}_spark.csv", spark_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = summary(rows)
    print(f"\n{'backend':<19} {'keys':>9} {'epochs':>6} {'run s':>6} {'rec/s':>8} {'t->c p50':>9} {'t->c p99':>9} "
          f"{'max':>7} "
          f"{'commit p50':>10} {'commit p99':>10} {'t->manifest p50':>15} {'MiB/epoch p50':>13} {'max':>7} "
          f"{'restore s':>9} {'load1':>5}  peak RSS MB/worker")
    for r in table:
        print(f"{r['backend']:<19} {r['keys']:>9} {r['epochs']:>6} {r['run_wall_s']:>6} {r['records_per_s']:>8} "
              f"{r['t2c_p50']:>8.3f}s "
              f"{r['t2c_p99']:>8.3f}s {r['t2c_max']:>6.2f}s {r['commit_p50']:>9.3f}s {r['commit_p99']:>9.3f}s "
              f"{r['t2m_p50']:>14.3f}s {r['bytes_p50'] / 2**20:>13.2f} {r['bytes_max'] / 2**20:>7.2f} "
              f"{r['restore_s']:>9} {r['load1']:>5}  {r['rss']}")
    for r in spark_rows:
        print(f"{'spark-rocksdb':<19} {r['keys']:>9} {r['micro_batches']:>6} {'':>6} {r['records_per_s']!s:>8} "
              f"{r['batch_p50_s']:>8.3f}s {r['batch_p99_s']:>8.3f}s   (micro-batch durations; state rows "
              f"{r['state_rows']}, checkpoint {r['checkpoint_mib']} MiB, JVM peak RSS {r['peak_rss_mb_jvm']} MB"
              f"{', failed: ' + r['failed'] if r['failed'] else ''})")
    targets(table, args.interval, out / f"{args.name}_targets.csv")
    plot(rows, out / f"{args.name}.png", trace)
    print(f"wrote {out / (args.name + '.csv')} and {args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
