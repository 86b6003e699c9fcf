"""State larger than memory: tens of millions of keys on the RocksDB keyed-state backend.

The target: the LSM backend runs 50M keys with RSS per worker under its setting and a
restore under 30 s. Workload: a vectorised source (``generate_batches``) of ``--keys * --updates``
rows, row i with key ``i % keys`` (int64), ``key_by("k")``, a keyed batch function whose
ValueState counts each key's rows (``throughput.BatchCount``), a discarding sink; local driver,
2 workers, aligned epochs every ``--interval`` seconds, ``state_backend_type="rocksdb"`` with
``--rocksdb-memory-mb``, incremental checkpoints (only new SST files uploaded).

Measured: rows/s, epochs and their trigger->manifest p50/p99, each worker's RSS and private memory
(``Private_Clean + Private_Dirty`` from ``smaps_rollup``) every 0.5 s, the bytes under the checkpoint
folder, and the restore: a second run of the same pipeline from the final checkpoint, whose source
is exhausted, so its wall time is starting the workers plus restoring the state (the RocksDB
backend opens the checkpoint's SST files as its DB). Checked: the committed state of two key
groups read back from the final checkpoint, every key's count equal to ``--updates``.

Writes ``benchmarks/results/<name>.csv`` (one row per run), ``<name>_rss.csv`` and ``<name>.png``
(memory per worker over time), prints progress every 10 s and a summary. Not a test.

    python benchmarks/state/state_beyond_memory.py [--keys 50000000] [--updates 1] [--interval 5]
        [--rocksdb-memory-mb 64] [--name state_beyond_memory]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.epochs.throughput import BatchCount  # noqa: E402
from benchmarks.harness import RESULTS, children_rss_mb, percentile, private_mb, pyplot, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, Pipeline  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.graph.keygroups import assign_to_key_group  # noqa: E402

ROWS = 65536


def check(chk: Path, keys: int, updates: int) -> int:
    """Key groups 0 and the last, read back from the final checkpoint: every count is ``updates``,
    and every key of a random sample of 20,000 that falls in them is there. Returns the keys read."""
    import pickle
    import random

    storage = LocalCheckpointStorage(chk)
    manifest, root = storage.latest()
    max_p = int(manifest["max_parallelism"])
    groups = (0, max_p - 1)
    got: dict[int, int] = {}
    for kg in groups:
        for _g, kb, _name, vb in storage.read_operator_rows(manifest, root, "count", (kg, kg)):
            got[pickle.loads(kb)] = pickle.loads(vb)
    bad = {k: v for k, v in got.items() if v != updates}
    sample = [k for k in random.Random(1).sample(range(keys), min(keys, 20_000))
              if assign_to_key_group(k, max_p) in groups]
    missing = [k for k in sample if k not in got]
    if bad or missing or not got:
        raise SystemExit(f"committed state is wrong: counts {list(bad.items())[:5]}, missing keys {missing[:5]}")
    return len(got)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(keys: int, updates: int, interval: float, memory_mb: int) -> Pipeline:
    import numpy as np
    import pyarrow as pa

    def rows(start: int, stop: int) -> Any:
        return pa.record_batch({"k": pa.array(np.arange(start, stop, dtype=np.int64) % keys)})

    p = Pipeline("state-beyond-memory", parallelism=2, checkpoint_interval=interval, batch_rows=ROWS,
                 checkpoint=CheckpointConfig(state_backend_type="rocksdb", rocksdb_memory_mb=memory_mb,
                                             incremental=True, num_retained=1))
    (p.generate_batches(rows, count=keys * updates, uid="src", block_rows=ROWS)
     .key_by("k")
     .process_batches(BatchCount(), uid="count")
     .sink(DiscardingSink(), uid="sink"))
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=50_000_000)
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--rocksdb-memory-mb", type=int, default=64)
    ap.add_argument("--name", default="state_beyond_memory")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=None, help="folder for checkpoints (default: a temporary one)")
    a = ap.parse_args()
    records = a.keys * a.updates
    work = Path(tempfile.mkdtemp(prefix="es-beyond-", dir=a.work))
    chk = work / "chk"
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def sample(phase: str) -> None:
        last_print = 0.0
        while not stop.wait(0.5):
            t = time.perf_counter() - t0
            rss = children_rss_mb()
            for pid, mb in rss.items():
                samples.append({"phase": phase, "t_s": round(t, 1), "pid": pid, "rss_mb": round(mb, 1),
                                "private_mb": round(private_mb(pid), 1)})
            if t - last_print >= 10:
                last_print = t
                disk = folder_bytes(chk) / 2**20 if chk.exists() else 0.0
                print(f"  [{phase} {t:6.0f} s] worker RSS {', '.join(f'{m:.0f}' for m in rss.values())} MB; "
                      f"checkpoint folder {disk:,.0f} MiB; load {os.getloadavg()[0]:.1f}", flush=True)

    try:
        sampler = threading.Thread(target=sample, args=("run",), daemon=True)
        sampler.start()
        print(f"{records:,} rows over {a.keys:,} keys, rocksdb {a.rocksdb_memory_mb} MiB per subtask", flush=True)
        result = build(a.keys, a.updates, a.interval, a.rocksdb_memory_mb).run(
            deployment="local", checkpoint_dir=str(chk))
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        chk_mib = folder_bytes(chk) / 2**20
        epochs = [e for e in result.metrics.get("epochs", []) if e.get("state") == "completed"]
        lat = [float(e["trigger_to_commit_seconds"]) for e in epochs]

        stop.clear()
        t0 = time.perf_counter()
        sampler = threading.Thread(target=sample, args=("restore",), daemon=True)
        sampler.start()
        build(a.keys, a.updates, a.interval, a.rocksdb_memory_mb).run(
            deployment="local", checkpoint_dir=str(chk), restore="latest")
        restore_s = time.perf_counter() - t0
        stop.set()
        sampler.join()

        checked = check(chk, a.keys, a.updates)
    finally:
        stop.set()
        shutil.rmtree(work, ignore_errors=True)

    run = [s for s in samples if s["phase"] == "run"]
    row = {"keys": a.keys, "updates": a.updates, "records": records, "rocksdb_memory_mb": a.rocksdb_memory_mb,
           "interval_s": a.interval, "wall_s": round(wall, 1), "rows_per_s": round(records / wall),
           "epochs": len(epochs), "trigger_to_manifest_p50_s": round(percentile(lat, 0.5), 2) if lat else "",
           "trigger_to_manifest_p99_s": round(percentile(lat, 0.99), 2) if lat else "",
           "max_rss_mb_per_worker": max((s["rss_mb"] for s in run), default=float("nan")),
           "max_private_mb_per_worker": max((s["private_mb"] for s in run), default=float("nan")),
           "median_private_mb_per_worker": statistics.median(s["private_mb"] for s in run) if run else "",
           "checkpoint_folder_mib": round(chk_mib), "restore_run_s": round(restore_s, 1),
           "keys_checked": checked, "load1": round(os.getloadavg()[0], 2)}
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / f"{a.name}.csv", [row])
    write_csv(a.out / f"{a.name}_rss.csv", samples, ["phase", "t_s", "pid", "rss_mb", "private_mb"])
    print()
    for k, v in row.items():
        print(f"{k:<30}{v}")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for pid in sorted({s["pid"] for s in run}):
        pts = [s for s in run if s["pid"] == pid]
        ax.plot([s["t_s"] for s in pts], [s["rss_mb"] for s in pts], label=f"worker {pid} RSS")
        ax.plot([s["t_s"] for s in pts], [s["private_mb"] for s in pts], "--", label=f"worker {pid} private")
    ax.axhline(a.rocksdb_memory_mb, color="grey", lw=0.8, label="rocksdb_memory_mb")
    ax.set_xlabel("s")
    ax.set_ylabel("MB")
    ax.set_title(f"{a.keys:,} keys on RocksDB: memory per worker")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out / f"{a.name}.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
