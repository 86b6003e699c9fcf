"""The workload of benchmarks/kafka/kafka_json_pandas.py: its records, its two user functions as Spark users write
them, and the checks of a run's output.

A module of its own so that Spark's Python workers import the functions by name (the benchmark puts the
repository on their ``PYTHONPATH``) and the benchmark's processes share one definition of a record.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
from pyspark.sql.streaming import StatefulProcessor

from benchmarks.spark.pyspark_stateful import count_ts, expected_counts

#: the input records' schema (Spark's ``from_json``, epochstream's ``input_schema`` and ``from_json``)
SCHEMA = "k string, v long, ts long"


class JsonRecord:
    """Record ``i`` of the workload as a Kafka message: key ``k<i % keys>``, value
    ``{"k": "k<i % keys>", "v": i, "ts": <ms>}``. ``base_ms`` None (the open-loop load): ``ts`` is the
    moment the record was due; otherwise (the pre-produced topic) ``ts = base_ms + i``, distinct per
    record, so an output's ``ts`` tells which of its key's records its count covers (``ts_of_count``).
    The Kafka key puts all of a key's records in one partition, in order."""

    def __init__(self, keys: int, base_ms: int | None = None, lag_file: str | None = None) -> None:
        self.keys, self.base_ms, self.lag_file = keys, base_ms, lag_file
        self.max_lag_ms = 0

    def __call__(self, i: int, due_ms: int) -> tuple[bytes, bytes]:
        k = f"k{i % self.keys}"
        ts = due_ms if self.base_ms is None else self.base_ms + i
        if self.lag_file is not None and i % 2000 == 0:
            self._note_lag(due_ms)
        return k.encode(), f'{{"k":"{k}","v":{i},"ts":{ts}}}'.encode()

    def _note_lag(self, due_ms: int) -> None:
        """The open-loop producer's own delay (now - due), its maximum kept in ``lag_file``: a
        generator that falls behind its schedule adds its delay to every latency measured."""
        lag = int(time.time() * 1000) - due_ms
        if lag > self.max_lag_ms:
            self.max_lag_ms = lag
            Path(self.lag_file).write_text(str(lag))  # type: ignore[arg-type]


def generator_lag_ms(lag_file: str) -> int | None:
    """The largest delay of the open-loop producer behind its schedule (``JsonRecord(lag_file=)``)."""
    try:
        return int(Path(lag_file).read_text())
    except (OSError, ValueError):
        return None


def ts_of_count(keys: int, base_ms: int) -> Callable[[str, int], int]:
    """The ``ts`` of key ``k``'s ``c``-th record on the pre-produced topic (``JsonRecord`` with ``base_ms``)."""
    return lambda k, c: base_ms + int(k[1:]) + (c - 1) * keys


# ---------------------------------------------------------------- the user functions, unchanged on both sides


class CountHistogram(StatefulProcessor):
    """``transformWithStateInPandas``: a running count (ValueState) and a histogram of ``v % 10``
    (MapState) per key; one row per key per micro-batch with the key's count and the newest ``ts`` of
    its rows in the batch."""

    def init(self, handle):
        self.count = handle.getValueState("count", "c long")
        self.hist = handle.getMapState("hist", "bucket long", "n long")

    def handleInputRows(self, key, rows, timerValues):
        got = self.count.get()
        c = got[0] if got else 0
        ts = 0
        for pdf in rows:
            c += len(pdf)
            ts = max(ts, int(pdf["ts"].max()))
            for bucket, n in (pdf["v"] % 10).value_counts().items():
                old = self.hist.getValue((int(bucket),))
                self.hist.updateValue((int(bucket),), ((old[0] if old else 0) + int(n),))
        self.count.update((c,))
        yield pd.DataFrame({"k": [key[0]], "c": [c], "ts": [ts]})


def count_each(key, pdfs, state):
    """``applyInPandasWithState`` emitting a row per input row (its key's running count and its own
    ts): output as large as the input, what the job master's CPU per output record is measured on."""
    c = state.get[0] if state.exists else 0
    for pdf in pdfs:
        n = len(pdf)
        yield pd.DataFrame({"k": [key[0]] * n, "c": range(c + 1, c + n + 1), "ts": pdf["ts"].astype("int64")})
        c += n
    state.update((c,))


@dataclass(frozen=True)
class Function:
    """One of the user functions and how each system calls it."""

    label: str
    output_schema: str
    #: the applyInPandasWithState function (None: the StatefulProcessor)
    func: Any = None

    def spark(self, grouped: Any, output_mode: str) -> Any:
        """``df.groupBy("k")`` -> the stateful step (Spark)."""
        from pyspark.sql.streaming.state import GroupStateTimeout

        if self.func is not None:
            return grouped.applyInPandasWithState(self.func, self.output_schema, "c long", output_mode,
                                                  GroupStateTimeout.NoTimeout)
        return grouped.transformWithStateInPandas(CountHistogram(), self.output_schema, output_mode, "None")

    def epochstream(self, stream: Any, output_mode: str) -> Any:
        """Parsed records -> the same step through epochstream's wrapper."""
        from pyspark.sql.streaming.state import GroupStateTimeout

        if self.func is not None:
            return stream.apply_in_pandas_with_state(self.func, self.output_schema, "c long", output_mode,
                                                     GroupStateTimeout.NoTimeout, key="k", input_schema=SCHEMA,
                                                     uid="state")
        return stream.transform_with_state(CountHistogram(), self.output_schema, "None", key="k",
                                           output_mode=output_mode.lower(), input_schema=SCHEMA, uid="state")


#: ``--functions`` names: ``count_ts`` of benchmarks/spark/pyspark_stateful.py (the keyed count that carries the
#: newest ts), ``CountHistogram`` and ``count_each`` (a row out per row in)
FUNCTIONS = {
    "apply": Function("applyInPandasWithState", "k string, c long, ts double", count_ts),
    "transform": Function("transformWithStateInPandas", "k string, c long, ts long"),
    "each": Function("applyInPandasWithState, a row per input", "k string, c long, ts long", count_each),
}


def parse_json(record: dict) -> dict:
    """The rows path's parse step: a Kafka record's value -> a dict of the input schema."""
    return json.loads(record["value"])


def output_key(row: dict) -> str:
    return row["k"]


# ---------------------------------------------------------------- reading and checking the output


def read_topic(bootstrap: str, topic: str, idle: float = 5.0) -> dict[int, list[dict]]:
    """Every record of ``topic`` visible at ``read_committed``, parsed, per partition in offset order.
    Read to each partition's end (or until nothing came for ``idle`` seconds)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{time.time_ns()}",
                  "isolation.level": "read_committed", "enable.auto.commit": False, "log_level": 3})
    try:
        parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out: dict[int, list[dict]] = {p: [] for p in parts}
        last_seen = time.time()
        while time.time() - last_seen < idle:
            msgs = c.consume(10000, timeout=0.5)
            for m in msgs:
                if m.error() is None and m.value() is not None:
                    out[m.partition()].append(json.loads(m.value()))
            if msgs:
                last_seen = time.time()
            # positions reach the high watermark past the last transaction's commit marker
            pos = {tp.partition: tp.offset for tp in c.position([TopicPartition(topic, p) for p in parts])}
            if all(ends[p] == 0 or pos[p] >= ends[p] for p in parts):
                break
        return out
    finally:
        c.close()


def read_delta(path: str) -> tuple[dict[int, list[dict]], list[float]]:
    """A Delta table's rows in commit order (as one "partition") and the moment each row became visible:
    the modification time of the log entry of the version that added it (seconds)."""
    import pyarrow.parquet as pq

    log_dir = Path(path, "_delta_log")
    rows: list[dict] = []
    visible: list[float] = []
    for entry in sorted(log_dir.glob("*.json")):
        at = entry.stat().st_mtime
        for line in entry.read_text().splitlines():
            add = json.loads(line).get("add") if line.strip() else None
            if add is None:
                continue
            table = pq.read_table(Path(path, urllib.parse.unquote(add["path"])), columns=["k", "c", "ts"])
            got = table.to_pylist()
            rows.extend(got)
            visible.extend([at] * len(got))
    return {0: rows}, visible


@dataclass
class Check:
    """What a run's output showed against its input."""

    outputs: int
    keys_complete: int
    keys_expected: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self, limit: int = 3) -> str:
        if self.ok:
            return f"ok: {self.outputs} outputs, every key's final count = its input count"
        more = f" (+{len(self.problems) - limit} more)" if len(self.problems) > limit else ""
        return f"FAILED: {'; '.join(self.problems[:limit])}{more}"


def check_counts(outputs: dict[int, list[dict]], n: int, keys: int,
                 ts_of: Callable[[str, int], int] | None = None, complete: bool = True) -> Check:
    """The running counts of a run that read ``n`` records over ``keys`` keys: per key, counts strictly
    increase in output order (a count repeated or going back is an output committed twice or a state
    replayed), the last one is the key's input count (``complete``; else only noted as a shortfall), and,
    with ``ts_of`` (the pre-produced topic), each count carries the ts of the key's record it ends at, so
    each increment is exactly the key's next records."""
    expected = expected_counts(n, keys)
    last: dict[str, int] = {}
    problems: list[str] = []
    total = 0
    for part in sorted(outputs):
        for r in outputs[part]:
            total += 1
            k, c = r["k"], int(r["c"])
            prev = last.get(k, 0)
            if c <= prev:
                problems.append(f"{k}: count {c} after {prev} (duplicate or replayed output)")
            elif ts_of is not None and int(r["ts"]) != ts_of(k, c):
                problems.append(f"{k}: count {c} carries ts {r['ts']}, its {c}th record has {ts_of(k, c)}")
            last[k] = max(prev, c)
    unknown = sorted(set(last) - set(expected))
    if unknown:
        problems.append(f"{len(unknown)} keys not in the input, e.g. {unknown[0]!r}")
    short = [k for k, want in expected.items() if last.get(k, 0) != want]
    if short and complete:
        k = short[0]
        problems.append(f"{len(short)} of {len(expected)} keys' final counts differ from their input counts, "
                        f"e.g. {k}: {last.get(k, 0)} for {expected[k]}")
    return Check(total, len(expected) - len(short), len(expected), problems)


def env_with_repository(root: Path) -> None:
    """Put the repository on ``PYTHONPATH`` (Spark's Python workers import this module by name)."""
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
