"""Figure 13a on the local driver: NEXMark Query 8 window latency with one slowed worker.

The simulator's version (``window_latency.py``) shows what stragglers do at 2 to 30 workers.
This one runs the same query on real worker processes (2, this machine's cores), with event
time taken from the wall clock: persons and auctions come from two ``rate`` sources at
``--rate`` records/s per subtask, each record stamped with the time it is due, joined per
person in tumbling windows of ``--window`` s. For every window

    latency = (when the last subtask's output of the window reached its sink)
            - (the window's end: when its last element was due)

With ``--stragglers`` one worker (worker 1, which runs a source subtask and a window
subtask) is paused with SIGSTOP and SIGCONT by a thread of this process, as the simulator
pauses its workers: Poisson arrivals at ``--straggler-rate`` per second, each pause
``--straggler-min`` s times a Pareto(``--straggler-alpha``) draw, cut at ``--straggler-cap`` s
so that heartbeats (10 s) never declare the worker failed. The *floor* of a window is how
long a pause that covered the window's end still lasted after it: a paused window subtask
cannot fire, so no protocol does better. The first ``--warmup`` s of windows (worker start-up)
are not counted. Writes benchmarks/results/<name>.csv and .png and prints p50/p99. Not a test.

    python benchmarks/paper/window_latency_local.py [--seconds 60] [--name window_latency_local]
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot  # noqa: E402
from benchmarks.paper.window_latency import Q8, add_workload_args  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, Pipeline, TrackerConfig  # noqa: E402
from epochstream.deploy.sources import RateSource  # noqa: E402

MODES = ("aligned", "tracker")


class Person:
    def __init__(self, people: int) -> None:
        self.people = people

    def __call__(self, r):
        i = r["value"]
        return ("P", i % self.people, f"p{i % self.people}", r["timestamp"])


class Auction:
    def __init__(self, people: int) -> None:
        self.people = people

    def __call__(self, r):
        i = r["value"]
        return ("A", i, (i * 7919) % self.people, r["timestamp"])


class _FiredWriter:
    """Logs, per write, the wall time and each window start in it (one file per worker process)."""

    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, f"fired-{os.getpid()}.log")

    def write(self, records) -> None:
        now = time.time()
        starts = {r[2] for r in records}
        with open(self.path, "a") as f:
            f.write("".join(f"{now:.6f} {s!r}\n" for s in starts))

    def take(self) -> list:
        return []


class FiredSink(DiscardingSink):
    """A DiscardingSink (two-phase commit, output dropped) that logs when each window's output arrived."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def writer(self) -> _FiredWriter:  # type: ignore[override]
        return _FiredWriter(self.log_dir)


def q8_local(mode: str, args, log_dir: str, start: float) -> Pipeline:
    workers = 2
    n = int(args.rate * args.seconds) * workers
    people = 50 * workers
    p = Pipeline(f"q8-local-{mode}", parallelism=workers, mode=mode, batch_size=8,
                 checkpoint=CheckpointConfig(interval=1.0, num_retained=1),
                 tracker=TrackerConfig(time_slack=args.slack, flush_interval=args.flush_interval))
    persons = p.from_source(RateSource(args.rate * workers, workers, n, start=start), uid="persons",
                            timestamps="timestamp").map(Person(people))
    auctions = p.from_source(RateSource(args.rate * workers, workers, n, start=start), uid="auctions",
                             timestamps="timestamp").map(Auction(people))
    joined = persons.union(auctions).key_by(lambda r: r[1] if r[0] == "P" else r[2]).process(Q8(args.window),
                                                                                              uid="q8")
    joined.sink(FiredSink(log_dir), uid="out")
    return p


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, oldest first (from /proc; the local driver forks its workers)."""
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # ppid
            kids.append((int(fields[19]), int(stat.split("/")[2])))  # (start time in ticks, pid)
    return [p for _t, p in sorted(kids)]


class Straggler(threading.Thread):
    """Pauses one worker process (SIGSTOP, then SIGCONT) at Poisson times for Pareto lengths."""

    def __init__(self, args, worker: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.args, self.worker, self.rng = args, worker, random.Random(seed)
        self.stop = threading.Event()
        self.pauses: list[tuple[float, float]] = []
        self.pid: int | None = None

    def run(self) -> None:
        a = self.args
        while not self.stop.is_set() and self.pid is None:  # wait for the workers to be forked
            kids = _children(os.getpid())
            if len(kids) > self.worker:
                self.pid = kids[self.worker]
            else:
                time.sleep(0.05)
        while not self.stop.wait(self.rng.expovariate(a.straggler_rate)):
            length = min(a.straggler_cap, a.straggler_min * self.rng.paretovariate(a.straggler_alpha))
            assert self.pid is not None
            try:
                os.kill(self.pid, signal.SIGSTOP)
            except ProcessLookupError:
                return
            t0 = time.time()
            time.sleep(length)
            os.kill(self.pid, signal.SIGCONT)
            self.pauses.append((t0, time.time()))


def measure(mode: str, args, stragglers: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="es-window-local-") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        start = time.time() + args.lead
        p = q8_local(mode, args, str(logs), start)
        strag = Straggler(args, worker=1, seed=args.seed) if stragglers else None
        if strag is not None:
            strag.start()
        load = os.getloadavg()[0]
        try:
            p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        finally:
            if strag is not None:
                strag.stop.set()
                strag.join()
        fired: dict[float, float] = {}
        for path in logs.glob("fired-*.log"):
            for line in path.read_text().splitlines():
                t, s = line.split()
                fired[float(s)] = max(fired.get(float(s), 0.0), float(t))
    pauses = strag.pauses if strag is not None else []
    first = start + args.warmup
    last_end = start + args.seconds
    lat, floor, over = [], [], []
    for s in sorted(fired):
        end = s + args.window
        if end < first or end > last_end - args.window:  # start-up, and the last (partial) window
            continue
        lat.append((fired[s] - end) * 1000)
        floor.append(max((e - end for b, e in pauses if b <= end < e), default=0.0) * 1000)
        over.append(lat[-1] - floor[-1])
    return {"mode": mode, "workers": 2, "stragglers": "on" if stragglers else "off",
            "straggler_rate": args.straggler_rate if stragglers else 0.0, "straggler_alpha": args.straggler_alpha,
            "straggler_min_ms": args.straggler_min * 1000, "straggler_cap_ms": args.straggler_cap * 1000,
            "pauses": len(pauses), "paused_s": round(sum(e - b for b, e in pauses), 2),
            "window_s": args.window, "slack_s": args.slack, "rate_per_subtask": args.rate,
            "seconds": args.seconds, "windows": len(lat),
            "mean_ms": statistics.fmean(lat),
            "p50_ms": statistics.median(lat), "p99_ms": percentile(lat, 0.99), "max_ms": max(lat),
            "floor_p50_ms": statistics.median(floor), "floor_p99_ms": percentile(floor, 0.99),
            "over_floor_p50_ms": statistics.median(over), "over_floor_p99_ms": percentile(over, 0.99),
            "flush_interval_ms": args.flush_interval * 1000, "load_1min": round(load, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of input per run")
    ap.add_argument("--flush-interval", type=float, default=0.005, help="local trackers' flush interval (s)")
    ap.add_argument("--lead", type=float, default=3.0, help="seconds from building the job to its first record")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of windows not counted after the first record")
    ap.add_argument("--straggler-rate", type=float, default=2.0, help="pauses per second of the slowed worker")
    ap.add_argument("--straggler-cap", type=float, default=2.0, help="longest pause, seconds (heartbeats: 10 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-baseline", action="store_true", help="only the runs with the slowed worker")
    ap.add_argument("--name", default="window_latency_local")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    settings = ([] if args.no_baseline else [False]) + [True]
    rows = []
    total, k = len(modes) * len(settings), 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stragglers in settings:
        for mode in modes:
            k += 1
            print(f"[{k}/{total}] {mode}, slowed worker {'on' if stragglers else 'off'}, {args.seconds:g} s ...",
                  end=" ", flush=True)
            row = measure(mode, args, stragglers)
            rows.append(row)
            print(f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms over {row['windows']} windows; "
                  f"{row['pauses']} pauses ({row['paused_s']} s); over the floor p50 {row['over_floor_p50_ms']:.1f}, "
                  f"p99 {row['over_floor_p99_ms']:.1f} ms (load {row['load_1min']})", flush=True)
            with open(out / f"{args.name}.csv", "w", newline="") as f:  # after every run: a long run keeps its rows
                wr = csv.DictWriter(f, fieldnames=list(rows[0]))
                wr.writeheader()
                wr.writerows(rows)
    print("\nwindow latency (ms), NEXMark Q8 on the local driver (2 workers), last element due -> window output")
    print(f"  {'mode':>8} {'slowed':>6} {'p50':>8} {'p99':>8} {'max':>8} {'floor p99':>10} {'over p50':>9} "
          f"{'over p99':>9} {'windows':>8}")
    for r in rows:
        print(f"  {r['mode']:>8} {r['stragglers']:>6} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f} "
              f"{r['floor_p99_ms']:10.1f} {r['over_floor_p50_ms']:9.1f} {r['over_floor_p99_ms']:9.1f} "
              f"{r['windows']:8d}")
    _plot(rows, out / f"{args.name}.png")
    print(f"\nwrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['mode']}\nslowed {r['stragglers']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["p50_ms"] for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["p99_ms"] for r in rows], width=0.4, label="p99")
    ax.scatter([i + 0.2 for i in x], [r["floor_p99_ms"] for r in rows], color="black", marker="_", s=300,
               label="straggler floor p99", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms from a window's end to its output")
    ax.set_title("NEXMark Q8 window latency, local driver (2 workers)", fontsize=9)
    ax.legend(fontsize=7)
    if any(r["p99_ms"] > 0 for r in rows):
        ax.set_yscale("symlog", linthresh=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
