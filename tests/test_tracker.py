"""trAcker core (tracker/): segments, local tracker, tracking agent, firm-bound gate.

Unit tests feed each machine events by hand. The property tests wire LocalTrackers, a
TrackingAgent and FirmBoundGates into an in-memory dataflow (``Dataflow`` below): a small
random graph with fan-out, fan-in and one cycle, processes spread over workers, FIFO
channels, random 64-bit batch ids from a seeded ``random.Random``, and one random event
at a time (emit, promise, deliver, process, poll a tracker, deliver a report to the
agent, deliver a NEOSS), so report delays, flush timing and interleavings are all random.
The harness keeps the ground truth (every batch: epoch, destination, when sent, when
processed) and checks the agent and the gates against it.
"""

from __future__ import annotations

import copy
import doctest
import random
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochstream.runtime.errors import ProtocolError
from epochstream.tracker import (
    NEOSS,
    BatchIds,
    FirmBoundGate,
    LocalTracker,
    Promise,
    Report,
    SegmentError,
    ServiceTraffic,
    TrackerMessage,
    TrackingAgent,
    build_segments,
    chain_graph,
    strongly_connected_components,
)
from epochstream.tracker import agent as agent_module
from epochstream.tracker import gate as gate_module
from epochstream.tracker import local as local_module
from epochstream.tracker import segments as segments_module
from epochstream.tracker.messages import HEADER_WIRE, NEOSS_WIRE, PROMISE_WIRE, REPORT_WIRE

# ================================================================ segments


def test_segments_of_a_pipeline_with_a_cycle():
    s = build_segments(
        ["src", "a", "b", "c", "sink"],
        [("src", "a"), ("a", "b"), ("b", "c"), ("c", "a"), ("c", "sink"), ("src", "sink")],
    )
    assert s.segments == (("src",), ("a", "b", "c"), ("sink",))
    assert s.segment_of == {"src": 0, "a": 1, "b": 1, "c": 1, "sink": 2}
    assert s.upstream == (frozenset(), frozenset({0}), frozenset({0, 1}))
    assert s.downstream == (frozenset({1, 2}), frozenset({2}), frozenset())
    assert s.cyclic == (False, True, False)
    assert s.roots == (0,)


def test_self_loop_is_a_cyclic_segment_of_one():
    s = build_segments([1, 2], [(1, 2), (2, 2)])
    assert s.segments == ((1,), (2,))
    assert s.cyclic == (False, True)
    assert s.upstream == (frozenset(), frozenset({0}))


def test_order_is_deterministic_and_follows_the_vertex_list():
    s = build_segments(["x", "y", "z"], [])
    assert s.segments == (("x",), ("y",), ("z",))
    s = build_segments(["z", "y", "x"], [("x", "y")])
    assert s.segments == (("z",), ("x",), ("y",))


def test_bad_graphs_name_the_vertex():
    with pytest.raises(SegmentError, match="'q'"):
        build_segments(["a"], [("a", "q")])
    with pytest.raises(SegmentError, match="listed twice"):
        build_segments(["a", "a"], [])


def test_deep_graphs_need_no_recursion():
    n = 100_000
    path = build_segments(range(n), [(i, i + 1) for i in range(n - 1)])
    assert len(path) == n and path.segment_of[n - 1] == n - 1
    ring = build_segments(range(n), [(i, (i + 1) % n) for i in range(n)])
    assert len(ring) == 1 and ring.cyclic == (True,)


def _reachable(vertices, edges):
    succ = {v: set() for v in vertices}
    for a, b in edges:
        succ[a].add(b)
    reach = {}
    for v in vertices:
        seen, todo = {v}, [v]
        while todo:
            for w in succ[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        reach[v] = seen
    return reach


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 12))
    vertices = draw(st.permutations(list(range(n))))
    edges = draw(st.lists(st.tuples(st.sampled_from(vertices), st.sampled_from(vertices)), max_size=3 * n))
    return list(vertices), edges


@settings(max_examples=300, deadline=None)
@given(graphs())
def test_segments_are_the_sccs_in_topological_order(graph):
    vertices, edges = graph
    s = build_segments(vertices, edges)
    reach = _reachable(vertices, edges)
    # a partition of the vertices
    assert sorted(v for seg in s.segments for v in seg) == sorted(vertices)
    # every edge goes from an earlier or the same segment
    for a, b in edges:
        assert s.segment_of[a] <= s.segment_of[b]
    # same segment <=> mutually reachable (an SCC)
    for a in vertices:
        for b in vertices:
            assert (s.segment_of[a] == s.segment_of[b]) == (b in reach[a] and a in reach[b])
    # upstream = segments with an edge into the segment, never itself
    expected = [set() for _ in s.segments]
    for a, b in edges:
        if s.segment_of[a] != s.segment_of[b]:
            expected[s.segment_of[b]].add(s.segment_of[a])
    assert [set(u) for u in s.upstream] == expected
    # cyclic = more than one member, or a self-loop
    for i, members in enumerate(s.segments):
        assert s.cyclic[i] == (len(members) > 1 or any(a == b and a in members for a, b in edges))
    # Tarjan's own output is reverse topological
    comps = strongly_connected_components(vertices, edges)
    pos = {v: i for i, c in enumerate(comps) for v in c}
    for a, b in edges:
        assert pos[a] >= pos[b]


def test_chain_graph_of_a_physical_plan():
    from pipelines import union_chain

    plan = union_chain(parallelism=2).plan(2)
    vertices, edges = chain_graph(plan)
    s = build_segments(vertices, edges)
    assert len(s) == len(plan.chains)
    assert not any(s.cyclic)
    for c in plan.chains:
        for oe in c.out_edges:
            assert s.segment_of[c.id] < s.segment_of[oe.dst_chain]
    assert {s.segment_of[c.id] for c in plan.chains if c.is_source} == set(s.roots)


# ================================================================ local tracker


def test_fold_xors_per_segment_and_epoch():
    t = LocalTracker("w0", flush_count=100)
    t.snd(5, 1, 7)
    t.rcv(12, 1, 7)
    t.snd(3, 2, 7)
    t.snd(9, 1, 8)
    (m,) = t.flush(now=0.0)
    assert m == TrackerMessage("w0", 0, (Report(7, 1, 5 ^ 12, 1, 1), Report(7, 2, 3, 1, 0), Report(8, 1, 9, 1, 0)), ())
    assert m.nbytes == HEADER_WIRE.size + 3 * REPORT_WIRE.size
    assert t.flush(now=0.0) == []  # nothing pending: no message
    t.snd(1, 1, 1)
    assert t.flush(now=1.0)[0].seq == 1


def test_a_local_hop_cancels_in_the_fold_and_costs_no_message():
    t = LocalTracker("w0", flush_count=100)
    t.snd(77, 3, 2)
    t.rcv(77, 3, 2)
    assert t.flush(now=0.0) == []
    assert t.seq == 0


def test_flush_on_count():
    t = LocalTracker("w", flush_interval=None, flush_count=3)
    t.snd(1, 1, 0)
    t.snd(2, 1, 0)
    assert not t.due(0.0) and t.poll(0.0) == [] and t.next_deadline(0.0) is None
    t.rcv(1, 1, 0)
    assert t.due(0.0)
    (m,) = t.poll(0.0)
    assert m.reports == (Report(0, 1, 1 ^ 2 ^ 1, 2, 1),)
    assert t.pending_events == 0 and not t.due(100.0)


def test_flush_on_interval():
    t = LocalTracker("w", flush_interval=0.5, flush_count=None, now=10.0)
    assert t.next_deadline(10.0) is None  # nothing pending
    t.snd(1, 1, 0)
    assert t.next_deadline(10.1) == 10.5
    assert t.poll(10.4) == []
    assert len(t.poll(10.5)) == 1
    t.snd(2, 1, 0)
    assert t.next_deadline(10.6) == 11.0


def test_a_promise_is_due_at_once_and_travels_after_the_reports_before_it():
    t = LocalTracker("w", flush_interval=60.0, flush_count=None)
    t.snd(11, 4, 1)
    t.promise(0, 4, now=0.0, source="src-0")
    t.promise(0, 5, now=0.0, source="src-0")  # supersedes the pending promise of 4
    assert t.due(0.0)
    (m,) = t.poll(0.0)
    assert m.reports == (Report(1, 4, 11, 1, 0),)
    assert m.promises == (Promise(0, 5, "src-0"),)
    with pytest.raises(ProtocolError, match="promises must increase"):
        t.promise(0, 5, now=0.0, source="src-0")


def test_with_promises_on_the_timer_an_epoch_per_record_costs_one_message_per_interval():
    """Granularity 1 (paper 000 Fig. 13b): a source ends an epoch after every record. With
    ``flush_on_promise=False`` the promises ride the timed flush, as FlameStream's heartbeats do:
    one message per flush interval carrying the newest promise and every report before it, not
    one message per record. (With promises urgent, the same script sends one per record.)"""
    def script(flush_on_promise: bool) -> list:
        t = LocalTracker("w", flush_interval=0.005, flush_count=None, flush_on_promise=flush_on_promise)
        out = []
        for i in range(1, 1001):  # 1,000 records in 0.1 s, an epoch each
            now = i * 0.0001
            t.snd(i, i, 1)
            t.promise(0, i, now=now, source="src-0")
            out += t.poll(now)
        return out + t.flush(0.2)

    timed = script(False)
    assert len(timed) <= 0.1 / 0.005 + 1
    assert [p.epoch for m in timed for p in m.promises][-1] == 1000
    assert sum(r.snd for m in timed for r in m.reports) == 1000
    promised = 0
    for m in timed:  # each message carries the SNDs of every epoch it promises
        promised = max([promised, *(p.epoch for p in m.promises)])
        assert all(r.epoch <= promised for r in m.reports)
    assert len(script(True)) == 1000


def test_a_promise_stays_urgent_without_a_flush_interval():
    """No timer would ever flush it: the promise flushes at once whatever ``flush_on_promise`` says."""
    t = LocalTracker("w", flush_interval=None, flush_count=100, flush_on_promise=False)
    t.promise(0, 1, now=0.0)
    assert t.due(0.0)
    t = LocalTracker("w", flush_interval=0.5, flush_count=100, flush_on_promise=False)
    t.promise(0, 1, now=0.0)
    assert not t.due(0.0) and t.next_deadline(0.0) == 0.5


def test_without_aggregation_every_event_is_one_message_in_order():
    t = LocalTracker("w", aggregate=False)
    t.snd(3, 1, 2)
    t.rcv(4, 1, 1)
    t.promise(0, 1, now=0.0)
    t.snd(5, 2, 2)
    msgs = t.poll(0.0)
    assert [m.seq for m in msgs] == [0, 1, 2, 3]
    assert [(m.reports, m.promises) for m in msgs] == [
        ((Report(2, 1, 3, 1, 0),), ()),
        ((Report(1, 1, 4, 0, 1),), ()),
        ((), (Promise(0, 1, "w"),)),
        ((Report(2, 2, 5, 1, 0),), ()),
    ]


def test_configuration_and_ids_are_checked():
    with pytest.raises(ValueError, match="flush_interval or flush_count"):
        LocalTracker("w", flush_interval=None, flush_count=None)
    with pytest.raises(ValueError, match="flush_count"):
        LocalTracker("w", flush_count=0)
    t = LocalTracker("w")
    for bad in (0, -1, 1 << 64):
        with pytest.raises(ValueError, match="batch id"):
            t.snd(bad, 1, 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("snd"), st.integers(1, 2**64 - 1), st.integers(1, 3), st.integers(0, 2)),
            st.tuples(st.just("rcv"), st.integers(1, 2**64 - 1), st.integers(1, 3), st.integers(0, 2)),
            st.tuples(st.just("poll"), st.floats(0, 0.01)),
        ),
        max_size=60,
    ),
    st.integers(1, 5),
)
def test_each_flush_is_exactly_the_fold_of_the_events_since_the_previous_one(script, count):
    """So no event is ever reported after one recorded later (the chain rule's half that
    the tracker owns): folding only merges events that share a message."""
    t = LocalTracker("w", flush_interval=0.004, flush_count=count)
    now = 0.0
    since: list[tuple[str, int, int, int]] = []
    for step in script:
        if step[0] == "poll":
            now += step[1]
            msgs = t.poll(now)
            if not msgs:
                continue
            (m,) = msgs
            expected: dict[tuple[int, int], list[int]] = {}
            for kind, bid, ep, seg in since:
                slot = expected.setdefault((seg, ep), [0, 0, 0])
                slot[0] ^= bid
                slot[1 if kind == "snd" else 2] += 1
            assert {(r.segment, r.epoch): [r.xor, r.snd, r.rcv] for r in m.reports} == {
                k: v for k, v in expected.items() if v[0] or v[1] != v[2]
            }
            since = []
        else:
            kind, bid, ep, seg = step
            getattr(t, kind)(bid, ep, seg)
            since.append(step)


def test_batch_ids_are_distinct_nonzero_and_reproducible():
    a = list(_take(BatchIds(7), 10_000))
    assert len(set(a)) == 10_000 and all(0 < x < 2**64 for x in a)
    assert list(_take(BatchIds(7), 5)) == list(_take(BatchIds(7), 5))
    assert set(_take(BatchIds(8), 1000)).isdisjoint(_take(BatchIds(7), 1000))


def _take(it, n):
    for _ in range(n):
        yield next(it)


# ================================================================ agent


def _line(n: int = 3):
    """src -> op1 -> ... -> op(n-1): segments 0..n-1."""
    return build_segments(range(n), [(i, i + 1) for i in range(n - 1)])


def _msg(sender, seq, reports=(), promises=()):
    return TrackerMessage(sender, seq, tuple(reports), tuple(promises))


def test_figure_8_chain_closes_when_the_xors_pair_up():
    """Paper 000 Figure 8: SND 5 / RCV 5, SND 12 / RCV 12, then NEOSS."""
    agent = TrackingAgent(_line(3), {0: ["src"]})
    out = agent.receive(_msg("w0", 0, [Report(1, 1, 5, 1, 0)], [Promise(0, 1, "src")]), now=0.0)
    assert out == [NEOSS(0, 1)]  # the source's own segment; nothing flows into it
    assert agent.in_flight(1) == {1: (5, 1)}
    # op1 processes batch 5 and emits batch 12 (SND 12 before RCV 5, one flush)
    out = agent.receive(_msg("w1", 0, [Report(2, 1, 12, 1, 0), Report(1, 1, 5, 0, 1)]), now=1.0)
    assert out == [NEOSS(1, 1)]
    out = agent.receive(_msg("w2", 0, [Report(2, 1, 12, 0, 1)]), now=2.0)
    assert out == [NEOSS(2, 1)]
    assert agent.bounds == (1, 1, 1)
    agent.check_invariants()


def test_xor_zero_before_any_report_is_not_an_end_of_epoch():
    """The false positive: the source has sent batch 99 to op1, but its tracker has not
    flushed. op1's slot for epoch 1 is empty, so its XOR is 0 - yet no NEOSS, because op1's
    producer (the source) has not promised. The promise comes in the same flush as the
    SND (after it), so by the time the cap allows epoch 1 the slot is no longer clear."""
    agent = TrackingAgent(_line(2), {0: ["src"]})
    tracker = LocalTracker("w0", flush_interval=None, flush_count=1000)
    tracker.snd(99, 1, 1)
    assert agent.in_flight(1) == {} and agent.cap(1) == 0 and agent.bound(1) == 0
    tracker.promise(0, 1, now=0.0, source="src")
    (m,) = tracker.poll(now=0.0)
    assert agent.receive(m, now=0.0) == [NEOSS(0, 1)]
    assert agent.cap(1) == 1 and agent.bound(1) == 0 and agent.in_flight(1) == {1: (99, 1)}
    receiver = LocalTracker("w1", flush_count=1)
    receiver.rcv(99, 1, 1)
    (m,) = receiver.poll(now=1.0)
    assert agent.receive(m, now=1.0) == [NEOSS(1, 1)]


def test_a_promise_that_overtakes_its_snd_would_close_too_early():
    """Why a promise must follow its SNDs: fed a promise alone (as a buggy tracker would
    send it), the agent bounds op1 at epoch 1 while batch 99 is still in flight, and the
    late SND is then a protocol violation naming segment and epoch."""
    agent = TrackingAgent(_line(2), {0: ["src"]})
    assert agent.receive(_msg("w0", 0, promises=[Promise(0, 1, "src")]), 0.0) == [NEOSS(0, 1), NEOSS(1, 1)]
    with pytest.raises(ProtocolError, match=r"segment=1, epoch=1.*already closed"):
        agent.receive(_msg("w0", 1, [Report(1, 1, 99, 1, 0)]), 0.0)


def test_cycle_segment_closes_only_when_its_loop_is_drained():
    seg = build_segments(["src", "a", "b"], [("src", "a"), ("a", "b"), ("b", "a")])
    agent = TrackingAgent(seg, {0: ["s"]})
    agent.receive(_msg("w", 0, [Report(1, 1, 10, 1, 0)], [Promise(0, 1, "s")]), 0.0)
    # a processes 10, sends 11 to b (same segment); b processes 11, sends 12 back to a
    assert agent.receive(_msg("w", 1, [Report(1, 1, 11, 1, 0), Report(1, 1, 10, 0, 1)]), 0.0) == []
    assert agent.receive(_msg("w", 2, [Report(1, 1, 12, 1, 0), Report(1, 1, 11, 0, 1)]), 0.0) == []
    assert agent.receive(_msg("w", 3, [Report(1, 1, 12, 0, 1)]), 0.0) == [NEOSS(1, 1)]


def test_bound_waits_for_every_source_and_every_upstream():
    # two sources into a join
    seg = build_segments(["s1", "s2", "j"], [("s1", "j"), ("s2", "j")])
    agent = TrackingAgent(seg, {0: ["s1a", "s1b"], 1: ["s2"]})
    assert agent.receive(_msg("w", 0, promises=[Promise(0, 2, "s1a"), Promise(1, 3, "s2")]), 0.0) == [NEOSS(1, 3)]
    assert agent.bound(2) == 0  # s1b has not promised
    assert agent.receive(_msg("w", 1, promises=[Promise(0, 1, "s1b")]), 0.0) == [NEOSS(0, 1), NEOSS(2, 1)]
    assert agent.receive(_msg("v", 0, promises=[Promise(0, 5, "s1b")]), 0.0) == [NEOSS(0, 2), NEOSS(2, 2)]


def test_a_jump_over_empty_epochs_is_one_neoss_and_stops_at_the_first_busy_slot():
    agent = TrackingAgent(_line(2), {0: ["s"]})
    out = agent.receive(_msg("w", 0, [Report(1, 4, 8, 1, 0)], [Promise(0, 6, "s")]), 0.0)
    assert out == [NEOSS(0, 6), NEOSS(1, 3)]
    assert agent.receive(_msg("w", 1, [Report(1, 4, 8, 0, 1)]), 0.0) == [NEOSS(1, 6)]


def test_balance_catches_what_the_xor_cannot():
    """Two batches with the same id cancel in the XOR; the SND/RCV balance still says 2 in flight."""
    agent = TrackingAgent(_line(2), {0: ["s"]})
    assert agent.receive(_msg("w", 0, [Report(1, 1, 0, 2, 0)], [Promise(0, 1, "s")]), 0.0) == [NEOSS(0, 1)]
    assert agent.in_flight(1) == {1: (0, 2)}


def test_protocol_violations_fail_the_agent_and_change_nothing():
    agent = TrackingAgent(_line(3), {0: ["s"]})
    agent.receive(_msg("w", 0, promises=[Promise(0, 2, "s")]), 0.0)
    before = (agent.bounds, [agent.in_flight(s) for s in range(3)])
    with pytest.raises(ProtocolError) as exc:
        # a valid report first, then one for closed epoch 2 of segment 2: nothing is applied
        agent.receive(_msg("w", 1, [Report(1, 3, 5, 1, 0), Report(2, 2, 7, 1, 0)]), 0.0)
    assert "segment=2, epoch=2" in str(exc.value) and "notified up to 2" in str(exc.value)
    assert (agent.bounds, [agent.in_flight(s) for s in range(3)]) == before
    assert agent.failed
    with pytest.raises(ProtocolError, match="FAILED"):
        agent.receive(_msg("w", 1, [Report(1, 3, 5, 1, 0)]), 0.0)


@pytest.mark.parametrize(
    "message, match",
    [
        (_msg("w", 1), "expecting message 0"),
        (_msg("w", 0, [Report(9, 1, 1, 1, 0)]), "unknown segment"),
        (_msg("w", 0, [Report(1, 1, 1 << 64, 1, 0)]), "out of range"),
        (_msg("w", 0, [Report(1, 1, 3, -1, 0)]), "out of range"),
        (_msg("w", 0, promises=[Promise(0, 1, "stranger")]), "not a source of segment 0"),
        (_msg("w", 0, promises=[Promise(0, 0, "s")]), "promises must increase"),
        (_msg("w", 0, promises=[Promise(0, 2, "s"), Promise(0, 2, "s")]), "promises must increase"),
        (_msg("w", 0, promises=[Promise(5, 1, "s")]), "unknown segment"),
    ],
)
def test_malformed_messages_are_protocol_errors(message, match):
    agent = TrackingAgent(_line(2), {0: ["s"]})
    with pytest.raises(ProtocolError, match=match):
        agent.receive(message, 0.0)
    assert agent.bounds == (0, 0)


def test_a_segment_nothing_can_bound_is_refused():
    with pytest.raises(ValueError, match=r"segment 1 \['b'\] has no upstream segment and no promising source"):
        TrackingAgent(build_segments(["a", "b"], []), {0: ["s"]})
    with pytest.raises(ValueError, match="segment 4"):
        TrackingAgent(_line(2), {4: ["s"]})


def test_restored_agent_starts_at_the_restored_epoch():
    agent = TrackingAgent(_line(2), {0: ["s"]}, last_closed=7)
    assert agent.bounds == (7, 7)
    with pytest.raises(ProtocolError, match="already closed"):
        agent.receive(_msg("w", 0, [Report(1, 7, 3, 1, 0)]), 0.0)
    agent = TrackingAgent(_line(2), {0: ["s"]}, last_closed=7)
    assert agent.receive(_msg("w", 0, promises=[Promise(0, 8, "s")]), 0.0) == [NEOSS(0, 8), NEOSS(1, 8)]


def test_traffic_accounting_counts_flushes_and_neoss_per_process():
    traffic = ServiceTraffic()
    agent = TrackingAgent(_line(2), {0: ["s"]}, processes={0: [], 1: ["p0", "p1", "p2"]}, traffic=traffic)
    m1 = _msg("w0", 0, [Report(1, 1, 5, 1, 0), Report(1, 2, 6, 1, 0)], [Promise(0, 1, "s")])
    agent.receive(m1, 0.0)
    m2 = _msg("w1", 0, [Report(1, 1, 5, 0, 1)])
    agent.receive(m2, 0.0)  # NEOSS(1, 1) to three processes
    m3 = _msg("w0", 1, promises=[Promise(0, 2, "s")])
    agent.receive(m3, 0.0)  # NEOSS(0, 2) to nobody; segment 1 waits for batch 6
    assert traffic.messages("report") == 2 and traffic.messages("promise") == 1
    assert traffic.messages("neoss") == 3
    assert traffic.bytes("report") == m1.nbytes + m2.nbytes
    assert traffic.bytes("promise") == HEADER_WIRE.size + PROMISE_WIRE.size
    assert traffic.bytes("neoss") == 3 * NEOSS_WIRE.size
    assert traffic.messages() == 6 == sum(t.messages for t in traffic.by_epoch.values())
    assert traffic.by_process["p1"].messages == 1 and traffic.by_process["w0"].messages == 2
    assert traffic.by_epoch[1].messages == 5 and traffic.by_epoch[2].messages == 1
    d = traffic.as_dict()
    assert d["total"]["messages"] == 6 and d["by_kind"]["neoss"]["bytes"] == 3 * NEOSS_WIRE.size
    merged = ServiceTraffic()
    merged.merge(traffic)
    merged.record("marker", "t0", 1, nbytes=12)
    assert merged.messages() == 7 and merged.by_epoch[1].messages == 6


@pytest.mark.parametrize("procs", [{1: ["p0", "p1"], 2: ["p0", "p1"]}, {1: ["p0", "p1"], 2: ["p1", "p2"]}],
                         ids=["same processes", "overlapping processes"])
def test_traffic_accounting_bundles_a_steps_neoss_per_destination(procs):
    """The NEOSS of one agent step travel as one message per destination, one entry per note, whether
    every segment's processes are the same (counted once for all) or not (counted per destination)."""
    traffic = ServiceTraffic()
    agent = TrackingAgent(_line(3), {0: ["s"]}, processes={0: [], **procs}, traffic=traffic)
    assert agent.receive(_msg("w", 0, promises=[Promise(0, 1, "s")]), 0.0) == [NEOSS(0, 1), NEOSS(1, 1), NEOSS(2, 1)]
    expect = {}
    for s in (1, 2):
        for q in procs[s]:
            expect[q] = expect.get(q, 0) + 1
    assert {q: (t.messages, t.entries, t.bytes) for q, t in traffic.by_process.items() if q != "w"} == \
        {q: (1, n, n * NEOSS_WIRE.size) for q, n in expect.items()}
    assert traffic.messages("neoss") == len(expect) == traffic.by_epoch[1].messages - 1
    assert traffic.by_kind["neoss"].entries == sum(expect.values())


# ================================================================ gate


def test_gate_holds_later_epochs_until_neoss():
    g = FirmBoundGate(segment=3)
    assert g.open_epoch == 1 and g.exactly_once
    assert g.admit(1, now=0.0) and not g.blocked
    assert not g.admit(2, now=1.0) and g.blocked
    assert not g.admit(3, now=2.0)
    assert not g.is_blocked(0)  # per epoch, never per channel
    assert g.on_neoss(1, now=4.0) == [1]
    assert g.last_hold_seconds == 3.0 and not g.blocked and g.open_epoch == 2
    assert g.admit(2) and not g.admit(3)
    assert g.on_neoss(4, now=5.0) == [2, 3, 4]  # a jump: snapshot each, in order
    with pytest.raises(ProtocolError, match="stale"):
        g.on_neoss(4, now=6.0)
    with pytest.raises(ProtocolError, match=r"segment 3 closed up to 4.*closed epoch"):
        g.admit(4)


def test_soft_gate_admits_everything_and_still_reports_ends():
    g = FirmBoundGate(firm=False)
    assert not g.exactly_once
    assert g.admit(1) and g.admit(5) and not g.blocked
    assert g.on_neoss(2, now=0.0) == [1, 2]


def test_gate_reset_restarts_from_a_restored_epoch():
    g = FirmBoundGate()
    g.admit(2, now=0.0)
    g.reset(last_completed=6)
    assert g.open_epoch == 7 and not g.blocked
    assert g.admit(7) and not g.admit(8)
    assert g.on_neoss(7, now=1.0) == [7]


# ================================================================ in-memory dataflow


@dataclass
class BatchInfo:
    id: int
    epoch: int
    dst: tuple[str, int]  # (vertex, instance)
    segment: int
    ttl: int
    sent_at: int
    processed_at: int | None = None


def random_graph(rng: random.Random):
    """Sources first; every other vertex has an input from an earlier one (a DAG with
    fan-in and fan-out), plus one back edge closing a cycle (or a self-loop)."""
    n = rng.randint(3, 7)
    n_sources = 1 if n < 5 else rng.randint(1, 2)
    vs = [f"v{i}" for i in range(n)]
    edges: set[tuple[str, str]] = set()
    for i in range(n_sources, n):
        edges.add((vs[rng.randrange(i)], vs[i]))
        for j in range(i):
            if rng.random() < 0.25:
                edges.add((vs[j], vs[i]))
    for s in range(n_sources):
        if not any(a == vs[s] for a, _ in edges):
            edges.add((vs[s], vs[rng.randrange(n_sources, n)]))
    reach = _reachable(vs, edges)
    i = rng.randrange(n_sources, n)
    ancestors = [vs[j] for j in range(n_sources, i) if vs[i] in reach[vs[j]]]
    head = rng.choice(ancestors) if ancestors and rng.random() < 0.85 else vs[i]
    edges.add((vs[i], head))  # the cycle head .. v_i -> head
    order = vs[:]
    rng.shuffle(order)  # segment numbering must not depend on the listing
    return order, sorted(edges), vs[:n_sources]


class Dataflow:
    """Sources, processes, workers' LocalTrackers, one TrackingAgent and a gate per process,
    stepped one random event at a time; ``check_*`` compare them with the ground truth."""

    def __init__(self, seed: int, *, workers: int = 3, epochs: int = 3, aggregate: bool = True,
                 flush_count: int | None = 8, flush_interval: float | None = 0.004, emits: int = 3,
                 max_ttl: int = 3, chain_rule: bool = True, flush_on_promise: bool = True) -> None:
        self.rng = rng = random.Random(seed)
        self.epochs, self.emits, self.max_ttl, self.chain_rule = epochs, emits, max_ttl, chain_rule
        vertices, edges, sources = random_graph(rng)
        self.seg = build_segments(vertices, edges)
        self.succ = {v: [b for a, b in edges if a == v] for v in vertices}
        self.sources = set(sources)
        par = {v: rng.randint(1, 3) for v in vertices}
        self.instances = {v: [(v, i) for i in range(par[v])] for v in vertices}
        self.worker_of = {p: (i + k) % workers for k, v in enumerate(vertices) for i, p in enumerate(self.instances[v])}
        self.procs = [p for v in vertices if v not in self.sources for p in self.instances[v]]
        self.source_procs = [p for v in sources for p in self.instances[v]]
        self.trackers = {
            w: LocalTracker(w, aggregate=aggregate, flush_count=flush_count, flush_interval=flush_interval,
                            flush_on_promise=flush_on_promise)
            for w in range(workers)
        }
        processes = {s: [p for p in self.procs if self.seg.segment_of[p[0]] == s] for s in range(len(self.seg))}
        promisers = {self.seg.segment_of[v]: self.instances[v] for v in sources}
        self.agent = TrackingAgent(self.seg, promisers, processes=processes)
        self.processes = processes
        self.gates = {p: FirmBoundGate(self.seg.segment_of[p[0]]) for p in self.procs}
        self.channels: dict[tuple, deque] = {}
        self.mailbox = {p: deque() for p in self.procs}
        self.held: dict[tuple, list] = {p: [] for p in self.procs}
        self.links = {w: deque() for w in self.trackers}
        self.neoss_in = {p: deque() for p in self.procs}
        self.source_epoch = {p: 1 for p in self.source_procs}
        self.emitted = {p: 0 for p in self.source_procs}
        self.batches: dict[int, BatchInfo] = {}
        self.processed = {p: [] for p in self.procs}
        self.closes: dict[tuple, list[tuple[int, int]]] = {p: [] for p in self.procs}
        self.neoss_log: list[tuple[int, int, int]] = []
        self.clock = 0  # event counter: the harness's notion of "when"
        self.now = 0.0  # virtual seconds, for flush intervals
        # per-run event weights: some runs deliver reports late, some flush rarely
        self.weights = {k: rng.choice([0.2, 1.0, 3.0]) for k in
                        ("emit", "promise", "deliver", "process", "poll", "agent", "neoss")}

    # -------------------------------------------------------- the dataflow's own moves
    def _new_id(self) -> int:
        while True:
            bid = self.rng.getrandbits(64)
            if bid and bid not in self.batches:
                return bid

    def _send(self, src, epoch: int, ttl: int) -> list[BatchInfo]:
        """Emit ``rng`` batches to random successors of ``src``: the fan-out."""
        out: list[BatchInfo] = []
        if not self.succ[src[0]]:
            return out  # a sink
        for _ in range(self.rng.choice([0, 1, 1, 2, 2, 3])):
            w = self.rng.choice(self.succ[src[0]])
            dst = self.rng.choice(self.instances[w])
            b = BatchInfo(self._new_id(), epoch, dst, self.seg.segment_of[w], ttl, self.clock)
            self.batches[b.id] = b
            self.channels.setdefault((src, dst), deque()).append(b)
            out.append(b)
        return out

    def _enabled(self):
        ev = []
        for p in self.source_procs:
            if self.source_epoch[p] <= self.epochs:
                ev.append(("promise", p))
                if self.emitted[p] < self.emits:
                    ev.append(("emit", p))
        ev += [("deliver", k) for k, q in self.channels.items() if q]
        ev += [("process", p) for p, q in self.mailbox.items() if q]
        ev += [("poll", w) for w, t in self.trackers.items() if t.due(self.now)]
        ev += [("agent", w) for w, q in self.links.items() if q]
        ev += [("neoss", p) for p, q in self.neoss_in.items() if q]
        return ev

    def step(self) -> bool:
        ev = self._enabled()
        if not ev:
            return False
        kind, who = self.rng.choices(ev, weights=[self.weights[k] for k, _ in ev])[0]
        self.clock += 1
        self.now += self.rng.expovariate(1000.0)
        getattr(self, "_" + kind)(who)
        return True

    def _emit(self, p) -> None:
        tracker = self.trackers[self.worker_of[p]]
        for b in self._send(p, self.source_epoch[p], self.rng.randint(0, self.max_ttl)):
            tracker.snd(b.id, b.epoch, b.segment)
        self.emitted[p] += 1

    def _promise(self, p) -> None:
        self.trackers[self.worker_of[p]].promise(self.seg.segment_of[p[0]], self.source_epoch[p], self.now, source=p)
        self.source_epoch[p] += 1
        self.emitted[p] = 0

    def _deliver(self, key) -> None:
        b = self.channels[key].popleft()
        self.mailbox[b.dst].append(b)

    def _process(self, p) -> None:
        b = self.mailbox[p].popleft()
        if not self.gates[p].admit(b.epoch, self.now):
            self.held[p].append(b)
            return
        tracker = self.trackers[self.worker_of[p]]
        outs = self._send(p, b.epoch, b.ttl - 1) if b.ttl > 0 else []
        if not self.chain_rule:  # the mutation: RCV first, and flushed before the SNDs
            tracker.rcv(b.id, b.epoch, b.segment)
            self.links[self.worker_of[p]].extend(tracker.flush(self.now))
        for o in outs:
            tracker.snd(o.id, o.epoch, o.segment)
        if self.chain_rule:
            tracker.rcv(b.id, b.epoch, b.segment)
        b.processed_at = self.clock
        self.processed[p].append(b.id)

    def _poll(self, w) -> None:
        self.links[w].extend(self.trackers[w].poll(self.now))

    def _agent(self, w) -> None:
        for n in self.agent.receive(self.links[w].popleft(), self.now):
            self._check_neoss_now(n)
            self.neoss_log.append((n.segment, n.epoch, self.clock))
            for p in self.processes[n.segment]:
                self.neoss_in[p].append(n.epoch)
        self.agent.check_invariants()

    def _neoss(self, p) -> None:
        epoch = self.neoss_in[p].popleft()
        for e in self.gates[p].on_neoss(epoch, self.now):
            self.closes[p].append((e, len(self.processed[p])))  # the snapshot of epoch e
        self.mailbox[p].extendleft(reversed(self.held[p]))
        self.held[p] = []

    # -------------------------------------------------------- running
    def run(self, limit: int = 200_000) -> None:
        """Until nothing can move: sources done, channels and links empty, trackers flushed."""
        for _ in range(limit):
            if self.step():
                continue
            pending = [w for w, t in self.trackers.items() if t.has_pending()]
            if not pending:
                return
            for w in pending:  # polling is not due (count not reached): the final flush
                self.links[w].extend(self.trackers[w].flush(self.now))
        raise AssertionError("the dataflow did not quiesce")

    # -------------------------------------------------------- ground-truth checks
    def _check_neoss_now(self, n: NEOSS) -> None:
        for b in self.batches.values():
            if b.segment == n.segment and b.epoch <= n.epoch:
                assert b.processed_at is not None, f"{n} emitted while batch {b} is unprocessed"

    def check_safety(self) -> None:
        """(a) NEOSS(s, n) at time t: every batch of epoch <= n into s, even one sent later,
        was processed before t."""
        for s, n, t in self.neoss_log:
            for b in self.batches.values():
                if b.segment == s and b.epoch <= n:
                    assert b.processed_at is not None and b.processed_at < t, f"NEOSS({s}, {n}) at {t} vs {b}"

    def check_monotone(self) -> None:
        """(c) per segment, NEOSS epochs strictly increase; per gate, closed epochs are 1, 2, 3..."""
        per: dict[int, list[int]] = {}
        for s, n, _t in self.neoss_log:
            per.setdefault(s, []).append(n)
        for s, ns in per.items():
            assert ns == sorted(set(ns)), f"segment {s}: NEOSS {ns}"
        for p, closes in self.closes.items():
            assert [e for e, _ in closes] == list(range(1, len(closes) + 1)), f"{p}: closed {closes}"

    def check_epoch_complete(self) -> None:
        """Firm bound: when p closes epoch e it has processed exactly its batches of epochs <= e."""
        for p, closes in self.closes.items():
            for e, upto in closes:
                done = set(self.processed[p][:upto])
                want = {b.id for b in self.batches.values() if b.dst == p and b.epoch <= e}
                assert done == want, f"{p} snapshot of epoch {e}: extra {done - want}, missing {want - done}"

    def check_liveness(self) -> None:
        """(b) all promised, delivered, flushed: every segment bounded at the last epoch."""
        assert all(b.processed_at is not None for b in self.batches.values())
        assert self.agent.bounds == (self.epochs,) * len(self.seg), self.agent.bounds
        for p, g in self.gates.items():
            assert g.closed == self.epochs and not self.held[p], p

    def report_messages(self) -> int:
        return self.agent.traffic.messages("report") + self.agent.traffic.messages("promise")


dataflow_params = dict(
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(1, 4),
    epochs=st.integers(1, 4),
    aggregate=st.booleans(),
    flush_count=st.one_of(st.none(), st.integers(1, 20)),
    flush_interval=st.one_of(st.none(), st.floats(0.0, 0.02)),
    emits=st.integers(1, 6),
    max_ttl=st.integers(0, 4),
    flush_on_promise=st.booleans(),
)


def _dataflow_property(seed, workers, epochs, aggregate, flush_count, flush_interval, emits, max_ttl,
                       flush_on_promise) -> None:
    if flush_count is None and flush_interval is None:
        flush_interval = 0.001
    df = Dataflow(seed, workers=workers, epochs=epochs, aggregate=aggregate, flush_count=flush_count,
                  flush_interval=flush_interval, emits=emits, max_ttl=max_ttl, flush_on_promise=flush_on_promise)
    df.run()
    df.check_safety()
    df.check_monotone()
    df.check_epoch_complete()
    df.check_liveness()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**dataflow_params)
def test_dataflow_safety_liveness_monotonicity(**params):
    """(a) safety, (b) liveness, (c) monotonicity, and epoch-complete firm bounds, over
    random graphs, placements, flush policies and schedules."""
    _dataflow_property(**params)


@pytest.mark.long
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**dataflow_params)
def test_dataflow_safety_liveness_monotonicity_long(**params):
    _dataflow_property(**params)


def test_aggregation_sends_far_fewer_report_messages():
    """(d) Same dataflows, same seeds, with and without the fold: one message per event
    against one per flush. Summed over a dozen random dataflows (a tiny one, where almost
    every flush carries a promise, saves little; the benchmark measures the real ratio)."""
    kw = dict(workers=3, epochs=4, emits=6, max_ttl=3, flush_count=64, flush_interval=0.02)
    plain_total = folded_total = 0
    for seed in range(12):
        plain = Dataflow(seed, aggregate=False, **kw)
        plain.run()
        folded = Dataflow(seed, aggregate=True, **kw)
        folded.run()
        events = sum(t.events for t in plain.trackers.values())
        promises = len(plain.source_procs) * plain.epochs
        assert plain.report_messages() == events + promises  # one per event, one per promise
        assert folded.report_messages() <= plain.report_messages()
        for df in (plain, folded):
            df.check_safety()
            df.check_liveness()
        plain_total += plain.report_messages()
        folded_total += folded.report_messages()
    assert plain_total >= 1000
    assert folded_total * 4 <= plain_total, (folded_total, plain_total)


class _FullPath(TrackingAgent):
    """The reference: advances on every promise, and takes the sources' minimum afresh each time."""

    skip_idle_promises = False

    def cap(self, segment: int, dim: int = 0) -> int:
        d = self._dims[dim]
        return min([d.bound[u] for u in self._upstream[segment]] + list(d.promised[segment].values()))


def _against_full_path(seed: int, monkeypatch: pytest.MonkeyPatch, promise=None) -> int:
    """Run a random dataflow; feed every message also to a copy of its agent that advances on every
    promise (``_FullPath``), and require the same notes, message by message, and the same traffic.
    ``promise``: a replacement for ``_Dimension.promise`` (a mutation of the shortcut). Returns how
    many promises the agent let pass without an advance."""
    rng = random.Random(seed)
    df = Dataflow(seed, workers=rng.randint(1, 4), epochs=rng.randint(2, 5), emits=rng.randint(1, 4),
                  flush_count=rng.choice([None, 1, 4, 16]), flush_interval=rng.choice([0.0005, 0.004]),
                  flush_on_promise=rng.random() < 0.5)
    ref = copy.deepcopy(df.agent)
    ref.__class__ = _FullPath
    fast_dims = {id(d) for d in df.agent._dims}
    real = promise or agent_module._Dimension.promise
    skipped = [0]

    def counted(d, s, source, label):
        raised = real(d, s, source, label)
        skipped[0] += id(d) in fast_dims and not raised
        return raised

    monkeypatch.setattr(agent_module._Dimension, "promise", counted)
    fast_receive = df.agent.receive

    def both(message, now):
        got = fast_receive(message, now)
        want = ref.receive(message, now)
        assert got == want, f"message {message}: fast path {got}, full path {want}"
        return got

    try:
        df.agent.receive = both  # type: ignore[method-assign]
        df.run()
    finally:
        monkeypatch.undo()
    assert df.agent.traffic.as_dict() == ref.traffic.as_dict()
    df.check_liveness()
    return skipped[0]


def test_a_promise_below_no_minimum_skips_the_advance_and_changes_no_notification(monkeypatch):
    """The shortcut (a promise advances its segment only when it raised the minimum over the
    segment's sources) sends exactly what the full advance sends, on random dataflows with 1-3
    sources per source segment; and it is taken, or this test would compare nothing."""
    skipped = sum(_against_full_path(seed, monkeypatch) for seed in range(60))
    assert skipped > 100, skipped


def test_the_full_path_comparison_catches_a_wrong_shortcut(monkeypatch):
    """Mutation check for the test above: a shortcut that never advances on a promise, or that
    keeps a stale minimum, must give different notes (or stall, or fail the invariants) for some seed."""

    def never(d, s, source, label):
        d.promised[s][source] = label
        return False

    def stale(d, s, source, label):  # forgets to count the sources at the minimum
        old = d.promised[s][source]
        d.promised[s][source] = label
        if old != d.floor[s]:
            return False
        d.floor[s] = min(d.promised[s].values())
        return True

    for mutation in (never, stale):
        caught = 0
        for seed in range(60):
            try:
                _against_full_path(seed, monkeypatch, mutation)
            except AssertionError:
                caught += 1
        assert caught >= 3, (mutation.__name__, caught)


def _break_chain_rule(df: Dataflow) -> None:
    df.chain_rule = False  # RCV reported (and flushed) before the SNDs it caused


def _xor_only(df: Dataflow) -> None:
    df.agent.cap = lambda segment, dim=0: df.epochs  # ignore producers: "XOR == 0" alone closes


def _soft_gates(df: Dataflow) -> None:
    for g in df.gates.values():
        g.firm = False  # process later epochs before the NEOSS


@pytest.mark.parametrize("mutation", [_break_chain_rule, _xor_only, _soft_gates])
def test_the_harness_catches_a_broken_protocol(mutation):
    """Mutation check: each broken rule must trip a check for some seeds, or the property
    tests above would be vacuous."""
    caught = 0
    for seed in range(40):
        df = Dataflow(seed, aggregate=False)
        mutation(df)
        try:
            df.run()
            df.check_safety()
            df.check_epoch_complete()
        except (AssertionError, ProtocolError):
            caught += 1
    assert caught >= 5, caught


# ================================================================ docstrings


@pytest.mark.parametrize("module", [segments_module, local_module, agent_module, gate_module])
def test_docstring_examples_run(module):
    failures, _tests = doctest.testmod(module, raise_on_error=False)
    assert failures == 0
