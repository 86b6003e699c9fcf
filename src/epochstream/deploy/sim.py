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
from dataclasses import dataclass
from typing import Any

from ..runtime.messages import Marker, Send, Snapshot, SourceExhausted, Watermark
from ..snapshot.coordinator import FINAL
from ..tracker.traffic import ServiceTraffic
from .control import SavepointRequest
from .assembly import build_tasks
from .driver import Driver
from .failures import Failover, FailureSchedule
from .persist import StateWriteError, persist
from .tracking import make_tracking, new_local_tracker

#: wire size of a marker (epoch number, channel, framing), for service-traffic accounting
MARKER_BYTES = 16

__all__ = ["FailureSchedule", "SimConfig", "SimDriver"]


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
    #: virtual times (from the start of each attempt) at which a savepoint is triggered into
    #: the run's savepoint_dir, as ``epochstream savepoint`` does on a running job
    savepoints_at: tuple[float, ...] = ()


class SimDriver(Driver):
    def __init__(self, pipeline, storage, seed: int = 0, config: SimConfig | None = None,
                 failures: FailureSchedule | None = None, parallelism: int | None = None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False) -> None:
        super().__init__(pipeline, storage, failures, parallelism, savepoint_dir, stop_with_savepoint)
        self.rng = random.Random(seed)
        self.cfg = config or SimConfig()
        self.now = 0.0
        self.writes = 0
        #: (epoch, task, seconds from the epoch's trigger to the task's bound), every attempt
        self.bound_latency: list[tuple[int, Any, float]] = []

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        # the strategy's delay is real time; the simulator waits its own virtual restart delay
        self.now += self.cfg.restart_delay

    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        self.attempt_traffic = ServiceTraffic()
        try:
            self._attempt(restored, attempt, duration)
        finally:  # a failed attempt's service messages were sent all the same
            self.traffic.merge(self.attempt_traffic)

    def _attempt(self, restored, attempt: str, duration: float | None) -> None:
        plan, cfg, rng = self.plan, self.cfg, self.rng
        traffic = self.attempt_traffic
        trackers: dict[int, Any] = {}
        tracking = None
        if self.pipeline.mode == "tracker":
            tracking = make_tracking(plan, restored, traffic, self.pipeline, attempt)
            trackers = {w: new_local_tracker(self.pipeline, w, self.now) for w in range(plan.parallelism)}
        self.tracking = tracking
        tasks = build_tasks(self.pipeline, plan, None, self.storage, restored, trackers=trackers, attempt=attempt)
        self.tasks = tasks  # the last attempt's tasks (benchmarks read their logs)
        master = self.new_master(restored, self.now, "sim", traffic=traffic)
        if tracking is not None:
            master.explain_timeout = tracking.undrained_loops
        savepoints_at = sorted(self.now + t for t in cfg.savepoints_at)
        batch = cfg.source_batch or self.pipeline.batch_size
        sources = [t for t in tasks.values() if t.is_source]
        trigger_targets = [t for t in tasks.values() if t.takes_triggers]  # sources and (aligned) loop heads
        exhausted: set = set()
        events: list[tuple[float, int, str, Any]] = []
        seq = itertools.count()
        busy: dict = {tid: self.now for tid in tasks}
        writer_busy: dict = {tid: self.now for tid in tasks}
        step_scheduled: set = set()
        last_arrival: dict[int, float] = {}
        final_requested = False
        final_waiting = False
        stop_at = None if duration is None else self.now + duration

        def push(t: float, kind: str, payload: Any) -> None:
            heapq.heappush(events, (t, next(seq), kind, payload))

        def schedule_step(tid) -> None:
            if tid not in step_scheduled:
                step_scheduled.add(tid)
                push(max(self.now, busy[tid]), "step", tid)

        def handle(tid, actions: list[Any], done_at: float) -> None:
            for a in actions:
                if type(a) is Send:
                    ch = plan.channels[a.channel]
                    same_worker = ch.src[1] == ch.dst[1]
                    at = fifo(a.channel, done_at, cfg.local_delay if same_worker else cfg.net_delay)
                    push(at, "deliver", a)
                    if type(a.message) is Marker:
                        traffic.record("marker", tid, a.message.epoch, nbytes=MARKER_BYTES)
                    elif type(a.message) is Watermark:
                        traffic.record("watermark", tid, None, nbytes=MARKER_BYTES)
                elif type(a) is Snapshot:
                    triggered = master.coordinator.epochs.get(a.capture.epoch)
                    if triggered is not None:  # notification latency: epoch trigger -> this task's bound
                        self.bound_latency.append((a.capture.epoch, tid, done_at - triggered.triggered_at))
                    size = sum(len(k.rows) for k in a.capture.keyed) * 64 + sum(len(s.records) for s in a.capture.sinks) * 32
                    at = max(done_at, writer_busy[tid]) + cfg.write_base + size * cfg.write_cost
                    writer_busy[tid] = at
                    push(at, "persisted", a.capture)
                elif type(a) is SourceExhausted:
                    exhausted.add(a.task)
                    if len(exhausted) == len(sources):
                        request_final_when_time_ends()

        def request_final_when_time_ends() -> None:
            """The final epoch waits for every timer to have fired (agent.py: time_finished)."""
            nonlocal final_requested, final_waiting
            final_waiting = True
            if not final_requested and (tracking is None or tracking.agent.time_finished()):
                final_requested = True
                apply_master(master.request(self.now, FINAL, drain=True))

        def fifo(link: Any, sent_at: float, mean_delay: float) -> float:
            """Arrival time on a FIFO link: a random delay, never before the previous message."""
            at = max(last_arrival.get(link, 0.0), sent_at + rng.expovariate(1.0 / mean_delay))
            last_arrival[link] = at
            return at

        def flush_tracker(worker: int, at: float) -> None:
            for msg in trackers[worker].poll(at):
                push(fifo(("tracker", worker), at, cfg.net_delay), "tracker", msg)

        def apply_master(out) -> None:
            if out.failover:
                raise Failover(out.failover)
            for trig in out.triggers:
                for s in trigger_targets:
                    s.trigger(trig.epoch)
                    schedule_step(s.id)

        for s in sources:
            push(self.now, "read", s.id)
        for t in tasks.values():  # a loop head re-emits its restored log first
            if not t.is_source and t.has_input():
                schedule_step(t.id)
        kill_times = self.failures.kill_times
        while not master.finished:
            if self.kills_done < len(kill_times) and kill_times[self.kills_done] <= self.now:
                self.kills_done += 1
                self.injected += 1
                worker = rng.randrange(plan.parallelism)
                raise Failover(f"worker {worker} killed at t={self.now:.6f}")
            # the duration ends the job even while a final epoch waits for its loops to drain
            if stop_at is not None and self.now >= stop_at and (not final_requested or master.drain_final):
                final_requested = True
                apply_master(master.request(self.now, FINAL))
            while savepoints_at and savepoints_at[0] <= self.now:
                savepoints_at.pop(0)
                apply_master(master.savepoint(self.now, SavepointRequest(self.savepoint_dir)))
            deadline = master.next_deadline(self.now)
            if savepoints_at and (deadline is None or savepoints_at[0] < deadline):
                deadline = savepoints_at[0]
            if deadline is not None and deadline <= self.now:
                apply_master(master.poll(self.now))
                deadline = master.next_deadline(self.now)
            for w, tr in trackers.items():
                due = tr.next_deadline(self.now)
                if due is not None and due <= self.now:
                    flush_tracker(w, self.now)
                    due = tr.next_deadline(self.now)
                if due is not None and (deadline is None or due < deadline):
                    deadline = due
            next_kill = kill_times[self.kills_done] if self.kills_done < len(kill_times) else None
            if not events:
                if deadline is None:
                    raise RuntimeError("simulation stalled: no events and no coordinator deadline")
                self.now = max(self.now, deadline)
                continue
            t = events[0][0]
            stop = stop_at if (not final_requested or master.drain_final) else None
            wake = min(x for x in (t, deadline, next_kill, stop) if x is not None)
            if wake < t:
                self.now = max(self.now, wake)
                continue
            _, _, kind, payload = heapq.heappop(events)
            self.now = max(self.now, t)
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
                if trackers:
                    flush_tracker(tid[1], busy[tid])
                if task.mailbox or task.triggers or task.neoss:
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
                if trackers:
                    flush_tracker(tid[1], busy[tid])
                if task.source_has_more():
                    push(max(busy[tid], self.now + got / cfg.source_rate), "read", tid)
            elif kind == "tracker":
                notes = tracking.notes(tracking.agent.receive(payload, self.now))
                if notes:
                    for w in range(plan.parallelism):  # one bundle per worker, FIFO per worker
                        push(fifo(("neoss", w), self.now, cfg.net_delay), "neoss", (w, notes))
                if cfg.check_invariants:
                    tracking.agent.check_invariants()
                if final_waiting:
                    request_final_when_time_ends()
            elif kind == "neoss":
                w, notes = payload
                for chains, epoch in notes:
                    for cid in chains:
                        dst = (cid, w)
                        tasks[dst].on_neoss(epoch)
                        if tasks[dst].neoss:
                            schedule_step(dst)
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
            self.collect(master)
        self.collect(master)
        for t in tasks.values():
            t.chain.close()

    def _injected_write_failure(self) -> None:
        self.injected += 1
        raise OSError("injected state write failure")
