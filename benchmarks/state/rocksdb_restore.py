"""Restoring RocksDB keyed state: rows re-inserted against the checkpoint's files opened as the DB.

One keyed operator subtask's RocksDB (``RocksDBKeyedState``, one ValueState, ``--keys`` keys,
key groups 0..127) takes an incremental RocksDB checkpoint, uploaded to a local checkpoint folder.
Then, ``--repeats`` times each, alternating:

* ``rows``: the restore every backend can do, rows of the range read from the checkpoint
  (download, open read-only, range scan) and written into a fresh DB in write batches;
* ``native``: the RocksDB shortcut, the checkpoint's files downloaded and opened as the new DB
  (``restore_checkpoint``), as Flink restores;
* ``native-half``: the same for half the key groups (a scale-out 1 -> 2), the rest deleted by a
  range tombstone.

Each restore is followed by reading 1,000 random keys back (checked). Then one capture after
each kind of restore: how many bytes the first checkpoint after it uploads (``native`` from the
job's own storage shares the restored files on; ``rows`` uploads everything).

Writes ``benchmarks/results/<name>.csv`` and ``<name>.png``, prints a summary table. Not a test.

    python benchmarks/state/rocksdb_restore.py [--keys 1000000] [--repeats 3] [--name rocksdb_restore]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.backends.rocksdb_state import RocksDBKeyedState  # noqa: E402
from epochstream.runtime.state import ValueStateDescriptor  # noqa: E402

GROUPS = 128


def key_group(k: int) -> int:
    return k % GROUPS


def fill(keys: int, local: str) -> RocksDBKeyedState:
    b = RocksDBKeyedState("count", key_group, (0, GROUPS - 1), local_dir=local, sst_incremental=True)
    h = b.handle(ValueStateDescriptor("n"))
    for k in range(keys):
        b.keys.key = k
        h.update(k)
    return b


def restore(kind: str, storage: LocalCheckpointStorage, m: dict, local: str) -> tuple[RocksDBKeyedState, float]:
    rng = (0, GROUPS // 2 - 1) if kind == "native-half" else (0, GROUPS - 1)
    b = RocksDBKeyedState("count", key_group, rng, local_dir=local, sst_incremental=True)
    t0 = time.perf_counter()
    if kind == "rows":
        b.restore_rows(storage.read_operator_rows(m, storage.root, "count", rng), {"n": "value"})
    else:
        found = storage.native_checkpoint(m, storage.root, "count", rng)
        assert found is not None, "one checkpoint holds the range"
        ref, handle, base = found
        b.restore_checkpoint(storage.store, base, ref, handle, {"n": "value"}, reuse_files=True)
    return b, time.perf_counter() - t0


def check(b: RocksDBKeyedState, keys: int) -> None:
    h = b.handle(ValueStateDescriptor("n"))
    lo, hi = b.key_group_range
    for k in random.Random(7).sample(range(keys), 1000):
        b.keys.key = k
        want = k if lo <= key_group(k) <= hi else None
        if h.value() != want:
            raise SystemExit(f"key {k}: restored {h.value()!r}, expected {want!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="rocksdb_restore")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rocksdb-restore-"))
    local = str(work / "local")
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        b = fill(a.keys, local)
        fill_s = time.perf_counter() - t0
        storage = LocalCheckpointStorage(work / "chk")
        kc = b.capture(1)
        ref = storage.pre_commit("count", 0, 1, "a", kc.rows, kc.key_group_range, kc.full)
        b.close()
        m = {"operators": {"count": {"files": [ref.to_json()]}}}
        ckpt_mb = sum(f.bytes for f in ref.shared) / 2**20
        print(f"{a.keys:,} keys written in {fill_s:.1f} s; checkpoint {ckpt_mb:.1f} MiB in {len(ref.shared)} SST files",
              flush=True)
        for r in range(a.repeats):
            for kind in ("rows", "native", "native-half"):
                restored, secs = restore(kind, storage, m, local)
                check(restored, a.keys)
                after = ""
                if r == a.repeats - 1 and kind != "native-half":  # the first capture after the restore
                    restored.keys.key = 0
                    restored.handle(ValueStateDescriptor("n")).update(-1)
                    kc = restored.capture(2)
                    ref2 = storage.pre_commit("count", 0, 2, f"{kind}-{r}", kc.rows, kc.key_group_range, kc.full)
                    after = str(ref2.new_bytes)
                restored.close()
                rows.append({"kind": kind, "repeat": r + 1, "keys": a.keys, "restore_s": round(secs, 3),
                             "checkpoint_mib": round(ckpt_mb, 1), "next_capture_uploaded_bytes": after,
                             "load1": round(os.getloadavg()[0], 2)})
                print(f"  repeat {r + 1} {kind:<12} {secs:7.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / f"{a.name}.csv", rows)
    med = {k: statistics.median(x["restore_s"] for x in rows if x["kind"] == k) for k in ("rows", "native",
                                                                                         "native-half")}
    print(f"\n{'restore':<14}{'median s':>10}{'vs rows':>10}{'next capture uploads':>24}")
    for k, v in med.items():
        up = next((x["next_capture_uploaded_bytes"] for x in rows
                   if x["kind"] == k and x["next_capture_uploaded_bytes"]), "")
        print(f"{k:<14}{v:>10.2f}{med['rows'] / v if v else float('nan'):>9.1f}x{up:>24}")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(med), list(med.values()), color=["#999999", "#3572b0", "#6fa8dc"])
    ax.set_ylabel("restore wall time, s (median)")
    ax.set_title(f"RocksDB restore of {a.keys:,} keys ({ckpt_mb:.0f} MiB of SST files)")
    fig.tight_layout()
    fig.savefig(a.out / f"{a.name}.png", dpi=120)
    print(f"\nwrote {a.out / (a.name + '.csv')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
