"""Window latency: NEXMark Query 8 (a windowed join) with trAcker time bounds vs watermarks.

Paper 000 §5.3.1 / Figure 13a measures the time from the last element of a window
entering the system to the window's output, for the trAcker and for punctuations, while
the number of nodes grows. Here, on the simulator (exponential one-way delay, mean
``--net-delay`` between workers; FIFO per channel; a task is busy 5 us per message plus
2 us per record): persons and auctions arrive at ``--rate`` records/s per source subtask
with event time = arrival time, are joined per person in tumbling windows of ``--window``
seconds (coarse time labels of ``--slack`` seconds), and for every window

    latency = (time the window operator fired it, slowest subtask)
            - (time every source had promised past the window, i.e. its last element was in)

``aligned`` carries event time as watermarks on every data channel (Flink's punctuation),
``tracker`` as WindowEnd notifications from the agent. Writes benchmarks/results/
<name>.csv and .png and prints medians and p99 per worker count. Not a test.

A task logs a time label at the start of the step that reaches it; with stragglers a step
that begins inside a pause of its worker ends after the pause, so a window fires when the
firing step's output leaves (``_out_at``). With stragglers (whole workers pause,
``SimConfig.straggler_rate``) each window also gets a
*floor*: the longest a worker that was paused when the window's last element came in stayed
paused after it. Every worker runs a window subtask, and a paused subtask cannot fire, so
no protocol's latency is below the floor; what a protocol adds to it is its own.

    python benchmarks/paper/window_latency.py [--quick] [--workers 20,30 --seconds 60 --no-baseline --name NAME]
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    KeyedProcessFunction,
    MapStateDescriptor,
    Pipeline,
    TrackerConfig,
)
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.sim import SimConfig, SimDriver  # noqa: E402
from epochstream.runtime import eventtime  # noqa: E402

MODES = ("aligned", "tracker")


class Q8(KeyedProcessFunction):
    """Per person and window: name seen and auction opened -> emit at the window's end."""

    def __init__(self, window: float) -> None:
        self.window = window

    def open(self, ctx):
        self.windows = ctx.state(MapStateDescriptor("windows"))
        self.timers = ctx.timer_service()

    def process(self, event, ctx):
        start = math.floor(event[3] / self.window) * self.window
        if not self.windows.contains(start):
            self.timers.register_event_time_timer(math.nextafter(start + self.window, -math.inf))
        name, opened = self.windows.get(start) or [None, False]
        self.windows.put(start, [event[2], opened] if event[0] == "P" else [name, True])

    def on_timer(self, timestamp, ctx):
        start = math.floor(timestamp / self.window) * self.window
        name, opened = self.windows.get(start)
        self.windows.remove(start)
        if name is not None and opened:
            yield (ctx.key, name, start)


class Person:
    def __init__(self, workers: int, rate: float, people: int) -> None:
        self.workers, self.rate, self.people = workers, rate, people

    def __call__(self, i: int):
        return ("P", i % self.people, f"p{i % self.people}", (i // self.workers) / self.rate)


class Auction:
    def __init__(self, workers: int, rate: float, people: int) -> None:
        self.workers, self.rate, self.people = workers, rate, people

    def __call__(self, i: int):
        return ("A", i, (i * 7919) % self.people, (i // self.workers) / self.rate)


def _ts(r):
    return r[3]


def q8_pipeline(mode: str, workers: int, rate: float, seconds: float, window: float, slack: float,
                flush_interval: float = 0.005) -> Pipeline:
    n = int(rate * seconds) * workers
    p = Pipeline(f"q8-{mode}-{workers}", parallelism=workers, mode=mode, batch_size=8,
                 checkpoint=CheckpointConfig(interval=1.0, num_retained=1),
                 tracker=TrackerConfig(time_slack=slack, flush_interval=flush_interval))
    people = p.generate(Person(workers, rate, 50 * workers), count=n, uid="persons", timestamps=_ts)
    auctions = p.generate(Auction(workers, rate, 50 * workers), count=n, uid="auctions", timestamps=_ts)
    joined = people.union(auctions).key_by(lambda r: r[1] if r[0] == "P" else r[2]).process(Q8(window), uid="q8")
    joined.sink(DiscardingSink(), uid="out")
    return p


def measure(mode: str, workers: int, args, straggle: float = 0.0) -> dict:
    # every label of the run must stay in the tasks' time logs (one per slack, and a little more)
    eventtime.TIME_LOG_LENGTH = max(eventtime.TIME_LOG_LENGTH, 2 * int(args.seconds / args.slack) + 1024)
    p = q8_pipeline(mode, workers, args.rate, args.seconds, args.window, args.slack, args.flush_interval)
    cfg = SimConfig(source_rate=args.rate, source_batch=4, check_invariants=False, net_delay=args.net_delay,
                    straggler_rate=straggle, straggler_alpha=args.straggler_alpha, straggler_min=args.straggler_min)
    with tempfile.TemporaryDirectory(prefix="es-window-") as chk:
        driver = SimDriver(p, LocalCheckpointStorage(chk), seed=args.seed, config=cfg)
        driver.run(None, False, None)
    per_label = round(args.window / args.slack)
    sources = [t for t in driver.tasks.values() if t.is_source]
    firing = [t for t in driver.tasks.values() if t.chain.timed]
    paused: dict[int, list[tuple[float, float]]] = {}
    for w, start, end in driver.pause_log:
        paused.setdefault(w, []).append((start, end))
    lat, floor, over = [], [], []
    for t in sources + firing:  # a log that lost its first labels would date every early window wrongly
        if t.time_log and t.time_log[0][0] > per_label - 1:
            raise RuntimeError(f"task {t.id}'s time log starts at label {t.time_log[0][0]}: "
                               f"raise eventtime.TIME_LOG_LENGTH")
    for k in range(1, int(args.seconds / args.window)):  # window k ends at label k * per_label - 1
        last = k * per_label - 1
        entered = max(_first(t.time_log, last) for t in sources)
        fired = max(_out_at(_first(t.time_log, last), paused.get(t.id[1], [])) for t in firing)
        lat.append((fired - entered) * 1000)
        floor.append(_straggler_floor(driver.pause_log, entered) * 1000)
        over.append(lat[-1] - floor[-1])
    traffic = driver.record.traffic.as_dict()["total"]
    return {"mode": mode, "workers": workers, "stragglers": "on" if straggle else "off",
            "straggler_rate": straggle, "straggler_alpha": args.straggler_alpha,
            "straggler_min_ms": args.straggler_min * 1000, "window_s": args.window, "slack_s": args.slack,
            "net_delay_ms": args.net_delay * 1000, "seconds": args.seconds, "seed": args.seed,
            "windows": len(lat), "mean_ms": statistics.fmean(lat),
            "p50_ms": statistics.median(lat), "p99_ms": percentile(lat, 0.99), "max_ms": max(lat),
            "floor_p50_ms": statistics.median(floor), "floor_p99_ms": percentile(floor, 0.99),
            "over_floor_p50_ms": statistics.median(over), "over_floor_p99_ms": percentile(over, 0.99),
            "flush_interval_ms": args.flush_interval * 1000, "service_messages": traffic["messages"]}


def _out_at(t: float, pauses: list[tuple[float, float]]) -> float:
    """When the output of a step that began at ``t`` leaves its worker: a task logs its time at
    the start of a step, and a step that begins inside one of the worker's pauses (which are
    sorted and never overlap) ends after the pause (``SimConfig.straggler_rate``; the step's own
    cost is microseconds)."""
    i = bisect.bisect_right(pauses, (t, math.inf)) - 1
    return pauses[i][1] if i >= 0 and pauses[i][0] <= t < pauses[i][1] else t


def _straggler_floor(pauses: list[tuple[int, float, float]], at: float) -> float:
    """How long after ``at`` the longest pause that covers ``at`` lasts (0 if no worker is paused then)."""
    return max((end - at for _w, start, end in pauses if start <= at < end), default=0.0)


def _first(log, label: int) -> float:
    """When the task's logged label first reached ``label``."""
    return next(t for lbl, t in log if lbl >= label)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The Q8 workload's and the pauses' flags, shared with ``window_latency_local.py``."""
    ap.add_argument("--rate", type=float, default=500.0, help="records/s per source subtask (paper: 500 RPS per node)")
    ap.add_argument("--window", type=float, default=0.5, help="tumbling window size, seconds")
    ap.add_argument("--slack", type=float, default=0.01, help="coarse time label width (paper: 10 ms)")
    ap.add_argument("--straggler-alpha", type=float, default=1.5, help="Pareto shape of a pause's length")
    ap.add_argument("--straggler-min", type=float, default=0.01, help="shortest pause, seconds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--seconds", type=float, default=5.0, help="virtual seconds of input")
    ap.add_argument("--net-delay", type=float, default=0.0005, help="mean one-way delay between workers (s)")
    ap.add_argument("--flush-interval", type=float, default=0.005,
                    help="local trackers' flush interval (s); the tracker's latency floor (paper: 5 ms)")
    ap.add_argument("--straggler-rate", type=float, default=2.0,
                    help="pauses per virtual second per worker in the straggler runs (0: skip them)")
    ap.add_argument("--workers", default=None, help="comma list of worker counts (default 2,5,10,20,30)")
    ap.add_argument("--seed", type=int, default=1, help="the simulator's seed (network delays, pauses)")
    ap.add_argument("--no-baseline", action="store_true", help="only the straggler runs")
    ap.add_argument("--name", default="window_latency", help="file name of the CSV and PNG")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    w_values = ([int(w) for w in args.workers.split(",")] if args.workers
                else [2, 5] if args.quick else [2, 5, 10, 20, 30])
    settings = ([] if args.no_baseline else [0.0]) + ([args.straggler_rate] if args.straggler_rate > 0 else [])
    rows = []
    total = len(w_values) * len(MODES) * len(settings)
    k = 0
    for straggle in settings:
        for w in w_values:
            for mode in MODES:
                k += 1
                print(f"[{k}/{total}] W={w} {mode} stragglers {'on' if straggle else 'off'} ...", end=" ", flush=True)
                row = measure(mode, w, args, straggle)
                rows.append(row)
                print(f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms over {row['windows']} windows "
                      f"(over the straggler floor: p50 {row['over_floor_p50_ms']:.2f}, "
                      f"p99 {row['over_floor_p99_ms']:.2f} ms), {row['service_messages']} service messages",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{args.name}.csv", rows)
    print("\nwindow latency (ms) from a window's last element being in to its firing, NEXMark Q8, simulator")
    for straggle in settings:
        sel = [r for r in rows if r["straggler_rate"] == straggle]
        how = (f"on ({straggle}/s per worker, Pareto a={args.straggler_alpha}, min {args.straggler_min * 1000:g} ms)"
               if straggle else "off")
        print(f"stragglers {how}")
        print(f"  {'workers':>7} " + " ".join(f"{m + ' p50':>14} {m + ' p99':>14}" for m in MODES))
        for w in w_values:
            a, t = (next(r for r in sel if (r["mode"], r["workers"]) == (m, w)) for m in MODES)
            cells = " ".join(f"{r['p50_ms']:14.2f} {r['p99_ms']:14.2f}" for r in (a, t))
            ratio = a["service_messages"] / t["service_messages"]
            floor = (f"   floor p50 {t['floor_p50_ms']:.1f} / p99 {t['floor_p99_ms']:.1f} ms; over it: aligned "
                     f"{a['over_floor_p50_ms']:.1f} / {a['over_floor_p99_ms']:.1f}, trAcker "
                     f"{t['over_floor_p50_ms']:.1f} / {t['over_floor_p99_ms']:.1f} ms") if straggle else ""
            print(f"  {w:>7} {cells}   service messages aligned/tracker {ratio:.1f}x{floor}")
    _plot(rows, w_values, settings, out / f"{args.name}.png")
    print(f"\nwrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def _plot(rows, w_values, settings, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False, sharey=True)
    for ax, straggle in zip(axes[0], settings, strict=True):
        for mode in MODES:
            sel = [next(r for r in rows if (r["mode"], r["workers"], r["straggler_rate"]) == (mode, w, straggle))
                   for w in w_values]
            label = "watermarks (aligned)" if mode == "aligned" else "trAcker"
            ax.plot(w_values, [r["p50_ms"] for r in sel], marker="o", label=f"{label} p50")
            ax.plot(w_values, [r["p99_ms"] for r in sel], marker="x", linestyle="--", label=f"{label} p99")
            if straggle and mode == "tracker":
                ax.plot(w_values, [r["floor_p99_ms"] for r in sel], color="grey", linestyle=":",
                        label="straggler floor p99 (trAcker run)")
        ax.set_xlabel("workers")
        ax.set_ylabel("ms from last element in to window fired")
        ax.set_title(f"NEXMark Q8 window latency (simulator), stragglers {'on' if straggle else 'off'}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
