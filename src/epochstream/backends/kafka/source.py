"""A replayable Kafka source: one split per topic partition, Kafka offsets as split offsets.

Theory of operation. When the pipeline is built (``Pipeline.from_kafka``) the source asks the
cluster for the partitions of its topics (a list, or a regular expression) and pins them as
its splits, sorted by (topic, partition). An unbounded source then grows: every
``partition_discovery_interval`` seconds each reader looks for new partitions (``discover``),
and a new one is read from its beginning. Workers look on their own, at different moments, so
a split's id must not depend on when it was found: over one named topic split i is partition
i (as before, so old manifests restore), read by subtask ``i % parallelism``; over several
topics or a pattern (where new matching topics are found too) a split's id is
``split_id(topic, partition) = crc32(topic) * 2**20 + partition``, the same on every worker and
in every run, and its reader is subtask ``(crc32(topic) + partition) % parallelism`` (Flink's
``KafkaSourceEnumerator.getSplitOwner``: a topic's partitions spread from a topic-dependent
start). Bounded sources and sources with discovery off keep the ids 0..n-1 in (topic,
partition) order and the split count they were built with, as every source does; so does a
restore of a checkpoint an older version wrote for several topics (``adopt_checkpoint``).
It resolves ``start`` (``"earliest"``, ``"latest"``, a timestamp in milliseconds, or offsets
per partition) and ``end`` (None: unbounded; ``"latest"``: the partitions' ends at build
time, Flink's ``setBounded``; or offsets) to offsets per split at the same moment, so a
replay of a fresh start reads the same records.

A split's offset in the epoch manifest is the *Kafka offset* of the next record to read, not
a count of records: transaction markers and compaction leave gaps, and the manifest then
names a position any Kafka tool understands. ``read_next`` returns the records and the
offset after them (past skipped markers), which ``runtime.reader.SplitReader`` stores.

A read returns one Arrow RecordBatch (``records="arrow"``, the default unless a deserializer
is given) built column by column from the list of messages ``consume()`` returned, with no dict
per record (``records.messages_batch``), or a dict per record (``records="dict"``); both hold the
same values (``records``).

Workers read with one consumer per split, assigned by hand (no group rebalancing), at
``isolation.level=read_committed`` so aborted input is never read, and poll without waiting
(librdkafka prefetches in the background), so a worker's loop is never blocked by an idle
partition. After an epoch completes the job master commits the manifest's offsets to the
consumer group ``group_id`` (``epoch_completed``), for lag monitoring only, as Flink does:
recovery reads the manifest, never the group.
"""

from __future__ import annotations

import bisect
import re
import zlib
from typing import Any, Callable, Iterable

from ...runtime.errors import UserFunctionError
from ...runtime.sources import Source
from .client import KafkaSourceError, confluent, holds_clients, topic_metadata
from .records import concat_reads, messages_batch, records_format, rows_of

#: seconds between looks for new partitions by default (Flink's ``partition.discovery.interval.ms``
#: is 5 minutes; a shorter look costs one metadata request per worker)
DISCOVERY_INTERVAL = 30.0  # from_kafka(partition_discovery_interval=...) defaults to it

#: how long a worker waits for the first fetch of a split when asked for records at an offset
#: it is not at (a seek); afterwards reads never wait
_SEEK_WAIT = 0.05


def _split_key(key: Any, topics: list[str]) -> tuple[str, int]:
    """A user's partition key: ``(topic, partition)``, ``"topic:partition"`` or a partition
    number (when there is one topic)."""
    if isinstance(key, tuple):
        return str(key[0]), int(key[1])
    if isinstance(key, str) and ":" in key:
        t, p = key.rsplit(":", 1)
        return t, int(p)
    if len(topics) != 1:
        raise ValueError(f"offsets of a multi-topic source are keyed by (topic, partition), got {key!r}")
    return topics[0], int(key)


#: partitions per topic a named split id has room for (``split_id``)
PARTITION_BITS = 20


def split_id(topic: str, partition: int) -> int:
    """The split id of (topic, partition) in a growing source over several topics or a
    pattern: a pure function of the name, so every worker and every run agree on it."""
    if not 0 <= partition < 1 << PARTITION_BITS:
        raise KafkaSourceError(f"topic {topic!r} partition {partition}: a growing multi-topic source has room for "
                               f"partitions below {1 << PARTITION_BITS}")
    return (zlib.crc32(topic.encode("utf-8")) << PARTITION_BITS) | partition


def before_offset(records: Any, stop: int) -> Any:
    """The records of one read whose offset is below ``stop`` (a read may run past it: offsets
    have gaps); a RecordBatch is sliced (its offsets ascend)."""
    if type(records) is list:
        return [r for r in records if r["offset"] < stop]
    import pyarrow.compute as pc

    keep = pc.sum(pc.less(records.column("offset"), stop)).as_py() or 0
    return records if keep == records.num_rows else records.slice(0, keep)


def kafka_event_time(record: Any) -> Any:
    """A record's Kafka timestamp in seconds (``from_kafka(timestamps="kafka")``); None if the
    producer set none (the reader then names the record)."""
    ts = record["timestamp"]
    return None if ts is None else ts / 1000.0


class KafkaSource(Source):
    """Kafka topics as a replayable source (see the module docstring)."""

    def __init__(self, bootstrap_servers: str, topics: str | Iterable[str] | re.Pattern[str],
                 start: Any = "earliest", end: Any = None, group_id: str | None = None,
                 key_deserializer: Callable[[bytes | None], Any] | None = None,
                 value_deserializer: Callable[[bytes | None], Any] | None = None,
                 settings: dict[str, Any] | None = None, timeout: float = 10.0,
                 partition_discovery_interval: float | None = DISCOVERY_INTERVAL, records: str | None = None) -> None:
        confluent()
        #: "arrow": one RecordBatch per read (``records.kafka_schema``); "dict": a dict per record
        self.records = records_format(records, key_deserializer, value_deserializer, f"from_kafka({topics!r})")
        self.bootstrap_servers = bootstrap_servers
        self.settings = dict(settings or {})
        self.group_id = group_id
        self.key_deserializer = key_deserializer
        self.value_deserializer = value_deserializer
        self.timeout = timeout
        what = f"from_kafka({topics!r})"
        md = topic_metadata(bootstrap_servers, what, self.settings, timeout)
        if isinstance(topics, re.Pattern):
            names = sorted(t for t in md.topics if topics.fullmatch(t) and not t.startswith("__"))
            if not names:
                raise KafkaSourceError(f"{what}: no topic matches the pattern {topics.pattern!r} at "
                                       f"{bootstrap_servers}")
        else:
            names = [topics] if isinstance(topics, str) else list(topics)
        found: list[tuple[str, int]] = []
        for t in names:
            tm = md.topics.get(t)
            if tm is None or tm.error is not None:
                missing = tm is None or tm.error.code() == confluent().KafkaError.UNKNOWN_TOPIC_OR_PART
                why = "does not exist" if missing else str(tm.error)
                raise KafkaSourceError(f"{what}: topic {t!r} {why} at {bootstrap_servers}")
            found += [(t, p) for p in sorted(tm.partitions)]
        #: the pattern new topics must match (discovery), None for named topics
        self.pattern = topics if isinstance(topics, re.Pattern) else None
        self.topics = names
        if partition_discovery_interval is not None and not partition_discovery_interval > 0:
            raise ValueError(f"from_kafka: partition_discovery_interval must be seconds > 0 or None, got "
                             f"{partition_discovery_interval!r}")
        #: seconds between looks for new partitions (None: never); only unbounded sources grow
        self.discovery_interval = partition_discovery_interval if end is None else None
        self.grows = self.discovery_interval is not None
        #: split ids named by (topic, partition) (``split_id``): a growing source over several
        #: topics or a pattern; else split i is the i-th partition in (topic, partition) order
        self.named_splits = self.grows and (len(names) != 1 or self.pattern is not None)
        #: (topic, partition) per split id
        self.partitions: dict[int, tuple[str, int]] = {}
        for i, tp in enumerate(found):
            self._add_split(i, tp)
        self.num_splits = len(self.partitions)
        #: splits known when the source was built (``start`` applies to them)
        self._built = set(self.partitions)
        self.elastic = False
        self.start_offsets = self._resolve(start, "start")
        self.end_offsets: dict[int, int] | None = None if end is None else self._resolve(end, "end")
        self._last_discovery: float | None = None
        self._consumers: dict[int, Any] = {}
        self._positions: dict[int, int] = {}
        #: the job master's client committing completed epochs' offsets to the group
        self._committer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_consumers": {}, "_positions": {}, "_last_discovery": None, "_committer": None}

    def _add_split(self, index: int, tp: tuple[str, int]) -> int:
        """Register (topic, partition) under its split id; returns the id."""
        sid = split_id(*tp) if self.named_splits else index
        other = self.partitions.get(sid)
        if other is not None and other != tp:  # two topic names with one crc32
            raise KafkaSourceError(f"source {self.uid!r}: topics {other[0]!r} and {tp[0]!r} get the same split ids; "
                                   f"read them with two from_kafka sources")
        self.partitions[sid] = tp
        return sid

    def adopt_checkpoint(self, split_ids: Iterable[Any]) -> None:
        """A restore: a checkpoint written before split ids were named (several topics, ids
        0..n-1 in (topic, partition) order) is read with those ids, and the source does not
        grow, as it did not then. Named ids are all >= 2**20 (a topic whose crc32 is 0 aside)."""
        ids = [int(s) for s in split_ids]
        if not self.named_splits or not ids or any(i >> PARTITION_BITS for i in ids):
            return
        order = sorted(self.partitions.values())
        remap = {sid: order.index(tp) for sid, tp in self.partitions.items()}
        self.named_splits = self.grows = False
        self.discovery_interval = None
        self.partitions = dict(enumerate(order))
        self._built = {remap[s] for s in self._built}
        self.start_offsets = {remap[s]: o for s, o in self.start_offsets.items()}
        if self.end_offsets is not None:
            self.end_offsets = {remap[s]: o for s, o in self.end_offsets.items()}

    def split_ids(self) -> list[int]:
        return list(self.partitions)

    def owner(self, split: int, parallelism: int) -> int:
        """The subtask that reads ``split``: ``split % parallelism``, or for named splits
        ``(crc32(topic) + partition) % parallelism`` (see the module docstring)."""
        if not self.named_splits:
            return split % parallelism
        return ((split >> PARTITION_BITS) + (split & ((1 << PARTITION_BITS) - 1))) % parallelism

    # ------------------------------------------------------------ partition discovery
    def discover(self, now: float, force: bool = False) -> None:
        """Add the partitions created since the last look (at most once per
        ``discovery_interval`` unless ``force``): of the topics, and with a pattern of every
        topic that matches it now. Split ids need no one's agreement (see the module
        docstring); a new partition starts from its beginning (it was created after the job
        started). A failed look is retried next time."""
        if not self.grows:
            return
        last = self._last_discovery
        if last is None and not force:
            self._last_discovery = now  # the first look waits one interval: the build just looked
            return
        assert self.discovery_interval is not None
        if not force and last is not None and now - last < self.discovery_interval:
            return
        self._last_discovery = now
        try:
            md = topic_metadata(self.bootstrap_servers, f"source {self.uid!r}", self.settings, self.timeout)
        except KafkaSourceError:
            return  # the broker is away for now: the readers notice it themselves
        topics = list(self.topics)
        if self.pattern is not None:
            topics += sorted(t for t in md.topics if t not in self.topics and self.pattern.fullmatch(t)
                             and not t.startswith("__"))
        for topic in topics:
            tm = md.topics.get(topic)
            if tm is None or tm.error is not None:
                continue
            # a partition without a leader yet (a topic just created) is taken at a later look:
            # asking for its offsets now would block the worker's loop
            ready = sorted(p for p, pm in tm.partitions.items() if getattr(pm, "leader", 0) >= 0)
            if not ready:
                continue
            if topic not in self.topics:
                self.topics.append(topic)
            for p in ready:
                if self.named_splits:
                    if split_id(topic, p) not in self.partitions:
                        self._add_split(-1, (topic, p))
                elif p >= self.num_splits and p == len(self.partitions):  # one topic: split i is partition i
                    self._add_split(p, (topic, p))
        self.num_splits = len(self.partitions)

    def discovered_start_offset(self, split: int) -> int:
        """The beginning of a partition created after the job started (its low watermark)."""
        ck = confluent()
        consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": "epochstream-resolve",
                                "enable.auto.commit": False, "log_level": 3, **self.settings})
        try:
            return self._watermarks(consumer, self.partitions[split])[0]
        finally:
            consumer.close()

    def __repr__(self) -> str:
        return f"KafkaSource({self.bootstrap_servers!r}, {self.topics!r}, {self.num_splits} partitions)"

    # ------------------------------------------------------------ building
    def _resolve(self, spec: Any, what: str) -> dict[int, int]:
        """Offsets per split for ``start`` or ``end``."""
        ck = confluent()
        consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": "epochstream-resolve",
                                "enable.auto.commit": False, "isolation.level": "read_committed",
                                "log_level": 3, **self.settings})
        try:
            if isinstance(spec, dict):
                given = {_split_key(k, self.topics): int(v) for k, v in spec.items()}
                unknown = set(given) - set(self.partitions.values())
                if unknown:
                    raise KafkaSourceError(f"source {self.uid!r}: {what} offsets name partitions the topics do not "
                                           f"have: {sorted(unknown)}")
                out = {}
                for sid, tp in self.partitions.items():
                    if tp in given:
                        out[sid] = given[tp]
                    else:  # a partition the user left out: from its beginning (start) or end (end)
                        low, high = self._watermarks(consumer, tp)
                        out[sid] = low if what == "start" else high
                return out
            if spec in ("earliest", "latest"):
                return {sid: self._watermarks(consumer, tp)[0 if spec == "earliest" else 1]
                        for sid, tp in self.partitions.items()}
            if isinstance(spec, (int, float)) and not isinstance(spec, bool) and what == "start":
                tps = [ck.TopicPartition(t, p, int(spec)) for t, p in self.partitions.values()]
                found = consumer.offsets_for_times(tps, timeout=self.timeout)
                out = {}
                for (sid, tp), got in zip(self.partitions.items(), found, strict=True):
                    # no record at or after the time: start at the end
                    out[sid] = got.offset if got.offset >= 0 else self._watermarks(consumer, tp)[1]
                return out
            allowed = "'earliest', 'latest', a timestamp in ms or offsets" if what == "start" \
                else "None, 'latest' or offsets"
            raise ValueError(f"from_kafka: {what} must be {allowed}, got {spec!r}")
        finally:
            consumer.close()

    def _watermarks(self, consumer: Any, tp: tuple[str, int]) -> tuple[int, int]:
        ck = confluent()
        try:
            low, high = consumer.get_watermark_offsets(ck.TopicPartition(*tp), timeout=self.timeout)
        except ck.KafkaException as exc:
            raise KafkaSourceError(f"source {self.uid!r}: topic {tp[0]!r} partition {tp[1]}: cannot read its "
                                   f"offsets at {self.bootstrap_servers} ({exc.args[0]})") from None
        return int(low), int(high)

    # ------------------------------------------------------------ the Source interface
    def start_offset(self, split: int) -> int:
        if split not in self._built:  # discovered while running: from its beginning
            return self.discovered_start_offset(split)
        return self.start_offsets[split]

    def split_length(self, split: int) -> int | None:
        """The end offset of a bounded split (offsets, not counts: see the module docstring)."""
        return None if self.end_offsets is None else self.end_offsets[split]

    def read(self, split: int, offset: int, count: int) -> Any:
        return self.read_next(split, offset, count)[0]

    def read_next(self, split: int, offset: int, count: int) -> tuple[Any, int]:
        """Up to ``count`` records of ``split`` from Kafka offset ``offset`` (a RecordBatch with
        ``records="arrow"``, else a list of dicts), and the offset after them; ([], offset) when
        nothing has arrived yet."""
        end = self.split_length(split)
        if end is not None and offset >= end:
            return [], offset
        consumer = self._consumer(split)
        topic, partition = self.partitions[split]
        if self._positions.get(split) != offset:
            self._seek(consumer, split, offset)
            wait = _SEEK_WAIT
        else:
            wait = 0.0
        msgs = consumer.consume(count if end is None else min(count, end - offset), timeout=wait)
        if any(m.error() is not None for m in msgs):
            msgs = self._without_errors(msgs, topic, partition, offset)
        offsets = [m.offset() for m in msgs]
        if end is not None and offsets and offsets[-1] >= end:  # offsets ascend: cut at the end
            cut = bisect.bisect_left(offsets, end)
            msgs, offsets = msgs[:cut], offsets[:cut]
        nxt = offsets[-1] + 1 if offsets else offset
        if not offsets:  # past transaction markers, or at the end of a bounded split
            pos = consumer.position([confluent().TopicPartition(topic, partition)])[0].offset
            if pos > nxt:
                nxt = pos if end is None else min(pos, end)
        self._positions[split] = nxt
        if not msgs:
            return [], nxt
        if self.records == "arrow":
            return messages_batch(msgs, topic, partition, offsets), nxt
        return [self._record(m, split) for m in msgs], nxt

    def _without_errors(self, msgs: list[Any], topic: str, partition: int, offset: int) -> list[Any]:
        """The messages before the first error (end-of-partition events are skipped); any
        other error fails the read, naming where it happened."""
        out = []
        nxt = offset
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == confluent().KafkaError._PARTITION_EOF:
                    continue
                raise KafkaSourceError(f"source {self.uid!r}: topic {topic!r} partition {partition} offset {nxt}: "
                                       f"{err.str()}")
            out.append(m)
            nxt = m.offset() + 1
        return out

    def _record(self, m: Any, split: int) -> dict[str, Any]:
        key, value = m.key(), m.value()
        try:
            if self.key_deserializer is not None:
                key = self.key_deserializer(key)
            if self.value_deserializer is not None:
                value = self.value_deserializer(value)
        except Exception as exc:
            raise UserFunctionError(f"source {self.uid!r}: the deserializer rejected the record at topic "
                                    f"{m.topic()!r} partition {m.partition()} offset {m.offset()}: {exc!r}") from exc
        ts_type, ts = m.timestamp()
        return {"key": key, "value": value, "topic": m.topic(), "partition": m.partition(), "offset": m.offset(),
                "timestamp": ts if ts_type != 0 else None, "headers": m.headers() or []}

    def _consumer(self, split: int) -> Any:
        consumer = self._consumers.get(split)
        if consumer is None:
            ck = confluent()
            consumer = ck.Consumer({
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": self.group_id or f"epochstream-{self.uid}",
                "enable.auto.commit": False, "enable.auto.offset.store": False,
                "isolation.level": "read_committed", "enable.partition.eof": False,
                "fetch.wait.max.ms": 10, "log_level": 3, **self.settings,
            })
            self._consumers[split] = consumer
            holds_clients(self)
        return consumer

    def _seek(self, consumer: Any, split: int, offset: int) -> None:
        ck = confluent()
        topic, partition = self.partitions[split]
        consumer.assign([ck.TopicPartition(topic, partition, offset)])
        self._positions[split] = offset

    def read_range(self, split: int, start: int, stop: int) -> Any:
        """The records at Kafka offsets [start, stop) (one RecordBatch with ``records="arrow"``):
        reads until the offset reaches ``stop`` (offsets have gaps: transaction markers, aborted
        records)."""
        parts: list[Any] = []
        pos = start
        while pos < stop:
            got, after = self.read_next(split, pos, min(10_000, stop - pos))
            if len(got):
                parts.append(before_offset(got, stop))
            if after == pos and not len(got):
                continue  # not fetched yet
            pos = after
        if self.records == "arrow":
            return concat_reads(parts)
        return [r for part in parts for r in part]

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        """Every record from the start offsets up to ``offsets`` (the input an epoch names), as
        dict rows."""
        out: list[Any] = []
        for split in self.partitions:
            first = self.start_offset(split)
            out.extend(rows_of(self.read_range(split, first, int(offsets.get(split, first)))))
        return out

    def release(self) -> None:
        """Close the consumers (they open again, at the offset asked for, on the next read)."""
        self.close()

    def close(self) -> None:
        for c in self._consumers.values():
            c.close()
        self._consumers.clear()
        self._positions.clear()
        if self._committer is not None:
            self._committer.close()
            self._committer = None

    # ------------------------------------------------------------ after an epoch completes
    def _committed(self, err: Any, partitions: Any) -> None:
        """An asynchronous group commit's outcome: a failure is logged (monitoring only)."""
        if err is not None:
            import logging

            logging.getLogger(__name__).warning("source %s: committing offsets to group %s failed: %s", self.uid,
                                                self.group_id, err)

    def epoch_completed(self, offsets: dict[Any, Any]) -> None:
        """Commit an epoch's offsets (split -> next offset, from its manifest) to the consumer
        group, for monitoring (lag); recovery never reads them. Best effort: a failure is logged."""
        import logging

        ck = confluent()
        tps = [ck.TopicPartition(*self.partitions[int(s)], int(o)) for s, o in offsets.items()
               if int(s) in self.partitions]
        if not tps:
            return
        # one client for every epoch (a new one per epoch cost ~60 ms of the master's loop: its
        # start, the coordinator lookup and its close); closed before the local driver forks
        # workers (``holds_clients``), as a librdkafka handle's threads must not be alive at a fork
        if self._committer is None:
            self._committer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers,
                                           "group.id": self.group_id or f"epochstream-{self.uid}",
                                           "enable.auto.commit": False, "log_level": 3,
                                           "on_commit": self._committed, **self.settings})
            holds_clients(self)
        # asynchronous: a synchronous commit held the master's loop ~100 ms per epoch on a busy
        # broker (it is monitoring only); the last epoch of a bounded source waits for it, so
        # the group shows the final offsets when the job returns
        last = self.end_offsets is not None and all(
            int(o) >= self.end_offsets.get(int(s), 0) for s, o in offsets.items() if int(s) in self.partitions)
        try:
            self._committer.poll(0)  # serve the callbacks of earlier commits
            self._committer.commit(offsets=tps, asynchronous=not last)
        except ck.KafkaException as exc:
            logging.getLogger(__name__).warning("source %s: committing offsets to group %s failed: %s", self.uid,
                                                self.group_id, exc)
        if last:  # nothing follows: no client outlives the job
            self._committer.close()
            self._committer = None
