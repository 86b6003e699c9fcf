"""Loop-head logging (Algorithm 7): the state machine alone, then a head task wired by hand,
then restores from real checkpoints: what the heads put back into the loop is exactly what
they logged."""

from __future__ import annotations

import collections
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cycle_pipelines import CYCLE_BUILDERS, rounds
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.assembly import build_tasks
from epochstream.deploy.restore import Restored
from epochstream.deploy.sim import FailureSchedule
from epochstream.loops.head import LoopHead
from epochstream.loops.task import LOG_STATE, LoopHeadTask
from epochstream.oracle import loop_logs
from epochstream.runtime.errors import ProtocolError
from epochstream.runtime.messages import Batch, Marker, Send, Snapshot
from pipelines import sim_run, without_fsync


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


# ---------------------------------------------------------------- the state machine


def test_records_are_logged_only_between_trigger_and_returning_marker():
    h = LoopHead()
    h.on_records(["before"])
    h.on_trigger(1)
    h.on_records(["a", "b"])
    assert h.on_marker(1) == ["a", "b"]
    h.on_records(["after"])
    assert h.log == [] and not h.recording
    h.check_invariants()


def test_concurrent_epochs_share_records_in_transit_for_both_cuts():
    h = LoopHead()
    h.on_trigger(1)
    h.on_records(["x"])
    h.on_trigger(2)
    h.on_records(["y"])  # sent before marker 1 came back, forwarded after both cuts
    assert h.on_marker(1) == ["x", "y"]
    h.check_invariants()
    h.on_records(["z"])
    assert h.on_marker(2) == ["y", "z"]
    h.check_invariants()


@pytest.mark.parametrize("bad", ["marker_never_sent", "out_of_order", "stale_trigger"])
def test_illegal_events_raise_and_change_nothing(bad):
    h = LoopHead(last_triggered=4)
    if bad == "marker_never_sent":
        with pytest.raises(ProtocolError, match="never sent"):
            h.on_marker(5)
    elif bad == "out_of_order":
        h.on_trigger(5)
        h.on_trigger(6)
        h.on_records([1])
        with pytest.raises(ProtocolError, match="expected 5"):
            h.on_marker(6)
        assert list(h.open) == [5, 6] and h.log == [1]
    else:
        with pytest.raises(ProtocolError, match="triggers must increase"):
            h.on_trigger(4)
    h.check_invariants()


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.sampled_from(["trigger", "records", "marker"]), max_size=60))
def test_each_log_is_what_arrived_while_its_epoch_was_open(events):
    """Against a direct model: the log of n is every record that arrived after trigger n and
    before marker n, whatever the overlap of concurrent epochs."""
    h = LoopHead()
    arrivals: list[tuple[int, int]] = []  # (time, record)
    opened: dict[int, int] = {}
    t = 0
    for ev in events:
        t += 1
        if ev == "trigger":
            h.on_trigger(h.last_triggered + 1)
            opened[h.last_triggered] = t
        elif ev == "records":
            h.on_records([t])
            arrivals.append((t, t))
        elif h.open:
            epoch = next(iter(h.open))
            want = [r for at, r in arrivals if at > opened[epoch]]
            assert h.on_marker(epoch) == want
        h.check_invariants()


# ---------------------------------------------------------------- a head task wired by hand


def _tasks(p, restored=None, storage=None):
    plan = p.plan()
    return plan, build_tasks(p, plan, None, storage, restored)


def test_head_task_sends_the_marker_logs_and_snapshots_when_it_returns(tmp_path):
    p = rounds(parallelism=1, out=tmp_path / "out")
    plan, tasks = _tasks(p)
    head = next(t for t in tasks.values() if isinstance(t, LoopHeadTask))
    (phantom,) = plan.inputs[head.id]
    assert head.takes_triggers and plan.channels[phantom].phantom
    head.receive(phantom, Batch(1, [(1, 4, 1)]))
    head.trigger(1)
    acts = head.step(0.0)
    # the trigger comes first: the marker leads, the record (already in the mailbox) follows in epoch 2
    kinds = [(type(a.message).__name__, a.message.epoch) for a in acts if type(a) is Send]
    assert kinds == [("Marker", 1), ("Batch", 2)]
    head.receive(phantom, Batch(1, [(2, 8, 1), (3, 5, 2)]))
    head.receive(phantom, Marker(1))
    head.receive(phantom, Batch(2, [(4, 2, 3)]))  # after the marker: not in epoch 1's log
    acts = head.step(0.1)
    (snap,) = [a for a in acts if type(a) is Snapshot]
    cap = snap.capture
    assert cap.epoch == 1 and cap.loop_log_records == 3 and cap.loop_log_bytes > 0
    (kc,) = cap.keyed
    assert kc.operator_uid == "loop/loop-head"
    logged = [r for _kg, _k, name, v in kc.rows if name == LOG_STATE and v for r in pickle.loads(v)]
    assert logged == [(1, 4, 1), (2, 8, 1), (3, 5, 2)]
    assert [a.message.records for a in acts if type(a) is Send] == [[(2, 8, 1), (3, 5, 2), (4, 2, 3)]]
    head.check_invariants()
    # an empty log next time: a tombstone, then nothing at all (incremental)
    head.trigger(2)
    head.receive(phantom, Marker(2))
    (snap,) = [a for a in head.step(0.2) if type(a) is Snapshot]
    assert snap.capture.loop_log_records == 0 and [r[3] for r in snap.capture.keyed[0].rows] == [None]
    head.trigger(3)
    head.receive(phantom, Marker(3))
    (snap,) = [a for a in head.step(0.3) if type(a) is Snapshot]
    assert snap.capture.keyed[0].rows == []


def test_tracker_mode_head_is_an_ordinary_task(tmp_path):
    p = rounds(parallelism=1, mode="tracker", out=tmp_path / "out")
    plan = p.plan()
    from epochstream.deploy.tracking import new_local_tracker

    tasks = build_tasks(p, plan, None, None, None, trackers={0: new_local_tracker(p, 0, 0.0)})
    head = next(t for t in tasks.values() if isinstance(t, LoopHeadTask))
    assert not head.takes_triggers
    (phantom,) = plan.inputs[head.id]
    head.receive(phantom, Batch(1, [(1, 4, 1)], id=77))
    acts = head.step(0.0)
    assert [type(a.message) for a in acts if type(a) is Send] == [Batch] and head.head.log == []


# ---------------------------------------------------------------- restores from real checkpoints


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(builder=st.sampled_from(sorted(CYCLE_BUILDERS)), seed=st.integers(0, 2**16), parallelism=st.integers(1, 3),
       kill=st.floats(0.1, 0.9), max_concurrent=st.integers(1, 2))
def test_after_restore_the_loop_holds_exactly_the_logged_records(tmp_path_factory, builder, seed, parallelism, kill,
                                                                 max_concurrent):
    """For every retained checkpoint of a run with a kill: restoring it makes the loop heads
    emit, before anything else, exactly the multiset of records they logged in transit."""
    work = tmp_path_factory.mktemp("restore")
    p = CYCLE_BUILDERS[builder](parallelism=parallelism, max_concurrent=max_concurrent, out=work / "out",
                                interval=0.0003)
    p.checkpoint.num_retained = 1000
    sim_run(p, work / "chk", seed=seed, failures=FailureSchedule(kill_times=[kill * 0.01]))
    storage = LocalCheckpointStorage(work / "chk")
    plan = p.plan()
    for epoch in storage.list_checkpoints():
        manifest, root = storage.load_manifest(epoch)
        restored = Restored(epoch, manifest, root, root / f"chk-{epoch}")
        want = collections.Counter(r for recs in loop_logs(storage, manifest, restored.root, plan.loops).values()
                                   for r in recs)
        tasks = build_tasks(p, plan, None, storage, restored)
        got: collections.Counter = collections.Counter()
        for t in tasks.values():
            if isinstance(t, LoopHeadTask):
                assert t.replayed == sum(1 for _ in t.replay)
                for a in t.step(0.0):
                    assert type(a) is Send and type(a.message) is Batch and a.message.epoch == epoch + 1
                    got.update(a.message.records)
                assert not t.replay and not t.chain.states[t.uid].as_dict()  # replayed once, then cleared
        assert got == want, f"epoch {epoch}"
