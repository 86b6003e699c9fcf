"""``epochstream chaos`` for jobs that write to Kafka: the output topic is the evidence.

The file-sink oracle (``oracle.check_exactly_once``) compares each epoch's staged files; a
``KafkaSink``'s output is a topic, so a Kafka job is checked as a consumer would see it. The job
runs twice, failure-free and with injected failures, each time into fresh output topics (same
partition count as the job's, names ``<topic>-<run>-<token>``; transactional ids and staging
are per run too, so the runs never fence each other). Then each output topic is read at
``read_committed`` and the two runs' records compared as multisets of (key, value): a record
of the failure-free run missing from the chaos run is *lost*, one more often there is
*duplicated*. Read at ``read_uncommitted`` the chaos topic also shows the aborted writes the
transactions hid (``aborted_visible``), proving they did the work. The input must be bounded
(``from_kafka(end="latest")`` or offsets) so both runs read the same records.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .client import admin
from .model import is_model, model_cluster
from .sink import KafkaSink
from .sink import read_topic as _read_real_topic


def read_topic(bootstrap_servers: str, topic: str, isolation: str = "read_committed") -> list[Any]:
    """``sink.read_topic``, or the simulator model's ``KafkaModel.read`` for ``memory://``."""
    if is_model(bootstrap_servers):
        return model_cluster(bootstrap_servers).read(topic, isolation)
    return _read_real_topic(bootstrap_servers, topic, isolation)


@dataclass
class KafkaChaosReport:
    """What the two runs' output topics hold, per sink uid and in total."""

    lost: int = 0
    duplicated: int = 0
    records_expected: int = 0
    records_committed: int = 0
    #: records the chaos topics show at read_uncommitted beyond read_committed (aborted writes)
    aborted_visible: int = 0
    topics: dict[str, dict[str, str]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "lost": self.lost, "duplicated": self.duplicated,
                "records_expected": self.records_expected, "records_committed": self.records_committed,
                "aborted_visible": self.aborted_visible, "topics": self.topics, "examples": self.examples[:10]}


def kafka_sinks(pipeline: Any) -> dict[str, KafkaSink]:
    return {uid: s for uid, s in pipeline.sinks.items() if isinstance(s, KafkaSink)}


def _fresh_topic(sink: KafkaSink, label: str, token: str) -> str:
    """A new topic beside the sink's, with its partition count (and the cluster's replication)."""
    name = f"{sink.topic}-{label}-{token}"
    if is_model(sink.bootstrap_servers):  # the simulator's model of a cluster
        cluster = model_cluster(sink.bootstrap_servers)
        cluster.create_topic(name, cluster.partitions(sink.topic))
        return name
    from confluent_kafka.admin import NewTopic

    client = admin(sink.bootstrap_servers, sink._client_settings())
    md = client.list_topics(sink.topic, timeout=10).topics[sink.topic]
    client.create_topics([NewTopic(name, num_partitions=max(1, len(md.partitions)))])[name].result(30)
    return name


def check_kafka_exactly_once(build: Callable[[], Any], run: Callable[[Any, str, bool], Any],
                             work: str | Path) -> KafkaChaosReport:
    """Run ``build()`` failure-free and then with failures (``run(pipeline, checkpoint_dir,
    failing)``), each into fresh output topics, and compare the topics (module docstring)."""
    work = Path(work)
    token = secrets.token_hex(3)
    seen: dict[str, dict[str, collections.Counter]] = {}
    report = KafkaChaosReport()
    for label, failing in (("reference", False), ("chaos", True)):
        p = build()
        sinks = kafka_sinks(p)
        for uid, sink in sinks.items():
            sink.topic = _fresh_topic(sink, label, token)
            sink.transactional_id_prefix = f"{sink.transactional_id_prefix}{label}-{token}-"
            sink.staging = str(work / label / "staging" / uid)
            report.topics.setdefault(uid, {})[label] = sink.topic
        run(p, str(work / label / "chk"), failing)
        seen[label] = {}
        for uid, sink in sinks.items():
            committed = read_topic(sink.bootstrap_servers, sink.topic, "read_committed")
            seen[label][uid] = collections.Counter((m["key"], m["value"]) for m in committed)
            if failing:
                raw = read_topic(sink.bootstrap_servers, sink.topic, "read_uncommitted")
                report.aborted_visible += len(raw) - len(committed)
    for uid, want in seen["reference"].items():
        got = seen["chaos"].get(uid, collections.Counter())
        lost, extra = want - got, got - want
        report.lost += sum(lost.values())
        report.duplicated += sum(extra.values())
        report.records_expected += sum(want.values())
        report.records_committed += sum(got.values())
        for (key, value), n in list(lost.items())[:3]:
            report.examples.append(f"sink {uid}: {n} x key={key!r} value={value!r} lost")
        for (key, value), n in list(extra.items())[:3]:
            report.examples.append(f"sink {uid}: {n} x key={key!r} value={value!r} duplicated")
    return report
