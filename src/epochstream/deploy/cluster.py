"""The driver side of every multi-process deployment (local and spark): one loop that runs
the job master and the tracking agent as services for the workers.

A subclass only says how workers come to life and how they die: ``launch`` starts one
attempt's workers and returns a ``WorkerGroup`` holding one control connection per worker
(a pipe for the local driver, a TCP connection for spark). Everything else is shared: the
coordinator's triggers, acks and declines, the final epoch, the trAcker agent and its NEOSS
bundles, the stop handshake, failover detection and the chaos kills.
"""

from __future__ import annotations

import os
import random
import signal
import time
from multiprocessing.connection import wait
from typing import Any

from ..snapshot.coordinator import FINAL
from ..snapshot.manifest import CheckpointError
from ..tracker.traffic import ServiceTraffic
from .common import Driver, Failover, JobMaster, make_tracking
from .sim import MARKER_BYTES


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

    def __init__(self, pipeline, storage, seed: int = 0, failures=None, parallelism: int | None = None) -> None:
        super().__init__(pipeline, storage, failures, parallelism)
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
        #: every chaos kill: time, worker, target, moment
        self.kill_log: list[dict[str, Any]] = []

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        self.t0 = time.monotonic()
        self.deadline = None if duration is None else self.t0 + duration
        super().run(restore, allow_non_restored_state, duration)

    def launch(self, restored, attempt: str) -> WorkerGroup:
        raise NotImplementedError

    # -- chaos
    def fail_point(self, name: str) -> None:
        if name == "mid_commit" and self._commit_kill is not None and self._group is not None:
            victim, target = self._commit_kill
            self._commit_kill = None
            self._kill(self._group, victim, target, "commit")
        super().fail_point(name)

    def _chaos(self, group: WorkerGroup, now: float) -> None:
        times = self.failures.kill_times
        if self.kills_done >= len(times) or now - self.t0 < times[self.kills_done]:
            return
        i = self.kills_done
        self.kills_done += 1
        self.injected += 1
        moments, targets = self.failures.kill_moments, self.failures.kill_targets
        moment = moments[i] if i < len(moments) else "now"
        target = targets[i] if i < len(targets) else "worker"
        victim = self.rng.randrange(len(group.conns))
        if moment == "now":
            self._kill(group, victim, target, moment)
        elif moment == "commit":
            self._commit_kill = (victim, target)
        else:  # the worker kills at the moment itself
            self.kill_log.append({"time": self.clock(), "worker": victim, "target": target, "moment": moment})
            self._send(group.conns, victim, ("die", moment, group.pid(victim, target)))

    def _kill(self, group: WorkerGroup, victim: int, target: str, moment: str) -> None:
        self.kill_log.append({"time": self.clock(), "worker": victim, "target": target, "moment": moment})
        try:
            os.kill(group.pid(victim, target), signal.SIGKILL)
        except ProcessLookupError:
            pass

    # -- one attempt
    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        group = self.launch(restored, attempt)
        self._group = group
        conns = group.conns
        n = len(conns)
        master = JobMaster(self.pipeline, self.plan, self.storage, restored, time.monotonic(), self.fail_point,
                           self.deployment)
        traffic = ServiceTraffic()
        tracking = (make_tracking(self.plan, restored, traffic, self.pipeline, attempt)
                    if self.pipeline.mode == "tracker" else None)
        n_sources = sum(1 for c in self.plan.chains if c.is_source) * self.plan.parallelism
        exhausted: set = set()
        ready = 0
        final_requested = False
        stop_sent = False
        stopped: dict[int, int] = {}
        try:
            while True:
                now = time.monotonic()
                if ready == n:
                    self._chaos(group, now)
                if master.finished and len(stopped) == n:
                    break
                if ready == n and not master.finished:
                    if self.deadline is not None and now >= self.deadline and not final_requested:
                        final_requested = True
                        self._apply(master.request(now, FINAL), conns)
                    self._apply(master.poll(now), conns)
                deadline = master.next_deadline(now)
                timeout = 0.05 if deadline is None else min(0.05, max(0.0, deadline - now))
                live = [c for w, c in enumerate(conns) if w not in stopped]
                for conn in wait(live, timeout=timeout) if live else ():
                    w = conns.index(conn)
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError) as exc:
                        raise Failover(self._death_report(conn, f"worker {w} died ({type(exc).__name__})")) from None
                    kind = msg[0]
                    now = time.monotonic()
                    if kind == "ready":
                        ready += 1
                        if ready == n and self.last_failure is not None:
                            self.recovery_seconds.append(self.clock() - self.last_failure)
                    elif kind == "ack":
                        triggered = master.coordinator.epochs.get(msg[1].epoch)
                        if triggered is not None:  # notification latency: trigger -> this task's bound
                            self.bound_latency.append((msg[1].epoch, msg[1].task,
                                                       msg[1].captured_at - triggered.triggered_at))
                        self._apply(master.ack(msg[1], now), conns)
                    elif kind == "decline":
                        self._apply(master.decline(msg[1], msg[2], msg[3], now, msg[4]), conns)
                    elif kind == "exhausted":
                        exhausted.add(msg[1])
                    elif kind == "error":
                        raise Failover(msg[1])
                    elif kind == "fatal":  # a damaged checkpoint: restarting cannot help
                        raise CheckpointError(msg[1].split(": ", 2)[-1].split("\n")[0])
                    elif kind == "tracker":
                        notes = tracking.notes(tracking.agent.receive(msg[1], now))
                        if notes:
                            self._send_all(conns, ("neoss", notes))
                    # the final epoch waits for every timer to have fired (agent.py: time_finished)
                    if (len(exhausted) == n_sources and not final_requested
                            and (tracking is None or tracking.agent.time_finished())):
                        final_requested = True
                        self._apply(master.request(now, FINAL), conns)
                    elif kind == "stopped":
                        stopped[msg[1]] = msg[2]
                        for kind_sent, count in (("marker", msg[3]), ("watermark", msg[4])):
                            if count:
                                traffic.record(kind_sent, msg[1], None, nbytes=MARKER_BYTES * count, messages=count,
                                               entries=count)
                group.check(stopped, stop_sent)
                if master.finished and not stop_sent:
                    stop_sent = True
                    self._send_all(conns, ("stop",))
                self.collect(master)
        except BaseException:
            self.traffic.merge(traffic)  # a failed attempt's service messages were sent all the same
            master.coordinator.fail(time.monotonic(), "failover")
            self.collect(master)
            self._group = None
            group.abort()
            raise
        self._group = None
        self.collect(master)
        self.traffic.merge(traffic)
        self.records_in += sum(stopped.values())
        group.finish()

    def _apply(self, out, conns) -> None:
        if out.failover:
            raise Failover(out.failover)
        for trig in out.triggers:
            self._send_all(conns, ("trigger", trig.epoch))

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
                if msg[0] in ("error", "fatal"):
                    return msg[1]
        except (EOFError, OSError):
            pass
        return fallback
