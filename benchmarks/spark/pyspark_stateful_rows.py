"""Row input into the PySpark wrappers: what turning rows into each key's pandas frame costs, and the keyed count
fed rows against Arrow.

Three measurements, each printed as one line per case (not a test: nothing asserts timings):

- ``convert``: one ``apply_in_pandas_with_state`` subtask in-process (its keyed state as a task builds it), fed
  ROWS dict rows ``{"id": i, "k": i % KEYS}`` in 1,024-row runtime batches (the default batching), then the
  epoch's grouping and conversion (``_by_key``: every key's frame); thread CPU per row, min over the repeats.
  Cases: dict rows without an input schema, with ``input_schema="id long, k long"``, Arrow batches, and Arrow
  batches with nulls in an int column of some keys. ``bound`` is the whole epoch bound with ``count``'s calls.
- ``job``: the keyed count (``count`` from pyspark_stateful.py, unchanged), local driver, p=2, 1 s epochs,
  ``micro_batch="epoch"``, default batching, fed dicts (``from_collection``) or Arrow (``from_arrow``); rows/s
  over the run (with worker start-up) and in steady state (after 2 s of output), the committed counts checked.
- ``percall``: one subtask fed Arrow batches, thread CPU per key of an epoch bound with ``count`` or the
  StatefulProcessor ``CountSumHistogram`` (a ValueState and a MapState).

    PYTHONPATH=src python benchmarks/spark/pyspark_stateful_rows.py convert [KEYS=1000] [ROWS=200000] [REPEATS=3]
    PYTHONPATH=src python benchmarks/spark/pyspark_stateful_rows.py job rows|arrow [KEYS=1000] [ROWS=2000000]
    PYTHONPATH=src python benchmarks/spark/pyspark_stateful_rows.py percall count|hist [KEYS=1000] [ROWS=200000]
        [EPOCHS=3]
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.state import GroupStateTimeout

from epochstream import CheckpointConfig, Pipeline
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.oracle import committed_state
from epochstream.pyspark.operators import ApplyInPandasWithState, TransformWithState
from epochstream.runtime.context import Context
from epochstream.runtime.state import HeapKeyedState, OperatorStateBackend

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import percentile  # noqa: E402
from benchmarks.spark.pyspark_stateful import (  # noqa: E402
    CountSumHistogram,
    ProbeSink,
    count,
    epoch_latencies,
    steady_rate,
)


def _subtask(op):
    state = HeapKeyedState("op", lambda k: 0, (0, 0))
    ctx = Context(state, 0, 1, "op", None, OperatorStateBackend("op", 0))
    op.open(ctx)
    return op, ctx


def _feed(op, ctx, batches: list) -> None:
    """The runtime batches as the chain hands them over: dict rows with their keys, or RecordBatches."""
    for b in batches:
        op.apply_batch(b, [(r["k"],) for r in b] if isinstance(b, list) else None, ctx)


def convert(keys: int = 1000, rows: int = 200_000, repeats: int = 3) -> None:
    data = [{"id": i, "k": i % keys} for i in range(rows)]
    with_nulls = [{"id": i, "k": i % keys, "n": None if i % keys < keys // 10 and i % 3 == 0 else i}
                  for i in range(rows)]
    cases = {
        "dict rows, no input_schema": ([data[i:i + 1024] for i in range(0, rows, 1024)], None),
        "dict rows, input_schema": ([data[i:i + 1024] for i in range(0, rows, 1024)], "id long, k long"),
        "Arrow batches": ([pa.RecordBatch.from_pylist(data[i:i + 1024]) for i in range(0, rows, 1024)], None),
        "Arrow batches, int nulls in a tenth of the keys": (
            [pa.RecordBatch.from_pylist(with_nulls[i:i + 1024]) for i in range(0, rows, 1024)], None),
    }
    for name, (batches, schema) in cases.items():
        op, ctx = _subtask(ApplyInPandasWithState(count, "k long, c long", "c long", "Update",
                                                  GroupStateTimeout.NoTimeout, key="k", input_schema=schema))


        convert_s, bound_s = [], []
        for rep in range(repeats + 1):
            gc.collect()
            c0 = time.thread_time()
            _feed(op, ctx, batches)
            gc.disable()
            frames = [op._frames(parts) for parts in op._by_key(op._take_pending()).values()]
            c1 = time.thread_time()
            gc.enable()
            assert len(frames) == min(keys, rows) and sum(len(f) for fs in frames for f in fs) == rows
            del frames
            c2 = time.thread_time()
            _feed(op, ctx, batches)
            op.on_epoch_end(rep, ctx)
            c3 = time.thread_time()
            if rep:  # the first is warm-up
                convert_s.append(c1 - c0)
                bound_s.append(c3 - c2)
        best = min(convert_s)
        print(f"convert {name}: {keys} keys, {rows} rows in 1024-row batches: {best * 1e6 / rows:.3f} us/row "
              f"({best * 1e3:.0f} ms, buffering included); bound with count's calls {min(bound_s) * 1e3:.0f} ms",
              flush=True)


def job(layout: str, keys: int = 1000, rows: int = 2_000_000) -> None:
    data = [{"id": i, "k": i % keys} for i in range(rows)]
    with tempfile.TemporaryDirectory(prefix="es-rows-job-") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        p = Pipeline("keyed-count", parallelism=2, max_parallelism=128, checkpoint=CheckpointConfig(interval=1.0))
        src = (p.from_arrow(pa.Table.from_pylist(data), num_splits=2, uid="events") if layout == "arrow"
               else p.from_collection(data, splits=2, uid="events"))
        (src.apply_in_pandas_with_state(count, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout,
                                        key="k", uid="count", micro_batch="epoch")
            .sink(ProbeSink(str(logs), "count"), uid="out"))
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = p.run(deployment="local", checkpoint_dir=str(Path(tmp) / "chk"))
        wall = time.perf_counter() - t0
        rate, steady_s, _ = steady_rate(str(logs), 2.0)
        storage = LocalCheckpointStorage(Path(tmp) / "chk")
        manifest, root = storage.latest()
        state = committed_state(storage, manifest, root)["count"]["$groupState"]
        ok = sum(v[0][0] for v in state.values()) == rows and len(state) == keys
    lat = sorted(epoch_latencies(res))
    print(f"job {layout}, {keys} keys, {rows} rows: {rows / wall:,.0f} rows/s over {wall:.1f} s, steady "
          f"{rate:,.0f} rows/s ({steady_s:.1f} s); {len(lat)} epochs, p50 {percentile(lat, 0.5) if lat else 0:.0f} ms; "
          f"counts ok {ok}; load {load:.1f}", flush=True)


def percall(workload: str, keys: int = 1000, rows: int = 200_000, epochs: int = 3) -> None:
    if workload == "count":
        op = ApplyInPandasWithState(count, "k long, c long", "c long", "Update", GroupStateTimeout.NoTimeout, key="k")
    else:
        op = TransformWithState(CountSumHistogram(), "k long, n long", "None", key="k")
    op, ctx = _subtask(op)
    cpus: list[float] = []
    for e in range(epochs + 1):
        ids = pa.array(range(e * rows, (e + 1) * rows), pa.int64())
        batch = pa.record_batch({"id": ids, "k": pc.subtract(ids, pc.multiply(pc.divide(ids, keys), keys)),
                                 "v": pc.bit_wise_and(ids, 127)})
        c0 = time.thread_time()
        for i in range(0, rows, 65536):
            op.apply_batch(batch.slice(i, 65536), None, ctx)
        out = op.on_epoch_end(e, ctx)
        if e:
            cpus.append(time.thread_time() - c0)
        assert out.num_rows == min(keys, rows), out.num_rows
    best = min(cpus)
    print(f"percall {workload}, {keys} keys, {rows} rows an epoch: bound {best * 1e3:.0f} ms thread CPU = "
          f"{best / min(keys, rows) * 1e6:.1f} us/key (min of {epochs})", flush=True)


def main() -> None:
    args = sys.argv[1:]
    what = args[0] if args else "convert"
    if what == "convert":
        convert(*(int(a) for a in args[1:4]))
    elif what == "job":
        job(args[1], *(int(a) for a in args[2:4]))
    elif what == "percall":
        percall(args[1], *(int(a) for a in args[2:5]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
