"""Recording the processing order of keyed operators, for the oracle of order-dependent pipelines.

A pipeline that merges streams (``union``, ``rebalance``, several sources, a loop) feeds each
key's records to a keyed operator in an order that depends on timing, so its output and
state legitimately differ between runs (a running count that carries record ids). The
oracle can still judge such a run exactly if it knows the order each key's records were
processed in the epochs that committed: it replays the sequential reference in that order.

``record_order(pipeline)`` rewrites a pipeline so that every keyed ``process`` operator (a
``KeyedProcessFunction``; batch and columnar functions are left as they are) also emits a
``TraceEntry(key, record)`` for each record it processes, before the record's own output.
Two filters split the operator's output: real records go on to its consumers, the entries
to a ``FileSink`` of the operator's own (uid ``<operator uid>~order``). That sink is
transactional like any other, so the order log commits exactly with the epoch whose state
it describes: an aborted epoch's entries are dropped, a committed one's survive recovery,
and the log of epoch n sits in ``part-e<n>-...`` files. Within a file, lines are in
processing order, and a key is processed by one subtask per epoch, so a key's order is
(epoch, line). Records are pickled when they are processed, so a function that mutates its
input in place does not change what was logged.

``read_orders`` reads the committed log back: operator uid -> epoch -> [(key, record)].
``record_id`` gives records a hashable identity that survives pickling between processes
(sets and dicts sorted, lists and tuples in order), to match logged records with the ones
the reference produces.
"""

from __future__ import annotations

import base64
import copy
import pickle
from typing import Any

from .graph.kinds import OpKind
from .graph.plan import Edge, Node, uid_of
from .runtime.traits import OperatorTraits

#: suffix of the uid of an operator's order log sink (``~`` cannot be produced by ``safe_name``
#: collisions: it is not percent-encoded and no default uid contains it)
ORDER_SUFFIX = "~order"


class TraceEntry:
    """One record a keyed operator processed, with its key, pickled when it was processed."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return (TraceEntry, (self.data,))


def encode_entry(entry: TraceEntry) -> str:
    """The order log's line format: base64 of the pickled ``(key, record)``."""
    return base64.b64encode(entry.data).decode("ascii")


def decode_entry(line: str) -> tuple[Any, Any]:
    key, record = pickle.loads(base64.b64decode(line))
    return key, record


def _is_entry(record: Any) -> bool:
    return type(record) is TraceEntry


def _not_entry(record: Any) -> bool:
    return type(record) is not TraceEntry


class Recording:
    """A ``KeyedProcessFunction`` that logs each record it processes, then runs the wrapped one.

    Everything else (``open``, ``on_timer``, ``on_epoch_end``, ``uses_event_time``, state
    declarations) is the wrapped function's: attributes are looked up on it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # while unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __deepcopy__(self, memo: dict) -> "Recording":
        return Recording(copy.deepcopy(self.inner, memo))

    def open(self, ctx: Any) -> None:
        self.inner.open(ctx)

    def process(self, value: Any, ctx: Any) -> Any:
        entry = TraceEntry(pickle.dumps((ctx.key, value), protocol=4))
        res = self.inner.process(value, ctx)
        if res is None:
            return (entry,)
        if type(res) in (str, bytes, dict):
            return res  # the chain raises its usual TypeError for it
        return [entry, *res]


def recordable(fn: Any) -> bool:
    """Row-at-a-time keyed functions are recorded; batch and columnar ones process a whole
    batch per call, and the reference replays those in arrival order (strict)."""
    traits = OperatorTraits.of(fn)
    return not (traits.applies_batches or traits.columnar_keyed)


def record_order(pipeline: Any, root: Any) -> tuple[Any, dict[str, str]]:
    """A copy of ``pipeline`` whose recordable keyed operators log their processing order to
    ``FileSink(root / <log uid>)``. Returns (the copy, operator uid -> log sink uid)."""
    from .backends.sinks import FileSink

    clone = copy.copy(pipeline)
    nodes: dict[int, Node] = {nid: Node(n.id, n.kind, n.name, n.payload, n.uid, [copy.copy(e) for e in n.inputs])
                              for nid, n in pipeline._nodes.items()}
    logs: dict[str, str] = {}
    next_id = max(nodes) + 1 if nodes else 0
    for nid in sorted(pipeline._nodes):
        n = nodes[nid]
        if n.kind != OpKind.PROCESS or not recordable(n.payload):
            continue
        uid = uid_of(n)
        out_id, log_filter_id, sink_id = next_id, next_id + 1, next_id + 2
        next_id += 3
        for other in nodes.values():  # the operator's consumers now read its real records
            for e in other.inputs:
                if e.src == nid:
                    e.src = out_id
        n.payload = Recording(n.payload)
        nodes[out_id] = Node(out_id, OpKind.FILTER, f"{n.name} records", _not_entry, f"{uid}~records",
                             [Edge(nid)])
        nodes[log_filter_id] = Node(log_filter_id, OpKind.FILTER, f"{n.name} order", _is_entry, f"{uid}~entries",
                                    [Edge(nid)])
        log_uid = uid + ORDER_SUFFIX
        nodes[sink_id] = Node(sink_id, OpKind.SINK, f"{n.name} order log",
                              FileSink(root / log_uid, encode_entry, decode_entry), log_uid, [Edge(log_filter_id)])
        logs[uid] = log_uid
    clone._nodes = nodes
    return clone, logs


def read_orders(sink_root: Any, logs: dict[str, str]) -> dict[str, dict[int, list[tuple[Any, Any]]]]:
    """The committed order logs: operator uid -> epoch -> [(key, record)] in processing order."""
    from .backends.sinks import FileSink

    out: dict[str, dict[int, list[tuple[Any, Any]]]] = {}
    for uid, log_uid in logs.items():
        reader = FileSink(sink_root / log_uid, encode_entry, decode_entry)
        per_epoch: dict[int, list[tuple[Any, Any]]] = {}
        for loc in reader.committed_files():
            epoch = int(loc.name.split("-")[1][1:])
            per_epoch.setdefault(epoch, []).extend(decode_entry(line) for line in reader.read_lines(loc))
        out[uid] = per_epoch
    return out


_SCALARS = (str, int, float, bool, bytes, type(None))


def record_id(value: Any) -> Any:
    """A hashable identity of a record, equal for equal records in any process: lists and
    tuples keep their order, sets and dicts are sorted (their iteration order follows the
    process's hash seed), other objects are identified by their pickle."""
    t = type(value)
    if t is str or t is int:  # fast paths, untagged: every tagged form is a tuple holding a tuple
        return value
    if t is tuple and all(type(v) is str or type(v) is int for v in value):
        return value
    if t in _SCALARS:
        return (t.__name__, value)
    if t is tuple or t is list:
        return (t.__name__, tuple(record_id(v) for v in value))
    if t is dict:
        return ("dict", tuple(sorted(((record_id(k), record_id(v)) for k, v in value.items()), key=repr)))
    if t is set or t is frozenset:
        return (t.__name__, tuple(sorted((record_id(v) for v in value), key=repr)))
    return ("object", t.__qualname__, pickle.dumps(value, protocol=4))
