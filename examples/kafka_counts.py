"""Kafka -> keyed running count -> Kafka, exactly once, on a real broker started here.

Run it:  python examples/kafka_counts.py     (needs the broker jars: bash scripts/setup.sh fetches them)

A KRaft broker starts from jars/kafka/lib on free ports; 10,000 words go into topic ``words``
(3 partitions). The job reads them with ``from_kafka`` (one split per partition, Kafka offsets
in every epoch's manifest), counts per word, and writes ``word,count`` lines to topic
``counts`` through ``KafkaSink(guarantee="exactly-once")``: one Kafka transaction per epoch,
committed by the job master once the epoch's manifest exists. A consumer at
``read_committed`` then sees every count exactly once.
"""

import collections
import tempfile

from confluent_kafka import Producer

from epochstream import KafkaSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor
from epochstream.backends.kafka import read_topic
from epochstream.deploy.kafka_broker import KafkaCluster


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))

    def process(self, word, ctx):
        self.n.update(self.n.value() + 1)
        yield f"{ctx.key},{self.n.value()}"


with KafkaCluster(1) as kafka:
    kafka.create_topic("words", partitions=3)
    kafka.create_topic("counts", partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    words = [("apple", "pear", "fig", "plum")[i % 4 if i % 3 else 0] for i in range(10_000)]
    for w in words:
        producer.produce("words", value=w.encode())
    producer.flush()

    p = Pipeline("kafka-counts", parallelism=2, checkpoint_interval=0.2)
    (p.from_kafka(kafka.bootstrap_servers, "words", start="earliest", end="latest", uid="words")
      .map(lambda r: r["value"].decode())
      .key_by(lambda w: w)
      .process(Count(), uid="count")
      .sink(KafkaSink(kafka.bootstrap_servers, "counts", key=lambda line: line.split(",")[0],
                      staging=tempfile.mkdtemp()), uid="counts"))
    result = p.run("local", checkpoint_dir=tempfile.mkdtemp())

    lines = [m["value"].decode() for m in read_topic(kafka.bootstrap_servers, "counts")]
    final = collections.Counter()
    for line in lines:
        word, n = line.split(",")
        final[word] = max(final[word], int(n))
    print(f"{len(result.completed_epochs)} epochs; {len(lines)} committed records in 'counts' (read_committed)")
    print("final counts:", dict(final), "expected:", dict(collections.Counter(words)))
    assert final == collections.Counter(words) and len(lines) == len(words)
