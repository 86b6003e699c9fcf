"""Sustainable throughput by tracking granularity (paper 000 §5.4, Figure 13b), on the simulator or the local driver.

RR-N (a source, N identity maps each repartitioned round-robin by key, a sink; one record per
batch) on W workers whose tasks share ``--cores`` cores each, fed at a fixed input rate. Every
record carries the virtual time it was read; the last map records its source-to-sink latency.
The paper calls a rate sustainable until "the median latency starts to grow": past it, input
queues and latency grows for as long as the run lasts. Here a run at a fixed rate is sustained
when the median latency of its last third of records is at most ``--growth`` times that of its
middle third (latency does not grow over the run; the first third is warm-up) and its median is at most ``--saturated``
times the setup's median at its lowest rate (a queue that filled at once); a run whose latency passes ``--cut`` seconds
is stopped as overloaded (the simulator would otherwise queue records forever), and a setup's
sweep stops at its first rate that is not sustained: higher rates only queue more. The
*sustainable throughput* of a setup is its highest sustained rate.

The sources must also read at least ``--read-rate`` (0.9) of the offered rate: a source waits for a
free core like every task, so an overloaded job reads slower and its records' latency, counted from
their reading, need not grow.

In trAcker mode a run must also keep up with its epochs: the median time from an epoch's trigger to its bound
at the last task may not grow either (with ``--pass-through`` records flow while the tracking falls behind, so
the record latency alone would not show an overloaded agent).

On the simulator a run must also catch up with its input within ``--drain`` (1.2) times the input time
(``drain_ratio`` in the CSV): its last record reaches the probe, and every epoch triggered while the sources
were still reading is bound at its last task, by then. Epochs that fall behind the input and drain after it
pass the growth rules (the empty epochs cut after the input close fast) but not this one. The job's final
epoch, triggered once the input is exhausted, is left out: it is the end-of-job commit (about 70 ms for a
marker wave across RR-30), not a backlog, and counting it (the job's whole virtual time) would fail no
tracking at every rate.

Batching (``--batched``, or each flag alone): promises ride the local trackers' timed flush
(``TrackerConfig.flush_on_promise=False``), stateless chains and the sink pass later epochs through
(``TrackerConfig.pass_through``: only stateful chains wait for NEOSS), and NEOSS to a worker coalesce on
the wire (``SimConfig.coalesce_neoss``): FlameStream's LocalAcker, maps and output barrier.

Setups, as in the paper: no tracking (no epochs at all), the trAcker at granularity 1 (an epoch
per record, aggregated local trackers) and markers (barrier alignment) at granularity 1, 10 and
50 records per epoch. Granularity g cuts an epoch every g records of the whole job.

The cost model, stated because the result depends on it: every task step (one record, or one
marker: punctuations travel the data channels and cost a step at every task they reach) costs
the measured wall time of epochstream's own ``Task.step``, and so does every marker a task takes
(``SimConfig.marker_cost``); the trAcker costs its tasks the
measured time of a local tracker's SND/RCV event, and its single agent the measured time per
report or promise it folds. All three are measured at start in this process as CPU time
(``--costs`` sets them instead; they are printed and in the CSV). Network:
exponential one-way delay, mean 0.5 ms between workers.

Paper (FlameStream, RR-30, 20 nodes of 2 cores): no tracking ~9K items/s, finest trAcker ~7K,
markers finest < 1K, granularity 10 ~2K, granularity 50 ~5K. The shape to reproduce: the
trAcker's finest setting keeps >= 0.75x of no tracking, markers at granularity 1 < 0.15x.

``--driver local`` runs the same on the local driver: ``--workers`` (default 2) real worker processes
for ``--seconds`` (default 8) of wall time per run, a paced source stamping each record with the host's
monotonic clock (snapshot_spikes' ``StampedPaced``), the last map appending every latency to a file
of its process (``FileProbe``), epochs every ``granularity / rate`` seconds. Real costs, no
calibration; the load average is in every row.

Writes benchmarks/results/sustainable_throughput.csv (every run) and .png (median latency by
input rate per setup) and prints the sustainable rates with their ratios. Not a test.

    python benchmarks/paper/sustainable_throughput.py [--quick] [--graph-size 30] [--workers 20] [--driver local]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, read_csv, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, JobFailedError, Pipeline, TrackerConfig  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.sim import SimConfig, SimDriver  # noqa: E402

#: (label, mode, granularity): granularity None = no epochs
SETUPS = (("no tracking", "aligned", None), ("trAcker g=1", "tracker", 1),
          ("markers g=1", "aligned", 1), ("markers g=10", "aligned", 10), ("markers g=50", "aligned", 50))


class Overloaded(Exception):
    """Raised from the latency probe: the run's latency has left the sustainable range."""


class Clock:
    """The running simulator's virtual clock, for the records' timestamps (one process)."""

    driver: SimDriver | None = None

    def now(self) -> float:
        assert self.driver is not None
        return self.driver.now


class Stamp:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __call__(self, i: int) -> tuple[int, float]:
        return (i, self.clock.now())


class Probe:
    """The last map: source-to-sink latency of every record, in virtual seconds."""

    def __init__(self, clock: Clock, limit: float | None) -> None:
        self.clock, self.limit = clock, limit
        self.latencies: list[float] = []
        self.read_at: list[float] = []

    def __call__(self, r: tuple[int, float]) -> tuple[int, float]:
        lat = self.clock.now() - r[1]
        self.latencies.append(lat)
        self.read_at.append(r[1])
        if self.limit is not None and lat > self.limit:
            raise Overloaded(f"latency {lat * 1000:.1f} ms")
        return r


def _key(r: tuple[int, float]) -> int:
    return r[0]


def _identity(r):
    return r


@dataclass(frozen=True)
class Costs:
    """CPU seconds the simulator charges (see the module docstring)."""

    step: float = 5e-6  # a task step on one record (batch of 1)
    report: float = 0.0  # a SND/RCV event at a local tracker
    agent: float = 0.0  # one report or promise folded by the agent


@dataclass(frozen=True)
class Batching:
    """How the trAcker batches (see the module docstring): the local trackers' flush interval,
    whether a promise flushes at once, whether NEOSS to a worker coalesce on the wire."""

    flush_interval: float = 0.005
    flush_on_promise: bool = True
    coalesce_neoss: bool = False
    pass_through: bool = False
    #: pass-through chains tracked as one segment (``TrackerConfig.merge_pass_through``)
    merge_segments: bool = True


def _rr_pipeline(name: str, workers: int, mode: str, interval: float | None, batching: "Batching") -> Pipeline:
    """The RR-N job's settings, shared by the simulator and the local driver: one record per batch,
    no restarts, epochs every ``interval`` seconds, the tracker's batching as given."""
    return Pipeline(name, parallelism=workers, mode=mode, batch_size=1, restart_attempts=0,
                    checkpoint=CheckpointConfig(interval=interval, max_concurrent=1_000_000, num_retained=1),
                    tracker=TrackerConfig(aggregate=True, flush_interval=batching.flush_interval, flush_count=1000,
                                          flush_on_promise=batching.flush_on_promise,
                                          pass_through=batching.pass_through,
                                          merge_pass_through=batching.merge_segments))


def run(n_maps: int, workers: int, cores: int, rate: float, records: int, mode: str, granularity: int | None,
        costs: Costs, limit: float | None, batching: Batching = Batching()) -> dict:
    """One run at ``rate`` records/s for the whole job."""
    clock = Clock()
    probe = Probe(clock, limit)
    interval = None if granularity is None else granularity / rate
    p = _rr_pipeline(f"rr-{n_maps}", workers, mode, interval, batching)
    s = p.generate(Stamp(clock), count=records, uid="src")
    for k in range(n_maps - 1):
        s = s.key_by(_key).map(_identity, name=f"map{k}")
    s.key_by(_key).map(probe, name="probe").sink(DiscardingSink(), uid="sink")
    cfg = SimConfig(source_rate=rate / workers, source_batch=1, check_invariants=False, worker_cores=cores,
                    message_cost=costs.step, record_cost=0.0, report_cost=costs.report, agent_cost=costs.agent,
                    marker_cost=costs.step if granularity is not None and mode == "aligned" else 0.0,
                    coalesce_neoss=batching.coalesce_neoss)
    t0 = time.perf_counter()
    overloaded = False
    with tempfile.TemporaryDirectory(prefix="es-sustain-") as chk:
        driver = SimDriver(p, LocalCheckpointStorage(chk), seed=1, config=cfg)
        clock.driver = driver
        try:
            driver.run(None, False, None)
        except (JobFailedError, Overloaded):
            overloaded = True
    # the epochs' side: seconds from an epoch's trigger to its bound at the last task (pass-through lets
    # records flow while the tracking falls behind, so the record latency alone would not show it)
    ends: dict[int, float] = {}
    for epoch, _task, secs in driver.bound_latency:
        ends[epoch] = max(ends.get(epoch, 0.0), secs)
    input_s = records / rate
    return {"rate": rate, **_verdict(probe.latencies, [ends[e] for e in sorted(ends)], probe.read_at, rate),
            "overloaded": overloaded,
            "input_s": round(input_s, 4), "virtual_s": round(driver.now, 4),
            "drain_ratio": round(_drained(probe, ends, driver.controller) / input_s, 3),
            "wall_s": round(time.perf_counter() - t0, 2)}


def _drained(probe: "Probe", ends: dict[int, float], controller) -> float:
    """When the run caught up with its input: its last record reached the probe and every epoch
    triggered while the sources were still reading was bound at its last task. The job's final
    epoch (triggered once the input is exhausted: the end-of-job commit, a marker wave of about
    70 ms across RR-30) is not a backlog and is left out; so is everything after the bounds."""
    if not probe.read_at:
        return float("inf")
    last_read = max(probe.read_at)
    done = max(r + lat for r, lat in zip(probe.read_at, probe.latencies, strict=True))
    triggered = controller.triggered_at if controller is not None else {}
    for epoch, secs in ends.items():
        at = triggered.get(epoch)
        if at is not None and at < last_read:
            done = max(done, at + secs)
    return done


def is_sustained(row: dict, mode: str, base: float, args: argparse.Namespace) -> bool:
    """The rules of a sustained rate (module docstring), on one run's row. ``base`` is the setup's
    median at its lowest rate. On the simulator the run must also catch up with its input (its last
    record done, the epochs triggered during the input bound: ``_drained``) within ``args.drain``
    times the input time: a tracking backlog that drains only after the input (pass-through records
    flowing while the epochs fall behind) shows there, not as latency growth."""
    drain = row.get("drain_ratio", "")
    return (not row["overloaded"] and row["growth"] <= args.growth
            and row["read_ratio"] >= args.read_rate
            and row["p50_ms"] <= args.saturated * base
            and (mode != "tracker" or row["bound_growth"] <= args.growth)
            and (drain == "" or drain <= args.drain))


def _verdict(seen: list[float], bounds: list[float], read_at: list[float], rate: float) -> dict:
    """Median latencies and their growth over a run: of the records (in the order read) and of the epochs;
    and the rate the sources managed to read at, over the offered one (a source waits for a free core, so
    an overloaded job reads slower and its records' latency, from their reading, need not grow)."""
    span = max(read_at) - min(read_at) if len(read_at) > 1 else 0.0
    lat = sorted(seen) or [float("inf")]
    third = max(1, len(seen) // 3)  # the first third warms up (no epoch has been cut yet): middle against last
    growth = (statistics.median(seen[-third:]) / statistics.median(seen[third:2 * third] or seen)
              if seen else float("inf"))
    b3 = max(1, len(bounds) // 3)
    bound_growth = (statistics.median(bounds[-b3:]) / max(1e-9, statistics.median(bounds[b3:2 * b3] or bounds))
                    if bounds else 0.0)
    return {"records_done": len(seen), "read_ratio": round(len(read_at) / (span * rate), 3) if span else 0.0,
            "growth": round(growth, 3), "epochs": len(bounds),
            "bound_p50_ms": statistics.median(bounds) * 1000 if bounds else 0.0, "bound_growth": round(bound_growth, 3),
            "p50_ms": statistics.median(lat) * 1000, "p99_ms": percentile(lat, 0.99) * 1000}


class FileProbe:
    """The last map on the local driver: appends each record's read time and source-to-sink latency
    (host monotonic clock) to a file of its worker process, line by line, so a stopped run keeps them."""

    def __init__(self, folder: str) -> None:
        self.folder, self._out = folder, None

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "_out": None}

    def __call__(self, r: tuple[int, float]) -> tuple[int, float]:
        if self._out is None:
            self._out = open(os.path.join(self.folder, f"probe-{os.getpid()}.txt"), "a", buffering=1)
        self._out.write(f"{r[1]!r} {time.monotonic() - r[1]!r}\n")
        return r


def run_local(n_maps: int, workers: int, rate: float, seconds: float, mode: str, granularity: int | None,
              batching: Batching) -> dict:
    """One run on the local driver (real worker processes) for ``seconds`` of wall time at ``rate``
    records/s for the whole job (snapshot_spikes' paced source); epochs every ``granularity / rate`` s.
    The epochs' side is, as on the simulator, an epoch's trigger to its bound at the last task; the
    median trigger-to-commit time is in the row too."""
    from benchmarks.paper.snapshot_spikes import StampedPaced
    from epochstream.deploy.local import LocalDriver

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="es-sustain-local-") as tmp:
        interval = None if granularity is None else granularity / rate
        p = _rr_pipeline(f"rr-{n_maps}-local", workers, mode, interval, batching)
        s = p.from_source(StampedPaced(rate / workers, workers), uid="src")
        for k in range(n_maps - 1):
            s = s.key_by(_key).map(_identity, name=f"map{k}")
        s.key_by(_key).map(FileProbe(tmp), name="probe").sink(DiscardingSink(), uid="sink")
        driver = LocalDriver(p, LocalCheckpointStorage(os.path.join(tmp, "chk")), seed=1, rest=False)
        driver.run(None, False, seconds)
        log = sorted(tuple(map(float, line.split())) for f in Path(tmp).glob("probe-*.txt")
                     for line in f.read_text().splitlines() if line.count(" ") == 1)
        assert driver.master is not None
        commits = [e["complete_seconds"] for e in driver.master.coordinator.stats()
                   if e["complete_seconds"] is not None and e["kind"] != "final"]
    ends: dict[int, float] = {}
    for epoch, _task, secs in driver.bound_latency:
        ends[epoch] = max(ends.get(epoch, 0.0), secs)
    return {"rate": rate, **_verdict([lat for _t, lat in log], [ends[e] for e in sorted(ends)],
                                     [t for t, _lat in log], rate),
            "commit_p50_ms": statistics.median(commits) * 1000 if commits else 0.0, "overloaded": False,
            "input_s": seconds, "virtual_s": "", "wall_s": round(time.perf_counter() - t0, 2),
            "load_1min": round(os.getloadavg()[0], 1)}


def calibrate(batching: Batching = Batching()) -> Costs:
    """This machine's costs, measured now in this process as CPU time (so other processes' load
    does not inflate them): a task step
    on one record (wall time of ``Task.step`` over a small job without tracking), a local
    tracker's SND event (timeit), and the agent's time per report folded (over a small
    tracker-mode job)."""
    from epochstream.runtime.task import Task
    from epochstream.tracker import agent as agent_mod
    from epochstream.tracker.local import LocalTracker

    def timing(cls, name: str, weight):
        real, spent = getattr(cls, name), [0.0, 0]

        def timed(self, *a, **kw):
            t0 = time.thread_time()
            try:
                return real(self, *a, **kw)
            finally:
                spent[0] += time.thread_time() - t0
                spent[1] += weight(a)

        setattr(cls, name, timed)
        return real, spent

    real, steps = timing(Task, "step", lambda a: 1)
    try:
        run(10, 5, 2, 2000.0, 2000, "aligned", None, Costs(), None)
    finally:
        Task.step = real  # type: ignore[method-assign]
    tr = LocalTracker("w0", aggregate=True, flush_interval=None, flush_count=1_000_000)
    report = timeit.Timer(lambda: tr.snd(12345, 1, 0), timer=time.thread_time).timeit(100_000) / 100_000
    real, folded = timing(agent_mod.TrackingAgent, "receive", lambda a: max(1, len(a[0].reports) + len(a[0].promises)))
    try:
        run(10, 5, 2, 2000.0, 300, "tracker", 1, Costs(), None, batching)  # messages as big as the runs
    finally:
        agent_mod.TrackingAgent.receive = real  # type: ignore[method-assign]
    return Costs(step=steps[0] / max(1, steps[1]), report=report, agent=folded[0] / max(1, folded[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph-size", type=int, default=30, help="N of RR-N (paper: 30)")
    ap.add_argument("--driver", choices=("sim", "local"), default="sim",
                    help="sim: the simulator; local: real worker processes on this machine (wall time)")
    ap.add_argument("--workers", type=int, default=None, help="nodes (paper: 20; default 20 sim, 2 local)")
    ap.add_argument("--cores", type=int, default=2, help="cores per node (paper: dual-core VMs)")
    ap.add_argument("--rates", default="", help="comma-separated input rates (records/s, whole job)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="sim: virtual seconds of input per run (records = rate x seconds, at least --min-records; "
                         "default 0.05); local: wall seconds per run (default 8)")
    ap.add_argument("--min-records", type=int, default=600)
    ap.add_argument("--growth", type=float, default=1.5,
                    help="sustained: median of the last third of records within this x that of the middle third")
    ap.add_argument("--cut", type=float, default=0.5, help="stop a run once a record's latency passes this (s)")
    ap.add_argument("--read-rate", type=float, default=0.9,
                    help="not sustained either: the sources read below this fraction of the offered rate")
    ap.add_argument("--drain", type=float, default=1.2,
                    help="not sustained either (simulator): the last record and the epochs triggered during the "
                         "input are done only after this x the input time (the tracking drains after the input)")
    ap.add_argument("--saturated", type=float, default=10.0,
                    help="not sustained either: a median above this x the setup's median at its lowest rate")
    ap.add_argument("--costs", default="measured",
                    help="'measured' (calibrated now), or step,report,agent in microseconds (e.g. 5,0.5,20)")
    ap.add_argument("--flush-interval", type=float, default=0.005,
                    help="trAcker: the local trackers' flush interval in seconds (FlameStream: 5 ms)")
    ap.add_argument("--promise-timer", action="store_true",
                    help="trAcker: a promise waits for the next timed flush (FlameStream's heartbeats) instead of "
                         "flushing its local tracker at once")
    ap.add_argument("--coalesce-neoss", action="store_true",
                    help="trAcker: NEOSS to a worker join its bundle still on the wire (one message per worker in "
                         "flight)")
    ap.add_argument("--pass-through", action="store_true",
                    help="trAcker: stateless maps process later epochs at once (only the sink's chain waits for "
                         "NEOSS), as FlameStream's maps do")
    ap.add_argument("--no-merge-segments", action="store_true",
                    help="trAcker with --pass-through: one segment per map (default: "
                         "neighbouring pass-through chains are one segment, so a hop's RCV and SND fold)")
    ap.add_argument("--batched", action="store_true",
                    help="trAcker: FlameStream's batching, all three: --promise-timer --coalesce-neoss --pass-through")
    ap.add_argument("--merge", default="", help="run nothing: comma-separated CSVs of earlier runs, written as "
                                                "one CSV and PNG (--name) with the summary")
    ap.add_argument("--keep-going", action="store_true",
                    help="run every rate, also after the first one that is not sustained (the table of medians)")
    ap.add_argument("--quick", action="store_true", help="RR-10 on 5 workers, fewer rates and records")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sustainable_throughput", help="file name of the CSV and PNG, without suffix")
    ap.add_argument("--setups", default="", help="comma-separated setup labels to run (default: all), e.g. "
                                                  "'no tracking,markers g=10'")
    args = ap.parse_args(argv)
    local = args.driver == "local"
    args.workers = args.workers or (2 if local else 20)
    args.seconds = args.seconds or (8.0 if local else 0.05)
    if args.quick:
        args.graph_size, args.workers = 10, 5
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    else:
        steps = (500, 2000, 8000, 32000, 128000, 512000) if args.quick else (
            250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000, 512000)
        rates = [float(r) for r in steps]
    if args.batched:
        args.promise_timer = args.coalesce_neoss = args.pass_through = True
    batching = Batching(args.flush_interval, not args.promise_timer, args.coalesce_neoss, args.pass_through,
                        not args.no_merge_segments)
    if local or args.merge:  # real costs, or none run
        costs = Costs(0.0)
    elif args.costs == "measured":
        costs = calibrate(batching)
    else:
        step, report, agent = (float(x) * 1e-6 for x in args.costs.split(","))
        costs = Costs(step, report, agent)
    if local:
        print(f"RR-{args.graph_size} on the local driver, {args.workers} worker processes, {args.seconds:g} s per run; "
              f"real costs; load {os.getloadavg()}", flush=True)
    else:
        print(f"RR-{args.graph_size}, {args.workers} workers x {args.cores} cores; costs: {costs.step * 1e6:.2f} us "
              f"per task step, trAcker {costs.report * 1e6:.2f} us per SND/RCV event and "
              f"{costs.agent * 1e6:.2f} us per report at the agent", flush=True)
    print(f"trAcker batching: flush every {batching.flush_interval * 1000:g} ms, promises "
          f"{'at once' if batching.flush_on_promise else 'on the timer'}, NEOSS "
          f"{'coalesced per worker' if batching.coalesce_neoss else 'one bundle per agent step'}, maps "
          f"{'pass later epochs through' if batching.pass_through else 'hold later epochs'}"
          f"{', in one segment' if batching.pass_through and batching.merge_segments else ''}", flush=True)
    setups = [s for s in SETUPS if not args.setups or s[0] in args.setups.split(",")]
    rows: list[dict] = []
    if args.merge:  # a sweep split into several (locked) runs: their CSVs as one table and figure
        for path in args.merge.split(","):
            rows += [{**r, "rate": float(r["rate"]), "p50_ms": float(r["p50_ms"]),
                      "sustained": r["sustained"] == "True"} for r in read_csv(path)]
        for r in rows:  # one setup run with several flush intervals: one line per interval
            flushes = {x.get("flush_ms", "") for x in rows if x["setup"] == r["setup"]}
            if len(flushes) > 1:
                r["setup_run"] = f"{r['setup']}, {float(r['flush_ms']):g} ms flush"
        split = [(lab, m, g) for lab, m, g in setups for lab in
                 dict.fromkeys(r.get("setup_run", r["setup"]) for r in rows if r["setup"] == lab)]
        for r in rows:
            r["setup"] = r.pop("setup_run", r["setup"])
        setups, rates = split, []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total, k = len(setups) * len(rates), 0
    for label, mode, g in setups:
        base = None
        for rate in rates:
            k += 1
            print(f"[{k}/{total}] {label} at {rate:g}/s ...", end=" ", flush=True)
            records = max(args.min_records, int(rate * args.seconds))
            tracked = costs if mode == "tracker" else Costs(step=costs.step)
            if local:
                row = run_local(args.graph_size, args.workers, rate, args.seconds, mode, g, batching)
            else:
                row = run(args.graph_size, args.workers, args.cores, rate, records, mode, g, tracked, args.cut,
                          batching)
            row = {"setup": label, "driver": args.driver, "mode": mode, "granularity": g or 0,
                   "graph_size": args.graph_size,
                   "workers": args.workers, "cores": args.cores, "step_us": costs.step * 1e6,
                   "report_us": tracked.report * 1e6, "agent_us": tracked.agent * 1e6,
                   "flush_ms": batching.flush_interval * 1000 if mode == "tracker" else "",
                   "promise_timer": (not batching.flush_on_promise) if mode == "tracker" else "",
                   "coalesce_neoss": batching.coalesce_neoss if mode == "tracker" else "",
                   "pass_through": batching.pass_through if mode == "tracker" else "",
                   "merged_segments": batching.pass_through and batching.merge_segments if mode == "tracker" else "",
                   **row}
            base = row["p50_ms"] if base is None else base
            # a queue that filled at once does not grow over the run: a median far above the setup's
            # own at its lowest rate is overload too
            row.setdefault("drain_ratio", "")  # the local driver: no virtual time
            row["drain_limit"] = args.drain
            row["sustained"] = is_sustained(row, mode, base, args)
            rows.append(row)
            print(f"p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms, latency x{row['growth']:.2f} over the run, "
                  f"read at {row['read_ratio']:.2f}x the rate, "
                  f"epoch bound p50 {row['bound_p50_ms']:.2f} ms x{row['bound_growth']:.2f}, "
                  f"{row['records_done']} records, {row['epochs']} epochs, "
                  f"{row['virtual_s'] or row['input_s']} s for {row['input_s']} s of input"
                  f"{', caught up at x' + str(row['drain_ratio']) + ' of it' if row['drain_ratio'] != '' else ''}"
                  f"{'' if row['sustained'] else ': not sustained'}"
                  f"{' (overloaded, cut short)' if row['overloaded'] else ''} [{row['wall_s']}s"
                  f"{', load ' + str(row['load_1min']) if local else ''}]")
            _write_csv(rows, out / f"{args.name}.csv")  # after every run: a run cut short keeps the rows before it
            if not row["sustained"] and not args.keep_going:  # higher rates only queue more
                k += len(rates) - rates.index(rate) - 1
                break
    _write_csv(rows, out / f"{args.name}.csv")
    sustained = {}
    for label, _m, _g in setups:  # the highest rate below which every rate was sustained
        sustained[label] = 0.0
        for r in rows:
            if r["setup"] == label:
                if not r["sustained"]:
                    break
                sustained[label] = r["rate"]
    ref = sustained.get("no tracking") or float("nan")
    print(f"\nsustainable throughput (latency grows at most {args.growth}x over a run, median within "
          f"{args.saturated:g}x the lowest rate's, sources read >= {args.read_rate:g}x the rate"
          f"{'' if local else f', input caught up (records and its epochs bound) by {args.drain:g}x its time'}), "
          f"{'local driver' if local else 'simulator'}")
    print(f"  {'setup':<14} {'records/s':>10} {'x no tracking':>14}")
    for label, _m, _g in setups:
        print(f"  {label:<14} {sustained[label]:>10g} {sustained[label] / ref:>14.2f}")
    print("  targets: trAcker g=1 >= 0.75x, markers g=1 < 0.15x (paper: 7K/9K = 0.78x, <1K/9K < 0.11x)")
    _plot(rows, out / f"{args.name}.png", args)
    print(f"\nwrote {out / (args.name + '.csv')} and {out / (args.name + '.png')}")
    return 0


def _write_csv(rows: list[dict], path: Path) -> None:
    write_csv(path, rows, list(dict.fromkeys(k for r in rows for k in r)))


def _plot(rows, path: Path, args) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["setup"] for r in rows):
        sel = [r for r in rows if r["setup"] == label]
        ax.plot([r["rate"] for r in sel], [r["p50_ms"] for r in sel], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("input rate (records/s, whole job)")
    ax.set_ylabel("median source-to-sink latency (ms)")
    where = "local driver" if args.driver == "local" else f"{args.cores} cores each, simulator"
    ax.set_title(f"RR-{args.graph_size}, {args.workers} workers ({where})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
