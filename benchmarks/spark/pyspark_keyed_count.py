"""Spark's own keyed count through ``apply_in_pandas_with_state``, rows against Arrow batches.

The function is Spark's, unchanged. Local driver, parallelism 2, 1 s epochs, a
DiscardingSink; the input is ``{"id": i, "k": i % keys}``, read either as dict rows
(``generate``: the chain hands the wrapper rows, which it groups in Python) or as Arrow
batches (``generate_batches``: the wrapper groups each batch with Arrow kernels). Every
combination of layout, key count and batch size (rows per source read) runs once per
repetition, interleaved. Throughput = rows / run seconds (worker start-up included); epoch
latency = trigger-to-commit seconds. The committed counts are checked against the input.

Writes benchmarks/results/pyspark_keyed_count.csv and .png and prints a summary table. Not a
test: nothing asserts timings.

    python benchmarks/spark/pyspark_keyed_count.py [--rows 2000000] [--keys 100,10000] [--batch-sizes 1024,65536]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.state import GroupStateTimeout

from epochstream import CheckpointConfig, DiscardingSink, Pipeline
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.oracle import committed_state

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402


def count(key, pdfs, state):
    c = state.get[0] if state.exists else 0
    for pdf in pdfs:
        c += len(pdf)
    state.update((c,))
    yield pd.DataFrame({"k": [key[0]], "c": [c]})


def run_one(rows: int, keys: int, batch_size: int, layout: str, interval: float) -> dict:
    def events(start: int, stop: int):
        ids = pa.array(range(start, stop), pa.int64())
        return pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys))})

    with tempfile.TemporaryDirectory(prefix="es-keyed-count-") as tmp:
        p = Pipeline("keyed-count", parallelism=2, max_parallelism=128,
                     checkpoint=CheckpointConfig(interval=interval), batch_size=batch_size)
        if layout == "arrow":
            src = p.generate_batches(events, count=rows, num_splits=2, uid="events")
        else:
            src = p.generate(lambda i: {"id": i, "k": i % keys}, count=rows, uid="events")
        (src.apply_in_pandas_with_state(count, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout,
                                        key="k", uid="count")
            .sink(DiscardingSink(), uid="out"))
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        seconds = time.perf_counter() - t0
        storage = LocalCheckpointStorage(Path(tmp) / "chk")
        manifest, root = storage.latest()
        state = committed_state(storage, manifest, root)["count"]["$groupState"]
        total = sum(v[0][0] for v in state.values())
        lat = sorted(e["trigger_to_commit_seconds"] for e in result.metrics.get("epochs", [])
                     if e.get("state") == "completed")
    if total != rows or len(state) != keys:
        raise RuntimeError(f"{layout} keys={keys}: committed counts sum to {total} over {len(state)} keys")
    return {"layout": layout, "rows": rows, "keys": keys, "batch_size": batch_size, "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds), "epochs": len(lat),
            "trigger_to_commit_p50_s": round(statistics.median(lat), 3) if lat else "",
            "trigger_to_commit_p99_s": round(percentile(lat, 0.99), 3) if lat else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--keys", default="100,10000", help="comma list of key counts")
    ap.add_argument("--batch-sizes", default="1024,65536", help="comma list of rows per source read")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    plan = [(k, b, layout) for k in map(int, args.keys.split(",")) for b in map(int, args.batch_sizes.split(","))
            for layout in ("rows", "arrow")]
    results: list[dict] = []
    total = len(plan) * args.repeats
    for rep in range(args.repeats):
        for keys, batch, layout in plan:
            print(f"[{len(results) + 1}/{total}] {layout} keys={keys} batch={batch} ...", end=" ", flush=True)
            row = {**run_one(args.rows, keys, batch, layout, args.interval), "repeat": rep + 1}
            results.append(row)
            print(f"{row['rows_per_s']:,} rows/s, p50 epoch {row['trigger_to_commit_p50_s']} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "pyspark_keyed_count.csv", results)
    print(f"\n{'keys':>6} {'batch':>6} {'rows rows/s':>12} {'arrow rows/s':>13} {'arrow/rows':>10}")
    med = {}
    for keys, batch, layout in plan:
        med[(keys, batch, layout)] = statistics.median(
            r["rows_per_s"] for r in results if (r["keys"], r["batch_size"], r["layout"]) == (keys, batch, layout))
    for keys, batch in dict.fromkeys((k, b) for k, b, _ in plan):
        r, a = med[(keys, batch, "rows")], med[(keys, batch, "arrow")]
        print(f"{keys:>6} {batch:>6} {r:>12,.0f} {a:>13,.0f} {a / r:>10.2f}")
    _plot(med, out / "pyspark_keyed_count.png")
    print(f"\nwrote {out / 'pyspark_keyed_count.csv'} and {out / 'pyspark_keyed_count.png'}")


def _plot(med: dict, path: Path) -> None:
    plt = pyplot()

    groups = list(dict.fromkeys((k, b) for k, b, _ in med))
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, layout in enumerate(("rows", "arrow")):
        ax.bar([g + i * 0.4 for g in range(len(groups))], [med[(k, b, layout)] / 1000 for k, b in groups],
               width=0.4, label=layout)
    ax.set_xticks([g + 0.2 for g in range(len(groups))], [f"{k} keys\nbatch {b}" for k, b in groups])
    ax.set_ylabel("thousand rows / s")
    ax.set_title("applyInPandasWithState keyed count, local driver, p=2, 1 s epochs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
