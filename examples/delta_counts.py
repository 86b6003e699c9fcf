"""Committed state and output as Delta tables: a running count per key, queried with Spark SQL.

Run it:  python examples/delta_counts.py      (needs the jars: bash scripts/setup.sh fetches them)

Each completed epoch is one Delta transaction on the operator's state table
(checkpoints/delta-counts/delta/count) and one on the sink table (out/delta-counts): a
restart re-issues a commit that may have happened, and Delta skips it (txnAppId/txnVersion).
The key and the state declare types (PyFlink's ``Types``), so the state table has the typed
columns ``typed_key STRING`` and ``typed_n BIGINT`` beside the pickled bytes. The state table is
a changelog (each epoch appends what it changed, compacted in the background): ``read_state``
folds it to the state as of an epoch (the newest row per key, by time travel to its version).
"""

import shutil

import pyarrow as pa

from epochstream import CheckpointConfig, KeyedProcessFunction, Pipeline, Types, ValueStateDescriptor
from epochstream.backends import spark_session
from epochstream.backends.delta import DeltaCheckpointStorage, DeltaSink, read_state


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", Types.LONG(), default=0))

    def process(self, word, ctx):
        self.n.update(self.n.value() + 1)
        yield (ctx.key, self.n.value())


words = [w for i in range(200_000) for w in ("apple", "pear", "fig")[: 1 + i % 3]]
p = Pipeline("delta-counts", parallelism=2, mode="aligned",
             checkpoint=CheckpointConfig(interval=0.5, state_backend="delta"))
(p.from_collection(words)
  .key_by(lambda w: w, key_type=Types.STRING())
  .process(Count(), uid="count")
  .sink(DeltaSink("out/delta-counts", pa.schema([("word", pa.string()), ("n", pa.int64())])), uid="counts"))

chk = "checkpoints/delta-counts"
shutil.rmtree(chk, ignore_errors=True)              # a fresh run each time (restore="latest" resumes instead)
shutil.rmtree("out/delta-counts", ignore_errors=True)
result = p.run(deployment="local", checkpoint_dir=chk)
print("completed epochs:", result.completed_epochs)

spark = spark_session.get_spark()                   # the same local session the job master used
state = DeltaCheckpointStorage(chk)
table = state.table_path("count")
for epoch in result.completed_epochs:               # time travel: the committed state of each epoch
    manifest, _ = state.load_manifest(epoch)
    version = manifest["delta"]["state"]["count"]["version"]
    rows = (read_state(spark, table, version=version).filter("state = 'n'").select("typed_key", "typed_n")
            .orderBy("typed_key").collect())
    print(f"epoch {epoch} (Delta version {version}):", [(r.typed_key, r.typed_n) for r in rows])
sink = p.sinks["counts"]                            # the committed output, one append per epoch
spark.read.format("delta").load(sink.path).groupBy("word").max("n").orderBy("word").show()
print("sink commits (epoch, Delta version):", sink.epochs())
spark_session.stop()
