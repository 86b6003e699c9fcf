"""A Kafka sink: exactly-once through Kafka transactions, or at-least-once, or fire-and-forget.

Theory of operation (``guarantee="exactly-once"``). Flink's ``KafkaSink`` keeps one Kafka
transaction open per subtask per checkpoint and commits it when the checkpoint completes; if
the job dies after the checkpoint and before that commit, Flink's recovery resumes the
transaction (by reflection into the Java producer). librdkafka cannot resume another process's
transaction, and ``init_transactions`` of a new producer with the same transactional id aborts
it, so that window would lose the epoch's output. This sink closes the window differently:

1. **pre-commit** (each sink subtask, when its epoch's snapshot is taken): the epoch's output,
   already encoded as Kafka messages, is *staged* durably as one file under ``staging`` (a
   local folder or ``s3://`` prefix, like ``FileSink``'s staging). The staged name goes into
   the epoch's manifest with the rest of the snapshot.
2. **commit** (the job master, once the manifest exists, ``commit_epoch``): one transaction
   per sink per epoch on the producer ``<prefix><sink uid>``: ``begin_transaction``, produce
   every staged message of the epoch, and ``send_offsets_to_transaction`` of a *marker*: the
   consumer group ``<prefix><sink uid>`` gets offset ``epoch`` on partition 0 of the output
   topic. Offsets sent that way commit atomically with the records, so the group's offset says
   which epoch Kafka last committed. Then ``commit_transaction``, then the staged files go.
3. **recovery** (``start`` and ``recover``, before any new write): ``init_transactions`` of the
   producer aborts whatever transaction of this sink is still open (a master killed
   mid-commit) and fences the old producer, so nothing lingers to hold ``read_committed``
   consumers back. Then the marker is read: if it is below the restored manifest's epoch, that
   epoch's output is produced again from its staged files in a new transaction (the manifest
   committed it and Kafka did not); if not, Kafka has it already. Staged files of later
   epochs (never in a manifest) are deleted.

Consumers at ``isolation.level=read_committed`` see each epoch's output exactly once; at
``read_uncommitted`` they also see the records of transactions that were aborted, which is how
the tests show the transactions doing the work. The cost is one staged write per subtask per
epoch and the master producing all of the sink's output (one producer per sink: the
transactional id needs no subtask number or pool, because only the master commits).

``"at-least-once"``: each subtask produces its output at pre-commit with an idempotent
producer and waits for every acknowledgement before its ack (Flink's flush on checkpoint):
nothing is lost, a replay after a failure writes again. ``"none"``: produced at pre-commit,
not awaited.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import tempfile
import time
from typing import Any, Callable, Iterable

from ...runtime.errors import ConfigurationError, UserFunctionError
from ..base import TransactionalSink
from ..objects import safe_name as _safe
from .client import KafkaSinkError, broker_config, confluent, holds_clients

STAGING = "_staging"
GUARANTEES = ("exactly-once", "at-least-once", "none")
#: a message as staged: (key, value, headers, partition or None)
Message = tuple["bytes | None", "bytes | None", "list[tuple[str, bytes]] | None", "int | None"]
_STAGED = re.compile(r"/e(\d+)-s(\d+)-a[^/]+\.msgs$")

log = logging.getLogger(__name__)


#: one encoder for every record: ``json.dumps`` with arguments builds a new encoder per call,
#: which cost as much as the encoding itself (a worker's hottest line in the Kafka benchmark)
_JSON = json.JSONEncoder(default=repr, separators=(",", ":")).encode


def to_bytes(x: Any) -> bytes | None:
    """The default encoding of a key or value: bytes and None pass, str is UTF-8, anything else JSON."""
    if x is None or isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    return _JSON(x).encode("utf-8")


class _Messages(list):
    """One epoch's records of a subtask, already encoded by its writer."""


class _MessageWriter:
    """Per-subtask buffer: encodes records into messages as they arrive."""

    __slots__ = ("sink", "buf")

    def __init__(self, sink: "KafkaSink") -> None:
        self.sink = sink
        self.buf = _Messages()

    def write(self, records: list[Any]) -> None:
        self.buf.extend(map(self.sink.encode, records))

    def take(self) -> _Messages:
        out, self.buf = self.buf, _Messages()
        return out


class KafkaSink(TransactionalSink):
    """Records to a Kafka topic with the given ``guarantee`` (see the module docstring).

    ``key`` / ``value``: record -> bytes (default: the record itself as the value, no key; bytes
    and str pass through, anything else becomes JSON); ``headers``: record -> list of (name,
    bytes); ``partitioner``: record -> partition number (default: librdkafka's, by key);
    ``staging``: where exactly-once stages output (default: a folder under the system temp
    dir named for the topic; production jobs point it at durable storage, e.g. beside the
    checkpoints); ``transactional_id_prefix``: default ``epochstream-<topic>-``;
    ``transaction_timeout``: seconds a commit's transaction may stay open (must not exceed the
    broker's ``transaction.max.timeout.ms``, checked at start); ``producer_settings``: any
    librdkafka producer setting.
    """

    def __new__(cls, bootstrap_servers: Any = None, *args: Any, **kwargs: Any) -> "KafkaSink":
        """``bootstrap_servers="memory://<name>"``: the simulator's model of a cluster
        (``backends.kafka.model.ModelKafkaSink``)."""
        if cls is KafkaSink and isinstance(bootstrap_servers, str) and bootstrap_servers.startswith("memory://"):
            from .model import ModelKafkaSink

            return super().__new__(ModelKafkaSink)
        return super().__new__(cls)

    def __init__(self, bootstrap_servers: str, topic: str, guarantee: str = "exactly-once",
                 key: Callable[[Any], Any] | None = None, value: Callable[[Any], Any] | None = None,
                 headers: Callable[[Any], Any] | None = None, partitioner: Callable[[Any], int] | None = None,
                 staging: Any = None, transactional_id_prefix: str | None = None,
                 transaction_timeout: float = 60.0, producer_settings: dict[str, Any] | None = None) -> None:
        if guarantee not in GUARANTEES:
            raise ValueError(f"KafkaSink: guarantee must be one of {GUARANTEES}, got {guarantee!r}")
        if not bootstrap_servers.startswith("memory://"):  # the simulator's model needs no client
            confluent()
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.guarantee = guarantee
        self.key_fn, self.value_fn, self.headers_fn, self.partitioner = key, value, headers, partitioner
        self.transactional_id_prefix = transactional_id_prefix or f"epochstream-{topic}-"
        self.transaction_timeout = transaction_timeout
        self.producer_settings = dict(producer_settings or {})
        #: the master commits once per sink per epoch (``commit_epoch``), not once per staged file
        self.epoch_transactions = guarantee == "exactly-once"
        #: its commits are Kafka transactions, not Spark jobs (the spark driver needs no spare slot)
        self.commits_with_spark = False
        self.staging = staging if staging is not None else os.path.join(
            tempfile.gettempdir(), "epochstream-kafka-staging", _safe(topic))
        self._store: Any = None
        self._producer: Any = None
        self._marker_consumer: Any = None
        #: newest epoch Kafka committed for this sink (from the marker), per transactional id
        self._marker: dict[str, int] = {}
        #: test hook: called with a step name inside ``commit_epoch`` ("produced", "committed")
        self.fail_hook: Callable[[str], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_producer": None, "_marker_consumer": None, "_marker": {},
                "fail_hook": None}

    def __repr__(self) -> str:
        return f"KafkaSink({self.bootstrap_servers!r}, {self.topic!r}, guarantee={self.guarantee!r})"

    # ------------------------------------------------------------ encoding
    def encode(self, record: Any) -> Message:
        try:
            key = to_bytes(self.key_fn(record)) if self.key_fn is not None else None
            value = to_bytes(self.value_fn(record) if self.value_fn is not None else record)
            headers = list(self.headers_fn(record)) if self.headers_fn is not None else None
            part = int(self.partitioner(record)) if self.partitioner is not None else None
        except Exception as exc:
            raise UserFunctionError(f"Kafka sink to topic {self.topic!r}: encoding record {record!r} failed: "
                                    f"{exc!r}") from exc
        return key, value, headers, part

    def writer(self) -> _MessageWriter:
        return _MessageWriter(self)

    @property
    def store(self) -> Any:
        if self._store is None:
            from .. import open_objects

            self._store = open_objects(self.staging)
        return self._store

    # ------------------------------------------------------------ producing
    def _produce_all(self, producer: Any, messages: Iterable[Message], epoch: int, track: bool = True,
                     flush: float | None = None) -> None:
        """Hand every message to the producer. ``track``: count failed deliveries and raise
        (at-least-once and none); ``flush``: first wait up to that many seconds for every
        acknowledgement (at-least-once). A transaction needs no tracking: ``commit_transaction``
        flushes and fails if any message of the transaction was not delivered, so its loop
        makes no Python callback or poll per record (the master's commit cost)."""
        ck = confluent()
        errors: list[Any] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)

        topic = self.topic
        produce = producer.produce
        on_delivery = delivered if track else None
        for n, (key, value, headers, part) in enumerate(messages):
            kwargs: dict[str, Any] = {}
            if on_delivery is not None:
                kwargs["on_delivery"] = on_delivery
            if headers:
                kwargs["headers"] = headers
            if part is not None:
                kwargs["partition"] = part
            while True:
                try:
                    produce(topic, value, key, **kwargs)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.05)
                except ck.KafkaException as exc:
                    raise KafkaSinkError(f"sink to topic {self.topic!r}, epoch {epoch}: produce failed: "
                                         f"{exc.args[0]}") from None
            if track and not n & 1023:
                producer.poll(0)  # serve delivery reports as they come, not all at the flush
        if flush is not None:
            left = producer.flush(flush)
            if left:
                raise KafkaSinkError(f"sink to topic {self.topic!r}, epoch {epoch}: {left} records unacknowledged "
                                     f"after {flush}s")
        elif track:
            producer.poll(0)
        if errors:
            raise KafkaSinkError(f"sink to topic {self.topic!r}, epoch {epoch}: {len(errors)} records were not "
                                 f"delivered (first: {errors[0]})")

    def _plain_producer(self) -> Any:
        if self._producer is None:
            ck = confluent()
            settings = {"bootstrap.servers": self.bootstrap_servers, "linger.ms": 5, "log_level": 3,
                        **self.producer_settings}
            if self.guarantee == "at-least-once":
                settings.setdefault("enable.idempotence", True)
            self._producer = ck.Producer(settings)
            holds_clients(self)
        return self._producer

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Exactly-once: stage the epoch's messages (the staged name goes into the manifest).
        At-least-once: produce and wait for every acknowledgement. None: produce."""
        if not records:
            return None
        messages = records if isinstance(records, _Messages) else [self.encode(r) for r in records]
        if self.guarantee != "exactly-once":
            wait = self.transaction_timeout if self.guarantee == "at-least-once" else None
            self._produce_all(self._plain_producer(), messages, epoch, flush=wait)
            return None
        rel = f"{STAGING}/{_safe(uid)}/e{epoch}-s{subtask}-a{attempt}.msgs"
        self.store.put(self.store.root / rel, pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL))
        return rel

    def commit(self, staged: Iterable[str]) -> int:
        """Per-file commits are not how this sink commits (``epoch_transactions``); nothing to do
        for the other guarantees either."""
        return 0

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.store.root / rel)

    def manifest_entry(self, uid: str) -> dict[str, Any]:
        """What the manifest records about this sink's commit: its transactional id."""
        return {"transactional_id": self.transactional_id(uid), "marker_group": self.transactional_id(uid)}

    def transactional_id(self, uid: str) -> str:
        return f"{self.transactional_id_prefix}{uid}"

    def start(self, uid: str, job: str, manifest: dict[str, Any] | None) -> None:
        """Before an attempt's first write: check that the cluster is reachable and has the
        topic (every guarantee), then (exactly-once) the broker's transaction timeout, start the
        transactional producer (aborting any transaction of this sink still open) and read the
        marker. An unreachable cluster is a ``KafkaSinkError`` naming the sink, the bootstrap
        servers and the topic, before anything of the attempt is written or committed."""
        self._check_topic(uid)
        if self.guarantee != "exactly-once":
            return
        limit = broker_config(self.bootstrap_servers, "transaction.max.timeout.ms", self._client_settings())
        if limit is not None and int(limit) < self.transaction_timeout * 1000:
            raise ConfigurationError(
                f"sink {uid!r} to topic {self.topic!r}: the broker's transaction.max.timeout.ms is {limit} ms, below "
                f"the sink's transaction_timeout of {self.transaction_timeout * 1000:.0f} ms (the longest a commit's "
                f"transaction may stay open); raise the broker setting or lower transaction_timeout")
        self.release()
        self._open(uid)
        self._marker[uid] = self.read_marker(uid)

    def _check_topic(self, uid: str) -> None:
        """The cluster answers and has the topic, or a ``KafkaSinkError`` naming both."""
        ck = confluent()
        try:
            md = ck.admin.AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 3,
                                       **self._client_settings()}).list_topics(self.topic, timeout=10)
        except ck.KafkaException as exc:
            raise KafkaSinkError(
                f"sink {uid!r} to topic {self.topic!r}: cannot reach the Kafka cluster at {self.bootstrap_servers!r} "
                f"within 10s ({exc.args[0] if exc.args else exc}); nothing of this attempt was written or committed"
            ) from None
        tm = md.topics.get(self.topic)
        if tm is None or tm.error is not None:
            raise KafkaSinkError(f"sink {uid!r}: topic {self.topic!r} does not exist at {self.bootstrap_servers} "
                                 f"({tm.error if tm is not None else 'unknown topic'})")

    def _open(self, uid: str) -> None:
        """The transactional producer (``init_transactions`` aborts any transaction of this
        transactional id still open, and fences an older producer) and the marker's consumer."""
        ck = confluent()
        tid = self.transactional_id(uid)
        self._producer = ck.Producer({
            "bootstrap.servers": self.bootstrap_servers, "transactional.id": tid,
            "transaction.timeout.ms": int(self.transaction_timeout * 1000), "linger.ms": 5, "log_level": 3,
            # an epoch's first write comes moments after the last commit, while the broker still writes
            # that transaction's markers: AddPartitionsToTxn is refused (CONCURRENT_TRANSACTIONS) and
            # retried after this backoff. librdkafka's 100 ms made that first write take ~26 ms of
            # every commit here; 5 ms makes it ~4 ms (Kafka's Java producer retries it after 20 ms)
            "retry.backoff.ms": 5,
            **self.producer_settings})
        try:
            self._producer.init_transactions(self.transaction_timeout)  # aborts the lingering one, fences zombies
        except ck.KafkaException as exc:
            raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}: init_transactions for transactional id "
                                 f"{tid!r} failed: {exc.args[0]}") from None
        self._marker_consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": tid,
                                             "enable.auto.commit": False, "isolation.level": "read_committed",
                                             "log_level": 3, **self._client_settings()})
        holds_clients(self)

    def release(self) -> None:
        """Close the clients (their threads): the local driver forks workers from the master's
        process after recovery, and no librdkafka thread may be alive at a fork. The next
        commit opens them again."""
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None
        if self._marker_consumer is not None:
            self._marker_consumer.close()
            self._marker_consumer = None

    def _client_settings(self) -> dict[str, Any]:
        """Connection settings (security, ...) from the producer settings that other clients share."""
        return {k: v for k, v in self.producer_settings.items()
                if k.startswith(("security.", "sasl.", "ssl.", "client."))}

    def read_marker(self, uid: str) -> int:
        """The newest epoch Kafka committed for this sink (-1 if none), from the marker group."""
        ck = confluent()
        consumer = self._marker_consumer or ck.Consumer({
            "bootstrap.servers": self.bootstrap_servers, "group.id": self.transactional_id(uid),
            "enable.auto.commit": False, "isolation.level": "read_committed", "log_level": 3,
            **self._client_settings()})
        deadline = time.monotonic() + 30
        try:
            while True:
                try:
                    got = consumer.committed([ck.TopicPartition(self.topic, 0)], timeout=30)[0]
                    break
                except ck.KafkaException as exc:
                    # a fresh broker's group coordinator is not ready yet (NOT_COORDINATOR,
                    # COORDINATOR_LOAD_IN_PROGRESS): retriable, so wait for it within the 30 s
                    if not exc.args[0].retriable() or time.monotonic() > deadline:
                        raise KafkaSinkError(f"sink {uid!r}: reading the commit marker of group "
                                             f"{self.transactional_id(uid)!r} failed: {exc.args[0]}") from None
                    time.sleep(0.2)
        finally:
            if consumer is not self._marker_consumer:
                consumer.close()
        if got.error is not None:
            raise KafkaSinkError(f"sink {uid!r}: reading the commit marker of group {self.transactional_id(uid)!r} "
                                 f"failed: {got.error}")
        return got.offset if got.offset >= 0 else -1

    def commit_epoch(self, uid: str, epoch: int, staged: Iterable[str]) -> None:
        """Produce an epoch's staged output and its marker in one transaction (idempotent:
        an epoch the marker already covers is skipped)."""
        staged = sorted(staged, key=_staged_order)
        if uid not in self._marker:
            self.start(uid, "job", None)
        if self._producer is None:
            self._open(uid)
        if epoch <= self._marker.get(uid, -1):
            self._drop(staged)
            return
        ck = confluent()
        producer = self._producer
        try:
            producer.begin_transaction()
            for rel in staged:
                try:
                    data = self.store.get(self.store.root / rel)
                except FileNotFoundError:
                    raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}, epoch {epoch}: staged output {rel} "
                                         f"under {self.staging} is gone and Kafka never committed it") from None
                self._produce_all(producer, pickle.loads(data), epoch, track=False)
            if self.fail_hook is not None:
                producer.flush(self.transaction_timeout)
                self.fail_hook("produced")
            group = self._marker_consumer.consumer_group_metadata()
            producer.send_offsets_to_transaction([ck.TopicPartition(self.topic, 0, epoch)], group,
                                                 self.transaction_timeout)
            producer.commit_transaction(self.transaction_timeout)
        except ck.KafkaException as exc:
            err = exc.args[0]
            try:
                if err.txn_requires_abort():
                    producer.abort_transaction(self.transaction_timeout)
            except ck.KafkaException:
                pass
            self._producer = None  # the next attempt starts a fresh producer (start)
            raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}: committing epoch {epoch} failed: "
                                 f"{err}") from None
        self._marker[uid] = epoch
        if self.fail_hook is not None:
            self.fail_hook("committed")
        self._drop(staged)

    def _drop(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.store.root / rel)

    def recover(self, uid: str, committed: Iterable[str], epoch: int | None = None) -> None:
        """Re-produce the restored epoch if the manifest has it and Kafka does not; delete
        staged output no manifest names. The other guarantees stage nothing: they only check
        that the cluster is reachable and has the topic (``start`` does it for exactly-once)."""
        if self.guarantee != "exactly-once":
            self._check_topic(uid)
            return
        keep = sorted(committed, key=_staged_order)
        if epoch is not None and keep:
            if epoch > self._marker.get(uid, -1):
                log.info("sink %s: epoch %d is in the manifest but not in Kafka (marker %d): producing it again",
                         uid, epoch, self._marker.get(uid, -1))
            self.commit_epoch(uid, epoch, keep)  # skips (and drops the files) if Kafka has it
        folder = f"{STAGING}/{_safe(uid)}/"
        for key in list(self.store.keys(self.store.root, folder)):
            if key not in keep:
                self.store.delete(self.store.root / key)

    def relocated(self, path: Any) -> "KafkaSink":
        raise NotImplementedError("KafkaSink writes to a topic: compare runs by reading the topic (read_topic)")

    def close(self) -> None:
        self.release()


def _staged_order(rel: str) -> tuple[int, int, str]:
    m = _STAGED.search(rel)
    return (int(m.group(1)), int(m.group(2)), rel) if m else (1 << 62, 0, rel)


#: seconds ``read_topic`` waits for a partition held back by a transaction before it counts the
#: transaction as open: a commit's markers land within milliseconds of ``commit_transaction``
READ_GRACE = 1.0


def read_topic(bootstrap_servers: str, topic: str, isolation: str = "read_committed",
               timeout: float = 30.0, settings: dict[str, Any] | None = None) -> list[Any]:
    """Every message of ``topic`` (all partitions, up to their ends now) as dicts, at
    ``read_committed`` or ``read_uncommitted``: how tests and the oracle read a sink's output."""
    ck = confluent()
    consumer = ck.Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "epochstream-read-topic",
                            "enable.auto.commit": False, "isolation.level": isolation, "log_level": 3,
                            **(settings or {})})
    try:
        md = consumer.list_topics(topic, timeout=timeout).topics[topic]
        if md.error is not None:
            raise KafkaSinkError(f"topic {topic!r} at {bootstrap_servers}: {md.error}")
        parts = sorted(md.partitions)
        ends = {}
        for p in parts:
            low, high = consumer.get_watermark_offsets(ck.TopicPartition(topic, p), timeout=timeout)
            ends[p] = high
        consumer.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in parts])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        done = {p for p in parts if ends[p] == 0}
        #: partition -> (last stable offset below its end, since when): an open transaction, or
        #: one whose commit markers are still being written right after ``commit_transaction``
        held: dict[int, tuple[int, float]] = {}
        while len(done) < len(parts):
            if time.monotonic() > deadline:
                raise KafkaSinkError(f"reading topic {topic!r} ({isolation}) did not reach its end in {timeout}s")
            for m in consumer.consume(1000, timeout=0.2):
                if m.error() is not None:
                    continue
                out.append({"key": m.key(), "value": m.value(), "partition": m.partition(), "offset": m.offset()})
            for p in parts:
                if p not in done:
                    pos = consumer.position([ck.TopicPartition(topic, p)])[0].offset
                    # read_committed stops at the last stable offset; an open transaction holds it back
                    lso = ends[p] if isolation == "read_uncommitted" else _last_stable(consumer, topic, p, ends[p])
                    if pos < lso:
                        continue
                    if lso >= ends[p]:
                        done.add(p)
                        continue
                    # held back: done once it stays so for READ_GRACE (a transaction left open),
                    # not at once (one committed a moment ago becomes readable within it)
                    now = time.monotonic()
                    since = held.get(p)
                    if since is None or since[0] != lso:
                        held[p] = (lso, now)
                    elif now - since[1] >= READ_GRACE:
                        done.add(p)
        return out
    finally:
        consumer.close()


def _last_stable(consumer: Any, topic: str, partition: int, high: int) -> int:
    ck = confluent()
    low, stable = consumer.get_watermark_offsets(ck.TopicPartition(topic, partition), timeout=10, cached=False)
    return min(stable, high)
