"""A real Kafka broker for the test session (KRaft, from jars/kafka/lib; scripts/setup.sh).

``kafka``: one broker for the whole session (started on first use, about 10 s); tests make
their own topics with ``new_topic``. ``kafka3``: three brokers for the fault tests, started
per module that asks for them. Missing jars or Java fail the tests that use them: no skip.
"""

from __future__ import annotations

import itertools

import pytest

_names = itertools.count()


@pytest.fixture(scope="session")
def kafka():
    from epochstream.deploy.kafka_broker import KafkaCluster

    cluster = KafkaCluster(1).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def kafka3():
    from epochstream.deploy.kafka_broker import KafkaCluster

    # a dead broker is noticed in 2 s instead of 9 (broker.session.timeout.ms), so leaders move soon
    cluster = KafkaCluster(3, settings={"broker.session.timeout.ms": 2000, "broker.heartbeat.interval.ms": 300}).start()
    yield cluster
    cluster.stop()


def new_topic(cluster, prefix: str, partitions: int = 2, replication: int | None = None) -> str:
    name = f"{prefix}-{next(_names)}"
    cluster.create_topic(name, partitions, replication)
    return name


def produce(cluster, topic: str, records, transactional: bool = False) -> None:
    """``records``: (key, value) pairs of bytes/str, produced and flushed."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": cluster.bootstrap_servers, "log_level": 3, "linger.ms": 5})
    for k, v in records:
        p.produce(topic, key=k, value=v)
        p.poll(0)
    assert p.flush(30) == 0
