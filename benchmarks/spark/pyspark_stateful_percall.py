"""The per-key cost of apply_in_pandas_with_state at many keys, in-process on one subtask.

The operator with its keyed state (as a task builds it) is fed one Arrow batch of ROWS_PER_EPOCH rows over KEYS
keys per epoch, then the epoch bound (``on_epoch_end``: one call of Spark's keyed ``count`` per key), for EPOCHS epochs
after one warm-up. Prints the wall and thread-CPU time of a bound (min over the epochs) and, as the floor, the
user's ``count`` alone (its frame and GroupState made outside the timing). Not a test: nothing is asserted but the
output row count. Run it with PYTHONPATH at the tree to measure (a baseline worktree too, alternating):

    PYTHONPATH=src python benchmarks/spark/pyspark_stateful_percall.py [KEYS=5000] [ROWS_PER_EPOCH=65536] [EPOCHS=4]
        [prof]

``prof`` adds a cProfile of the measured epochs. A second bound is timed with ``count_prebuilt``: ``count``
yielding one frame made once instead of its own ``pd.DataFrame`` per call, so what it costs is the wrapper's
share of a call plus the few microseconds of the user's state calls and ``len``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import Row

from epochstream.pyspark.operators import ApplyInPandasWithState
from epochstream.runtime.context import Context
from epochstream.runtime.state import HeapKeyedState, OperatorStateBackend

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.spark.pyspark_stateful import count  # noqa: E402  (Spark's keyed count, as the end-to-end benchmark runs it)

_PREBUILT = pd.DataFrame({"k": [0], "c": [0]})


def count_prebuilt(key, pdfs, state):
    """``count`` without its ``pd.DataFrame`` per call: the wrapper's own share of a call."""
    c = state.get[0] if state.exists else 0
    for pdf in pdfs:
        c += len(pdf)
    state.update((c,))
    yield _PREBUILT


def bound_cpu(func, keys: int, rows: int, epochs: int, profile: bool = False) -> tuple[float, float]:
    """Min wall and thread-CPU seconds of a bound over ``epochs`` epochs after one warm-up."""
    state = HeapKeyedState("op", lambda k: 0, (0, 0))
    ctx = Context(state, 0, 1, "op", None, OperatorStateBackend("op", 0))
    op = ApplyInPandasWithState(func, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout, key="k")
    op.open(ctx)
    calls = min(keys, rows)
    pos = 0
    walls: list[float] = []
    cpus: list[float] = []

    def run(n: int) -> None:
        nonlocal pos
        for e in range(n):
            ids = pa.array(range(pos, pos + rows), pa.int64())
            batch = pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys))})
            pos += rows
            t0, c0 = time.perf_counter(), time.thread_time()
            op.apply_batch(batch, None, ctx)
            out = op.on_epoch_end(e, ctx)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            assert out.num_rows == calls, out.num_rows

    run(1)
    walls.clear()
    cpus.clear()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    run(epochs)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    return min(walls), min(cpus)


def main() -> None:
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    profile = len(sys.argv) > 4 and sys.argv[4] == "prof"

    calls = min(keys, rows)
    wall, cpu = bound_cpu(count, keys, rows, epochs, profile)
    print(f"keys={keys} rows/epoch={rows}: bound wall min {wall * 1000:.0f} ms "
          f"({wall / calls * 1e6:.1f} us/key, {rows / wall:,.0f} rows/s); "
          f"thread CPU min {cpu * 1000:.0f} ms = {cpu / calls * 1e6:.1f} us/key")
    _wall, own = bound_cpu(count_prebuilt, keys, rows, epochs)
    print(f"   count_prebuilt (the wrapper's share): thread CPU min {own * 1000:.0f} ms = "
          f"{own / calls * 1e6:.1f} us/key")

    pdf = pd.DataFrame({"id": [1, 2], "k": [3, 3]})
    best = float("inf")
    for _ in range(3):
        states = [GroupState(optionalValue=Row(c=5), batchProcessingTimeMs=1, eventTimeWatermarkMs=-1,
                             timeoutConf=GroupStateTimeout.NoTimeout, hasTimedOut=False, watermarkPresent=False,
                             defined=True, updated=False, removed=False, timeoutTimestamp=-1, keyAsUnsafe=b"",
                             valueSchema=None)  # type: ignore[arg-type]
                  for _ in range(calls)]
        c0 = time.thread_time()
        for i in range(calls):
            list(count((i,), iter([pdf]), states[i]))
        best = min(best, time.thread_time() - c0)
    print(f"   user function alone: thread CPU {best * 1000:.0f} ms = {best / calls * 1e6:.1f} us/key")


if __name__ == "__main__":
    main()
