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
from typing import Iterator, Tuple

from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.number_seq import NumberSequenceSource
from pyflink.datastream.functions import FlatMapFunction, KeyedProcessFunction
from pyflink.datastream.state import ValueStateDescriptor

KV = Types.TUPLE([Types.STRING(), Types.LONG()])


def process_start_time() -> float:
    """Epoch time this process was exec'd (Linux /proc), to report startup cost."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + start_ticks / ticks


class RunningCount(KeyedProcessFunction):
    """Per-key running count kept in Flink keyed state (checkpointed)."""

    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value: Tuple[str, int], ctx: KeyedProcessFunction.Context) -> Iterator[Tuple[str, int]]:
        c = (self.count.value() or 0) + value[1]
        self.count.update(c)
        yield value[0], c


class CountingSink(FlatMapFunction):
    """Counts and drops outputs; writes its count to a file on close.

    PyFlink has no Python-side sink API, and collecting all N outputs to the client
    would distort the measurement, so each subtask reports its count via a file.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.n = 0

    def flat_map(self, value: Tuple[str, int]) -> Iterator[None]:
        self.n += 1
        return iter(())

    def close(self) -> None:
        Path(self.out_dir, f"count-{uuid.uuid4().hex}").write_text(str(self.n))


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
    # Read by StreamExecutionEnvironment._open(); unset means loopback for a local mini-cluster.
    os.environ["_python_worker_execution_mode"] = "loopback" if args.python_mode == "loopback" else "process"
    if args.python_mode == "thread":  # the JVM-embedded interpreter must see this venv's packages
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sysconfig.get_paths()["purelib"],
                                                                  os.environ.get("PYTHONPATH")]))
    started = process_start_time()
    n, keys = args.records, args.keys

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
        counts_dir = Path(tmp, "counts")
        counts_dir.mkdir()

        src = env.from_source(NumberSequenceSource(0, n - 1), WatermarkStrategy.no_watermarks(), "seq")
        recs = src.map(lambda i: (f"k{i % keys}", 1), output_type=KV)  # the generator
        recs = recs.map(lambda r: (r[0], r[1] * 1), output_type=KV)  # the "map" operator
        counts = recs.key_by(lambda r: r[0], key_type=Types.STRING()).process(RunningCount(), output_type=KV)
        counts.flat_map(CountingSink(str(counts_dir)), output_type=Types.LONG()).print()  # print gets nothing

        t0 = time.time()
        result = env.execute("keyed_count")
        end = time.time()
        outputs = sum(int(f.read_text()) for f in counts_dir.iterdir())
        checkpoints = _completed_checkpoints(Path(tmp, "checkpoints"))

    seconds = result.get_net_runtime() / 1000.0
    print(json.dumps({
        "system": "pyflink", "version": version("apache-flink"), "records": n, "keys": keys,
        "seconds": round(seconds, 3), "seconds_execute_wall": round(end - t0, 3),
        "seconds_incl_startup": round(end - started, 3), "records_per_s": round(n / seconds, 1),
        "workers": args.workers, "python_mode": args.python_mode, "snapshot_interval": args.snapshot_interval, "outputs": outputs,
        "checkpoints_retained": checkpoints,
    }), flush=True)
    if outputs != n:
        print(f"outputs {outputs} != records {n}", file=sys.stderr)
        return 1
    return 0


def _completed_checkpoints(root: Path) -> int:
    """Count chk-* dirs left (Flink keeps only the latest by default; 0 means none done)."""
    return sum(1 for _ in root.glob("*/chk-*"))


if __name__ == "__main__":
    sys.exit(main())
