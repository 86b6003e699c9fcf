"""Logical graph -> physical plan: operator chains, channels, key-group routing.

Cycles are cut first (``cycles.expand_loops``): each back edge becomes a loop tail, a
phantom channel and a loop head, so chaining and channel layout below see a DAG.

Operators joined by a *forward* edge run in the same task (a chain, as Flink chains them);
a chain ends where records change subtask (``hash`` by key, ``rebalance``) or where
several inputs meet. Every chain runs at the job's parallelism, and worker ``w`` hosts
subtask ``w`` of every chain (FlameStream's layout): forward channels stay inside a
worker, repartitioning channels cross workers all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .cycles import Loop, expand_loops
from .keygroups import check_parallelism, default_max_parallelism, key_group_range
from .kinds import OpKind

FORWARD, HASH, REBALANCE = "forward", "hash", "rebalance"


@dataclass(frozen=True)
class ColumnKey:
    """The key of ``key_by("col")`` / ``key_by(["a", "b"])``: a column's value, or the tuple of
    several columns' values (a list of names always gives a tuple, even of one column).

    Columnar batches are routed on the columns themselves (``keygroups.key_groups``); a row
    (a dict, as ``RecordBatch.to_pylist`` gives) is keyed by calling this object, which gives
    the same key, so a key lands in the same key group whichever way its record travels.
    """

    columns: tuple[str, ...]
    tuple_key: bool = False

    def __post_init__(self) -> None:
        if not self.columns or not all(isinstance(c, str) and c for c in self.columns):
            raise ValueError(f"key_by needs column names (non-empty strings), got {list(self.columns)!r}")
        if not self.tuple_key and len(self.columns) != 1:
            raise ValueError("a scalar column key names exactly one column")

    def __call__(self, record: Any) -> Any:
        try:
            if self.tuple_key:
                return tuple(record[c] for c in self.columns)
            return record[self.columns[0]]
        except (KeyError, IndexError, TypeError):
            missing = [c for c in self.columns if not (isinstance(record, dict) and c in record)]
            raise KeyError(
                f"key_by column(s) {missing} not in the record {record!r:.200}; key_by with column names needs "
                f"dict records or Arrow batches that have those columns"
            ) from None

    def __str__(self) -> str:
        return repr(list(self.columns)) if self.tuple_key else repr(self.columns[0])


@dataclass
class Edge:
    src: int
    partition: str = FORWARD
    key_fn: Callable[[Any], Any] | None = None
    #: the key's declared type (``key_by(fn, key_type)``), for typed key columns
    key_type: Any = None


@dataclass
class Node:
    """A logical operator; ``kind`` says which (``graph.kinds.OpKind``)."""

    id: int
    kind: OpKind
    name: str
    payload: Any
    uid: str | None = None
    inputs: list[Edge] = field(default_factory=list)


class GraphError(ValueError):
    """A pipeline that cannot be turned into a physical plan."""


def uid_of(node: Node) -> str:
    """The uid of a node that must have one: the API names every source, sink, keyed operator
    and loop (state, offsets and output are stored under it)."""
    if node.uid is None:
        raise GraphError(f"operator {node.name!r} ({node.kind}) has no uid")
    return node.uid


@dataclass(frozen=True)
class OutEdge:
    """An edge leaving a chain: from ``node`` to chain ``dst_chain`` (entering at ``dst_node``)."""

    node: int
    dst_chain: int
    dst_node: int
    partition: str
    key_fn: Callable[[Any], Any] | None
    index: int  # position in the source chain's out_edges
    phantom: bool = False  # loop tail -> loop head


@dataclass(frozen=True)
class Chain:
    id: int
    name: str
    nodes: tuple[int, ...]  # topological order; nodes[0] is a head
    heads: tuple[int, ...]  # nodes fed from outside the chain (or sources)
    out_edges: tuple[OutEdge, ...]
    is_source: bool
    is_loop_head: bool = False


@dataclass(frozen=True)
class Channel:
    """One FIFO channel between two tasks; ``id`` is dense, 0..n-1."""

    id: int
    src: tuple[int, int]  # (chain, subtask)
    dst: tuple[int, int]
    out_edge: int  # index in the source chain's out_edges
    dst_node: int
    #: a loop tail -> loop head channel: never an input the aligner waits on (same worker)
    phantom: bool = False


@dataclass
class PhysicalPlan:
    name: str
    parallelism: int
    max_parallelism: int
    nodes: dict[int, Node]
    chains: list[Chain]
    channels: list[Channel]
    #: chain -> subtask -> out edge index -> channel ids indexed by destination subtask
    outputs: dict[tuple[int, int], list[list[int]]]
    #: task -> its input channel ids
    inputs: dict[tuple[int, int], list[int]]
    #: back edges cut by loop expansion, one head/tail pair each
    loops: tuple[Loop, ...] = ()

    @property
    def tasks(self) -> list[tuple[int, int]]:
        return [(c.id, s) for c in self.chains for s in range(self.parallelism)]

    def key_group_range(self, subtask: int) -> tuple[int, int]:
        return key_group_range(self.max_parallelism, self.parallelism, subtask)

    def worker_of(self, task: tuple[int, int]) -> int:
        return task[1]


def build_plan(name: str, nodes: dict[int, Node], parallelism: int, max_parallelism: int | None) -> PhysicalPlan:
    """Chain the logical graph and lay out channels for ``parallelism`` workers."""
    if max_parallelism is None:
        max_parallelism = default_max_parallelism(parallelism)
    check_parallelism(parallelism, max_parallelism)
    _check_graph(nodes)
    try:
        nodes, loops = expand_loops(nodes, Node, Edge)
    except ValueError as exc:
        raise GraphError(str(exc)) from None

    consumers: dict[int, list[tuple[int, Edge]]] = {nid: [] for nid in nodes}
    for n in nodes.values():
        for e in n.inputs:
            consumers[e.src].append((n.id, e))
    for lp in loops:  # the phantom channel: not an input of the head, so the graph stays acyclic
        consumers[lp.tail].append((lp.head, Edge(lp.tail, FORWARD, None)))

    # A node starts a new chain unless it has exactly one input and that input is forward;
    # a loop head always does (its records come through the phantom channel).
    def is_head(n: Node) -> bool:
        return n.kind == OpKind.LOOP_HEAD or not (len(n.inputs) == 1 and n.inputs[0].partition == FORWARD)

    order = topological_order(nodes)
    chain_of: dict[int, int] = {}
    members: list[list[int]] = []
    for nid in order:
        n = nodes[nid]
        if is_head(n):
            chain_of[nid] = len(members)
            members.append([nid])
        else:
            cid = chain_of[n.inputs[0].src]
            chain_of[nid] = cid
            members[cid].append(nid)

    chains: list[Chain] = []
    for cid, ms in enumerate(members):
        outs: list[OutEdge] = []
        for nid in ms:
            for dst, e in consumers[nid]:
                if chain_of[dst] != cid or is_head(nodes[dst]):
                    phantom = nodes[dst].kind == OpKind.LOOP_HEAD
                    outs.append(OutEdge(nid, chain_of[dst], dst, e.partition, e.key_fn, len(outs), phantom))
        head = nodes[ms[0]]
        chains.append(
            Chain(
                id=cid,
                name=head.name if len(ms) == 1 else " -> ".join(nodes[m].name for m in ms),
                nodes=tuple(ms),
                heads=(ms[0],),
                out_edges=tuple(outs),
                is_source=head.kind == OpKind.SOURCE,
                is_loop_head=head.kind == OpKind.LOOP_HEAD,
            )
        )

    channels: list[Channel] = []
    outputs: dict[tuple[int, int], list[list[int]]] = {
        (c.id, s): [[] for _ in c.out_edges] for c in chains for s in range(parallelism)
    }
    inputs: dict[tuple[int, int], list[int]] = {(c.id, s): [] for c in chains for s in range(parallelism)}
    for c in chains:
        for oe in c.out_edges:
            for s in range(parallelism):
                targets = [s] if oe.partition == FORWARD else list(range(parallelism))
                for d in targets:
                    ch = Channel(len(channels), (c.id, s), (oe.dst_chain, d), oe.index, oe.dst_node, oe.phantom)
                    channels.append(ch)
                    outputs[(c.id, s)][oe.index].append(ch.id)
                    inputs[(oe.dst_chain, d)].append(ch.id)
    return PhysicalPlan(name, parallelism, max_parallelism, dict(nodes), chains, channels, outputs, inputs, loops)


def _check_graph(nodes: dict[int, Node]) -> None:
    uids: dict[str, int] = {}
    for n in nodes.values():
        if n.uid is not None:
            if n.uid in uids:
                raise GraphError(f"operator uid {n.uid!r} is used twice; uids must be unique in a pipeline")
            uids[n.uid] = n.id
        if n.kind in (OpKind.LOOP_HEAD, OpKind.LOOP_TAIL):
            raise GraphError(f"operator {n.name!r}: kind {n.kind!r} is reserved for the planner's loop expansion")
        if n.kind == OpKind.SOURCE and n.inputs:
            raise GraphError(f"source {n.name!r} cannot have inputs")
        if n.kind != OpKind.SOURCE and not n.inputs:
            raise GraphError(f"operator {n.name!r} has no input")
        if n.kind == OpKind.ITERATE and not getattr(n.payload, "closed", True):
            raise GraphError(f"iteration {n.uid!r} was never closed: call close_with(feedback_stream) on it")
        if n.kind == OpKind.PROCESS:
            if any(e.partition != HASH for e in n.inputs):
                raise GraphError(f"operator {n.name!r}: keyed process needs a key_by() before it")
    if not any(n.kind == OpKind.SOURCE for n in nodes.values()):
        raise GraphError("a pipeline needs at least one source")


def topological_order(nodes: dict[int, Node]) -> list[int]:
    """Node ids, every node after its inputs; ties in id order, so the order is the same in
    every process. Raises ``GraphError`` on a cycle (cut loops first: ``cycles.expand_loops``)."""
    indeg = {nid: len(n.inputs) for nid, n in nodes.items()}
    succ: dict[int, list[int]] = {nid: [] for nid in nodes}
    for n in nodes.values():
        for e in n.inputs:
            succ[e.src].append(n.id)
    ready = sorted(nid for nid, d in indeg.items() if d == 0)
    order: list[int] = []
    while ready:
        nid = ready.pop(0)
        order.append(nid)
        for m in succ[nid]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if len(order) != len(nodes):
        cyclic = sorted(nodes[n].name for n, d in indeg.items() if d > 0)
        raise GraphError(f"the graph still has a cycle through {cyclic} after loop expansion")
    return order
