"""Liveness: time from freezing a worker (SIGSTOP) to the job's failover, on the local driver.

Workload: an unbounded generated source -> key_by -> a keyed running count -> a discarding
sink, parallelism 2, checkpoint interval 0.1 s, run for a fixed duration. The driver freezes
one random worker ``--freezes`` times (chaos target ``freeze``: SIGSTOP, the process stays
alive but silent), at most once per attempt, spaced so each freeze lands in a running
attempt. Each freeze must be found by the heartbeat timeout (``--timeout``, default the
product default of 10 s; ``--interval`` between heartbeats, default 1 s), fail the job over
and restart it from the latest checkpoint.

Measured per freeze, on the driver's clock: freeze -> failover (the heartbeat timeout plus
detection lag) and failover -> every worker ready again. Writes
benchmarks/results/freeze_failover.csv (one row per freeze) and freeze_failover.png; prints
p50 and max. Not a test: timings vary with the machine and its load.

    python benchmarks/failures/freeze_failover.py [--freezes 10] [--timeout 10] [--interval 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    KeyedProcessFunction,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.deploy.liveness import HeartbeatConfig  # noqa: E402
from epochstream.deploy.sim import FailureSchedule  # noqa: E402


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))

    def process(self, value, ctx):
        self.n.update(self.n.value() + 1)
        return ((ctx.key, self.n.value()),)


def build(interval: float, timeout: float) -> Pipeline:
    p = Pipeline("freeze-failover", parallelism=2, batch_size=256, restart_attempts=1000, restart_delay=0.1,
                 checkpoint=CheckpointConfig(interval=0.1, timeout=600.0),
                 heartbeat=HeartbeatConfig(interval=interval, timeout=timeout))
    (p.generate(lambda i: (i % 64, i), count=None, uid="gen")
     .key_by(lambda r: r[0]).process(Count(), uid="count").sink(DiscardingSink(), uid="out"))
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--freezes", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=10.0, help="heartbeat timeout, seconds (default 10)")
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, seconds (default 1)")
    ap.add_argument("--out", default=str(RESULTS / "freeze_failover"))
    args = ap.parse_args(argv)
    gap = args.timeout + 4.0  # detection + restart + a running attempt before the next freeze
    kill_times = [2.0 + i * gap for i in range(args.freezes)]
    duration = kill_times[-1] + gap
    failures = FailureSchedule(kill_times=kill_times, kill_targets=["freeze"] * args.freezes)
    with tempfile.TemporaryDirectory(prefix="freeze-") as work:
        result = build(args.interval, args.timeout).run(deployment="local", checkpoint_dir=work, failures=failures,
                                                        duration=duration, seed=1)
    kills, failovers = result.metrics["kills"], result.metrics["failovers"]
    recoveries = result.metrics.get("recovery_seconds", [])
    rows = []
    for i, (k, f) in enumerate(zip(kills, failovers, strict=False)):
        rows.append({"freeze": i + 1, "worker": k["worker"], "frozen_at": round(k["time"], 3),
                     "failover_at": round(f["time"], 3), "freeze_to_failover_s": round(f["time"] - k["time"], 3),
                     "recovery_s": round(recoveries[i], 3) if i < len(recoveries) else "",
                     "reason": f["reason"].splitlines()[0]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows, list(rows[0]) if rows else ["freeze"])
    lags = [r["freeze_to_failover_s"] for r in rows]
    if lags:
        plt = pyplot()

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar([r["freeze"] for r in rows], lags, color="tab:blue")
        ax.axhline(args.timeout, color="tab:red", linestyle="--", label=f"heartbeat timeout {args.timeout:g} s")
        ax.set_xlabel("freeze")
        ax.set_ylabel("freeze -> failover (s)")
        ax.set_title(f"SIGSTOP of a worker, local driver, heartbeat every {args.interval:g} s")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"{'freezes':>8} {'detected':>8} {'timeout s':>9} {'p50 s':>7} {'max s':>7} {'recovery p50 s':>14} "
          f"{'restarts':>8}")
    rec = [r["recovery_s"] for r in rows if r["recovery_s"] != ""]
    print(f"{args.freezes:>8} {len(lags):>8} {args.timeout:>9g} "
          f"{statistics.median(lags) if lags else float('nan'):>7.2f} {max(lags) if lags else float('nan'):>7.2f} "
          f"{statistics.median(rec) if rec else float('nan'):>14.2f} {result.restarts:>8}")
    ok = len(lags) == args.freezes and all("no heartbeat" in r["reason"] for r in rows)
    if not ok:
        print("not every freeze was detected by the heartbeat timeout:", [r["reason"] for r in rows], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
