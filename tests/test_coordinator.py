"""The epoch-commit coordinator (snapshot/coordinator.py), driven event by event.

Times are multiples of 1/8 in the property tests so that float rounding never decides a
case; a separate test pins the float behaviour the simulator relies on.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from epochstream.runtime.errors import ProtocolError
from epochstream.snapshot.coordinator import (
    CHECKPOINT,
    FINAL,
    SAVEPOINT,
    AbortEpoch,
    CommitEpoch,
    CompleteEpoch,
    CoordinatorConfig,
    EpochCoordinator,
    EpochState,
    FailJob,
    JobFinished,
    TriggerEpoch,
)

TASKS = ("a", "b", "c")


def make(tasks=TASKS, now=0.0, last_completed=0, **cfg) -> EpochCoordinator:
    return EpochCoordinator(tasks, CoordinatorConfig(**cfg), last_completed=last_completed, now=now)


def ack_all(c: EpochCoordinator, epoch: int, now: float, tasks=TASKS) -> list:
    out: list = []
    for t in tasks:
        out += c.ack(t, epoch, {"task": t, "epoch": epoch}, now)
    return out


def types(actions) -> list[type]:
    return [type(a) for a in actions]


# ---------------------------------------------------------------- triggering


def test_periodic_trigger_respects_interval():
    c = make(interval=2.0, max_concurrent=5)
    assert c.poll(1.0) == []
    assert c.poll(1.875) == []
    assert c.poll(2.0) == [TriggerEpoch(1, CHECKPOINT)]
    assert c.poll(2.0) == []  # interval counts from the last trigger
    assert c.poll(3.875) == []
    assert c.poll(4.0) == [TriggerEpoch(2, CHECKPOINT)]
    assert c.pending() == [1, 2]


def test_interval_none_never_triggers_by_itself():
    c = make(interval=None)
    assert c.poll(1e6) == []
    assert c.next_deadline(1e6) is None


def test_max_concurrent_caps_pending_epochs():
    c = make(interval=1.0, max_concurrent=2)
    assert c.poll(1.0) == [TriggerEpoch(1, CHECKPOINT)]
    assert c.poll(2.0) == [TriggerEpoch(2, CHECKPOINT)]
    assert c.poll(3.0) == []  # two in flight
    assert c.poll(10.0) == []
    assert types(ack_all(c, 1, 10.0)) == [CompleteEpoch]
    assert c.poll(10.0) == []  # a PREPARED epoch still counts as in flight
    assert c.manifest_written(1, 10.0) == [CommitEpoch(1, CHECKPOINT)]
    assert c.poll(10.0) == [TriggerEpoch(3, CHECKPOINT)]


def test_min_pause_counts_from_last_completion():
    c = make(interval=1.0, min_pause=3.0)
    assert c.poll(2.0) == []  # min pause counts from the coordinator's start too (as in Flink)
    assert c.poll(3.0) == [TriggerEpoch(1, CHECKPOINT)]
    ack_all(c, 1, 4.0)
    assert c.manifest_written(1, 4.0) == [CommitEpoch(1, CHECKPOINT)]
    assert c.poll(5.0) == []  # interval passed, pause did not
    assert c.poll(6.875) == []
    assert c.next_deadline(6.875) == 7.0
    assert c.poll(7.0) == [TriggerEpoch(2, CHECKPOINT)]


def test_aborted_epoch_does_not_restart_min_pause():
    c = make(interval=1.0, min_pause=3.0, timeout=1.0, tolerable_failed=5)
    assert c.poll(3.0) == [TriggerEpoch(1, CHECKPOINT)]
    actions = c.poll(4.0)
    assert types(actions) == [AbortEpoch, TriggerEpoch]  # the pause counts from completions only
    assert actions[1] == TriggerEpoch(2, CHECKPOINT)


def test_request_triggers_now_regardless_of_interval():
    c = make(interval=100.0)
    assert c.request(0.5, SAVEPOINT) == [TriggerEpoch(1, SAVEPOINT)]
    assert c.request(0.625) == [TriggerEpoch(2, CHECKPOINT)]
    ack_all(c, 1, 1.0)
    ack_all(c, 2, 1.0)
    assert c.manifest_written(1, 1.0) == [CommitEpoch(1, SAVEPOINT), CompleteEpoch(2, CHECKPOINT, _acks(2))]


def test_epochs_after_restore_continue_numbering():
    c = make(interval=1.0, last_completed=7)
    assert c.poll(1.0) == [TriggerEpoch(8, CHECKPOINT)]
    assert c.ack("a", 7, None, 1.0) == []  # an epoch of the previous incarnation: ignored
    assert c.last_completed == 7


# ---------------------------------------------------------------- two-phase commit


def _acks(epoch, tasks=TASKS):
    return {t: {"task": t, "epoch": epoch} for t in tasks}


def test_epoch_completes_only_when_every_task_acked():
    c = make(interval=1.0)
    c.poll(1.0)
    assert c.ack("a", 1, {"task": "a", "epoch": 1}, 1.5) == []
    assert c.ack("b", 1, {"task": "b", "epoch": 1}, 1.5) == []
    assert c.epochs[1].state is EpochState.PENDING
    assert c.ack("c", 1, {"task": "c", "epoch": 1}, 1.75) == [CompleteEpoch(1, CHECKPOINT, _acks(1))]
    assert c.epochs[1].state is EpochState.PREPARED
    assert c.last_completed == 0  # not complete before the manifest is written
    assert c.manifest_written(1, 2.0) == [CommitEpoch(1, CHECKPOINT)]
    assert c.epochs[1].state is EpochState.COMPLETED
    assert c.last_completed == 1
    assert c.pending() == []


def test_complete_epoch_carries_a_copy_of_the_acks():
    c = make(interval=1.0)
    c.poll(1.0)
    (done,) = ack_all(c, 1, 1.0)
    done.acks.clear()
    assert c.epochs[1].acks == _acks(1)


def test_epochs_complete_in_order_when_a_later_epoch_is_acked_first():
    c = make(interval=1.0, max_concurrent=3)
    c.poll(1.0)
    c.poll(2.0)
    c.poll(3.0)
    assert ack_all(c, 3, 3.5) == []
    assert ack_all(c, 2, 3.5) == []  # epoch 1 still pending: 2 and 3 wait
    assert c.ack("a", 1, {"task": "a", "epoch": 1}, 4.0) == []
    assert c.ack("b", 1, {"task": "b", "epoch": 1}, 4.0) == []
    assert c.ack("c", 1, {"task": "c", "epoch": 1}, 4.0) == [CompleteEpoch(1, CHECKPOINT, _acks(1))]
    # one manifest at a time: 2 becomes PREPARED only once 1 is written
    assert c.epochs[2].state is EpochState.PENDING
    assert c.manifest_written(1, 5.0) == [CommitEpoch(1, CHECKPOINT), CompleteEpoch(2, CHECKPOINT, _acks(2))]
    assert c.manifest_written(2, 6.0) == [CommitEpoch(2, CHECKPOINT), CompleteEpoch(3, CHECKPOINT, _acks(3))]
    assert c.manifest_written(3, 7.0) == [CommitEpoch(3, CHECKPOINT)]
    assert c.last_completed == 3


def test_abort_of_older_epoch_releases_fully_acked_newer_epoch():
    c = make(interval=1.0, max_concurrent=2, timeout=10.0, tolerable_failed=1)
    c.poll(1.0)
    c.poll(2.0)
    ack_all(c, 2, 3.0)
    c.ack("a", 1, None, 3.0)
    actions = c.poll(11.0)
    assert isinstance(actions[0], AbortEpoch) and actions[0].epoch == 1
    assert actions[1] == CompleteEpoch(2, CHECKPOINT, _acks(2))
    assert c.manifest_written(2, 11.0)[0] == CommitEpoch(2, CHECKPOINT)
    assert c.last_completed == 2


def test_manifest_written_for_an_epoch_that_is_not_prepared_is_a_protocol_error():
    c = make(interval=1.0)
    c.poll(1.0)
    with pytest.raises(ProtocolError, match=r"manifest_written\(1\).*pending"):
        c.manifest_written(1, 1.0)
    with pytest.raises(ProtocolError, match=r"manifest_written\(9\).*unknown"):
        c.manifest_written(9, 1.0)
    ack_all(c, 1, 1.0)
    c.manifest_written(1, 1.0)
    with pytest.raises(ProtocolError, match="completed"):
        c.manifest_written(1, 1.0)


def test_manifest_failure_aborts_and_counts():
    c = make(interval=1.0, tolerable_failed=0)
    c.poll(1.0)
    ack_all(c, 1, 1.0)
    actions = c.manifest_failed(1, "disk full", 1.5)
    assert types(actions) == [AbortEpoch, FailJob]
    assert "disk full" in actions[0].reason


# ---------------------------------------------------------------- timeouts, declines, failures


def test_timeout_aborts_and_within_tolerance_the_job_goes_on():
    c = make(interval=1.0, timeout=5.0, tolerable_failed=1)
    assert c.poll(1.0) == [TriggerEpoch(1, CHECKPOINT)]
    c.ack("a", 1, None, 2.0)
    assert c.poll(5.875) == []
    assert c.next_deadline(5.875) == 6.0
    actions = c.poll(6.0)
    assert types(actions) == [AbortEpoch, TriggerEpoch]
    assert actions[0].epoch == 1 and "timed out" in actions[0].reason
    assert actions[1] == TriggerEpoch(2, CHECKPOINT)
    assert c.epochs[1].state is EpochState.ABORTED
    assert c.consecutive_failures == 1


def test_exceeding_tolerable_failed_fails_the_job():
    c = make(interval=1.0, timeout=5.0, tolerable_failed=1)
    c.poll(1.0)
    assert types(c.poll(6.0)) == [AbortEpoch, TriggerEpoch]
    actions = c.poll(11.0)
    assert types(actions) == [AbortEpoch, FailJob]
    assert "2 consecutive" in actions[1].reason and "tolerable: 1" in actions[1].reason
    assert c.failed
    assert c.poll(100.0) == []
    assert c.next_deadline(100.0) is None
    with pytest.raises(ProtocolError, match="failed"):
        c.request(100.0, SAVEPOINT)


def test_a_completed_epoch_resets_the_failure_count():
    c = make(interval=1.0, timeout=5.0, tolerable_failed=1)
    c.poll(1.0)
    c.poll(6.0)  # epoch 1 times out, epoch 2 triggered
    ack_all(c, 2, 7.0)
    c.manifest_written(2, 7.0)
    assert c.consecutive_failures == 0
    assert c.poll(8.0) == [TriggerEpoch(3, CHECKPOINT)]
    assert types(c.poll(13.0)) == [AbortEpoch, TriggerEpoch]  # one failure again: tolerated


def test_tolerable_zero_fails_on_first_timeout():
    c = make(interval=1.0, timeout=5.0, tolerable_failed=0)
    c.poll(1.0)
    assert types(c.poll(6.0)) == [AbortEpoch, FailJob]


def test_decline_aborts_and_late_acks_are_ignored():
    c = make(interval=1.0, tolerable_failed=3)
    c.poll(1.0)
    c.ack("a", 1, None, 1.0)
    actions = c.decline("b", 1, "disk full", 1.5)
    assert types(actions) == [AbortEpoch]
    assert actions[0].epoch == 1
    assert "b" in actions[0].reason and "disk full" in actions[0].reason
    assert c.epochs[1].state is EpochState.ABORTED
    # late acks of the aborted epoch change nothing
    assert c.ack("c", 1, None, 2.0) == []
    assert c.ack("b", 1, None, 2.0) == []
    assert c.epochs[1].state is EpochState.ABORTED
    assert c.decline("c", 1, "again", 2.0) == []  # a second decline is not a second failure
    assert c.consecutive_failures == 1
    assert c.poll(2.0) == [TriggerEpoch(2, CHECKPOINT)]


def test_decline_with_no_tolerance_fails_job():
    c = make(interval=1.0)
    c.poll(1.0)
    assert types(c.decline("a", 1, "boom", 1.0)) == [AbortEpoch, FailJob]


def test_fail_aborts_everything_in_flight_without_fail_job():
    c = make(interval=1.0, max_concurrent=3)
    c.poll(1.0)
    c.poll(2.0)
    actions = c.fail(2.5, "worker 1 died")
    assert types(actions) == [AbortEpoch, AbortEpoch]
    assert [a.epoch for a in actions] == [1, 2]
    assert all("worker 1 died" in a.reason for a in actions)
    assert c.poll(100.0) == []
    assert c.next_deadline(100.0) is None


# ---------------------------------------------------------------- protocol errors


def test_duplicate_ack_is_a_protocol_error_naming_event_and_state():
    c = make(interval=1.0)
    c.poll(1.0)
    c.ack("a", 1, None, 1.0)
    with pytest.raises(ProtocolError) as ei:
        c.ack("a", 1, None, 1.0)
    assert ei.value.event == "ack" and "pending" in ei.value.state
    msg = str(ei.value)
    assert "ack" in msg and "epoch 1 pending" in msg and "duplicate" in msg and "a" in msg
    # the illegal event changed nothing: the epoch still completes normally
    assert c.ack("b", 1, None, 1.0) == []
    assert types(c.ack("c", 1, None, 1.0)) == [CompleteEpoch]


def test_ack_from_unknown_task_is_a_protocol_error():
    c = make(interval=1.0)
    c.poll(1.0)
    with pytest.raises(ProtocolError, match=r"event ack is illegal in state running: unknown task zz"):
        c.ack("zz", 1, None, 1.0)
    with pytest.raises(ProtocolError, match="unknown task zz"):
        c.decline("zz", 1, "x", 1.0)
    assert c.epochs[1].acks == {}


def test_ack_for_never_triggered_epoch_is_a_protocol_error():
    c = make(interval=1.0)
    c.poll(1.0)
    with pytest.raises(ProtocolError, match=r"ack\(2\).*running.*never triggered"):
        c.ack("a", 2, None, 1.0)
    with pytest.raises(ProtocolError, match=r"decline\(5\).*never triggered"):
        c.decline("a", 5, "x", 1.0)
    assert 2 not in c.epochs and c.next_epoch == 2


def test_duplicate_ack_after_the_epoch_is_prepared_is_a_protocol_error():
    c = make(interval=1.0)
    c.poll(1.0)
    ack_all(c, 1, 1.0)
    with pytest.raises(ProtocolError):
        c.ack("a", 1, None, 1.5)


# ---------------------------------------------------------------- the final epoch


def test_final_epoch_finishes_the_job():
    c = make(interval=1.0)
    assert c.request(0.5, FINAL) == [TriggerEpoch(1, FINAL)]
    assert c.poll(10.0) == []  # no checkpoints after the final epoch was triggered
    assert ack_all(c, 1, 10.0) == [CompleteEpoch(1, FINAL, _acks(1))]
    assert c.manifest_written(1, 10.5) == [CommitEpoch(1, FINAL), JobFinished(1)]
    assert c.finished
    assert c.poll(11.0) == []
    assert c.next_deadline(11.0) is None
    with pytest.raises(ProtocolError, match="finished"):
        c.request(11.0, SAVEPOINT)


def test_final_epoch_waits_for_a_free_slot():
    c = make(interval=1.0, max_concurrent=1)
    c.poll(1.0)
    assert c.request(1.5, FINAL) == []  # epoch 1 in flight
    assert c.next_deadline(1.5) is None or c.next_deadline(1.5) > 1.5
    ack_all(c, 1, 2.0)
    assert c.manifest_written(1, 2.0) == [CommitEpoch(1, CHECKPOINT)]  # not the final one
    assert c.next_deadline(2.0) == 2.0
    assert c.poll(2.0) == [TriggerEpoch(2, FINAL)]


def test_aborted_final_epoch_is_triggered_again():
    c = make(interval=1.0, tolerable_failed=2, timeout=5.0)
    assert c.request(1.0, FINAL) == [TriggerEpoch(1, FINAL)]
    assert types(c.decline("b", 1, "io", 1.5)) == [AbortEpoch]
    assert not c.finished
    assert c.next_deadline(1.5) == 1.5
    assert c.poll(1.5) == [TriggerEpoch(2, FINAL)]
    # a timeout of the final epoch also retries it, in the same poll
    actions = c.poll(6.5)
    assert types(actions) == [AbortEpoch, TriggerEpoch]
    assert actions[1] == TriggerEpoch(3, FINAL)
    ack_all(c, 3, 7.0)
    assert c.manifest_written(3, 7.0) == [CommitEpoch(3, FINAL), JobFinished(3)]


def test_requesting_final_twice_triggers_one_final_epoch():
    c = make(interval=None, max_concurrent=3)
    assert c.request(1.0, FINAL) == [TriggerEpoch(1, FINAL)]
    assert c.request(1.0, FINAL) == []
    assert c.poll(2.0) == []


# ---------------------------------------------------------------- next_deadline vs poll


@st.composite
def configs(draw):
    return CoordinatorConfig(
        interval=draw(st.sampled_from([None, 0.5, 1.0, 2.25])),
        max_concurrent=draw(st.integers(1, 3)),
        min_pause=draw(st.sampled_from([0.0, 0.75, 3.0])),
        timeout=draw(st.sampled_from([1.5, 4.0, 40.0, 40.0])),
        tolerable_failed=draw(st.sampled_from([0, 1, 3, 100])),
    )


EVENTS = ["advance", "sleep", "poll", "ack", "ack", "ack", "ack", "ack", "ack", "decline", "manifest",
          "manifest", "manifest", "manifest_fail", "request"]


@settings(max_examples=150, deadline=None)
@given(configs(), st.data())
def test_next_deadline_is_consistent_with_poll(cfg, data):
    """A driver sleeping until next_deadline() and then polling neither spins nor oversleeps.

    Invariant after every event: poll(now) acts exactly when next_deadline(now) <= now
    (the "sleep" event jumps the clock to the deadline, as the simulator does). Also checks
    the 2PC bookkeeping: commits in increasing order, at most one PREPARED epoch,
    CompleteEpoch only with every task's ack.
    """
    tasks = ("a", "b")
    start = data.draw(st.integers(0, 16), label="start") / 8
    c = EpochCoordinator(tasks, cfg, now=start)
    now = start
    prepared: list[int] = []
    committed: list[int] = []

    def absorb(actions):
        for a in actions:
            if isinstance(a, CompleteEpoch):
                assert set(a.acks) == set(tasks)
                assert all(e < a.epoch for e in committed)
                prepared.append(a.epoch)
            elif isinstance(a, CommitEpoch):
                assert not committed or committed[-1] < a.epoch
                committed.append(a.epoch)
            elif isinstance(a, AbortEpoch):
                if a.epoch in prepared:
                    prepared.remove(a.epoch)

    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        if c.failed or c.finished:
            break
        ev = data.draw(st.sampled_from(EVENTS), label="event")
        ackable = [
            e for e in c.pending() if c.epochs[e].state is EpochState.PENDING and len(c.epochs[e].acks) < len(tasks)
        ]
        if ev == "advance":
            now += data.draw(st.integers(1, 16), label="dt") / 8
        elif ev == "sleep":
            deadline = c.next_deadline(now)
            if deadline is not None:
                now = max(now, deadline)
        elif ev == "poll":
            absorb(c.poll(now))
        elif ev == "ack" and ackable:
            e = data.draw(st.sampled_from(ackable), label="epoch")
            free = [t for t in tasks if t not in c.epochs[e].acks]
            absorb(c.ack(data.draw(st.sampled_from(free), label="task"), e, None, now))
        elif ev == "decline" and ackable:
            e = data.draw(st.sampled_from(ackable), label="epoch")
            absorb(c.decline(data.draw(st.sampled_from(tasks), label="task"), e, "declined", now))
        elif ev in ("manifest", "manifest_fail") and prepared:
            e = prepared.pop(0)
            absorb(c.manifest_written(e, now) if ev == "manifest" else c.manifest_failed(e, "io", now))
        elif ev == "request":
            kind = data.draw(st.sampled_from([CHECKPOINT, SAVEPOINT, FINAL]), label="kind")
            absorb(c.request(now, kind))
        if c.failed or c.finished:
            assert c.next_deadline(now) is None and c.poll(now) == []
            break
        assert sum(r.state is EpochState.PREPARED for r in c.epochs.values()) <= 1
        deadline = c.next_deadline(now)
        due = deadline is not None and deadline <= now
        actions = c.poll(now)
        absorb(actions)
        assert bool(actions) == due, (deadline, now, actions)
    event(f"committed {min(len(committed), 3)}+ epochs")
    event("failed" if c.failed else "finished" if c.finished else "running")


@pytest.mark.parametrize("what", ["interval", "timeout"])
def test_poll_at_next_deadline_acts_with_float_times(what):
    """Regression: with floats 0.3 + 0.6 == 0.8999999999999999 but 0.8999999999999999 - 0.3 < 0.6.

    If next_deadline adds where poll subtracts, poll(next_deadline()) does nothing and the
    simulator, which jumps its clock to the deadline and polls, spins forever.
    """
    if what == "interval":
        c = make(now=0.3, interval=0.6)
    else:
        c = make(now=0.3, interval=None, timeout=0.6)
        c.request(0.3)
    deadline = c.next_deadline(0.3)
    assert deadline is not None and deadline > 0.3
    assert c.poll(deadline) != []
