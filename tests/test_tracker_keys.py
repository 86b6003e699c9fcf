"""Per-key substream tracking (tracker/keys.py): a key is reported free exactly when no message
of it is in flight, checked against a brute-force model of a random distributed system."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochstream.runtime.errors import ProtocolError
from epochstream.tracker.keys import KeyFree, KeyMessage, KeyReport, KeyTrackingAgent, LocalKeyTracker

PROCS = 3
KEYS = 4


@dataclass
class Msg:
    id: int
    keys: tuple[int, ...]
    dest: int
    #: key -> id of the message that started this message's substream of that key
    root: dict[int, int]


@dataclass
class World:
    """The real system (messages in flight, events per flush) and the agent's applied view."""

    trackers: list[LocalKeyTracker]
    agent: KeyTrackingAgent = field(default_factory=KeyTrackingAgent)
    in_flight: list[Msg] = field(default_factory=list)
    next_id: int = 1
    #: per tracker: events recorded since its last flush: (is_snd, id, key)
    pending: list[list[tuple[bool, int, int]]] = field(default_factory=lambda: [[] for _ in range(PROCS)])
    #: per tracker: flushed messages not yet delivered, with their events
    queues: list[list[tuple[KeyMessage, list[tuple[bool, int, int]]]]] = field(
        default_factory=lambda: [[] for _ in range(PROCS)])
    applied_snd: Counter = field(default_factory=Counter)  # (key, id) -> count
    applied_rcv: Counter = field(default_factory=Counter)
    touched: set[int] = field(default_factory=set)

    def fresh(self) -> int:
        # spread ids over 64 bits (sequential ids would XOR-collide often)
        self.next_id += 1
        return (self.next_id * 0x9E3779B97F4A7C15) % (1 << 64) or 1

    def emit(self, p: int, keys: tuple[int, ...], dest: int, cause: Msg | None) -> None:
        m = Msg(self.fresh(), keys, dest, {})
        for k in keys:
            m.root[k] = cause.root[k] if cause is not None and k in cause.keys else m.id
        self.trackers[p].snd(m.id, keys)
        self.pending[p] += [(True, m.id, k) for k in keys]
        self.in_flight.append(m)
        self.touched.update(keys)

    def process(self, i: int, outputs: list[tuple[tuple[int, ...], int]]) -> None:
        x = self.in_flight.pop(i)
        for keys, dest in outputs:  # SNDs of the outputs first (the chain rule) ...
            self.emit(x.dest, keys, dest, x)
        self.trackers[x.dest].rcv(x.id, x.keys)  # ... then the RCV of the input
        self.pending[x.dest] += [(False, x.id, k) for k in x.keys]

    def flush(self, p: int) -> None:
        for msg in self.trackers[p].flush(0.0):
            self.queues[p].append((msg, self.pending[p]))
        self.pending[p] = []

    def referenced_bf(self, k: int) -> bool:
        ids = {i for (kk, i) in self.applied_snd if kk == k} | {i for (kk, i) in self.applied_rcv if kk == k}
        return any(self.applied_snd[(k, i)] != self.applied_rcv[(k, i)] for i in ids)

    def deliver(self, p: int) -> list[KeyFree]:
        msg, events = self.queues[p].pop(0)
        for is_snd, i, k in events:
            (self.applied_snd if is_snd else self.applied_rcv)[(k, i)] += 1
        free = self.agent.receive(msg)
        # exactness against the brute-force pairing of applied events
        for k in range(KEYS):
            assert self.agent.referenced(k) == self.referenced_bf(k), k
        assert free == [KeyFree(r.key, self.agent.substreams_ended(r.key)) for r in msg.reports
                        if not self.referenced_bf(r.key)]
        # safety in the real system: whatever message of a freed key is still in flight belongs to a
        # substream of that key whose first SND the agent has not applied yet (a new substream)
        for f in free:
            for m in self.in_flight:
                if f.key in m.keys:
                    assert self.applied_snd[(f.key, m.root[f.key])] == 0, (f, m)
        return free


def _keys(data: st.DataObject) -> tuple[int, ...]:
    return tuple(sorted(data.draw(st.sets(st.integers(0, KEYS - 1), min_size=1, max_size=2))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_key_is_free_exactly_when_no_message_of_it_is_in_flight(data: st.DataObject) -> None:
    w = World([LocalKeyTracker(p, flush_interval=None, flush_count=10**9) for p in range(PROCS)])
    frees = 0
    for _ in range(data.draw(st.integers(5, 40))):
        action = data.draw(st.sampled_from(["create", "process", "process", "flush", "deliver", "deliver"]))
        if action == "create":
            w.emit(data.draw(st.integers(0, PROCS - 1)), _keys(data), data.draw(st.integers(0, PROCS - 1)), None)
        elif action == "process" and w.in_flight:
            i = data.draw(st.integers(0, len(w.in_flight) - 1))
            n_out = data.draw(st.integers(0, 2))
            w.process(i, [(_keys(data), data.draw(st.integers(0, PROCS - 1))) for _ in range(n_out)])
        elif action == "flush":
            w.flush(data.draw(st.integers(0, PROCS - 1)))
        elif action == "deliver":
            ready = [p for p in range(PROCS) if w.queues[p]]
            if ready:
                frees += len(w.deliver(data.draw(st.sampled_from(ready))))
    # drain: process everything without new outputs, flush, deliver: every key ends
    while w.in_flight:
        w.process(0, [])
    for p in range(PROCS):
        w.flush(p)
        while w.queues[p]:
            frees += len(w.deliver(p))
    assert w.agent.live_keys == 0
    assert all(w.agent.substreams_ended(k) >= 1 for k in w.touched)
    assert frees == sum(w.agent.substreams_ended(k) for k in range(KEYS))


def test_a_chain_across_processes_keeps_its_key_until_the_last_hop_is_reported() -> None:
    a, b = LocalKeyTracker("a", flush_count=10**9), LocalKeyTracker("b", flush_count=10**9)
    agent = KeyTrackingAgent()
    a.snd(5, ["u"])  # a sends message 5 of u to b
    b.snd(12, ["u"])  # b processes it and sends 12 of u on ...
    b.rcv(5, ["u"])
    assert agent.receive(b.flush(0.0)[0]) == []  # 5 ^ 12 unpaired
    assert agent.referenced("u")
    assert agent.receive(a.flush(0.0)[0]) == []  # 12 still in flight
    a.rcv(12, ["u"])  # ... back to a, which processes it
    assert agent.receive(a.flush(0.0)[0]) == [KeyFree("u", 1)]
    assert not agent.referenced("u")


def test_a_substream_inside_one_flush_is_still_reported_free() -> None:
    t, agent = LocalKeyTracker(0, flush_count=10**9), KeyTrackingAgent()
    t.snd(7, ["v"])
    t.rcv(7, ["v"])
    (msg,) = t.flush(0.0)
    assert msg.reports == (KeyReport("v", 0, 1, 1),)
    assert agent.receive(msg) == [KeyFree("v", 1)]
    t.snd(9, ["v"])
    t.rcv(9, ["v"])
    assert agent.receive(t.flush(0.0)[0]) == [KeyFree("v", 2)]  # a key may start again after it ended


def test_flushes_on_interval_and_count() -> None:
    t = LocalKeyTracker(0, flush_interval=0.005, flush_count=3)
    assert t.poll(1.0) == [] and t.next_deadline(0.0) is None
    t.snd(1, ["k"])
    assert not t.due(0.004) and t.next_deadline(0.001) == 0.005
    assert len(t.poll(0.005)) == 1
    t.snd(2, ["a", "b", "c"])  # three events: due by count
    assert t.due(0.0051)


def test_out_of_order_and_malformed_messages_are_protocol_errors() -> None:
    agent = KeyTrackingAgent()
    with pytest.raises(ProtocolError, match="expected seq 0"):
        agent.receive(KeyMessage("a", 1, (KeyReport("k", 3, 1, 0),)))
    with pytest.raises(ProtocolError, match="FAILED"):
        agent.receive(KeyMessage("a", 0, (KeyReport("k", 3, 1, 0),)))
    with pytest.raises(ProtocolError, match="counts non-negative"):
        KeyTrackingAgent().receive(KeyMessage("a", 0, (KeyReport("k", 3, -1, 0),)))
    with pytest.raises(ValueError, match="not in"):
        LocalKeyTracker(0).snd(0, ["k"])
