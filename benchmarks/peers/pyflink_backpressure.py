"""Epochs under backpressure on PyFlink: aligned against unaligned checkpoints, the shape of
benchmarks/epochs/backpressure.py (its ``--peers pyflink`` comparison).

Workload: Flink's ``NumberSequenceSource`` paced to ``--rate`` records/s (a Python map chained
to the source sleeps to keep the pace) -> key by ``i % 1000`` -> a keyed running count
(``ValueState`` in a Python ``KeyedProcessFunction``) -> a slow stage costing
``workers * k / rate`` seconds per record (so all its subtasks together take ``rate / k``
records/s) -> a counting sink. ``k`` = 0.5 is unloaded; 10 is ten times too slow.

Checkpoints every ``--interval`` seconds with ``execution.checkpointing.unaligned.enabled``
on or off (``--unaligned``); the hashmap state backend and filesystem checkpoint storage in a
temp dir. Each completed checkpoint's duration (trigger to the last acknowledgement, Flink's
``end_to_end_duration``) and persisted in-flight data come from the job's REST API
(``/jobs/<id>/checkpoints``) of the local mini-cluster, polled while the job runs, so every
completed checkpoint is seen.

Run with the interpreter of benchmarks/.venv-pyflink (``run_peers.ensure_venv("pyflink")``).
Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from _procinfo import TreeCpuSampler  # only used in main(), never in UDFs
from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.datastream import RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.number_seq import NumberSequenceSource
from pyflink.datastream.functions import FlatMapFunction, KeyedProcessFunction, MapFunction
from pyflink.datastream.state import ValueStateDescriptor

KV = Types.TUPLE([Types.LONG(), Types.LONG()])
KEYS = 1000


class Paced(MapFunction):
    """Lets records through at ``rate`` per second (this subtask's share)."""

    def __init__(self, rate: float, out_dir: str) -> None:
        self.rate, self.out_dir = rate, out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.t0, self.n, self.first = 0.0, 0, 0.0

    def map(self, i: int) -> Tuple[int, int]:
        if self.n == 0:
            self.t0, self.first = time.perf_counter(), time.time()
        self.n += 1
        ahead = self.n / self.rate - (time.perf_counter() - self.t0)
        if ahead > 0.001:
            time.sleep(ahead)
        return i % KEYS, 1

    def close(self) -> None:
        if self.n:
            Path(self.out_dir, f"first-{uuid.uuid4().hex}").write_text(repr(self.first))


class RunningCount(KeyedProcessFunction):
    def open(self, runtime_context: RuntimeContext) -> None:
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))

    def process_element(self, value: Tuple[int, int], ctx: KeyedProcessFunction.Context) -> Iterator[Tuple[int, int]]:
        c = (self.count.value() or 0) + value[1]
        self.count.update(c)
        yield value[0], c


class Slow(MapFunction):
    """``cost`` seconds per record, slept in slices of at least a millisecond (as in
    benchmarks/epochs/backpressure.py)."""

    def __init__(self, cost: float) -> None:
        self.cost = cost

    def open(self, runtime_context: RuntimeContext) -> None:
        self.debt = 0.0

    def map(self, value: Tuple[int, int]) -> Tuple[int, int]:
        self.debt += self.cost
        if self.debt >= 0.001:
            began = time.perf_counter()
            time.sleep(self.debt)
            self.debt -= time.perf_counter() - began
        return value


class CountingSink(FlatMapFunction):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def open(self, runtime_context: RuntimeContext) -> None:
        self.n, self.last = 0, 0.0

    def flat_map(self, value: Tuple[int, int]) -> Iterator[None]:
        self.n += 1
        self.last = time.time()
        return iter(())

    def close(self) -> None:
        Path(self.out_dir, f"count-{uuid.uuid4().hex}").write_text(f"{self.n} {self.last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rest(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.load(r)


class CheckpointPoller(threading.Thread):
    """Collects the job's completed checkpoints from the REST API while it runs (the history
    keeps only the latest few, so it is read every 0.5 s)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.seen: Dict[int, Dict[str, Any]] = {}
        self.failed = 0
        self.stop = threading.Event()
        self.error = ""

    def run(self) -> None:
        job = None
        while not self.stop.is_set():
            try:
                if job is None:
                    jobs = rest(self.port, "/jobs").get("jobs", [])
                    job = jobs[0]["id"] if jobs else None
                if job is not None:
                    stats = rest(self.port, f"/jobs/{job}/checkpoints")
                    self.failed = stats.get("counts", {}).get("failed", 0)
                    for c in stats.get("history", []):
                        if c.get("status") == "COMPLETED":
                            self.seen[c["id"]] = c
            except Exception as exc:  # the REST server comes up with the job and goes with it
                self.error = f"{type(exc).__name__}: {exc}"
            self.stop.wait(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=2000.0, help="records/s of the source (all subtasks)")
    p.add_argument("--k", type=float, default=10.0, help="backpressure factor: slow stage capacity = rate / k")
    p.add_argument("--seconds", type=float, default=20.0, help="about how long the run lasts")
    p.add_argument("--interval", type=float, default=1.0, help="checkpoint interval, seconds")
    p.add_argument("--workers", type=int, default=2, help="parallelism")
    p.add_argument("--unaligned", action="store_true", help="execution.checkpointing.unaligned.enabled")
    p.add_argument("--bundle-size", type=int, default=0,
                   help="python.fn-execution.bundle.size (0: Flink's default)")
    args = p.parse_args()
    cpu = TreeCpuSampler()
    n = int(args.rate / max(args.k, 1.0) * args.seconds)
    os.environ["_python_worker_execution_mode"] = "process"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pyflink-bp-") as tmp:
        conf = Configuration()
        conf.set_string("execution.checkpointing.dir", Path(tmp, "checkpoints").as_uri())
        conf.set_string("state.backend.type", "hashmap")
        conf.set_string("python.executable", sys.executable)
        conf.set_string("python.execution-mode", "process")
        conf.set_string("restart-strategy.type", "none")
        conf.set_string("rest.port", str(port))
        conf.set_string("rest.bind-port", str(port))
        conf.set_string("execution.checkpointing.unaligned.enabled", "true" if args.unaligned else "false")
        conf.set_string("execution.checkpointing.timeout", "10 min")
        if args.bundle_size:
            conf.set_string("python.fn-execution.bundle.size", str(args.bundle_size))
        env = StreamExecutionEnvironment.get_execution_environment(conf)
        env.set_parallelism(args.workers)
        env.enable_checkpointing(int(args.interval * 1000))
        stats = Path(tmp, "stats")
        stats.mkdir()
        src = env.from_source(NumberSequenceSource(0, n - 1), WatermarkStrategy.no_watermarks(), "seq")
        recs = src.map(Paced(args.rate / args.workers, str(stats)), output_type=KV)
        counts = recs.key_by(lambda r: r[0], key_type=Types.LONG()).process(RunningCount(), output_type=KV)
        slow = counts.map(Slow(args.workers * args.k / args.rate), output_type=KV)
        slow.flat_map(CountingSink(str(stats)), output_type=Types.LONG()).print()
        poller = CheckpointPoller(port)
        poller.start()
        t0 = time.time()
        env.execute("backpressure")
        wall = time.time() - t0
        poller.stop.set()
        poller.join()
        sinks = [f.read_text().split() for f in stats.glob("count-*")]
        firsts = [float(f.read_text()) for f in stats.glob("first-*")]
        outputs = sum(int(c) for c, _ in sinks)
        # first record paced in -> last record out, measured in the UDFs (no JVM or worker start-up)
        seconds = max(float(t) for _, t in sinks) - min(firsts) if firsts and sinks else wall
    ckpts = sorted(poller.seen.values(), key=lambda c: c["id"])
    # only checkpoints of the processing (a checkpoint triggered before the first record waits
    # for the Python workers to start, which is not backpressure)
    ckpts = [c for c in ckpts if not firsts or c.get("trigger_timestamp", 0) / 1000.0 >= min(firsts)]
    durations: List[float] = [c["end_to_end_duration"] / 1000.0 for c in ckpts]
    in_flight = [int(c.get("persisted_data", 0)) for c in ckpts]
    print(json.dumps({
        "system": "pyflink", "version": version("apache-flink"), "unaligned": args.unaligned, "k": args.k,
        "rate": args.rate, "records": n, "outputs": outputs, "workers": args.workers,
        "interval_s": args.interval, "trigger_times": [c.get("trigger_timestamp") for c in ckpts],
        "bundle_size": args.bundle_size or None, "wall_s": round(wall, 2),
        "seconds": round(seconds, 2), "records_per_s": round(n / seconds, 1), "checkpoints_completed": len(ckpts),
        "checkpoints_failed": poller.failed, "checkpoint_s": durations, "persisted_bytes": in_flight,
        "state_bytes": [int(c.get("state_size", c.get("checkpointed_size", 0))) for c in ckpts],
        "rest_error": poller.error if not ckpts else "", "cpu_seconds": round(cpu.stop(), 2),
    }), flush=True)
    return 0 if outputs == n else 1


if __name__ == "__main__":
    sys.exit(main())
