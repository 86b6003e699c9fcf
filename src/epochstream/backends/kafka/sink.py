"""A Kafka sink: exactly-once through Kafka transactions, or at-least-once, or fire-and-forget.

Theory of operation (``guarantee="exactly-once"``). As Flink's ``KafkaSink``, every sink
subtask produces its own output inside its own Kafka transactions, and the job master only
coordinates: it never carries a record. Per subtask (``backends.kafka.transactions``):

1. **pre-commit** (the subtask, when its epoch's snapshot is taken): the epoch's messages
   are *staged* durably as one file under ``staging`` (a local folder or ``s3://`` prefix),
   whose name goes into the epoch's manifest with the rest of the snapshot, and produced into
   a transaction of one of the subtask's producers (transactional ids
   ``<prefix><uid>-<subtask>-<slot>``), left open.
2. **commit** (the subtask, once the job master tells it that the manifest of epoch n exists,
   ``commit_subtask``): every epoch up to n the subtask holds is committed, oldest first, each
   with a *marker*: offset ``epoch`` of the consumer group ``<prefix><uid>-<subtask>`` on
   partition 0 of the topic, sent to the transaction so that it commits atomically with the
   records. The marker says which epoch Kafka last committed for the subtask. Then the staged
   file goes.
3. **recovery** (the job master, before an attempt, ``recover``): ``init_transactions`` of
   every producer the subtasks may have used aborts what an earlier attempt left open and
   fences its producers (a zombie can commit nothing after that). Then each subtask's marker
   is read, and its staged files of epochs after the marker, up to the restored epoch, are
   produced again in a transaction with their marker: the manifest committed them and Kafka
   did not (the window between manifest and commit, e.g. a subtask killed in between).
   librdkafka cannot resume another process's transaction (Kafka's KIP-939 would allow it),
   so the staged copy is what closes that window. Staged files of later epochs are deleted.

Consumers at ``isolation.level=read_committed`` see each epoch's output exactly once; at
``read_uncommitted`` they also see the records of transactions that were aborted, which is how
the tests show the transactions doing the work. The cost is one staged write per subtask per
epoch, and a few milliseconds per commit in each subtask's writer thread.

``"at-least-once"``: each subtask produces its output at pre-commit with an idempotent
producer and waits for every acknowledgement before its ack (Flink's flush on checkpoint):
nothing is lost, a replay after a failure writes again. ``"none"``: produced at pre-commit,
not awaited.

Arrow batches are encoded once per batch (``write_batch``): values as JSON objects by
``runtime.jsoncolumns`` or a column taken as it is, keys from a column.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import time
from typing import Any, Callable, Iterable

from ...runtime.errors import ConfigurationError, UserFunctionError
from ..base import TransactionalSink
from ..objects import safe_name as _safe
from .client import KafkaSinkError, broker_config, confluent, holds_clients
from .transactions import (
    SLOTS,
    Commit,
    Produce,
    ProduceCommit,
    SubtaskTransactions,
    staged_epoch_subtask,
    to_reproduce,
    transactional_id,
)

STAGING = "_staging"
GUARANTEES = ("exactly-once", "at-least-once", "none")
#: a message as staged: (key, value, headers, partition or None)
Message = tuple["bytes | None", "bytes | None", "list[tuple[str, bytes]] | None", "int | None"]

log = logging.getLogger(__name__)


#: one encoder for every record: ``json.dumps`` with arguments builds a new encoder per call,
#: which cost as much as the encoding itself (a worker's hottest line in the Kafka benchmark);
#: non-ASCII as UTF-8, as ``encode_json`` writes Arrow batches and Spark's ``to_json`` does
_JSON = json.JSONEncoder(default=repr, separators=(",", ":"), ensure_ascii=False).encode

#: times a commit that failed with a retriable error is tried again before the worker fails over
COMMIT_RETRIES = 5


def to_bytes(x: Any) -> bytes | None:
    """The default encoding of a key or value: bytes and None pass, str is UTF-8, anything else JSON."""
    if x is None or isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    return _JSON(x).encode("utf-8")


class _Messages(list):
    """One epoch's messages of a subtask, already encoded by its writer."""


class _MessageWriter:
    """Per-subtask buffer: encodes records into messages as they arrive (Arrow batches per column)."""

    __slots__ = ("sink", "buf")

    def __init__(self, sink: "KafkaSink") -> None:
        self.sink = sink
        self.buf = _Messages()

    def write(self, records: list[Any]) -> None:
        self.buf.extend(map(self.sink.encode, records))

    def write_batch(self, batch: Any) -> None:
        self.buf.extend(self.sink.encode_batch(batch))

    def take(self) -> _Messages:
        out, self.buf = self.buf, _Messages()
        return out


class KafkaSink(TransactionalSink):
    """Records to a Kafka topic with the given ``guarantee`` (see the module docstring).

    ``key`` / ``value``: record -> bytes, or the name of a field (a column of Arrow batches)
    (default: the record itself as the value, as JSON, no key; bytes and str pass through,
    anything else becomes JSON); ``headers``: record -> list of (name, bytes); ``partitioner``:
    record -> partition number (default: librdkafka's, by key); ``staging``: where exactly-once
    stages output (default: a folder under the system temp dir named for the topic; production
    jobs point it at durable storage, e.g. beside the checkpoints); ``transactional_id_prefix``:
    default ``epochstream-<topic>-`` (two jobs writing one topic need different prefixes or sink
    uids, as with Flink's ``setTransactionalIdPrefix``); ``transaction_timeout``: seconds a
    transaction may stay open, from an epoch's pre-commit to its commit (must not exceed the
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
                 key: Callable[[Any], Any] | str | None = None, value: Callable[[Any], Any] | str | None = None,
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
        #: a field name given for the key or value (Arrow batches: a column, taken without rows)
        self.key_column = key if isinstance(key, str) else None
        self.value_column = value if isinstance(value, str) else None
        self.key_fn = _field(key) if isinstance(key, str) else key
        self.value_fn = _field(value) if isinstance(value, str) else value
        self.headers_fn, self.partitioner = headers, partitioner
        self.transactional_id_prefix = transactional_id_prefix or f"epochstream-{topic}-"
        self.transaction_timeout = transaction_timeout
        self.producer_settings = dict(producer_settings or {})
        #: each sink subtask commits its own transactions once the master says the epoch's
        #: manifest exists (``commit_subtask``); the master commits nothing of this sink
        self.commits_in_subtasks = guarantee == "exactly-once"
        #: its commits are Kafka transactions, not Spark jobs (the spark driver needs no spare slot)
        self.commits_with_spark = False
        #: producers per subtask (``transactions.SLOTS``)
        self.slots = SLOTS
        self.staging = staging if staging is not None else os.path.join(
            tempfile.gettempdir(), "epochstream-kafka-staging", _safe(topic))
        self._store: Any = None
        #: the plain producer (at-least-once, none)
        self._producer: Any = None
        #: (uid, subtask) -> its transactions' bookkeeping, in the process that runs the subtask
        self._pools: dict[tuple[str, int], SubtaskTransactions] = {}
        #: transactional id -> its producer (``init_transactions`` done)
        self._txn_producers: dict[str, Any] = {}
        #: marker group -> the consumer whose group metadata the transactions carry
        self._marker_consumers: dict[str, Any] = {}
        #: (uid, subtask, epoch) -> (its messages, its staged file), until Kafka committed it
        self._held: dict[tuple[str, int, int], tuple[list[Message], str]] = {}
        #: test hook: called with a step name ("committing", "committed") around each commit
        self.fail_hook: Callable[[str], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_producer": None, "_pools": {}, "_txn_producers": {},
                "_marker_consumers": {}, "_held": {}, "fail_hook": None}

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

    def encode_batch(self, batch: Any) -> list[Message]:
        """The messages of an Arrow RecordBatch, encoded per column where the key and value are
        columns or the defaults (values: every row as one JSON object, ``runtime.jsoncolumns``);
        through rows where a function is given."""
        from ...runtime.columns import to_rows

        by_column = (self.headers_fn is None and self.partitioner is None
                     and (self.key_fn is None or self.key_column is not None)
                     and (self.value_fn is None or self.value_column is not None))
        if not by_column:
            return [self.encode(r) for r in to_rows(batch)]
        try:
            values = _column_bytes(batch, self.value_column) if self.value_column is not None else _json_rows(batch)
            keys = _column_bytes(batch, self.key_column) if self.key_column is not None else None
        except KeyError as exc:
            raise UserFunctionError(f"Kafka sink to topic {self.topic!r}: the batch has no column {exc.args[0]!r} "
                                    f"(its columns: {batch.schema.names})") from None
        if keys is None:
            return [(None, v, None, None) for v in values]
        return [(k, v, None, None) for k, v in zip(keys, values, strict=True)]

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
        makes no Python callback or poll per record."""
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

    # ------------------------------------------------------------ names
    def transactional_id(self, uid: str, subtask: int, slot: int) -> str:
        return transactional_id(self.transactional_id_prefix, uid, subtask, slot)

    def marker_group(self, uid: str, subtask: int) -> str:
        """The consumer group whose offset on partition 0 is the subtask's last committed epoch."""
        return f"{self.transactional_id_prefix}{uid}-{subtask}"

    def manifest_entry(self, uid: str) -> dict[str, Any]:
        """What the manifest records about this sink's commits: the transactional ids' prefix
        and the producers per subtask (recovery fences them all)."""
        return {"transactional_id_prefix": self.transactional_id_prefix, "slots": self.slots,
                "marker_group": self.marker_group(uid, 0)[:-1] + "<subtask>"}

    # ------------------------------------------------------------ transactions (I/O; the model overrides them)
    def _txn_producer(self, tid: str) -> Any:
        """The producer of transactional id ``tid``: ``init_transactions`` on first use aborts
        any transaction of ``tid`` still open and fences older producers of it."""
        producer = self._txn_producers.get(tid)
        if producer is None:
            producer = self._txn_producers[tid] = self._new_txn_producer(tid)
            holds_clients(self)
        return producer

    def _new_txn_producer(self, tid: str) -> Any:
        """A producer of ``tid`` after ``init_transactions``."""
        ck = confluent()
        producer = ck.Producer({
            "bootstrap.servers": self.bootstrap_servers, "transactional.id": tid,
            "transaction.timeout.ms": int(self.transaction_timeout * 1000), "linger.ms": 5, "log_level": 3,
            # an epoch's first write comes moments after the last commit, while the broker still writes
            # that transaction's markers: AddPartitionsToTxn is refused (CONCURRENT_TRANSACTIONS) and
            # retried after this backoff. librdkafka's 100 ms made that first write take ~26 ms of
            # each commit; 5 ms makes it ~4 ms (Kafka's Java producer retries it after 20 ms)
            "retry.backoff.ms": 5,
            **self.producer_settings})
        try:
            producer.init_transactions(self.transaction_timeout)
        except ck.KafkaException as exc:
            raise KafkaSinkError(f"sink to topic {self.topic!r}: init_transactions for transactional id "
                                 f"{tid!r} failed: {exc.args[0]}") from None
        return producer

    def _fence(self, tids: list[str]) -> None:
        """Open the producers of ``tids`` (``init_transactions``: what each left open is aborted,
        its older producers fenced), at once: one costs ~0.15-0.35 s here, mostly waiting."""
        if len(tids) <= 1:
            for tid in tids:
                self._txn_producer(tid)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(tids), 8)) as pool:
            opened = list(pool.map(self._new_txn_producer, tids))  # the calls release the GIL
        self._txn_producers.update(zip(tids, opened, strict=True))
        holds_clients(self)

    def open_subtask(self, uid: str, subtask: int) -> None:
        """At the start of an attempt, in the subtask's process: open (and so fence) its
        producers, the spare too, so a zombie of an earlier attempt can commit nothing and
        the first epoch does not wait for them."""
        if self.commits_in_subtasks:
            self._fence([self.transactional_id(uid, subtask, slot) for slot in range(self.slots + 1)])

    def _txn_produce(self, tid: str, messages: list[Message], epoch: int) -> None:
        """Begin a transaction on ``tid`` and produce ``messages`` into it (left open)."""
        ck = confluent()
        producer = self._txn_producer(tid)
        try:
            producer.begin_transaction()
        except ck.KafkaException as exc:
            raise KafkaSinkError(f"sink to topic {self.topic!r}, epoch {epoch}: begin_transaction on {tid!r} "
                                 f"failed: {exc.args[0]}") from None
        self._produce_all(producer, messages, epoch, track=False)
        producer.poll(0)

    def _txn_commit(self, tid: str, group: str, epoch: int) -> bool:
        """Add the marker ``epoch`` of ``group`` to ``tid``'s open transaction and commit it.
        False: the transaction is gone (aborted by the broker, e.g. its timeout passed) and was
        aborted here too; its epoch must be produced again. A fenced producer (a newer attempt
        owns ``tid``) or an error that persists raises ``KafkaSinkError``."""
        ck = confluent()
        producer = self._txn_producer(tid)
        tp = [ck.TopicPartition(self.topic, 0, epoch)]
        for attempt in range(COMMIT_RETRIES + 1):
            try:
                producer.send_offsets_to_transaction(tp, self._group_metadata(group), self.transaction_timeout)
                producer.commit_transaction(self.transaction_timeout)
                return True
            except ck.KafkaException as exc:
                err = exc.args[0]
                if err.txn_requires_abort():
                    try:
                        producer.abort_transaction(self.transaction_timeout)
                    except ck.KafkaException:
                        self._drop_producer(tid)
                    return False
                if err.retriable() and attempt < COMMIT_RETRIES:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                self._drop_producer(tid)
                why = "fenced by a newer attempt" if err.fatal() else "failed"
                raise KafkaSinkError(f"sink to topic {self.topic!r}: committing epoch {epoch} on transactional id "
                                     f"{tid!r} {why}: {err}") from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _group_metadata(self, group: str) -> Any:
        consumer = self._marker_consumers.get(group)
        if consumer is None:
            ck = confluent()
            consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": group,
                                    "enable.auto.commit": False, "isolation.level": "read_committed",
                                    "log_level": 3, **self._client_settings()})
            self._marker_consumers[group] = consumer
            holds_clients(self)
        return consumer.consumer_group_metadata()

    def _drop_producer(self, tid: str) -> None:
        producer = self._txn_producers.pop(tid, None)
        if producer is not None:
            producer.purge()

    def read_marker(self, uid: str, subtask: int) -> int:
        """The newest epoch Kafka committed for ``uid``'s subtask ``subtask`` (-1 if none)."""
        ck = confluent()
        group = self.marker_group(uid, subtask)
        consumer = ck.Consumer({
            "bootstrap.servers": self.bootstrap_servers, "group.id": group,
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
                    # COORDINATOR_LOAD_IN_PROGRESS), or offsets of a transaction being aborted
                    # are still pending (UNSTABLE_OFFSET_COMMIT): retriable, so wait within the 30 s
                    if not exc.args[0].retriable() or time.monotonic() > deadline:
                        raise KafkaSinkError(f"sink {uid!r}: reading the commit marker of group {group!r} "
                                             f"failed: {exc.args[0]}") from None
                    time.sleep(0.2)
        finally:
            consumer.close()
        if got.error is not None:
            raise KafkaSinkError(f"sink {uid!r}: reading the commit marker of group {group!r} failed: {got.error}")
        return got.offset if got.offset >= 0 else -1

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Exactly-once: stage the epoch's messages (the staged name goes into the manifest) and
        produce them into an open transaction of the subtask. At-least-once: produce and wait
        for every acknowledgement. None: produce."""
        if not records:
            return None
        messages = records if isinstance(records, _Messages) else [self.encode(r) for r in records]
        if self.guarantee != "exactly-once":
            wait = self.transaction_timeout if self.guarantee == "at-least-once" else None
            self._produce_all(self._plain_producer(), messages, epoch, flush=wait)
            return None
        rel = f"{STAGING}/{_safe(uid)}/e{epoch}-s{subtask}-a{attempt}.msgs"
        self.store.put(self.store.root / rel, pickle.dumps(list(messages), protocol=pickle.HIGHEST_PROTOCOL))
        self._held[(uid, subtask, epoch)] = (messages, rel)
        pool = self._pools.setdefault((uid, subtask), SubtaskTransactions(self.slots))
        for action in pool.staged(epoch):
            self._carry_out(uid, subtask, pool, action)
        return rel

    def commit_subtask(self, uid: str, subtask: int, epoch: int) -> None:
        """The manifest of ``epoch`` exists: commit every epoch up to it this subtask holds, in
        epoch order (in the process that runs the subtask)."""
        pool = self._pools.get((uid, subtask))
        if pool is None:
            return
        for action in pool.completed(epoch):
            self._carry_out(uid, subtask, pool, action)

    def _carry_out(self, uid: str, subtask: int, pool: SubtaskTransactions, action: Any) -> None:
        tid = self.transactional_id(uid, subtask, action.slot)
        messages, rel = self._held[(uid, subtask, action.epoch)]
        if type(action) is Produce:
            self._txn_produce(tid, messages, action.epoch)
            return
        if type(action) is ProduceCommit:
            self._txn_produce(tid, messages, action.epoch)
        assert type(action) in (Commit, ProduceCommit), action
        group = self.marker_group(uid, subtask)
        if self.fail_hook is not None:
            self.fail_hook("committing")
        if not self._txn_commit(tid, group, action.epoch):
            # the broker had aborted it: produce the epoch again, from its messages, and commit
            log.warning("sink %s subtask %d: the transaction of epoch %d was aborted by the broker before its "
                        "commit (transaction_timeout %.0fs); producing it again", uid, subtask, action.epoch,
                        self.transaction_timeout)
            self._txn_produce(tid, messages, action.epoch)
            if not self._txn_commit(tid, group, action.epoch):
                raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}: epoch {action.epoch} of subtask "
                                     f"{subtask} was aborted twice by the broker; its staged output stays for "
                                     f"recovery")
        if self.fail_hook is not None:
            self.fail_hook("committed")
        del self._held[(uid, subtask, action.epoch)]
        self.store.delete(self.store.root / rel)

    def commit(self, staged: Iterable[str]) -> int:
        """The job master commits nothing of this sink: exactly-once commits are the subtasks'
        (``commit_subtask``), the other guarantees have nothing to commit."""
        return 0

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.store.root / rel)

    def start(self, uid: str, job: str, manifest: dict[str, Any] | None) -> None:
        """Before an attempt's first write: check that the cluster is reachable and has the
        topic (every guarantee), then (exactly-once) the broker's transaction timeout. An
        unreachable cluster is a ``KafkaSinkError`` naming the sink, the bootstrap servers and
        the topic, before anything of the attempt is written or committed."""
        self._check_topic(uid)
        if self.guarantee != "exactly-once":
            return
        limit = broker_config(self.bootstrap_servers, "transaction.max.timeout.ms", self._client_settings())
        if limit is not None and int(limit) < self.transaction_timeout * 1000:
            raise ConfigurationError(
                f"sink {uid!r} to topic {self.topic!r}: the broker's transaction.max.timeout.ms is {limit} ms, below "
                f"the sink's transaction_timeout of {self.transaction_timeout * 1000:.0f} ms (the longest a "
                f"transaction may stay open); raise the broker setting or lower transaction_timeout")
        # the markers' group coordinator must be up before a subtask sends offsets to a transaction:
        # on a fresh cluster (no __consumer_offsets yet) librdkafka's send_offsets_to_transaction
        # waited out its whole timeout, again and again; a committed() lookup (retried) brings it up
        self.read_marker(uid, 0)

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

    def release(self) -> None:
        """Close the clients (their threads): the local driver forks workers from the master's
        process after recovery, and no librdkafka thread may be alive at a fork (a child that
        inherits one can hang in its first import). They open again on next use. Subtasks hold
        transactions only in workers, which never fork; any held here is forgotten (its
        transactions stay open until recovery fences them)."""
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None
        self._pools.clear()
        self._held.clear()
        self._close_transactions()

    def _client_settings(self) -> dict[str, Any]:
        """Connection settings (security, ...) from the producer settings that other clients share."""
        return {k: v for k, v in self.producer_settings.items()
                if k.startswith(("security.", "sasl.", "ssl.", "client."))}

    def recover(self, uid: str, committed: Iterable[str], epoch: int | None = None,
                previous: int = 0, parallelism: int = 0, slots: int | None = None) -> None:
        """Before an attempt, with ``epoch`` the restored one (None: a fresh start), at
        ``parallelism``, after one at ``previous`` (the restored manifest's): fence the
        producers of subtasks with staged files and of those the attempt no longer has, then
        produce again, in a transaction with its marker, each staged file of an epoch up to
        ``epoch`` that the subtask's marker does not cover; delete staged files of later
        epochs. ``committed`` (the manifest's staged list) is not needed: a subtask may be told
        of an epoch's completion after it staged the next one, so staged files of earlier
        epochs can outlive the manifest that lists them, and the folder is the record. The
        other guarantees stage nothing: they only check that the cluster is reachable and has
        the topic."""
        if self.guarantee != "exactly-once":
            self._check_topic(uid)
            return
        # an earlier attempt's bookkeeping and producers die with it (the simulator keeps one sink object)
        self._pools.clear()
        self._held.clear()
        self._close_transactions()
        restored = -1 if epoch is None else epoch
        folder = f"{STAGING}/{_safe(uid)}/"
        files = [k for k in self.store.keys(self.store.root, folder) if k.endswith(".msgs")]
        keep = []
        for rel in files:
            e, _ = staged_epoch_subtask(rel)
            if e <= restored:
                keep.append(rel)
            else:  # never in a manifest this run keeps: the replay writes it again
                self.store.delete(self.store.root / rel)
        # fenced here: the subtasks whose staged epochs need their marker read (its pending
        # offsets resolved first) and those no subtask of the attempt will open again; the
        # attempt's subtasks fence their own producers when they open them (``open_subtask``)
        staged = {staged_epoch_subtask(rel)[1] for rel in keep}
        gone = set(range(previous)) - set(range(parallelism))
        per_subtask = max(slots or 0, self.slots) + 1  # the spare producer too
        self._fence([self.transactional_id(uid, s, slot) for s in sorted(staged | gone) for slot in range(per_subtask)])
        markers = {s: self.read_marker(uid, s) for s in sorted(staged)}
        for s, todo in sorted(to_reproduce(keep, markers).items()):
            tid = self.transactional_id(uid, s, 0)
            for e, rel in todo:
                log.info("sink %s subtask %d: epoch %d is in a manifest but not in Kafka (marker %d): producing it "
                         "again", uid, s, e, markers[s])
                try:
                    data = self.store.get(self.store.root / rel)
                except FileNotFoundError:
                    raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}, epoch {e}: staged output {rel} "
                                         f"under {self.staging} is gone and Kafka never committed it") from None
                self._txn_produce(tid, pickle.loads(data), e)
                if self.fail_hook is not None:
                    self.fail_hook("committing")
                if not self._txn_commit(tid, self.marker_group(uid, s), e):
                    raise KafkaSinkError(f"sink {uid!r} to topic {self.topic!r}: producing epoch {e} of subtask {s} "
                                         f"again was aborted by the broker")
        for rel in keep:
            self.store.delete(self.store.root / rel)
        self._close_transactions()

    def _close_transactions(self) -> None:
        """Flush and forget the transactional producers of this process (after recovery: the
        attempt's subtasks open their own, which fences these)."""
        for producer in self._txn_producers.values():
            producer.flush(self.transaction_timeout)
        self._txn_producers.clear()
        for consumer in self._marker_consumers.values():
            consumer.close()
        self._marker_consumers.clear()

    def relocated(self, path: Any) -> "KafkaSink":
        raise NotImplementedError("KafkaSink writes to a topic: compare runs by reading the topic (read_topic)")

    def close(self) -> None:
        self.release()


def _field(name: str) -> Callable[[Any], Any]:
    """A record's field ``name`` (a dict's key)."""
    def get(record: Any) -> Any:
        return record[name]
    get.__name__ = f"field_{name}"
    return get


def _column_bytes(batch: Any, name: str) -> list[bytes | None]:
    """A column as message bytes: binary as it is, strings as UTF-8, anything else as JSON
    scalars (raises KeyError naming a missing column)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if name not in batch.schema.names:
        raise KeyError(name)
    col = batch.column(name)
    t = col.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return col.to_pylist()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pc.cast(col, pa.binary()).to_pylist()
    return [to_bytes(v) for v in col.to_pylist()]


def _json_rows(batch: Any) -> list[bytes]:
    """Every row of ``batch`` as one JSON object, encoded once per batch (``encode_json``)."""
    from ...runtime.jsoncodec import encode_json

    values: list[bytes] = encode_json(batch).to_pylist()
    return values


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
