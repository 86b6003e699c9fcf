"""The deterministic simulator: every task of the job in one process, on a virtual clock.

A discrete-event simulation. Messages take a random network delay (exponential, mean
``net_delay``; FIFO per channel, so a message never overtakes the one before it); a task
is busy for ``message_cost + records * record_cost`` per step; sources emit at
``source_rate`` records/s per subtask; a snapshot write takes ``write_base + bytes *
write_cost`` on the task's writer lane (one write at a time per task, in epoch order). Only a
capture that ``persist`` writes a file for is charged (``persist.writes_files``: keyed state, or
sink output); a stateless task's capture (offsets, operator and channel state ride in the ack)
writes nothing and passes the lane at no cost, so stateless tasks do not cap the epoch rate.
All randomness comes from one seeded generator, so a seed *is* a schedule, and the same seed
replays the same run. The real storage and sinks are used; only time is
virtual.

Flow control (``SimConfig.flow``, off by default) is modelled with the objects a worker
drives (``deploy.flow``): each directed link between two workers has a credit window,
carries a step's remote output to that worker as one envelope, FIFO, and sends control
envelopes (credit, backpressure, overtaking markers) ahead of the data waiting for credit;
each worker has a ``Pressure``, and its sources stop reading while it or a peer is over its
bound. ``SimConfig.time_limit`` turns a run that never finishes into a ``SimStalled`` naming
what waits (the links without credit, the pressured workers, the parked sources).

Failures are injected from a ``FailureSchedule``: worker kills at virtual times, crashes at
named fail points of the job master (``before_manifest``, ``after_manifest``,
``mid_commit``, ``after_commit``, ``recovery``), and failed state-file writes. A kill rolls
the whole job back to the latest completed checkpoint, as Flink's full restart does.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..backends.base import commits_in_subtasks
from ..chaos.verdict import WRITE_FAILURE, kill_kind
from ..runtime.messages import (
    Marker,
    Send,
    Snapshot,
    SourceExhausted,
    TaskCapture,
    TaskId,
    Watermark,
)
from ..runtime.meters import WorkerSample, task_key
from ..runtime.modes import implications
from ..runtime.task import ConsumingTask, Task
from ..tracker.traffic import ServiceTraffic
from .assembly import build_tasks, gates_overtake
from .attempt import MARKER_BYTES, AttemptController, CaptureFull
from .control import SavepointRequest
from .driver import Driver
from .failures import Failover, FailureSchedule
from .flow import FlowLimits, Pressure, ReceiveWindow, SendWindow
from .lease import Lease
from .persist import StateWriteError, persist, writes_files
from .protocol import (
    Ack,
    Backpressure,
    Committed,
    Credit,
    Decline,
    Exhausted,
    Neoss,
    PriorityMarker,
    Stop,
    TrackerReport,
    Trigger,
)
from .result import SimFlowCounts
from .tracking import Tracking, new_local_tracker

__all__ = ["MARKER_BYTES", "FailureSchedule", "FlowLimits", "SimConfig", "SimDriver", "SimStalled"]


class SimStalled(RuntimeError):
    """The run passed ``SimConfig.time_limit`` without finishing; the message names what waits."""


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
    #: stragglers (paper 000 §5.3.1: "the probability that some node delays punctuation
    #: increases" with the number of nodes): every worker pauses ``straggler_rate`` times per
    #: virtual second on average (Poisson), each pause lasting ``straggler_min`` seconds times a
    #: Pareto(``straggler_alpha``) draw, a heavy tail like GC pauses and noisy neighbours. A step
    #: that overlaps a pause ends that much later. Each worker draws its pauses from a generator
    #: of its own, seeded with the run's seed and the worker: runs with one seed pause the same
    #: workers at the same times (the two modes of Figure 13a are compared on the same pauses),
    #: and the run's other draws are unchanged. 0 = no stragglers.
    straggler_rate: float = 0.0
    straggler_alpha: float = 1.5
    straggler_min: float = 0.002
    #: CPU sharing (for throughput experiments, paper 000 §5.4): with ``worker_cores`` the tasks of
    #: a worker share that many cores, so a step waits for a free one; None = every task has a CPU
    #: of its own (the default: latency experiments on an unloaded system)
    worker_cores: int | None = None
    #: CPU of a task per marker it takes from its inputs (a step takes every queued marker up to the
    #: alignment with one record, so without it a burst of markers costs one ``message_cost``);
    #: punctuations travel the data channels and cost a task like a message (paper 000 §5.4)
    marker_cost: float = 0.0
    #: CPU of a task per SND/RCV event it hands its local tracker (the trAcker's per-batch XOR)
    report_cost: float = 0.0
    #: CPU of the tracking agent per report message: the agent is one process, so messages
    #: queue behind each other there (0 = the agent is never the bottleneck)
    agent_cost: float = 0.0
    #: NEOSS of several agent steps to one worker travel as one bundle: notes join the worker's
    #: bundle still on the wire (FlameStream hands min-time updates to each node's local acker,
    #: which passes them on to its components); off = one bundle per agent step and worker
    coalesce_neoss: bool = False
    #: the task itself writes its snapshot and processes nothing meanwhile (the blocking save of
    #: paper 000 §5.3.2); off = epochstream's asynchronous writer lane beside the task
    blocking_writes: bool = False
    #: flow control between workers, as a worker does it (``deploy.flow``): credit windows per
    #: link and backpressure per worker with these bounds; None = every message leaves at once
    #: on a channel of its own (latency experiments on an unloaded system)
    flow: FlowLimits | None = None
    #: virtual seconds the whole run may take; past them it raises ``SimStalled`` (None: no limit)
    time_limit: float | None = None


class SimDriver(Driver):
    def __init__(self, pipeline, storage, seed: int = 0, config: SimConfig | None = None,
                 failures: FailureSchedule | None = None, parallelism: int | None = None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False, *, job_id: str | None = None,
                 lease: Lease | None = None, allow_sources_from_start: bool = False) -> None:
        super().__init__(pipeline, storage, failures, parallelism, savepoint_dir, stop_with_savepoint,
                         job_id=job_id, lease=lease, allow_sources_from_start=allow_sources_from_start)
        self.rng = random.Random(seed)
        self.seed = seed
        #: worker kills at virtual times, at once (no protocol moments): the victim from the run's generator
        self.chaos = self.failures.chaos_plan(self.rng.randrange, 0.0, moments=False)
        #: per worker, the generator of its straggler pauses: seeded from the run's seed and the worker alone,
        #: so runs with one seed pause the same workers at the same times whatever else they draw (the two
        #: modes of Figure 13a see the same pauses), and a restarted attempt goes on with the same stream
        self.pause_rngs: dict[int, random.Random] = {}
        self.cfg = config or SimConfig()
        self.now = 0.0
        #: capture ``n`` of ``failures.write_failures`` came (``record.captures`` counts them), and the
        #: next one that writes a state file fails (a capture without keyed state writes none)
        self.write_failure_due = False
        #: (epoch, task, seconds from the epoch's trigger to the task's bound), every attempt
        self.bound_latency: list[tuple[int, Any, float]] = []
        #: the last attempt's trAcker objects (None in the aligned modes), tasks and controller (benchmarks read
        #: their logs and epoch timings)
        self.tracking: Tracking | None = None
        self.controller: AttemptController | None = None
        self.tasks: dict[TaskId, Task] = {}
        #: (worker, start, end) of every straggler pause drawn, every attempt (``SimConfig.straggler_rate``):
        #: benchmarks set a latency against the pauses that no protocol can hide
        self.pause_log: list[tuple[int, float, float]] = []
        if self.cfg.flow is not None:  # flow control over the run: waits for credit, reads held back
            self.record.sim_flow = SimFlowCounts()

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        # the strategy's delay is real time; the simulator waits its own virtual restart delay
        self.now += self.cfg.restart_delay

    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        self.attempt_traffic = ServiceTraffic()
        self.chaos.new_attempt()
        run = None
        try:
            run = _SimAttempt(self, restored, attempt, duration)
            run.run()
        finally:  # a failed attempt's service messages were sent all the same
            self.record.traffic.merge(self.attempt_traffic)
            if run is not None:  # every task's rows in and out (no time shares: time is virtual)
                meters = self.record.meters
                meters.new_attempt()
                meters.sample(0, WorkerSample(self.now, {task_key(tid): (t.records_in, t.records_out, 0.0, 0.0, 0.0,
                                                                         t.late_records, t.dead_letters)
                                                         for tid, t in run.tasks.items()}))
                self.bound_latency.extend(run.controller.bound_latency)
                self.controller = run.controller

    def _injected_write_failure(self) -> None:
        self.write_failure_due = False
        self.record.injected += 1
        self.record.landed.append(WRITE_FAILURE)
        raise OSError("injected state write failure")


class _SimAttempt:
    """One attempt in virtual time: the event queue, every task of the job, and the attempt's
    ``AttemptController``. An event is (time, sequence number, handler, payload); the
    sequence number keeps the heap FIFO among equal times, so handlers are never compared."""

    def __init__(self, driver: SimDriver, restored, attempt: str, duration: float | None) -> None:
        d = self.driver = driver
        self.plan, self.cfg, self.rng, self.attempt = d.plan, d.cfg, d.rng, attempt
        c: AttemptController = d.new_attempt(restored, attempt, d.now, "sim", d.attempt_traffic,
                                             stop_at=None if duration is None else d.now + duration)
        self.controller = c
        d.tracking = c.tracking
        self.trackers: dict[int, Any] = {}
        if c.tracking is not None:
            self.trackers = {w: new_local_tracker(d.pipeline, w, d.now) for w in range(self.plan.parallelism)}
        self.tasks = build_tasks(d.pipeline, self.plan, None, d.storage, restored, trackers=self.trackers,
                                 attempt=attempt)
        d.tasks = self.tasks  # the last attempt's tasks (benchmarks read their logs)
        #: the gates overtake: a step draws a row budget (``_on_step``) for a task that takes markers
        #: early and for a source, whose step without a read leaves it unused (a seed's schedule keeps it)
        self.sources_draw = gates_overtake(d.pipeline.mode, d.pipeline.aligned_timeout)
        self.savepoints_at = sorted(d.now + t for t in self.cfg.savepoints_at)
        self.batch = self.cfg.source_batch or d.pipeline.batch_rows
        #: per task, the flush deadline a ``_on_linger`` event is queued for
        self.linger_at: dict[Any, float] = {}
        self.sources = [t for t in self.tasks.values() if t.is_source]
        self.trigger_targets = [t for t in self.tasks.values() if t.takes_triggers]  # sources, (aligned) loop heads
        self.events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self.seq = itertools.count()
        self.busy: dict = {tid: d.now for tid in self.tasks}
        self.writer_busy: dict = {tid: d.now for tid in self.tasks}
        self.step_scheduled: set = set()
        self.last_arrival: dict[Any, float] = {}
        #: per worker, when each of its cores is free (only with ``SimConfig.worker_cores``)
        self.cores: dict[int, list[float]] = {}
        if self.cfg.worker_cores is not None:
            self.cores = {w: [d.now] * self.cfg.worker_cores for w in range(self.plan.parallelism)}
        self.agent_busy = d.now
        #: per worker, the NEOSS bundle on the wire that later notes may join (``coalesce_neoss``)
        self.neoss_wire: dict[int, tuple[int, list[Any]]] = {}
        #: per worker, when its next pause starts (only with ``SimConfig.straggler_rate``)
        self.next_pause: dict[int, float] = {}
        self.pauses: dict[int, deque[tuple[float, float]]] = {}
        self.pause_rng: dict[int, random.Random] = {}
        if self.cfg.straggler_rate > 0:
            self.pause_rng = {w: d.pause_rngs.setdefault(w, random.Random(f"sim-pauses-{d.seed}-{w}"))
                              for w in range(self.plan.parallelism)}
            self.next_pause = {w: d.now + self.pause_rng[w].expovariate(self.cfg.straggler_rate)
                               for w in range(self.plan.parallelism)}
            self.pauses = {w: deque() for w in range(self.plan.parallelism)}
        #: what the controller's actions do here (the cluster driver sends them to workers)
        self.act = {Trigger: self._trigger, Neoss: self._neoss, Committed: self._committed,
                    CaptureFull: self._capture_full, Stop: None}
        #: task -> its sinks that commit in their subtasks (told of committed epochs on the task's writer lane)
        self.subtask_sinks = {tid: [uid for uid in t.chain.sink_writers if commits_in_subtasks(d.pipeline.sinks[uid])]
                              for tid, t in self.tasks.items()}
        self.subtask_sinks = {tid: uids for tid, uids in self.subtask_sinks.items() if uids}
        for tid, uids in self.subtask_sinks.items():
            for uid in uids:
                d.pipeline.sinks[uid].open_subtask(uid, tid[1])
        #: what the tasks' actions do here
        self.task_act: dict[type, Callable[[TaskId, Any, float], None]] = {
            Send: self._send, Snapshot: self._snapshot, SourceExhausted: self._exhausted}
        #: flow control between the workers (``SimConfig.flow``; None: off)
        self.flow = None if self.cfg.flow is None else _SimFlow(self, self.cfg.flow)
        #: with flow control, the remote output of the step being handled: worker -> its envelope
        self.outbox: dict[int, list[tuple[int, Any]]] = {}

    # -- the loop
    def run(self) -> None:
        d, c = self.driver, self.controller
        for s in self.sources:
            self.push(d.now, self._on_read, s.id)
        for t in self.tasks.values():  # a loop head re-emits its restored log first
            if not t.is_source and t.has_input():
                self.schedule_step(t.id)
        limit = self.cfg.time_limit
        while not c.master.finished:
            if limit is not None and d.now > limit:
                raise SimStalled(f"the run did not finish in {limit} virtual seconds (t={d.now:.6f}): "
                                 + self._waiting())
            self._kill_if_due()
            self.apply(c.tick(d.now, self._due_savepoints()))
            deadline = self._deadline()
            if not self.events:
                if deadline is None:
                    raise RuntimeError("simulation stalled: no events and no coordinator deadline")
                d.now = max(d.now, deadline)
                continue
            first = self.events[0][0]  # the earliest event's time
            wake = min(x for x in (first, deadline, self._next_kill(), c.pending_stop()) if x is not None)
            if wake < first:
                d.now = max(d.now, wake)
                continue
            _, _, handler, payload = heapq.heappop(self.events)
            d.now = max(d.now, first)
            handler(payload)
            d.collect(c.master)
        # the final epoch's commits in the sinks' subtasks: a worker carries them out before it stops
        while self.events:
            at, _, handler, payload = heapq.heappop(self.events)
            if handler == self._on_sink_commit:
                d.now = max(d.now, at)
                handler(payload)
        d.collect(c.master)
        for t in self.tasks.values():
            t.chain.close()

    def _waiting(self) -> str:
        """What waits now: tasks with input, and with flow control its links and workers."""
        busy = sorted(str(tid) for tid, t in self.tasks.items()
                      if t.has_input() or (isinstance(t, ConsumingTask) and t.held))
        text = f"tasks with input or held messages: {', '.join(busy) or 'none'}"
        return text if self.flow is None else f"{text}; {self.flow.describe()}"

    def _next_kill(self) -> float | None:
        return self.driver.chaos.next_due()

    def _kill_if_due(self) -> None:
        d = self.driver
        for kill in d.chaos.step(d.now, workers=self.plan.parallelism, final=False):  # a Kill, now
            d.record.injected += 1
            d.record.landed.append(kill_kind(kill.target, kill.moment))
            raise Failover(f"worker {kill.worker} killed at t={d.now:.6f}")

    def _due_savepoints(self) -> list[SavepointRequest]:
        """``SimConfig.savepoints_at``: what ``epochstream savepoint`` would ask of a running job."""
        due = []
        while self.savepoints_at and self.savepoints_at[0] <= self.driver.now:
            self.savepoints_at.pop(0)
            due.append(SavepointRequest(self.driver.savepoint_dir))
        return due

    def _deadline(self) -> float | None:
        """The earliest timer: the job master's, a scheduled savepoint, a local tracker's flush
        (flushing the trackers that are due now)."""
        now = self.driver.now
        deadline = self.controller.next_deadline(now)
        if self.savepoints_at and (deadline is None or self.savepoints_at[0] < deadline):
            deadline = self.savepoints_at[0]
        for w, tr in self.trackers.items():
            due = tr.next_deadline(now)
            if due is not None and due <= now:
                self.flush_tracker(w, now)
                due = tr.next_deadline(now)
            if due is not None and (deadline is None or due < deadline):
                deadline = due
        return deadline

    # -- the virtual network
    def push(self, t: float, handler: Callable[[Any], None], payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), handler, payload))

    def schedule_step(self, tid) -> None:
        if tid not in self.step_scheduled:
            self.step_scheduled.add(tid)
            self.push(max(self.driver.now, self.busy[tid]), self._on_step, tid)

    def fifo(self, link: Any, sent_at: float, mean_delay: float) -> float:
        """Arrival time on a FIFO link: a random delay, never before the previous message."""
        at = max(self.last_arrival.get(link, 0.0), sent_at + self.rng.expovariate(1.0 / mean_delay))
        self.last_arrival[link] = at
        return at

    def flush_tracker(self, worker: int, at: float) -> None:
        for msg in self.trackers[worker].poll(at):
            self.push(self.fifo(("tracker", worker), at, self.cfg.net_delay), self._on_tracker, msg)

    # -- the controller's actions
    def apply(self, actions: list[Any]) -> None:
        for a in actions:
            handler = self.act[type(a)]
            if handler is not None:
                handler(a)

    def _trigger(self, a: Trigger) -> None:
        for s in self.trigger_targets:
            s.trigger(a.epoch, a.aligned)
            self.schedule_step(s.id)

    def _neoss(self, a: Neoss) -> None:
        """One bundle per worker, FIFO per worker. With ``SimConfig.coalesce_neoss`` the notes join
        the worker's bundle still on the wire, if any (arriving with it, never after later notes):
        one message per worker per link delay, however many agent steps produced notes."""
        for w in range(self.plan.parallelism):
            bundle = self.neoss_wire.get(w) if self.cfg.coalesce_neoss else None
            if bundle is not None:
                bundle[1].extend(a.notes)
                continue
            bundle = (w, list(a.notes))
            self.neoss_wire[w] = bundle
            self.push(self.fifo(("neoss", w), self.driver.now, self.cfg.net_delay), self._on_neoss, bundle)

    def _committed(self, a: Committed) -> None:
        """Each sink subtask commits on its task's writer lane, after the writes before it."""
        d = self.driver
        for tid in self.subtask_sinks:
            at = max(self.fifo(("control", tid[1]), d.now, self.cfg.net_delay), self.writer_busy[tid])
            self.writer_busy[tid] = at + self.cfg.write_base
            self.push(at + self.cfg.write_base, self._on_sink_commit, (tid, a.epoch))

    def _on_sink_commit(self, payload: tuple[TaskId, int]) -> None:
        tid, epoch = payload
        sinks = self.driver.pipeline.sinks
        for uid in self.subtask_sinks[tid]:
            sinks[uid].commit_subtask(uid, tid[1], epoch)

    def _capture_full(self, a: CaptureFull) -> None:
        for st in self.tasks[a.task].chain.states.values():
            st.force_full = True

    # -- the tasks' actions
    def handle(self, tid, actions: list[Any], done_at: float) -> None:
        for a in actions:
            self.task_act[type(a)](tid, a, done_at)
        if self.outbox:  # with flow control: the step's remote output, one envelope per worker
            outbox, self.outbox = self.outbox, {}
            assert self.flow is not None
            for worker, envelope in outbox.items():
                self.flow.send(tid[1], worker, envelope, done_at)

    def _send(self, tid, a: Send, done_at: float) -> None:
        ch = self.plan.channels[a.channel]
        if ch.src[1] == ch.dst[1]:
            self.push(self.fifo(a.channel, done_at, self.cfg.local_delay), self._on_deliver, a)
        elif self.flow is not None:
            self.outbox.setdefault(ch.dst[1], []).append((a.channel, a.message))
        else:
            self.push(self.fifo(a.channel, done_at, self.cfg.net_delay), self._on_deliver, a)
        if type(a.message) is Marker:
            self.controller.count_sent("marker", tid, a.message.epoch)
        elif type(a.message) is Watermark:
            self.controller.count_sent("watermark", tid, None)

    def _snapshot(self, tid, a: Snapshot, done_at: float) -> None:
        capture = a.capture
        self.controller.bound(capture.epoch, tid, done_at)  # notification latency: trigger -> this task's bound
        at = max(done_at, self.writer_busy[tid])  # the task's writes stay in order, as in a worker's writer thread
        if writes_files(capture):  # a stateless task's capture writes no file (persist): it costs no write
            size = sum(len(k.rows) for k in capture.keyed) * 64 + sum(len(s.records) for s in capture.sinks) * 32
            at += self.cfg.write_base + size * self.cfg.write_cost
        self.writer_busy[tid] = at
        if self.cfg.blocking_writes:
            self.busy[tid] = max(self.busy[tid], at)
        self.push(at, self._on_persisted, capture)

    def _exhausted(self, tid, a: SourceExhausted, done_at: float) -> None:
        self.apply(self.controller.on_exhausted(Exhausted(a.task), self.driver.now))

    # -- events
    def _on_deliver(self, a: Send) -> None:
        dst = self.plan.channels[a.channel].dst
        self.tasks[dst].receive(a.channel, a.message)
        self.schedule_step(dst)

    def _core_free_at(self, tid) -> float | None:
        """With ``worker_cores``: when a core of the task's worker is free, if not now."""
        if not self.cores:
            return None
        free = min(self.cores[tid[1]])
        return free if free > self.driver.now else None

    def _on_step(self, tid) -> None:
        wait = self._core_free_at(tid)
        if self.cfg.blocking_writes and self.busy[tid] > self.driver.now:  # a blocking save began after scheduling
            wait = max(wait or 0.0, self.busy[tid])
        if wait is not None:
            self.push(wait, self._on_step, tid)
            return
        self.step_scheduled.discard(tid)
        task = self.tasks[tid]
        # one message per step; an unaligned task gets a row budget drawn per step instead, so
        # messages are cut at random rows and markers overtake their rest (``ConsumingTask._continue``)
        draws = task.overtakes or (task.is_source and self.sources_draw)
        budget = self.rng.randint(1, max(1, self.batch // 2)) if draws else 1
        self._run_task(task, budget=budget, read_source=False)
        if task.has_input():
            self.schedule_step(tid)

    def _on_read(self, tid) -> None:
        if self.flow is not None and self.flow.holds_read(tid):
            return
        wait = self._core_free_at(tid)
        if wait is not None:
            self.push(wait, self._on_read, tid)
            return
        task = self.tasks[tid]
        got = self._run_task(task, budget=self.rng.randint(1, self.batch), read_source=True)
        self.driver.record.records_in += got
        if task.source_has_more():
            self.push(max(self.busy[tid], self.driver.now + got / self.cfg.source_rate), self._on_read, tid)

    def _run_task(self, task, budget: int, read_source: bool) -> int:
        """One step of ``task``, busy for its cost; returns the records it took in."""
        now, cfg = self.driver.now, self.cfg
        before, markers = task.records_in, task.markers_in
        tracker = self.trackers.get(task.id[1])
        events = tracker.events if tracker is not None else 0
        actions = task.step(now, budget=budget, read_source=read_source)
        got = task.records_in - before
        done = now + cfg.message_cost + got * cfg.record_cost
        if cfg.marker_cost:  # every marker a step of its own: the step's cost covers one, if it took no record
            done += max(0, task.markers_in - markers - (0 if got else 1)) * cfg.marker_cost
        if tracker is not None and cfg.report_cost:
            done += (tracker.events - events) * cfg.report_cost
        if self.next_pause:
            done = self._straggle(task.id[1], now, done)
        self.busy[task.id] = done
        if self.cores:
            cores = self.cores[task.id[1]]
            cores[cores.index(min(cores))] = done
        if cfg.check_invariants:
            task.check_invariants()
        self.handle(task.id, actions, done)
        if self.flow is not None:  # mailboxes drained, output queued: credit and pressure
            self.flow.update(task.id[1], done)
        due = task.flush_deadline()
        if due is not None and self.linger_at.get(task.id) != due:  # lingering output: step again when it is due
            self.linger_at[task.id] = due
            self.push(due, self._on_linger, task.id)
        if self.trackers:
            self.flush_tracker(task.id[1], done)
        return got

    def _on_linger(self, tid) -> None:
        due = self.tasks[tid].flush_deadline()
        if due is not None and due <= self.driver.now:
            self.schedule_step(tid)

    def _straggle(self, worker: int, now: float, done: float) -> float:
        """A step of ``worker`` from ``now`` to ``done`` is held up by every pause of the worker
        that overlaps it (the whole worker pauses, so all its tasks wait for the same pause)."""
        cfg, pauses = self.cfg, self.pauses[worker]
        while pauses and pauses[0][1] <= now:  # steps come in time order: a past pause stays past
            pauses.popleft()
        i = 0
        while True:
            while self.next_pause[worker] < done:  # draw the pauses that begin before the step ends
                start = self.next_pause[worker]
                end = start + cfg.straggler_min * self.pause_rng[worker].paretovariate(cfg.straggler_alpha)
                pauses.append((start, end))
                self.driver.pause_log.append((worker, start, end))
                self.next_pause[worker] = end + self.pause_rng[worker].expovariate(cfg.straggler_rate)
            if i == len(pauses) or pauses[i][0] >= done:
                return done
            start, end = pauses[i]
            done += end - max(start, now)
            i += 1

    def _on_tracker(self, msg) -> None:
        if self.cfg.agent_cost:  # the agent handles one message at a time
            now = self.driver.now
            if self.agent_busy > now:
                self.push(self.agent_busy, self._on_tracker, msg)
                return
            self.agent_busy = now + self.cfg.agent_cost * max(1, len(msg.reports) + len(msg.promises))
        c = self.controller
        self.apply(c.on_tracker_report(TrackerReport(msg), self.driver.now))
        if self.cfg.check_invariants and c.tracking is not None:  # not None: on_tracker_report checked
            c.tracking.agent.check_invariants()

    def _on_neoss(self, payload) -> None:
        w, notes = payload
        if self.neoss_wire.get(w) is payload:
            del self.neoss_wire[w]
        for chains, epoch in notes:
            for cid in chains:
                dst = (cid, w)
                task = self.tasks[dst]
                task.on_neoss(epoch)
                if isinstance(task, ConsumingTask) and task.neoss:
                    self.schedule_step(dst)

    def _on_persisted(self, capture: TaskCapture) -> None:
        d, c = self.driver, self.controller
        d.record.captures += 1
        d.write_failure_due = d.write_failure_due or d.record.captures in d.failures.write_failures
        inject = d._injected_write_failure if d.write_failure_due else None
        try:
            info = persist(d.storage, d.pipeline.sinks, capture, self.attempt, inject)
        except StateWriteError as exc:
            self.apply(c.on_decline(Decline(capture.task, capture.epoch, str(exc), exc.staged), d.now))
            return
        self.apply(c.on_ack(Ack(info), d.now))


class _SimFlow:
    """Flow control on the virtual network: the ``deploy.flow`` objects a worker drives, one
    ``SendWindow`` and ``ReceiveWindow`` per directed link between two workers and one
    ``Pressure`` per worker, with ``SimConfig.flow``'s bounds. An envelope crosses its link
    after a random delay, FIFO with the link's other envelopes (one connection per pair).

    Invariant (``check_invariants``), per link: the data envelopes a sender may not send for
    want of credit (window - credit) are on the wire, owed by the receiver, or credited back
    by a ``Credit`` still on the wire."""

    def __init__(self, run: _SimAttempt, limits: FlowLimits) -> None:
        self.run = run
        counts = run.driver.record.sim_flow
        assert counts is not None, "SimDriver keeps the run's flow counts when SimConfig.flow is set"
        #: the run's waits for credit and reads held back (every attempt)
        self.counts = counts
        workers = range(run.plan.parallelism)
        pipeline = run.driver.pipeline
        overtake = implications(pipeline.mode).overtakes and pipeline.aligned_timeout is None
        pairs = [(a, b) for a in workers for b in workers if a != b]
        #: (sender, receiver) -> the sender's window of that link / the receiver's
        self.sending = {ab: SendWindow(limits.window, overtake) for ab in pairs}
        self.receiving = {ab: ReceiveWindow(limits.window) for ab in pairs}
        self.pressure = {w: Pressure(limits.high, limits.low, limits.hold) for w in workers}
        self.peers = {w: [b for b in workers if b != w] for w in workers}
        self.consumers = {w: [t for t in run.tasks.values() if isinstance(t, ConsumingTask) and t.id[1] == w]
                          for w in workers}
        #: per worker, its sources whose next read waits for the backpressure to end
        self.parked: dict[int, set[TaskId]] = {w: set() for w in workers}
        #: per link, data envelopes on the wire, and credit on its way back
        self.data_on_wire = {ab: 0 for ab in pairs}
        self.credit_on_wire = {ab: 0 for ab in pairs}

    def send(self, src: int, dst: int, envelope: list[tuple[int, Any]], at: float) -> None:
        """A step of worker ``src`` ending at ``at`` sent ``envelope`` to worker ``dst``."""
        window = self.sending[(src, dst)]
        queued = window.queue_data(envelope)
        self._pump(src, dst, at)
        if queued and window.data and window.data[-1] is queued:  # it waits for credit
            self.counts.credit_waits += 1

    def _pump(self, src: int, dst: int, at: float) -> None:
        """Put on the wire whatever the link's window lets leave at ``at``."""
        run, window = self.run, self.sending[(src, dst)]
        while (out := window.next_envelope()) is not None:
            item, data = out
            if data:
                self.data_on_wire[(src, dst)] += 1
            elif type(item) is Credit:
                self.credit_on_wire[(dst, src)] += item.envelopes
            run.push(run.fifo(("link", src, dst), at, run.cfg.net_delay), self._on_envelope, (src, dst, item))

    def _on_envelope(self, payload: tuple[int, int, Any]) -> None:
        src, dst, item = payload
        run, now = self.run, self.run.driver.now
        if type(item) is list:
            self.data_on_wire[(src, dst)] -= 1
            self.receiving[(src, dst)].on_data()
            for ch, msg in item:
                task = run.plan.channels[ch].dst
                run.tasks[task].receive(ch, msg)
                run.schedule_step(task)
        else:
            match item:
                case Credit():
                    self.credit_on_wire[(dst, src)] -= item.envelopes
                    self.sending[(dst, src)].on_credit(item)
                    self._pump(dst, src, now)
                case Backpressure():
                    self.pressure[dst].on_signal(src, item)
                    self._wake(dst, now)
                case PriorityMarker(channel=ch, marker=marker):
                    task = run.plan.channels[ch].dst
                    run.tasks[task].receive(ch, marker)
                    run.schedule_step(task)
        self.update(dst, now)
        if run.cfg.check_invariants:
            self.check_invariants()

    def update(self, worker: int, at: float) -> None:
        """The worker's loop after a turn: its pressure, then the credit it hands back."""
        consumers, pressure = self.consumers[worker], self.pressure[worker]
        mailbox = sum(len(t.mailbox) for t in consumers)
        backlog = mailbox + sum(len(t.held) for t in consumers) + sum(
            len(self.sending[(worker, b)].data) for b in self.peers[worker])
        signal = pressure.on_backlog(backlog)
        if signal is not None:
            for b in self.peers[worker]:
                self.sending[(worker, b)].queue_control(signal)
                self._pump(worker, b, at)
            self._wake(worker, at)
        if not pressure.withholds_credit(mailbox):
            for a in self.peers[worker]:
                credit = self.receiving[(a, worker)].grant()
                if credit is not None:
                    self.sending[(worker, a)].queue_control(credit)
                    self._pump(worker, a, at)

    def holds_read(self, source: TaskId) -> bool:
        """Park ``source``'s read while its worker is throttled (``_wake`` reads again)."""
        if not self.pressure[source[1]].throttled:
            return False
        self.parked[source[1]].add(source)
        self.counts.throttled_reads += 1
        return True

    def _wake(self, worker: int, at: float) -> None:
        parked = self.parked[worker]
        if parked and not self.pressure[worker].throttled:
            for tid in sorted(parked):
                self.run.push(at, self.run._on_read, tid)
            parked.clear()

    def describe(self) -> str:
        stalled = [f"{a}->{b} ({len(w.data)} waiting, credit {w.credit}, owed {self.receiving[(a, b)].owed})"
                   for (a, b), w in self.sending.items() if w.data]
        pressured = [w for w, p in self.pressure.items() if p.pressured]
        parked = sorted(str(t) for tids in self.parked.values() for t in tids)
        return (f"links with data waiting: {', '.join(stalled) or 'none'}; pressured workers: {pressured}; "
                f"parked sources: {', '.join(parked) or 'none'}")

    def check_invariants(self) -> None:
        for ab, window in self.sending.items():
            out = window.window - window.credit
            assert out == self.data_on_wire[ab] + self.receiving[ab].owed + self.credit_on_wire[ab], \
                f"link {ab}: {out} envelopes without credit, but {self.data_on_wire[ab]} on the wire, " \
                f"{self.receiving[ab].owed} owed and {self.credit_on_wire[ab]} credited on the wire"
