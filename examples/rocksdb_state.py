"""Keyed state in RocksDB: a job whose state lives in a local RocksDB per operator subtask,
then the same job moved back to the heap from its savepoint.

Run it:  python examples/rocksdb_state.py [WORKDIR]      (needs: pip install 'epochstream[rocksdb]')

1. A running count over 200,000 keys runs on the local driver at parallelism 2 with
   ``state_backend_type="rocksdb"`` and 16 MiB of RocksDB memory per operator subtask
   (``rocksdb_memory_mb``; Flink's ``state.backend.rocksdb.memory.fixed-per-slot``), and
   stops with a savepoint.
2. The savepoint restores into the same job on the heap (``hashmap``) at parallelism 3: both
   backends write the same checkpoint rows, so switching is a stop and a restore.
3. ``epochstream.state.query`` reads a few committed counts.
"""

import sys
import tempfile
from pathlib import Path

import epochstream.state
from epochstream import CheckpointConfig, DiscardingSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

KEYS = 200_000


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))

    def process(self, value, ctx):
        n = self.n.value() + 1
        self.n.update(n)  # RocksDB stores what is written back (a value read is a fresh copy)
        return ((ctx.key, n),)


def build(parallelism: int, state_backend_type: str, local_dir: Path) -> Pipeline:
    cfg = CheckpointConfig(interval=0.5, state_backend_type=state_backend_type, rocksdb_memory_mb=16,
                           rocksdb_dir=str(local_dir))
    p = Pipeline("rocksdb-counts", parallelism=parallelism, max_parallelism=64, checkpoint=cfg)
    (p.generate(lambda i: i % KEYS, count=2 * KEYS, uid="numbers")
      .key_by(lambda k: k)
      .process(Count(), uid="count")
      .sink(DiscardingSink(), uid="out"))
    return p


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="epochstream-rocksdb-"))
    first = build(2, "rocksdb", work / "db").run(deployment="local", checkpoint_dir=str(work / "chk-rocksdb"),
                                                 duration=3.0, savepoint_dir=str(work / "savepoints"),
                                                 stop_with_savepoint=True)
    savepoint = first.savepoints[-1]
    print(f"1. rocksdb, parallelism 2: stopped with savepoint {Path(savepoint).name} "
          f"(epochs {first.completed_epochs[0]}..{first.completed_epochs[-1]})")
    second = build(3, "hashmap", work / "db").run(deployment="local", checkpoint_dir=str(work / "chk-heap"),
                                                  restore=savepoint)
    print(f"2. restored on the heap at parallelism 3 and finished the input: {len(second.completed_epochs)} epochs")
    table = epochstream.state.query(work / "chk-heap", "count", state="n")
    counts = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True))
    assert len(counts) == KEYS and set(counts.values()) == {2}, "every key counted twice, across the switch"
    print(f"3. committed: {len(counts):,} keys, each counted {counts[0]} times (e.g. key 12345 -> {counts[12345]})")


if __name__ == "__main__":
    main()
