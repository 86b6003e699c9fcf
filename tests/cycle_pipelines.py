"""Cyclic pipeline builders for the cycle suites (same knobs as ``pipelines.make_pipeline``).

Each loop is chosen so that the oracle can compare runs whatever order records go round
in: per-record iteration (``rounds``, ``nested``: each input record leaves the loop once,
with a result that depends on it alone; keyed state counts passes, a sum that commutes),
and reachability over a stream of edge insertions (``reachability``: the reached set only
grows, every node is emitted once, adjacency lists compare as multisets).

``self_loop`` builds its cycle without ``iterate()``: it adds an input edge from a keyed
operator to itself on the logical graph, which the planner must find on its own.
"""

from __future__ import annotations

from typing import Any

from epochstream import KeyedProcessFunction, ListStateDescriptor, ValueStateDescriptor
from epochstream.graph.plan import HASH, Edge
from pipelines import _sink, make_pipeline


def collatz(x: int) -> int:
    return x // 2 if x % 2 == 0 else 3 * x + 1


class Round(KeyedProcessFunction):
    """One round of the loop body: counts passes per key, steps the value."""

    def __init__(self, state: str = "passes") -> None:
        self.name = state

    def open(self, ctx) -> None:
        self.passes = ctx.state(ValueStateDescriptor(self.name, default=0))

    def process(self, value, ctx):
        rid, x, r = value
        self.passes.update(self.passes.value() + 1)
        return ((rid, collatz(x), r + 1),)


def rounds(*, n: int = 200, keys: int = 5, max_rounds: int = 12, out=None, **knobs: Any):
    """Records ``(id, x, 0)`` go round a Collatz step until x == 1 or ``max_rounds`` rounds:
    a bounded number of iterations per input (1..max_rounds). Output: ``(id, x, rounds)``."""
    p = make_pipeline("rounds", **knobs)
    src = p.from_collection([(i, 7 + i % 23, 0) for i in range(n)], uid="nums")
    loop = src.iterate(uid="loop")
    body = loop.key_by(lambda r: r[0] % keys).process(Round(), uid="round")
    loop.close_with(body.filter(lambda r: r[1] != 1 and r[2] < max_rounds))
    body.filter(lambda r: r[1] == 1 or r[2] >= max_rounds).sink(_sink(out, "done"), uid="done")
    return p


class Reach(KeyedProcessFunction):
    """Reachability from node ``root`` over inserted edges; key = node.

    ``("edge", u, v)`` (key u) records v as a neighbour of u and, if u is reached, sends
    ``("reach", v)``; ``("reach", x)`` (key x) marks x reached once, emits ``("out", x)`` and
    sends ``("reach", w)`` for every known neighbour w (round the loop)."""

    def __init__(self, root: int = 0) -> None:
        self.root = root

    def open(self, ctx) -> None:
        self.adj = ctx.state(ListStateDescriptor("adj"))
        self.reached = ctx.state(ValueStateDescriptor("reached", default=False))

    def process(self, value, ctx):
        kind, x = value[0], value[1]
        reached = self.reached.value() or x == self.root
        if kind == "edge":
            self.adj.add(value[2])
            return (("reach", value[2]),) if reached else None
        if reached:  # the root counts as reached from the start and is never emitted
            return None
        self.reached.update(True)
        return [("out", x)] + [("reach", w) for w in self.adj.get()]


def edge_stream(n: int, nodes: int) -> list[tuple[str, int, int]]:
    """``n`` deterministic pseudo-random edge insertions over ``nodes`` nodes."""
    edges = []
    x = 12345
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        u, v = x % nodes, (x // nodes) % nodes
        edges.append(("edge", u, v))
    return edges


def reachability(*, n: int = 200, nodes: int = 60, out=None, **knobs: Any):
    """Nodes reachable from node 0 as edges arrive; output ``("out", node)`` once per node."""
    p = make_pipeline("reachability", **knobs)
    loop = p.from_collection(edge_stream(n, nodes), uid="edges").iterate(uid="bfs")
    body = loop.key_by(lambda r: r[1]).process(Reach(), uid="reach")
    loop.close_with(body.filter(lambda r: r[0] == "reach"))
    body.filter(lambda r: r[0] == "out").sink(_sink(out, "reached"), uid="reached")
    return p


def nested(*, n: int = 150, keys: int = 4, out=None, **knobs: Any):
    """A loop inside a loop: record ``(id, a, b)`` runs the inner loop b times, then the outer
    loop sets b = id % 3 + 1 and goes round again until a == 0."""
    p = make_pipeline("nested", **knobs)
    src = p.from_collection([(i, i % 4 + 1, i % 3 + 1) for i in range(n)], uid="nums")
    outer = src.iterate(uid="outer")
    inner = outer.iterate(uid="inner")
    step = inner.key_by(lambda r: r[0] % keys).process(Down(), uid="inner-step")
    inner.close_with(step.filter(lambda r: r[2] > 0))
    after = step.filter(lambda r: r[2] == 0).map(lambda r: (r[0], r[1] - 1, r[0] % 3 + 1))
    outer.close_with(after.filter(lambda r: r[1] > 0))
    after.filter(lambda r: r[1] == 0).sink(_sink(out, "finished"), uid="finished")
    return p


class Down(KeyedProcessFunction):
    def open(self, ctx) -> None:
        self.passes = ctx.state(ValueStateDescriptor("passes", default=0))

    def process(self, value, ctx):
        self.passes.update(self.passes.value() + 1)
        return ((value[0], value[1], value[2] - 1),)


class Halve(KeyedProcessFunction):
    """Counts passes per key; emits (id, x // 2): a record goes round until x == 0."""

    def open(self, ctx) -> None:
        self.passes = ctx.state(ValueStateDescriptor("passes", default=0))

    def process(self, value, ctx):
        self.passes.update(self.passes.value() + 1)
        return ((value[0], value[1] // 2),)


def self_loop(*, n: int = 150, keys: int = 6, out=None, **knobs: Any):
    """A keyed operator fed back into itself, wired on the logical graph (no iterate()):
    its output ``(id, x // 2)`` re-enters it (through a filter) until x == 0."""
    p = make_pipeline("self-loop", **knobs)
    src = p.from_collection([(i, 1 + i % 37) for i in range(n)], uid="nums")
    halve = src.key_by(lambda r: r[0] % keys).process(Halve(), uid="halve")
    again = halve.filter(lambda r: r[1] > 0)
    halve.filter(lambda r: r[1] == 0).sink(_sink(out, "zeros"), uid="zeros")
    node = p._nodes[halve._heads[0].src]
    node.inputs.append(Edge(again._heads[0].src, HASH, lambda r: r[0] % keys))
    return p


CYCLE_BUILDERS = {
    "rounds": rounds,
    "reachability": reachability,
    "nested": nested,
    "self_loop": self_loop,
}
