"""Spark's own keyed count (issue 13) through ``apply_in_pandas_with_state`` on a columnar source.

The function is the issue's, unchanged. Local driver, parallelism 2, 1 s epochs, a
``generate_batches`` source (``k = id % keys``), DiscardingSink. Throughput = rows / run
seconds (worker start-up included). Which path runs depends on the package imported: this
branch's wrappers group the Arrow batches themselves (columnar path); run it with an older
``PYTHONPATH`` (e.g. ``/work/main/src`` before the change) for the row path, where the chain
makes dict rows of every batch before the wrapper::

    PYTHONPATH=src python benchmarks/pyspark_keyed_count.py --rows 2000000 --keys 100

Prints one JSON line; the committed counts are checked against the input.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def count(key, pdfs, state):
    c = state.get[0] if state.exists else 0
    for pdf in pdfs:
        c += len(pdf)
    state.update((c,))
    yield pd.DataFrame({"k": [key[0]], "c": [c]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--keys", type=int, default=100)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=1024, help="rows per source read (Pipeline batch_size)")
    args = ap.parse_args()
    keys = args.keys

    def events(start: int, stop: int):
        ids = pa.array(range(start, stop), pa.int64())
        return pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys))})

    with tempfile.TemporaryDirectory(prefix="es-keyed-count-") as tmp:
        p = Pipeline("keyed-count", parallelism=2, max_parallelism=128,
                     checkpoint=CheckpointConfig(interval=args.interval), batch_size=args.batch_size)
        (p.generate_batches(events, count=args.rows, num_splits=2, uid="events")
          .apply_in_pandas_with_state(count, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout,
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
    print(json.dumps({
        "rows": args.rows, "keys": keys, "batch_size": args.batch_size,
        "seconds": round(seconds, 2), "rows_per_s": round(args.rows / seconds),
        "counts_ok": total == args.rows and len(state) == keys, "epochs": len(lat),
        "trigger_to_commit_p50_s": round(statistics.median(lat), 3) if lat else None,
        "trigger_to_commit_max_s": round(lat[-1], 3) if lat else None,
    }))


if __name__ == "__main__":
    main()
