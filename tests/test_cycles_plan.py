"""Cycles in the plan: back edges, loop expansion, chains and channels, segments, API errors.

Pure functions over logical graphs (``graph.cycles``) and the physical plans built from
them; no driver runs here.
"""

from __future__ import annotations

import doctest
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import epochstream.graph.cycles as cycles_module
from cycle_pipelines import nested, reachability, rounds, self_loop
from epochstream import Pipeline
from epochstream.graph.cycles import back_edges, loop_components, tarjan
from epochstream.graph.kinds import OpKind
from epochstream.graph.plan import FORWARD, HASH, Edge, GraphError, Node, topological_order
from epochstream.tracker.segments import build_segments, chain_graph
from pipelines import running_count


def _graph(n: int, edges: list[tuple[int, int]], sources=(0,)) -> dict[int, Node]:
    nodes = {i: Node(i, "source" if i in sources else "map", f"n{i}", None, f"u{i}") for i in range(n)}
    for a, b in edges:
        nodes[b].inputs.append(Edge(a))
    return nodes


def test_doctests_run():
    failures, _ = doctest.testmod(cycles_module, raise_on_error=False)
    assert failures == 0


def test_back_edges_of_a_simple_loop_and_a_dag():
    nodes = _graph(4, [(0, 1), (1, 2), (2, 1), (2, 3)])
    assert back_edges(nodes) == [(2, 1, 1)]  # 2 -> 1, second input of node 1
    assert loop_components(nodes) == [[1, 2]]
    dag = _graph(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    assert back_edges(dag) == [] and loop_components(dag) == []


def test_nested_loops_and_self_loops_get_one_back_edge_each():
    # 0 -> 1 -> 2 -> 3 -> 1 (outer), 2 -> 2 (self-loop), 3 -> 4
    nodes = _graph(5, [(0, 1), (1, 2), (2, 3), (3, 1), (2, 2), (3, 4)])
    found = back_edges(nodes)
    assert sorted((u, v) for u, v, _ in found) == [(2, 2), (3, 1)]
    assert loop_components(nodes) == [[1, 2, 3]]


def test_a_cycle_nothing_feeds_is_refused_naming_it():
    nodes = _graph(4, [(0, 1), (2, 3), (3, 2)])
    with pytest.raises(ValueError, match=r"\['u2', 'u3'\] are not reachable from any source"):
        back_edges(nodes)
    with pytest.raises(GraphError, match="not reachable from any source"):
        from epochstream.graph.plan import build_plan

        build_plan("x", nodes, 1, None)


@st.composite
def cyclic_graphs(draw):
    n = draw(st.integers(2, 12))
    edges = [(draw(st.integers(0, i - 1)), i) for i in range(1, n)]  # a tree from source 0
    extra = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, n - 1)), max_size=2 * n))
    return n, edges + extra


@settings(max_examples=200, deadline=None)
@given(g=cyclic_graphs())
def test_removing_back_edges_leaves_a_dag_and_every_loop_keeps_one(g):
    """Whatever the graph: cutting the DFS back edges leaves a DAG, every back edge lies
    inside a strongly connected component, and every such component loses at least one."""
    n, edges = g
    nodes = _graph(n, edges)
    found = back_edges(nodes)
    comps = loop_components(nodes)
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    cut = _graph(n, edges)
    for u, v, pos in sorted(found, key=lambda t: -t[2]):
        assert comp_of.get(u) is not None and comp_of.get(u) == comp_of.get(v)
        del cut[v].inputs[pos]
    topological_order(cut)  # raises on a cycle
    assert {comp_of[u] for u, _v, _p in found} == set(range(len(comps)))
    # Tarjan agrees with the segment builder (which shares it) on the condensation
    seg = build_segments(list(range(n)), edges)
    assert sorted(sorted(s) for s, cyc in zip(seg.segments, seg.cyclic, strict=True) if cyc) == comps


def test_tarjan_handles_deep_graphs_without_recursion():
    n = 50_000
    succ = [[i + 1] for i in range(n - 1)] + [[0]]
    assert len(tarjan(succ)) == 1


# ---------------------------------------------------------------- physical plans


def test_iterate_expands_into_head_tail_and_a_phantom_channel():
    plan = rounds(parallelism=3).plan()
    (lp,) = plan.loops
    assert lp.uid == "loop/loop-head"
    head, tail = plan.nodes[lp.head], plan.nodes[lp.tail]
    assert (head.kind, tail.kind) == (OpKind.LOOP_HEAD, OpKind.LOOP_TAIL) and head.inputs == []
    assert plan.nodes[lp.dst].kind == "iterate"
    assert plan.nodes[lp.dst].inputs[lp.edge].src == lp.head
    head_chain = next(c for c in plan.chains if c.is_loop_head)
    assert head_chain.nodes == (lp.head,) and not head_chain.is_source
    tail_chain = next(c for c in plan.chains if lp.tail in c.nodes)
    assert lp.src in tail_chain.nodes  # the tail is chained behind the back edge's source
    phantom = [ch for ch in plan.channels if ch.phantom]
    assert len(phantom) == 3
    for ch in phantom:  # subtask s -> subtask s: the phantom channel never leaves a worker
        assert ch.src == (tail_chain.id, ch.src[1]) and ch.dst == (head_chain.id, ch.src[1])
        assert plan.inputs[ch.dst] == [ch.id]
    # the loop's chains are one cyclic segment in tracker mode; the source is not in it
    seg = build_segments(*chain_graph(plan))
    loop_seg = seg.segment_of[head_chain.id]
    assert seg.cyclic[loop_seg] and seg.segment_of[tail_chain.id] == loop_seg
    assert not seg.cyclic[seg.segment_of[0]]


def test_the_head_feeds_the_entry_with_the_back_edges_partitioning():
    plan = self_loop(parallelism=2).plan()
    (lp,) = plan.loops
    entry = plan.nodes[lp.dst]
    assert entry.kind == "process" and entry.inputs[lp.edge].partition == HASH
    head_chain = next(c for c in plan.chains if c.is_loop_head)
    assert [oe.partition for oe in head_chain.out_edges] == [HASH]
    assert plan.nodes[lp.tail].inputs == [Edge(lp.src, FORWARD, None)]


def test_nested_loops_get_one_head_each_and_stay_one_segment():
    plan = nested(parallelism=2).plan()
    assert sorted(lp.uid for lp in plan.loops) == ["inner/loop-head", "outer/loop-head"]
    inner = next(lp for lp in plan.loops if lp.uid.startswith("inner"))
    outer = next(lp for lp in plan.loops if lp.uid.startswith("outer"))
    assert set(inner.members) == set(outer.members)  # one SCC holds both loops
    seg = build_segments(*chain_graph(plan))
    heads = [c.id for c in plan.chains if c.is_loop_head]
    assert len(heads) == 2 and seg.segment_of[heads[0]] == seg.segment_of[heads[1]]


def test_acyclic_plans_are_unchanged():
    plan = running_count(parallelism=3).plan()
    assert plan.loops == () and not any(ch.phantom for ch in plan.channels)
    assert not any(c.is_loop_head for c in plan.chains)
    assert len(plan.channels) == 9


def test_loop_expansion_does_not_touch_the_pipelines_graph():
    p = reachability(parallelism=2)
    before = {nid: list(n.inputs) for nid, n in p._nodes.items()}
    p.plan()
    p.plan(4)
    assert {nid: list(n.inputs) for nid, n in p._nodes.items()} == before
    assert not any(n.kind in (OpKind.LOOP_HEAD, OpKind.LOOP_TAIL) for n in p._nodes.values())


# ---------------------------------------------------------------- API errors


def test_an_iteration_never_closed_is_refused():
    p = Pipeline("open-loop")
    loop = p.from_collection([1, 2]).iterate(uid="l")
    loop.map(lambda x: x).sink(object(), uid="s")
    with pytest.raises(GraphError, match="iteration 'l' was never closed"):
        p.plan()


def test_close_with_twice_or_across_pipelines_is_refused():
    p, q = Pipeline("a"), Pipeline("b")
    loop = p.from_collection([1]).iterate(uid="l")
    loop.close_with(loop.filter(lambda x: x > 1))
    with pytest.raises(ValueError, match="already closed"):
        loop.close_with(loop.map(lambda x: x))
    loop2 = p.from_collection([1], uid="s2").iterate(uid="l2")
    with pytest.raises(ValueError, match="same pipeline"):
        loop2.close_with(q.from_collection([1]))


def test_reserved_kinds_and_colliding_head_uids_are_refused():
    p = Pipeline("bad")
    s = p.from_collection([1])
    p._add(OpKind.LOOP_HEAD, "fake", None, s._heads, uid="x")
    with pytest.raises(GraphError, match="reserved"):
        p.plan()
    p = Pipeline("collide")
    loop = p.from_collection([1]).iterate(uid="l")
    loop.map(lambda x: x).sink(object(), uid="l/loop-head")
    loop.close_with(loop.filter(lambda x: False))
    with pytest.raises(GraphError, match="collides"):
        p.plan()


def test_feedback_into_a_keyed_process_must_be_keyed():
    p = Pipeline("unkeyed-feedback")
    out = p.from_collection([(1, 2)]).key_by(lambda r: r[0]).process(_Noop(), uid="k")
    node = p._nodes[out._heads[0].src]
    node.inputs.append(Edge(node.id, FORWARD, None))
    with pytest.raises(GraphError, match="needs a key_by"):
        p.plan()


class _Noop:
    def open(self, ctx):
        pass

    def process(self, value, ctx):
        return None


def test_random_pipelines_with_loops_plan_deterministically():
    """The same pipeline code gives the same plan: loop uids (the log's state) are stable."""
    rng = random.Random(3)
    for _ in range(5):
        p = rng.choice([rounds, reachability, nested, self_loop])(parallelism=rng.randint(1, 4))
        a, b = p.plan(), p.plan()
        assert a.loops == b.loops
        assert [c.name for c in a.chains] == [c.name for c in b.chains]
