"""Barrier alignment (alignment/barrier.py) and the task that applies it (runtime/task.py).

The aligner is fed markers directly; tasks are built from a real pipeline and plan and
fed Batch / Marker messages by hand, one ``step`` at a time, like a driver would.
"""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import epochstream as es
from epochstream.alignment.barrier import BarrierAligner
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.assembly import build_tasks
from epochstream.graph.keygroups import assign_key_to_operator, assign_to_key_group
from epochstream.runtime.errors import ProtocolError
from epochstream.runtime.messages import Batch, Marker, Send, Snapshot, SourceExhausted

# ---------------------------------------------------------------- BarrierAligner


def test_channels_block_as_markers_arrive_and_unblock_when_aligned():
    a = BarrierAligner([0, 1, 2])
    assert a.on_marker(1, 1, now=10.0) is None
    assert a.is_blocked(1) and not a.is_blocked(0) and not a.is_blocked(2)
    assert a.on_marker(0, 1, now=10.5) is None
    assert a.is_blocked(0) and a.is_blocked(1) and not a.is_blocked(2)
    assert a.on_marker(2, 1, now=12.25) == (1, 2.25)  # alignment time: first to last marker
    assert not any(a.is_blocked(c) for c in (0, 1, 2))
    assert a.last_aligned == 1
    # the next epoch aligns the same way, timed from its own first marker
    assert a.on_marker(2, 2, now=20.0) is None
    assert a.on_marker(0, 2, now=20.0) is None
    assert a.on_marker(1, 2, now=21.0) == (2, 1.0)


def test_single_channel_aligns_immediately_and_never_stays_blocked():
    a = BarrierAligner([7])
    assert a.on_marker(7, 1, now=3.0) == (1, 0.0)
    assert not a.is_blocked(7)


def test_at_least_once_never_blocks():
    a = BarrierAligner([0, 1], exactly_once=False)
    assert a.on_marker(0, 1, now=1.0) is None
    assert not a.is_blocked(0)
    # channel 0 may even deliver the next epoch's marker before channel 1 delivers this one
    assert a.on_marker(0, 2, now=1.5) is None
    assert not a.is_blocked(0)
    assert a.on_marker(1, 1, now=2.0) == (1, 1.0)
    assert a.on_marker(1, 2, now=4.0) == (2, 2.5)
    assert not a.is_blocked(0) and not a.is_blocked(1)


def test_reset_restarts_from_the_restored_epoch():
    a = BarrierAligner([0, 1])
    a.on_marker(0, 1, now=0.0)
    a.reset(last_completed=5)
    assert not a.is_blocked(0)
    with pytest.raises(ProtocolError, match="stale"):
        a.on_marker(0, 5, now=1.0)
    assert a.on_marker(0, 6, now=1.0) is None
    assert a.on_marker(1, 6, now=2.0) == (6, 1.0)


def _snapshot(a: BarrierAligner):
    return ({e: set(s) for e, s in a.arrived.items()}, set(a.blocked), dict(a.started), a.last_aligned)


@pytest.mark.parametrize("exactly_once", [True, False])
def test_illegal_markers_raise_and_leave_the_aligner_unchanged(exactly_once):
    a = BarrierAligner([0, 1, 2], exactly_once=exactly_once)
    a.on_marker(0, 1, 0.0)
    a.on_marker(1, 1, 0.0)
    a.on_marker(2, 1, 0.0)  # aligned 1
    a.on_marker(0, 2, 1.0)  # aligning 2 on channel 0
    before = _snapshot(a)
    cases = [
        ((9, 2), "unknown channel 9"),  # unknown channel
        ((1, 1), "stale marker on channel 1"),  # already aligned epoch
        ((1, 0), "stale"),
        ((0, 2), "channel 0" if exactly_once else "duplicate on 0"),  # duplicate
    ]
    for (channel, epoch), fragment in cases:
        with pytest.raises(ProtocolError) as ei:
            a.on_marker(channel, epoch, 2.0)
        msg = str(ei.value)
        assert f"Marker({epoch})" in msg and "BarrierAligner" in msg and fragment in msg, msg
        assert _snapshot(a) == before
    assert a.on_marker(1, 2, 3.0) is None
    assert a.on_marker(2, 2, 4.0) == (2, 3.0)


def test_exactly_once_rejects_a_marker_of_another_epoch_while_aligning():
    a = BarrierAligner([0, 1])
    a.on_marker(0, 1, 0.0)
    with pytest.raises(ProtocolError, match=r"Marker\(2\) is illegal in state aligning epoch 1: on channel 1"):
        a.on_marker(1, 2, 0.0)


def test_exactly_once_rejects_a_skipped_epoch_at_its_first_marker():
    a = BarrierAligner([0, 1])
    with pytest.raises(ProtocolError, match="epoch skipped"):
        a.on_marker(0, 2, 0.0)
    assert a.on_marker(0, 1, 0.0) is None  # the aligner is still usable for the right epoch


def test_skipped_epoch_marker_is_rejected_without_changing_the_aligner():
    a = BarrierAligner([0])
    with pytest.raises(ProtocolError, match="skipped"):
        a.on_marker(0, 3, 0.0)
    assert not a.is_blocked(0) and a.arrived == {} and a.last_aligned == 0


@given(st.permutations(range(5)), st.lists(st.integers(0, 100), min_size=5, max_size=5))
def test_alignment_duration_is_last_minus_first_marker(order, times):
    times = sorted(times)
    a = BarrierAligner(range(5))
    results = [a.on_marker(ch, 1, float(t)) for ch, t in zip(order, times, strict=True)]
    assert results[:-1] == [None] * 4
    assert results[-1] == (1, float(times[-1] - times[0]))
    assert not a.blocked


# ---------------------------------------------------------------- tasks built from a pipeline


class CountPerKey(es.KeyedProcessFunction):
    """Per key: a count (ValueState) and the values seen (ListState); emits (key, value, count)."""

    def open(self, ctx):
        self.count = ctx.state(es.ValueStateDescriptor("count", default=0))
        self.seen = ctx.get_list_state(es.ListStateDescriptor("seen"))

    def process(self, value, ctx):
        n = self.count.value() + 1
        self.count.update(n)
        self.seen.add(value[1])
        return [(ctx.key, value[1], n)]


def build(tmp_path, parallelism=1, mode="aligned"):
    """Two sources union'd -> key_by -> CountPerKey -> (sink, rebalance -> map).

    Chains: 0 = source a, 1 = source b, 2 = CountPerKey -> sink, 3 = map.
    """
    p = es.Pipeline("align-test", parallelism=parallelism, mode=mode)
    a = p.from_collection([("a", i) for i in range(20)], uid="src-a")
    b = p.from_collection([("b", i) for i in range(20)], uid="src-b")
    counted = a.union(b).key_by(lambda r: r[0]).process(CountPerKey(), uid="count")
    counted.sink(es.FileSink(tmp_path / "out"), uid="out")
    counted.rebalance().map(lambda r: r, name="after")
    plan = p.plan()
    tasks = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk"), None)
    return p, plan, tasks


def kbatch(epoch, records):
    """A batch as a hash-partitioned channel carries it: records and their keys."""
    return Batch(epoch, list(records), [r[0] for r in records])


def decode(keyed_capture):
    state: dict[str, dict] = {}
    for _kg, kb, name, vb in keyed_capture.rows:
        state.setdefault(name, {})[pickle.loads(kb)] = None if vb is None else pickle.loads(vb)
    return state


def sent(actions):
    return [(a.channel, a.message) for a in actions if isinstance(a, Send)]


def emitted(actions):
    """Records sent in batches, in order."""
    return [r for a in actions if isinstance(a, Send) and isinstance(a.message, Batch) for r in a.message.records]


def test_plan_wiring_the_tests_rely_on(tmp_path):
    _p, plan, tasks = build(tmp_path)
    proc = tasks[(2, 0)]
    assert [plan.channels[c].src for c in plan.inputs[(2, 0)]] == [(0, 0), (1, 0)]
    assert proc.out_channels == [2] and plan.channels[2].dst == (3, 0)
    assert not proc.is_source and tasks[(0, 0)].is_source


def test_blocked_channel_is_held_until_alignment_then_replayed_in_arrival_order(tmp_path):
    _p, plan, tasks = build(tmp_path)
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    for ch, msg in [
        (c_a, kbatch(1, [("k", 1)])),
        (c_a, Marker(1)),
        (c_a, kbatch(2, [("k", 2)])),  # after the marker: epoch 2, must wait
        (c_b, kbatch(1, [("j", 10)])),
        (c_a, kbatch(2, [("k", 3)])),  # epoch 2 again, still blocked
        (c_b, Marker(1)),  # aligns epoch 1
        (c_b, kbatch(2, [("j", 11)])),
    ]:
        t.receive(ch, msg)

    # step 1: the first record
    acts1 = t.step(1.0, budget=1)
    assert emitted(acts1) == [("k", 1, 1)]
    # step 2: marker on a blocks it; ("k", 2) is set aside and ("j", 10) goes first
    acts2 = t.step(2.0, budget=1)
    assert emitted(acts2) == [("j", 10, 1)]
    assert t.gate.is_blocked(c_a) and not t.gate.is_blocked(c_b)
    assert [m.records for _c, m in t.held] == [[("k", 2)]]
    t.check_invariants()
    # step 3: ("k", 3) is held too, the marker on b aligns the epoch
    acts3 = t.step(3.0, budget=1)
    assert emitted(acts3) == []
    snaps = [a for a in acts3 if isinstance(a, Snapshot)]
    assert len(snaps) == 1
    cap = snaps[0].capture
    assert cap.epoch == 1 and cap.task == (2, 0)
    assert cap.alignment_seconds == 1.0  # first marker at t=2, last at t=3
    assert cap.held_records == 2
    assert not t.gate.is_blocked(c_a) and t.held == []
    t.check_invariants()
    # a message arriving now queues behind the held ones
    t.receive(c_a, kbatch(2, [("k", 4)]))
    rest = []
    while t.has_input():
        rest += t.step(4.0, budget=1)
        t.check_invariants()
    assert emitted(rest) == [("k", 2, 2), ("k", 3, 3), ("j", 11, 2), ("k", 4, 4)]
    assert all(m.epoch == 2 for _c, m in sent(rest))
    assert t.records_in == 6


def test_snapshot_holds_exactly_the_records_before_the_markers(tmp_path):
    _p, plan, tasks = build(tmp_path)
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", 1), ("k", 2)]))
    t.receive(c_b, kbatch(1, [("j", 1)]))
    t.receive(c_b, Marker(1))
    t.receive(c_b, kbatch(2, [("j", 2), ("k", 100)]))  # after b's marker: not in epoch 1
    t.receive(c_a, kbatch(1, [("k", 3)]))
    t.receive(c_a, Marker(1))
    actions = []
    while t.has_input():
        actions += t.step(1.0, budget=1000)
    (snap,) = [a.capture for a in actions if isinstance(a, Snapshot)]
    (keyed,) = snap.keyed
    assert keyed.operator_uid == "count" and keyed.full
    assert decode(keyed) == {"count": {"k": 3, "j": 1}, "seen": {"k": [1, 2, 3], "j": [1]}}
    assert keyed.key_group_range == plan.key_group_range(0)
    assert all(kg == assign_to_key_group(pickle.loads(kb), plan.max_parallelism) for kg, kb, _n, _v in keyed.rows)
    # the sink's epoch-1 output is exactly the outputs of those records
    (sink,) = snap.sinks
    assert sink.sink_uid == "out" and sink.epoch == 1
    # FileSink's writer hands over encoded JSON lines
    assert sorted(tuple(json.loads(line)) for line in sink.records) == [
        ("j", 1, 1), ("k", 1, 1), ("k", 2, 2), ("k", 3, 3)]
    # and the live state went on with epoch 2
    live = t.chain.states["count"].as_dict()
    assert live["count"] == {"k": 4, "j": 2}


def test_second_epoch_capture_is_incremental_and_holds_only_changed_keys(tmp_path):
    _p, plan, tasks = build(tmp_path)
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    for ch, msg in [
        (c_a, kbatch(1, [("k", 1)])), (c_b, kbatch(1, [("j", 1)])), (c_a, Marker(1)), (c_b, Marker(1)),
        (c_a, kbatch(2, [("k", 2)])), (c_a, Marker(2)), (c_b, Marker(2)),
    ]:
        t.receive(ch, msg)
    actions = []
    while t.has_input():
        actions += t.step(1.0)
    caps = [a.capture for a in actions if isinstance(a, Snapshot)]
    assert [c.epoch for c in caps] == [1, 2]
    second = caps[1].keyed[0]
    assert not second.full and second.chain == (1, 2)
    assert decode(second) == {"count": {"k": 2}, "seen": {"k": [1, 2]}}
    assert [tuple(json.loads(line)) for line in caps[1].sinks[0].records] == [("k", 2, 2)]


def test_marker_is_forwarded_after_the_snapshot_on_every_output_channel(tmp_path):
    _p, plan, tasks = build(tmp_path, parallelism=2)
    t = tasks[(2, 0)]
    ins = plan.inputs[(2, 0)]
    outs = t.out_channels
    assert len(ins) == 4 and len(outs) == 2
    m = plan.max_parallelism
    mine = [k for k in (f"key{i}" for i in range(50)) if assign_key_to_operator(k, m, 2) == 0][:4]
    actions = []
    for i, ch in enumerate(ins):
        t.receive(ch, kbatch(1, [(mine[i], i), (mine[(i + 1) % 4], 10 + i)]))
        t.receive(ch, Marker(1))
        t.receive(ch, kbatch(2, [(mine[i], 100 + i)]))
        actions += t.step(float(i), budget=1)
    while t.has_input():
        actions += t.step(9.0, budget=1)
    snap_at = [i for i, a in enumerate(actions) if isinstance(a, Snapshot)]
    assert len(snap_at) == 1
    for ch in outs:
        on_ch = [(i, a.message) for i, a in enumerate(actions) if isinstance(a, Send) and a.channel == ch]
        markers = [i for i, msg in on_ch if msg == Marker(1)]
        assert len(markers) == 1, f"channel {ch}: one marker"
        assert markers[0] > snap_at[0], "marker only after the snapshot is taken"
        for i, msg in on_ch:
            if isinstance(msg, Batch):
                assert msg.epoch == (1 if i < markers[0] else 2), (ch, i, msg)
    out_records = emitted(actions)
    assert len(out_records) == 12  # 8 of epoch 1, 4 of epoch 2: nothing lost or doubled
    assert sorted(r[1] for r in out_records) == sorted(list(range(4)) + list(range(10, 14)) + list(range(100, 104)))


def test_exactly_once_task_rejects_a_batch_of_the_wrong_epoch(tmp_path):
    _p, plan, tasks = build(tmp_path)
    t = tasks[(2, 0)]
    c_a, _c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(2, [("k", 1)]))  # epoch 2 without marker 1 before it
    with pytest.raises(ProtocolError, match=r"Batch\(epoch=2\).*epoch 1") as ei:
        t.step(0.0)
    assert f"channel {c_a}" in str(ei.value)


def test_at_least_once_task_processes_records_behind_a_marker_before_alignment(tmp_path):
    _p, plan, tasks = build(tmp_path, mode="at-least-once")
    t = tasks[(2, 0)]
    c_a, c_b = plan.inputs[(2, 0)]
    t.receive(c_a, kbatch(1, [("k", 1)]))
    t.receive(c_a, Marker(1))
    t.receive(c_a, kbatch(2, [("k", 2)]))
    t.receive(c_b, Marker(1))
    actions = []
    while t.has_input():
        actions += t.step(0.0, budget=1)
        assert t.held == []
    (snap,) = [a.capture for a in actions if isinstance(a, Snapshot)]
    # not epoch-complete by design: the record after a's marker is already in the snapshot
    assert decode(snap.keyed[0])["count"] == {"k": 2}
    assert snap.held_records == 0


def test_source_task_emits_offsets_and_marker_at_the_trigger(tmp_path):
    _p, plan, tasks = build(tmp_path)
    src = tasks[(0, 0)]
    out_ch = src.out_channels
    assert out_ch == plan.outputs[(0, 0)][0]
    first = src.step(0.0, budget=3)
    assert [m.epoch for _c, m in sent(first)] == [1]
    assert emitted(first) == [("a", 0), ("a", 1), ("a", 2)]
    (batch,) = [m for _c, m in sent(first)]
    assert batch.keys == ["a", "a", "a"]  # hash channel carries the keys
    src.trigger(1)
    second = src.step(0.0, budget=3)
    kinds = [type(a).__name__ if not isinstance(a, Send) else type(a.message).__name__ for a in second]
    assert kinds == ["Snapshot", "Marker", "Batch"]
    snap = second[0].capture
    assert snap.epoch == 1 and snap.offsets == {"src-a": {0: 3}}
    assert second[2].message.epoch == 2 and second[2].message.records == [("a", 3), ("a", 4), ("a", 5)]
    # the source finishes and says so exactly once
    rest = []
    while src.source_has_more():
        rest += src.step(0.0, budget=100)
    rest += src.step(0.0)
    assert sum(isinstance(a, SourceExhausted) for a in rest) == 1
    assert len(emitted(rest)) == 14


def test_hash_channels_route_each_key_to_the_subtask_owning_its_key_group(tmp_path):
    _p, plan, tasks = build(tmp_path, parallelism=2)
    # the collection has one key only: push many keys through the source chain's router
    src = tasks[(0, 0)]
    push = src.chain.entry[plan.chains[0].heads[0]]
    recs = [(f"user{i}", i) for i in range(200)]
    push(recs, None)
    m = plan.max_parallelism
    seen = 0
    for ch, msg in src.chain.out.drain(1):
        dst_subtask = plan.channels[ch].dst[1]
        assert msg.keys == [r[0] for r in msg.records]
        for key in msg.keys:
            assert assign_key_to_operator(key, m, 2) == dst_subtask
            lo, hi = plan.key_group_range(dst_subtask)
            assert lo <= assign_to_key_group(key, m) <= hi
        seen += len(msg.records)
    assert seen == 200
