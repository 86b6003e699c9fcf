"""The attempt controller alone: a real JobMaster and coordinator over a temporary checkpoint
dir, events in, actions out; no processes, threads or sleeps (STYLE.md: tests drive objects).

Time is whatever the test says it is: ``now`` is an argument of every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from epochstream import CheckpointConfig, DiscardingSink, Pipeline
from epochstream.backends import open_storage
from epochstream.deploy.attempt import MARKER_BYTES, AttemptController, CaptureFull
from epochstream.deploy.control import COMPLETED, SavepointRequest
from epochstream.deploy.failures import Failover
from epochstream.deploy.master import JobMaster
from epochstream.deploy.protocol import (
    Ack,
    Decline,
    Exhausted,
    Neoss,
    Ready,
    Stop,
    Stopped,
    TrackerReport,
    Trigger,
)
from epochstream.runtime.errors import ProtocolError
from epochstream.snapshot.coordinator import CHECKPOINT, FINAL, SAVEPOINT
from epochstream.snapshot.manifest import AckInfo
from epochstream.tracker.traffic import ServiceTraffic

P = 2  # parallelism: tasks (0, 0), (0, 1) of the source chain, and so on


def _pipeline(interval: float | None = None, tolerable_failed: int = 0) -> Pipeline:
    p = Pipeline("attempt", parallelism=P, checkpoint=CheckpointConfig(interval=interval,
                                                                         tolerable_failed=tolerable_failed))
    p.from_collection([1, 2, 3], uid="src").map(lambda x: x, name="id").sink(DiscardingSink(), uid="out")
    return p


@dataclass
class _Agent:
    """Stands in for the trAcker agent where only ``time_finished`` and ``receive`` matter."""

    finished: bool = False
    notes: tuple = ()

    def time_finished(self) -> bool:
        return self.finished

    def receive(self, message, now):
        return list(self.notes)


class _Tracking:
    def __init__(self, agent: _Agent) -> None:
        self.agent = agent

    def notes(self, neoss):
        return [((1,), n) for n in neoss]


def _controller(tmp_path, *, interval=None, workers=0, tracking=None, tolerable_failed=0, **kw):
    pipeline = _pipeline(interval, tolerable_failed)
    plan = pipeline.plan()
    traffic = ServiceTraffic()
    # as Driver.new_attempt: the master takes the stop the driver remembers across attempts
    master = JobMaster(pipeline, plan, open_storage(str(tmp_path / "chk")), None, 0.0, traffic=traffic,
                       stop_request=kw.get("stop_request"))
    sources = sum(1 for c in plan.chains if c.is_source) * plan.parallelism
    return AttemptController(master, tracking, traffic, sources=sources, workers=workers, **kw)


def _kind(c: AttemptController, action) -> str:
    assert type(action) is Trigger
    return c.master.coordinator.epochs[action.epoch].kind


def _source_tasks(c: AttemptController):
    plan = c.master.plan
    return [(ch.id, s) for ch in plan.chains if ch.is_source for s in range(plan.parallelism)]


def _ack_all(c: AttemptController, epoch: int, now: float) -> list:
    out = []
    for task in c.master.plan.tasks:
        out += c.on_ack(Ack(AckInfo(task, epoch)), now)
    return out


def test_duration_end_asks_for_a_final_epoch_once(tmp_path):
    c = _controller(tmp_path, stop_at=10.0)
    assert c.tick(9.9) == []
    assert c.pending_stop() == 10.0
    [trigger] = c.tick(10.0)
    assert _kind(c, trigger) == FINAL
    assert c.final_requested and c.pending_stop() is None
    assert c.tick(11.0) == []  # asked once


def test_duration_end_cuts_short_a_final_epoch_that_waits_for_loops_to_drain(tmp_path):
    c = _controller(tmp_path, stop_at=10.0)
    out = []
    for task in _source_tasks(c):
        out += c.on_exhausted(Exhausted(task), 1.0)
    assert [_kind(c, a) for a in out] == [FINAL]
    assert c.master.drain_final
    assert c.pending_stop() == 10.0  # a draining final epoch does not hold the duration back
    c.tick(10.0)
    assert not c.master.drain_final  # the duration's final epoch ends the job without draining


def test_exhausted_sources_wait_for_time_to_finish(tmp_path):
    agent = _Agent()
    c = _controller(tmp_path, tracking=_Tracking(agent))
    tasks = _source_tasks(c)
    for task in tasks[:-1]:
        assert c.on_exhausted(Exhausted(task), 1.0) == []
    assert c.on_exhausted(Exhausted(tasks[-1]), 1.0) == []  # all exhausted, but a timer may still fire
    assert c.final_waiting and not c.final_requested
    assert c.on_tracker_report(TrackerReport("report"), 2.0) == []
    agent.finished = True
    agent.notes = (7,)
    out = c.on_tracker_report(TrackerReport("report"), 3.0)
    assert out[0] == Neoss([((1,), 7)])  # the notes go out before the final trigger
    assert [_kind(c, a) for a in out[1:]] == [FINAL]
    assert c.final_requested and c.master.drain_final


def test_tracker_reports_before_exhaustion_only_forward_notes(tmp_path):
    c = _controller(tmp_path, tracking=_Tracking(_Agent(finished=True, notes=(3,))))
    assert c.on_tracker_report(TrackerReport("report"), 1.0) == [Neoss([((1,), 3)])]
    assert not c.final_requested


def test_a_stop_asked_before_a_failover_is_asked_again(tmp_path):
    stop = SavepointRequest(None, stop=True)
    c = _controller(tmp_path, stop_request=stop, stop_asked=True)
    [trigger] = c.tick(0.5)
    assert _kind(c, trigger) == FINAL
    assert c.master.stop_request is stop


def test_a_completed_stop_is_not_asked_again(tmp_path):
    stop = SavepointRequest(None, stop=True)
    stop.complete("chk-3")
    assert stop.status == COMPLETED
    c = _controller(tmp_path, stop_request=stop, stop_asked=True)
    assert c.tick(0.5) == []


def test_savepoint_requests_are_taken_in_tick_and_a_stop_ends_the_job(tmp_path):
    c = _controller(tmp_path)
    req = SavepointRequest("/tmp/sp")
    [trigger] = c.tick(1.0, [req])
    assert _kind(c, trigger) == SAVEPOINT and req.epoch == trigger.epoch
    stop = SavepointRequest("/tmp/sp", stop=True)
    c.tick(2.0, [stop])
    assert c.final_requested and c.stop_asked and c.stop_request is stop


def test_a_failed_state_write_forces_a_full_capture_first(tmp_path):
    c = _controller(tmp_path, interval=1.0, tolerable_failed=5)
    [trigger] = c.tick(1.0)
    assert _kind(c, trigger) == CHECKPOINT
    task = _source_tasks(c)[0]
    out = c.on_decline(Decline(task, trigger.epoch, "disk full", {}), 1.5)
    assert out[0] == CaptureFull(task)
    assert c.master.coordinator.epochs[trigger.epoch].state.value == "aborted"


def test_a_decline_beyond_the_tolerance_fails_the_attempt_over(tmp_path):
    c = _controller(tmp_path, interval=1.0, tolerable_failed=0)
    [trigger] = c.tick(1.0)
    with pytest.raises(Failover, match="disk full"):
        c.on_decline(Decline(_source_tasks(c)[0], trigger.epoch, "disk full", {}), 1.5)


def test_periodic_epochs_and_bound_latency(tmp_path):
    c = _controller(tmp_path, interval=1.0)
    assert c.next_deadline(0.0) == 1.0
    [trigger] = c.tick(1.0)
    c.bound(trigger.epoch, (0, 0), 1.25)
    c.bound(99, (0, 0), 2.0)  # never triggered: nothing to measure from
    assert c.bound_latency == [(trigger.epoch, (0, 0), 0.25)]
    assert _ack_all(c, trigger.epoch, 1.5) == []
    assert c.master.completed == [trigger.epoch]


def test_workers_must_be_ready_before_tick_and_stop_once_the_job_finished(tmp_path):
    c = _controller(tmp_path, workers=P)
    with pytest.raises(ProtocolError, match="tick"):
        c.tick(0.0)
    for w in range(P):
        c.on_ready(Ready(w), 0.0)
    assert c.running
    assert c.stop_workers() == []  # not finished
    [final] = c.savepoint(0.1, SavepointRequest(None, stop=True))
    assert _ack_all(c, final.epoch, 0.2) == []
    assert c.master.finished and not c.running and not c.done
    assert c.stop_workers() == [Stop()]
    assert c.stop_workers() == []  # once
    c.on_stopped(Stopped(0, 10, 3, 0), 0.3)
    assert not c.done
    c.on_stopped(Stopped(1, 5, 2, 4), 0.3)
    assert c.done and c.records_in == 15
    assert c.traffic.messages("marker") == 5 and c.traffic.messages("watermark") == 4
    assert c.traffic.total.messages == 9


def test_markers_count_as_service_traffic(tmp_path):
    c = _controller(tmp_path)
    c.count_sent("marker", (0, 0), 1)
    c.count_sent("watermark", (0, 0), None, 0)  # nothing sent: nothing counted
    assert c.traffic.messages("marker") == 1 and c.traffic.messages("watermark") == 0
    assert c.traffic.by_kind["marker"].bytes == MARKER_BYTES
