"""A replayable Kafka source: one split per topic partition, Kafka offsets as split offsets.

Theory of operation. When the pipeline is built (``Pipeline.from_kafka``) the source asks the
cluster for the partitions of its topics (a list, or a regular expression) and pins them as
its splits, sorted by (topic, partition). An unbounded source over one topic then grows: every
``partition_discovery_interval`` seconds each reader looks for new partitions (``discover``);
partition i is split i, so every worker numbers them alike, and a new one is read from its
beginning by subtask ``i % parallelism``. Other sources keep the split count they were built
with, as every source does. It resolves ``start`` (``"earliest"``, ``"latest"``, a
timestamp in milliseconds, or offsets per partition) and ``end`` (None: unbounded;
``"latest"``: the partitions' ends at build time, Flink's ``setBounded``; or offsets) to
offsets per split at the same moment, so a replay of a fresh start reads the same records.

A split's offset in the epoch manifest is the *Kafka offset* of the next record to read, not
a count of records: transaction markers and compaction leave gaps, and the manifest then
names a position any Kafka tool understands. ``read_next`` returns the records and the
offset after them (past skipped markers), which ``runtime.reader.SplitReader`` stores.

Workers read with one consumer per split, assigned by hand (no group rebalancing), at
``isolation.level=read_committed`` so aborted input is never read, and poll without waiting
(librdkafka prefetches in the background), so a worker's loop is never blocked by an idle
partition. After an epoch completes the job master commits the manifest's offsets to the
consumer group ``group_id`` (``epoch_completed``), for lag monitoring only, as Flink does:
recovery reads the manifest, never the group.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from ...runtime.errors import UserFunctionError
from ...runtime.sources import Source
from .client import KafkaSourceError, confluent, holds_clients, topic_metadata

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
                 partition_discovery_interval: float | None = DISCOVERY_INTERVAL) -> None:
        confluent()
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
        #: (topic, partition) per split
        self.partitions: list[tuple[str, int]] = []
        for t in names:
            tm = md.topics.get(t)
            if tm is None or tm.error is not None:
                missing = tm is None or tm.error.code() == confluent().KafkaError.UNKNOWN_TOPIC_OR_PART
                why = "does not exist" if missing else str(tm.error)
                raise KafkaSourceError(f"{what}: topic {t!r} {why} at {bootstrap_servers}")
            self.partitions += [(t, p) for p in sorted(tm.partitions)]
        self.topics = names
        self.num_splits = len(self.partitions)
        #: splits known when the source was built (``start`` applies to them)
        self._built_splits = self.num_splits
        self.elastic = False
        self.start_offsets = self._resolve(start, "start")
        self.end_offsets: list[int] | None = None if end is None else self._resolve(end, "end")
        if partition_discovery_interval is not None and not partition_discovery_interval > 0:
            raise ValueError(f"from_kafka: partition_discovery_interval must be seconds > 0 or None, got "
                             f"{partition_discovery_interval!r}")
        #: seconds between looks for new partitions (None: never); only an unbounded source over
        #: one named topic grows (a split's index is then its partition, on every worker alike)
        self.discovery_interval = partition_discovery_interval if end is None else None
        self.grows = self.discovery_interval is not None and len(names) == 1 and not isinstance(topics, re.Pattern)
        self._last_discovery: float | None = None
        self._consumers: dict[int, Any] = {}
        self._positions: dict[int, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_consumers": {}, "_positions": {}, "_last_discovery": None}

    # ------------------------------------------------------------ partition discovery
    def discover(self, now: float, force: bool = False) -> None:
        """Add the topic's partitions created since the last look (at most once per
        ``discovery_interval`` unless ``force``). Split i is partition i of the one topic, so
        every worker numbers them alike without asking anyone; a new partition starts from its
        beginning (it was created after the job started). A failed look is retried next time."""
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
        topic = self.topics[0]
        try:
            md = topic_metadata(self.bootstrap_servers, f"source {self.uid!r}", self.settings, self.timeout)
        except KafkaSourceError:
            return  # the broker is away for now: the readers notice it themselves
        tm = md.topics.get(topic)
        if tm is None or tm.error is not None:
            return
        for p in sorted(tm.partitions):
            if p >= self.num_splits and p == len(self.partitions):
                self.partitions.append((topic, p))
                self.start_offsets.append(0)  # resolved lazily: ``discovered_start_offset``
                self.num_splits += 1

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
    def _resolve(self, spec: Any, what: str) -> list[int]:
        """Offsets per split for ``start`` or ``end``."""
        ck = confluent()
        consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": "epochstream-resolve",
                                "enable.auto.commit": False, "isolation.level": "read_committed",
                                "log_level": 3, **self.settings})
        try:
            if isinstance(spec, dict):
                given = {_split_key(k, self.topics): int(v) for k, v in spec.items()}
                unknown = set(given) - set(self.partitions)
                if unknown:
                    raise KafkaSourceError(f"source {self.uid!r}: {what} offsets name partitions the topics do not "
                                           f"have: {sorted(unknown)}")
                out = []
                for tp in self.partitions:
                    if tp in given:
                        out.append(given[tp])
                    else:  # a partition the user left out: from its beginning (start) or end (end)
                        low, high = self._watermarks(consumer, tp)
                        out.append(low if what == "start" else high)
                return out
            if spec in ("earliest", "latest"):
                return [self._watermarks(consumer, tp)[0 if spec == "earliest" else 1] for tp in self.partitions]
            if isinstance(spec, (int, float)) and not isinstance(spec, bool) and what == "start":
                tps = [ck.TopicPartition(t, p, int(spec)) for t, p in self.partitions]
                found = consumer.offsets_for_times(tps, timeout=self.timeout)
                out = []
                for tp, got in zip(self.partitions, found, strict=True):
                    # no record at or after the time: start at the end
                    out.append(got.offset if got.offset >= 0 else self._watermarks(consumer, tp)[1])
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
        if split >= self._built_splits:  # discovered while running: from its beginning
            return self.discovered_start_offset(split)
        return self.start_offsets[split]

    def split_length(self, split: int) -> int | None:
        """The end offset of a bounded split (offsets, not counts: see the module docstring)."""
        return None if self.end_offsets is None else self.end_offsets[split]

    def read(self, split: int, offset: int, count: int) -> list[Any]:
        return self.read_next(split, offset, count)[0]

    def read_next(self, split: int, offset: int, count: int) -> tuple[list[Any], int]:
        """Up to ``count`` records of ``split`` from Kafka offset ``offset``, and the offset after
        them; ([], offset) when nothing has arrived yet."""
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
        out: list[Any] = []
        nxt = offset
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == confluent().KafkaError._PARTITION_EOF:
                    continue
                raise KafkaSourceError(f"source {self.uid!r}: topic {topic!r} partition {partition} offset {nxt}: "
                                       f"{err.str()}")
            off = m.offset()
            if end is not None and off >= end:
                break
            out.append(self._record(m, split))
            nxt = off + 1
        if not out:  # past transaction markers, or at the end of a bounded split
            pos = consumer.position([confluent().TopicPartition(topic, partition)])[0].offset
            if pos > nxt:
                nxt = pos if end is None else min(pos, end)
        self._positions[split] = nxt
        return out, nxt

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

    def read_range(self, split: int, start: int, stop: int) -> list[Any]:
        """The records at Kafka offsets [start, stop): reads until the offset reaches ``stop``
        (offsets have gaps: transaction markers, aborted records)."""
        out: list[Any] = []
        pos = start
        while pos < stop:
            got, after = self.read_next(split, pos, stop - pos)
            out.extend(r for r in got if r["offset"] < stop)
            if after == pos and not got:
                continue  # not fetched yet
            pos = after
        return out

    def records_before(self, offsets: dict[int, int]) -> list[Any]:
        """Every record from the start offsets up to ``offsets`` (the input an epoch names)."""
        out: list[Any] = []
        for split in range(self.num_splits):
            pos, stop = self.start_offsets[split], int(offsets.get(split, self.start_offsets[split]))
            while pos < stop:
                got, pos2 = self.read_next(split, pos, min(10_000, stop - pos))
                out.extend(r for r in got if r["offset"] < stop)
                if pos2 == pos and not got:
                    continue  # not fetched yet
                pos = pos2
        return out

    def release(self) -> None:
        """Close the consumers (they open again, at the offset asked for, on the next read)."""
        self.close()

    def close(self) -> None:
        for c in self._consumers.values():
            c.close()
        self._consumers.clear()
        self._positions.clear()

    # ------------------------------------------------------------ after an epoch completes
    def epoch_completed(self, offsets: dict[Any, Any]) -> None:
        """Commit an epoch's offsets (split -> next offset, from its manifest) to the consumer
        group, for monitoring (lag); recovery never reads them. Best effort: a failure is logged."""
        import logging

        ck = confluent()
        tps = [ck.TopicPartition(*self.partitions[int(s)], int(o)) for s, o in offsets.items()
               if int(s) < self.num_splits]
        if not tps:
            return
        # a short-lived client: the local driver forks workers from the master's process, and a
        # librdkafka handle's threads must not be alive at a fork
        consumer = ck.Consumer({"bootstrap.servers": self.bootstrap_servers,
                                "group.id": self.group_id or f"epochstream-{self.uid}",
                                "enable.auto.commit": False, "log_level": 3, **self.settings})
        try:
            consumer.commit(offsets=tps, asynchronous=False)
        except ck.KafkaException as exc:
            logging.getLogger(__name__).warning("source %s: committing offsets to group %s failed: %s", self.uid,
                                                self.group_id, exc)
        finally:
            consumer.close()
