"""One PySpark StatefulProcessor, unchanged, in Spark Structured Streaming and in epochstream.

``FraudFlags`` is ordinary transformWithStateInPandas code: per card it keeps a running
count (ValueState), the last few amounts (ListState) and a per-merchant total (MapState),
and flags a card whose amount is more than three times its recent average.

    python examples/pyspark_stateful.py            # both: Spark micro-batch, then epochstream
    python examples/pyspark_stateful.py epochstream  # epochstream only (no JVM)
    epochstream chaos examples/pyspark_stateful.py:pipeline --mode tracker   # exactly-once check

Spark needs the RocksDB state store for transformWithState; the file source and the
json sink here are plain Structured Streaming.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import pandas as pd
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

OUTPUT = "card string, n long, amount long, flagged boolean"


class FraudFlags(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.recent = handle.getListState("recent", "amount long")
        self.by_merchant = handle.getMapState("by_merchant", "merchant string", "total long")

    def handleInputRows(self, key, rows, timerValues):
        card = key[0]
        out = []
        for pdf in rows:
            for amount, merchant in zip(pdf["amount"], pdf["merchant"], strict=True):
                amount = int(amount)
                recent = [a for (a,) in self.recent.get()]
                flagged = bool(recent) and amount > 3 * sum(recent) / len(recent)
                n = (self.count.get() or (0,))[0] + 1
                self.count.update((n,))
                self.recent.put([(a,) for a in (recent + [amount])[-5:]])
                total = (self.by_merchant.getValue((merchant,)) or (0,))[0] + amount
                self.by_merchant.updateValue((merchant,), (total,))
                out.append((card, n, amount, flagged))
        yield pd.DataFrame(out, columns=["card", "n", "amount", "flagged"])

    def close(self) -> None:
        pass


def payments(n: int = 2_000) -> list[dict]:
    return [{"card": f"c{i % 13}", "merchant": f"m{i % 5}", "amount": (i * 37) % 101 + (400 if i % 97 == 0 else 0)}
            for i in range(n)]


def pipeline(out: str | None = None):
    """The epochstream job (a factory: ``epochstream run|chaos examples/pyspark_stateful.py:pipeline``)."""
    from epochstream import FileSink, Pipeline

    p = Pipeline("fraud-flags", parallelism=2, max_parallelism=128, checkpoint_interval=0.2)
    # one split: every card's payments arrive in input order, as in Spark's one-file micro-batches
    (p.from_collection(payments(), splits=1, uid="payments")
      .transform_with_state(FraudFlags(), OUTPUT, "None", key="card", uid="fraud-flags")
      .sink(FileSink(out or os.path.join(tempfile.mkdtemp(prefix="fraud-"), "flags")), uid="flags"))
    return p


def run_epochstream(work: str) -> list[dict]:
    p = pipeline(os.path.join(work, "epochstream"))
    result = p.run(deployment="local", checkpoint_dir=os.path.join(work, "chk"))
    print(f"epochstream: {len(result.completed_epochs)} epochs, latest checkpoint {result.latest_checkpoint}")
    rows = []
    for name in sorted(os.listdir(os.path.join(work, "epochstream"))):
        if name.startswith("part-"):
            with open(os.path.join(work, "epochstream", name)) as f:
                rows.extend(json.loads(line) for line in f)
    return rows


def run_spark(work: str) -> list[dict]:
    from pyspark.sql import SparkSession

    src = os.path.join(work, "spark-in")
    os.makedirs(src)
    data = payments()
    for i in range(0, len(data), 500):  # four files: four micro-batches
        with open(os.path.join(src, f"part-{i:05d}.json"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data[i:i + 500])
    spark = (SparkSession.builder.master("local[2]").appName("fraud-flags")
             .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false")
             .config("spark.sql.streaming.stateStore.providerClass",
                     "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
             .getOrCreate())
    try:
        df = (spark.readStream.schema("card string, merchant string, amount long")
              .option("maxFilesPerTrigger", 1).json(src))
        q = (df.groupBy("card").transformWithStateInPandas(FraudFlags(), OUTPUT, "Append", "None")
             .writeStream.format("json").option("path", os.path.join(work, "spark-out"))
             .option("checkpointLocation", os.path.join(work, "spark-chk")).trigger(availableNow=True).start())
        q.awaitTermination()
        rows = [r.asDict() for r in spark.read.schema(OUTPUT).json(os.path.join(work, "spark-out")).collect()]
        print(f"spark: {len(q.recentProgress)} micro-batches")
        return rows
    finally:
        spark.stop()


def main() -> None:
    work = tempfile.mkdtemp(prefix="pyspark-stateful-")
    t0 = time.perf_counter()
    mine = run_epochstream(work)
    print(f"  {len(mine)} rows, {sum(r['flagged'] for r in mine)} flagged ({time.perf_counter() - t0:.1f} s)")
    if sys.argv[1:] != ["epochstream"]:
        t0 = time.perf_counter()
        theirs = run_spark(work)
        print(f"  {len(theirs)} rows, {sum(r['flagged'] for r in theirs)} flagged ({time.perf_counter() - t0:.1f} s)")

        def canon(rows):
            return sorted(json.dumps(r, sort_keys=True) for r in rows)

        print("same output:", canon(mine) == canon(theirs))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
