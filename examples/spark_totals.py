"""Per-customer totals over a Spark DataFrame, on the spark driver (one barrier task per worker).

    epochstream run examples/spark_totals.py:build --deployment spark --master "local[2,4]" --checkpoint-dir chk
    python examples/spark_totals.py        # the same, from Python, and prints the committed totals

The DataFrame here is made in memory; any Spark source works (``spark.read.parquet(...)``,
JSON, Delta). Its partitions become the source's splits.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from epochstream import FileSink, Pipeline
from epochstream.deploy.spark import spark_session

OUT = Path(tempfile.gettempdir()) / "epochstream-spark-totals"


def build(spark=None) -> Pipeline:
    spark = spark or spark_session("local[2,4]")
    orders = spark.range(0, 50_000, numPartitions=4).selectExpr(
        "concat('c', cast(id % 7 as string)) as customer", "cast(id % 100 as double) as amount")
    p = Pipeline("spark-totals", parallelism=2, checkpoint_interval=0.5)
    (
        p.from_dataframe(orders, uid="orders", path=tempfile.mkdtemp(prefix="orders-snapshot-"))
        .key_by(lambda r: r["customer"])
        .reduce(lambda a, b: {"customer": a["customer"], "amount": a["amount"] + b["amount"]}, uid="totals")
        .sink(FileSink(OUT / "totals"), uid="totals-out")
    )
    return p


if __name__ == "__main__":
    session = spark_session("local[2,4]")
    session.sparkContext.setLogLevel("ERROR")
    result = build(session).run(deployment="spark", spark=session, checkpoint_dir=tempfile.mkdtemp())
    final: dict[str, float] = {}
    for f in sorted((OUT / "totals").glob("part-*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            final[r["customer"]] = max(final.get(r["customer"], 0.0), r["amount"])
    print(f"{len(result.completed_epochs)} epochs, restarts {result.restarts}; totals: {dict(sorted(final.items()))}")
    session.stop()
    sys.exit(0)
