"""Kafka -> keyed running count -> Kafka on PyFlink, with ``KafkaSink`` exactly-once: the PyFlink row of
benchmarks/kafka/kafka.py (which starts the broker, fills the topics, loads and reads them; this script only runs
the job). Run with the interpreter of benchmarks/.venv-pyflink (run_peers.ensure_venv).

Job: Flink's Kafka source (the SQL connector's table source, ``key.format`` raw so the Kafka key is read,
as epochstream's and Spark's sources read it, and the record's timestamp as metadata) -> DataStream ->
key_by(key) -> running count per key in a Python ``KeyedProcessFunction`` (ValueState, hashmap backend)
-> JSON string ``{"key": .., "n": .., "ts": <input's Kafka timestamp, ms>}`` -> ``KafkaSink`` with
``DeliveryGuarantee.EXACTLY_ONCE``: each checkpoint's output is one Kafka transaction per subtask,
committed when the checkpoint completes, so a ``read_committed`` reader sees it only then. Local
mini-cluster, parallelism ``--workers``, Python in Beam worker processes (Flink's default) or, with
``--python-mode thread``, embedded in the JVM. Other settings are Flink's defaults (bundles of 1,000
records or 1 s, aligned checkpoints, hashmap state).

``--bounded``: read the topic to its end offsets at start, then finish (Flink takes a final checkpoint,
which commits the last transaction); prints ``seconds_steady`` (first record in the Python count ->
``execute()`` returned: Python start-up left out, the last commit in) and ``seconds_execute``
(``execute()`` called -> returned: job submission and Python worker start-up in, JVM start-up out).
Otherwise the job runs until a line arrives on stdin, then is cancelled; it prints ``{"running": ...}``
once its first checkpoint completed. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Iterator, Optional

from flink_setup import job_config, kafka_sink_properties, kafka_table_ddl
from pyflink.common import Configuration, Row, Types
from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import KafkaRecordSerializationSchema, KafkaSink
from pyflink.datastream.functions import KeyedProcessFunction
from pyflink.datastream.state import ValueStateDescriptor
from pyflink.table import StreamTableEnvironment
from pyflink_keyed_count import completed_checkpoints

HERE = Path(__file__).resolve().parent


def epoch_ms(instant) -> int:
    """Milliseconds of a TIMESTAMP_LTZ value: process mode hands Python a ``pyflink.common.time.Instant``,
    thread mode the ``java.time.Instant`` itself (a PEMJA proxy without ``to_epoch_milli``)."""
    to_ms = getattr(instant, "to_epoch_milli", None)
    return int(to_ms() if to_ms is not None else instant.toEpochMilli())


class RunningCount(KeyedProcessFunction):
    """Per-key running count in keyed state; one JSON line per input row (key, Kafka timestamp as an
    Instant), carrying that timestamp in ms.
    Notes its first record's time in ``out_dir`` on close (the steady rate's start)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("n", Types.LONG()))
        self.t_first: Optional[float] = None

    def process_element(self, row: Row, ctx: KeyedProcessFunction.Context) -> Iterator[str]:
        if self.t_first is None:
            self.t_first = time.time()
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        yield '{"key":"%s","n":%d,"ts":%d}' % (row[0], n, epoch_ms(row[1]))

    def close(self) -> None:
        if self.t_first is not None:
            Path(self.out_dir, f"first-{uuid.uuid4().hex}").write_text(repr(self.t_first))


def connector_jars() -> list[str]:
    """file: URLs of the Flink Kafka connector's jars (jars/kafka-flink/lib, fetched by kafka.py)."""
    lib = HERE.parents[1] / "jars" / "kafka-flink" / "lib"
    jars = sorted(lib.glob("*.jar"))
    if not jars:
        raise SystemExit(f"no Flink Kafka connector jars in {lib} (benchmarks/kafka/kafka.py --pyflink fetches them)")
    return [p.as_uri() for p in jars]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--source-topic", required=True)
    p.add_argument("--sink-topic", required=True)
    p.add_argument("--group", required=True, help="the source's consumer group (offsets committed at checkpoints)")
    p.add_argument("--interval", type=float, required=True, help="checkpoint interval, seconds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bounded", action="store_true")
    p.add_argument("--python-mode", choices=["process", "thread"], default="process",
                   help="process: Beam worker processes (Flink's default); thread: UDFs embedded in the JVM (PEMJA)")
    p.add_argument("--transaction-timeout-ms", type=int, default=300_000)
    p.add_argument("--broker-max-timeout-ms", type=int, default=900_000,
                   help="the broker's transaction.max.timeout.ms (Kafka's default 900000)")
    args = p.parse_args()
    # read by StreamExecutionEnvironment: unset, a local job runs every UDF in this client process (loopback)
    os.environ["_python_worker_execution_mode"] = "process"
    if args.python_mode == "thread":  # the JVM-embedded interpreter must see this venv's packages
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sysconfig.get_paths()["purelib"],
                                                                  os.environ.get("PYTHONPATH")]))

    with tempfile.TemporaryDirectory(prefix="pyflink-kafka-") as tmp:
        conf = Configuration()
        for k, v in job_config(python_mode=args.python_mode, checkpoint_dir=str(Path(tmp, "checkpoints")),
                               python_executable=sys.executable).items():
            conf.set_string(k, v)
        conf.set_string("pipeline.jars", ";".join(connector_jars()))
        env = StreamExecutionEnvironment.get_execution_environment(conf)  # starts the JVM
        env.set_parallelism(args.workers)
        env.enable_checkpointing(max(1, int(args.interval * 1000)))
        t_env = StreamTableEnvironment.create(env)
        t_env.execute_sql(kafka_table_ddl("src", bootstrap=args.bootstrap, topic=args.source_topic,
                                          group=args.group, bounded=args.bounded))
        stats = Path(tmp, "stats")
        stats.mkdir()
        rows = t_env.to_data_stream(t_env.sql_query("SELECT k, ts FROM src"))
        counts = rows.key_by(lambda r: r[0], key_type=Types.STRING()).process(RunningCount(str(stats)),
                                                                                output_type=Types.STRING())
        builder = (KafkaSink.builder().set_bootstrap_servers(args.bootstrap)
                   .set_record_serializer(KafkaRecordSerializationSchema.builder().set_topic(args.sink_topic)
                                          .set_value_serialization_schema(SimpleStringSchema()).build())
                   .set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE)
                   .set_transactional_id_prefix(f"pyflink-bench-{uuid.uuid4().hex[:8]}"))
        for k, v in kafka_sink_properties(args.transaction_timeout_ms, args.interval,
                                          args.broker_max_timeout_ms).items():
            builder.set_property(k, v)
        counts.sink_to(builder.build())
        t0 = time.time()
        if args.bounded:
            result = env.execute("pyflink-kafka-count")
            t_end = time.time()
            firsts = [float(f.read_text()) for f in stats.glob("first-*")]
            out = {"version": version("apache-flink"), "job_id": str(result.get_job_id()),
                   "seconds_execute": round(t_end - t0, 3),
                   "seconds_steady": round(t_end - min(firsts), 3) if firsts else None}
        else:
            client = env.execute_async("pyflink-kafka-count")
            job_id = str(client.get_job_id())
            # running once a checkpoint completed: every task, Python workers too, is up (the source
            # commits no offsets for partitions it read nothing from, so its group cannot tell)
            deadline = time.time() + 300
            while not completed_checkpoints(job_id) and time.time() < deadline:
                time.sleep(0.2)
            print(json.dumps({"running": job_id}), flush=True)
            sys.stdin.readline()  # kafka.py's signal: the load is over and the output had time to come out
            client.cancel().result()
            out = {"version": version("apache-flink"), "job_id": str(client.get_job_id()),
                   "seconds_execute": round(time.time() - t0, 3)}
    out["checkpoints"] = len(completed_checkpoints(out["job_id"]))
    out["python_mode"] = args.python_mode
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
