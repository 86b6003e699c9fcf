"""How the trAcker batches at fine granularity (paper 000 Fig. 13b; FlameStream's LocalAcker).

* pass-through (``TrackerConfig.pass_through``): a stateless chain processes a record of a later
  epoch at once, gives its output the record's epoch and sinks it into that epoch's writer; a
  chain with state still holds it until NEOSS (the firm bound);
* NEOSS coalescing (``SimConfig.coalesce_neoss``): notes to a worker join its bundle on the wire.

The promise-on-the-timer rule of the local tracker is tested in test_tracker.py; the exactly-once
oracle draws all three in tracker mode (tests/test_exactly_once.py, ``Chaos.tracker_batching``).
"""

from __future__ import annotations

import epochstream as es
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.assembly import build_tasks
from epochstream.deploy.sim import SimConfig, SimDriver
from epochstream.runtime.messages import Batch, Send, Snapshot
from epochstream.tracker.local import LocalTracker
from pipelines import committed_output


def _identity(r):
    return r


def _sum(a, b):
    return a + b


def _rr(tmp_path, pass_through: bool, n: int = 40, interval: float = 0.0002) -> es.Pipeline:
    """source -> map (stateless) -> map (stateless) -> FileSink, each hop rebalanced."""
    p = es.Pipeline("pt", parallelism=2, mode="tracker", batch_size=1,
                    checkpoint=es.CheckpointConfig(interval=interval, max_concurrent=1_000),
                    tracker=es.TrackerConfig(flush_interval=0.0002, pass_through=pass_through))
    s = p.from_collection(list(range(n)), uid="src")
    s.rebalance().map(_identity, name="m1").rebalance().map(_identity, name="m2").rebalance() \
        .sink(es.FileSink(tmp_path / "out"), uid="out")
    return p


def _tasks(tmp_path, pass_through: bool):
    p = _rr(tmp_path, pass_through)
    plan = p.plan()
    trackers = {w: LocalTracker(w) for w in range(plan.parallelism)}
    tasks = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk"), None, trackers=trackers)
    return plan, tasks, trackers


def _names(plan, tid) -> list[str]:
    return [plan.nodes[n].name for n in plan.chains[tid[0]].nodes]


def test_a_stateless_chain_passes_a_later_epoch_through_and_a_sink_holds_it(tmp_path):
    plan, tasks, trackers = _tasks(tmp_path, pass_through=True)
    m1 = next(t for tid, t in tasks.items() if "m1" in _names(plan, tid) and tid[1] == 0)
    sink = next(t for tid, t in tasks.items() if "out" in [plan.nodes[n].uid for n in plan.chains[tid[0]].nodes]
                and tid[1] == 0)
    assert m1.out_epoch == 1 and not m1.gate.firm
    assert sink.out_epoch == 1 and not sink.gate.firm
    # epoch 1 is still open at both (no NEOSS yet); a record of epoch 3 arrives
    m1.receive(m1.inputs[0], Batch(3, ["x"], None, id=12345))
    sends = [a for a in m1.step(0.0) if type(a) is Send]
    assert [(a.message.epoch, a.message.records) for a in sends] == [(3, ["x"])]
    assert m1.epoch == 1  # its own epochs still end on NEOSS only
    # the sink takes records of epochs 3 and 2, in that order, each into its epoch's writer
    sink.receive(sink.inputs[0], Batch(3, ["c"], None, id=678))
    sink.receive(sink.inputs[0], Batch(2, ["b"], None, id=679))
    sink.step(0.0, budget=1)
    sink.step(0.0, budget=1)
    assert not sink.held and sink.records_in == 2
    sink.on_neoss(2)  # epochs 1 and 2 end: their captures hold only their own records
    snaps = [a.capture for a in sink.step(0.0) if type(a) is Snapshot]
    assert [(c.epoch, [list(s.records) for s in c.sinks]) for c in snaps] == [(1, [[]]), (2, [['"b"']])]
    sink.on_neoss(3)
    (snap,) = [a.capture for a in sink.step(0.0) if type(a) is Snapshot]
    assert (snap.epoch, [list(s.records) for s in snap.sinks]) == (3, [['"c"']])


def test_a_stateful_chain_still_holds_a_later_epoch(tmp_path):
    p = es.Pipeline("pt-state", parallelism=1, mode="tracker", tracker=es.TrackerConfig(pass_through=True))
    p.from_collection(list(range(4)), uid="src").key_by(_identity).reduce(_sum, uid="sum") \
        .sink(es.FileSink(tmp_path / "out"), uid="out")
    plan = p.plan()
    tasks = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk"), None, trackers={0: LocalTracker(0)})
    (t,) = [t for t in tasks.values() if not t.is_source]
    assert t.out_epoch is None and t.gate.firm
    t.receive(t.inputs[0], Batch(3, [1], [1], id=12345))
    assert t.step(0.0) == [] and len(t.held) == 1


def test_without_pass_through_every_chain_holds_a_later_epoch(tmp_path):
    plan, tasks, _ = _tasks(tmp_path, pass_through=False)
    m1 = next(t for tid, t in tasks.items() if "m1" in _names(plan, tid) and tid[1] == 0)
    assert m1.out_epoch is None and m1.gate.firm
    m1.receive(m1.inputs[0], Batch(3, ["x"], None, id=12345))
    assert m1.step(0.0) == [] and len(m1.held) == 1


def _sim(tmp_path, name: str, pass_through: bool, coalesce: bool) -> tuple[SimDriver, list]:
    p = _rr(tmp_path / name, pass_through)
    d = SimDriver(p, LocalCheckpointStorage(tmp_path / name / "chk"), seed=3,
                  config=SimConfig(source_rate=5_000.0, source_batch=1, coalesce_neoss=coalesce))
    d.run(None, False, None)
    return d, committed_output(tmp_path / name / "out")


def test_pass_through_and_coalesced_neoss_commit_every_record_once(tmp_path):
    """Epochs of a record or two (interval 0.2 ms at 10K records/s): the same committed output
    with and without the batching, each record once, over many epochs."""
    plain, out_plain = _sim(tmp_path, "plain", False, False)
    batched, out_batched = _sim(tmp_path, "batched", True, True)
    assert sorted(out_plain) == sorted(out_batched) == list(range(40))
    assert batched.controller is not None and batched.controller.master.coordinator.last_completed >= 5


def test_coalesced_neoss_send_fewer_bundles(tmp_path, monkeypatch):
    """Every agent step with notes sends a bundle to every worker; coalesced, notes that find a
    bundle on the wire join it, so fewer bundles travel for the same epochs."""
    from epochstream.deploy import sim as sim_module

    counts = {}
    real = sim_module._SimAttempt._on_neoss

    def counting(self, payload):
        counts[self.cfg.coalesce_neoss] = counts.get(self.cfg.coalesce_neoss, 0) + 1
        real(self, payload)

    monkeypatch.setattr(sim_module._SimAttempt, "_on_neoss", counting)
    _sim(tmp_path, "a", True, False)
    _sim(tmp_path, "b", True, True)
    assert 0 < counts[True] < counts[False]


# ---------------------------------------------------------------- merged pass-through segments


def _merged_rr(tmp_path, merge: bool, stateful_middle: bool = False) -> es.Pipeline:
    """source -> m1 -> m2 [-> keyed reduce] -> sink, each hop repartitioned, pass-through on."""
    p = es.Pipeline("mg", parallelism=2, mode="tracker", batch_size=1,
                    checkpoint=es.CheckpointConfig(interval=0.0002, max_concurrent=1_000),
                    tracker=es.TrackerConfig(flush_interval=0.0002, pass_through=True, merge_pass_through=merge))
    s = p.from_collection(list(range(40)), uid="src")
    s = s.rebalance().map(_identity, name="m1").rebalance().map(_identity, name="m2")
    if stateful_middle:
        s = s.key_by(_identity).reduce(_sum, uid="sum")
    s.rebalance().sink(es.FileSink(tmp_path / "out"), uid="out")
    return p


def _segment_names(p: es.Pipeline) -> list[list[str]]:
    from epochstream.deploy.tracking import tracking_segments

    plan = p.plan()
    return [sorted(n for c in seg for n in _names(plan, (c, 0))) for seg in tracking_segments(plan, p).segments]


def test_neighbouring_pass_through_chains_share_one_segment(tmp_path):
    assert _segment_names(_merged_rr(tmp_path, True)) == [["collection"], ["m1", "m2", "sink"]]
    assert _segment_names(_merged_rr(tmp_path, False)) == [["collection"], ["m1"], ["m2"], ["sink"]]
    # a stateful chain (it waits for NEOSS) is a boundary: the chains on either side stay apart
    assert _segment_names(_merged_rr(tmp_path, True, stateful_middle=True)) == [
        ["collection"], ["m1", "m2"], ["reduce"], ["sink"]]


def test_a_merged_segment_is_not_bound_while_a_record_is_in_flight_inside_it():
    """src -> a -> b -> c (stateful), a and b merged. The record is RCVed by a, which SNDs its
    output to b: that hop folds into one report of the merged segment, and the segment (and c
    after it) must not be bound before b has RCVed it, even though the source promised."""
    from epochstream.tracker.agent import TrackingAgent
    from epochstream.tracker.segments import build_segments

    seg = build_segments(["src", "a", "b", "c"], [("src", "a"), ("a", "b"), ("b", "c")], merge={"a", "b"})
    assert seg.segments == (("src",), ("a", "b"), ("c",))
    S, C = seg.segment_of["a"], seg.segment_of["c"]
    agent = TrackingAgent(seg, {0: ["src"]})
    w0, w1 = LocalTracker(0, flush_interval=1.0), LocalTracker(1, flush_interval=1.0)
    # the source sends x (id 11) to a, then promises epoch 1
    w0.snd(11, 1, S)
    w0.promise(0, 1, 0.0, source="src")
    assert [n.segment for n in agent.receive(w0.flush(0.0)[0], 0.0)] == [0]  # the source's own segment
    # a (worker 1) processes x and sends y (id 22) to b: SND(y) then RCV(x), both under S
    w1.snd(22, 1, S)
    w1.rcv(11, 1, S)
    (m,) = w1.flush(0.0)
    assert len(m.reports) == 1  # the hop's two events are one report
    assert agent.receive(m, 0.0) == [] and agent.bound(S) == 0 and agent.bound(C) == 0
    # b (worker 0) processes y and sends z (id 33) to c: S is drained, c is not yet
    w0.snd(33, 1, C)
    w0.rcv(22, 1, S)
    notes = agent.receive(w0.flush(0.0)[0], 0.0)
    assert [(n.segment, n.epoch) for n in notes] == [(S, 1)] and agent.bound(C) == 0
    w1.rcv(33, 1, C)
    assert [(n.segment, n.epoch) for n in agent.receive(w1.flush(0.0)[0], 0.0)] == [(C, 1)]


def test_merged_segments_send_fewer_reports_and_commit_every_record_once(tmp_path):
    runs = {}
    for merge in (False, True):
        p = _merged_rr(tmp_path / str(merge), merge)
        d = SimDriver(p, LocalCheckpointStorage(tmp_path / str(merge) / "chk"), seed=3,
                      config=SimConfig(source_rate=5_000.0, source_batch=1))
        d.run(None, False, None)
        assert sorted(committed_output(tmp_path / str(merge) / "out")) == list(range(40))
        assert d.controller is not None and d.controller.master.coordinator.last_completed >= 5
        runs[merge] = d.record.traffic.by_kind["report"].entries
    assert runs[True] < runs[False]
