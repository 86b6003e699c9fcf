"""The worker loop every multi-process driver runs: local (forked processes, pipes) and spark
(barrier tasks, TCP). It only needs connection objects with ``send``/``recv``/``poll`` and a
``fileno`` (``multiprocessing.connection.Connection`` over a pipe or a socket): one control
connection to the driver and one multiplexed connection per peer worker.

One loop owns the worker's tasks (the sans-IO core): it reads every inbound connection
without blocking, steps the tasks, delivers local sends directly and queues remote ones as
*envelopes* (lists of ``(channel, message)``; one connection per worker pair and one sender
thread per connection keep every channel FIFO). A writer thread persists snapshots in the
background (pre-commit) and the loop forwards its acks to the driver.

Flow control is ``deploy.flow``'s (its rules, and why loops cannot deadlock on them): each
``PeerLink`` drives a ``SendWindow`` from its sender thread, and the loop keeps a
``ReceiveWindow`` per peer and one ``Pressure``. The link messages (``Credit``,
``Backpressure``, ``PriorityMarker``: ``deploy.protocol``) are control envelopes, told apart
from data envelopes (lists) by type. The condition variable of a link is I/O glue only: it
wakes the sender thread and guards the window the loop and the thread share.

Metering (``runtime.meters``) only reads this: each turn of the loop is a round of
``LoopTimes`` (the clock read around every task step), a task is backpressured for the rest
of a round while it is throttled with input left, while a link its output goes to has data
and no credit (``PeerLink.stalled``), or, with work left, while the loop runs its consumers
in this worker. Rows in and out and the three times go to the driver on every heartbeat and
with ``Stopped``.

Columnar batches cross the wire as Arrow IPC (``ArrowFrame``), encoded in the link's sender
thread and decoded on delivery; row batches are pickled as they are.

The control connection carries ``deploy.protocol`` messages; ``_control`` hands each one
from the driver to its ``_on_<kind>`` method by type.

Chaos: a driver may ask a worker to die at a protocol moment (``Die(moment, pid)``):
``now``, ``alignment`` (while a task holds messages for its epoch gate: mid-alignment, or in
trAcker mode mid-hold) or ``snapshot_write`` (in the writer thread, between staging sink
output and writing state files). The worker then SIGKILLs ``pid``: its own process, or the
Spark executor JVM it runs in.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from ..backends.base import commits_in_subtasks
from ..runtime.columns import from_ipc, to_ipc
from ..runtime.errors import ProtocolError
from ..runtime.messages import Batch, Marker, Send, Snapshot, SourceExhausted, Watermark
from ..runtime.meters import LoopTimes, WorkerSample, task_key
from ..runtime.modes import implications
from ..runtime.task import ConsumingTask, SourceTask
from ..snapshot.manifest import CheckpointError
from .assembly import build_tasks
from .flow import DEFAULT_TARGET, ROWS_EVERY, WINDOW, Debloater, Pressure, ReceiveWindow, SendWindow
from .liveness import DEFAULT_INTERVAL, HeartbeatSender
from .persist import StateWriteError, persist
from .protocol import (
    MOMENTS,
    Ack,
    Backpressure,
    Committed,
    Credit,
    Decline,
    Die,
    Exhausted,
    Fatal,
    Heartbeat,
    LinkLost,
    Neoss,
    PriorityMarker,
    Ready,
    Stop,
    Stopped,
    TrackerReport,
    Trigger,
    WorkerError,
)
from .tracking import new_local_tracker

STEP_BUDGET = 4096  # records per task step
#: debloating: seconds of work a consuming task's step aims at (at least one message)
STEP_SECONDS = 0.05
#: unaligned mode: seconds of work a step aims at. Its tasks cut messages there, so this is
#: how long an overtaking marker waits per hop (0.05 s gave epochs of 0.23 s at 10x
#: backpressure, 0.01 s 0.06 s, at the same throughput: benchmarks/epochs/backpressure.py)
CUT_SECONDS = 0.01
#: unaligned mode, before the first measurement: rows a consuming step takes (it cuts messages
#: there, so a marker waits for at most this much work even behind a very slow operator)
FIRST_CUT = 256

__all__ = ["MOMENTS", "PeerLink", "WorkerLoop", "run_worker"]


@dataclass(frozen=True, slots=True)
class ArrowFrame:
    """A ``Batch`` of an Arrow RecordBatch on the wire: its records as an Arrow IPC stream
    (keys travel in the columns, so a columnar Batch has none)."""

    epoch: int
    id: int
    time: int
    ipc: bytes

    def batch(self) -> Batch:
        return Batch(self.epoch, from_ipc(self.ipc), None, self.id, self.time)


def to_wire(envelope: list) -> list:
    """A data envelope with its columnar batches as ``ArrowFrame``s (row envelopes as they are)."""
    if not any(type(m) is Batch and type(m.records) is not list for _ch, m in envelope):
        return envelope
    return [(ch, ArrowFrame(m.epoch, m.id, m.time, to_ipc(m.records))
             if type(m) is Batch and type(m.records) is not list else m) for ch, m in envelope]


def rows_of(messages: Any) -> int:
    """Rows in (channel, message) pairs: the records of their batches."""
    return sum(len(m.records) for _ch, m in messages if type(m) is Batch)


class SharedConnection:
    """A control connection two threads send on (the loop, and the pulse thread while a step
    runs long): sends are whole messages under a lock; the loop alone receives."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> Any:
        return self.conn.recv()

    def fileno(self) -> int:
        return self.conn.fileno()


class PeerLink:
    """One connection to a peer: its ``flow.SendWindow`` (what leaves next), written out by a
    sender thread. The condition guards the window, shared by the loop and the thread.

    ``queued``/``sent`` (and their rows) count data envelopes queued by the loop and written by
    the thread, one writer each: the loop reads them without the lock, as measurements.
    """

    def __init__(self, conn, window: int = WINDOW, overtake: bool = False) -> None:
        self.conn = conn
        #: unaligned mode (``overtake``): markers leave ahead of the data queued for credit,
        #: carrying copies of the messages of their channel they passed (``alignment.overtaking``)
        self.window = SendWindow(window, overtake)
        self._cond = threading.Condition()
        self._closed = False
        self.queued = 0
        self.sent = 0
        self.queued_rows = 0
        self.sent_rows = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def send_data(self, envelope: list) -> None:
        with self._cond:
            queued = self.window.queue_data(envelope)
            if queued:
                self.queued += 1
                self.queued_rows += rows_of(queued)
            self._cond.notify()

    def send_control(self, message: Any) -> None:
        """Send a link message (``deploy.protocol.ON_LINKS``) ahead of the data waiting for credit."""
        with self._cond:
            self.window.queue_control(message)
            self._cond.notify()

    def on_credit(self, credit: Credit) -> None:
        with self._cond:
            self.window.on_credit(credit)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    @property
    def credit(self) -> int:
        return self.window.credit

    @property
    def backlog(self) -> int:
        return self.queued - self.sent

    @property
    def backlog_rows(self) -> int:
        return self.queued_rows - self.sent_rows

    @property
    def stalled(self) -> bool:
        """Data waits for credit (read without the lock: a measurement, not a decision)."""
        return self.window.stalled

    def _run(self) -> None:
        window, cond = self.window, self._cond
        while True:
            with cond:
                while (out := window.next_envelope()) is None and not self._closed:
                    cond.wait()
            if out is None:  # closed, and nothing left that may leave
                return
            item, data = out
            try:
                self.conn.send(to_wire(item) if data else item)
            except (BrokenPipeError, OSError):
                return
            if data:
                self.sent += 1
                self.sent_rows += rows_of(item)


class WorkerLoop:
    def __init__(self, index: int, pipeline, plan, storage, restored, attempt: str, control, peers: dict) -> None:
        self.index = index
        self.pipeline = pipeline
        self.plan = plan
        self.storage = storage
        self.attempt = attempt
        self.control = SharedConnection(control)
        #: when the loop entered the task step it is in (None: between steps); read by the pulse thread
        self.step_began: float | None = None
        self._pulse_stop = threading.Event()
        self.peers = peers
        implies = implications(pipeline.mode)
        self.tracker = new_local_tracker(pipeline, index, time.monotonic()) if implies.tracks else None
        self.tasks = build_tasks(pipeline, plan, index, storage, restored,
                                 trackers={index: self.tracker} if self.tracker else None, attempt=attempt)
        #: chain id -> this worker's task of it (NEOSS for a segment goes to its chains' tasks)
        self.task_of_chain = {tid[0]: t for tid, t in self.tasks.items()}
        self.markers_sent = 0
        self.watermarks_sent = 0
        self.sources = [t for t in self.tasks.values() if isinstance(t, SourceTask)]
        self.others = [t for t in self.tasks.values() if isinstance(t, ConsumingTask)]
        #: tasks the coordinator's triggers go to: sources and, in the aligned modes, loop heads
        self.triggered = [t for t in self.tasks.values() if t.takes_triggers]
        self.channel_dst = {c.id: c.dst for c in plan.channels}
        self.outbox: dict[int, list] = {p: [] for p in peers}
        #: unaligned mode: markers overtake the data a link queues for credit (``alignment.overtaking``)
        overtake = implies.overtakes and getattr(pipeline, "aligned_timeout", None) is None
        self.links = {p: PeerLink(c, overtake=overtake) for p, c in peers.items()}
        #: per peer, the data envelopes delivered and not yet credited back
        self.receiving = {p: ReceiveWindow() for p in peers}
        #: this worker's backpressure and its peers' (``flow.Pressure``)
        self.pressure = Pressure()
        target = getattr(pipeline, "buffer_debloat_target", DEFAULT_TARGET)
        #: the backlog bound in rows, sized by time (None: debloating off, or no consuming task)
        self.debloat = Debloater(target, pipeline.batch_rows) if target and self.others else None
        #: sizes a consuming step by time (``STEP_SECONDS``): the debloater, or with debloating
        #: off a meter of its own where tasks overtake (unaligned tasks cut messages at the step
        #: budget, ``ConsumingTask._continue``, so that is how long a marker waits for the work in hand)
        overtaking = any(t.overtakes for t in self.others)
        self.step_meter = self.debloat or (Debloater(DEFAULT_TARGET, pipeline.batch_rows) if overtaking else None)
        self._first_budget = FIRST_CUT if overtaking else STEP_BUDGET
        self._step_seconds = CUT_SECONDS if overtaking else STEP_SECONDS
        self._meter_at = 0.0
        self.writes: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.records_in = 0
        #: busy / backpressured / idle time per task (``runtime.meters``), sent with every heartbeat
        self.keys = {tid: task_key(tid) for tid in self.tasks}
        #: task -> the peer workers its output channels lead to (its output can wait for their credit)
        self.out_peers = {tid: frozenset(self.channel_dst[c][1] for c in t.out_channels) - {index}
                          for tid, t in self.tasks.items()}
        local_down = {tid: frozenset(d for c in t.out_channels if (d := self.channel_dst[c]) in self.tasks)
                      for tid, t in self.tasks.items()}
        self.times = LoopTimes(self.tasks, time.monotonic(), local_down)
        #: tasks that could not put out their output / that had work left, in the current round
        self.blocked: frozenset[Any] = frozenset()
        self.pending: frozenset[Any] = frozenset()
        #: chaos: (moment, pid to SIGKILL) asked for by the driver
        self.die_at: tuple[str, int] | None = None
        #: driver -> worker messages by type
        #: driver -> worker control messages, by type
        self.on: dict[type, Callable[[Any], None]] = {
            Trigger: self._on_trigger, Neoss: self._on_neoss, Committed: self._on_committed, Stop: self._on_stop,
            Die: self._on_die}
        #: (sink uid, subtask) of this worker's sinks that commit in their subtasks (``Committed``)
        self.subtask_sinks = [(uid, tid[1]) for tid, t in self.tasks.items() for uid in t.chain.sink_writers
                              if commits_in_subtasks(pipeline.sinks[uid])]

    # -- threads
    def _writer(self) -> None:
        sinks = self.pipeline.sinks
        try:  # before the first capture: its sinks' producers (fencing earlier attempts')
            for uid, subtask in self.subtask_sinks:
                sinks[uid].open_subtask(uid, subtask)
        except Exception as exc:
            self.results.put(WorkerError(f"worker {self.index}: opening sink {uid!r}: {type(exc).__name__}: {exc}"))
        while True:
            capture = self.writes.get()
            if capture is None:
                return
            if type(capture) is Committed:  # in the writer, after the captures before it, in order
                self._commit_sinks(capture.epoch)
                continue
            try:
                info = persist(self.storage, sinks, capture, self.attempt,
                               fail_state_write=lambda: self._maybe_die("snapshot_write"))
                self.results.put(Ack(info))
            except StateWriteError as exc:
                # the chain of increments is broken: the next capture is full (the controller's
                # CaptureFull, applied here before the Decline leaves, so no capture slips through)
                for st in self.tasks[capture.task].chain.states.values():
                    st.force_full = True
                self.results.put(Decline(capture.task, capture.epoch, str(exc), exc.staged))
            except Exception as exc:  # sink staging or anything else: the job must fail over
                self.results.put(WorkerError(f"worker {self.index}: {type(exc).__name__}: {exc}"))

    def _commit_sinks(self, epoch: int) -> None:
        """Commit this worker's sink subtasks up to ``epoch`` (its manifest exists). A failure
        fails the job over; recovery produces again what Kafka lacks from the staged output."""
        self._maybe_die("sink_commit")
        try:
            for uid, subtask in self.subtask_sinks:
                self.pipeline.sinks[uid].commit_subtask(uid, subtask, epoch)
        except Exception as exc:
            self.results.put(WorkerError(f"worker {self.index}: committing sink output of epoch {epoch}: "
                                         f"{type(exc).__name__}: {exc}"))

    def _maybe_die(self, moment: str) -> None:
        die = self.die_at
        if die is not None and die[0] == moment:
            os.kill(die[1], signal.SIGKILL)
            time.sleep(10)  # the kill is asynchronous; never carry on past it

    # -- main loop
    def run(self) -> None:
        config = getattr(self.pipeline, "heartbeat", None)
        interval = config.interval if config is not None else DEFAULT_INTERVAL
        threads = [threading.Thread(target=self._writer, daemon=True)]
        pulse = threading.Thread(target=self._pulse, args=(interval,), name="epochstream-pulse", daemon=True)
        for link in self.links.values():
            link.start()
        for t in threads:
            t.start()
        pulse.start()
        try:
            self._loop()
        finally:
            self._pulse_stop.set()
            pulse.join(timeout=5)
            for link in self.links.values():
                link.close()
            self.writes.put(None)
            # everything queued is carried out before Stopped leaves: the final epoch's commit too
            # (each step is bounded by the sinks' own timeouts)
            threads[0].join()
            for t in threads[1:] + [link.thread for link in self.links.values()]:
                t.join(timeout=5)
            for uid, _ in self.subtask_sinks:
                self.pipeline.sinks[uid].close()
        self._results()
        self.control.send(Stopped(self.index, self.records_in, self.markers_sent, self.watermarks_sent,
                                  self.sample(time.monotonic())))

    def _pulse(self, interval: float) -> None:
        """While one task step runs longer than the heartbeat interval, say so every interval
        (``liveness``: a long step is not silence; a frozen process stops this thread too)."""
        last = 0.0
        while not self._pulse_stop.wait(interval / 4):
            began = self.step_began
            now = time.monotonic()
            if began is not None and now - began >= interval and now - last >= interval:
                last = now
                try:
                    self.control.send(Heartbeat(self.index, None, busy_for=now - began))
                except (OSError, ValueError):  # the driver went away: the loop finds out itself
                    return

    def sample(self, now: float) -> WorkerSample:
        """Every task's counters now (``runtime.meters``): rows in and out, seconds busy,
        backpressured and idle."""
        times = self.times
        return WorkerSample(now, {self.keys[tid]: (t.records_in, t.records_out, times.busy[tid],
                                                   times.backpressured[tid], times.idle[tid], t.late_records,
                                                   t.dead_letters)
                                  for tid, t in self.tasks.items()})

    def _loop(self) -> None:
        self.control.send(Ready(self.index))
        inbound = list(self.peers.values())
        peer_of = {id(c): p for p, c in self.peers.items()}
        # output lingers, or an alignment may time out: step tasks at their deadlines
        lingering = self.pipeline.batch_linger > 0 or getattr(self.pipeline, "aligned_timeout", None) is not None
        config = getattr(self.pipeline, "heartbeat", None)
        beat = HeartbeatSender(config.interval if config is not None else DEFAULT_INTERVAL, time.monotonic())
        while not self.stopping:
            now = time.monotonic()
            self.times.round_end(now, self.blocked, self.pending)  # the last round: its steps and its wait
            if beat.due(now):  # from the loop itself: a loop that stops turning goes silent
                self.control.send(Heartbeat(self.index, self.sample(now)))
            did = self._control()
            did = self._read_peers(inbound, peer_of) or did
            if self.die_at is not None and self.die_at[0] == "alignment" and any(t.held for t in self.others):
                self._maybe_die("alignment")
            did = self._step_consumers(lingering) or did
            throttled = self.pressure.throttled
            did = self._step_sources(throttled) or did
            self._flush()
            self._results()
            self._pressure()
            self._credit()
            self.blocked = self._blocked(throttled)
            self.pending = frozenset(tid for tid, t in self.tasks.items()
                                     if t.has_input() or (t.reader is not None and t.reader.has_more()))
            timeout = self._timeout(lingering)
            if not did:
                wait(inbound + [self.control], timeout=timeout)
        for task in self.tasks.values():
            task.chain.close()

    def _read_peers(self, inbound: list, peer_of: dict[int, int]) -> bool:
        """Deliver every envelope the peers' connections hold now; drop a connection that ended."""
        ready: list[Any] = wait(inbound, timeout=0) if inbound else []  # Connections: inbound holds no socket
        for conn in ready:
            try:
                while conn.poll():
                    self._deliver(peer_of[id(conn)], conn.recv())
            except (EOFError, OSError) as exc:
                # the peer exited (after a clean stop that is expected, after a crash the driver
                # sees the death on its own connection), or the link between two live workers
                # failed (reset, cut): the driver tells which and fails the job over
                inbound.remove(conn)
                self.control.send(LinkLost(self.index, peer_of[id(conn)], f"{type(exc).__name__}: {exc}"
                                           if str(exc) else type(exc).__name__))
        return bool(ready)

    def _step_consumers(self, lingering: bool) -> bool:
        """Step every consuming task with input, or whose lingering output is due."""
        # debloating: a consuming step does about STEP_SECONDS of work (whole messages, so
        # the batches a function sees are unchanged), so triggers, markers and deliveries
        # are not kept waiting behind a long step of a slow operator
        meter = self.step_meter
        budget = STEP_BUDGET if meter is None else meter.rows_in(self._step_seconds, STEP_BUDGET, self._first_budget)
        times, clock = self.times, time.monotonic
        did = False
        now = clock()
        for task in self.others:
            # mailbox, NEOSS, triggers (loop heads), a restored loop log; or output whose linger is up
            if task.has_input() or (lingering and (due := task.flush_deadline()) is not None and due <= now):
                began = self.step_began = clock()
                self._handle(task.step(began, budget))
                self.step_began = None
                times.worked(task.id, clock() - began)
                did = True
        return did

    def _step_sources(self, throttled: bool) -> bool:
        """Step every source with triggers or input left; it reads only while not ``throttled``."""
        batch = self.pipeline.batch_rows
        # output may wait for batch_linger: a live source may then wait for its records too
        chunked = self.pipeline.batch_linger > 0
        times, clock = self.times, time.monotonic
        did = False
        for task in self.sources:
            if task.triggers or not task.exhausted_reported:
                had_triggers = bool(task.triggers)
                before = task.records_in
                began = self.step_began = clock()
                self._handle(task.step(began, batch, read_source=not throttled))
                self.step_began = None
                times.worked(task.id, clock() - began)
                got = task.records_in - before
                self.records_in += got
                # with a linger, a live source's short read has caught up: wait below (a
                # message, the idle timeout or the linger) rather than read again at once the
                # few records due since; below capacity that took both cores for tiny reads
                caught_up = chunked and got < batch and task.reader is not None and task.reader.source.live
                did = did or (got > 0 and not caught_up) or had_triggers
        return did

    def _timeout(self, lingering: bool) -> float:
        """Seconds the loop may wait for a message: 2 ms, or less to the local tracker's next
        flush (polling it now) or to the earliest lingering output."""
        timeout = 0.002
        if self.tracker is not None:
            now = time.monotonic()
            for msg in self.tracker.poll(now):
                self.control.send(TrackerReport(msg))
            due = self.tracker.next_deadline(now)
            if due is not None:
                timeout = max(0.0, min(timeout, due - now))
        if lingering:  # wake for the earliest buffered output that must leave
            now = time.monotonic()
            for task in self.tasks.values():
                due = task.flush_deadline()
                if due is not None:
                    timeout = max(0.0, min(timeout, due - now))
        return timeout

    def _control(self) -> bool:
        did = False
        while self.control.poll():
            msg = self.control.recv()
            did = True
            self.on[type(msg)](msg)
        return did

    def _on_trigger(self, msg: Trigger) -> None:
        for s in self.triggered:
            s.trigger(msg.epoch, msg.aligned)

    def _on_neoss(self, msg: Neoss) -> None:
        for chains, epoch in msg.notes:
            for cid in chains:
                task = self.task_of_chain.get(cid)
                if task is not None:
                    task.on_neoss(epoch)

    def _on_committed(self, msg: Committed) -> None:
        if self.subtask_sinks:
            self.writes.put(msg)

    def _on_stop(self, msg: Stop) -> None:
        self.stopping = True

    def _on_die(self, msg: Die) -> None:
        self.die_at = (msg.moment, msg.pid)
        if msg.moment == "now":
            self._maybe_die("now")

    def _deliver(self, peer: int, envelope: Any) -> None:
        if type(envelope) is not list:  # a control envelope
            self._on_link(peer, envelope)
            return
        self.receiving[peer].on_data()
        tasks, dst = self.tasks, self.channel_dst
        for ch, msg in envelope:
            tasks[dst[ch]].receive(ch, msg.batch() if type(msg) is ArrowFrame else msg)

    def _on_link(self, peer: int, message: Any) -> None:
        match message:
            case Credit():
                self.links[peer].on_credit(message)
            case Backpressure():
                self.pressure.on_signal(peer, message)
            case PriorityMarker(channel=channel, marker=marker):  # it overtook data at the sender
                self.tasks[self.channel_dst[channel]].receive(channel, marker)
            case _:
                raise ProtocolError("WorkerLoop", "running", type(message).__name__,
                                    f"worker {peer} sent what is neither a data envelope nor a link message")

    def _handle(self, actions: list[Any]) -> None:
        for a in actions:
            if type(a) is Send:
                if type(a.message) is Marker:
                    self.markers_sent += 1
                elif type(a.message) is Watermark:
                    self.watermarks_sent += 1
                dst = self.channel_dst[a.channel]
                if dst[1] == self.index:
                    self.tasks[dst].receive(a.channel, a.message)
                else:
                    self.outbox[dst[1]].append((a.channel, a.message))
            elif type(a) is Snapshot:
                self.writes.put(a.capture)
            elif type(a) is SourceExhausted:
                self.control.send(Exhausted(a.task))

    def _flush(self) -> None:
        for peer, items in self.outbox.items():
            if items:
                self.links[peer].send_data(items)
                self.outbox[peer] = []

    def _results(self) -> None:
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                return
            self.control.send(res)

    def _blocked(self, throttled: bool) -> frozenset[Any]:
        """Tasks whose output cannot leave now: sources with input left while the loop throttles
        them, and tasks with an output channel to a peer whose link waits for credit. Flow
        control itself is unchanged: this only reads its state."""
        stalled = {p for p, link in self.links.items() if link.stalled}
        if not (throttled or stalled):
            return frozenset()
        return frozenset(tid for tid, t in self.tasks.items()
                         if (throttled and t.reader is not None and t.reader.has_more())
                         or not stalled.isdisjoint(self.out_peers[tid]))

    def _credit(self) -> None:
        """Hand back the credit owed per link (``flow.ReceiveWindow``), unless this worker's
        mailboxes are long (``flow.Pressure.withholds_credit``): then its senders wait."""
        if self.pressure.withholds_credit(sum(len(t.mailbox) for t in self.others)):
            return
        for peer, window in self.receiving.items():
            credit = window.grant()
            if credit is not None:
                self.links[peer].send_control(credit)

    def _pressure(self) -> None:
        others, links = self.others, self.links.values()
        backlog = sum(len(t.mailbox) + len(t.held) for t in others) + sum(link.backlog for link in links)
        meter = self.step_meter
        if meter is not None and meter is not self.debloat:  # debloating off: only the step budget
            now = time.monotonic()
            if now - self._meter_at >= ROWS_EVERY:
                self._meter_at = now
                busy = self.times.busy
                meter.observe(now, sum(t.records_in for t in others), sum(busy[t.id] for t in others))
        pressure, debloat = self.pressure, self.debloat
        if debloat is not None and backlog:
            now = time.monotonic()
            if pressure.count_rows(now, backlog):  # counting rows walks the mailboxes: not every turn
                busy = self.times.busy
                debloat.observe(now, sum(t.records_in for t in others), sum(busy[t.id] for t in others))
                inbound = sum(rows_of(t.mailbox) for t in others)
                rows = inbound + sum(rows_of(t.held) for t in others) + sum(link.backlog_rows for link in links)
                pressure.on_rows(now, inbound, rows, debloat.limit())
        signal = pressure.on_backlog(backlog)
        if signal is not None:
            for link in links:
                link.send_control(signal)


def run_worker(index: int, pipeline, plan, storage, restored, attempt: str, control, peers: dict) -> bool:
    """Run one worker until the driver stops it; on failure report it on ``control`` and
    return False (the caller exits or fails its task)."""
    try:
        WorkerLoop(index, pipeline, plan, storage, restored, attempt, control, peers).run()
        return True
    except BaseException as exc:  # report, then die: the driver fails the job over
        kind = Fatal if isinstance(exc, CheckpointError) else WorkerError
        try:
            control.send(kind(f"worker {index}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        except Exception:
            pass
        return False
