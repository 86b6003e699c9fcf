"""Cycles in the logical graph: strongly connected components, back edges, loop expansion.

Theory of operation (thesis 003 §3.4.4.4, "Cyclic State"). Barrier alignment needs an
acyclic graph: a task forwards marker n only once marker n has arrived on every input,
so a cycle would wait for itself. A cycle is therefore cut open at one edge per loop, the
*back edge*, which is replaced by two operators joined by a *phantom channel*:

- the *loop tail*, chained behind the back edge's source, hands the loop's records (and,
  in aligned mode, its markers) to the phantom channel;
- the *loop head*, a task of its own on the same worker, takes them from the phantom
  channel and forwards them to the back edge's destination (the loop's *entry*), with the
  back edge's partitioning.

The head has no input edge in the expanded graph (the phantom channel is kept out of the
node inputs), so the graph is acyclic: markers start at the sources and at the loop heads,
which the coordinator triggers like sources (``loops.head`` logs what comes back through
the phantom channel while an epoch is open: Algorithm 7). In tracker mode the phantom
channel is an ordinary channel and the loop is one segment (``tracker.segments``).

Back edges. A depth-first search from the sources (in node-id order) marks an edge
``u -> v`` as a back edge when ``v`` is on the search stack: ``v`` is then an ancestor of
``u``, so the edge closes a cycle, and ``v`` is the first node of that cycle the search
reached (for ``Stream.iterate()`` loops that is always the iterate node, since the body is
reached only through it). Removing every back edge of a depth-first search leaves a DAG,
whatever the graph, so arbitrary cycles (several entries, self-loops, loops inside loops)
are all cut; nested loops get one head per back edge. Tarjan's algorithm groups nodes
into strongly connected components, which name each loop's members.

Pure functions, no state; iterative (no recursion limit on deep graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # plan imports this module; the types are only for the checker
    from .plan import Edge, Node

from .kinds import OpKind


@dataclass(frozen=True)
class Loop:
    """One back edge of the logical graph and the head/tail pair that replaced it.

    ``uid`` names the head: its log of in-transit records is stored as that operator's
    state, so it must stay the same across runs of the same pipeline code.
    """

    index: int
    src: int  # logical node the back edge leaves (inside the loop)
    dst: int  # the loop's entry (the back edge's destination)
    edge: int  # position of the back edge in ``nodes[dst].inputs``
    head: int  # node id of the loop head in the expanded graph
    tail: int  # node id of the loop tail
    uid: str
    members: tuple[int, ...]  # the strongly connected component holding the back edge, sorted


def tarjan(succ: Sequence[Sequence[int]]) -> list[list[int]]:
    """Strongly connected components of the graph ``i -> succ[i]`` over ``0..len(succ)-1``,
    in Tarjan's output order (reverse topological), with an explicit stack.

    >>> tarjan([[1], [0, 2], []])
    [[2], [1, 0]]
    """
    n = len(succ)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] != -1:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        work = [(root, 0)]  # (vertex, next successor to look at): the recursion, made explicit
        while work:
            v, i = work[-1]
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp: list[int] = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def back_edges(nodes: Mapping[int, Node]) -> list[tuple[int, int, int]]:
    """Back edges ``(src, dst, position in dst.inputs)`` of a depth-first search from the
    sources, in discovery order; ``nodes``: id -> ``graph.plan.Node``.

    Raises ``ValueError`` naming the operators no source reaches (a cycle nothing feeds).
    """
    succ: dict[int, list[tuple[int, int]]] = {nid: [] for nid in nodes}
    for nid in sorted(nodes):
        for i, e in enumerate(nodes[nid].inputs):
            succ[e.src].append((nid, i))
    WHITE, GREY, BLACK = 0, 1, 2
    color = {nid: WHITE for nid in nodes}
    found: list[tuple[int, int, int]] = []
    for root in sorted(nid for nid, n in nodes.items() if n.kind == OpKind.SOURCE):
        if color[root] != WHITE:
            continue
        color[root] = GREY
        work = [(root, 0)]
        while work:
            u, i = work[-1]
            if i < len(succ[u]):
                work[-1] = (u, i + 1)
                v, pos = succ[u][i]
                if color[v] == GREY:
                    found.append((u, v, pos))
                elif color[v] == WHITE:
                    color[v] = GREY
                    work.append((v, 0))
                continue
            color[u] = BLACK
            work.pop()
    unreached = sorted(nid for nid, c in color.items() if c == WHITE)
    if unreached:
        names = [nodes[nid].uid or nodes[nid].name for nid in unreached]
        raise ValueError(f"operators {names} are not reachable from any source (a cycle that nothing feeds?)")
    return found


def loop_components(nodes: Mapping[int, Node]) -> list[list[int]]:
    """The strongly connected components that are loops (several nodes, or a self-loop)."""
    ids = sorted(nodes)
    pos = {nid: i for i, nid in enumerate(ids)}
    succ: list[list[int]] = [[] for _ in ids]
    self_loop = set()
    for nid in ids:
        for e in nodes[nid].inputs:
            succ[pos[e.src]].append(pos[nid])
            if e.src == nid:
                self_loop.add(nid)
    comps = [sorted(ids[i] for i in c) for c in tarjan(succ)]
    return sorted((c for c in comps if len(c) > 1 or c[0] in self_loop), key=lambda c: c[0])


def expand_loops(nodes: Mapping[int, Node], node_factory: type[Node],
                 edge_factory: type[Edge]) -> tuple[dict[int, Node], tuple[Loop, ...]]:
    """Replace every back edge by a loop head and a loop tail (a new dict; ``nodes`` is not
    changed). ``node_factory``/``edge_factory`` build ``graph.plan.Node``/``Edge`` values.

    The tail joins the back edge's source with a forward edge (so it is chained into the
    source's task), the head feeds the entry with the back edge's partitioning, and the
    head has no inputs: the phantom channel tail -> head is added by the planner.
    """
    found = back_edges(nodes)
    if not found:
        return dict(nodes), ()
    comps = loop_components(nodes)
    comp_of = {nid: tuple(c) for c in comps for nid in c}
    out = {nid: node_factory(n.id, n.kind, n.name, n.payload, n.uid, list(n.inputs)) for nid, n in nodes.items()}
    next_id = max(nodes) + 1
    loops: list[Loop] = []
    used = {n.uid for n in nodes.values() if n.uid}
    for k, (u, v, pos) in enumerate(found):
        entry = out[v]
        back = entry.inputs[pos]
        uid = f"{entry.uid}/loop-head" if entry.uid else f"loop-head-{v}"
        if sum(1 for (_u, vv, _p) in found if vv == v) > 1:
            uid += f"-{pos}"  # an entry with several back edges gets one head per edge
        if uid in used:
            raise ValueError(f"loop head uid {uid!r} collides with an operator uid; rename that operator")
        used.add(uid)
        tail_id, head_id = next_id, next_id + 1
        next_id += 2
        src = out[u]
        out[tail_id] = node_factory(tail_id, OpKind.LOOP_TAIL, f"loop-tail({src.uid or src.name})", k, None,
                                    [edge_factory(u)])
        out[head_id] = node_factory(head_id, OpKind.LOOP_HEAD, f"loop-head({entry.uid or entry.name})", k, uid, [])
        entry.inputs[pos] = edge_factory(head_id, back.partition, back.key_fn)
        loops.append(Loop(k, u, v, pos, head_id, tail_id, uid, comp_of.get(v, (v,))))
    return out, tuple(loops)
