"""Keyed running count on Bytewax 0.21 -- peer baseline for benchmarks/epochs/throughput.py.

Workload (identical to pyflink_keyed_count.py, see README.md):
records i = 0..N-1 -> (f"k{i % K}", 1); map (value * 1); key by key;
stateful per-key running count emitting (key, count); sink counts outputs.

Run it with the interpreter of benchmarks/.venv-bytewax (run_peers.py does that).
Prints one JSON line on stdout; exits 1 if outputs != records.

Two ways to use W workers (--mode):
- ``processes`` (default): W OS processes of 1 worker each, wired over
  localhost TCP (what ``python -m bytewax.run -i/-a`` does). Each process has
  its own GIL, so this is what actually uses both cores.
- ``threads``: 1 process with W worker threads (``python -m bytewax.run -w W``);
  all Python code (source, map, state, sink) shares one GIL.
"""

from __future__ import annotations

import argparse
import json
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import bytewax.operators as op
from _procinfo import TreeCpuSampler, process_start_time
from bytewax._bytewax import cli_main
from bytewax.dataflow import Dataflow
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import DynamicSink, StatelessSinkPartition
from bytewax.recovery import RecoveryConfig, init_db_dir

BATCH = 1000  # records per source batch (next_batch call)
PARTS_PER_WORKER = 4  # several input partitions per worker so assignment balances

# Per-process measurements: outputs per sink partition, time the first record was
# generated and time of the last sink write ("seconds" = first record -> last output).
OUTPUTS: List[int] = []
FIRST: List[float] = []
LAST: List[float] = [0.0]


class _RangePart(StatefulSourcePartition[Tuple[str, int], int]):
    """Emits records i = start, start+step, ... < n; resume state = next i."""

    def __init__(self, start: int, step: int, n: int, keys: int) -> None:
        self.i, self.step, self.n, self.keys = start, step, n, keys

    def next_batch(self) -> List[Tuple[str, int]]:
        if self.i >= self.n:
            raise StopIteration()
        if not FIRST:
            FIRST.append(time.time())
        end = self.i + BATCH * self.step
        keys = self.keys
        batch = [(f"k{j % keys}", 1) for j in range(self.i, min(end, self.n), self.step)]
        self.i = end
        return batch

    def snapshot(self) -> int:
        return self.i


class RangeSource(FixedPartitionedSource[Tuple[str, int], int]):
    """Deterministic generator split into `parts` interleaved partitions."""

    def __init__(self, n: int, keys: int, parts: int) -> None:
        self.n, self.keys, self.parts = n, keys, parts

    def list_parts(self) -> List[str]:
        return [str(p) for p in range(self.parts)]

    def build_part(self, step_id: str, for_part: str, resume_state: Optional[int]) -> _RangePart:
        start = int(for_part) if resume_state is None else resume_state
        return _RangePart(start, self.parts, self.n, self.keys)


class _CountPart(StatelessSinkPartition[Tuple[str, int]]):
    def __init__(self, slot: int) -> None:
        self.slot = slot

    def write_batch(self, items: List[Tuple[str, int]]) -> None:
        OUTPUTS[self.slot] += len(items)
        LAST[0] = time.time()


class CountingSink(DynamicSink[Tuple[str, int]]):
    """Discards outputs, only counts them (per worker, summed at the end)."""

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _CountPart:
        OUTPUTS.append(0)
        return _CountPart(len(OUTPUTS) - 1)


def _count(state: Optional[int], rec: Tuple[str, int]) -> Tuple[int, int]:
    c = (state or 0) + rec[1]
    return c, c


def build_flow(n: int, keys: int, parts: int) -> Dataflow:
    """source -> map -> key_on -> stateful_map (running count) -> counting sink."""
    flow = Dataflow("keyed_count")
    s = op.input("inp", flow, RangeSource(n, keys, parts))
    s = op.map("map", s, lambda r: (r[0], r[1] * 1))
    ks = op.key_on("key", s, lambda r: r[0])
    counts = op.stateful_map("count", ks, _count)
    op.output("sink", counts, CountingSink())
    return flow


def run_here(args: argparse.Namespace, workers_here: int, proc_id: Optional[int],
             addresses: Optional[List[str]]) -> Dict[str, Any]:
    """Run this process's share of the dataflow; returns outputs and timestamps."""
    flow = build_flow(args.records, args.keys, args.workers * PARTS_PER_WORKER)
    recovery = RecoveryConfig(args.db_dir, timedelta(0)) if args.snapshot_interval > 0 else None
    # Same as `python -m bytewax.run`: with recovery, epoch == snapshot interval.
    epoch = timedelta(seconds=args.snapshot_interval) if recovery else timedelta(seconds=10)
    cli_main(flow, workers_per_process=workers_here, process_id=proc_id,
             addresses=addresses, epoch_interval=epoch, recovery_config=recovery)
    return {"outputs": sum(OUTPUTS), "t_first": min(FIRST, default=time.time()), "t_last": LAST[0]}


def last_snapshot_epoch(db_dir: Path) -> Optional[int]:
    """Highest epoch with a state snapshot in the SQLite recovery partitions (~ number of snapshots)."""
    epochs = []
    for f in db_dir.glob("*.sqlite3"):
        with closing(sqlite3.connect(f)) as db:
            epochs.append(db.execute("SELECT max(snap_epoch) FROM snaps").fetchone()[0])
    return max((e for e in epochs if e is not None), default=None)


def _free_ports(k: int) -> List[int]:
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=3_000_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--snapshot-interval", type=float, default=1.0, help="seconds; 0 = recovery off")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", choices=["processes", "threads"], default="processes")
    p.add_argument("--db-dir", type=Path, help=argparse.SUPPRESS)  # internal (children)
    p.add_argument("--proc-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.snapshot_interval > 0 and args.snapshot_interval != int(args.snapshot_interval):
        p.error("bytewax snapshot intervals are whole seconds here")

    if args.proc_id is not None:  # child of --mode processes
        res = run_here(args, 1, args.proc_id, args.addresses.split(";"))
        print(json.dumps(res), flush=True)
        return 0

    started = process_start_time()
    cpu = TreeCpuSampler()
    with tempfile.TemporaryDirectory(prefix="bytewax-recovery-") as tmp:
        args.db_dir = Path(tmp)
        if args.snapshot_interval > 0:
            init_db_dir(args.db_dir, args.workers)  # SQLite recovery partitions
        if args.mode == "threads" or args.workers == 1:
            parts = [run_here(args, args.workers, None, None)]
        else:
            addrs = ";".join(f"127.0.0.1:{port}" for port in _free_ports(args.workers))
            base = [sys.executable, __file__, "--records", str(args.records), "--keys", str(args.keys),
                    "--snapshot-interval", str(args.snapshot_interval), "--workers", str(args.workers),
                    "--db-dir", tmp, "--addresses", addrs]
            children = [subprocess.Popen(base + ["--proc-id", str(i)], stdout=subprocess.PIPE, text=True)
                        for i in range(args.workers)]
            outs = [c.communicate()[0] for c in children]
            if any(c.returncode for c in children):
                print(f"bytewax worker process failed: {[c.returncode for c in children]}", file=sys.stderr)
                return 1
            parts = [json.loads(o.strip().splitlines()[-1]) for o in outs]
        end = time.time()
        snap_epoch = last_snapshot_epoch(args.db_dir) if args.snapshot_interval > 0 else None
    seconds = max(r["t_last"] for r in parts) - min(r["t_first"] for r in parts)
    outputs = sum(r["outputs"] for r in parts)
    print(json.dumps({
        "system": "bytewax", "version": version("bytewax"), "records": args.records, "keys": args.keys,
        "seconds": round(seconds, 3), "seconds_incl_startup": round(end - started, 3),
        "records_per_s": round(args.records / seconds, 1), "workers": args.workers, "mode": args.mode,
        "snapshot_interval": args.snapshot_interval, "last_snapshot_epoch": snap_epoch, "outputs": outputs,
        "cpu_seconds": round(cpu.stop(), 2),
    }), flush=True)
    if outputs != args.records:
        print(f"outputs {outputs} != records {args.records}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
