"""A Kafka -> keyed count -> Kafka job in the deterministic simulator, against its in-memory
model of a cluster (``memory://``), with a worker killed and the job master crashing right
after a manifest: the output topic read committed holds each input's count exactly once.
The same pipeline with real bootstrap servers runs on the local and spark drivers
(``examples/kafka_counts.py``).

Run it:  python examples/kafka_sim.py
"""

import json
import tempfile

from epochstream import KafkaSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor
from epochstream.backends.kafka.model import model_cluster
from epochstream.deploy.failures import FailureSchedule
from epochstream.deploy.sim import SimConfig


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))

    def process(self, value, ctx):
        n = self.n.value() + 1
        self.n.update(n)
        return [(ctx.key, n)]


cluster = model_cluster("memory://demo")
cluster.create_topic("clicks", partitions=3)
cluster.create_topic("counts", partitions=1)
for i in range(3000):
    cluster.produce("clicks", str(i).encode(), key=f"user{i % 11}".encode(), partition=i % 3)

p = Pipeline("clicks-per-user", parallelism=2, mode="aligned", checkpoint_interval=0.01)
(p.from_kafka("memory://demo", "clicks", end="latest", uid="clicks")
  .key_by(lambda r: r["key"].decode())
  .process(Count(), uid="count")
  .sink(KafkaSink("memory://demo", "counts", key=lambda r: r[0]), uid="counts"))
# virtual time: the sources read 20K records/s, so the run spans several epochs and both failures
result = p.run(deployment="sim", checkpoint_dir=tempfile.mkdtemp(), sim=SimConfig(source_rate=20_000),
               failures=FailureSchedule(kill_times=[0.03], fail_points={"after_manifest": {3}}))
final = {}
for m in cluster.read("counts"):
    user, n = json.loads(m["value"])
    final[user] = max(final.get(user, 0), n)
print(f"{result.restarts} restarts, {len(cluster.read('counts'))} committed records "
      f"({len(cluster.read('counts', 'read_uncommitted'))} written, aborted ones included), "
      f"final counts sum to {sum(final.values())}")
