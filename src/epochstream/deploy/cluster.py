"""The driver side of every multi-process deployment (local and spark): one loop that runs
the job master and the tracking agent as services for the workers.

A subclass only says how workers come to life and how they die: ``launch`` starts one
attempt's workers and returns a ``WorkerGroup`` holding one control connection per worker
(a pipe for the local driver, a TCP connection for spark). The attempt's policy (triggers,
acks and declines, the final epoch, the trAcker agent's NEOSS, the stop handshake) is the
``attempt.AttemptController``'s, the same the simulator drives; this loop does its I/O:
it reads the workers' ``deploy.protocol`` messages, hands each to its handler by type and
sends the controller's actions to every worker. It also detects failovers, carries out
the chaos kills and serves the job's HTTP API (``deploy.rest``: savepoints, stop, status)
from a thread of the driver process, whose requests the loop hands to the controller
between its own steps (``deploy.control.JobControl``).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import time
from multiprocessing.connection import wait
from typing import Any, Iterator

from ..runtime.meters import RunMeters
from ..snapshot.manifest import CheckpointError
from ..tracker.traffic import ServiceTraffic
from ..ui.app import Dashboard
from ..ui.graph import job_graph
from ..ui.model import dashboard, task_metrics
from ..ui.offline import checkpoint_rows
from . import jobs as _jobs
from .attempt import AttemptController, CaptureFull
from .control import JobControl, SavepointRequest
from .driver import Driver
from .failures import Failover
from .liveness import HeartbeatMonitor
from .protocol import (
    Ack,
    Decline,
    Die,
    Exhausted,
    Fatal,
    Heartbeat,
    LinkLost,
    Ready,
    Stopped,
    TrackerReport,
    WorkerError,
)
from .rest import RestServer
from .tracking import tracking_segments

log = logging.getLogger("epochstream")


class WorkerGroup:
    """One attempt's workers, as the driver loop sees them."""

    #: control connection of worker w at index w
    conns: list[Any]

    def check(self, stopped: dict[int, int], stop_sent: bool) -> None:
        """Raise ``Failover`` if a worker is gone in a way its connection does not show."""

    def pid(self, worker: int, target: str) -> int:
        """The pid a chaos kill of ``worker`` hits: ``worker`` (its process) or ``executor``."""
        raise NotImplementedError

    def abort(self) -> None:
        """Failover: make every worker of the attempt go away."""

    def finish(self) -> None:
        """Success: wait for the workers to exit."""


class ClusterDriver(Driver):
    """Runs attempts over a ``WorkerGroup``; see the module docstring."""

    deployment = "cluster"
    #: seconds a chaos kill waits for its protocol moment before it is carried out anyway
    MOMENT_TIMEOUT = 3.0
    #: chaos kills wait until every worker of the attempt is up (spark: so each kill has a
    #: measured recovery); the local driver may also kill while workers restore
    KILL_AFTER_READY = False

    def __init__(self, pipeline, storage, seed: int = 0, failures=None, parallelism: int | None = None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False, rest: bool = True,
                 rest_port: int = 0, on_start=None) -> None:
        super().__init__(pipeline, storage, failures, parallelism, savepoint_dir, stop_with_savepoint)
        #: serve the job's HTTP API (``deploy.rest``) on 127.0.0.1 and register it for the CLI
        self.rest = rest
        self.rest_port = rest_port
        #: called with the job file's content once the HTTP API is up (the CLI prints it)
        self.on_start = on_start
        self.control = JobControl()
        self.endpoint: str | None = None
        self._published = 0.0
        self.rng = random.Random(seed)
        self.recovery_seconds: list[float] = []
        #: (epoch, task, seconds from the epoch trigger to the task reaching its bound); the
        #: task's clock is the driver's only where both share a host's monotonic clock
        self.bound_latency: list[tuple[int, Any, float]] = []
        self.t0 = time.monotonic()
        self.deadline: float | None = None
        #: chaos: a kill armed for the driver's next commit (victim, target)
        self._commit_kill: tuple[int, str] | None = None
        self._group: WorkerGroup | None = None
        #: the running attempt's controller
        self._controller: AttemptController | None = None
        #: every chaos kill: time, worker, target, moment
        self.kill_log: list[dict[str, Any]] = []
        #: a kill waiting for its moment: (armed at, victim, target, moment)
        self._armed: tuple[float, int, str, str] | None = None
        self._attempt_killed = False
        self._liveness = HeartbeatMonitor(self.pipeline.heartbeat)
        #: every task's counters from its worker's heartbeats (``runtime.meters``)
        self.meters = RunMeters()
        #: why the run failed (the REST status's ``error`` once it ended FAILED)
        self.final_error: str | None = None

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        self.t0 = time.monotonic()
        self.deadline = None if duration is None else self.t0 + duration
        restored = self.prepare(restore, allow_non_restored_state)  # refuse bad input before serving anything
        server = None
        self._publish("CREATED", force=True)
        if self.rest:
            server = RestServer(self.job_id, self.control, self._checkpoints_doc, self.savepoint_dir,
                                self.rest_port, pages=self._dashboard().page).start()
            self.endpoint = server.endpoint
            _jobs.register({
                "id": self.job_id, "name": self.pipeline.name, "endpoint": server.endpoint, "pid": os.getpid(),
                "token": server.token,
                "deployment": self.deployment, "checkpoint_dir": str(self.storage.root),
                "savepoint_dir": self.savepoint_dir, "started_at": time.time(), "parallelism": self.plan.parallelism,
            })
            log.info("job %s (%s) serves its REST API at %s", self.pipeline.name, self.job_id, server.endpoint)
            if self.on_start is not None:
                self.on_start({"id": self.job_id, "name": self.pipeline.name, "endpoint": server.endpoint})
        state = "FAILED"
        try:
            self.run_prepared(restored, duration)
            state = "FINISHED"
        except BaseException as exc:
            self.final_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.control.fail_pending(f"the job is {state.lower()}")
            self._publish(state, force=True)
            if server is not None:
                _jobs.unregister(self.job_id)
                linger = time.monotonic() + 5.0  # let clients read the outcome of their last requests
                while self.control.untold() and time.monotonic() < linger:
                    time.sleep(0.02)
                server.close()

    # -- the HTTP API's side of the loop
    def _publish(self, state: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._published < 0.1:
            return
        self._published = now
        self.control.publish(
            jid=self.job_id, name=self.pipeline.name, state=state, mode=self.pipeline.mode,
            deployment=self.deployment, parallelism=self.plan.parallelism,
            **{"max-parallelism": self.plan.max_parallelism, "checkpoint-dir": str(self.storage.root),
               "savepoint-dir": self.savepoint_dir, "completed-epochs": len(self.completed),
               "latest-epoch": self.completed[-1] if self.completed else None, "records-in": self.records_in},
            restarts=self.restarts, savepoints=list(self.savepoints_written), epochs=self.epoch_log[-200:],
            **{"last-failover": self.failover_log[-1] if self.failover_log else None},
            # the failover reasons, the same text as in the logs and JobResult (operator, subtask, key, record,
            # source split and offset of a user-function failure)
            failures=[{"time": f["time"], "reason": f["reason"].splitlines()[0]} for f in self.failover_log[-10:]],
            duration=self.clock(), error=self.final_error, **self._progress(), **self._status_extra(),
        )

    def collect(self, master) -> None:
        """As ``Driver.collect``; a completed epoch is stamped with the driver's clock (``time``,
        seconds since the run began, as kill and failover times), at most one loop step late."""
        fresh = len(master.epoch_log)
        super().collect(master)
        if fresh:
            now = self.clock()
            for entry in self.epoch_log[-fresh:]:
                entry.setdefault("time", now)

    def _status_extra(self) -> dict[str, Any]:
        """Status fields of one kind of driver (spark: the slots a starting attempt waits for)."""
        return {}

    def on_failover(self) -> None:
        # RESTARTING with the failure just counted, until the next attempt runs (or the run ends)
        self._publish("RESTARTING", force=True)

    def _progress(self) -> dict[str, Any]:
        """What the dashboard, ``/metrics`` and the status line read beyond the summary (``ui``)."""
        traffic = ServiceTraffic()
        traffic.merge(self.traffic)
        if self._controller is not None:
            traffic.merge(self._controller.traffic)  # the running attempt's, merged into the run's at its end
        return {
            "records-committed": sum(e.get("records") or 0 for e in self.epoch_log),
            "aborted-epochs": sum(1 for e in self.epoch_log if e.get("state") == "aborted"),
            "failovers": self.failover_log[-50:], "recovery-seconds": self.recovery_seconds[-50:],
            "kills": self.kill_log[-50:], "traffic": traffic.as_dict()["by_kind"],
            "task-metrics": task_metrics(self.meters.as_dict()),
        }

    def _dashboard(self) -> Dashboard:
        """The dashboard and ``/metrics`` of this job (``ui``), from the published status."""
        graph = job_graph(self.plan, self.pipeline.mode, tracking_segments(self.plan, self.pipeline))
        rows: dict[str, Any] = {"key": None, "rows": []}

        def build() -> dict[str, Any]:
            status = self.control.status()
            key = (status.get("completed-epochs"), status.get("state"))
            if key != rows["key"]:  # storage is read again only when an epoch completed
                rows["key"], rows["rows"] = key, checkpoint_rows(self.storage)
            return dashboard(status, graph, rows["rows"])

        return Dashboard(build, cache_seconds=0.0)

    def _checkpoints_doc(self) -> dict[str, Any]:
        """GET /jobs/<id>/checkpoints: what storage holds (read on the REST thread, read-only)."""
        rows = []
        for epoch in self.storage.list_checkpoints():
            try:
                m, _root = self.storage.load_manifest(epoch)
            except CheckpointError as exc:
                rows.append({"epoch": epoch, "status": "damaged", "error": str(exc)})
                continue
            rows.append({"epoch": epoch, "status": "completed", "kind": m.get("kind"),
                         "path": str(self.storage.checkpoint_dir(epoch)), "created_at": m.get("created_at"),
                         "parallelism": m["parallelism"], "metrics": m.get("metrics", {})})
        done = [r for r in rows if r["status"] == "completed"]
        return {"counts": {"completed": len(done)}, "latest": done[-1] if done else None, "checkpoints": rows}

    def _commands(self) -> Iterator[SavepointRequest]:
        """REST requests, drained when the controller reads them; a stop is remembered across
        attempts (asked again after a failover until it completes)."""
        for req in self.control.drain():
            if req.stop:
                self.stop_request = req
                self.stop_asked = True
            yield req

    def launch(self, restored, attempt: str) -> WorkerGroup:
        raise NotImplementedError

    # -- chaos
    def fail_point(self, name: str) -> None:
        if name == "mid_commit" and self._commit_kill is not None and self._group is not None:
            victim, target = self._commit_kill
            self._commit_kill = None
            self._kill(self._group, victim, target, None)
            time.sleep(0.05)  # let the death land while the commit is still in progress
        super().fail_point(name)

    def _chaos(self, group: WorkerGroup, c: AttemptController, now: float) -> None:
        """Inject the next scheduled kill: at most one per attempt, so every kill causes its
        own failover. A kill waiting for a protocol moment that has not come within
        ``MOMENT_TIMEOUT`` seconds is carried out at once (logged as ``<moment>/timeout``), and
        so is one still waiting when the attempt asks for its final epoch (``<moment>/final``):
        its moment may not come again (a final epoch need not hold any channel), and a kill
        counted as injected must happen. A ``commit`` or ``sink_commit`` kill waits: the final
        epoch commits too."""
        armed = self._armed
        if armed is not None:
            final = c.final_requested and not c.master.finished and armed[3] not in ("commit", "sink_commit")
            if final or now - armed[0] >= self.MOMENT_TIMEOUT:
                self._commit_kill = None
                self.kill_log[-1]["moment"] += "/final" if final else "/timeout"
                self._kill(group, armed[1], armed[2], None)
            return
        times = self.failures.kill_times
        if self._attempt_killed or self.kills_done >= len(times) or now - self.t0 < times[self.kills_done]:
            return
        i = self.kills_done
        self.kills_done += 1
        self.injected += 1
        self._attempt_killed = True
        moments, targets = self.failures.kill_moments, self.failures.kill_targets
        moment = moments[i] if i < len(moments) else "now"
        target = targets[i] if i < len(targets) else "worker"
        victim = self.rng.randrange(len(group.conns))
        if moment == "now" or target in ("freeze", "machine"):  # kills the driver does itself, now
            moment = "now"
            self._kill(group, victim, target, moment)
            return
        self._armed = (now, victim, target, moment)
        self.kill_log.append({"time": self.clock(), "worker": victim, "target": target, "moment": moment})
        if moment == "commit":
            self._commit_kill = (victim, target)
        else:  # the worker kills at the moment itself
            self._send(group.conns, victim, Die(moment, group.pid(victim, target)))

    def _kill(self, group: WorkerGroup, victim: int, target: str, moment: str | None) -> None:
        """SIGKILL now; ``moment`` None: the kill was logged when it was armed."""
        self._armed = None
        if moment is not None:
            self.kill_log.append({"time": self.clock(), "worker": victim, "target": target, "moment": moment})
        try:
            if target == "freeze":  # alive but silent: a hung or cut-off host (liveness.py)
                os.kill(group.pid(victim, "worker"), signal.SIGSTOP)
            elif target == "machine":  # a lost machine: its cluster daemon and the executor at once
                daemon, executor = group.pid(victim, "machine"), group.pid(victim, "executor")
                os.kill(daemon, signal.SIGKILL)
                os.kill(executor, signal.SIGKILL)
            else:
                os.kill(group.pid(victim, target), signal.SIGKILL)
        except ProcessLookupError:
            pass

    # -- one attempt
    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        group = self.launch(restored, attempt)
        self._group = group
        self._attempt_killed = False
        self._armed = None
        self._commit_kill = None
        traffic = ServiceTraffic()
        c = self._controller = self.new_attempt(restored, attempt, time.monotonic(), self.deployment, traffic,
                                                workers=len(group.conns), stop_at=self.deadline)
        self._liveness = HeartbeatMonitor(self.pipeline.heartbeat)
        self.meters.new_attempt()  # the last attempt's counts stay in the run's totals
        launched = time.monotonic()
        for w in range(len(group.conns)):
            self._liveness.launched(w, launched)
        #: worker -> driver messages by type (each handler returns the controller's actions)
        on = {Ready: functools.partial(self._on_ready, c), Ack: functools.partial(self._on_ack, c),
              Decline: c.on_decline, Exhausted: c.on_exhausted, TrackerReport: c.on_tracker_report,
              Stopped: functools.partial(self._on_stopped, c), Heartbeat: self._on_heartbeat,
              WorkerError: self._on_worker_error, Fatal: self._on_fatal,
              LinkLost: functools.partial(self._on_link_lost, c, group)}
        try:
            while True:
                now = time.monotonic()
                if c.all_ready or not self.KILL_AFTER_READY:
                    self._chaos(group, c, now)
                if c.done:
                    break
                self._step(group, c, on, now)
        except BaseException:
            self._controller = None  # its traffic is the run's from here on (the status must not count it twice)
            self.traffic.merge(traffic)  # a failed attempt's service messages were sent all the same
            c.fail(time.monotonic())
            self.collect(c.master)
            self._group = None
            group.abort()
            raise
        finally:
            self.bound_latency.extend(c.bound_latency)
        self._group = None
        self.collect(c.master)
        self._controller = None
        self.traffic.merge(traffic)
        self.records_in += c.records_in
        group.finish()

    def _step(self, group: WorkerGroup, c: AttemptController, on: dict, now: float) -> None:
        """One round of the driver loop: the controller's timers and REST requests, then what
        the workers sent (waiting at most until the job master's next deadline)."""
        conns = group.conns
        if c.running:
            self._do(c.tick(now, self._commands()), conns)
            self._publish("RUNNING")
        deadline = c.next_deadline(now)
        timeout = 0.05 if deadline is None else min(0.05, max(0.0, deadline - now))
        live = [conn for w, conn in enumerate(conns) if w not in c.stopped]
        # wait() hands back some of the connections it was given (typeshed: any waitable)
        ready: list[Any] = wait(live, timeout=timeout) if live else []
        liveness = self._liveness
        for conn in ready:
            w = conns.index(conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError) as exc:
                raise Failover(self._death_report(conn, f"worker {w} died ({type(exc).__name__})")) from None
            handler = on.get(type(msg))
            if handler is None:
                raise Failover(f"worker {w} sent {type(msg).__name__} on its control connection mid-attempt")
            received = time.monotonic()
            if type(msg) is Ready:
                liveness.watch(w, received)
            else:
                liveness.heard(w, received)
            self._do(handler(msg, received), conns)
        group.check(c.stopped, c.stop_sent)
        self._check_liveness(group, c)
        self._do(c.stop_workers(), conns)
        self.collect(c.master)

    def _check_liveness(self, group: WorkerGroup, c: AttemptController) -> None:
        """Fail over when a watched worker has been silent for the heartbeat timeout. Unread
        messages on its connection count as life (this loop may have been busy, not it)."""
        liveness = self._liveness
        if c.stop_sent:
            liveness.forget_all()  # workers leave their loops: heartbeats end
            return
        now = time.monotonic()
        for silent in liveness.expired(now):
            conn = group.conns[silent.worker]
            try:
                alive = conn.poll()
            except (EOFError, OSError):
                alive = False
            if alive and not silent.stuck:
                liveness.heard(silent.worker, now)
                continue
            log.error("job %s: %s", self.pipeline.name, silent.reason)
            raise Failover(silent.reason)

    # -- worker -> driver messages the driver handles itself (the rest go to the controller)
    def _on_heartbeat(self, msg: Heartbeat, now: float) -> list[Any]:
        self.meters.sample(msg.worker, msg.meters)
        self._liveness.busy(msg.worker, now, msg.busy_for)
        return []

    def _on_stopped(self, c: AttemptController, msg: Stopped, now: float) -> list[Any]:
        self.meters.sample(msg.worker, msg.meters)  # the final counts, exact at the job's end
        return c.on_stopped(msg, now)

    def _on_ready(self, c: AttemptController, msg: Ready, now: float) -> list[Any]:
        out = c.on_ready(msg, now)
        if c.all_ready and self.last_failure is not None:
            self.recovery_seconds.append(self.clock() - self.last_failure)
        return out

    def _on_ack(self, c: AttemptController, msg: Ack, now: float) -> list[Any]:
        c.bound(msg.info.epoch, msg.info.task, msg.info.captured_at)  # notification latency: trigger -> bound
        return c.on_ack(msg, now)

    #: how long a lost link waits for its peer's own connection to show a death (a killed worker's
    #: sockets all close at once; its peer's notice comes after)
    LINK_LOST_GRACE = 1.0

    def _on_link_lost(self, c: AttemptController, group: WorkerGroup, msg: LinkLost, now: float) -> list[Any]:
        """A worker's link to a peer ended. After ``Stop`` peers leave: expected. Before it, a
        peer that died is reported as its death; a peer still alive means the network between
        two live workers failed (a reset or cut connection): fail over, naming both."""
        if c.stop_sent or msg.peer in c.stopped:
            return []
        conn = group.conns[msg.peer]
        end = time.monotonic() + self.LINK_LOST_GRACE
        try:
            while time.monotonic() < end:
                if conn.poll(0.05):
                    got = conn.recv()
                    if type(got) in (WorkerError, Fatal):
                        raise Failover(got.text)
        except (EOFError, OSError) as exc:
            raise Failover(f"worker {msg.peer} died ({type(exc).__name__})") from None
        reason = (f"worker {msg.worker} lost its connection to worker {msg.peer} ({msg.reason}) while both are "
                  f"alive: the network between them failed")
        log.error("job %s: %s", self.pipeline.name, reason)
        raise Failover(reason)

    def _on_worker_error(self, msg: WorkerError, now: float) -> list[Any]:
        raise Failover(msg.text)

    def _on_fatal(self, msg: Fatal, now: float) -> list[Any]:  # a damaged checkpoint: restarting cannot help
        raise CheckpointError(msg.text.split(": ", 2)[-1].split("\n")[0])

    # -- driver -> worker
    def _do(self, actions: list[Any], conns) -> None:
        """Send the controller's actions (``Trigger``, ``Neoss``, ``Stop``) to every worker."""
        for a in actions:
            if type(a) is CaptureFull:
                continue  # the worker forced it itself before its Decline left (worker._writer)
            self._send_all(conns, a)

    def _send_all(self, conns, msg) -> None:
        for w in range(len(conns)):
            self._send(conns, w, msg)

    def _send(self, conns, w: int, msg) -> None:
        try:
            conns[w].send(msg)
        except OSError as exc:
            raise Failover(self._death_report(conns[w], f"worker {w} unreachable ({type(exc).__name__})")) from None

    @staticmethod
    def _death_report(conn, fallback: str) -> str:
        """Why a worker is gone: the error it reported before dying, if it sent one."""
        try:
            while conn.poll():
                msg = conn.recv()
                if type(msg) in (WorkerError, Fatal):
                    return msg.text
        except (EOFError, OSError):
            pass
        return fallback
