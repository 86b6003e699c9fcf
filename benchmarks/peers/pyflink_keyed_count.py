"""Keyed running count on PyFlink (apache-flink 2.x) -- peer baseline for benchmarks/throughput.py.

Workload (identical to bytewax_keyed_count.py, see README.md):
records i = 0..N-1 -> (f"k{i % K}", 1); map (value * 1); key by key;
stateful per-key running count (ValueState in a Python KeyedProcessFunction)
emitting (key, count); sink counts outputs and discards them.

Run it with the interpreter of benchmarks/.venv-pyflink (run_peers.py does that):
apache-flink pins its own numpy/pandas/pyarrow, so it must not share the main env.
Local mini-cluster in the JVM that PyFlink starts, parallelism = --workers,
hashmap state backend, filesystem checkpoint storage in a temp dir.
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
from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.number_seq import NumberSequenceSource
from pyflink.datastream.functions import FlatMapFunction, KeyedProcessFunction, MapFunction
from pyflink.datastream.state import ValueStateDescriptor

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
    args = p.parse_args()
    started = process_start_time()
    cpu = TreeCpuSampler()
    n, keys = args.records, args.keys
    # Read by StreamExecutionEnvironment._open(); unset means loopback for a local mini-cluster.
    os.environ["_python_worker_execution_mode"] = "loopback" if args.python_mode == "loopback" else "process"
    if args.python_mode == "thread":  # the JVM-embedded interpreter must see this venv's packages
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sysconfig.get_paths()["purelib"],
                                                                  os.environ.get("PYTHONPATH")]))

    with tempfile.TemporaryDirectory(prefix="pyflink-peer-") as tmp:
        conf = Configuration()
        conf.set_string("execution.checkpointing.dir", Path(tmp, "checkpoints").as_uri())
        conf.set_string("state.backend.type", "hashmap")
        conf.set_string("python.executable", sys.executable)  # workers default to `python` on PATH
        conf.set_string("python.execution-mode", "thread" if args.python_mode == "thread" else "process")
        conf.set_string("restart-strategy.type", "none")  # fail fast instead of restarting forever
        env = StreamExecutionEnvironment.get_execution_environment(conf)  # starts the JVM
        env.set_parallelism(args.workers)
        if args.snapshot_interval > 0:
            env.enable_checkpointing(int(args.snapshot_interval * 1000))
        stats = Path(tmp, "stats")
        stats.mkdir()

        src = env.from_source(NumberSequenceSource(0, n - 1), WatermarkStrategy.no_watermarks(), "seq")
        recs = src.map(Generate(keys, str(stats)), output_type=KV)
        recs = recs.map(lambda r: (r[0], r[1] * 1), output_type=KV)  # the "map" operator
        counts = recs.key_by(lambda r: r[0], key_type=Types.STRING()).process(RunningCount(), output_type=KV)
        counts.flat_map(CountingSink(str(stats)), output_type=Types.LONG()).print()  # print gets nothing

        t0 = time.time()
        result = env.execute("keyed_count")
        end = time.time()
        firsts = [float(f.read_text()) for f in stats.glob("first-*")]
        sinks = [f.read_text().split() for f in stats.glob("count-*")]

    outputs = sum(int(c) for c, _ in sinks)
    seconds = max(float(t) for _, t in sinks) - min(firsts)
    ckpts = completed_checkpoints(str(result.get_job_id()))
    print(json.dumps({
        "system": "pyflink", "version": version("apache-flink"), "records": n, "keys": keys,
        "seconds": round(seconds, 3), "seconds_job": result.get_net_runtime() / 1000.0,
        "seconds_execute_wall": round(end - t0, 3), "seconds_incl_startup": round(end - started, 3),
        "records_per_s": round(n / seconds, 1), "workers": args.workers, "python_mode": args.python_mode,
        "snapshot_interval": args.snapshot_interval, "snapshots_completed": len(ckpts),
        "snapshot_ms_mean": round(sum(ckpts) / len(ckpts)) if ckpts else None, "outputs": outputs,
        "cpu_seconds": round(cpu.stop(), 2),  # this script + JVM + Python workers
    }), flush=True)
    if outputs != n:
        print(f"outputs {outputs} != records {n}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
