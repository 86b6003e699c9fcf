"""Where one RocksDB keyed state's memory goes as its keys grow: RocksDB's own accounting beside RSS.

The target: the LSM backend runs 50M keys with memory per worker under its setting
(``rocksdb_memory_mb``). ``state_beyond_memory.py`` measures a worker's RSS; this script says what
part of it RocksDB holds. It opens one ``RocksDBKeyedState`` with the backend's own options (one
LRU block cache of ``--memory-mb``, memtables charged to it, partitioned filters and indexes) in
this process and writes ``--keys`` keys the way a keyed batch function on the backend does: batches
of 65,536 keys, one sorted multi-get, one write batch, values laid out as the backend stores them
(pickled key, pickled count). After every tenth of the keys it reads RocksDB's properties:
``block-cache-usage`` (memtables included, being charged to the cache), ``block-cache-pinned-usage``,
``cur-size-all-mem-tables``, ``estimate-table-readers-mem`` and ``total-sst-files-size``, and the
process's RSS.

Writes ``benchmarks/results/<name>.csv`` and ``<name>.png``, prints each sample and a summary.
Not a test.

    python benchmarks/state/rocksdb_memory.py [--keys 25000000] [--memory-mb 64] [--name rocksdb_memory]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks.harness import RESULTS, pyplot, rss_mb, write_csv  # noqa: E402
from epochstream.backends.rocksdb_state import RocksDBKeyedState  # noqa: E402
from epochstream.graph.keygroups import assign_to_key_group  # noqa: E402

BATCH = 65536
MAX_PARALLELISM = 128
PROPS = ("block-cache-usage", "block-cache-pinned-usage", "cur-size-all-mem-tables",
         "estimate-table-readers-mem", "total-sst-files-size")


def db_key(k: int) -> bytes:
    """Key group (2 bytes), state id (2 bytes), the key: the layout of the backend's DB keys."""
    return assign_to_key_group(k, MAX_PARALLELISM).to_bytes(2, "big") + b"\x00\x01" + k.to_bytes(8, "big")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=25_000_000, help="keys written (one worker's share of 50M: 25M)")
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--name", default="rocksdb_memory")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    from rocksdict import WriteBatch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    before = rss_mb()
    with tempfile.TemporaryDirectory(prefix="es-rocksdb-memory-") as tmp:
        state = RocksDBKeyedState("count", lambda k: assign_to_key_group(k, MAX_PARALLELISM),
                                  (0, MAX_PARALLELISM - 1), local_dir=tmp, memory_mb=a.memory_mb)
        db = state._db
        base = rss_mb()
        print(f"RSS {before:.0f} MB before the DB, {base:.0f} MB with it open; {a.keys:,} keys, "
              f"{a.memory_mb} MB setting", flush=True)
        every = max(BATCH, (a.keys // a.samples) // BATCH * BATCH)
        t0 = time.perf_counter()
        for lo in range(0, a.keys, BATCH):
            keys = sorted(db_key(k) for k in range(lo, min(a.keys, lo + BATCH)))
            old = db.get(keys)
            batch = WriteBatch(raw_mode=True)
            for dbk, prev in zip(keys, old, strict=True):
                kp = pickle.dumps(int.from_bytes(dbk[4:], "big"))
                count = 1 if prev is None else pickle.loads(prev[4 + int.from_bytes(prev[:4], "big"):]) + 1
                batch.put(dbk, len(kp).to_bytes(4, "big") + kp + pickle.dumps(count))
            db.write(batch)
            done = min(a.keys, lo + BATCH)
            if done % every == 0 or done == a.keys:
                row = {"keys": done, "seconds": round(time.perf_counter() - t0, 1), "rss_mb": round(rss_mb(), 1),
                       "rss_growth_mb": round(rss_mb() - base, 1)}
                for p in PROPS:
                    row[p.replace("-", "_") + "_mb"] = round((db.property_int_value(f"rocksdb.{p}") or 0) / 2**20, 1)
                rows.append(row)
                print(f"{done:>12,} keys {row['seconds']:>7.0f} s  RSS {row['rss_mb']:.0f} MB "
                      f"(+{row['rss_growth_mb']:.0f})  cache {row['block_cache_usage_mb']:.1f}  pinned "
                      f"{row['block_cache_pinned_usage_mb']:.1f}  memtables {row['cur_size_all_mem_tables_mb']:.1f}"
                      f"  table readers {row['estimate_table_readers_mem_mb']:.1f}  SST "
                      f"{row['total_sst_files_size_mb']:.0f} MB", flush=True)
        del state, db
    csv_path, png_path = out / f"{a.name}.csv", out / f"{a.name}.png"
    write_csv(csv_path, rows)
    cache_max = max(r["block_cache_usage_mb"] for r in rows)
    within = "within" if cache_max <= a.memory_mb else "ABOVE"
    print(f"\nsetting {a.memory_mb} MB: RocksDB's block cache (memtables charged to it) peaked at {cache_max:.1f} MB "
          f"({within} the setting); RSS grew {rows[-1]['rss_growth_mb']:.0f} MB over the open DB, "
          f"{rows[len(rows) // 2]['rss_growth_mb']:.0f} MB at half the keys")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    ks = [r["keys"] / 1e6 for r in rows]
    ax.plot(ks, [r["rss_growth_mb"] for r in rows], marker="o", label="RSS growth over the open DB")
    ax.plot(ks, [r["block_cache_usage_mb"] for r in rows], marker="o", label="block cache usage (memtables in it)")
    ax.plot(ks, [r["block_cache_pinned_usage_mb"] for r in rows], marker=".", label="pinned in the cache")
    ax.axhline(a.memory_mb, color="grey", lw=1, label="rocksdb_memory_mb")
    ax.set_xlabel("keys (millions)")
    ax.set_ylabel("MB")
    ax.set_title(f"One RocksDB keyed state, {a.memory_mb} MB setting")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
