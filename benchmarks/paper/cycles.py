"""Cycles: aligned mode with loop-head logging against tracker mode, on the same loop.

Workload: a bounded source of N records ``(id, k)``; each record goes round a loop exactly
k times (``iterate()``, a keyed step that counts passes per key, ``close_with`` while
rounds remain), then leaves for a discarding sink. Run on the local driver (one process
per worker, real time, parallelism 2, checkpoint interval ``--interval``), for k in
``--rounds``, in both modes:

- *aligned*: epochs end by markers; each loop head logs the records in transit on its
  back edge while its marker goes round (Algorithm 7), and the log is part of its
  snapshot. Measured per epoch: the log's records and pickled bytes.
- *tracker*: the loop is one segment; an epoch ends there only once the loop has drained
  every record of it, so nothing is logged, and records of the next epoch wait at the
  loop's entry meanwhile.

Per run: throughput (input records/s and loop passes/s over the whole job), epoch
completion latency (trigger to commit, p50 and p99 over completed epochs), and the
per-epoch log size. Writes benchmarks/results/cycles.csv (one row per run),
cycles_epochs.csv (one row per completed epoch) and cycles.png; prints a summary table.
Not a test: timings vary with the machine and its load.

    python benchmarks/paper/cycles.py [--records 40000] [--rounds 1 2 4 8 16] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor  # noqa: E402

MODES = ("aligned", "tracker")


class Pass(KeyedProcessFunction):
    """One trip round the loop: count it for the key, take one round off the record."""

    def open(self, ctx):
        self.passes = ctx.state(ValueStateDescriptor("passes", default=0))

    def process(self, value, ctx):
        self.passes.update(self.passes.value() + 1)
        return ((value[0], value[1] - 1),)


def build(mode: str, records: int, rounds: int, interval: float, parallelism: int) -> Pipeline:
    p = Pipeline(f"cycles-{mode}-{rounds}", parallelism=parallelism, mode=mode, batch_size=512,
                 checkpoint=CheckpointConfig(interval=interval, timeout=120.0))
    loop = p.generate(lambda i: (i, rounds), count=records, uid="gen").iterate(uid="loop")
    step = loop.key_by(lambda r: r[0] % 256).process(Pass(), uid="pass")
    loop.close_with(step.filter(lambda r: r[1] > 0))
    step.filter(lambda r: r[1] == 0).sink(DiscardingSink(), uid="out")
    return p


def measure(mode: str, records: int, rounds: int, interval: float, parallelism: int):
    with tempfile.TemporaryDirectory(prefix="es-cycles-") as chk:
        result = build(mode, records, rounds, interval, parallelism).run(deployment="local", checkpoint_dir=chk)
    done = [e for e in result.metrics["epochs"] if e.get("state") == "completed"]
    lat = [e["trigger_to_commit_seconds"] * 1000 for e in done]
    logs = [e["loop_log_records"] for e in done]
    log_bytes = [e["loop_log_bytes"] for e in done]
    row = {
        "mode": mode, "rounds": rounds, "records": records, "parallelism": parallelism, "interval_s": interval,
        "seconds": round(result.seconds, 3), "epochs": len(done),
        "records_per_s": round(records / result.seconds), "passes_per_s": round(records * rounds / result.seconds),
        "epoch_p50_ms": round(statistics.median(lat), 2) if lat else None,
        "epoch_p99_ms": round(percentile(lat, 0.99), 2) if lat else None,
        "log_records_mean": round(statistics.mean(logs), 1) if logs else 0,
        "log_records_max": max(logs, default=0),
        "log_bytes_mean": round(statistics.mean(log_bytes)) if log_bytes else 0,
        "log_bytes_max": max(log_bytes, default=0),
        "restarts": result.restarts,
    }
    per_epoch = [{"mode": mode, "rounds": rounds, "epoch": e["epoch"], "kind": e["kind"],
                  "trigger_to_commit_ms": round(e["trigger_to_commit_seconds"] * 1000, 3),
                  "loop_log_records": e["loop_log_records"], "loop_log_bytes": e["loop_log_bytes"],
                  "state_bytes": e["bytes"]} for e in done]
    return row, per_epoch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=40_000)
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--interval", type=float, default=0.1, help="checkpoint interval (s)")
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="10,000 records, rounds 1 4 16")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.rounds = 10_000, [1, 4, 16]
    rows, epochs = [], []
    total = len(args.rounds) * len(MODES)
    k = 0
    for rounds in args.rounds:
        for mode in MODES:
            k += 1
            print(f"[{k}/{total}] {mode:<8} rounds={rounds:<3} ...", end=" ", flush=True)
            row, per_epoch = measure(mode, args.records, rounds, args.interval, args.parallelism)
            rows.append(row)
            epochs.extend(per_epoch)
            print(f"{row['seconds']:6.2f}s  {row['passes_per_s']:>8} passes/s  epochs {row['epochs']:>3}  "
                  f"p50 {row['epoch_p50_ms']} ms  log mean {row['log_records_mean']} rec")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("cycles.csv", rows), ("cycles_epochs.csv", epochs)):
        write_csv(out / name, data)
    print(f"\n{args.records} records, parallelism {args.parallelism}, interval {args.interval}s (local driver)")
    print(f"{'rounds':>6} | {'aligned passes/s':>16} {'p50 ms':>8} {'p99 ms':>8} {'log rec':>8} {'log KiB':>8} | "
          f"{'tracker passes/s':>16} {'p50 ms':>8} {'p99 ms':>8} | {'thr t/a':>7}")
    for rounds in args.rounds:
        a = next(r for r in rows if r["mode"] == "aligned" and r["rounds"] == rounds)
        t = next(r for r in rows if r["mode"] == "tracker" and r["rounds"] == rounds)
        print(f"{rounds:>6} | {a['passes_per_s']:>16} {a['epoch_p50_ms']!s:>8} {a['epoch_p99_ms']!s:>8} "
              f"{a['log_records_mean']:>8} {a['log_bytes_mean'] / 1024:>8.1f} | {t['passes_per_s']:>16} "
              f"{t['epoch_p50_ms']!s:>8} {t['epoch_p99_ms']!s:>8} | {t['passes_per_s'] / a['passes_per_s']:>7.2f}")
    _plot(rows, args.rounds, out / "cycles.png")
    print(f"\nwrote {out / 'cycles.csv'}, {out / 'cycles_epochs.csv'} and {out / 'cycles.png'}")
    return 0


def _plot(rows, rounds, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode in MODES:
        sel = [next(r for r in rows if r["mode"] == mode and r["rounds"] == k) for k in rounds]
        axes[0].plot(rounds, [r["log_records_mean"] for r in sel], marker="o", label=f"{mode} mean")
        axes[0].plot(rounds, [r["log_records_max"] for r in sel], marker="x", linestyle="--", label=f"{mode} max")
        axes[1].plot(rounds, [r["epoch_p50_ms"] for r in sel], marker="o", label=f"{mode} p50")
        axes[1].plot(rounds, [r["epoch_p99_ms"] for r in sel], marker="x", linestyle="--", label=f"{mode} p99")
        axes[2].plot(rounds, [r["passes_per_s"] for r in sel], marker="o", label=mode)
    ylabels = ("records logged per epoch", "epoch trigger -> commit (ms)", "loop passes / s")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rounds per record")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle("cycles: aligned + loop-head logging vs tracker (local driver)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
