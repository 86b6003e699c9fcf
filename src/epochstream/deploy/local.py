"""The local driver: one OS process per worker, real time, real pipes.

Python runs one thread of bytecode at a time per process, so the local driver uses
processes, one per worker (subtask index), forked from the driver so user lambdas need no
pickling. Workers are joined all-to-all by duplex pipes; each worker hosts subtask ``w`` of
every chain, so forward channels never leave a process.

Inside a worker one loop owns the tasks (the sans-IO core): it reads every inbound pipe
without blocking, steps the tasks, delivers local sends directly and queues remote ones.
Sender threads write the queues to the pipes, so a full pipe never stalls the loop (two
workers blocked on sending to each other would deadlock). A writer thread persists
snapshots in the background (pre-commit) and the loop forwards its acks to the driver.

Backpressure: a worker whose unprocessed backlog (mailboxes, held messages of blocked
channels, send queues) crosses a high watermark tells its peers; sources stop reading
while any worker is over it, and resume below the low watermark. Reading never stops, so
markers always get through.

The driver process runs the job master (coordinator, manifests, sink commits) and the
restart strategy: when a worker dies or reports an error, every worker is killed and the
job restarts from the latest completed checkpoint after ``restart_delay`` seconds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from ..runtime.errors import ConfigurationError
from ..runtime.messages import Marker, Send, Snapshot, SourceExhausted
from ..snapshot.coordinator import FINAL
from ..snapshot.manifest import CheckpointError
from ..tracker.traffic import ServiceTraffic
from .common import Driver, Failover, JobMaster, StateWriteError, build_tasks, make_tracking, new_local_tracker, persist
from .sim import MARKER_BYTES

log = logging.getLogger("epochstream")

HIGH_WATERMARK = 32  # messages
LOW_WATERMARK = 8
STEP_BUDGET = 4096  # records per task step


# ---------------------------------------------------------------- worker process


class _Worker:
    def __init__(self, index: int, pipeline, plan, storage, restored, attempt: str,
                 control: Connection, peers: dict[int, Connection]) -> None:
        self.index = index
        self.pipeline = pipeline
        self.plan = plan
        self.storage = storage
        self.attempt = attempt
        self.control = control
        self.peers = peers
        self.tracker = new_local_tracker(pipeline, index, time.monotonic()) if pipeline.mode == "tracker" else None
        self.tasks = build_tasks(pipeline, plan, index, storage, restored,
                                 trackers={index: self.tracker} if self.tracker else None, attempt=attempt)
        #: chain id -> this worker's task of it (NEOSS for a segment goes to its chains' tasks)
        self.task_of_chain = {tid[0]: t for tid, t in self.tasks.items()}
        self.markers_sent = 0
        self.sources = [t for t in self.tasks.values() if t.is_source]
        self.others = [t for t in self.tasks.values() if not t.is_source]
        self.channel_dst = {c.id: c.dst for c in plan.channels}
        self.outbox: dict[int, list] = {p: [] for p in peers}
        self.send_queues: dict[int, queue.SimpleQueue] = {p: queue.SimpleQueue() for p in peers}
        #: envelopes queued per peer by the loop, and sent per peer by the sender thread; each
        #: counter has one writer, so the backlog (queued - sent) needs no lock
        self.queued: dict[int, int] = {p: 0 for p in peers}
        self.sent: dict[int, int] = {p: 0 for p in peers}
        self.peer_pressure: set[int] = set()
        self.pressured = False
        self.writes: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.records_in = 0

    # -- threads
    def _sender(self, peer: int) -> None:
        conn, q = self.peers[peer], self.send_queues[peer]
        while True:
            item = q.get()
            if item is None:
                return
            try:
                conn.send(item)
            except (BrokenPipeError, OSError):
                return
            self.sent[peer] += 1

    def _writer(self) -> None:
        sinks = self.pipeline.sinks
        while True:
            capture = self.writes.get()
            if capture is None:
                return
            try:
                info = persist(self.storage, sinks, capture, self.attempt)
                self.results.put(("ack", info))
            except StateWriteError as exc:
                for st in self.tasks[capture.task].chain.states.values():
                    st.force_full = True
                self.results.put(("decline", capture.task, capture.epoch, str(exc), exc.staged))
            except Exception as exc:  # sink staging or anything else: the job must fail over
                self.results.put(("error", f"worker {self.index}: {type(exc).__name__}: {exc}"))

    # -- main loop
    def run(self) -> None:
        threads = [threading.Thread(target=self._sender, args=(p,), daemon=True) for p in self.peers]
        threads.append(threading.Thread(target=self._writer, daemon=True))
        for t in threads:
            t.start()
        self.control.send(("ready", self.index))
        inbound = list(self.peers.values())
        peer_of = {id(c): p for p, c in self.peers.items()}
        batch = self.pipeline.batch_size
        while not self.stopping:
            did = self._control()
            for conn in wait(inbound, timeout=0) if inbound else ():
                did = True
                try:
                    while conn.poll():
                        self._deliver(peer_of[id(conn)], conn.recv())
                except (EOFError, OSError):
                    # the peer exited: after a clean stop that is expected, after a crash the
                    # driver sees the death on its own pipe and fails the job over
                    inbound.remove(conn)
            for task in self.others:
                if task.mailbox or task.neoss:
                    self._handle(task.step(time.monotonic(), STEP_BUDGET))
                    did = True
            throttled = self.pressured or bool(self.peer_pressure)
            for task in self.sources:
                if task.triggers or not task.exhausted_reported:
                    had_triggers = bool(task.triggers)
                    before = task.records_in
                    self._handle(task.step(time.monotonic(), batch, read_source=not throttled))
                    got = task.records_in - before
                    self.records_in += got
                    did = did or got > 0 or had_triggers
            self._flush()
            self._results()
            self._pressure()
            timeout = 0.002
            if self.tracker is not None:
                now = time.monotonic()
                for msg in self.tracker.poll(now):
                    self.control.send(("tracker", msg))
                due = self.tracker.next_deadline(now)
                if due is not None:
                    timeout = max(0.0, min(timeout, due - now))
            if not did:
                wait(inbound + [self.control], timeout=timeout)
        for task in self.tasks.values():
            task.chain.close()
        for q in self.send_queues.values():
            q.put(None)
        self.writes.put(None)
        for t in threads:
            t.join(timeout=5)
        self._results()
        self.control.send(("stopped", self.index, self.records_in, self.markers_sent))

    def _control(self) -> bool:
        did = False
        while self.control.poll():
            msg = self.control.recv()
            did = True
            if msg[0] == "trigger":
                for s in self.sources:
                    s.trigger(msg[1])
            elif msg[0] == "neoss":
                for chains, epoch in msg[1]:
                    for cid in chains:
                        task = self.task_of_chain.get(cid)
                        if task is not None:
                            task.on_neoss(epoch)
            elif msg[0] == "stop":
                self.stopping = True
        return did

    def _deliver(self, peer: int, envelope: list) -> None:
        for ch, msg in envelope:
            if ch < 0:  # backpressure signal from a peer
                (self.peer_pressure.add if msg else self.peer_pressure.discard)(peer)
            else:
                self.tasks[self.channel_dst[ch]].receive(ch, msg)

    def _handle(self, actions: list[Any]) -> None:
        for a in actions:
            if type(a) is Send:
                if type(a.message) is Marker:
                    self.markers_sent += 1
                dst = self.channel_dst[a.channel]
                if dst[1] == self.index:
                    self.tasks[dst].receive(a.channel, a.message)
                else:
                    self.outbox[dst[1]].append((a.channel, a.message))
            elif type(a) is Snapshot:
                self.writes.put(a.capture)
            elif type(a) is SourceExhausted:
                self.control.send(("exhausted", a.task))

    def _flush(self) -> None:
        for peer, items in self.outbox.items():
            if items:
                self.queued[peer] += 1
                self.send_queues[peer].put(items)
                self.outbox[peer] = []

    def _results(self) -> None:
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                return
            self.control.send(res)

    def _pressure(self) -> None:
        backlog = sum(len(t.mailbox) + len(t.held) for t in self.others) + sum(
            self.queued[p] - self.sent[p] for p in self.peers)
        if not self.pressured and backlog > HIGH_WATERMARK:
            self.pressured = True
        elif self.pressured and backlog < LOW_WATERMARK:
            self.pressured = False
        else:
            return
        for peer in self.peers:
            self.queued[peer] += 1
            self.send_queues[peer].put([(-1, self.pressured)])


def _worker_main(index, pipeline, plan, storage, restored, attempt, control, peers, close) -> None:
    for c in close:
        c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    try:
        _Worker(index, pipeline, plan, storage, restored, attempt, control, peers).run()
    except BaseException as exc:  # report, then die: the driver fails the job over
        kind = "fatal" if isinstance(exc, CheckpointError) else "error"
        try:
            control.send((kind, f"worker {index}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        except Exception:
            pass
        os._exit(1)
    os._exit(0)


# ---------------------------------------------------------------- driver


class LocalDriver(Driver):
    def __init__(self, pipeline, storage, seed: int = 0, failures=None, parallelism: int | None = None,
                 **options: Any) -> None:
        if options:
            raise TypeError(f"unknown option(s) for the local driver: {sorted(options)}")
        super().__init__(pipeline, storage, failures, parallelism)
        self.rng = random.Random(seed)
        self.recovery_seconds: list[float] = []
        self._ctx = mp.get_context("fork")
        self.t0 = time.monotonic()
        self.deadline: float | None = None

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        self.t0 = time.monotonic()
        self.deadline = None if duration is None else self.t0 + duration
        super().run(restore, allow_non_restored_state, duration)

    def _spawn(self, restored, attempt: str):
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
        return procs, [c[1] for c in controls]

    def attempt(self, restored, attempt: str, duration: float | None) -> None:
        procs, conns = self._spawn(restored, attempt)
        self.procs = procs
        master = JobMaster(self.pipeline, self.plan, self.storage, restored, time.monotonic(), self.fail_point, "local")
        traffic = ServiceTraffic()
        tracking = make_tracking(self.plan, restored, traffic) if self.pipeline.mode == "tracker" else None
        n_sources = sum(1 for c in self.plan.chains if c.is_source) * self.plan.parallelism
        exhausted: set = set()
        ready = 0
        final_requested = False
        stopped: dict[int, int] = {}
        kill_times = self.failures.kill_times if self.failures else []
        try:
            while True:
                now = time.monotonic()
                if self.kills_done < len(kill_times) and now - self.t0 >= kill_times[self.kills_done]:
                    self.kills_done += 1
                    self.injected += 1
                    victim = self.rng.randrange(len(procs))
                    os.kill(procs[victim].pid, signal.SIGKILL)
                if master.finished and len(stopped) == len(procs):
                    break
                if ready == len(procs) and not master.finished:
                    if self.deadline is not None and now >= self.deadline and not final_requested:
                        final_requested = True
                        self._apply(master.request(now, FINAL), conns)
                    self._apply(master.poll(now), conns)
                deadline = master.next_deadline(now)
                timeout = 0.05 if deadline is None else min(0.05, max(0.0, deadline - now))
                live = [c for w, c in enumerate(conns) if w not in stopped]
                for conn in wait(live, timeout=timeout) if live else ():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError) as exc:
                        w = conns.index(conn)
                        raise Failover(self._death_report(w, conn, f"worker {w} died ({type(exc).__name__})")) from None
                    kind = msg[0]
                    now = time.monotonic()
                    if kind == "ready":
                        ready += 1
                        if ready == len(procs) and self.last_failure is not None:
                            self.recovery_seconds.append(self.clock() - self.last_failure)
                    elif kind == "ack":
                        self._apply(master.ack(msg[1], now), conns)
                    elif kind == "decline":
                        self._apply(master.decline(msg[1], msg[2], msg[3], now, msg[4]), conns)
                    elif kind == "exhausted":
                        exhausted.add(msg[1])
                        if len(exhausted) == n_sources and not final_requested:
                            final_requested = True
                            self._apply(master.request(now, FINAL), conns)
                    elif kind == "error":
                        raise Failover(msg[1])
                    elif kind == "fatal":  # a damaged checkpoint: restarting cannot help
                        raise CheckpointError(msg[1].split(": ", 2)[-1].split("\n")[0])
                    elif kind == "tracker":
                        notes = tracking.notes(tracking.agent.receive(msg[1], now))
                        if notes:
                            self._send_all(conns, ("neoss", notes))
                    elif kind == "stopped":
                        stopped[msg[1]] = msg[2]
                        if msg[3]:
                            traffic.record("marker", msg[1], None, nbytes=MARKER_BYTES * msg[3], messages=msg[3],
                                           entries=msg[3])
                for w, proc in enumerate(procs):
                    if not proc.is_alive() and w not in stopped:
                        if proc.exitcode == 0 and getattr(self, "_stop_sent", False):
                            continue  # stopped cleanly; its "stopped" message is still in the pipe
                        if conns[w].poll():
                            continue  # read what it sent before dying first (its error report)
                        raise Failover(f"worker {w} (pid {proc.pid}) died with exit code {proc.exitcode}")
                if master.finished and not getattr(self, "_stop_sent", False):
                    self._stop_sent = True
                    self._send_all(conns, ("stop",))
                self.collect(master)
        except BaseException:
            self.traffic.merge(traffic)  # a failed attempt's service messages were sent all the same
            master.coordinator.fail(time.monotonic(), "failover")
            self.collect(master)
            self._kill(procs)
            raise
        finally:
            self._stop_sent = False
            for c in conns:
                c.close()
        self.collect(master)
        self.traffic.merge(traffic)
        self.records_in += sum(stopped.values())
        for proc in procs:
            proc.join(timeout=5)

    def _apply(self, out, conns) -> None:
        if out.failover:
            raise Failover(out.failover)
        for trig in out.triggers:
            self._send_all(conns, ("trigger", trig.epoch))

    @staticmethod
    def _send_all(conns, msg) -> None:
        for w, c in enumerate(conns):
            try:
                c.send(msg)
            except OSError as exc:
                raise Failover(LocalDriver._death_report(w, c, f"worker {w} unreachable ({type(exc).__name__})")) from None

    @staticmethod
    def _death_report(w: int, conn, fallback: str) -> str:
        """Why worker ``w`` is gone: the error it reported before dying, if it sent one."""
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] in ("error", "fatal"):
                    return msg[1]
        except (EOFError, OSError):
            pass
        return fallback

    @staticmethod
    def _kill(procs) -> None:
        for proc in procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            proc.join(timeout=5)
