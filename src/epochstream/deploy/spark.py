"""The spark driver: every worker is one task of a Spark barrier stage.

One attempt is one Spark job: ``parallelize(range(p), p).barrier().mapPartitions(task)``.
Task *w* is worker *w* (it hosts subtask *w* of every chain, as in the local driver):

1. it connects to the driver's service port and says hello (its index, its pid and the pid
   of the executor JVM it runs in, for chaos);
2. it opens a server socket and swaps ``host:port`` with every other task through
   ``BarrierTaskContext.allGather``; then every pair of tasks opens one TCP connection
   (``deploy.net.mesh``), which carries all channels between them (FIFO per channel,
   credit-based flow control: ``deploy.worker``);
3. it runs ``deploy.worker.WorkerLoop`` until the driver says stop, and returns.

The driver runs the coordinator (job master) and, in trAcker mode, the tracking agent as
services in the driver process (``deploy.cluster.ClusterDriver``, the local driver's loop),
like xgboost.spark's tracker. Every connection is authenticated with a random key of the
attempt (``deploy.net``).

Failures: a dead task (its Python worker or its executor JVM killed) fails the barrier
stage, and Spark does not retry a failed barrier *result* stage: the job aborts. The driver
sees that (a control connection at EOF, or the job's error), cancels the job group, closes
every connection (tasks still running, such as the Python worker of a killed executor, leave
their loop at EOF) and its restart strategy (``deploy.restart``) submits a new job whose
tasks restore from the latest completed epoch. The sans-IO core is the same as everywhere.

Requirements: ``parallelism`` barrier slots at once (``local[N]``/``local[N,F]`` with N >= p;
``local-cluster[W,C,M]`` with W*C >= p; a cluster with that many cores free; Delta commits go
through delta-rs in the driver process and need no slot), no dynamic allocation, the driver
reachable from executors, and the checkpoint dir and sink paths on storage every executor sees
(the same machine, or a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from typing import Any, Callable

import cloudpickle

from ..backends.spark_session import delta_conf, uses_delta
from ..chaos.kills import KillTarget
from ..runtime.errors import ConfigurationError
from .cluster import ClusterDriver, WorkerGroup
from .failures import Failover
from .lease import Lease
from .net import MeshRoute, Server, connect, mesh
from .protocol import Hello, WorkerError
from .slots import SlotWait, spark_slot_message
from .worker import run_worker

log = logging.getLogger("epochstream")

#: Spark settings a barrier job needs (applied when the driver builds the session itself)
SESSION_DEFAULTS = {
    # a stage short of slots fails its check with Spark's [SPARK-24819] message within ~2 s; the
    # driver then waits for the slots itself, visibly, up to Pipeline.slot_wait_timeout (deploy.slots)
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
    "spark.dynamicAllocation.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.python.worker.reuse": "true",
    # Python workers are forked from a daemon that has imported epochstream (deploy.spark_daemon):
    # the replacement of a killed task's worker starts warm
    "spark.python.daemon.module": "epochstream.deploy.spark_daemon",
}


def spark_session(master: str | None = None, conf: dict[str, str] | None = None, app_name: str = "epochstream"):
    """A SparkSession for the spark driver (``getOrCreate``: an active one is reused)."""
    from pyspark.sql import SparkSession

    master = master or "local[*]"
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = dict(SESSION_DEFAULTS)
    settings["spark.pyspark.python"] = sys.executable
    if master.startswith("local"):
        settings.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def barrier_slots(master: str) -> int | None:
    """Task slots a local master offers (None for a cluster: Spark checks when it schedules).

    >>> barrier_slots("local[3,4]"), barrier_slots("local-cluster[2,2,1024]"), barrier_slots("local")
    (3, 4, 1)
    """
    if master == "local":
        return 1
    m = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", master)
    if m:
        return os.cpu_count() or 1 if m.group(1) == "*" else int(m.group(1))
    m = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*(\d+)\]", master)
    if m:
        return int(m.group(1)) * int(m.group(2))
    return None


# ---------------------------------------------------------------- the task (runs in a Python worker)


def _executor_jvm_pid() -> int | None:
    """The JVM this Python worker belongs to: the nearest ancestor running java."""
    pid = os.getppid()
    for _ in range(5):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
            if argv0.endswith(b"java"):
                return pid
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def task_main(blob: bytes, driver: tuple[str, int], authkey: bytes) -> list[int]:
    """Worker ``partitionId`` of one attempt: hello, mesh, worker loop."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    w = ctx.partitionId()
    control = connect(driver, authkey)
    peers: dict[int, Any] = {}
    try:
        control.send(Hello(w, os.getpid(), _executor_jvm_pid()))
        pipeline, plan, storage, restored, attempt, route = cloudpickle.loads(blob)
        host = ctx.getTaskInfos()[w].address.rsplit(":", 1)[0]
        server = Server(host, authkey)
        try:
            gathered = ctx.allGather(json.dumps([host, server.address[1]]))
            peers = mesh(w, [tuple(json.loads(a)) for a in gathered], server, authkey, route=route)
        finally:
            server.close()
    except BaseException as exc:
        try:
            control.send(WorkerError(f"worker {w}: could not start: {type(exc).__name__}: {exc}"))
        finally:
            control.close()
        raise
    try:
        ok = run_worker(w, pipeline, plan, storage, restored, attempt, control, peers)
    finally:
        for c in [control, *peers.values()]:
            c.close()
    if not ok:
        raise RuntimeError(f"epochstream worker {w} failed; its error went to the driver")
    return [w]


def _barrier_task(blob: bytes, paths: list[str], driver: tuple[str, int], authkey: bytes):
    """The function Spark ships (by value): put the driver's import paths first, so the
    task imports the same epochstream and job modules, then run ``task_main``."""

    def task(_partition):
        import sys as _sys

        for p in reversed(paths):
            if p not in _sys.path:
                _sys.path.insert(0, p)
        from epochstream.deploy.spark import task_main as _main

        return _main(blob, driver, authkey)

    return task


def _warm_task(paths: list[str]):
    def warm(_partition):
        import sys as _sys

        for p in reversed(paths):
            if p not in _sys.path:
                _sys.path.insert(0, p)
        import pyarrow.parquet  # noqa: F401

        import epochstream.deploy.spark  # noqa: F401  (and with it pyarrow, cloudpickle, the core)

        return []

    return warm


#: SparkContexts (application ids) whose Python workers have imported epochstream
_WARM: set[str] = set()


def warm_spare_slots(sc, spares: int) -> threading.Thread:
    """Start (and import epochstream in) the Python worker of every slot the running barrier
    stage does not hold: a plain job of ``spares`` tasks, which Spark can only place on the free
    slots (a new executor that joined while the job runs), in the background."""
    paths = [os.path.abspath(x) for x in sys.path if x]

    def run() -> None:
        try:
            sc.setJobGroup("epochstream-warm-spares", "epochstream: start Python workers on spare slots")
            sc.parallelize(range(spares), spares).mapPartitions(_warm_task(paths)).collect()
        except Exception as exc:  # a spare lost meanwhile: it is only a warm-up
            log.info("spark: warming spare slots failed: %s", _spark_reason(exc))

    t = threading.Thread(target=run, name="epochstream-warm-spares", daemon=True)
    t.start()
    return t


def warm_up(sc, slots: int) -> None:
    """Start a Python worker per slot and import epochstream in it, once per SparkContext, so
    the first attempt's start (and a benchmark's first run) does not pay for cold workers."""
    key = sc.applicationId
    if key in _WARM:
        return
    paths = [os.path.abspath(x) for x in sys.path if x]
    sc.setJobGroup("epochstream-warm-up", "epochstream: start Python workers")
    sc.parallelize(range(slots), slots).barrier().mapPartitions(_warm_task(paths)).collect()
    _WARM.add(key)


# ---------------------------------------------------------------- the driver side


class _SparkJob(threading.Thread):
    """One barrier job, submitted from its own thread (``collect`` blocks until it ends)."""

    def __init__(self, sc, parallelism: int, fn, group: str) -> None:
        super().__init__(name=f"epochstream-{group}", daemon=True)
        self.sc, self.parallelism, self.fn, self.group = sc, parallelism, fn, group
        self.error: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, "epochstream barrier stage", interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.parallelism), self.parallelism).barrier().mapPartitions(self.fn)
            rdd.collect()
        except BaseException as exc:  # the job aborted (a task or an executor died) or was cancelled
            self.error = _spark_reason(exc)
        finally:
            self.done.set()


def _spark_reason(exc: BaseException) -> str:
    """The first informative line of a (Py4J-wrapped) Spark job failure: Spark's own message,
    with its tag (``[SPARK-24819]: ...``, ``[TASK_WRITE_FAILED] ...``) when it has one."""
    text = str(exc)
    for pattern in (r"(Could not recover from a failed barrier ResultStage[^\n]*)", r"(Job aborted[^\n]*)",
                    r"(Executor[^\n]*exited[^\n]*)", r"(\[[A-Z][A-Z0-9_-]*\][^\n]*)"):
        m = re.search(pattern, text)
        if m:
            return m.group(1)[:500]
    return f"{type(exc).__name__}: {text.splitlines()[0][:500] if text else ''}"


class SparkGroup(WorkerGroup):
    def __init__(self, driver: "SparkDriver", job: _SparkJob, server: Server) -> None:
        self.driver = driver
        self.job = job
        self.server = server
        self.conns: list[Any] = []
        self.pids: dict[int, tuple[int, int | None]] = {}

    def check(self, stopped: dict[int, int], stop_sent: bool) -> None:
        if self.job.done.is_set() and self.job.error and len(stopped) < len(self.conns):
            raise Failover(f"spark job failed: {self.job.error}")
        self.driver.spares.check(time.monotonic())

    def pid(self, worker: int, target: KillTarget) -> int:
        py, jvm = self.pids[worker]
        if target is KillTarget.WORKER:
            return py
        if target in (KillTarget.EXECUTOR, KillTarget.MACHINE):
            if self.driver.local_mode or jvm is None:
                raise ConfigurationError(
                    f"cannot kill the {target.value} of worker {worker} on master {self.driver.spark_master!r}: "
                    f"in local mode the executor is the driver's own JVM; use local-cluster[W,C,M] or a standalone "
                    f"cluster to kill executors")
            if target is KillTarget.EXECUTOR:
                return jvm
            if self.driver.spark_master.startswith("local-cluster"):  # its Workers are threads of the driver's JVM
                raise ConfigurationError("kill target 'machine' needs a standalone cluster (spark://host:port); on "
                                         "local-cluster[W,C,M] the Workers live in the driver's own JVM")
            daemon = _parent_pid(jvm)  # the standalone Worker that started the executor
            if daemon is None:
                raise ConfigurationError(f"cannot find the process that started executor {jvm} of worker {worker}")
            return daemon
        raise ConfigurationError(f"unknown kill target {target.value!r} (worker, executor, machine)")

    def abort(self) -> None:
        t0 = time.monotonic()
        for c in self.conns:
            c.close()
        self.driver.sc.cancelJobGroup(self.job.group)
        self.job.join(timeout=120)
        if self.job.is_alive():
            log.warning("spark job %s still running 120 s after it was cancelled", self.job.group)
        self.server.close()
        log.info("spark job %s cancelled in %.2fs (%s)", self.job.group, time.monotonic() - t0, self.job.error)

    def finish(self) -> None:
        self.job.join(timeout=120)
        if self.job.error:
            log.warning("spark job %s ended with an error after the job finished: %s", self.job.group,
                        self.job.error)
        for c in self.conns:
            c.close()
        self.server.close()


class _SpareSlots:
    """The slots whose Python workers have imported epochstream: every slot there is at start,
    not only the barrier stage's, so a spare executor's Python worker is warm when a lost
    task's replacement lands on it (recovery after a Worker loss); and, while an attempt runs,
    the slots the cluster has gained since (a Worker came back, a spare was added)."""

    def __init__(self, sc, parallelism: int, slots: Callable[[], int | None], every: float) -> None:
        self.sc = sc
        self.parallelism = parallelism
        #: the cluster's slots now (``SparkDriver.slots``)
        self.slots = slots
        #: seconds between two checks for gained slots
        self.every = every
        #: slots whose Python workers were warmed
        self.warmed = max(1, slots() or parallelism)
        self._next_check = 0.0
        self._warmer: threading.Thread | None = None
        try:
            warm_up(sc, self.warmed)
        except Exception as exc:  # an executor lost meanwhile: the attempt's launch reports and waits
            log.warning("spark: could not warm up Python workers: %s", _spark_reason(exc))

    def check(self, now: float) -> None:
        """Warm the slots gained beyond the barrier stage's since the last check (at most every
        ``every`` seconds, one warm-up job at a time), so the next lost task is placed on a ready one."""
        if now < self._next_check or (self._warmer is not None and self._warmer.is_alive()):
            return
        self._next_check = now + self.every
        slots = self.slots()
        if slots is None:
            return
        spares = slots - self.parallelism
        if slots > self.warmed and spares > 0:
            log.info("spark: %d slots (was %d): warming %d spare slot(s)", slots, self.warmed, spares)
            self._warmer = warm_spare_slots(self.sc, spares)
        self.warmed = slots


class SparkDriver(ClusterDriver):
    deployment = "spark"
    KILL_AFTER_READY = True
    #: seconds between reads of the cluster's slot count while an attempt starts
    SLOT_POLL = 0.5
    #: seconds a new session's executors get to register before the first attempt is submitted
    STARTUP_SLOTS_WAIT = 30.0
    #: seconds between checks for new spare slots to warm while an attempt runs
    SPARE_CHECK = 2.0

    def __init__(self, pipeline, storage, seed: int = 0, failures=None, parallelism: int | None = None,
                 spark=None, master: str | None = None, spark_conf: dict[str, str] | None = None,
                 connect_timeout: float = 300.0, savepoint_dir: str | None = None, stop_with_savepoint: bool = False,
                 rest: bool = True, rest_port: int = 0, on_start=None, mesh_route: MeshRoute | None = None, *,
                 job_id: str | None = None, lease: Lease | None = None, allow_sources_from_start: bool = False,
                 **options: Any) -> None:
        if options:
            raise TypeError(f"unknown option(s) for the spark driver: {sorted(options)}")
        super().__init__(pipeline, storage, seed, failures, parallelism, savepoint_dir=savepoint_dir,
                         stop_with_savepoint=stop_with_savepoint, rest=rest, rest_port=rest_port, on_start=on_start,
                         job_id=job_id, lease=lease, allow_sources_from_start=allow_sources_from_start)
        if spark is None and uses_delta(pipeline):  # Delta's settings, so this session reads the job's tables
            spark_conf = {**delta_conf(), **(spark_conf or {})}
        self.spark = spark if spark is not None else spark_session(master, spark_conf)
        self.sc = self.spark.sparkContext
        #: the Spark master URL (not ``Driver.master``, the attempt's job master)
        self.spark_master: str = self.sc.master
        if master is not None and spark is None and master != self.spark_master:
            log.warning("a SparkSession on %s is already active; master %s is ignored", self.spark_master, master)
        self.local_mode = self.spark_master == "local" or self.spark_master.startswith("local[")
        self.connect_timeout = connect_timeout
        #: where task i dials task j of the mesh (``net.mesh``; None: directly): a test's fault proxy
        self.mesh_route = mesh_route
        p = self.plan.parallelism
        slots = barrier_slots(self.spark_master)
        if slots is not None and slots < p:
            raise ConfigurationError(
                f"parallelism {p} needs {p} barrier task slots at once, master {self.spark_master!r} offers {slots}; "
                f"use local[{p}] (or more), local-cluster[W,C,M] with W*C >= {p}, or a lower parallelism")
        if self.sc.getConf().get("spark.dynamicAllocation.enabled", "false").lower() == "true":
            raise ConfigurationError("barrier stages do not work with dynamic allocation: set "
                                     "spark.dynamicAllocation.enabled=false")
        self.host = self.sc.getConf().get("spark.driver.host", "127.0.0.1")
        #: the running attempt's wait for barrier slots (deploy.slots; every shortage of the run: the record's)
        self._slot_wait: SlotWait | None = None
        self._await_executors(p)
        #: the Python workers of the cluster's slots, warmed at start and when slots are gained
        self.spares = _SpareSlots(self.sc, p, self.slots, self.SPARE_CHECK)

    def _await_executors(self, p: int) -> None:
        """A new session's executors register over a few seconds: wait (at most
        ``STARTUP_SLOTS_WAIT`` seconds) while none has or their number still grows, so the first
        attempt is not reported short of slots that are coming; a cluster that stays short is
        the launch's to report (``slot_wait_timeout``)."""
        now = time.monotonic()
        deadline, last, changed_at = now + self.STARTUP_SLOTS_WAIT, -1, now
        while now < deadline:
            slots = self.slots()
            if slots is None or slots >= p:
                return
            if slots != last:
                last, changed_at = slots, now
            elif slots > 0 and now - changed_at >= 2.0:
                return
            time.sleep(0.2)
            now = time.monotonic()

    # -- task slots (deploy.slots)
    def slots(self) -> int | None:
        """Barrier task slots the cluster has now: the number Spark's own check compares with the
        stage's task count (``SparkContext.maxNumConcurrentTasks`` of the default resource
        profile); None if it cannot be read."""
        try:
            jsc = self.sc._jsc.sc()
            return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
        except Exception:  # a py4j or Spark change: Spark's check still reports, only later
            return None

    def _status_extra(self) -> dict[str, Any]:
        wait = self._slot_wait
        return {"slots": wait.status(time.monotonic()) if wait is not None and wait.waiting else None}

    def _slot_note(self, wait: SlotWait, line: str | None) -> None:
        """Log a change of the shortage and publish it (state WAITING_FOR_SLOTS while it lasts)."""
        if line is not None:
            log.warning("job %s: %s", self.pipeline.name, line)
        if wait.waiting:
            self._publish("WAITING_FOR_SLOTS", force=line is not None)

    def _poll_slots(self, wait: SlotWait, now: float) -> int | None:
        """Read the slot count, note a shortage (or its end), and give up when the wait is over."""
        available = self.slots()
        if available is not None and available >= wait.needed:
            self._slot_note(wait, wait.slots_back(now))
        else:
            self._slot_note(wait, wait.observe(available, now))
        if wait.expired(now):
            raise wait.error(now)
        return available

    def launch(self, restored, attempt: str) -> SparkGroup:
        """Submit the attempt's barrier stage and wait for its tasks' Hellos. A stage short of
        slots is reported at once and waited for (``Pipeline.slot_wait_timeout``), then submitted
        again when Spark's check gave up; the connect timeout counts from when the slots exist."""
        wait = SlotWait(self.plan.parallelism, self.pipeline.slot_wait_timeout, self.spark_master)
        self._slot_wait = wait
        try:
            while True:
                group = self._submit(restored, attempt, wait)
                if group is not None:
                    return group
                while True:  # Spark gave up its check: wait for the slots here, then submit again
                    now = time.monotonic()
                    available = self._poll_slots(wait, now)
                    if available is None or not wait.waiting:
                        break
                    time.sleep(self.SLOT_POLL)
        finally:
            if wait.waiting:  # the run ends waiting: its record still shows the shortage
                wait.slots_back(time.monotonic())
            self.record.slot_waits.extend(wait.history)
            self._slot_wait = None

    def _submit(self, restored, attempt: str, wait: SlotWait) -> SparkGroup | None:
        """One barrier job; None if Spark refused it for want of slots."""
        p = self.plan.parallelism
        authkey = secrets.token_bytes(16)
        server = Server(self.host, authkey)
        blob = cloudpickle.dumps((self.pipeline, self.plan, self.storage, restored, attempt, self.mesh_route))
        paths = [os.path.abspath(x) for x in sys.path if x]
        job = _SparkJob(self.sc, p, _barrier_task(blob, paths, server.address, authkey),
                        f"epochstream-{attempt}-{secrets.token_hex(2)}")
        group = SparkGroup(self, job, server)
        job.start()
        conns: dict[int, Any] = {}
        try:
            started = time.monotonic()
            deadline = started + self.connect_timeout
            next_poll = started
            while len(conns) < p:
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + self.SLOT_POLL
                    self._poll_slots(wait, now)
                    if wait.waiting:
                        deadline = now + self.connect_timeout
                if job.done.is_set():
                    message = spark_slot_message(job.error or "")
                    if message is None:
                        raise Failover(f"spark job failed before its {p} tasks connected: {job.error}")
                    self._slot_note(wait, wait.spark_failed(message, now))
                    if wait.expired(now):
                        raise wait.error(now)
                    group.abort()
                    return None
                if now > deadline:
                    raise Failover(f"only {len(conns)} of {p} tasks connected within {self.connect_timeout}s "
                                   f"(are {p} task slots free on {self.spark_master}?)")
                conn = server.accept(0.2)
                if conn is None:
                    continue
                msg = conn.recv()
                if type(msg) is not Hello:
                    raise Failover(f"a task sent {type(msg).__name__} before Hello")
                conns[msg.worker] = conn
                group.pids[msg.worker] = (msg.pid, msg.executor_pid)
            group.conns = [conns[w] for w in range(p)]
            self._slot_note(wait, wait.slots_back(time.monotonic()))
            log.info("spark job %s: %d tasks connected after %.2fs", job.group, p, time.monotonic() - started)
        except BaseException:
            group.conns = list(conns.values())
            group.abort()
            raise
        return group
