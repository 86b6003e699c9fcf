"""Epochs under backpressure: how long an epoch takes when a downstream stage is slower than the source.

Workload: a ``rate`` source at ``--rate`` rows/s -> ``key_by`` -> a keyed running
count -> a *slow stage* -> a discarding sink, local driver, ``--parallelism`` workers, epochs
every ``--interval`` seconds. The slow stage costs ``parallelism * k / rate`` seconds per
record, so all its subtasks together take ``rate / k`` rows/s: ``k`` = 0.5 is an unloaded job
(the stage has twice the capacity it needs), ``k`` = 1 runs at the edge, 2, 5 and 10 are
backpressured that many times over. Each run reads ``rate / max(k, 1) * --seconds`` records,
so every run lasts about ``--seconds``. ``--skew`` sends half of all records to one hot key
(its subtask is the bottleneck).

``--driver spark`` runs the same on the spark driver (one ``local[p+1]`` session for every
run). Per mode (``aligned``, ``tracker``, ``unaligned``, and ``aligned-timeout``: aligned with
Flink's aligned-checkpoint-timeout, ``--aligned-timeout`` seconds, default 0.2) and buffer
debloating on or off (``Pipeline(buffer_debloat_target=)``), the
job master's epoch log gives per completed epoch:

* ``trigger_to_commit_s``: trigger until the manifest is written plus the commits after it;
* ``alignment_s`` (aligned: the longest per-task alignment; tracker: the longest hold);
* ``state_bytes`` and ``channel_bytes`` (channel state, the unaligned mode's in-flight records).

Throughput is records over the run's wall time. ``--kill`` kills one worker at mid-run and
records the recovery time (failure to the next running attempt). Each run is checked: the
committed count of every key equals its number of records.

Writes ``benchmarks/results/<name>.csv`` (one row per epoch) and ``<name>.png`` (epoch p99
against k per mode), and prints a summary: p50/p99 per (mode, debloat, k) and the p99 at the
highest k over the unloaded p99 (targets: unaligned <= 2x; aligned with debloating <= 3x).

    python benchmarks/epochs/backpressure.py [--quick] [--modes aligned,tracker] [--factors 0.5,1,2,5,10]
        [--debloat on,off] [--skew] [--kill] [--warmup-epochs 1]

The summary and the plot leave out each run's first epoch (``--warmup-epochs``); the CSV has every epoch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    KeyedProcessFunction,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.api.pipeline import MODES  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

KEYS = 1_000


class RunningCount(KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        return ((ctx.key, n),)


class KeyOf:
    """``value % KEYS``, or with ``skew`` every other record on key 0 (a class: it pickles)."""

    def __init__(self, skew: bool) -> None:
        self.skew = skew

    def __call__(self, record: dict[str, Any]) -> int:
        v = int(record["value"])
        return 0 if self.skew and v % 2 == 0 else v % KEYS


class Slow:
    """``cost`` seconds per record, slept in slices of at least a millisecond (a sleep per
    record would cost more than the record at small costs)."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.debt = 0.0

    def __call__(self, record: Any) -> Any:
        self.debt += self.cost
        if self.debt >= 0.001:
            began = time.perf_counter()
            time.sleep(self.debt)
            self.debt -= time.perf_counter() - began
        return record


def total_records(args: argparse.Namespace, k: float) -> int:
    return int(args.rate / max(k, 1.0) * args.seconds)


#: the benchmark's name for aligned mode with Flink's aligned-checkpoint-timeout (``--aligned-timeout``)
ALIGNED_TIMEOUT = "aligned-timeout"


def build(args: argparse.Namespace, mode: str, debloat: bool, k: float) -> Pipeline:
    timeout = args.aligned_timeout if mode == ALIGNED_TIMEOUT else None
    p = Pipeline(f"backpressure-{mode}", parallelism=args.parallelism, mode="aligned" if timeout else mode,
                 batch_rows=args.batch_rows, aligned_timeout=timeout,
                 checkpoint=CheckpointConfig(interval=args.interval, incremental=True))
    if hasattr(p, "buffer_debloat_target"):
        p.buffer_debloat_target = args.debloat_target if debloat else None
    (
        p.rate(args.rate, count=total_records(args, k), uid="src")
        .key_by(KeyOf(args.skew))
        .process(RunningCount(), uid="count")
        .map(Slow(args.parallelism * k / args.rate))
        .sink(DiscardingSink(), uid="out")
    )
    return p


def _metric(entry: dict[str, Any], *names: str) -> float:
    """The largest per-task value of the first metric the entry has (absent: 0)."""
    for name in names:
        v = entry.get(name)
        if isinstance(v, dict):
            return float(max(v.values(), default=0.0))
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


def run_one(args: argparse.Namespace, mode: str, debloat: bool, k: float, work: Path,
            spark: Any = None) -> list[dict[str, Any]]:
    from epochstream.deploy.failures import FailureSchedule

    chk = work / f"chk-{mode}-{debloat}-{k}"
    p = build(args, mode, debloat, k)
    failures = FailureSchedule(kill_times=[args.seconds / 2]) if args.kill else None
    t0 = time.perf_counter()
    extra = {"spark": spark} if spark is not None else {}
    result = p.run(deployment=args.driver, checkpoint_dir=str(chk), failures=failures, **extra)
    wall = time.perf_counter() - t0
    check(chk, total_records(args, k), args.skew)
    recovery = result.metrics.get("recovery_seconds") or []
    load1 = os.getloadavg()[0]
    rows = []
    for e in result.metrics.get("epochs", []):
        if e.get("state") != "completed" or e.get("kind") == "final":
            continue
        rows.append({
            "driver": args.driver, "mode": mode, "debloat": "on" if debloat else "off", "k": k, "skew": args.skew,
            "rate": args.rate, "interval_s": args.interval, "parallelism": args.parallelism,
            "batch_rows": args.batch_rows, "epoch": e["epoch"], "kind": e.get("kind"),
            "trigger_to_commit_s": round(float(e["trigger_to_commit_seconds"]) + float(e["commit_seconds"]), 4),
            "alignment_s": round(_metric(e, "alignment_seconds_max"), 4),
            "state_bytes": int(_metric(e, "bytes")),
            "channel_bytes": int(_metric(e, "channel_state_bytes")),
            "records_per_s": round(result.records_in / wall, 1), "run_wall_s": round(wall, 2),
            "recovery_s": round(float(recovery[0]), 3) if recovery else None, "load1": round(load1, 2),
        })
    return rows


def check(chk: Path, total: int, skew: bool) -> None:
    """The newest checkpoint's committed counts are every key's number of records."""
    from epochstream.backends.local import LocalCheckpointStorage

    storage = LocalCheckpointStorage(chk)
    latest = storage.latest()
    if latest is None:
        raise SystemExit(f"{chk.name}: no checkpoint")
    manifest, root = latest
    counts = committed_state(storage, manifest, root)["count"].get("count", {})
    want: dict[int, int] = {}
    for v in range(total):
        key = 0 if skew and v % 2 == 0 else v % KEYS
        want[key] = want.get(key, 0) + 1
    if counts != want:
        raise SystemExit(f"{chk.name}: committed counts are wrong ({len(counts)} keys, {sum(counts.values())} "
                         f"counts, want {total})")


def run_pyflink(args: argparse.Namespace, unaligned: bool, k: float) -> list[dict[str, Any]]:
    """The same shape on PyFlink (benchmarks/peers/pyflink_backpressure.py), one row per completed
    checkpoint: its end-to-end duration as ``trigger_to_commit_s`` (Flink's trigger to the last
    acknowledgement, which includes writing the checkpoint metadata, like our manifest) and its
    persisted in-flight data as ``channel_bytes``."""
    from benchmarks.peers.run_peers import run_peer_args

    flags = ["--rate", str(args.rate), "--k", str(k), "--seconds", str(args.seconds), "--interval",
             str(args.interval), "--workers", str(args.parallelism)] + (["--unaligned"] if unaligned else [])
    if args.pyflink_bundle_size:
        flags += ["--bundle-size", str(args.pyflink_bundle_size)]
    r = run_peer_args("pyflink", flags, script="pyflink_backpressure.py")
    if r["outputs"] != r["records"]:
        raise SystemExit(f"pyflink k={k}: {r['outputs']} outputs for {r['records']} records")
    load1 = os.getloadavg()[0]
    return [{
        "driver": f"pyflink {r['version']}", "mode": "pyflink-unaligned" if unaligned else "pyflink-aligned",
        "debloat": "off", "k": k, "skew": False, "rate": args.rate, "interval_s": args.interval,
        "parallelism": args.parallelism, "batch_rows": r["bundle_size"] or "default", "epoch": i,
        "kind": "checkpoint", "trigger_to_commit_s": round(d, 4), "alignment_s": 0.0,
        "state_bytes": sb, "channel_bytes": cb, "records_per_s": r["records_per_s"], "run_wall_s": r["wall_s"],
        "recovery_s": None, "load1": round(load1, 2),
    } for i, (d, cb, sb) in enumerate(zip(r["checkpoint_s"], r["persisted_bytes"], r["state_bytes"],
                                                      strict=True), 1)]


def summary(rows: list[dict[str, Any]], warmup: int = 0) -> list[dict[str, Any]]:
    """Per (mode, debloat, k); epochs up to ``warmup`` are left out (the first epoch of an
    unloaded run can take a second: the workers' first writes and imports)."""
    out = []
    for mode, debloat, k in dict.fromkeys((r["mode"], r["debloat"], r["k"]) for r in rows):
        xs = [r for r in rows if (r["mode"], r["debloat"], r["k"]) == (mode, debloat, k) and int(r["epoch"]) > warmup]
        t2c = [r["trigger_to_commit_s"] for r in xs]
        out.append({"mode": mode, "debloat": debloat, "k": k, "epochs": len(xs),
                    "p50": percentile(t2c, 0.5), "p99": percentile(t2c, 0.99),
                    "alignment_p99": percentile([r["alignment_s"] for r in xs], 0.99),
                    "channel_bytes_p99": percentile([float(r["channel_bytes"]) for r in xs], 0.99),
                    "state_bytes_p50": percentile([float(r["state_bytes"]) for r in xs], 0.5),
                    "records_per_s": xs[0]["records_per_s"] if xs else float("nan"),
                    "recovery_s": xs[0]["recovery_s"] if xs else None})
    return out


def plot(table: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, debloat in dict.fromkeys((r["mode"], r["debloat"]) for r in table):
        xs = [r for r in table if (r["mode"], r["debloat"]) == (mode, debloat)]
        ax.plot([r["k"] for r in xs], [r["p99"] for r in xs], marker="o", ms=4,
                linestyle="-" if debloat == "on" else "--", label=f"{mode}, debloating {debloat}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("backpressure k (slow stage capacity = rate / k)")
    ax.set_ylabel("epoch trigger -> commit p99 (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    exactly_once = [m for m in MODES if m != "at-least-once"] + [ALIGNED_TIMEOUT]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=20000, help="rows/s of the rate source")
    ap.add_argument("--seconds", type=float, default=20, help="about how long each run lasts")
    ap.add_argument("--interval", type=float, default=1.0, help="checkpoint interval (s)")
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--batch-rows", type=int, default=1024)
    ap.add_argument("--modes", default=",".join(exactly_once))
    ap.add_argument("--factors", default="0.5,1,2,5,10", help="backpressure factors k")
    ap.add_argument("--debloat", default="on,off", help="buffer debloating on, off or both")
    ap.add_argument("--debloat-target", type=float, default=1.0, help="seconds of in-flight data (debloating)")
    ap.add_argument("--skew", action="store_true", help="half of all records on one hot key")
    ap.add_argument("--kill", action="store_true", help="kill a worker at mid-run; report recovery time")
    ap.add_argument("--driver", choices=["local", "spark"], default="local",
                    help="spark: the spark driver on local[parallelism + 1] (one session for every run)")
    ap.add_argument("--quick", action="store_true", help="k in 0.5, 10 and 10 s runs")
    ap.add_argument("--peers", default="", help="pyflink: the same shape on PyFlink 2.3 (benchmarks/.venv-pyflink, "
                    "created on first use), checkpoints aligned and unaligned, in the same run")
    ap.add_argument("--pyflink-bundle-size", type=int, default=0,
                    help="python.fn-execution.bundle.size of the PyFlink runs (0: Flink's default)")
    ap.add_argument("--aligned-timeout", type=float, default=0.2,
                    help=f"seconds of alignment before a task goes unaligned (mode {ALIGNED_TIMEOUT})")
    ap.add_argument("--warmup-epochs", type=int, default=1, help="epochs per run the summary leaves out (warm-up)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="backpressure")
    args = ap.parse_args(argv)
    if args.quick:
        args.factors, args.seconds = "0.5,10", min(args.seconds, 10.0)
    modes = [m for m in args.modes.split(",") if m]  # "" with --peers: the peer alone
    unknown = [m for m in modes if m not in exactly_once]
    if unknown:
        ap.error(f"modes {unknown} are not exactly-once modes of this build ({exactly_once})")
    factors = [float(x) for x in args.factors.split(",")]
    debloats = [d == "on" for d in args.debloat.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="backpressure-"))
    runs: list[tuple[str, bool, float]] = [(m, d, k) for m in modes for d in debloats for k in factors]
    if "pyflink" in args.peers.split(","):
        runs += [(m, False, k) for m in ("pyflink-aligned", "pyflink-unaligned") for k in factors]
    spark = None
    if args.driver == "spark":
        from epochstream.deploy.spark import spark_session

        spark = spark_session(f"local[{args.parallelism + 1}]", {"spark.ui.enabled": "false"})
        spark.sparkContext.setLogLevel("ERROR")
    try:
        for i, (mode, debloat, k) in enumerate(runs, 1):
            got = run_pyflink(args, mode == "pyflink-unaligned", k) if mode.startswith("pyflink") else \
                run_one(args, mode, debloat, k, work, spark)
            rows += got
            t2c = [r["trigger_to_commit_s"] for r in got]
            print(f"[{i}/{len(runs)}] {mode:<17} debloating {'on ' if debloat else 'off'} k={k:<4}: {len(got)} epochs, "
                  f"p50 {percentile(t2c, 0.5):.2f}s p99 {percentile(t2c, 0.99):.2f}s, "
                  f"{got[0]['records_per_s'] if got else 0:,.0f} records/s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
            shutil.rmtree(work / f"chk-{mode}-{debloat}-{k}", ignore_errors=True)
            if rows:
                write_csv(out / f"{args.name}.csv", rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if spark is not None:
            spark.stop()
    table = summary(rows, args.warmup_epochs)
    if args.warmup_epochs:
        print(f"\n(the summary leaves out each run's first {args.warmup_epochs} epoch(s), the warm-up; "
              "the CSV has all)")
    print(f"\n{'mode':<17} {'debloat':<7} {'k':>5} {'epochs':>6} {'p50 s':>7} {'p99 s':>7} {'align p99':>9} "
          f"{'chan B p99':>10} {'records/s':>10} {'recovery s':>10}")
    for r in table:
        print(f"{r['mode']:<17} {r['debloat']:<7} {r['k']:>5} {r['epochs']:>6} {r['p50']:>7.2f} {r['p99']:>7.2f} "
              f"{r['alignment_p99']:>9.2f} {r['channel_bytes_p99']:>10.0f} {r['records_per_s']:>10,.0f} "
              f"{r['recovery_s'] if r['recovery_s'] is not None else '-':>10}")
    lo, hi = min(factors), max(factors)
    print(f"\np99 at k={hi} over the unloaded (k={lo}) p99:")
    for mode, debloat in dict.fromkeys((r["mode"], r["debloat"]) for r in table):
        by = {r["k"]: r for r in table if (r["mode"], r["debloat"]) == (mode, debloat)}
        if lo in by and hi in by and by[lo]["p99"] > 0:
            print(f"  {mode:<17} debloating {debloat:<3}: {by[hi]['p99'] / by[lo]['p99']:.2f}x")
    title = (f"rate {args.rate:,.0f}/s -> count -> slow stage (rate/k), {args.driver} driver p={args.parallelism}"
             f"{', one hot key' if args.skew else ''}")
    plot(table, out / f"{args.name}.png", title)
    print(f"wrote {out / (args.name + '.csv')} and {args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
