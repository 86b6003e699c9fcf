"""Find the slow stage: per-task throughput and backpressure (Flink's busy / backpressured / idle).

A generator feeds a map that sleeps per record (the deliberately slow stage) and a sink, at p=2,
for a few seconds on the local driver; then every task's rows in and out, rows/s and milliseconds
per second busy, backpressured and idle are printed from ``JobResult.metrics["tasks"]``. The
sources come out HIGH (held back by the map), the map's tasks busy. ``--slow source`` moves the
sleep into the source instead: then nothing waits on output and every task is OK. While it runs,
the dashboard URL it prints shows the same table live, and ``/metrics`` has it under Flink's names.

Run it:  python examples/backpressure.py [--slow map|source] [--seconds 8] [--delay 0.002]
"""

import argparse
import json
import tempfile
import time

from epochstream import FileSink, Pipeline


def build(slow: str, delay: float, out: str) -> Pipeline:
    def record(i):
        if slow == "source":
            time.sleep(delay)
        return (f"k{i % 7}", i)

    def work(r):
        if slow == "map":
            time.sleep(delay)
        return r

    p = Pipeline("backpressure", parallelism=2, checkpoint_interval=0.5, batch_rows=8)
    (p.generate(record, count=10**9, uid="gen")
      .key_by(lambda r: r[0])
      .map(work, name="slow")
      .sink(FileSink(out), uid="out"))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", choices=["map", "source"], default="map")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--delay", type=float, default=0.002, help="seconds of sleep per record in the slow stage")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="epochstream-backpressure-")
    p = build(args.slow, args.delay, f"{work}/out")
    r = p.run(deployment="local", checkpoint_dir=f"{work}/chk", duration=args.seconds,
              on_start=lambda info: print("dashboard:", info["endpoint"] + "/"))
    tasks = r.metrics["tasks"]
    if args.json:
        print(json.dumps(tasks, indent=1))
        return
    print(f"{'task':6} {'rows in':>9} {'rows out':>9} {'out/s':>8} {'busy':>6} {'backp.':>6} {'idle':>6}  level")
    for t, m in tasks.items():
        print(f"{t:6} {m['records_in']:>9} {m['records_out']:>9} {m['records_out_per_second'] or 0:>8.0f} "
              f"{m['busy_ms_per_second'] or 0:>6.0f} {m['backpressured_ms_per_second'] or 0:>6.0f} "
              f"{m['idle_ms_per_second'] or 0:>6.0f}  {m['backpressure']}")
    print("(ms per second over the last 5 s; chain 0 = generate, chain 1 = slow map -> sink)")


if __name__ == "__main__":
    main()
