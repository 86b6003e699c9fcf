"""Kafka JSON -> per-key running count (and histogram) -> Kafka on PyFlink with ``KafkaSink`` exactly-once:
the PyFlink row of benchmarks/kafka/kafka_json_pandas.py (which starts the broker, fills and loads the topics and
reads the output; this script only runs the job). Run with the interpreter of benchmarks/.venv-pyflink.

PyFlink cannot run PySpark's ``applyInPandasWithState`` function or ``StatefulProcessor``, so the same logic
is written in its keyed API: Flink's Kafka table source parses the JSON value in the JVM (``format`` json,
columns ``k STRING, v BIGINT, ts BIGINT``, as Spark's ``from_json``) -> DataStream -> key_by(k) -> a Python
``KeyedProcessFunction`` keeping the running count and newest ``ts`` in ValueState (``--function
transform``: also a MapState histogram of ``v % 10``) and emitting one JSON row ``{"k", "c", "ts"}`` per key
per ``--interval`` (a processing-time timer at the next interval boundary, so one row per key per
micro-batch as Spark's and epochstream's wrappers emit), and once more at the end of bounded input (an
event-time timer at the final watermark) -> ``KafkaSink`` with ``DeliveryGuarantee.EXACTLY_ONCE``,
checkpoints every ``--interval``. Other settings are Flink's defaults (hashmap state, aligned checkpoints,
bundles of 1,000 records or 1 s, Python in Beam worker processes).

``--bounded``: read to the end offsets found at start, then finish; prints ``seconds_steady`` (first record
in the Python function -> ``execute()`` returned) and ``seconds_execute`` (``execute()`` called -> returned).
Otherwise the job runs until a line arrives on stdin; it prints ``{"running": ...}`` once its first
checkpoint completed. Last stdout line: one JSON object, with ``checkpoint_ms`` (each completed checkpoint's
duration, from Flink's log).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Iterator, Optional

from flink_setup import job_config, kafka_sink_properties
from pyflink.common import Configuration, Row, Types, WatermarkStrategy
from pyflink.common.serialization import SimpleStringSchema
from pyflink.common.watermark_strategy import TimestampAssigner
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment, TimeDomain
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink
from pyflink.datastream.functions import KeyedProcessFunction
from pyflink.datastream.state import MapStateDescriptor, ValueStateDescriptor
from pyflink.java_gateway import get_gateway
from pyflink.table import StreamTableEnvironment
from pyflink_kafka_count import connector_jars
from pyflink_keyed_count import completed_checkpoints

#: the final watermark of a bounded input fires event-time timers at this time (Long.MAX_VALUE)
END_OF_INPUT = 2**63 - 1


def json_table_ddl(name: str, *, bootstrap: str, topic: str, group: str, bounded: bool) -> str:
    """CREATE TABLE of Flink's Kafka source with the JSON value parsed into ``k, v, ts``."""
    for what, value in (("table name", name), ("topic", topic), ("group", group)):
        if not value or "'" in value or "`" in value:
            raise ValueError(f"{what} {value!r} cannot be quoted into the DDL")
    options = {
        "connector": "kafka",
        "topic": topic,
        "properties.bootstrap.servers": bootstrap,
        "properties.group.id": group,
        "scan.startup.mode": "earliest-offset",
        "format": "json",
    }
    if bounded:
        options["scan.bounded.mode"] = "latest-offset"
    body = ",\n  ".join(f"'{k}' = '{v}'" for k, v in options.items())
    return f"CREATE TABLE `{name}` (\n  k STRING,\n  v BIGINT,\n  ts BIGINT\n) WITH (\n  {body}\n)"


class CountPerInterval(KeyedProcessFunction):
    """Running count and newest ts per key (and a histogram of ``v % 10``), one output row per key per
    interval. Notes its first record's time in ``out_dir`` on close (the steady rate's start)."""

    def __init__(self, interval_ms: int, histogram: bool, out_dir: str) -> None:
        self.interval_ms, self.histogram, self.out_dir = interval_ms, histogram, out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("c", Types.LONG()))
        self.newest = runtime_context.get_state(ValueStateDescriptor("ts", Types.LONG()))
        self.pending = runtime_context.get_state(ValueStateDescriptor("timer", Types.LONG()))
        if self.histogram:
            self.hist = runtime_context.get_map_state(MapStateDescriptor("hist", Types.LONG(), Types.LONG()))
        self.t_first: Optional[float] = None

    def process_element(self, row: Row, ctx: KeyedProcessFunction.Context) -> Iterator[str]:
        if self.t_first is None:
            self.t_first = time.time()
        c = (self.count.value() or 0) + 1
        self.count.update(c)
        self.newest.update(max(self.newest.value() or 0, row[2]))
        if self.histogram:
            bucket = row[1] % 10
            self.hist.put(bucket, (self.hist.get(bucket) or 0) + 1)
        if c == 1:
            ctx.timer_service().register_event_time_timer(END_OF_INPUT)
        if self.pending.value() is None:
            now = ctx.timer_service().current_processing_time()
            due = (now // self.interval_ms + 1) * self.interval_ms
            ctx.timer_service().register_processing_time_timer(due)
            self.pending.update(due)
        return iter(())

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterator[str]:
        due = self.pending.value()
        if due is None:  # nothing new since this key's last row (end of input after its last interval)
            return
        if ctx.time_domain() == TimeDomain.EVENT_TIME:  # end of input: flush, and the interval's timer goes
            ctx.timer_service().delete_processing_time_timer(due)
        self.pending.clear()
        yield '{"k":"%s","c":%d,"ts":%d}' % (ctx.get_current_key(), self.count.value(), self.newest.value())

    def close(self) -> None:
        if self.t_first is not None:
            Path(self.out_dir, f"first-{uuid.uuid4().hex}").write_text(repr(self.t_first))


class EmittedNow(TimestampAssigner):
    """Output rows stamped with the moment they were made: the end-of-input rows would carry their
    timer's time (Long.MAX_VALUE), which Kafka refuses as a record timestamp."""

    def extract_timestamp(self, value, record_timestamp: int) -> int:
        return int(time.time() * 1000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--source-topic", required=True)
    p.add_argument("--sink-topic", required=True)
    p.add_argument("--group", required=True, help="the source's consumer group")
    p.add_argument("--interval", type=float, default=1.0, help="checkpoint and output interval, seconds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--function", choices=["apply", "transform"], default="apply",
                   help="apply: count and newest ts; transform: also the MapState histogram")
    p.add_argument("--bounded", action="store_true")
    p.add_argument("--transaction-timeout-ms", type=int, default=300_000)
    args = p.parse_args()
    os.environ["_python_worker_execution_mode"] = "process"  # Beam worker processes, Flink's default
    with tempfile.TemporaryDirectory(prefix="pyflink-json-") as tmp:
        conf = Configuration()
        for k, v in job_config(python_mode="process", checkpoint_dir=str(Path(tmp, "checkpoints")),
                               python_executable=sys.executable).items():
            conf.set_string(k, v)
        conf.set_string("pipeline.jars", ";".join(connector_jars()))
        env = StreamExecutionEnvironment.get_execution_environment(conf)
        env.set_parallelism(args.workers)
        interval_ms = max(1, int(args.interval * 1000))
        env.enable_checkpointing(interval_ms)
        t_env = StreamTableEnvironment.create(env)
        t_env.execute_sql(json_table_ddl("src", bootstrap=args.bootstrap, topic=args.source_topic,
                                         group=args.group, bounded=args.bounded))
        stats = Path(tmp, "stats")
        stats.mkdir()
        rows = t_env.to_data_stream(t_env.sql_query("SELECT k, v, ts FROM src"))
        out = rows.key_by(lambda r: r[0], key_type=Types.STRING()).process(
            CountPerInterval(interval_ms, args.function == "transform", str(stats)), output_type=Types.STRING()
        ).assign_timestamps_and_watermarks(WatermarkStrategy.no_watermarks().with_timestamp_assigner(EmittedNow()))
        serializer = (KafkaRecordSerializationSchema.builder().set_topic(args.sink_topic)
                      .set_value_serialization_schema(SimpleStringSchema()))
        # each sink subtask writes one partition (PyFlink's builder has no set_partitioner): a key's rows,
        # all from the subtask that owns it, stay in order in one partition, as the other systems' by key
        serializer._j_builder.setPartitioner(
            get_gateway().jvm.org.apache.flink.streaming.connectors.kafka.partitioner.FlinkFixedPartitioner())
        builder = (KafkaSink.builder().set_bootstrap_servers(args.bootstrap)
                   .set_record_serializer(serializer.build())
                   .set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE)
                   .set_transactional_id_prefix(f"pyflink-json-{uuid.uuid4().hex[:8]}"))
        for k, v in kafka_sink_properties(args.transaction_timeout_ms, args.interval).items():
            builder.set_property(k, v)
        out.sink_to(builder.build())
        t0 = time.time()
        if args.bounded:
            result = env.execute("pyflink-kafka-json-state")
            t_end = time.time()
            firsts = [float(f.read_text()) for f in stats.glob("first-*")]
            res = {"job_id": str(result.get_job_id()), "seconds_execute": round(t_end - t0, 3),
                   "seconds_steady": round(t_end - min(firsts), 3) if firsts else None}
        else:
            client = env.execute_async("pyflink-kafka-json-state")
            job_id = str(client.get_job_id())
            deadline = time.time() + 300
            while not completed_checkpoints(job_id) and time.time() < deadline:
                time.sleep(0.2)
            print(json.dumps({"running": job_id}), flush=True)
            sys.stdin.readline()
            client.cancel().result()
            res = {"job_id": job_id, "seconds_execute": round(time.time() - t0, 3)}
    res["checkpoint_ms"] = completed_checkpoints(res["job_id"])
    res["version"] = version("apache-flink")
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
