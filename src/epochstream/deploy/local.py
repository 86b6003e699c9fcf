"""The local driver: one OS process per worker, real time, real pipes.

Python runs one thread of bytecode at a time per process, so the local driver uses
processes, one per worker (subtask index), forked from the driver so user lambdas need no
pickling. Workers are joined all-to-all by duplex pipes; each worker hosts subtask ``w`` of
every chain, so forward channels never leave a process.

Each worker runs ``deploy.worker.WorkerLoop`` (the loop the spark driver's tasks run too);
the driver process runs ``deploy.cluster.ClusterDriver``'s loop: the job master
(coordinator, manifests, sink commits), the tracking agent and the restart strategy. When a
worker dies or reports an error, every worker is killed and the job restarts from the latest
completed checkpoint after the strategy's delay.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from ..backends.rocksdb_checkpoint import used_here as rocksdb_used_here
from ..chaos.kills import KillTarget
from ..runtime.errors import ConfigurationError
from .cluster import ClusterDriver, WorkerGroup
from .failures import Failover
from .lease import Lease
from .worker import run_worker


def _worker_main(index, pipeline, plan, storage, restored, attempt, control, peers, close) -> None:
    for c in close:
        c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    ok = run_worker(index, pipeline, plan, storage, restored, attempt, control, peers)
    os._exit(0 if ok else 1)


class LocalGroup(WorkerGroup):
    def __init__(self, procs, conns) -> None:
        self.procs = procs
        self.conns = conns

    def check(self, stopped: dict[int, int], stop_sent: bool) -> None:
        for w, proc in enumerate(self.procs):
            if not proc.is_alive() and w not in stopped:
                if proc.exitcode == 0 and stop_sent:
                    continue  # stopped cleanly; its "stopped" message is still in the pipe
                if self.conns[w].poll():
                    continue  # read what it sent before dying first (its error report)
                raise Failover(f"worker {w} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def pid(self, worker: int, target: KillTarget) -> int:
        if target is not KillTarget.WORKER:
            raise ConfigurationError(f"the local driver can only kill worker processes, not {target.value!r}")
        return self.procs[worker].pid

    def abort(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.join(timeout=5)
        self._close()

    def finish(self) -> None:
        self._close()
        for proc in self.procs:
            proc.join(timeout=5)

    def _close(self) -> None:
        for c in self.conns:
            c.close()


class LocalDriver(ClusterDriver):
    deployment = "local"

    def __init__(self, pipeline, storage, seed: int = 0, failures=None, parallelism: int | None = None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False, rest: bool = True,
                 rest_port: int = 0, on_start=None, *, job_id: str | None = None, lease: Lease | None = None,
                 allow_sources_from_start: bool = False, **options: Any) -> None:
        if options:
            raise TypeError(f"unknown option(s) for the local driver: {sorted(options)}")
        super().__init__(pipeline, storage, seed, failures, parallelism, savepoint_dir=savepoint_dir,
                         stop_with_savepoint=stop_with_savepoint, rest=rest, rest_port=rest_port, on_start=on_start,
                         job_id=job_id, lease=lease, allow_sources_from_start=allow_sources_from_start)
        self._ctx = mp.get_context("fork")
        if pipeline.checkpoint.state_backend_type == "rocksdb" and rocksdb_used_here():
            raise ConfigurationError(
                "state_backend_type='rocksdb' on the local driver, in a process that has already opened a RocksDB "
                "DB (a simulator run, or a query of RocksDB state in this process): the local driver forks its "
                "workers, and RocksDB's background threads do not survive fork, so the workers' DBs would hang. "
                "Run the job from a fresh process (e.g. `epochstream run`), or use state_backend_type='hashmap' "
                "for the in-process run")

    def launch(self, restored, attempt: str) -> LocalGroup:
        p = self.plan.parallelism
        peer_ends: dict[int, dict[int, Connection]] = {w: {} for w in range(p)}
        try:
            for i in range(p):
                for j in range(i + 1, p):
                    a, b = self._ctx.Pipe(duplex=True)
                    peer_ends[i][j], peer_ends[j][i] = a, b
        except OSError as exc:
            for ends in peer_ends.values():
                for c in ends.values():
                    c.close()
            raise ConfigurationError(
                f"the local driver cannot connect {p} workers all-to-all ({p * (p - 1) // 2} pipes): {exc}; "
                f"use a lower parallelism or raise the open-file limit (ulimit -n)"
            ) from None
        controls = [self._ctx.Pipe(duplex=True) for _ in range(p)]
        procs = []
        for w in range(p):
            close = [controls[v][1] for v in range(p)] + [controls[v][0] for v in range(p) if v != w]
            close += [c for v in range(p) if v != w for c in peer_ends[v].values()]
            proc = self._ctx.Process(
                target=_worker_main,
                args=(w, self.pipeline, self.plan, self.storage, restored, attempt, controls[w][0],
                      peer_ends[w], close),
                name=f"epochstream-worker-{w}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        for w in range(p):
            controls[w][0].close()
            for c in peer_ends[w].values():
                c.close()
        return LocalGroup(procs, [c[1] for c in controls])
