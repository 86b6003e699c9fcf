"""Kafka JSON -> from_json -> applyInPandasWithState -> Kafka, exactly once, on a real broker started here.

Run it:  python examples/kafka_json_pandas.py     (needs the broker jars: bash scripts/setup.sh fetches them;
         and pyspark with pandas for the pandas function: pip install 'epochstream[spark]')

A KRaft broker starts from jars/kafka/lib on free ports; 6,000 JSON click events go into topic ``clicks``
(3 partitions), every 500th one malformed. The job reads them as Arrow batches (``from_kafka``'s default
``records="arrow"``: no dict per record), decodes the JSON with ``from_json`` and a Spark DDL schema (one pyarrow
JSON read per batch; records that do not decode go to topic ``clicks-dead`` with their partition, offset and the
reason), keeps a running count of clicks per user with an unchanged ``applyInPandasWithState`` function (its
pandas frames are made from the batches, grouped with Arrow), and writes ``{"user", "n", "page"}`` rows to topic
``counts`` through ``KafkaSink``: one Kafka transaction per epoch, committed once the epoch's manifest exists.
"""

import collections
import json
import tempfile

import pandas as pd
from confluent_kafka import Producer

from epochstream import KafkaSink, Pipeline
from epochstream.backends.kafka import read_topic
from epochstream.deploy.kafka_broker import KafkaCluster

N = 6_000


def clicks_per_user(key, pdfs, state):
    """applyInPandasWithState: the running count of each user's clicks, one row per click."""
    count = state.get[0] if state.exists else 0
    for pdf in pdfs:
        n = len(pdf)
        yield pd.DataFrame({"user": [key[0]] * n, "n": range(count + 1, count + n + 1), "page": pdf["page"]})
        count += n
    state.update((count,))


with KafkaCluster(1) as kafka:
    kafka.create_topic("clicks", partitions=3)
    kafka.create_topic("counts", partitions=2)
    kafka.create_topic("clicks-dead", partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 5})
    users = collections.Counter()
    for i in range(N):
        if i % 500 == 499:
            value = b'{"user": "u1", "page": '  # cut short: a dead letter
        else:
            user = f"u{(i * 7) % 23}"
            users[user] += 1
            value = json.dumps({"user": user, "page": f"/p/{i % 40}", "ts": "2024-05-01T12:00:00Z"}).encode()
        producer.produce("clicks", value=value, partition=i % 3)
    producer.flush()

    p = Pipeline("clicks", parallelism=2, checkpoint_interval=0.1)
    (p.from_kafka(kafka.bootstrap_servers, "clicks", end="latest", uid="clicks")
      .from_json("user string NOT NULL, page string, ts timestamp", uid="decode",
                 dead_letter=KafkaSink(kafka.bootstrap_servers, "clicks-dead", staging=tempfile.mkdtemp()))
      .apply_in_pandas_with_state(clicks_per_user, "user string, n long, page string", "count long", "append",
                                  "NoTimeout", key="user", uid="count")
      .sink(KafkaSink(kafka.bootstrap_servers, "counts", key=lambda r: r["user"], staging=tempfile.mkdtemp()),
            uid="counts"))
    result = p.run("local", checkpoint_dir=tempfile.mkdtemp())

    rows = [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, "counts")]
    final = collections.Counter()
    for r in rows:
        final[r["user"]] = max(final[r["user"]], r["n"])
    dead = [json.loads(m["value"]) for m in read_topic(kafka.bootstrap_servers, "clicks-dead")]
    print(f"{len(result.completed_epochs)} epochs; {len(rows)} counts committed (read_committed); "
          f"{len(dead)} dead letters (metrics: {result.metrics['dead_letters']}), e.g. {dead[0]}")
    assert final == users and len(rows) == sum(users.values()) and len(dead) == N // 500
