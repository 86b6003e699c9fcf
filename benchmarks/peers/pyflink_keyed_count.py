"""Keyed running count on PyFlink (apache-flink 2.x) -- peer baseline for benchmarks/epochs/throughput.py.

Workload (identical to bytewax_keyed_count.py, see README.md):
records i = 0..N-1 -> (f"k{i % K}", 1); map (value * 1); key by key;
stateful per-key running count (ValueState in a Python KeyedProcessFunction)
emitting (key, count); sink counts outputs and discards them.

Run it with the interpreter of benchmarks/.venv-pyflink (run_peers.py does that):
apache-flink pins its own numpy/pandas/pyarrow, so it must not share the main env.
Local mini-cluster in the JVM that PyFlink starts (or, with --cluster N, a standalone
cluster of N TaskManagers x 1 slot started from the wheel's jars), parallelism = --workers,
hashmap state backend, filesystem checkpoint storage in a temp dir. Tuning flags:
--bundle-size, --no-metrics, --unaligned (see flink_setup.job_config). --sql runs the JVM's
ceiling instead: Flink SQL `COUNT(*) GROUP BY` over the same keys, no Python in the job.
Prints one JSON line on stdout; exits 1 if outputs != records.

"seconds" is first record generated -> last output counted (measured inside the
Python UDFs), so it excludes JVM start, job submission and Python worker start-up;
"seconds_job" is Flink's net job runtime, which includes the worker start-up.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import sysconfig
import tempfile
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pyflink
from _procinfo import TreeCpuSampler, process_start_time  # only used in main(), never in UDFs
from flink_setup import StandaloneCluster, job_config, variant_label
from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.number_seq import NumberSequenceSource
from pyflink.datastream.functions import FlatMapFunction, KeyedProcessFunction, MapFunction
from pyflink.datastream.state import ValueStateDescriptor
from pyflink.java_gateway import get_gateway
from pyflink.table import StreamTableEnvironment

KV = Types.TUPLE([Types.STRING(), Types.LONG()])


class Generate(MapFunction):
    """i -> (f"k{i % keys}", 1); notes when its first record arrived (timing start)."""

    def __init__(self, keys: int, out_dir: str) -> None:
        self.keys, self.out_dir = keys, out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.t_first: Optional[float] = None

    def map(self, i: int) -> Tuple[str, int]:
        if self.t_first is None:
            self.t_first = time.time()
        return f"k{i % self.keys}", 1

    def close(self) -> None:
        if self.t_first is not None:
            Path(self.out_dir, f"first-{uuid.uuid4().hex}").write_text(repr(self.t_first))


class RunningCount(KeyedProcessFunction):
    """Per-key running count kept in Flink keyed state (checkpointed)."""

    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value: Tuple[str, int], ctx: KeyedProcessFunction.Context) -> Iterator[Tuple[str, int]]:
        c = (self.count.value() or 0) + value[1]
        self.count.update(c)
        yield value[0], c


class CountingSink(FlatMapFunction):
    """Counts and drops outputs; on close writes "count last_output_time" to a file.

    PyFlink has no Python-side sink API, and collecting all N outputs to the client
    would distort the measurement, so each subtask reports its count via a file.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.n, self.t_last = 0, 0.0

    def flat_map(self, value: Tuple[str, int]) -> Iterator[None]:
        self.n += 1
        self.t_last = time.time()
        return iter(())

    def close(self) -> None:
        Path(self.out_dir, f"count-{uuid.uuid4().hex}").write_text(f"{self.n} {self.t_last!r}")


def completed_checkpoints(job_id: str) -> List[int]:
    """Durations (ms) of this job's completed checkpoints, from the local Flink log."""
    pat = re.compile(rf"Completed checkpoint \d+ for job {job_id} .*checkpointDuration=(\d+) ms")
    out: List[int] = []
    for log in glob.glob(os.path.join(os.path.dirname(pyflink.__file__), "log", "*.log")):
        with open(log, errors="replace") as f:
            out += [int(m.group(1)) for m in map(pat.search, f) if m]
    return out


def remote_env(rest_port: int, conf: Configuration) -> StreamExecutionEnvironment:
    """A StreamExecutionEnvironment that submits to the standalone cluster's REST endpoint.

    get_execution_environment() always makes a local one outside `flink run`; the Java
    RemoteStreamEnvironment ships no jars here (flink-python is on the TaskManagers' class path).
    """
    gw = get_gateway()
    jenv = gw.jvm.org.apache.flink.streaming.api.environment.StreamExecutionEnvironment.createRemoteEnvironment(
        "localhost", rest_port, conf._j_configuration, gw.new_array(gw.jvm.String, 0))
    return StreamExecutionEnvironment(jenv)


def run_sql(env: StreamExecutionEnvironment, n: int, keys: int) -> str:
    """The keyed count in Flink SQL (datagen -> key "k<i>" -> COUNT(*) GROUP BY -> blackhole); its job id."""
    t_env = StreamTableEnvironment.create(env)
    # Random keys in [0, keys), not a sequence: datagen's sequence generator checkpoints every value
    # it has not emitted yet (20 MB per subtask at 5M records, over Flink's RPC frame limit).
    t_env.execute_sql(f"""CREATE TABLE seq (i BIGINT) WITH ('connector' = 'datagen',
        'number-of-rows' = '{n}', 'fields.i.kind' = 'random', 'fields.i.min' = '0', 'fields.i.max' = '{keys - 1}',
        'rows-per-second' = '1000000000')""")
    t_env.execute_sql("CREATE TABLE out_counts (k STRING, c BIGINT) WITH ('connector' = 'blackhole')")
    result = t_env.execute_sql("""INSERT INTO out_counts
        SELECT k, COUNT(*) FROM (SELECT CONCAT('k', CAST(i AS STRING)) AS k FROM seq) GROUP BY k""")
    client = result.get_job_client()
    assert client is not None
    result.wait()
    return str(client.get_job_id())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=300_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--snapshot-interval", type=float, default=1.0, help="checkpoint interval, seconds; 0 = off")
    p.add_argument("--workers", type=int, default=2, help="parallelism")
    p.add_argument("--python-mode", choices=["process", "loopback", "thread"], default="process",
                   help="process: Beam worker processes (python.execution-mode=process, one per slot); "
                        "loopback: PyFlink's local default, all UDFs in this client process; "
                        "thread: python.execution-mode=thread, UDFs embedded in the JVM via PEMJA")
    p.add_argument("--bundle-size", type=int, help="python.fn-execution.bundle.size (Flink 2.3 default: 1000)")
    p.add_argument("--no-metrics", action="store_true", help="python.metric.enabled = false")
    p.add_argument("--unaligned", action="store_true", help="unaligned checkpoints")
    p.add_argument("--cluster", type=int, default=0,
                   help="run on a standalone cluster of this many TaskManagers x 1 slot (0: local mini-cluster)")
    p.add_argument("--sql", action="store_true",
                   help="Flink SQL COUNT(*) GROUP BY instead of the Python job (needs --cluster: counts via REST)")
    args = p.parse_args()
    if args.cluster and args.python_mode == "loopback":
        p.error("--python-mode loopback runs UDFs in this process: not with --cluster")
    if args.sql and not args.cluster:
        p.error("--sql needs --cluster N (its output count is read from the cluster's REST API)")
    started = process_start_time()
    cpu = TreeCpuSampler()
    n, keys = args.records, args.keys
    # Read by StreamExecutionEnvironment._open(); unset means loopback for a local mini-cluster.
    os.environ["_python_worker_execution_mode"] = "loopback" if args.python_mode == "loopback" else "process"
    if args.python_mode == "thread":  # the JVM-embedded interpreter must see this venv's packages
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sysconfig.get_paths()["purelib"],
                                                                  os.environ.get("PYTHONPATH")]))
    label = variant_label(python_mode=args.python_mode, bundle_size=args.bundle_size, metrics=not args.no_metrics,
                          unaligned=args.unaligned, cluster=args.cluster, sql=args.sql)

    with tempfile.TemporaryDirectory(prefix="pyflink-peer-") as tmp:
        conf = Configuration()
        for k, v in job_config(python_mode=args.python_mode, checkpoint_dir=str(Path(tmp, "checkpoints")),
                               python_executable=sys.executable, bundle_size=args.bundle_size,
                               metrics=not args.no_metrics, unaligned=args.unaligned).items():
            conf.set_string(k, v)
        cluster = StandaloneCluster(Path(tmp, "cluster"), args.cluster) if args.cluster else None
        if cluster:
            cluster.__enter__()
        try:
            env = (remote_env(cluster.rest_port, conf) if cluster
                   else StreamExecutionEnvironment.get_execution_environment(conf))  # starts the JVM
            env.set_parallelism(args.workers)
            if args.snapshot_interval > 0:
                env.enable_checkpointing(int(args.snapshot_interval * 1000))
            stats = Path(tmp, "stats")
            stats.mkdir()
            t0 = time.time()
            if args.sql:
                job_id = run_sql(env, n, keys)
                seconds_job = None
            else:
                src = env.from_source(NumberSequenceSource(0, n - 1), WatermarkStrategy.no_watermarks(), "seq")
                recs = src.map(Generate(keys, str(stats)), output_type=KV)
                recs = recs.map(lambda r: (r[0], r[1] * 1), output_type=KV)  # the "map" operator
                counts = recs.key_by(lambda r: r[0], key_type=Types.STRING()).process(RunningCount(),
                                                                                       output_type=KV)
                counts.flat_map(CountingSink(str(stats)), output_type=Types.LONG()).print()  # print gets nothing
                result = env.execute("keyed_count")
                job_id, seconds_job = str(result.get_job_id()), result.get_net_runtime() / 1000.0
            end = time.time()
            rest = cluster.job_stats(job_id) if cluster else None
        finally:
            if cluster:
                cluster.stop()
        firsts = [float(f.read_text()) for f in stats.glob("first-*")]
        sinks = [f.read_text().split() for f in stats.glob("count-*")]

    if args.sql:
        assert rest is not None
        # the GroupAggregate vertex (chained with the sink) reads every record once
        outputs = sum(v["read"] for v in rest["vertices"] if "GroupAggregate" in v["name"])
        # first task deployed -> last task finished: includes task deployment, no Python start-up
        seconds = (max(v["end"] for v in rest["vertices"]) - min(v["start"] for v in rest["vertices"])) / 1000.0
    else:
        outputs = sum(int(c) for c, _ in sinks)
        seconds = max(float(t) for _, t in sinks) - min(firsts)
    if rest:
        ckpt_count, ckpt_mean = rest["checkpoints"], rest["checkpoint_ms_mean"]
    else:
        ckpts = completed_checkpoints(job_id)
        ckpt_count, ckpt_mean = len(ckpts), (round(sum(ckpts) / len(ckpts)) if ckpts else None)
    print(json.dumps({
        "system": "flink-sql" if args.sql else "pyflink", "version": version("apache-flink"), "records": n,
        "keys": keys, "seconds": round(seconds, 3), "seconds_job": seconds_job,
        "seconds_execute_wall": round(end - t0, 3), "seconds_incl_startup": round(end - started, 3),
        "records_per_s": round(n / seconds, 1), "workers": args.workers, "python_mode": args.python_mode,
        "bundle_size": args.bundle_size, "metrics": not args.no_metrics, "unaligned": args.unaligned,
        "cluster_taskmanagers": args.cluster, "settings": label,
        "snapshot_interval": args.snapshot_interval, "snapshots_completed": ckpt_count,
        "snapshot_ms_mean": ckpt_mean, "outputs": outputs,
        "cpu_seconds": round(cpu.stop(), 2),  # this script + JVMs (+ cluster) + Python workers
    }), flush=True)
    if outputs != n:
        print(f"outputs {outputs} != records {n}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
