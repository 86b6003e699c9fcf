"""Notification latency: from an epoch's end at the sources to each process's bound.

For every epoch and every process (task), the time from the coordinator's trigger (the
sources end the epoch: markers in aligned mode, promises in tracker mode) to the moment
the process reaches its bound (aligned: its last marker arrived; tracker: the NEOSS that
closes the epoch arrived), on the simulator's network model (exponential one-way delay,
mean ``--net-delay`` between workers, 10 us within a worker; FIFO per channel; a task is
busy 5 us per message plus 2 us per record).

Workload RR-N as in benchmarks/paper/traffic.py, sweeping N (operators) and workers. Writes
benchmarks/results/notification_latency.csv and .png; prints medians and p99. The
target: the tracker's median stays within 25% from N=10 to N=100 while alignment's grows.
Not a test.

``--deployment local`` measures the same on the local driver (real worker processes, real
pipes, wall-clock time): RR-N at 2 workers (this machine has 2 cores; also 4 at N=30) with a source paced
at ``--rate`` records/s per worker, run for ``--seconds`` with an epoch every 0.1 s. The
task's bound time is taken in the worker with the system-wide monotonic clock the driver
uses for triggers. Writes notification_latency_local.csv and .png.

    python benchmarks/paper/notification_latency.py [--epochs 20] [--quick]
    python benchmarks/paper/notification_latency.py --deployment local [--seconds 4] [--rate 2000]
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
from benchmarks.paper.traffic import RATE, rr_n  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, Pipeline, Source, TrackerConfig  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.local import LocalDriver  # noqa: E402
from epochstream.deploy.sim import SimConfig, SimDriver  # noqa: E402

MODES = (("aligned", "aligned", True), ("tracker-aggregated", "tracker", True))


def measure(n_maps: int, workers: int, granularity: int, epochs: int, label: str, mode: str, net_delay: float):
    p, _records = rr_n(n_maps, workers, granularity, epochs, mode, True)
    cfg = SimConfig(source_rate=RATE, source_batch=1, check_invariants=False, net_delay=net_delay)
    with tempfile.TemporaryDirectory(prefix="es-latency-") as chk:
        driver = SimDriver(p, LocalCheckpointStorage(chk), seed=1, config=cfg)
        driver.run(None, False, None)
    sources = {c.id for c in driver.plan.chains if c.is_source}
    # sources end epochs themselves (their bound is the trigger): only downstream processes count
    lat = sorted(s * 1000 for _e, t, s in driver.bound_latency if t[0] not in sources)
    return {"mode": label, "graph_size": n_maps, "workers": workers, "granularity": granularity,
            "net_delay_ms": net_delay * 1000, "samples": len(lat), "p50_ms": statistics.median(lat),
            "p99_ms": percentile(lat, 0.99), "max_ms": lat[-1]}


class PacedSource(Source):
    """Unbounded integers, ``rate`` records/s per split from the first read (wall clock):
    a steady load instead of a source that saturates both cores."""

    def __init__(self, rate: float, num_splits: int) -> None:
        self.rate = rate
        self.num_splits = num_splits
        self._t0: float | None = None

    def split_length(self, split: int) -> None:
        return None

    def read(self, split: int, offset: int, count: int) -> list[int]:
        import time

        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        due = int((now - self._t0) * self.rate) - offset
        return list(range(offset * self.num_splits + split, (offset + min(count, max(due, 0))) * self.num_splits,
                          self.num_splits))


def measure_local(n_maps: int, mode: str, seconds: float, rate: float, workers: int = 2) -> dict:
    p = Pipeline(f"rr-{n_maps}-local", parallelism=workers, mode=mode, batch_size=64,
                 checkpoint=CheckpointConfig(interval=0.1, num_retained=1),
                 tracker=TrackerConfig(aggregate=True, flush_interval=0.005, flush_count=1000))
    s = p.from_source(PacedSource(rate, workers), uid="src")
    for k in range(n_maps):
        s = s.key_by(_ident).map(_ident, name=f"map{k}")
    s.sink(DiscardingSink(), uid="sink")
    with tempfile.TemporaryDirectory(prefix="es-latency-local-") as chk:
        driver = LocalDriver(p, LocalCheckpointStorage(chk), seed=1)
        driver.run(None, False, seconds)
    sources = {c.id for c in driver.plan.chains if c.is_source}
    lat = sorted(s * 1000 for _e, t, s in driver.bound_latency if t[0] not in sources)
    return {"mode": mode, "graph_size": n_maps, "workers": workers, "rate_per_worker": rate, "samples": len(lat),
            "epochs": len(driver.record.completed), "p50_ms": statistics.median(lat),
            "p99_ms": percentile(lat, 0.99), "max_ms": lat[-1]}


def _ident(x):
    return x


def main_local(args) -> int:
    n_values = [3, 10] if args.quick else [3, 10, 30, 100]
    points = [(n, 2) for n in n_values] + ([] if args.quick else [(30, 4)])
    rows = []
    total = len(points) * 2
    k = 0
    for n, w in points:
        for mode in ("aligned", "tracker"):
            k += 1
            print(f"[{k}/{total}] local N={n} W={w} {mode} ({args.seconds:.0f} s) ...", end=" ", flush=True)
            row = measure_local(n, mode, args.seconds, args.rate, w)
            rows.append(row)
            print(f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms "
                  f"({row['samples']} bounds, {row['epochs']} epochs)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "notification_latency_local.csv", rows)
    print("\nlocal driver: median / p99 ms from an epoch's trigger to each downstream task's bound")
    for r in rows:
        print(f"  {r['mode']:<8} N={r['graph_size']:<3} W={r['workers']} "
              f"p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f}")
    for mode in ("aligned", "tracker"):
        lo = next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (mode, n_values[0], 2))
        hi = next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (mode, n_values[-1], 2))
        print(f"  {mode}: median N={n_values[-1]} / N={n_values[0]} = {hi['p50_ms'] / lo['p50_ms']:.2f}")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 4))
    for mode in ("aligned", "tracker"):
        sel = [next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (mode, n, 2)) for n in n_values]
        ax.plot(n_values, [r["p50_ms"] for r in sel], marker="o", label=f"{mode} p50")
        ax.plot(n_values, [r["p99_ms"] for r in sel], marker="x", linestyle="--", label=f"{mode} p99")
    ax.set_xlabel("graph_size (repartitioned maps)")
    ax.set_ylabel("ms from epoch trigger to bound")
    ax.set_title("notification latency (local driver, 2 workers)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "notification_latency_local.png", dpi=120)
    print(f"\nwrote {out / 'notification_latency_local.csv'} and {out / 'notification_latency_local.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deployment", choices=("sim", "local"), default="sim")
    ap.add_argument("--seconds", type=float, default=4.0, help="local: seconds per run")
    ap.add_argument("--rate", type=float, default=2000.0, help="local: records/s per worker")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--granularity", type=int, default=10)
    ap.add_argument("--net-delay", type=float, default=0.0005, help="mean one-way delay between workers (s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.deployment == "local":
        return main_local(args)
    n_values = [10, 30] if args.quick else [10, 30, 100]
    w_values = [5, 15] if args.quick else [5, 10, 15, 20]
    points = sorted({(n, 15) for n in n_values} | {(30, w) for w in w_values})
    rows = []
    total = len(points) * len(MODES)
    k = 0
    for n, w in points:
        for label, mode, _agg in MODES:
            k += 1
            print(f"[{k}/{total}] N={n} W={w} {label} ...", end=" ", flush=True)
            row = measure(n, w, args.granularity, args.epochs, label, mode, args.net_delay)
            rows.append(row)
            print(f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms ({row['samples']} bounds)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "notification_latency.csv", rows)
    print("\nmedian / p99 ms from an epoch's end at the sources to each process's bound")
    for label, _m, _a in MODES:
        for n, w in points:
            r = next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (label, n, w))
            print(f"  {label:<19} N={n:<4} W={w:<3} p50 {r['p50_ms']:7.2f}  p99 {r['p99_ms']:7.2f}")
    for label, _m, _a in MODES:
        lo = next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (label, n_values[0], 15))
        hi = next(r for r in rows if (r["mode"], r["graph_size"], r["workers"]) == (label, n_values[-1], 15))
        print(f"  {label}: median N={n_values[-1]} / N={n_values[0]} = {hi['p50_ms'] / lo['p50_ms']:.2f} "
              f"(tracker target: within 1.25)")
    _plot(rows, n_values, w_values, out / "notification_latency.png")
    print(f"\nwrote {out / 'notification_latency.csv'} and {out / 'notification_latency.png'}")
    return 0


def _plot(rows, n_values, w_values, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, xs, fixed in ((axes[0], "graph_size", n_values, ("workers", 15)),
                               (axes[1], "workers", w_values, ("graph_size", 30))):
        for label, _m, _a in MODES:
            sel = [next(r for r in rows if r["mode"] == label and r[key] == x and r[fixed[0]] == fixed[1]) for x in xs]
            ax.plot(xs, [r["p50_ms"] for r in sel], marker="o", label=f"{label} p50")
            ax.plot(xs, [r["p99_ms"] for r in sel], marker="x", linestyle="--", label=f"{label} p99")
        ax.set_xlabel(key)
        ax.set_ylabel("ms from epoch end to bound")
        ax.set_title(f"{fixed[0]}={fixed[1]}", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("notification latency (simulator)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
