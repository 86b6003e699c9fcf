"""Throughput and latency of the local driver, with and without epochs, against Bytewax (and PyFlink).

Workload (the same for every system, see benchmarks/peers/README.md): record i is
``("k{i % keys}", 1)``; map (value * 1); key by the key; a keyed running count in
ValueState emitting ``(key, count)``; a sink that discards. Parallelism / workers 2.

Variants of epochstream, interleaved with the peers in every repetition so machine noise
hits all of them alike:
- ``epochs-1s``: aligned epochs every second (snapshots + 2PC);
- ``no-epochs``: only the final epoch of the bounded job;
- ``latency``: epochs every second; every 64th count carries its source timestamp to the
  sink, which records source-to-sink latency (ms);
- ``vectorised``: the columnar keyed path, ``generate_batches -> key_by("k") ->
  process_batches`` (a running count per key in ValueState, one call per key per batch),
  epochs every second, ``--vector-rows`` rows per batch (``batch_rows``);
- ``slow-operator`` (``--memory-seconds`` > 0): the vectorised path from an unbounded source
  for that many seconds, with an operator that costs 10x what the source does per row, so
  the source outpaces it 10x; the max RSS of every worker process (``/proc/PID/status``) is
  sampled during the run, to show backpressure bounds what columnar batches pile up.
Each epochstream run is checked: the final committed state must hold exactly N counts.

The Python limit: a plain single-process Python loop doing the same work, per core, times the
two workers: for the row path ``for i in range(N)`` making the record, mapping it and counting
it in a dict; for the vectorised path the same Arrow batches counted per key with pyarrow's
``group_by`` into a dict. ``ratio_to_python_limit`` = rows/s / (2 x the loop's rows/s).

Writes benchmarks/results/throughput.csv and throughput.png; prints a summary table.
Not a test: nothing here asserts timings.

    python benchmarks/epochs/throughput.py [--records 3000000] [--repeats 3] [--peers bytewax,pyflink]
        [--vector-records 20000000] [--vector-rows 65536] [--memory-seconds 8] [--name throughput]

Peers (``--peers``, run by benchmarks/peers/run_peers.py in their own venvs): ``bytewax``,
``pyflink`` (Flink 2.3's defaults: process mode, bundles of 1,000 records), and PyFlink at its
best, with 1 s checkpoints only: ``pyflink-tuned`` (process mode, bundle 100,000, Python metrics
off, unaligned checkpoints), ``pyflink-thread`` (thread mode, Python metrics off, default bundle,
aligned checkpoints, on a standalone cluster of 2 TaskManagers x 1 slot) and ``flink-sql``
(Flink SQL ``COUNT(*) GROUP BY`` on that cluster: the JVM's ceiling, no Python). Their rows
carry ``checkpoints`` (completed) and ``settings``.

``--baseline-src DIR`` also runs the epochstream variants from another source tree (the
``src`` folder of a checkout of an earlier commit, e.g. a ``git worktree``), interleaved
with this tree's in the same repetitions, as system ``epochstream@baseline``; both then run
in a child process each, so neither has the benchmark's own process to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, children_rss_mb, percentile, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    DiscardingSink,
    FileSink,
    KeyedBatchFunction,
    KeyedProcessFunction,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

KEYS = 1000


class RunningCount(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        n = self.count.value() + value[1]
        self.count.update(n)
        return ((ctx.key, n),)


class RunningCountStamped(RunningCount):
    def process(self, value, ctx):
        n = self.count.value() + value[1]
        self.count.update(n)
        return ((ctx.key, n, value[2]),)


def _record(i: int):
    return (f"k{i % KEYS}", 1)


def _stamped(i: int):
    return (f"k{i % KEYS}", 1, time.perf_counter())  # CLOCK_MONOTONIC: comparable across processes


def _sample_latency(r) -> bool:
    return r[1] % 64 == 0


def _latency_ms(r) -> float:
    return (time.perf_counter() - r[2]) * 1000.0


def build(records: int, interval: float | None, latency_dir: str | None = None) -> Pipeline:
    p = Pipeline("throughput", parallelism=2, checkpoint_interval=interval)
    if latency_dir is None:
        (p.generate(_record, count=records, uid="src")
         .map(lambda r: (r[0], r[1] * 1))
         .key_by(lambda r: r[0])
         .process(RunningCount(), uid="count")
         .sink(DiscardingSink(), uid="sink"))
    else:
        (p.generate(_stamped, count=records, uid="src")
         .map(lambda r: (r[0], r[1] * 1, r[2]))
         .key_by(lambda r: r[0])
         .process(RunningCountStamped(), uid="count")
         .filter(_sample_latency)
         .map(_latency_ms)
         .sink(FileSink(latency_dir), uid="latency"))
    return p


def run_epochstream(records: int, variant: str) -> dict:
    interval = None if variant == "no-epochs" else 1.0
    with tempfile.TemporaryDirectory(prefix="es-bench-") as tmp:
        lat_dir = os.path.join(tmp, "lat") if variant == "latency" else None
        p = build(records, interval, lat_dir)
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=os.path.join(tmp, "chk"))
        seconds = time.perf_counter() - t0
        workers_cpu = _children_cpu() - cpu0  # CPU of the reaped worker processes
        storage = LocalCheckpointStorage(os.path.join(tmp, "chk"))
        manifest, root = storage.latest()
        total = sum(committed_state(storage, manifest, root)["count"]["count"].values())
        if total != records:
            raise RuntimeError(f"epochstream {variant}: committed counts sum to {total}, expected {records}")
        row = {"system": "epochstream", "variant": variant, "snapshot_interval": interval or 0,
               "records": records, "seconds": seconds, "records_per_s": records / seconds,
               "epochs": len(result.completed_epochs), "workers": 2, "p50_ms": "", "p99_ms": "",
               "workers_cpu_per_wall": round(workers_cpu / seconds, 2)}
        if lat_dir:
            lat = sorted(FileSink(lat_dir).read())
            row["p50_ms"] = percentile(lat, 0.5)
            row["p99_ms"] = percentile(lat, 0.99)
        return row


class BatchCount(KeyedBatchFunction):
    """The vectorised running count: one state read and write per key per batch."""

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process_batch(self, key, batch, ctx):
        self.count.update(self.count.value() + batch.num_rows)


class SlowBatchCount(BatchCount):
    """``BatchCount`` that also sleeps ``per_row`` seconds per row: an operator slower than its source."""

    def __init__(self, per_row: float) -> None:
        self.per_row = per_row
        self.debt = 0.0  # seconds owed: slept in pieces of >= 2 ms, so sleep's own overhead does not add up

    def process_batch(self, key, batch, ctx):
        self.debt += batch.num_rows * self.per_row
        if self.debt >= 0.002:
            time.sleep(self.debt)
            self.debt = 0.0
        super().process_batch(key, batch, ctx)


def _keys_batch(start: int, stop: int):
    """Rows [start, stop) of the vectorised workload: column ``k`` = i % KEYS (int64)."""
    import numpy as np
    import pyarrow as pa

    return pa.record_batch({"k": pa.array(np.arange(start, stop, dtype=np.int64) % KEYS)})


def build_vectorised(records: int | None, rows: int, interval: float | None = 1.0, slow_per_row: float = 0.0,
                     keys_batch=None) -> Pipeline:
    p = Pipeline("throughput-vectorised", parallelism=2, checkpoint_interval=interval, batch_rows=rows)
    fn = SlowBatchCount(slow_per_row) if slow_per_row else BatchCount()
    (p.generate_batches(keys_batch or _keys_batch, count=records, uid="src", block_rows=rows)
     .key_by("k")
     .process_batches(fn, uid="count")
     .sink(DiscardingSink(), uid="sink"))
    return p


def _committed_total(chk: str) -> int:
    storage = LocalCheckpointStorage(chk)
    manifest, root = storage.latest()
    return sum(committed_state(storage, manifest, root)["count"]["count"].values())


def run_vectorised(records: int, rows: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="es-bench-vec-") as tmp:
        p = build_vectorised(records, rows)
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=os.path.join(tmp, "chk"))
        seconds = time.perf_counter() - t0
        workers_cpu = _children_cpu() - cpu0
        total = _committed_total(os.path.join(tmp, "chk"))
    if total != records:
        raise RuntimeError(f"epochstream vectorised: committed counts sum to {total}, expected {records}")
    return {"system": "epochstream", "variant": "vectorised", "snapshot_interval": 1.0, "records": records,
            "seconds": seconds, "records_per_s": records / seconds, "epochs": len(result.completed_epochs),
            "workers": 2, "p50_ms": "", "p99_ms": "", "workers_cpu_per_wall": round(workers_cpu / seconds, 2),
            "batch_rows": rows}


def python_loop_rows(records: int) -> float:
    """The row workload in one plain Python loop (record, map, key, count in a dict): rows/s."""
    counts: dict[str, int] = {}
    out = None
    t0 = time.perf_counter()
    for i in range(records):
        r = _record(i)
        r = (r[0], r[1] * 1)
        k = r[0]
        n = counts.get(k, 0) + r[1]
        counts[k] = n
        out = (k, n)
    seconds = time.perf_counter() - t0
    assert out is not None and sum(counts.values()) == records
    return records / seconds


def python_loop_batches(records: int, rows: int) -> float:
    """The vectorised workload in one plain Python loop: the same batches, counted per key with
    pyarrow's group_by into a dict: rows/s."""
    import pyarrow as pa

    counts: dict[int, int] = {}
    t0 = time.perf_counter()
    for start in range(0, records, rows):
        batch = _keys_batch(start, min(start + rows, records))
        agg = pa.Table.from_batches([batch]).group_by("k").aggregate([("k", "count")])
        for k, c in zip(agg.column("k").to_pylist(), agg.column("k_count").to_pylist(), strict=True):
            counts[k] = counts.get(k, 0) + c
    seconds = time.perf_counter() - t0
    assert sum(counts.values()) == records
    return records / seconds


def _source_rows_per_s(rows: int, seconds: float = 1.0) -> float:
    """How fast the vectorised source's function makes rows in this process (its cost per row)."""
    made, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        made += _keys_batch(made, made + rows).num_rows
    return made / (time.perf_counter() - t0)


def run_slow_operator(seconds: float, rows: int) -> dict:
    """The vectorised path with an operator 10x slower than its source, for ``seconds``: max RSS per worker."""
    import threading

    source_rate = _source_rows_per_s(rows)
    per_row = 10.0 / source_rate
    samples: list[tuple[float, dict[int, float]]] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.perf_counter()
        while not stop.wait(0.1):
            samples.append((time.perf_counter() - t0, children_rss_mb()))

    with tempfile.TemporaryDirectory(prefix="es-bench-mem-") as tmp:
        p = build_vectorised(None, rows, slow_per_row=per_row)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=os.path.join(tmp, "chk"), duration=seconds)
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        total = _committed_total(os.path.join(tmp, "chk"))
    # rows read after the final epoch's trigger are read but not committed: committed <= read
    if not 0 < total <= result.records_in:
        raise RuntimeError(f"slow operator: committed counts sum to {total}, the source read {result.records_in}")
    per_pid: dict[int, list[tuple[float, float]]] = {}
    for at, rss in samples:
        for pid, mb in rss.items():
            per_pid.setdefault(pid, []).append((at, mb))
    # the workers: the two children that lived longest (the sampler may also see short-lived helpers)
    workers = sorted(per_pid.values(), key=len, reverse=True)[:2]
    maxima = [max(mb for _at, mb in w) for w in workers]
    half = seconds / 2
    first = max((mb for w in workers for at, mb in w if at < half), default=0.0)
    second = max((mb for w in workers for at, mb in w if at >= half), default=0.0)
    return {"system": "epochstream", "variant": "slow-operator", "snapshot_interval": 1.0,
            "records": total, "seconds": wall, "records_per_s": total / wall,
            "epochs": len(result.completed_epochs), "workers": 2, "p50_ms": "", "p99_ms": "", "batch_rows": rows,
            "source_alone_rows_per_s": round(source_rate), "operator_cap_rows_per_s": round(1 / per_row),
            "max_rss_mb": round(max(maxima), 1), "max_rss_mb_per_worker": ";".join(f"{m:.1f}" for m in maxima),
            "max_rss_mb_first_half": round(first, 1), "max_rss_mb_second_half": round(second, 1)}


def run_epochstream_in(src: str, records: int, variant: str) -> dict:
    """One epochstream run with the package imported from ``src``, in a child process."""
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, __file__, "--single", variant, "--records", str(records)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"epochstream from {src}, {variant}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# peers of --peers beyond bytewax and pyflink (Flink 2.3 defaults): PyFlink at its best and the JVM's
# ceiling, by their PYFLINK_VARIANTS name in benchmarks/peers/run_peers.py; run with 1 s checkpoints only.
PYFLINK_PEERS = {"pyflink-tuned": "tuned", "pyflink-thread": "thread", "flink-sql": "sql"}


def run_peer_row(system: str, records: int, interval: float) -> dict:
    from benchmarks.peers.run_peers import run_peer, run_pyflink_variant

    if system in PYFLINK_PEERS:
        res = run_pyflink_variant(PYFLINK_PEERS[system], records=records, keys=KEYS, snapshot_interval=interval)
    else:
        res = run_peer(system, records=records, keys=KEYS, snapshot_interval=interval, workers=2)
    checkpoints = res.get("snapshots_completed", res.get("last_snapshot_epoch", ""))
    settings = res.get("settings") or ("processes (2 procs x 1 worker)" if system == "bytewax" else "")
    return {"system": system, "variant": "snapshots-1s" if interval else "no-snapshots",
            "snapshot_interval": interval, "records": records, "seconds": res["seconds"],
            "records_per_s": res["records_per_s"], "epochs": "", "workers": 2, "p50_ms": "", "p99_ms": "",
            "checkpoints": checkpoints if interval else "", "settings": settings,
            "checkpoint_ms_mean": res.get("snapshot_ms_mean") or ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=3_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default="bytewax",
                    help="comma list of bytewax, pyflink (Flink 2.3 defaults), pyflink-tuned, pyflink-thread, "
                         "flink-sql ('' for none); the last three run with 1 s checkpoints only")
    ap.add_argument("--pyflink-records", type=int, default=200_000,
                    help="records of the PyFlink peers (all three Python ones)")
    ap.add_argument("--flink-sql-records", type=int, default=5_000_000, help="records of the flink-sql peer")
    ap.add_argument("--name", default="throughput", help="base name of the CSV and PNG in --out")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--baseline-src", help="src folder of an earlier checkout to compare with, in the same run")
    ap.add_argument("--vector-records", type=int, default=20_000_000, help="rows of the vectorised path (0: skip)")
    ap.add_argument("--vector-rows", type=int, default=65_536, help="batch_rows of the vectorised path")
    ap.add_argument("--memory-seconds", type=float, default=8.0,
                    help="seconds of the slow-operator memory check (0: skip)")
    ap.add_argument("--single", help=argparse.SUPPRESS)  # one epochstream run, a JSON row on stdout
    args = ap.parse_args(argv)
    if args.single:
        print(json.dumps(run_epochstream(args.records, args.single)))
        return 0
    peers = [p for p in args.peers.split(",") if p]
    systems = ["epochstream"] + (["epochstream@baseline"] if args.baseline_src else [])
    plan = [(system, v) for v in ("epochs-1s", "no-epochs", "latency") for system in systems]
    if args.vector_records:
        plan += [("epochstream", "vectorised"), ("python-loop", "vectorised")]
    plan += [("python-loop", "rows")]
    unknown = [p for p in peers if p not in ("bytewax", "pyflink", *PYFLINK_PEERS)]
    if unknown:
        ap.error(f"unknown peers {unknown}")
    plan += [(peer, iv) for peer in peers for iv in ((1.0,) if peer in PYFLINK_PEERS else (1.0, 0.0))]
    rows: list[dict] = []
    total = args.repeats * len(plan)
    done = 0
    for rep in range(args.repeats):
        for system, variant in plan:
            done += 1
            label = variant if system.startswith(("epochstream", "python")) else (
                "snapshots 1s" if variant else "no snapshots")
            print(f"[{done}/{total}] repeat {rep + 1}: {system} {label} ...",
                  end=" ", flush=True)
            if system == "python-loop":
                n = args.records if variant == "rows" else args.vector_records
                rate = python_loop_rows(n) if variant == "rows" else python_loop_batches(n, args.vector_rows)
                row = {"system": system, "variant": variant, "records": n, "seconds": n / rate,
                       "records_per_s": rate, "workers": 1}
            elif variant == "vectorised":
                row = run_vectorised(args.vector_records, args.vector_rows)
            elif system == "epochstream@baseline":
                row = {**run_epochstream_in(args.baseline_src, args.records, variant), "system": system}
            elif system == "epochstream" and args.baseline_src:
                row = run_epochstream_in(str(ROOT / "src"), args.records, variant)
            elif system == "epochstream":
                row = run_epochstream(args.records, variant)
            else:
                n = (args.flink_sql_records if system == "flink-sql" else args.pyflink_records
                     if system.startswith("pyflink") else args.records)
                row = run_peer_row(system, n, variant)
            row["repeat"] = rep + 1
            rows.append(row)
            cores = f", workers used {row['workers_cpu_per_wall']} cores" if row.get("workers_cpu_per_wall") else ""
            ckpt = f", {row['checkpoints']} checkpoints completed" if row.get("checkpoints") != "" and \
                row.get("checkpoints") is not None and system not in ("python-loop",) and \
                not system.startswith("epochstream") else ""
            print(f"{row['records_per_s']:,.0f} records/s{cores}{ckpt}")
    if args.memory_seconds > 0:
        print(f"slow operator (10x slower than its source) for {args.memory_seconds:.0f} s ...", end=" ", flush=True)
        mem = {**run_slow_operator(args.memory_seconds, args.vector_rows), "repeat": 1}
        rows.append(mem)
        print(f"max RSS per worker {mem['max_rss_mb_per_worker']} MB")
    # the Python limit: the single-process loop's rows/s on each of the two workers' cores
    loops = {v: statistics.median(r["records_per_s"] for r in rows if (r["system"], r["variant"]) == ("python-loop", v))
             for v in ("rows", "vectorised") if any(r["system"] == "python-loop" and r["variant"] == v for r in rows)}
    for r in rows:
        limit = loops.get("vectorised" if r["variant"] == "vectorised" else "rows")
        if r["system"].startswith("epochstream") and r["variant"] in ("epochs-1s", "no-epochs", "vectorised") and limit:
            r["ratio_to_python_limit"] = round(r["records_per_s"] / (2 * limit), 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = ["system", "variant", "repeat", "records", "seconds", "records_per_s", "snapshot_interval", "epochs",
              "workers", "workers_cpu_per_wall", "p50_ms", "p99_ms", "batch_rows", "ratio_to_python_limit",
              "source_alone_rows_per_s", "operator_cap_rows_per_s", "max_rss_mb", "max_rss_mb_per_worker",
              "max_rss_mb_first_half", "max_rss_mb_second_half", "checkpoints", "checkpoint_ms_mean", "settings"]
    write_csv(out / f"{args.name}.csv", rows, fields, extrasaction="ignore")
    med: dict[tuple[str, str], float] = {}
    for key in sorted({(r["system"], r["variant"]) for r in rows}):
        med[key] = statistics.median(r["records_per_s"] for r in rows if (r["system"], r["variant"]) == key)
    lat = [r for r in rows if r["variant"] == "latency"]
    print("\nmedian records/s (2 workers, keyed running count, 1000 keys)")
    print(f"  {'system':<21} {'variant':<14} {'records/s':>12}")
    for (system, variant), v in med.items():
        print(f"  {system:<21} {variant:<14} {v:>12,.0f}")
    ratio = med[("epochstream", "epochs-1s")] / med[("epochstream", "no-epochs")]
    print(f"\nepochs every 1 s vs no epochs: {ratio:.2f} (target >= 0.9)")
    for variant in ("epochs-1s", "no-epochs"):
        if ("epochstream@baseline", variant) in med:
            print(f"this tree / baseline ({args.baseline_src}), {variant}: "
                  f"{med[('epochstream', variant)] / med[('epochstream@baseline', variant)]:.3f}")
    if ("bytewax", "snapshots-1s") in med:
        print(f"epochstream / Bytewax, both with 1 s snapshots: "
              f"{med[('epochstream', 'epochs-1s')] / med[('bytewax', 'snapshots-1s')]:.2f} (target >= 1)")
    peer_rows = [r for r in rows if r["system"] in ("bytewax", "pyflink", *PYFLINK_PEERS)
                 and r["variant"] == "snapshots-1s"]
    if peer_rows:
        print("\npeers with 1 s checkpoints (median records/s, completed checkpoints per run, settings)")
        for system in dict.fromkeys(r["system"] for r in peer_rows):
            mine = [r for r in peer_rows if r["system"] == system]
            print(f"  {system:<15} {med[(system, 'snapshots-1s')]:>12,.0f}  checkpoints "
                  f"{','.join(str(r['checkpoints']) for r in mine):<10} {mine[0]['settings']}")
    for system in ("pyflink", *PYFLINK_PEERS):
        if (system, "snapshots-1s") in med and ("epochstream", "epochs-1s") in med:
            print(f"epochstream / {system}, both with 1 s snapshots: "
                  f"{med[('epochstream', 'epochs-1s')] / med[(system, 'snapshots-1s')]:.2f}")
    for variant, path in (("epochs-1s", "rows"), ("vectorised", "vectorised")):
        if ("epochstream", variant) in med and path in loops:
            print(f"{variant} / Python limit (plain loop {loops[path]:,.0f} rows/s per core x 2 workers): "
                  f"{med[('epochstream', variant)] / (2 * loops[path]):.2f}")
    if ("epochstream", "vectorised") in med:
        print(f"vectorised keyed path: {med[('epochstream', 'vectorised')]:,.0f} rows/s (target >= 3,000,000); "
              f"row path epochs-1s: {med[('epochstream', 'epochs-1s')]:,.0f}")
    mem_rows = [r for r in rows if r["variant"] == "slow-operator"]
    for r in mem_rows:
        print(f"slow operator: source alone {r['source_alone_rows_per_s']:,} rows/s, operator cap "
              f"{r['operator_cap_rows_per_s']:,} rows/s; max RSS per worker {r['max_rss_mb_per_worker']} MB "
              f"(first half {r['max_rss_mb_first_half']}, second half {r['max_rss_mb_second_half']})")
    if lat:
        print(f"latency source->sink with 1 s epochs: p50 {statistics.median(r['p50_ms'] for r in lat):.1f} ms, "
              f"p99 {statistics.median(r['p99_ms'] for r in lat):.1f} ms (median over repeats)")
    _plot(med, lat, out / f"{args.name}.png")
    print(f"\nwrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def _plot(med, lat, path: Path) -> None:
    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{s}\n{v}" for s, v in med]
    colors = ["tab:blue" if s == "epochstream" else "tab:cyan" if s.startswith("epochstream") else "tab:gray"
              for s, _ in med]
    ax.bar(labels, [v / 1000 for v in med.values()], color=colors)
    ax.set_ylabel("thousand records / s (median)")
    ax.set_title("keyed running count, 2 workers")
    ax.tick_params(axis="x", labelsize=8)
    if lat:
        ax2.bar(["p50", "p99"], [statistics.median(r["p50_ms"] for r in lat),
                                 statistics.median(r["p99_ms"] for r in lat)], color="tab:blue")
        ax2.set_ylabel("ms")
        ax2.set_title("latency, 1 s epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
