"""Epochs under backpressure: aligned markers wait behind the queue, unaligned ones overtake it.

A generator feeds a keyed running count that sleeps per record (the slow stage) and a sink, at
p=2 on the local driver. Records queue in front of the slow count, so in aligned mode a marker
waits behind the queue before the task can snapshot; in unaligned mode it overtakes the queue
and the queued records are stored with the snapshot as channel state. Per completed epoch the
script prints trigger-to-manifest seconds, the longest alignment, and the channel state.

Run it:  python examples/unaligned_epochs.py [--mode aligned|unaligned|timeout] [--seconds 4]
(``timeout``: mode aligned with ``aligned_timeout=0.05``, switching to unaligned when aligning
takes longer)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from epochstream import FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor


class SlowCount(KeyedProcessFunction):
    """Running count per key, ``delay`` seconds per record."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, record, ctx):
        time.sleep(self.delay)
        n = self.count.value() + 1
        self.count.update(n)
        yield (ctx.key, n)


def build(mode: str, delay: float, out: str) -> Pipeline:
    p = Pipeline("unaligned-epochs", parallelism=2, mode="aligned" if mode == "timeout" else mode,
                 checkpoint_interval=0.2, batch_rows=8, aligned_timeout=0.05 if mode == "timeout" else None)
    (p.generate(lambda i: (f"k{i % 11}", i), count=10**9, uid="gen")
      .key_by(lambda r: r[0])
      .process(SlowCount(delay), uid="count")
      .sink(FileSink(out), uid="out"))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["aligned", "unaligned", "timeout"], default="unaligned")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--delay", type=float, default=0.0005, help="seconds of sleep per record in the count")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="epochstream-unaligned-")
    r = build(args.mode, args.delay, f"{work}/out").run(deployment="local", checkpoint_dir=f"{work}/chk",
                                                         duration=args.seconds)
    epochs = [{k: e.get(k) for k in ("epoch", "kind", "trigger_to_manifest_seconds", "alignment_seconds_max",
                                     "channel_state_records", "channel_state_bytes")}
              for e in r.metrics["epochs"] if e.get("state") == "completed"]
    if args.json:
        print(json.dumps(epochs, indent=1))
        return
    print(f"mode {args.mode}: {len(epochs)} epochs completed")
    print(f"{'epoch':>5} {'kind':10} {'trigger->manifest s':>19} {'align s':>8} {'ch. records':>11} {'ch. bytes':>9}")
    for e in epochs:
        print(f"{e['epoch']:>5} {e['kind']:10} {e['trigger_to_manifest_seconds'] or 0:>19.3f} "
              f"{e['alignment_seconds_max'] or 0:>8.3f} {e['channel_state_records'] or 0:>11} "
              f"{e['channel_state_bytes'] or 0:>9}")


if __name__ == "__main__":
    main()
