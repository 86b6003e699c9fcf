"""The batching policy's trade-off: rows/s against epoch latency over ``batch_rows`` x ``batch_linger``.

Workload: ``generate_batches -> key_by("k") -> process_batches`` a running count per key
(ValueState) plus a count of calls per key, into a DiscardingSink; 100 keys (``--keys``),
local driver, 2 workers, epochs every second. For every ``batch_rows`` (rows per source read
and per full output batch) and ``batch_linger`` (seconds output may wait to fill up), one run
per repetition, interleaved. Reported: rows/s (rows / run seconds, worker start-up included),
the epochs' trigger-to-commit p50 and p99, and the mean rows a key gets per call of the
function (what a keyed pandas function sees). Committed counts are checked against the input.

Writes benchmarks/results/batching.csv and batching.png and prints a summary table. Not a
test: nothing asserts timings.

    python benchmarks/epochs/batching.py [--rows 4000000] [--batch-rows 1024,16384,65536] [--lingers 0,0.005,0.05,0.2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from epochstream import (  # noqa: E402
    CheckpointConfig,
    DiscardingSink,
    KeyedBatchFunction,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402


class CountCalls(KeyedBatchFunction):
    """A running count per key, and how many calls it took."""

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))
        self.calls = ctx.state(ValueStateDescriptor("calls", default=0))

    def process_batch(self, key, batch, ctx):
        self.count.update(self.count.value() + batch.num_rows)
        self.calls.update(self.calls.value() + 1)


def run_one(rows: int, keys: int, batch_rows: int, linger: float, interval: float) -> dict:
    def gen(start: int, stop: int):
        return pa.record_batch({"k": pa.array(np.arange(start, stop, dtype=np.int64) % keys)})

    with tempfile.TemporaryDirectory(prefix="es-batching-") as tmp:
        p = Pipeline("batching", parallelism=2, checkpoint=CheckpointConfig(interval=interval),
                     batch_rows=batch_rows, batch_linger=linger)
        (p.generate_batches(gen, count=rows, uid="src", block_rows=batch_rows)
         .key_by("k").process_batches(CountCalls(), uid="count").sink(DiscardingSink(), uid="out"))
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        seconds = time.perf_counter() - t0
        storage = LocalCheckpointStorage(Path(tmp) / "chk")
        manifest, root = storage.latest()
        state = committed_state(storage, manifest, root)["count"]
        total, calls = sum(state["count"].values()), sum(state["calls"].values())
        lat = sorted(e["trigger_to_commit_seconds"] for e in result.metrics.get("epochs", [])
                     if e.get("state") == "completed" and e.get("kind") != "final")
    if total != rows:
        raise RuntimeError(f"batch_rows={batch_rows} linger={linger}: committed counts sum to {total}, not {rows}")
    return {"batch_rows": batch_rows, "batch_linger_ms": round(linger * 1000, 1), "rows": rows, "keys": keys,
            "seconds": round(seconds, 2), "rows_per_s": round(rows / seconds), "periodic_epochs": len(lat),
            "trigger_to_commit_p50_ms": round(1000 * statistics.median(lat), 1) if lat else "",
            "trigger_to_commit_p99_ms": round(1000 * percentile(lat, 0.99), 1) if lat else "",
            "rows_per_key_call": round(rows / calls, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--batch-rows", default="1024,16384,65536")
    ap.add_argument("--lingers", default="0,0.005,0.05,0.2", help="seconds")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    plan = [(int(b), float(li)) for b in args.batch_rows.split(",") for li in args.lingers.split(",")]
    results: list[dict] = []
    for rep in range(args.repeats):
        for batch_rows, linger in plan:
            print(f"[{len(results) + 1}/{len(plan) * args.repeats}] batch_rows={batch_rows} "
                  f"linger={linger * 1000:g} ms ...", end=" ", flush=True)
            row = {**run_one(args.rows, args.keys, batch_rows, linger, args.interval), "repeat": rep + 1}
            results.append(row)
            print(f"{row['rows_per_s']:,} rows/s, epoch p50 {row['trigger_to_commit_p50_ms']} ms, "
                  f"{row['rows_per_key_call']} rows per key per call")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "batching.csv", results)
    print(f"\n{'batch_rows':>10} {'linger ms':>9} {'rows/s':>11} {'epoch p50 ms':>12} {'epoch p99 ms':>12} "
          f"{'rows/key/call':>13}")
    med = {}
    for batch_rows, linger in plan:
        rs = [r for r in results if (r["batch_rows"], r["batch_linger_ms"]) == (batch_rows, round(linger * 1000, 1))]
        m = {k: statistics.median(r[k] for r in rs if r[k] != "") if any(r[k] != "" for r in rs) else float("nan")
             for k in ("rows_per_s", "trigger_to_commit_p50_ms", "trigger_to_commit_p99_ms", "rows_per_key_call")}
        med[(batch_rows, linger)] = m
        print(f"{batch_rows:>10} {linger * 1000:>9g} {m['rows_per_s']:>11,.0f} {m['trigger_to_commit_p50_ms']:>12.1f} "
              f"{m['trigger_to_commit_p99_ms']:>12.1f} {m['rows_per_key_call']:>13.1f}")
    _plot(med, out / "batching.png")
    print(f"\nwrote {out / 'batching.csv'} and {out / 'batching.png'}")


def _plot(med: dict, path: Path) -> None:
    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for batch_rows in sorted({b for b, _ in med}):
        lingers = sorted(li for b, li in med if b == batch_rows)
        ms = [li * 1000 for li in lingers]
        ax.plot(ms, [med[(batch_rows, li)]["rows_per_s"] / 1e6 for li in lingers], marker="o",
                label=f"batch_rows {batch_rows}")
        ax2.plot(ms, [med[(batch_rows, li)]["trigger_to_commit_p99_ms"] for li in lingers], marker="o",
                 label=f"batch_rows {batch_rows}")
    ax.set_xlabel("batch_linger (ms)")
    ax.set_ylabel("million rows / s")
    ax.set_title("keyed process_batches count, 2 workers")
    ax2.set_xlabel("batch_linger (ms)")
    ax2.set_ylabel("epoch trigger-to-commit p99 (ms)")
    ax2.set_title("1 s epochs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
