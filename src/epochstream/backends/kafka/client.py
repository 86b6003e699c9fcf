"""What the Kafka source and sink share: their errors and how they talk to the cluster.

Every client comes from ``confluent-kafka`` (librdkafka), the optional extra
``epochstream[kafka]``; this module imports it lazily so the rest of epochstream never needs it.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from ...runtime.errors import ConfigurationError, EpochStreamError


class KafkaSourceError(EpochStreamError):
    """Reading a Kafka topic failed; the message names the source uid, topic, partition and offset."""


class KafkaSinkError(EpochStreamError):
    """Writing or committing to a Kafka topic failed; names the sink, topic and epoch."""


def confluent() -> Any:
    """The ``confluent_kafka`` module, or a clear error naming the extra to install."""
    try:
        import confluent_kafka
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ConfigurationError("Kafka sources and sinks need confluent-kafka: pip install 'epochstream[kafka]'") \
            from exc
    return confluent_kafka


def admin(bootstrap_servers: str, settings: dict[str, Any] | None = None) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 3, **(settings or {})})


def topic_metadata(bootstrap_servers: str, what: str, settings: dict[str, Any] | None = None,
                   timeout: float = 10.0) -> Any:
    """Cluster metadata, or an error saying the broker is unreachable (naming ``what`` needed it)."""
    ck = confluent()
    try:
        return admin(bootstrap_servers, settings).list_topics(timeout=timeout)
    except ck.KafkaException as exc:
        raise KafkaSourceError(f"{what}: cannot reach the Kafka cluster at {bootstrap_servers!r} within "
                               f"{timeout}s ({exc.args[0] if exc.args else exc})") from None


def broker_config(bootstrap_servers: str, name: str, settings: dict[str, Any] | None = None,
                  timeout: float = 10.0) -> str | None:
    """One broker setting (of the first broker the cluster names), or None if not reported."""
    from confluent_kafka.admin import ConfigResource

    md = topic_metadata(bootstrap_servers, f"reading broker setting {name}", settings, timeout)
    broker = min(md.brokers)
    res = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    client = admin(bootstrap_servers, settings)  # kept alive until the answer is in
    configs = client.describe_configs([res])[res].result(timeout)
    entry = configs.get(name)
    return None if entry is None else entry.value


#: sources and sinks holding librdkafka clients in this process (see ``release_before_fork``)
_HOLDERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def holds_clients(obj: Any) -> None:
    """Register ``obj`` (with a ``release()`` method) to close its clients before this process forks."""
    _HOLDERS.add(obj)


def release_before_fork() -> None:
    """Close every registered client. The local driver forks workers from the job master's
    process; a librdkafka handle's threads do not survive a fork, and a child that inherits
    the handle (and its locks) can hang when it frees it. The clients open again on next use."""
    for obj in list(_HOLDERS):
        obj.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=release_before_fork)
