"""The driver side of every multi-process deployment (local and spark): one loop that runs
the job master and the tracking agent as services for the workers.

A subclass only says how workers come to life and how they die: ``launch`` starts one
attempt's workers and returns a ``WorkerGroup`` holding one control connection per worker
(a pipe for the local driver, a TCP connection for spark). The attempt's policy (triggers,
acks and declines, the final epoch, the trAcker agent's NEOSS, the stop handshake) is the
``attempt.AttemptController``'s, the same the simulator drives; an attempt's loop
(``_AttemptLoop``) does its I/O: it reads the workers' ``deploy.protocol`` messages, hands
each to its handler by type, sends the controller's actions to every worker, detects
failovers and carries out the kills the chaos plan (``chaos.plan``) says are due. What the
run has done is its ``RunRecord``; its ``StatusPublisher`` (``deploy.status``) serves the job's
HTTP API from a thread of the driver process, whose requests the loop hands to the
controller between its own steps (``deploy.control.JobControl``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator

from ..chaos.kills import Kill, KillTarget
from ..chaos.verdict import kill_kind
from ..snapshot.failpoints import FailPointName
from ..snapshot.manifest import CheckpointError
from ..tracker.traffic import ServiceTraffic
from .attempt import AttemptController, CaptureFull
from .control import SavepointRequest
from .driver import Driver
from .failures import Failover
from .lease import Lease
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
from .status import StatusPublisher

log = logging.getLogger("epochstream")


class WorkerGroup:
    """One attempt's workers, as the driver loop sees them."""

    #: control connection of worker w at index w
    conns: list[Any]

    def check(self, stopped: dict[int, int], stop_sent: bool) -> None:
        """Raise ``Failover`` if a worker is gone in a way its connection does not show."""

    def pid(self, worker: int, target: KillTarget) -> int:
        """The pid a chaos kill of ``worker`` hits: ``worker`` (its process) or ``executor``."""
        raise NotImplementedError

    def kill(self, worker: int, target: KillTarget) -> None:
        """Carry out a chaos kill of ``worker`` now: SIGKILL what ``target`` names (a freeze:
        SIGSTOP of its process, alive but silent; a lost machine: its cluster daemon and the
        executor at once). A process already gone is no error."""
        try:
            if target is KillTarget.FREEZE:  # a hung or cut-off host (liveness.py)
                os.kill(self.pid(worker, KillTarget.WORKER), signal.SIGSTOP)
            elif target is KillTarget.MACHINE:
                daemon, executor = self.pid(worker, KillTarget.MACHINE), self.pid(worker, KillTarget.EXECUTOR)
                os.kill(daemon, signal.SIGKILL)
                os.kill(executor, signal.SIGKILL)
            else:
                os.kill(self.pid(worker, target), signal.SIGKILL)
        except ProcessLookupError:
            pass

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
                 rest_port: int = 0, on_start=None, *, job_id: str | None = None, lease: Lease | None = None,
                 allow_sources_from_start: bool = False) -> None:
        super().__init__(pipeline, storage, failures, parallelism, savepoint_dir, stop_with_savepoint,
                         job_id=job_id, lease=lease, allow_sources_from_start=allow_sources_from_start)
        #: the status document, the HTTP API (``rest``: served on 127.0.0.1 and registered for the CLI;
        #: ``on_start``: called with the job file's content once it is up, the CLI prints it)
        self.status = StatusPublisher(job_id=self.job_id, pipeline=pipeline, plan=self.plan, storage=storage,
                                      deployment=self.deployment, savepoint_dir=self.savepoint_dir,
                                      record=self.record, rest=rest, port=rest_port, on_start=on_start)
        #: picks the victims of chaos kills
        self.rng = random.Random(seed)
        self.chaos = self.failures.chaos_plan(self.rng.randrange, self.MOMENT_TIMEOUT)
        #: (epoch, task, seconds from the epoch trigger to the task reaching its bound); the
        #: task's clock is the driver's only where both share a host's monotonic clock
        self.bound_latency: list[tuple[int, Any, float]] = []
        self.t0 = time.monotonic()
        self.deadline: float | None = None
        #: the running attempt's workers and controller
        self._group: WorkerGroup | None = None
        self._controller: AttemptController | None = None

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        self.t0 = time.monotonic()
        self.deadline = None if duration is None else self.t0 + duration
        restored = self.prepare(restore, allow_non_restored_state)  # refuse bad input before serving anything
        status = self.status
        try:
            status.start(self.clock())
            self.run_prepared(restored, duration)
        except BaseException as exc:
            status.error = f"{type(exc).__name__}: {exc}"
            status.close("FAILED", self.clock())
            raise
        status.close("FINISHED", self.clock())

    def _publish(self, state: str, force: bool = False) -> None:
        self.status.publish(state, self.clock(), force=force,
                            running=None if self._controller is None else self._controller.traffic,
                            extra=self._status_extra())

    def collect(self, master) -> None:
        """As ``Driver.collect``; a completed epoch is stamped with the driver's clock (``time``,
        seconds since the run began, as kill and failover times), at most one loop step late."""
        fresh = len(master.epoch_log)
        super().collect(master)
        if fresh:
            now = self.clock()
            for entry in self.record.epoch_log[-fresh:]:
                entry.setdefault("time", now)

    def _status_extra(self) -> dict[str, Any]:
        """Status fields of one kind of driver (spark: the slots a starting attempt waits for)."""
        return {}

    def on_failover(self) -> None:
        # RESTARTING with the failure just counted, until the next attempt runs (or the run ends)
        self._publish("RESTARTING", force=True)

    def _commands(self) -> Iterator[SavepointRequest]:
        """REST requests, drained when the controller reads them; a stop is remembered across
        attempts (asked again after a failover until it completes)."""
        for req in self.status.control.drain():
            if req.stop:
                self.stop_request = req
                self.stop_asked = True
            yield req

    def launch(self, restored, attempt: str) -> WorkerGroup:
        raise NotImplementedError

    # -- chaos (the plan says which kill is due: ``chaos.plan``; the worker group carries it out)
    def fail_point(self, name: str) -> None:
        if name == FailPointName.MID_COMMIT and self._group is not None:
            kill = self.chaos.at_commit(self.clock())  # logged when it was armed, as it reads now
            if kill is not None:
                self._group.kill(kill.worker, kill.target)
                time.sleep(0.05)  # let the death land while the commit is still in progress
        super().fail_point(name)

    # -- one attempt
    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        group = self.launch(restored, attempt)
        self._group = group
        self.chaos.new_attempt()
        traffic = ServiceTraffic()
        c = self._controller = self.new_attempt(restored, attempt, time.monotonic(), self.deployment, traffic,
                                                workers=len(group.conns), stop_at=self.deadline)
        self.record.meters.new_attempt()  # the last attempt's counts stay in the run's totals
        try:
            _AttemptLoop(self, group, c).run()
        except BaseException:
            self._controller = None  # its traffic is the run's from here on (the status must not count it twice)
            self.record.traffic.merge(traffic)  # a failed attempt's service messages were sent all the same
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
        self.record.traffic.merge(traffic)
        self.record.records_in += c.records_in
        group.finish()


class _AttemptLoop:
    """One attempt's loop over its worker group: reads what the workers send, hands each
    message to its handler by type (the controller's, or one here), sends the controller's
    actions to every worker, watches the workers' liveness and carries out the chaos kills."""

    #: how long a lost link waits for its peer's own connection to show a death (a killed worker's
    #: sockets all close at once; its peer's notice comes after)
    LINK_LOST_GRACE = 1.0

    def __init__(self, driver: ClusterDriver, group: WorkerGroup, controller: AttemptController) -> None:
        self.driver = driver
        self.group = group
        self.c = c = controller
        self.liveness = HeartbeatMonitor(driver.pipeline.heartbeat)
        launched = time.monotonic()
        for w in range(len(group.conns)):
            self.liveness.launched(w, launched)
        #: worker -> driver messages by type (each handler returns the controller's actions)
        self.on: dict[type, Callable[[Any, float], list[Any]]] = {
            Ready: self._on_ready, Ack: self._on_ack, Decline: c.on_decline, Exhausted: c.on_exhausted,
            TrackerReport: c.on_tracker_report, Stopped: self._on_stopped, Heartbeat: self._on_heartbeat,
            WorkerError: self._on_worker_error, Fatal: self._on_fatal, LinkLost: self._on_link_lost}

    def run(self) -> None:
        """Until the controller is done; a failure raises (``Failover``, ``CheckpointError``)."""
        c, kill_after_ready = self.c, self.driver.KILL_AFTER_READY
        while True:
            now = time.monotonic()
            if c.all_ready or not kill_after_ready:
                self._chaos()
            if c.done:
                return
            self._step(now)

    def _chaos(self) -> None:
        """Carry out the kills the plan says are due now (``chaos.plan.ChaosPlan.step``), and
        log them: an armed kill when it is armed, its entry then saying how it came
        (``<moment>/timeout``, ``<moment>/final``) once the driver kills it itself."""
        d, c, group = self.driver, self.c, self.group
        final = c.final_requested and not c.master.finished
        kills = d.record.kills
        for action in d.chaos.step(d.clock(), workers=len(group.conns), final=final, completed=len(d.record.completed)):
            if isinstance(action, Kill) and action.armed:
                kills[-1]["moment"] = action.moment
            else:
                d.record.injected += 1
                d.record.landed.append(kill_kind(action.target, action.moment))
                kills.append({"time": action.at, "worker": action.worker, "target": action.target.value,
                              "moment": str(action.moment)})
            if isinstance(action, Kill):
                group.kill(action.worker, action.target)
            elif action.moment.in_worker:  # the worker kills at the moment itself
                self._send(action.worker, Die(action.moment.value, group.pid(action.worker, action.target)))

    def _step(self, now: float) -> None:
        """One round of the driver loop: the controller's timers and REST requests, then what
        the workers sent (waiting at most until the job master's next deadline)."""
        d, c, group, on = self.driver, self.c, self.group, self.on
        conns = group.conns
        if c.running:
            self._do(c.tick(now, d._commands()))
            d._publish("RUNNING")
        deadline = c.next_deadline(now)
        timeout = 0.05 if deadline is None else min(0.05, max(0.0, deadline - now))
        live = [conn for w, conn in enumerate(conns) if w not in c.stopped]
        # wait() hands back some of the connections it was given (typeshed: any waitable)
        ready: list[Any] = wait(live, timeout=timeout) if live else []
        liveness = self.liveness
        for conn in ready:
            w = conns.index(conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError) as exc:
                raise Failover(_death_report(conn, f"worker {w} died ({type(exc).__name__})")) from None
            handler = on.get(type(msg))
            if handler is None:
                raise Failover(f"worker {w} sent {type(msg).__name__} on its control connection mid-attempt")
            received = time.monotonic()
            if type(msg) is Ready:
                liveness.watch(w, received)
            else:
                liveness.heard(w, received)
            self._do(handler(msg, received))
        group.check(c.stopped, c.stop_sent)
        self._check_liveness()
        self._do(c.stop_workers())
        d.collect(c.master)

    def _check_liveness(self) -> None:
        """Fail over when a watched worker has been silent for the heartbeat timeout. Unread
        messages on its connection count as life (this loop may have been busy, not it)."""
        liveness = self.liveness
        if self.c.stop_sent:
            liveness.forget_all()  # workers leave their loops: heartbeats end
            return
        now = time.monotonic()
        for silent in liveness.expired(now):
            conn = self.group.conns[silent.worker]
            try:
                alive = conn.poll()
            except (EOFError, OSError):
                alive = False
            if alive and not silent.stuck:
                liveness.heard(silent.worker, now)
                continue
            log.error("job %s: %s", self.driver.pipeline.name, silent.reason)
            raise Failover(silent.reason)

    # -- worker -> driver messages the loop handles itself (the rest go to the controller)
    def _on_heartbeat(self, msg: Heartbeat, now: float) -> list[Any]:
        self.driver.record.meters.sample(msg.worker, msg.meters)
        self.liveness.busy(msg.worker, now, msg.busy_for)
        return []

    def _on_stopped(self, msg: Stopped, now: float) -> list[Any]:
        self.driver.record.meters.sample(msg.worker, msg.meters)  # the final counts, exact at the job's end
        return self.c.on_stopped(msg, now)

    def _on_ready(self, msg: Ready, now: float) -> list[Any]:
        d, c = self.driver, self.c
        out = c.on_ready(msg, now)
        if c.all_ready and d.last_failure is not None:
            d.record.recovery_seconds.append(d.clock() - d.last_failure)
        return out

    def _on_ack(self, msg: Ack, now: float) -> list[Any]:
        self.c.bound(msg.info.epoch, msg.info.task, msg.info.captured_at)  # notification latency: trigger -> bound
        return self.c.on_ack(msg, now)

    def _on_link_lost(self, msg: LinkLost, now: float) -> list[Any]:
        """A worker's link to a peer ended. After ``Stop`` peers leave: expected. Before it, a
        peer that died is reported as its death; a peer still alive means the network between
        two live workers failed (a reset or cut connection): fail over, naming both."""
        c = self.c
        if c.stop_sent or msg.peer in c.stopped:
            return []
        conn = self.group.conns[msg.peer]
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
        log.error("job %s: %s", self.driver.pipeline.name, reason)
        raise Failover(reason)

    def _on_worker_error(self, msg: WorkerError, now: float) -> list[Any]:
        raise Failover(msg.text)

    def _on_fatal(self, msg: Fatal, now: float) -> list[Any]:  # a damaged checkpoint: restarting cannot help
        raise CheckpointError(msg.text.split(": ", 2)[-1].split("\n")[0])

    # -- driver -> worker
    def _do(self, actions: list[Any]) -> None:
        """Send the controller's actions (``Trigger``, ``Neoss``, ``Stop``) to every worker."""
        for a in actions:
            if type(a) is CaptureFull:
                continue  # the worker forced it itself before its Decline left (worker._writer)
            for w in range(len(self.group.conns)):
                self._send(w, a)

    def _send(self, w: int, msg: Any) -> None:
        conn = self.group.conns[w]
        try:
            conn.send(msg)
        except OSError as exc:
            raise Failover(_death_report(conn, f"worker {w} unreachable ({type(exc).__name__})")) from None


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
