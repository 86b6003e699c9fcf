"""The deterministic simulator: every task of the job in one process, on a virtual clock.

A discrete-event simulation. Messages take a random network delay (exponential, mean
``net_delay``; FIFO per channel, so a message never overtakes the one before it); a task
is busy for ``message_cost + records * record_cost`` per step; sources emit at
``source_rate`` records/s per subtask; a snapshot write takes ``write_base + bytes *
write_cost``. All randomness comes from one seeded generator, so a seed *is* a schedule,
and the same seed replays the same run. The real storage and sinks are used; only time is
virtual.

Failures are injected from a ``FailureSchedule``: worker kills at virtual times, crashes at
named fail points of the job master (``before_manifest``, ``after_manifest``,
``mid_commit``, ``after_commit``, ``recovery``), and failed state-file writes. A kill rolls
the whole job back to the latest completed checkpoint, as Flink's full restart does.
"""

from __future__ import annotations

import heapq
import itertools
import random
import secrets
from dataclasses import dataclass, field
from typing import Any

from ..runtime.errors import EpochStreamError
from ..snapshot.manifest import CheckpointError
from ..runtime.messages import Send, Snapshot, SourceExhausted
from ..snapshot.coordinator import FINAL
from .common import (
    InjectedFailure,
    JobFailedError,
    JobMaster,
    SinkStagingError,
    StateWriteError,
    build_tasks,
    check_compatible,
    find_restore,
    persist,
    recover,
)


@dataclass
class SimConfig:
    net_delay: float = 0.0005
    local_delay: float = 0.00001
    record_cost: float = 2e-6
    message_cost: float = 5e-6
    source_rate: float = 200_000.0
    source_batch: int | None = None
    write_base: float = 0.001
    write_cost: float = 1e-8
    restart_delay: float = 0.01
    check_invariants: bool = True


@dataclass
class FailureSchedule:
    """What goes wrong, and when. Occurrence numbers count from 1 over the whole run."""

    kill_times: list[float] = field(default_factory=list)
    fail_points: dict[str, set[int]] = field(default_factory=dict)
    write_failures: set[int] = field(default_factory=set)

    @classmethod
    def random(cls, rng: random.Random, kills: int, horizon: float) -> "FailureSchedule":
        """``kills`` failures spread over ``horizon`` virtual seconds, a mix of worker kills
        and job-master crashes at fail points."""
        sched = cls()
        points = ["before_manifest", "after_manifest", "mid_commit", "after_commit", "recovery"]
        for _ in range(kills):
            r = rng.random()
            if r < 0.6:
                sched.kill_times.append(rng.uniform(0, horizon))
            elif r < 0.9:
                sched.fail_points.setdefault(rng.choice(points), set()).add(rng.randint(1, 4))
            else:
                sched.write_failures.add(rng.randint(1, 20))
        sched.kill_times.sort()
        return sched


class _Failover(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SimDriver:
    def __init__(self, pipeline, storage, seed: int = 0, config: SimConfig | None = None,
                 failures: FailureSchedule | None = None, parallelism: int | None = None) -> None:
        self.pipeline = pipeline
        self.plan = pipeline.plan(parallelism)
        self.storage = storage
        self.rng = random.Random(seed)
        self.cfg = config or SimConfig()
        self.failures = failures or FailureSchedule()
        self.now = 0.0
        self.restarts = 0
        self.point_counts: dict[str, int] = {}
        self.writes = 0
        self.kills_done = 0
        self.injected = 0  # failures actually injected (kills, fail points, write failures)
        self.failover_log: list[dict[str, Any]] = []
        self.epoch_log: list[dict[str, Any]] = []
        self.completed: list[int] = []
        self.records_in = 0
        self.events_processed = 0

    # ------------------------------------------------------------ failure injection
    def fail_point(self, name: str) -> None:
        n = self.point_counts[name] = self.point_counts.get(name, 0) + 1
        if n in self.failures.fail_points.get(name, ()):
            self.injected += 1
            raise InjectedFailure(f"injected crash at {name} (occurrence {n})")

    # ------------------------------------------------------------ run
    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        restored = find_restore(self.storage, restore)
        if restored:
            check_compatible(self.plan, self.pipeline, restored, allow_non_restored_state)
        initial = restored
        self.attempt_index = 0
        self.run_id = secrets.token_hex(4)  # unique file names per run; not from the seeded rng
        max_restarts = self.pipeline.restart_attempts
        while True:
            try:
                recover(self.storage, self.pipeline.sinks, restored, self.fail_point)
                if self._attempt(restored, duration):
                    return
            except CheckpointError:
                raise  # a damaged checkpoint stays damaged: restarting cannot help
            except (_Failover, InjectedFailure, SinkStagingError, EpochStreamError) as exc:
                reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                self.failover_log.append({"time": self.now, "reason": reason})
                self.restarts += 1
                if self.restarts > max_restarts:
                    raise JobFailedError(
                        f"job {self.pipeline.name!r} failed: gave up after {max_restarts} restarts; last failure: {reason}"
                    ) from exc
                self.now += self.cfg.restart_delay
                restored = find_restore(self.storage, "latest") or initial
            self.attempt_index += 1

    def _attempt(self, restored, duration: float | None) -> bool:
        plan, cfg, rng = self.plan, self.cfg, self.rng
        attempt = f"{self.run_id}.{self.attempt_index}"
        tasks = build_tasks(self.pipeline, plan, None, self.storage, restored)
        master = JobMaster(self.pipeline, plan, self.storage, restored, self.now, self.fail_point, "sim")
        self.master = master
        batch = cfg.source_batch or self.pipeline.batch_size
        sources = [t for t in tasks.values() if t.is_source]
        exhausted: set = set()
        events: list[tuple[float, int, str, Any]] = []
        seq = itertools.count()
        busy: dict = {tid: self.now for tid in tasks}
        writer_busy: dict = {tid: self.now for tid in tasks}
        step_scheduled: set = set()
        last_arrival: dict[int, float] = {}
        final_requested = False
        stop_at = None if duration is None else self.now + duration

        def push(t: float, kind: str, payload: Any) -> None:
            heapq.heappush(events, (t, next(seq), kind, payload))

        def schedule_step(tid) -> None:
            if tid not in step_scheduled:
                step_scheduled.add(tid)
                push(max(self.now, busy[tid]), "step", tid)

        def handle(tid, actions: list[Any], done_at: float) -> None:
            nonlocal final_requested
            for a in actions:
                if type(a) is Send:
                    ch = plan.channels[a.channel]
                    same_worker = ch.src[1] == ch.dst[1]
                    delay = rng.expovariate(1.0 / (cfg.local_delay if same_worker else cfg.net_delay))
                    at = max(last_arrival.get(a.channel, 0.0), done_at + delay)
                    last_arrival[a.channel] = at
                    push(at, "deliver", a)
                elif type(a) is Snapshot:
                    size = sum(len(k.rows) for k in a.capture.keyed) * 64 + sum(len(s.records) for s in a.capture.sinks) * 32
                    at = max(done_at, writer_busy[tid]) + cfg.write_base + size * cfg.write_cost
                    writer_busy[tid] = at
                    push(at, "persisted", a.capture)
                elif type(a) is SourceExhausted:
                    exhausted.add(a.task)
                    if len(exhausted) == len(sources) and not final_requested:
                        final_requested = True
                        apply_master(master.request(self.now, FINAL))

        def apply_master(out) -> None:
            if out.failover:
                raise _Failover(out.failover)
            for trig in out.triggers:
                for s in sources:
                    s.trigger(trig.epoch)
                    schedule_step(s.id)

        for s in sources:
            push(self.now, "read", s.id)
        kill_times = self.failures.kill_times
        while not master.finished:
            if self.kills_done < len(kill_times) and kill_times[self.kills_done] <= self.now:
                self.kills_done += 1
                self.injected += 1
                worker = rng.randrange(plan.parallelism)
                raise _Failover(f"worker {worker} killed at t={self.now:.6f}")
            if stop_at is not None and self.now >= stop_at and not final_requested:
                final_requested = True
                apply_master(master.request(self.now, FINAL))
            deadline = master.next_deadline(self.now)
            if deadline is not None and deadline <= self.now:
                apply_master(master.poll(self.now))
                deadline = master.next_deadline(self.now)
            next_kill = kill_times[self.kills_done] if self.kills_done < len(kill_times) else None
            if not events:
                if deadline is None:
                    raise RuntimeError("simulation stalled: no events and no coordinator deadline")
                self.now = max(self.now, deadline)
                continue
            t = events[0][0]
            wake = min(x for x in (t, deadline, next_kill, stop_at if not final_requested else None) if x is not None)
            if wake < t:
                self.now = max(self.now, wake)
                continue
            _, _, kind, payload = heapq.heappop(events)
            self.now = max(self.now, t)
            self.events_processed += 1
            if kind == "deliver":
                ch = plan.channels[payload.channel]
                tasks[ch.dst].receive(payload.channel, payload.message)
                schedule_step(ch.dst)
            elif kind == "step":
                tid = payload
                step_scheduled.discard(tid)
                task = tasks[tid]
                before = task.records_in
                actions = task.step(self.now, budget=1, read_source=False)
                cost = cfg.message_cost + (task.records_in - before) * cfg.record_cost
                busy[tid] = self.now + cost
                if cfg.check_invariants:
                    task.check_invariants()
                handle(tid, actions, busy[tid])
                if task.mailbox or task.triggers:
                    schedule_step(tid)
            elif kind == "read":
                tid = payload
                task = tasks[tid]
                n = rng.randint(1, batch)
                before = task.records_in
                actions = task.step(self.now, budget=n, read_source=True)
                got = task.records_in - before
                self.records_in += got
                busy[tid] = self.now + cfg.message_cost + got * cfg.record_cost
                if cfg.check_invariants:
                    task.check_invariants()
                handle(tid, actions, busy[tid])
                if task.source_has_more():
                    push(max(busy[tid], self.now + got / cfg.source_rate), "read", tid)
            elif kind == "persisted":
                capture = payload
                self.writes += 1
                inject = self._injected_write_failure if self.writes in self.failures.write_failures else None
                try:
                    info = persist(self.storage, self.pipeline.sinks, capture, attempt, inject)
                except StateWriteError as exc:
                    for st in tasks[capture.task].chain.states.values():
                        st.force_full = True  # the chain is broken: the next capture is full
                    apply_master(master.decline(capture.task, capture.epoch, str(exc), self.now, exc.staged))
                    continue
                apply_master(master.ack(info, self.now))
            self._collect(master)
        self._collect(master)
        for t in tasks.values():
            t.chain.close()
        return True

    def _injected_write_failure(self) -> None:
        self.injected += 1
        raise OSError("injected state write failure")

    def _collect(self, master: JobMaster) -> None:
        if master.completed:
            self.completed.extend(master.completed)
            master.completed = []
        if master.epoch_log:
            self.epoch_log.extend(master.epoch_log)
            master.epoch_log = []
