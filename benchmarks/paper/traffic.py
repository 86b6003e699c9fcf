"""Service traffic of barrier alignment vs the trAcker (paper 000, Figure 10), on the simulator.

Workload RR-N: a source, N identity maps each repartitioned all-to-all by key, a sink; W
workers; *granularity* g = records per epoch for the whole job (the paper's records per
substream). Epochs are cut every g records (time interval g / total source rate, with no
limit on concurrent epochs), and every run has ``--epochs`` epochs.

Service messages counted (see ``epochstream.tracker.traffic``): markers on data channels
(aligned); SND/RCV report flushes, promises and NEOSS notifications (tracker). Three
modes: ``aligned``, ``tracker`` (one report message per event, the paper's "without
optimisation") and ``tracker-aggregated`` (local trackers XOR-fold reports per (segment,
epoch) and flush every 5 ms or 1000 events).

The simulator's network model: exponential one-way delay, mean 0.5 ms between workers,
10 us inside a worker; FIFO per channel.

Writes benchmarks/results/traffic.csv and traffic.png; prints a summary with the targets
(N=30, W=15, g=10: aggregated tracker >= 30x fewer messages than alignment, tracker
without aggregation >= 1.5x fewer; fitted exponent of messages vs workers ~2 for
alignment, ~1 for the tracker). Not a test.

    python benchmarks/paper/traffic.py [--epochs 20] [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, Pipeline, TrackerConfig  # noqa: E402
from epochstream.deploy.sim import SimConfig  # noqa: E402

MODES = (("aligned", "aligned", True), ("tracker", "tracker", False), ("tracker-aggregated", "tracker", True))
RATE = 10_000.0  # records/s per source subtask


def rr_n(n_maps: int, workers: int, granularity: int, epochs: int, mode: str, aggregate: bool):
    records = granularity * epochs
    interval = granularity / (RATE * workers)
    p = Pipeline(
        f"rr-{n_maps}", parallelism=workers, mode=mode, batch_size=1,
        checkpoint=CheckpointConfig(interval=interval, max_concurrent=1_000_000, num_retained=1),
        checkpoint_interval=interval,
        tracker=TrackerConfig(aggregate=aggregate, flush_interval=0.005, flush_count=1000),
    )
    s = p.generate(_identity, count=records, uid="src")
    for k in range(n_maps):
        s = s.key_by(_identity).map(_identity, name=f"map{k}")
    s.sink(DiscardingSink(), uid="sink")
    return p, records


def _identity(x):
    return x


def measure(n_maps: int, workers: int, granularity: int, epochs: int, label: str, mode: str, aggregate: bool) -> dict:
    p, records = rr_n(n_maps, workers, granularity, epochs, mode, aggregate)
    cfg = SimConfig(source_rate=RATE, source_batch=1, check_invariants=False)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="es-traffic-") as chk:
        r = p.run(deployment="sim", checkpoint_dir=chk, sim=cfg, seed=1)
    st = r.metrics["service_traffic"]["total"]
    done = max(1, len(r.completed_epochs))
    return {"mode": label, "graph_size": n_maps, "workers": workers, "granularity": granularity, "records": records,
            "epochs": len(r.completed_epochs), "service_messages": st["messages"], "service_bytes": st["bytes"],
            "messages_per_epoch": st["messages"] / done, "sim_seconds": round(time.perf_counter() - t0, 2)}


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) over log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (N<=30, W<=15)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    n_values = [10, 30] if args.quick else [10, 30, 100]
    w_values = [5, 10, 15] if args.quick else [5, 10, 15, 20, 30]
    g_values = [1, 10, 100]
    points = sorted({(n, 15, 10) for n in n_values} | {(30, w, 10) for w in w_values} | {(30, 15, g) for g in g_values})
    rows = []
    total = len(points) * len(MODES)
    for i, (n, w, g) in enumerate(points):
        for j, (label, mode, agg) in enumerate(MODES):
            k = i * len(MODES) + j + 1
            print(f"[{k}/{total}] N={n} W={w} g={g} {label} ...", end=" ", flush=True)
            row = measure(n, w, g, args.epochs, label, mode, agg)
            rows.append(row)
            print(f"{row['service_messages']} messages in {row['epochs']} epochs ({row['sim_seconds']}s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "traffic.csv", rows)

    def pick(label, n, w, g):
        return next(r for r in rows if (r["mode"], r["graph_size"], r["workers"], r["granularity"]) == (label, n, w, g))

    print("\nservice messages per epoch")
    print(f"  {'N':>4} {'W':>3} {'g':>4}  {'aligned':>10} {'tracker':>10} {'tracker-agg':>12}")
    for n, w, g in points:
        vals = [pick(lbl, n, w, g)["messages_per_epoch"] for lbl, _m, _a in MODES]
        print(f"  {n:>4} {w:>3} {g:>4}  {vals[0]:>10.0f} {vals[1]:>10.0f} {vals[2]:>12.1f}")
    a, t, ta = (pick(lbl, 30, 15, 10)["messages_per_epoch"] for lbl, _m, _x in MODES)
    print(f"\nN=30 W=15 g=10: alignment / aggregated tracker = {a / ta:.1f}x (target >= 30x); "
          f"alignment / tracker without aggregation = {a / t:.2f}x (target >= 1.5x)")
    for lbl, _m, _a in MODES:
        xs = [w for w in w_values]
        ys = [pick(lbl, 30, w, 10)["messages_per_epoch"] for w in xs]
        print(f"  exponent of messages vs workers, {lbl}: {fit_exponent(xs, ys):.2f}")
    _plot(rows, n_values, w_values, g_values, out / "traffic.png")
    print(f"\nwrote {out / 'traffic.csv'} and {out / 'traffic.png'}")
    return 0


def _plot(rows, n_values, w_values, g_values, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    sweeps = [("graph_size", n_values, {"workers": 15, "granularity": 10}, "N (operators)"),
              ("workers", w_values, {"graph_size": 30, "granularity": 10}, "workers"),
              ("granularity", g_values, {"graph_size": 30, "workers": 15}, "records per epoch")]
    for ax, (key, xs, fixed, xlabel) in zip(axes, sweeps, strict=True):
        for label, _m, _a in MODES:
            ys = [next(r["messages_per_epoch"] for r in rows if r["mode"] == label and r[key] == x
                       and all(r[k] == v for k, v in fixed.items())) for x in xs]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("service messages per epoch")
        ax.set_title(", ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("RR-N service traffic (simulator)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
