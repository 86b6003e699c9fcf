"""A real Spark standalone cluster on this machine, from the pip-installed pyspark package's own
classes: one ``org.apache.spark.deploy.master.Master`` and Workers of one core each
(``org.apache.spark.deploy.worker.Worker``), started with ``bin/spark-class`` of pyspark.

Used by ``test_spark_standalone.py`` and ``benchmarks/failures/worker_loss.py``. ``kill_worker`` is a
lost machine: SIGKILL of the Worker JVM and, with it, of every executor JVM (and their Python
workers) it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class StandaloneCluster:
    """A Master and ``workers`` Workers of one core each; ``url`` is the master for a session."""

    def __init__(self, work: Path, workers: int = 2, worker_memory: str = "1g") -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.home = os.path.dirname(pyspark.__file__)
        self.port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.worker_memory = worker_memory
        self.env = dict(os.environ, SPARK_HOME=self.home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
                        SPARK_LOG_DIR=str(self.work / "logs"), SPARK_NO_DAEMONIZE="1")
        self.master = self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                             "--port", str(self.port), "--webui-port", str(_free_port())])
        self._wait_port(self.port)
        self.workers: list[subprocess.Popen] = []
        for _ in range(workers):
            self.add_worker()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")
        return subprocess.Popen([os.path.join(self.home, "bin", "spark-class"), *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_port(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the Spark master did not listen on {port} within {timeout}s (see {self.work})")

    def add_worker(self) -> subprocess.Popen:
        """Start one more Worker (one core); the session's application gets an executor on it."""
        i = len(self.workers)
        work_dir = self.work / f"worker-{i}"
        w = self._spawn(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores",
                                        "1", "--memory", self.worker_memory, "--webui-port", str(_free_port()),
                                        "--work-dir", str(work_dir), self.url])
        self.workers.append(w)
        return w

    def executor_pids(self, worker: int) -> list[int]:
        """The executor JVMs (and their Python workers) Worker ``worker`` started."""
        return _children(self.workers[worker].pid)

    def worker_of_executor(self, executor_pid: int) -> int:
        """Which Worker started the executor JVM ``executor_pid``."""
        for i, w in enumerate(self.workers):
            if w.poll() is None and executor_pid in _children(w.pid):
                return i
        raise LookupError(f"no live Worker started pid {executor_pid}")

    def kill_worker(self, worker: int) -> None:
        """A lost machine: SIGKILL the Worker JVM and everything it started, at once."""
        w = self.workers[worker]
        for pid in [w.pid, *_children(w.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        w.wait()

    def stop(self) -> None:
        for p in [*self.workers, self.master]:
            if p.poll() is None:
                for pid in [p.pid, *_children(p.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait()
