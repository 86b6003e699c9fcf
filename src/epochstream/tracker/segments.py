"""Segments: the dataflow graph condensed into the units the tracking agent tracks.

Theory of operation. The agent decides "no record of epoch n is left for s" per segment
(paper 000 §4.1). A segment is one logical operator, except that the operators of one
strongly connected component (a cycle) form a single segment: records of a cycle can
stay in flight inside it for any time, and nothing upstream of the cycle can tell when
they stop, so the cycle must be judged as a whole, by its own XOR. Condensing the SCCs
leaves a DAG, so segments can be numbered in topological order and the agent can compute
bounds in one pass from sources to sinks: every edge goes from a segment to itself or to
a later one.

Pure functions, no state. Tarjan's algorithm (``graph.cycles.tarjan``, shared with loop
expansion) is written with an explicit stack, so graphs of any depth work (a path of 100,000
operators is fine; Python's recursion limit would stop a recursive version near 1,000).

Choice: the order of segments is deterministic (Kahn's algorithm over the condensation,
breaking ties by the earliest position of a member in the ``vertices`` argument), so the
same graph always gives the same segment numbers and a source listed first is segment 0.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Collection, Hashable, Iterable, Mapping, Sequence

from ..graph.cycles import tarjan


class SegmentError(ValueError):
    """A graph description that cannot be segmented (unknown or duplicate vertex)."""


@dataclass(frozen=True)
class Segmentation:
    """Segments of a graph in topological order.

    Invariants: ``segment_of[v] == s`` iff ``v in segments[s]``; every edge (a, b) has
    ``segment_of[a] <= segment_of[b]``; ``upstream[s]`` is the set of segments t != s with
    an edge into s (so every member of ``upstream[s]`` is < s).
    """

    #: members of each segment, in the order the vertices were given
    segments: tuple[tuple[Hashable, ...], ...]
    segment_of: Mapping[Hashable, int]
    upstream: tuple[frozenset[int], ...]
    #: True for an SCC of several vertices or a vertex with a self-loop
    cyclic: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.segments)

    @property
    def downstream(self) -> tuple[frozenset[int], ...]:
        out: list[set[int]] = [set() for _ in self.segments]
        for s, ups in enumerate(self.upstream):
            for u in ups:
                out[u].add(s)
        return tuple(frozenset(d) for d in out)

    @property
    def roots(self) -> tuple[int, ...]:
        """Segments nothing flows into from another segment (the sources' segments)."""
        return tuple(s for s, ups in enumerate(self.upstream) if not ups)


def strongly_connected_components(
    vertices: Sequence[Hashable], edges: Iterable[tuple[Hashable, Hashable]]
) -> list[list[Hashable]]:
    """Tarjan's SCCs, iteratively, in Tarjan's output order (reverse topological).

    >>> strongly_connected_components(["a", "b", "c"], [("a", "b"), ("b", "a"), ("b", "c")])
    [['c'], ['b', 'a']]
    """
    index_of = _index(vertices)
    succ: list[list[int]] = [[] for _ in vertices]
    for a, b in edges:
        succ[_lookup(index_of, a, (a, b))].append(_lookup(index_of, b, (a, b)))
    return [[vertices[i] for i in comp] for comp in tarjan(succ)]


def build_segments(vertices: Iterable[Hashable], edges: Iterable[tuple[Hashable, Hashable]],
                   merge: Collection[Hashable] = ()) -> Segmentation:
    """Condense ``(vertices, edges)`` into segments in topological order.

    ``vertices``: distinct hashable ids (logical operators, or chains). ``edges``: pairs
    (src, dst) of ids from ``vertices``; duplicates and self-loops are allowed.
    ``merge``: vertices that may share a segment with their neighbours in ``merge``
    (``merge_groups``: the pass-through chains); vertices of a cycle are never merged.

    >>> s = build_segments(["src", "a", "b", "sink"],
    ...                    [("src", "a"), ("a", "b"), ("b", "a"), ("b", "sink")])
    >>> s.segments
    (('src',), ('a', 'b'), ('sink',))
    >>> s.upstream
    (frozenset(), frozenset({0}), frozenset({1}))
    >>> s.cyclic
    (False, True, False)
    """
    vs = list(vertices)
    es = list(edges)
    position = _index(vs)
    if merge:
        return _merged(vs, es, merge)
    comps = strongly_connected_components(vs, es)
    comp_of: dict[Hashable, int] = {}
    for c, members in enumerate(comps):
        for v in members:
            comp_of[v] = c
    k = len(comps)
    succ: list[set[int]] = [set() for _ in range(k)]
    indeg = [0] * k
    self_loop = [False] * k
    for a, b in es:
        ca, cb = comp_of[a], comp_of[b]
        if ca == cb:
            if a == b:
                self_loop[ca] = True
        elif cb not in succ[ca]:
            succ[ca].add(cb)
            indeg[cb] += 1
    first = [min(position[v] for v in members) for members in comps]
    ready = [(first[c], c) for c in range(k) if indeg[c] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, c = heapq.heappop(ready)
        order.append(c)
        for d in succ[c]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, (first[d], d))
    assert len(order) == k, "the condensation of a graph is acyclic"
    number = {c: s for s, c in enumerate(order)}
    segments = tuple(tuple(sorted(comps[c], key=position.__getitem__)) for c in order)
    segment_of = {v: number[comp_of[v]] for v in vs}
    upstream: list[set[int]] = [set() for _ in range(k)]
    for c in range(k):
        for d in succ[c]:
            upstream[number[d]].add(number[c])
    cyclic = tuple(len(comps[c]) > 1 or self_loop[c] for c in order)
    return Segmentation(segments, segment_of, tuple(frozenset(u) for u in upstream), cyclic)


def chain_graph(plan: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """Vertices and edges of a ``graph.plan.PhysicalPlan`` at the level of chains.

    A task is one subtask of one chain, records enter a chain only at its head, and hops
    inside a chain are function calls (no channel, nothing to track), so a chain is the
    unit the tracker needs: segment ``segment_of[chain.id]`` is what every task of that
    chain reports RCV under and waits a NEOSS for. A loop's phantom channel (loop tail ->
    loop head) is an ordinary out edge here, so the chains of a loop form one cyclic
    segment. (Duck-typed: reads ``plan.chains``,
    ``chain.id`` and ``chain.out_edges[*].dst_chain``.)
    """
    vertices = [c.id for c in plan.chains]
    edges = [(c.id, oe.dst_chain) for c in plan.chains for oe in c.out_edges]
    return vertices, edges


def merge_groups(vertices: Sequence[Hashable], edges: Iterable[tuple[Hashable, Hashable]],
                 merge: Collection[Hashable]) -> list[list[Hashable]]:
    """Groups of ``vertices`` that may be tracked as one segment: an edge between two vertices
    of ``merge`` joins their groups unless that would close a cycle through a vertex outside
    them (another path from one group to the other); a vertex of a cycle stays alone. Groups
    in the order of their first member.

    Why a group may be one segment. The agent's safety argument (agent.py) holds for any
    segment whose condensation stays acyclic: part (2), written for cycles, covers every
    batch that stays inside a segment, whatever its shape. Why it is worth it: a record
    crossing a merged hop is RCVed and its output SNDed under the *same* (segment, epoch),
    so the local tracker folds the two into one report (paper 000 §4.1's local aggregation;
    FlameStream's acker keeps one table for the whole graph). The price: the group is bound
    only when all of it has drained an epoch, so merge only chains that never wait for a
    NEOSS (pass-through chains); then the chains downstream see the same bound as before.

    >>> merge_groups(["src", "a", "b", "c", "sink"],
    ...              [("src", "a"), ("a", "b"), ("b", "c"), ("c", "sink")], {"a", "b", "c"})
    [['src'], ['a', 'b', 'c'], ['sink']]
    >>> merge_groups(["a", "x", "b"], [("a", "x"), ("x", "b"), ("a", "b")], {"a", "b"})
    [['a'], ['x'], ['b']]
    """
    vs = list(vertices)
    es = list(edges)
    position = _index(vs)
    cyclic = set()
    for comp in strongly_connected_components(vs, es):
        if len(comp) > 1:
            cyclic.update(comp)
    cyclic.update(a for a, b in es if a == b)
    parent = list(range(len(vs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    idx = [(_lookup(position, a, (a, b)), _lookup(position, b, (a, b))) for a, b in es]
    ok = [v in merge and v not in cyclic for v in vs]
    for i, j in idx:
        gi, gj = find(i), find(j)
        if gi == gj or not (ok[i] and ok[j]) or _other_path(idx, find, gi, gj):
            continue
        parent[gj] = gi
    groups: dict[int, list[Hashable]] = {}
    for i, v in enumerate(vs):
        groups.setdefault(find(i), []).append(v)
    return list(groups.values())


def _other_path(idx: list[tuple[int, int]], find: Callable[[int], int], gi: int, gj: int) -> bool:
    """Is there a path between groups ``gi`` and ``gj`` (either way) through some third group?
    Then merging them would put that group on a cycle."""
    succ: dict[int, set[int]] = {}
    for a, b in idx:
        ga, gb = find(a), find(b)
        if ga != gb:
            succ.setdefault(ga, set()).add(gb)
    for start, goal in ((gi, gj), (gj, gi)):
        seen = set()
        todo = [g for g in succ.get(start, ()) if g != goal]
        while todo:
            g = todo.pop()
            if g == goal:
                return True
            if g in seen:
                continue
            seen.add(g)
            todo.extend(succ.get(g, ()))
    return False


def _merged(vs: list[Hashable], es: list[tuple[Hashable, Hashable]], merge: Collection[Hashable]) -> Segmentation:
    """``build_segments`` over the quotient graph of ``merge_groups``, members expanded again."""
    groups = merge_groups(vs, es, merge)
    group_of = {v: g for g, members in enumerate(groups) for v in members}
    quotient = build_segments(range(len(groups)),
                              [(group_of[a], group_of[b]) for a, b in es
                               if group_of[a] != group_of[b] or a == b])
    position = {v: i for i, v in enumerate(vs)}
    members_of: dict[Hashable, list[Hashable]] = dict(enumerate(groups))
    segments = tuple(tuple(sorted((v for g in seg for v in members_of[g]), key=position.__getitem__))
                     for seg in quotient.segments)
    segment_of = {v: quotient.segment_of[group_of[v]] for v in vs}
    return Segmentation(segments, segment_of, quotient.upstream, quotient.cyclic)


# ---------------------------------------------------------------- helpers


def _index(vertices: Sequence[Hashable]) -> dict[Hashable, int]:
    index: dict[Hashable, int] = {}
    for i, v in enumerate(vertices):
        if v in index:
            raise SegmentError(f"vertex {v!r} is listed twice (positions {index[v]} and {i})")
        index[v] = i
    return index


def _lookup(index: Mapping[Hashable, int], v: Hashable, edge: tuple[Hashable, Hashable]) -> int:
    try:
        return index[v]
    except KeyError:
        raise SegmentError(f"edge {edge!r} names vertex {v!r}, which is not in the vertex list") from None
