"""Record latency spikes while snapshots are taken (paper 000 §5.3.2, Figure 12), on the simulator.

RR-N (a source, N maps each repartitioned round-robin by key, the last one keyed with a running
count as state, a sink) at a fixed input rate, epochs every ``--interval`` virtual seconds, and
the persistent save of every snapshot taking ``--saves`` seconds (``SimConfig.write_base``).
Every record carries the virtual time it was read; the last map records its source-to-sink
latency. A record is *inside a snapshot window* if it was read between an epoch's trigger and
its completion. The spike of a run is the p99 (and max) latency of the records inside windows
minus the median latency of the records outside them.

Two save disciplines, because the paper's result depends on which one a system uses:

* ``blocking``: the task writes its snapshot itself and takes no record meanwhile, as the paper
  describes snapshotting ("it blocks all inputs and persistently saves its local state");
* ``async``: epochstream's own: the capture is taken at the bound and a writer lane beside the
  task writes it, so a save's duration delays only the epoch's commit.

For each, aligned (markers) and tracker (NEOSS) at each save duration. Paper (FlameStream,
blocking saves): the trAcker's spikes are 50-120 ms smaller than punctuations'. Costs: the
simulator's defaults (5 us per step, 2 us per record), worker cores shared (``--cores``).

``--driver local`` runs the same on the local driver (``--modes aligned,tracker,unaligned`` adds
unaligned snapshots): real worker processes (``--workers``,
default 2 there), a paced source stamping each record with the host's monotonic clock, 1 s
epochs of wall time, and the save delay injected into the storage layer
(``LocalCheckpointStorage(save_delay=...)``: every state pre-commit sleeps that long in the
worker's writer thread). Only epochstream's own (asynchronous) saves exist there. The probe's
records go to a FileSink, so only committed epochs are counted.

Writes benchmarks/results/snapshot_spikes.csv and .png (``snapshot_spikes_local.*`` with
``--driver local``) and prints the spikes. Not a test.

    python benchmarks/paper/snapshot_spikes.py [--quick] [--driver local]
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from benchmarks.paper.sustainable_throughput import Clock, Stamp  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    FileSink,
    KeyedProcessFunction,
    Pipeline,
    Source,
    TrackerConfig,
    ValueStateDescriptor,
)
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.local import LocalDriver  # noqa: E402
from epochstream.deploy.sim import SimConfig, SimDriver  # noqa: E402

MODES = ("aligned", "tracker")
DISCIPLINES = ("blocking", "async")


class CountingProbe(KeyedProcessFunction):
    """A running count per key (the state snapshots save) that also logs each record's latency."""

    def __init__(self, clock: Clock, log: list[tuple[float, float]]) -> None:
        self.clock, self.log = clock, log

    def __deepcopy__(self, memo):
        # each subtask gets its own instance (the runtime deep-copies it), all logging to one list
        # and reading the one running simulator's clock
        return CountingProbe(self.clock, self.log)

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, r, ctx):
        self.count.update(self.count.value() + 1)
        self.log.append((r[1], self.clock.now() - r[1]))
        yield r


def _key(r):
    return r[0] % 1024


def _identity(r):
    return r


def run(args, mode: str, save: float, discipline: str) -> dict:
    clock = Clock()
    log: list[tuple[float, float]] = []
    records = int(args.rate * args.seconds)
    p = Pipeline(f"spikes-{mode}", parallelism=args.workers, mode=mode, batch_size=1,
                 checkpoint=CheckpointConfig(interval=args.interval, max_concurrent=1, num_retained=1),
                 tracker=TrackerConfig(aggregate=True, flush_interval=0.005, flush_count=1000))
    s = p.generate(Stamp(clock), count=records, uid="src")
    for k in range(args.graph_size - 1):
        s = s.key_by(_key).map(_identity, name=f"map{k}")
    s.key_by(_key).process(CountingProbe(clock, log), uid="count").sink(DiscardingSink(), uid="sink")
    cfg = SimConfig(source_rate=args.rate / args.workers, source_batch=1, check_invariants=False,
                    worker_cores=args.cores, write_base=save, blocking_writes=discipline == "blocking")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="es-spikes-") as chk:
        driver = SimDriver(p, LocalCheckpointStorage(chk), seed=1, config=cfg)
        clock.driver = driver
        driver.run(None, False, None)
    assert driver.controller is not None
    windows = sorted((e["triggered_at"], e["triggered_at"] + e["complete_seconds"])
                     for e in driver.controller.master.coordinator.stats()
                     if e["complete_seconds"] is not None and e["kind"] != "final")
    return {"discipline": discipline, "mode": mode, "save_ms": save * 1000, "graph_size": args.graph_size,
            "workers": args.workers, "rate": args.rate, "epochs": len(windows),
            **_spikes(windows, log, warm=args.interval), "wall_s": round(time.perf_counter() - t0, 1)}


def _spikes(windows: list[tuple[float, float]], log: list[tuple[float, float]], warm: float) -> dict:
    """p99 / max latency of records read inside a snapshot window, minus the median of the rest.

    ``warm``: records read before it are skipped (start-up; the first epoch starts after one
    interval)."""
    starts = [w[0] for w in windows]

    def inside(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= windows[i][1]

    inn = sorted(lat for t, lat in log if t > warm and inside(t))
    out = sorted(lat for t, lat in log if t > warm and not inside(t))
    steady = statistics.median(out) if out else float("nan")
    p99 = percentile(inn, 0.99) if inn else float("nan")
    # the worst record of each epoch's window: its median over epochs is the typical epoch's spike
    worst: dict[int, float] = {}
    for t, lat in log:
        i = bisect.bisect_right(starts, t) - 1
        if t > warm and i >= 0 and t <= windows[i][1]:
            worst[i] = max(worst.get(i, 0.0), lat)
    typical = statistics.median(worst.values()) - steady if worst else float("nan")
    return {"records_in_windows": len(inn), "records_outside": len(out), "steady_p50_ms": steady * 1000,
            "spike_epoch_median_ms": typical * 1000,
            "window_p99_ms": p99 * 1000, "window_max_ms": (inn[-1] if inn else float("nan")) * 1000,
            "spike_p99_ms": (p99 - steady) * 1000, "spike_max_ms": ((inn[-1] if inn else steady) - steady) * 1000}


# ---------------------------------------------------------------------------- the local driver
class StampedPaced(Source):
    """Unbounded records ``(i, monotonic time read)``, ``rate`` per second per split (wall clock)."""

    def __init__(self, rate: float, num_splits: int) -> None:
        self.rate = rate
        self.num_splits = num_splits
        self._t0: float | None = None

    def split_length(self, split: int) -> None:
        return None

    def read(self, split: int, offset: int, count: int) -> list[tuple[int, float]]:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        due = min(count, max(int((now - self._t0) * self.rate) - offset, 0))
        return [((offset + j) * self.num_splits + split, now) for j in range(due)]


class LocalProbe(KeyedProcessFunction):
    """A running count per key (the saved state); emits (time read, source-to-here latency)."""

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, r, ctx):
        self.count.update(self.count.value() + 1)
        return ((r[1], time.monotonic() - r[1]),)


def run_local(args, mode: str, save: float) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="es-spikes-local-") as tmp:
        sink = FileSink(os.path.join(tmp, "out"))
        p = Pipeline(f"spikes-local-{mode}", parallelism=args.workers, mode=mode, batch_size=64,
                     checkpoint=CheckpointConfig(interval=args.interval, max_concurrent=1, num_retained=1),
                     tracker=TrackerConfig(aggregate=True, flush_interval=0.005, flush_count=1000))
        s = p.from_source(StampedPaced(args.rate / args.workers, args.workers), uid="src")
        for k in range(args.graph_size - 1):
            s = s.key_by(_key).map(_identity, name=f"map{k}")
        s.key_by(_key).process(LocalProbe(), uid="count").sink(sink, uid="sink")
        driver = LocalDriver(p, LocalCheckpointStorage(os.path.join(tmp, "chk"), save_delay=save), seed=1,
                             rest=False)
        driver.run(None, False, args.seconds)
        log = [(t, lat) for t, lat in sink.read()]  # both on the host's monotonic clock
        assert driver.master is not None
        windows = sorted((e["triggered_at"], e["triggered_at"] + e["complete_seconds"])
                         for e in driver.master.coordinator.stats()
                         if e["complete_seconds"] is not None and e["kind"] != "final")
    # the first epoch is the warm-up (workers import their writers' libraries on its first save): skip
    # everything read before it completed
    warm, windows = (windows[0][1], windows[1:]) if windows else (float("inf"), windows)
    return {"discipline": "async", "mode": mode, "save_ms": save * 1000, "graph_size": args.graph_size,
            "workers": args.workers, "rate": args.rate, "epochs": len(windows),
            **_spikes(windows, log, warm=warm), "wall_s": round(time.perf_counter() - t0, 1)}


def main_local(args, saves: list[float]) -> int:
    runs = []
    modes = args.modes
    total, k = args.repeats * len(saves) * len(modes), 0
    for rep in range(args.repeats):  # repeats interleaved, so a burst of load hits every setting alike
        for save in saves:
            for mode in modes:
                k += 1
                print(f"[{k}/{total}] local driver, saves of {save * 1000:g} ms, {mode} ({args.seconds:g} s) ...",
                      end=" ", flush=True)
                row = {**run_local(args, mode, save), "repeat": rep, "load_1min": round(os.getloadavg()[0], 1)}
                runs.append(row)
                print(f"steady p50 {row['steady_p50_ms']:.2f} ms, spike p99 {row['spike_p99_ms']:.1f} ms, "
                      f"max {row['spike_max_ms']:.1f} ms, typical epoch {row['spike_epoch_median_ms']:.1f} ms over "
                      f"{row['epochs']} epochs [{row['wall_s']}s, load {row['load_1min']}]")
    # one row per setting: the median over repeats of every measure
    measures = ("steady_p50_ms", "spike_p99_ms", "spike_max_ms", "spike_epoch_median_ms")
    rows = []
    for save in saves:
        for mode in modes:
            sel = [r for r in runs if (r["save_ms"], r["mode"]) == (save * 1000, mode)]
            rows.append({**sel[0], "repeat": "median", "epochs": sum(r["epochs"] for r in sel),
                         "load_1min": statistics.median(r["load_1min"] for r in sel),
                         **{m: statistics.median(r[m] for r in sel) for m in measures}})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", runs + rows, list(rows[0]))
    print(f"\nlatency spike inside snapshot windows (p99 / max minus steady p50, ms), RR-{args.graph_size}, "
          f"local driver, {args.workers} workers, {args.rate:g} records/s, {args.interval:g} s epochs")
    print(f"  median of {args.repeats} run(s) per setting; 'epoch' = the median over epochs of each window's worst "
          f"record, minus the steady p50")
    print(f"  {'save ms':>7}  {'mode':<10} {'steady p50':>10} {'spike p99':>10} {'spike max':>10} {'epoch':>8}")
    for save in saves:
        for mode in modes:
            r = next(r for r in rows if (r["save_ms"], r["mode"]) == (save * 1000, mode))
            print(f"  {save * 1000:>7g}  {mode:<10} {r['steady_p50_ms']:>10.2f} {r['spike_p99_ms']:>10.1f} "
                  f"{r['spike_max_ms']:>10.1f} {r['spike_epoch_median_ms']:>8.1f}")
    print("  paper (blocking saves, FlameStream): the trAcker's spikes are 50-120 ms smaller")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        sel = [next(r for r in rows if (r["save_ms"], r["mode"]) == (s * 1000, mode)) for s in saves]
        ax.plot([s * 1000 for s in saves], [r["spike_p99_ms"] for r in sel], marker="x", linestyle="--",
                label=f"{mode} p99")
        ax.plot([s * 1000 for s in saves], [r["spike_epoch_median_ms"] for r in sel], marker="o",
                label=f"{mode} typical epoch")
    ax.set_xlabel("persistent save duration (ms, injected in the storage layer)")
    ax.set_ylabel("latency spike over steady p50 (ms)")
    ax.set_title(f"RR-{args.graph_size}, local driver, {args.workers} workers, {args.rate:g} records/s, median of "
                 f"{args.repeats}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)
    print(f"\nwrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--driver", choices=("sim", "local"), default="sim",
                    help="sim: the simulator; local: real worker processes")
    ap.add_argument("--graph-size", type=int, default=10, help="N of RR-N")
    ap.add_argument("--workers", type=int, default=None, help="default 5 on the simulator, 2 locally")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--rate", type=float, default=None, help="records/s, whole job (default 5000 sim, 1000 local)")
    ap.add_argument("--interval", type=float, default=1.0, help="epoch interval, virtual seconds (paper: 1 s)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="seconds of input (virtual on the simulator; default 6, local 15)")
    ap.add_argument("--saves", default="0,0.05,0.1,0.2,0.5", help="save durations, seconds (paper: 0-500 ms)")
    ap.add_argument("--quick", action="store_true",
                    help="RR-5; simulator: 3 virtual seconds, saves 0, 0.1, 0.5; local: 12 s per run, all saves")
    ap.add_argument("--repeats", type=int, default=None,
                    help="local driver: runs per setting, interleaved; the table shows medians (default 3)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--modes", default="aligned,tracker",
                    help="local driver: snapshot modes, comma-separated (aligned, tracker, unaligned)")
    ap.add_argument("--name", default="snapshot_spikes_local", help="local driver: results file name")
    args = ap.parse_args(argv)
    saves = [float(x) for x in args.saves.split(",")]
    local = args.driver == "local"
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not local and args.modes != list(MODES):
        ap.error("--modes applies to --driver local (the simulator compares aligned and tracker)")
    args.workers = args.workers or (2 if local else 5)
    args.rate = args.rate or (1000.0 if local else 5000.0)
    args.seconds = args.seconds or (15.0 if local else 6.0)
    args.repeats = args.repeats or 3
    if args.quick:
        args.graph_size = 5
        args.seconds = 12.0 if local else 3.0
        saves = saves if local else [0.0, 0.1, 0.5]
    if local:
        print(f"load {os.getloadavg()[0]:.2f} (1 min average) on {os.cpu_count()} cores")
        return main_local(args, saves)
    rows = []
    total, k = len(DISCIPLINES) * len(MODES) * len(saves), 0
    for discipline in DISCIPLINES:
        for save in saves:
            for mode in MODES:
                k += 1
                print(f"[{k}/{total}] {discipline} saves of {save * 1000:g} ms, {mode} ...", end=" ", flush=True)
                row = run(args, mode, save, discipline)
                rows.append(row)
                print(f"steady p50 {row['steady_p50_ms']:.2f} ms, spike p99 {row['spike_p99_ms']:.1f} ms, "
                      f"max {row['spike_max_ms']:.1f} ms over {row['epochs']} epochs [{row['wall_s']}s]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "snapshot_spikes.csv", rows)
    print(f"\nlatency spike inside snapshot windows (p99 / max minus steady p50, ms), RR-{args.graph_size}, "
          f"{args.workers} workers, {args.rate:g} records/s, simulator")
    print(f"  {'saves':<9} {'save ms':>7}  {'aligned p99':>11} {'tracker p99':>11}  {'aligned max':>11} "
          f"{'tracker max':>11}  {'aligned - tracker (max)':>24}")
    for discipline in DISCIPLINES:
        for save in saves:
            a, t = (next(r for r in rows if (r["discipline"], r["save_ms"], r["mode"]) == (discipline, save * 1000, m))
                    for m in MODES)
            print(f"  {discipline:<9} {save * 1000:>7g}  {a['spike_p99_ms']:>11.1f} {t['spike_p99_ms']:>11.1f}  "
                  f"{a['spike_max_ms']:>11.1f} {t['spike_max_ms']:>11.1f}  "
                  f"{a['spike_max_ms'] - t['spike_max_ms']:>24.1f}")
    print("  paper (blocking saves): the trAcker's spikes are 50-120 ms smaller")
    _plot(rows, saves, out / "snapshot_spikes.png")
    print(f"\nwrote {out / 'snapshot_spikes.csv'} and {out / 'snapshot_spikes.png'}")
    return 0


def _plot(rows, saves, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(DISCIPLINES), figsize=(11, 4), sharey=True)
    for ax, discipline in zip(axes, DISCIPLINES, strict=True):
        for mode in MODES:
            sel = [next(r for r in rows if (r["discipline"], r["save_ms"], r["mode"]) == (discipline, s * 1000, mode))
                   for s in saves]
            ax.plot([s * 1000 for s in saves], [r["spike_max_ms"] for r in sel], marker="o", label=f"{mode} max")
            ax.plot([s * 1000 for s in saves], [r["spike_p99_ms"] for r in sel], marker="x", linestyle="--",
                    label=f"{mode} p99")
        ax.set_xlabel("persistent save duration (ms)")
        ax.set_ylabel("latency spike over steady p50 (ms)")
        ax.set_title(f"{discipline} saves (simulator)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
