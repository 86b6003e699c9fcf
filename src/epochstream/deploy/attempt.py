"""One attempt's policy, the same for every driver: when the job ends, and what the driver must do.

An *attempt* runs the job once, from a restored checkpoint until it finishes or fails over
(``driver.Driver.run`` starts the next one). ``AttemptController`` holds the decisions an
attempt makes beyond the epoch protocol itself (which is ``EpochCoordinator``'s, reached
through the ``JobMaster``): it takes the attempt's events with ``now`` and returns actions.
It imports no clock, thread, socket or random generator (``tests/test_layers.py``), so the
simulator's virtual time and the cluster driver's wall clock drive the same object, and
tests drive it alone.

Theory of operation. A job ends with a *final epoch*; the controller asks the job master
for one, at most once unless noted, when

1. ``stop_at`` (the end of ``duration``) has come, also while a final epoch asked for by
   exhausted sources waits for its loops to drain (``JobMaster.drain_final``): the duration
   ends the job without waiting for that;
2. every source task is exhausted and, in trAcker mode with event time, the tracking agent
   says time has finished (``TrackingAgent.time_finished``: every timer has fired); until
   then each tracker report asks again. This final epoch drains loops (``drain=True``);
3. a stop that was asked over REST before a failover is still in progress: it is asked again
   in the next attempt (the driver remembers it across attempts);
4. a savepoint request with ``stop`` arrives (``savepoint``).

Everything else it decides: a failed state write makes the task's next capture full (its
chain of increments is broken; ``CaptureFull``); a ``MasterOutput`` with a failover ends the
attempt (``Failover`` is raised); trigger latency (epoch trigger -> a task's bound) is
recorded in ``bound_latency``; markers and watermarks count as service traffic; workers that
stopped are counted, and the attempt is ``done`` once the job master has finished and every
worker has stopped (``Stop`` is returned once, by ``stop_workers``).

Actions are the driver -> worker messages of ``deploy.protocol`` (``Trigger``, ``Neoss``,
``Committed``, ``Stop``: the cluster driver sends them to every worker; the simulator hands
them to its tasks) and ``CaptureFull``. ``Committed`` comes for every epoch the job master
committed, before the triggers of the same step, when a sink commits in its subtasks
(``subtask_commits``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..backends.base import commits_in_subtasks
from ..runtime.errors import ProtocolError
from ..runtime.messages import TaskId
from ..snapshot.coordinator import FINAL, SAVEPOINT
from ..tracker.traffic import ServiceTraffic
from .control import IN_PROGRESS, SavepointRequest
from .failures import Failover
from .master import JobMaster, MasterOutput
from .protocol import (
    Ack,
    Committed,
    Decline,
    Exhausted,
    Neoss,
    Ready,
    Stop,
    Stopped,
    TrackerReport,
    Trigger,
)
from .tracking import Tracking

#: wire size of a marker or watermark (epoch or label, channel, framing), for service-traffic accounting
MARKER_BYTES = 16


@dataclass(frozen=True, slots=True)
class CaptureFull:
    """Task ``task``'s next capture must be full: a failed state write broke its chain of
    increments. (A cluster worker applies this itself, before its ``Decline`` leaves: a
    round trip through the driver would let the next capture go out incremental.)"""

    task: TaskId


Action = Trigger | Neoss | Committed | Stop | CaptureFull


class AttemptController:
    """The per-attempt policy; see the module docstring. One per attempt."""

    def __init__(self, master: JobMaster, tracking: Tracking | None, traffic: ServiceTraffic, *, sources: int,
                 workers: int = 0, stop_at: float | None = None, stop_request: SavepointRequest | None = None,
                 stop_asked: bool = False) -> None:
        self.master = master
        #: some sink commits in its subtasks: they are told of every committed epoch (``Committed``)
        self.subtask_commits = any(commits_in_subtasks(s) for s in master.sinks.values())
        #: trAcker mode's segments and agent (None in the aligned modes)
        self.tracking = tracking
        #: the attempt's service-traffic counter
        self.traffic = traffic
        #: source tasks of the job: once all are exhausted the job may end
        self.sources = sources
        #: workers that report ``Ready`` and ``Stopped`` (0: the simulator, which steps its tasks itself)
        self.workers = workers
        #: when ``duration`` ends (same clock as ``now``), None: never
        self.stop_at = stop_at
        #: a stop asked for over REST, remembered across attempts by the driver
        self.stop_request = stop_request
        self.stop_asked = stop_asked
        self.ready: set[int] = set()
        self.exhausted: set[TaskId] = set()
        #: a final epoch has been asked of the job master (invariant: at most once, except rule 1)
        self.final_requested = False
        #: every source is exhausted; the final epoch waits for time to finish
        self.final_waiting = False
        #: worker -> records its sources read (from ``Stopped``)
        self.stopped: dict[int, int] = {}
        self.stop_sent = False
        #: (epoch, task, seconds from the epoch's trigger to the task reaching its bound)
        self.bound_latency: list[tuple[int, TaskId, float]] = []
        #: epoch -> the moment it was triggered, for the epochs in ``bound_latency`` (benchmarks place
        #: the bounds in time: ``sustainable_throughput``'s drain rule)
        self.triggered_at: dict[int, float] = {}

    # -- state
    @property
    def all_ready(self) -> bool:
        """Every worker has reported ``Ready`` (at once in the simulator)."""
        return len(self.ready) == self.workers

    @property
    def running(self) -> bool:
        """Every worker is ready and the job master has not finished: ``tick`` may be called."""
        return self.all_ready and not self.master.finished

    @property
    def done(self) -> bool:
        """The job master has finished and every worker has stopped."""
        return self.master.finished and len(self.stopped) == self.workers

    @property
    def records_in(self) -> int:
        return sum(self.stopped.values())

    def pending_stop(self) -> float | None:
        """When ``tick`` will next ask for a final epoch because ``duration`` ended (rule 1)."""
        return self.stop_at if (not self.final_requested or self.master.drain_final) else None

    def next_deadline(self, now: float) -> float | None:
        """The job master's next deadline (a periodic epoch, a timeout); ``tick`` acts at it."""
        return self.master.next_deadline(now)

    # -- time
    def tick(self, now: float, requests: Iterable[SavepointRequest] = ()) -> list[Action]:
        """The job's end (rules 1 and 3), the savepoint ``requests`` that arrived, and the
        job master's timers, in that order. Only while ``running``."""
        if not self.running:
            raise ProtocolError("AttemptController", "finished" if self.master.finished else "starting", "tick")
        out: list[Action] = []
        if self.stop_at is not None and now >= self.stop_at and (not self.final_requested or self.master.drain_final):
            out += self._request_final(now)
        stop = self.stop_request
        if self.stop_asked and stop is not None and stop.status == IN_PROGRESS and not self.final_requested:
            out += self._request_final(now)  # a stop asked before a failover is asked again
        for request in requests:
            out += self.savepoint(now, request)
        deadline = self.master.next_deadline(now)
        if deadline is not None and deadline <= now:
            out += self._apply(self.master.poll(now))
        return out

    def savepoint(self, now: float, request: SavepointRequest) -> list[Action]:
        """Take a savepoint now, or stop the job (``request.stop``) with a final epoch."""
        out = self._apply(self.master.savepoint(now, request))
        if request.stop:
            self.stop_request, self.stop_asked, self.final_requested = request, True, True
        return out

    # -- worker -> driver messages (the simulator makes them from its tasks' actions)
    def on_ready(self, msg: Ready, now: float) -> list[Action]:
        self.ready.add(msg.worker)
        return []

    def on_ack(self, msg: Ack, now: float) -> list[Action]:
        return self._apply(self.master.ack(msg.info, now))

    def on_decline(self, msg: Decline, now: float) -> list[Action]:
        return [CaptureFull(msg.task), *self._apply(self.master.decline(msg.task, msg.epoch, msg.reason, now,
                                                                         msg.staged))]

    def on_exhausted(self, msg: Exhausted, now: float) -> list[Action]:
        self.exhausted.add(msg.task)
        if len(self.exhausted) < self.sources:
            return []
        self.final_waiting = True
        return self._final_when_time_ends(now)

    def on_tracker_report(self, msg: TrackerReport, now: float) -> list[Action]:
        tracking = self.tracking
        if tracking is None:
            raise ProtocolError("AttemptController", "running", "tracker_report", "the job has no trAcker")
        notes = tracking.notes(tracking.agent.receive(msg.message, now))
        out: list[Action] = [Neoss(notes)] if notes else []
        if self.final_waiting:
            out += self._final_when_time_ends(now)
        return out

    def on_stopped(self, msg: Stopped, now: float) -> list[Action]:
        self.stopped[msg.worker] = msg.records
        self.count_sent("marker", msg.worker, None, msg.markers)
        self.count_sent("watermark", msg.worker, None, msg.watermarks)
        return []

    # -- observations
    def bound(self, epoch: int, task: TaskId, at: float) -> None:
        """Task ``task`` reached the bound of ``epoch`` at ``at``: record the trigger latency."""
        triggered = self.master.coordinator.epochs.get(epoch)
        if triggered is not None:
            self.bound_latency.append((epoch, task, at - triggered.triggered_at))
            self.triggered_at[epoch] = triggered.triggered_at

    def count_sent(self, kind: str, sender, epoch: int | None, count: int = 1) -> None:
        """``count`` markers or watermarks (``kind``) sent by ``sender``, as service traffic."""
        if count:
            self.traffic.record(kind, sender, epoch, nbytes=MARKER_BYTES * count, messages=count, entries=count)

    def stop_workers(self) -> list[Action]:
        """``Stop``, once, after the job master has finished."""
        if not self.master.finished or self.stop_sent:
            return []
        self.stop_sent = True
        return [Stop()]

    def fail(self, now: float, reason: str = "failover") -> None:
        """The attempt is over (a failover): no epoch of it may complete any more."""
        self.master.coordinator.fail(now, reason)

    # -- internals
    def _final_when_time_ends(self, now: float) -> list[Action]:
        """Rule 2: the final epoch waits for every timer to have fired (agent.py: time_finished)."""
        if self.final_requested or (self.tracking is not None and not self.tracking.agent.time_finished()):
            return []
        self.final_requested = True
        return self._apply(self.master.request(now, FINAL, drain=True))

    def _request_final(self, now: float) -> list[Action]:
        self.final_requested = True
        return self._apply(self.master.request(now, FINAL))

    def _apply(self, out: MasterOutput) -> list[Action]:
        if out.failover:
            raise Failover(out.failover)
        commits: list[Action] = [Committed(e) for e in out.committed] if self.subtask_commits else []
        # savepoints and final epochs (the end of bounded input, a stop, a stop with savepoint)
        # are aligned in unaligned mode too: they hold no channel state, so they rescale
        return commits + [Trigger(t.epoch, t.kind in (SAVEPOINT, FINAL)) for t in out.triggers]
