"""Kafka in and out: a replayable source (``source``) and a transactional sink (``sink``), on
confluent-kafka (the optional extra ``epochstream[kafka]``)."""

from .client import KafkaSinkError, KafkaSourceError
from .sink import KafkaSink, read_topic
from .source import KafkaSource

__all__ = ["KafkaSink", "KafkaSinkError", "KafkaSource", "KafkaSourceError", "read_topic"]
