"""An in-memory model of a Kafka cluster for the simulator (``deployment="sim"``).

Theory of operation. The simulator runs a whole job in one thread on a virtual clock, so it
cannot wait on a real broker, so it runs against a model. ``KafkaModel`` keeps what the
source and the sink rely on, and nothing else:

- topics of partitions, each a log of entries at consecutive **offsets**; a transaction's
  commit or abort writes a **control entry** (a marker) that takes an offset, as in Kafka,
  so offsets have gaps a reader must step over;
- **transactions** per transactional id: ``begin``, ``produce`` (entries open), ``commit`` /
  ``abort`` (they become committed or aborted, a marker follows on every partition they
  touched); ``init_transactions`` aborts the id's open transaction, as librdkafka's does;
- ``read_committed`` reads stop at the **last stable offset** (the first entry of a
  transaction still open) and skip aborted entries; ``read_uncommitted`` sees every record;
- **group offsets** (``commit_offsets``), and ``send_offsets`` inside a transaction, which
  commit atomically with it: the sink's marker.

Clusters are named: ``bootstrap_servers="memory://<name>"`` in ``Pipeline.from_kafka`` and
``KafkaSink`` selects ``model_cluster(name)`` (``ModelKafkaSource``, ``ModelKafkaSink``).
They live in this process, so only the simulator runs them; the local and spark drivers
refuse them (their workers are other processes).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ...runtime.errors import UserFunctionError
from ...runtime.sources import Source
from .client import KafkaSinkError, KafkaSourceError
from .sink import KafkaSink

SCHEME = "memory://"

#: entry states
OPEN, COMMITTED, ABORTED, CONTROL = "open", "committed", "aborted", "control"


@dataclass
class Entry:
    """One offset of a partition's log: a record, or a transaction's control marker."""

    key: bytes | None
    value: bytes | None
    timestamp: int | None
    headers: list[tuple[str, bytes]] | None
    #: ``OPEN`` (in a transaction not finished), ``COMMITTED``, ``ABORTED`` or ``CONTROL``
    state: str
    txn: str | None = None


@dataclass
class _Txn:
    #: (topic, partition, offset) of the entries it wrote
    entries: list[tuple[str, int, int]] = field(default_factory=list)
    #: group offsets sent to the transaction: group -> {(topic, partition): offset}
    offsets: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)


class KafkaModel:
    """An in-memory Kafka cluster (see the module docstring). Not thread-safe: the simulator
    is one thread."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self.topics: dict[str, list[list[Entry]]] = {}
        self.groups: dict[str, dict[tuple[str, int], int]] = {}
        self._txns: dict[str, _Txn] = {}
        #: a clock for records produced without a timestamp (ms); only grows
        self.now_ms = 0

    # ------------------------------------------------------------ topics
    def create_topic(self, topic: str, partitions: int = 1) -> None:
        if topic in self.topics:
            raise KafkaSourceError(f"{SCHEME}{self.name}: topic {topic!r} exists already")
        self.topics[topic] = [[] for _ in range(partitions)]

    def create_partitions(self, topic: str, total: int) -> None:
        parts = self._topic(topic, "create_partitions")
        parts.extend([] for _ in range(total - len(parts)))

    def _topic(self, topic: str, what: str) -> list[list[Entry]]:
        parts = self.topics.get(topic)
        if parts is None:
            raise KafkaSourceError(f"{what}: topic {topic!r} does not exist at {SCHEME}{self.name}")
        return parts

    def partitions(self, topic: str) -> int:
        return len(self._topic(topic, "partitions"))

    # ------------------------------------------------------------ producing
    def produce(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None,
                timestamp: int | None = None, headers: list[tuple[str, bytes]] | None = None,
                transactional_id: str | None = None) -> tuple[int, int]:
        """Append a record (in ``transactional_id``'s open transaction, if given); returns
        (partition, offset). Without ``partition``: by key (crc32), else partition 0."""
        parts = self._topic(topic, f"produce to {topic!r}")
        if partition is None:
            import zlib

            partition = zlib.crc32(key) % len(parts) if key is not None else 0
        if not 0 <= partition < len(parts):
            raise KafkaSinkError(f"produce to topic {topic!r}: no partition {partition} (it has {len(parts)})")
        if timestamp is None:
            self.now_ms += 1
            timestamp = self.now_ms
        state = COMMITTED
        if transactional_id is not None:
            txn = self._txns.get(transactional_id)
            if txn is None:
                raise KafkaSinkError(f"transactional id {transactional_id!r} has no open transaction")
            state = OPEN
        log = parts[partition]
        log.append(Entry(key, value, timestamp, headers, state, transactional_id))
        if transactional_id is not None:
            self._txns[transactional_id].entries.append((topic, partition, len(log) - 1))
        return partition, len(log) - 1

    # ------------------------------------------------------------ transactions
    def init_transactions(self, transactional_id: str) -> None:
        """A new producer for the id: its open transaction, if any, is aborted (fencing)."""
        if transactional_id in self._txns:
            self._finish(transactional_id, ABORTED)

    def begin(self, transactional_id: str) -> None:
        if transactional_id in self._txns:
            raise KafkaSinkError(f"transactional id {transactional_id!r} already has an open transaction")
        self._txns[transactional_id] = _Txn()

    def send_offsets(self, transactional_id: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Group offsets that commit with the transaction (``send_offsets_to_transaction``)."""
        self._txns[transactional_id].offsets.setdefault(group, {}).update(offsets)

    def commit(self, transactional_id: str) -> None:
        self._finish(transactional_id, COMMITTED)

    def abort(self, transactional_id: str) -> None:
        self._finish(transactional_id, ABORTED)

    def _finish(self, transactional_id: str, state: str) -> None:
        txn = self._txns.pop(transactional_id)
        touched = set()
        for topic, partition, offset in txn.entries:
            self.topics[topic][partition][offset].state = state
            touched.add((topic, partition))
        for topic, partition in sorted(touched):  # the control marker takes an offset
            self.topics[topic][partition].append(Entry(None, None, None, None, CONTROL, transactional_id))
        if state == COMMITTED:
            for group, offs in txn.offsets.items():
                self.groups.setdefault(group, {}).update(offs)

    def open_transactions(self) -> list[str]:
        return sorted(self._txns)

    # ------------------------------------------------------------ reading
    def last_stable_offset(self, topic: str, partition: int) -> int:
        log = self._topic(topic, "last_stable_offset")[partition]
        for i, e in enumerate(log):
            if e.state == OPEN:
                return i
        return len(log)

    def fetch(self, topic: str, partition: int, offset: int, count: int,
              isolation: str = "read_committed") -> tuple[list[tuple[int, Entry]], int]:
        """Up to ``count`` records from ``offset`` and the offset after the last entry looked
        at (past control markers and, read committed, aborted records; never past the last
        stable offset)."""
        log = self._topic(topic, "fetch")[partition]
        stop = len(log) if isolation == "read_uncommitted" else self.last_stable_offset(topic, partition)
        out: list[tuple[int, Entry]] = []
        pos = offset
        while pos < stop and len(out) < count:
            e = log[pos]
            if e.state == CONTROL or (e.state == ABORTED and isolation != "read_uncommitted"):
                pos += 1
                continue
            out.append((pos, e))
            pos += 1
        return out, pos

    def read(self, topic: str, isolation: str = "read_committed") -> list[dict[str, Any]]:
        """Every record of ``topic`` up to the ends (read committed: up to the last stable
        offsets), as ``read_topic`` returns them from a real cluster."""
        out: list[dict[str, Any]] = []
        for p in range(self.partitions(topic)):
            for off, e in self.fetch(topic, p, 0, 1 << 62, isolation)[0]:
                out.append({"key": e.key, "value": e.value, "partition": p, "offset": off})
        return out

    def committed_offset(self, group: str, topic: str, partition: int) -> int:
        """The group's offset of the partition (-1 if none)."""
        return self.groups.get(group, {}).get((topic, partition), -1)

    def commit_offsets(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        self.groups.setdefault(group, {}).update(offsets)


_CLUSTERS: dict[str, KafkaModel] = {}


def model_cluster(name: str) -> KafkaModel:
    """The model cluster ``memory://<name>`` (created on first use; ``name`` may carry the scheme)."""
    if name.startswith(SCHEME):
        name = name[len(SCHEME):]
    cluster = _CLUSTERS.get(name)
    if cluster is None:
        cluster = _CLUSTERS[name] = KafkaModel(name)
    return cluster


def is_model(bootstrap_servers: str) -> bool:
    return isinstance(bootstrap_servers, str) and bootstrap_servers.startswith(SCHEME)


# ---------------------------------------------------------------- the source and sink over the model


class ModelKafkaSource(Source):
    """``from_kafka("memory://<name>", topics, ...)``: the Kafka source's contract (one split
    per partition sorted by (topic, partition), Kafka offsets in the manifest, read committed,
    ``start``/``end``, the same record dicts or Arrow batches) over a ``KafkaModel``."""

    def __init__(self, bootstrap_servers: str, topics: Any, start: Any = "earliest", end: Any = None,
                 group_id: str | None = None, key_deserializer: Any = None, value_deserializer: Any = None,
                 records: str | None = None) -> None:
        from .records import records_format

        #: "arrow": one RecordBatch per read, as the real source's; "dict": a dict per record
        self.records = records_format(records, key_deserializer, value_deserializer, f"from_kafka({topics!r})")
        self.bootstrap_servers = bootstrap_servers
        cluster = model_cluster(bootstrap_servers)
        if isinstance(topics, re.Pattern):
            names = sorted(t for t in cluster.topics if topics.fullmatch(t))
            if not names:
                raise KafkaSourceError(f"from_kafka({topics!r}): no topic matches at {bootstrap_servers}")
        else:
            names = [topics] if isinstance(topics, str) else list(topics)
        self.topics = names
        self.partitions = [(t, p) for t in names for p in range(len(cluster._topic(t, f"from_kafka({t!r})")))]
        self.num_splits = len(self.partitions)
        self.group_id = group_id
        self.key_deserializer, self.value_deserializer = key_deserializer, value_deserializer
        self.start_offsets = self._resolve(start, "start")
        self.end_offsets = None if end is None else self._resolve(end, "end")

    @property
    def cluster(self) -> KafkaModel:
        return model_cluster(self.bootstrap_servers)

    def _resolve(self, spec: Any, what: str) -> list[int]:
        c = self.cluster
        if spec == "earliest":
            return [0] * self.num_splits
        if spec == "latest":
            return [c.last_stable_offset(*tp) for tp in self.partitions]
        if isinstance(spec, dict):
            from .source import _split_key

            given = {_split_key(k, self.topics): int(v) for k, v in spec.items()}
            unknown = set(given) - set(self.partitions)
            if unknown:
                raise KafkaSourceError(f"from_kafka: {what} offsets name partitions the topics do not have: "
                                       f"{sorted(unknown)}")
            return [given.get(tp, 0 if what == "start" else c.last_stable_offset(*tp)) for tp in self.partitions]
        raise ValueError(f"from_kafka({self.bootstrap_servers!r}): {what} must be 'earliest', 'latest' or offsets "
                         f"(the model keeps no time index), got {spec!r}")

    def start_offset(self, split: int) -> int:
        return self.start_offsets[split]

    def split_length(self, split: int) -> int | None:
        return None if self.end_offsets is None else self.end_offsets[split]

    def read(self, split: int, offset: int, count: int) -> Any:
        return self.read_next(split, offset, count)[0]

    def read_next(self, split: int, offset: int, count: int) -> tuple[Any, int]:
        end = self.split_length(split)
        if end is not None:
            if offset >= end:
                return [], offset
        topic, partition = self.partitions[split]
        got, after = self.cluster.fetch(topic, partition, offset, count)
        if end is not None:
            after = min(after, end)
            if got and got[-1][0] >= end:
                got = [(o, e) for o, e in got if o < end]
        return self._records(topic, partition, got), after

    def _records(self, topic: str, partition: int, got: list[tuple[int, Entry]]) -> Any:
        if not got:
            return []
        if self.records == "arrow":
            from .records import columns_batch

            return columns_batch(topic, partition, [e.key for _o, e in got], [e.value for _o, e in got],
                                 [o for o, _e in got], [e.timestamp for _o, e in got],
                                 [e.headers for _o, e in got])
        return [self._record(topic, partition, off, e) for off, e in got]

    def _record(self, topic: str, partition: int, offset: int, e: Entry) -> dict[str, Any]:
        key, value = e.key, e.value
        try:
            if self.key_deserializer is not None:
                key = self.key_deserializer(key)
            if self.value_deserializer is not None:
                value = self.value_deserializer(value)
        except Exception as exc:
            raise UserFunctionError(f"source {self.uid!r}: the deserializer rejected the record at topic {topic!r} "
                                    f"partition {partition} offset {offset}: {exc!r}") from exc
        return {"key": key, "value": value, "topic": topic, "partition": partition, "offset": offset,
                "timestamp": e.timestamp, "headers": list(e.headers or [])}

    def read_range(self, split: int, start: int, stop: int) -> Any:
        """The records at Kafka offsets [start, stop) (one RecordBatch with ``records="arrow"``):
        reads until the offset reaches ``stop`` (offsets have gaps: transaction markers, aborted
        records)."""
        got: list[tuple[int, Entry]] = []
        pos = start
        topic, partition = self.partitions[split]
        end = self.split_length(split)
        while pos < stop:
            part, after = self.cluster.fetch(topic, partition, pos, stop - pos)
            got.extend((o, e) for o, e in part if o < stop and (end is None or o < end))
            if after == pos and not part:
                break  # nothing there (yet): the manifest's offset is past what the cluster holds now
            pos = after
        out = self._records(topic, partition, got)
        if self.records == "arrow" and not got:
            from .records import concat_reads

            return concat_reads([])
        return out

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        """Every record from the start offsets up to ``offsets``, as dict rows."""
        from .records import rows_of

        out: list[Any] = []
        for split in range(self.num_splits):
            start = self.start_offsets[split]
            out.extend(rows_of(self.read_range(split, start, int(offsets.get(split, start)))))
        return out

    def epoch_completed(self, offsets: dict[Any, Any]) -> None:
        """The manifest's offsets to the consumer group, for monitoring (as the real source)."""
        self.cluster.commit_offsets(self.group_id or f"epochstream-{self.uid}",
                                    {self.partitions[int(s)]: int(o) for s, o in offsets.items()})

    def __repr__(self) -> str:
        return f"ModelKafkaSource({self.bootstrap_servers!r}, {self.topics!r}, {self.num_splits} partitions)"


class ModelKafkaSink(KafkaSink):
    """``KafkaSink("memory://<name>", topic, ...)``: the real sink's protocol (each subtask's
    output staged and produced into its own open transaction at pre-commit, committed with its
    marker once the master says the epoch's manifest exists; recovery that aborts what is open
    and produces again what a manifest has and the cluster lacks) against a ``KafkaModel``.
    Only the I/O primitives differ from the real sink's."""

    def __init__(self, bootstrap_servers: str, topic: str, guarantee: str = "exactly-once", **kwargs: Any) -> None:
        super().__init__(bootstrap_servers, topic, guarantee, **kwargs)

    @property
    def cluster(self) -> KafkaModel:
        return model_cluster(self.bootstrap_servers)

    def __repr__(self) -> str:
        return f"ModelKafkaSink({self.bootstrap_servers!r}, {self.topic!r}, guarantee={self.guarantee!r})"

    def _produce_messages(self, messages: Any, transactional_id: str | None) -> None:
        for key, value, headers, part in messages:
            self.cluster.produce(self.topic, value, key=key, partition=part, headers=headers,
                                 transactional_id=transactional_id)

    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        if self.guarantee == "exactly-once" or not records:
            return super().pre_commit(uid, subtask, epoch, attempt, records)
        from .sink import _Messages

        self._produce_messages(records if isinstance(records, _Messages) else [self.encode(r) for r in records], None)
        return None

    def _check_topic(self, uid: str) -> None:
        if self.topic not in self.cluster.topics:
            raise KafkaSinkError(f"sink {uid!r}: topic {self.topic!r} does not exist at {self.bootstrap_servers}")

    def start(self, uid: str, job: str, manifest: dict[str, Any] | None) -> None:
        self._check_topic(uid)

    # the transactional primitives, on the model
    def _new_txn_producer(self, tid: str) -> Any:
        self.cluster.init_transactions(tid)  # aborts what is open, as librdkafka's does
        return tid

    def _fence(self, tids: list[str]) -> None:
        for tid in tids:
            self._txn_producer(tid)

    def _txn_produce(self, tid: str, messages: Any, epoch: int) -> None:
        self._txn_producer(tid)
        self.cluster.begin(tid)
        self._produce_messages(messages, tid)

    def _txn_commit(self, tid: str, group: str, epoch: int) -> bool:
        self.cluster.send_offsets(tid, group, {(self.topic, 0): epoch})
        self.cluster.commit(tid)
        return True

    def read_marker(self, uid: str, subtask: int) -> int:
        return self.cluster.committed_offset(self.marker_group(uid, subtask), self.topic, 0)

    def release(self) -> None:
        self._producer = None

    def _close_transactions(self) -> None:
        self._txn_producers.clear()

    def read(self, isolation: str = "read_committed") -> list[Any]:
        """The topic's records (values decoded as JSON where they are JSON, else bytes)."""
        out = []
        for m in self.cluster.read(self.topic, isolation):
            try:
                out.append(json.loads(m["value"]))
            except (TypeError, ValueError):
                out.append(m["value"])
        return out
