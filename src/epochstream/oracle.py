"""The exactly-once oracle: does a run with failures commit what a run without them would?

Three checks, none of which assumes one interleaving of channels:

1. **Output**: the committed output of the chaos run equals, as a multiset, the committed
   output of a failure-free run (no record lost, none duplicated).
2. **Output per epoch** (exactly-once modes): for every completed epoch n, the output
   committed in files of epochs <= n equals the output a sequential execution produces
   from exactly the input prefix named by epoch n's source offsets.
3. **State per epoch**: the committed keyed state of every operator at epoch n equals the
   state of that sequential execution. Lists compare as multisets, since records of one
   key from different splits may interleave either way; everything else compares exactly,
   so state must not depend on the cross-split arrival order beyond list order.

The sequential reference runs the logical graph in one thread with fresh copies of the
user functions: the semantics the job promises, with no epochs, channels or failures.
With event time, the reference fires each operator's timers up to the time label the
manifest of epoch n records for it, after epoch n's records (timers commute with records
of later timestamps, as in Flink), and all of them at the end of bounded input. In unaligned
mode the subtasks of one operator snapshot at different event times (a marker overtakes
watermarks too), so each key's timers fire up to the label of the subtask that held the key.

Cycles. The reference runs a loop to its fixpoint: records move through a FIFO work list,
so every chunk of input (and everything it feeds back) is processed before the next. In
aligned mode an epoch's cut goes through a loop (thesis Algorithm 7): the committed state
of epoch n has not seen the records in transit on the back edge, which the loop heads
logged instead. So the check for epoch n first *completes* the committed epoch: it loads
the committed state into a fresh reference, feeds the logged records in at the back
edges, and runs the loop to its fixpoint; that state, and the committed output plus what
the completion emitted, must equal the reference over the epoch's input prefix. A log
that missed or doubled a record shows up there. In tracker mode the logs are empty (an
epoch ends when its loop has drained), so the committed state itself must match.
Per-epoch comparisons need loops whose fixpoint does not depend on the order records go
round (a count, a minimum, a set); outputs compare as multisets.

Channel state (unaligned mode). The snapshot of epoch n has not seen the records its markers
overtook; they are stored with it as channel state. The completion feeds them in too, each at
the node and input edge its channel enters (``channel_state_records``). With the recorded
order, keyed operators already process each key's records in the logged order (channel state
is processed, and logged, in epoch n + 1), so there the completion holds those operators
back and completes the others (``recorded_completion``); records that reached a keyed operator in the
reference but no committed epoch are not counted as missing at a cut with channel state.
"""

from __future__ import annotations

import base64
import collections
import copy
import os
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .alignment.channel_state import decode_channel_state
from .graph.cycles import back_edges
from .graph.keygroups import assign_key_to_operator, canonical_key
from .graph.kinds import OpKind
from .graph.plan import Node, PhysicalPlan, topological_order, uid_of
from .recorded_order import read_orders, record_id, record_order
from .runtime.columns import as_record_batch, from_rows, to_rows
from .runtime.context import Context
from .runtime.messages import END_OF_TIME
from .runtime.modes import implications
from .runtime.state import HeapKeyedState, OperatorStateBackend
from .runtime.timers import TimerService
from .runtime.traits import OperatorTraits
from .runtime.watermarks import LateRecord, SplitWatermarks

if TYPE_CHECKING:  # the sinks module imports backends, which the oracle loads only when it reads output
    from .backends.sinks import FileSink

# ---------------------------------------------------------------- sequential reference



@dataclass(frozen=True)
class SubtaskTime:
    """How far event time got in each subtask of one operator at a committed epoch."""

    parallelism: int
    max_parallelism: int
    labels: dict[int, int]  # subtask -> time label

    def watermark(self, slack: float, key: Any) -> float:
        """The watermark the subtask holding ``key`` had reached."""
        subtask = assign_key_to_operator(key, self.max_parallelism, self.parallelism)
        label = self.labels.get(subtask)
        return float("-inf") if label is None else (label + 1) * slack


def manifest_event_time(manifest: dict[str, Any]) -> tuple[dict[str, int], dict[str, SubtaskTime]]:
    """A committed epoch's event time per operator (the lowest of its subtasks') and per
    subtask, as ``Reference.feed`` takes them."""
    low: dict[str, int] = {}
    per_subtask: dict[str, SubtaskTime] = {}
    p, max_p = int(manifest["parallelism"]), int(manifest["max_parallelism"])
    for uid, op in manifest["operators"].items():
        if "event_time" not in op:
            continue
        low[uid] = op["event_time"]
        if op.get("event_time_subtasks"):
            per_subtask[uid] = SubtaskTime(p, max_p, {int(k): int(v) for k, v in op["event_time_subtasks"].items()})
    return low, per_subtask


class Reference:
    """A sequential execution of the pipeline that can be fed its input prefix by prefix.

    Feeding offsets o1 <= o2 <= ... processes each source's new records (per split, from the
    previous offset to the new one) through the whole graph in one thread. Any such order is
    a valid sequential execution: the checks compare multisets and order-normalized state.
    """

    def __init__(self, pipeline) -> None:
        self.nodes: dict[int, Node] = pipeline._nodes
        self.order = _acyclic_order(self.nodes)
        #: records waiting to enter a node: (node, records, input edge); FIFO to a fixpoint
        self._work: collections.deque[tuple[Node, list[Any], int]] = collections.deque()
        self.consumers: dict[int, list[tuple[Node, int]]] = {nid: [] for nid in self.nodes}
        for n in self.nodes.values():
            for i, e in enumerate(n.inputs):
                self.consumers[e.src].append((n, i))
        self.offsets: dict[str, dict[int, int]] = {}
        self.sinks: dict[str, list[Any]] = {n.uid: [] for n in self.nodes.values() if n.kind == OpKind.SINK}
        self.states: dict[str, HeapKeyedState] = {}
        self.fns: dict[int, tuple[Any, Context]] = {}
        #: per keyed node id: what its function can do (``runtime.traits``), read once
        self.traits: dict[int, OperatorTraits] = {}
        event_time = any(getattr(n.payload, "timestamp", None) is not None
                         for n in self.nodes.values() if n.kind == OpKind.SOURCE)
        self.slack = pipeline.tracker.time_slack
        #: keyed operators replayed in a recorded order (``follow``): uid -> their gate
        self._gates: dict[str, _OrderGate] = {}
        self.timers: dict[int, TimerService] = {}
        #: sources with bounded out-of-orderness: node id -> the late-record rule's state
        self._watermarks: dict[int, SplitWatermarks] = {}
        for n in self.nodes.values():
            if n.kind == OpKind.PROCESS:
                state = HeapKeyedState(n.uid, lambda k: 0, (0, 0))
                fn = copy.deepcopy(n.payload)
                traits = self.traits[n.id] = OperatorTraits.of(fn)
                timers = None
                if event_time and traits.uses_event_time:
                    timers = self.timers[n.id] = TimerService(state)
                # one subtask: operator state is there for functions that use it, and not checked
                ctx = Context(state, 0, 1, n.uid, timers, OperatorStateBackend(n.uid, 0))
                fn.open(ctx)
                self.states[n.uid] = state
                self.fns[n.id] = (fn, ctx)

    def feed(self, offsets: dict[str, dict[int, int]] | None, event_time: dict[str, int] | None = None,
             subtask_time: dict[str, SubtaskTime] | None = None) -> None:
        """Advance every source to ``offsets`` (None: to the end of bounded sources), then
        fire timers up to ``event_time`` (operator uid -> time label; all at the end). With
        ``subtask_time`` (``manifest_event_time``), each key's timers fire up to the label of
        the subtask that held the key."""
        for n in self.nodes.values():
            if n.kind != OpKind.SOURCE:
                continue
            src = n.payload
            if offsets is None:
                target = {s: src.split_length(s) for s in src.split_ids()}
                if any(v is None for v in target.values()):
                    raise ValueError(f"source {n.uid!r} is unbounded: the reference needs offsets")
            else:
                target = offsets.get(uid_of(n), {})
            done = self.offsets.setdefault(uid_of(n), {})
            for split in src.split_ids():
                first = src.start_offset(split)  # a Kafka source's resolved start
                start, stop = done.get(split, first), target.get(split, first)
                if stop > start:
                    self._push(n, self._on_time(n, split, src.read_range(split, start, stop)))
                    done[split] = stop
        for nid in self.order:  # topological: timer output reaches later operators' timers in time
            timers = self.timers.get(nid)
            if timers is None:
                continue
            node = self.nodes[nid]
            label = END_OF_TIME if offsets is None else (event_time or {}).get(uid_of(node))
            if label is None:
                continue
            fn, ctx = self.fns[nid]
            out: list[Any] = []

            def on_timer(ts: float, fn=fn, ctx=ctx, out=out) -> None:
                res = fn.on_timer(ts, ctx)
                if res is not None:
                    out.extend(res)

            watermark = float("inf") if label >= END_OF_TIME else (label + 1) * self.slack
            per_subtask = None if offsets is None else (subtask_time or {}).get(uid_of(node))
            if per_subtask is not None and len(set(per_subtask.labels.values())) > 1:
                ceiling = (max(per_subtask.labels.values()) + 1) * self.slack
                timers.advance_keys(label, watermark, partial(per_subtask.watermark, self.slack), ceiling, on_timer)
            else:
                timers.advance(label, watermark, on_timer)
            if out:
                for consumer, i in self.consumers[nid]:
                    self._push(consumer, out, i)

    def _on_time(self, node: Node, split: int, records: Any) -> Any:
        """The records a source with bounded out-of-orderness does not drop as late: the
        same per-split rule the readers apply (``runtime.watermarks``), fed in offset order."""
        src = node.payload
        delay = getattr(src, "max_out_of_orderness", None)
        if delay is None or src.timestamp is None:
            return records
        if type(records) is not list:  # a columnar read: event time reads rows
            records = records.to_pylist()
        wm = self._watermarks.get(node.id)
        if wm is None:
            wm = self._watermarks[node.id] = SplitWatermarks(self.slack, delay, src.split_ids())
        if src.late_output:  # late records go on to the side output, as the reader sends them
            return [r if wm.admit(split, src.timestamp(r), int(src.timestamp(r) // self.slack), -1)
                    else LateRecord(r) for r in records]
        return [r for r in records if wm.admit(split, src.timestamp(r), int(src.timestamp(r) // self.slack), -1)]

    def inject(self, node_id: int, edge: int, records: list[Any]) -> None:
        """Feed ``records`` into node ``node_id`` through its input ``edge`` (a back edge:
        the records a loop head logged) and run to the fixpoint."""
        self._push(self.nodes[node_id], records, edge)

    # ------------------------------------------------------------ recorded order
    def follow(self, uid: str, entries: list[tuple[Any, Any]]) -> None:
        """Process operator ``uid``'s records in the recorded order: ``entries`` (key, record)
        are appended to what it must process next. From the first call on, records reaching
        the operator wait per key until the log names them; logged records that already
        wait are processed now (a loop's records in transit at the previous epoch)."""
        gate = self._gates.get(uid)
        if gate is None:
            nid = next(n.id for n in self.nodes.values() if n.kind == OpKind.PROCESS and uid_of(n) == uid)
            gate = self._gates[uid] = _OrderGate(nid)
        touched = set()
        for key, record in entries:
            kid = record_id(key)
            gate.expected.setdefault(kid, collections.deque()).append((record_id(record), key))
            touched.add(kid)
        self._release(gate, touched)

    def settle(self) -> tuple[list[tuple[str, Any, Any]], dict[str, int]]:
        """After an epoch's input: logged records the reference never produced are skipped
        (a duplicate, or a record the job made up); returns them as (uid, key, record), and
        per operator how many produced records still wait (not processed by any committed
        epoch: lost, or in transit in a loop)."""
        unexpected: list[tuple[str, Any, Any]] = []
        by_node = {g.node_id: (uid, g) for uid, g in self._gates.items()}
        for nid in self.order:  # upstream first: releasing there can feed what blocks below
            if nid not in by_node:
                continue
            uid, gate = by_node[nid]
            while True:
                blocked = [kid for kid, q in gate.expected.items()
                           if q and not gate.pending.get(kid, {}).get(q[0][0])]
                if not blocked:
                    break
                for kid in blocked:
                    rid, key = gate.expected[kid].popleft()
                    unexpected.append((uid, key, rid))
                self._release(gate, set(blocked))
        waiting = {uid: sum(len(v) for by_id in g.pending.values() for v in by_id.values())
                   for uid, g in self._gates.items()}
        return unexpected, waiting

    def ungate(self) -> None:
        """Stop following the recorded order: process what still waits, in arrival order, and
        everything that arrives from now on (after the last epoch: the effects lost records
        would have had, so the output comparison counts them too)."""
        by_node = {g.node_id: g for g in self._gates.values()}
        self._gates = {}
        for nid in self.order:
            gate = by_node.get(nid)
            if gate is None:
                continue
            node = self.nodes[nid]
            fn, ctx = self.fns[nid]
            keyslot = self.states[uid_of(node)].keys
            out: list[Any] = []
            for by_id in gate.pending.values():
                for recs in by_id.values():
                    for record, key in recs:
                        keyslot.key = key
                        res = fn.process(record, ctx)
                        if res is not None:
                            out.extend(res)
            gate.pending.clear()
            if out:
                for consumer, i in self.consumers[nid]:
                    self._push(consumer, out, i)

    def waiting_records(self, uid: str) -> list[Any]:
        gate = self._gates.get(uid)
        if gate is None:
            return []
        return [r for by_id in gate.pending.values() for recs in by_id.values() for r, _key in recs]

    def _release(self, gate: "_OrderGate", kids: set[Any]) -> None:
        node = self.nodes[gate.node_id]
        fn, ctx = self.fns[gate.node_id]
        keyslot = self.states[uid_of(node)].keys
        out: list[Any] = []
        for kid in kids:
            q = gate.expected.get(kid)
            waiting = gate.pending.get(kid)
            while q and waiting:
                recs = waiting.get(q[0][0])
                if not recs:
                    break
                q.popleft()
                record, key = recs.pop(0)
                keyslot.key = key
                res = fn.process(record, ctx)
                if res is not None:
                    out.extend(res)
            if waiting is not None:
                for rid in [r for r, v in waiting.items() if not v]:
                    del waiting[rid]
        if out:
            for consumer, i in self.consumers[gate.node_id]:
                self._push(consumer, out, i)

    def restore(self, storage, manifest: dict[str, Any], root: Path) -> None:
        """Start from a committed epoch's keyed state instead of empty state."""
        for uid, st in self.states.items():
            entry = manifest["operators"].get(uid)
            if entry is not None:
                st.restore_rows(storage.read_operator_rows(manifest, root, uid), entry.get("states", {}))

    def _push(self, node: Node, records: list[Any], edge: int = 0) -> None:
        work = self._work
        work.append((node, records, edge))
        if len(work) > 1:
            return  # an outer call is draining the work list
        while work:
            self._apply(*work[0])
            work.popleft()

    def _apply(self, node: Node, records: Any, edge: int) -> None:
        kind = node.kind
        if kind == OpKind.MAP_BATCHES and OperatorTraits.of(node.payload).takes_any_records:
            res = node.payload(records)  # from_json, side-output splitters: records as they come
            for part in res if type(res) is tuple else (res,):
                if part is not None and len(part):
                    for consumer, i in self.consumers[node.id]:
                        self._work.append((consumer, part, i))
            return
        if kind == OpKind.MAP_BATCHES:  # rows in become one batch, as in the chain
            batch = from_rows(records, node.name) if type(records) is list else records
            out = as_record_batch(node.payload(batch), node.name)
            if out is not None and out.num_rows:
                for consumer, i in self.consumers[node.id]:
                    self._work.append((consumer, out, i))
            return
        if kind == OpKind.PROCESS and self.traits[node.id].columnar_keyed:
            fn, ctx = self.fns[node.id]
            out = fn.apply(records, self.states[uid_of(node)].keys, ctx, node.uid)
            if out is not None:
                for consumer, i in self.consumers[node.id]:
                    self._work.append((consumer, out, i))
            return
        if type(records) is not list and kind not in (OpKind.SOURCE, OpKind.ITERATE):
            records = to_rows(records)  # row operators take a RecordBatch as dict rows, as in the chain
        if kind in (OpKind.SOURCE, OpKind.ITERATE):
            out = records
        elif kind == OpKind.MAP:
            out = [node.payload(r) for r in records]
        elif kind == OpKind.FILTER:
            out = [r for r in records if node.payload(r)]
        elif kind == OpKind.FLAT_MAP:
            out = [o for r in records for o in node.payload(r)]
        elif kind == OpKind.SINK:
            self.sinks[uid_of(node)].extend(records)
            return
        elif kind == OpKind.PROCESS:
            fn, ctx = self.fns[node.id]
            keyslot = self.states[uid_of(node)].keys
            key_fn = node.inputs[edge].key_fn
            assert key_fn is not None, f"keyed operator {node.name!r} without a key function"
            gate = self._gates.get(uid_of(node))
            if gate is not None:  # wait for the recorded order
                kids = set()
                for r in records:
                    key = key_fn(r)
                    kid = record_id(key)
                    gate.pending.setdefault(kid, {}).setdefault(record_id(r), []).append((r, key))
                    kids.add(kid)
                self._release(gate, kids)
                return
            traits = self.traits[node.id]
            if traits.applies_batches:  # batch-at-a-time keyed functions (the PySpark wrappers)
                res = fn.apply_batch(records, [key_fn(r) for r in records], ctx)
                # a wrapper's pandas output is one RecordBatch: rows of it, as the chain makes them
                out = [] if res is None else res if type(res) is list else to_rows(res)
                drain = fn.drain_input if traits.drains_input else None
                if drain is not None:  # it keeps input for one call per key per epoch: run it now
                    res = drain(ctx)
                    out += [] if res is None else res if type(res) is list else to_rows(res)
                records = ()
            else:
                out = []
            for r in records:
                keyslot.key = canonical_key(key_fn(r))
                res = fn.process(r, ctx)
                if res is not None:
                    out.extend(res)
        else:
            raise ValueError(f"reference run: unknown operator kind {kind!r}")
        if out:
            for consumer, i in self.consumers[node.id]:
                self._work.append((consumer, out, i))

    def state(self) -> dict[str, dict]:
        return {uid: st.as_dict() for uid, st in self.states.items()}


@dataclass
class _OrderGate:
    """What one keyed operator of the reference must process next, and what waits for it."""

    node_id: int
    #: key id -> (record id, key) in the recorded order, not yet processed
    expected: dict[Any, collections.deque] = field(default_factory=dict)
    #: key id -> record id -> [(record, key)] produced upstream, not yet processed
    pending: dict[Any, dict[Any, list[tuple[Any, Any]]]] = field(default_factory=dict)


def _acyclic_order(nodes: dict[int, Node]) -> list[int]:
    """A topological order of the graph with its back edges cut (loops run to a fixpoint)."""
    cut = {(v, pos) for _u, v, pos in back_edges(nodes)}
    if not cut:
        return topological_order(nodes)
    dag = {nid: Node(n.id, n.kind, n.name, n.payload, n.uid,
                     [e for i, e in enumerate(n.inputs) if (nid, i) not in cut]) for nid, n in nodes.items()}
    return topological_order(dag)


def reference_run(pipeline, offsets: dict[str, dict[int, int]] | None = None) -> tuple[dict, dict]:
    """Run the pipeline sequentially over a prefix of its sources (None: all bounded input).

    Returns (sink uid -> records, process uid -> {state name: {key: value}}).
    """
    ref = Reference(pipeline)
    ref.feed(offsets)
    return ref.sinks, ref.state()


# ---------------------------------------------------------------- comparison helpers


def canonical(value: Any) -> Any:
    """A hashable, order-normalized form: lists become sorted multisets."""
    if isinstance(value, list):
        return ("list", tuple(sorted((canonical(v) for v in value), key=repr)))
    if isinstance(value, tuple):
        return ("tuple", tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((canonical(k), canonical(v)) for k, v in value.items()), key=repr)))
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted((canonical(v) for v in value), key=repr)))
    return value


def _encoded(records: list[Any], encoder: Callable[[Any], str]) -> collections.Counter:
    """Records as the sink writes them: the oracle compares the sink's own lines."""
    return collections.Counter(map(encoder, records))


def _committed(sink_root: Any) -> "FileSink":
    """A reader of the committed files under ``sink_root`` (a local folder or an S3 prefix)."""
    from .backends.sinks import FileSink

    return FileSink(sink_root)


def _read_lines(sink_root: Any) -> collections.Counter:
    reader = _committed(sink_root)
    c: collections.Counter = collections.Counter()
    for loc in reader.committed_files():
        c.update(reader.read_lines(loc))
    return c


def _epoch_of(path: Any) -> int:
    return int(path.name.split("-")[1][1:])


def _sink_lines_by_epoch(sink: Any, sink_root: Any) -> dict[int, collections.Counter]:
    """Committed output of one sink per epoch: FileSink part files, or the sink's own reader
    (a Delta sink reads its table at each epoch's version: time travel, not files)."""
    by_epoch = getattr(sink, "committed_lines_by_epoch", None)
    if by_epoch is not None:
        return by_epoch()
    return _lines_by_epoch(sink_root)


def _sink_lines(sink: Any, sink_root: Any) -> collections.Counter:
    if getattr(sink, "committed_lines_by_epoch", None) is None:
        return _read_lines(sink_root)
    total: collections.Counter = collections.Counter()
    for c in sink.committed_lines_by_epoch().values():
        total.update(c)
    return total


class _SinkProgress:
    """One sink's committed output of epochs <= n against the reference's output so far, as
    encoded lines; both grow epoch by epoch (strict and recorded-order checks share it)."""

    def __init__(self, sink: Any, folder: Any) -> None:
        self.by_epoch = _sink_lines_by_epoch(sink, folder)
        self.encoder = sink.encoder
        self.got: collections.Counter[str] = collections.Counter()
        self.want: collections.Counter[str] = collections.Counter()
        self.seen_epoch = 0
        self.seen_out = 0

    def advance(self, epoch: int, reference: list[Any]) -> tuple[collections.Counter[str], collections.Counter[str]]:
        """(committed, expected) up to ``epoch``, given the reference's records so far."""
        for e in sorted(e for e in self.by_epoch if self.seen_epoch < e <= epoch):
            self.got.update(self.by_epoch[e])
        self.seen_epoch = max(self.seen_epoch, epoch)
        self.want.update(_encoded(reference[self.seen_out:], self.encoder))
        self.seen_out = len(reference)
        return self.got, self.want


def _lines_by_epoch(sink_root: Any) -> dict[int, collections.Counter]:
    reader = _committed(sink_root)
    out: dict[int, collections.Counter] = {}
    for loc in reader.committed_files():
        out.setdefault(_epoch_of(loc), collections.Counter()).update(reader.read_lines(loc))
    return out


@dataclass
class OracleReport:
    lost: int = 0
    duplicated: int = 0
    mismatched_state: int = 0
    mismatched_epoch_output: int = 0
    epochs_checked: int = 0
    restarts: int = 0
    at_least_once: bool = False
    records_expected: int = 0
    records_committed: int = 0
    #: records the loop heads had logged in transit, over all epochs checked (aligned mode)
    loop_records_logged: int = 0
    #: records stored as channel state, over all epochs checked (unaligned mode)
    channel_state_records: int = 0
    #: "recorded" (the reference replays each key in the order the committed epochs processed
    #: it) or "strict" (the failure-free run's output, for deterministic pipelines)
    compare: str = "strict"
    #: recorded: records that reached a keyed operator in the reference but that no committed
    #: epoch processed
    inputs_lost: int = 0
    #: recorded: records committed epochs processed that the reference has no (more) copy of
    inputs_duplicated: int = 0
    #: recorded: output lines of the failure-free run that this run has not (the same count of
    #: lines is different instead): a different processing order, which is allowed
    order_differs: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.at_least_once:  # duplicates are the contract there; loss is not
            return not (self.lost or self.inputs_lost)
        return not (self.lost or self.duplicated or self.mismatched_state or self.mismatched_epoch_output
                    or self.inputs_lost or self.inputs_duplicated)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": "at-least-once" if self.at_least_once else "exactly-once",
            "lost": self.lost,
            "duplicated": self.duplicated,
            "mismatched_state": self.mismatched_state,
            "mismatched_epoch_output": self.mismatched_epoch_output,
            "epochs_checked": self.epochs_checked,
            "restarts": self.restarts,
            "records_expected": self.records_expected,
            "records_committed": self.records_committed,
            "loop_records_logged": self.loop_records_logged,
            "channel_state_records": self.channel_state_records,
            "compare": self.compare,
            "inputs_lost": self.inputs_lost,
            "inputs_duplicated": self.inputs_duplicated,
            "order_differs": self.order_differs,
            "examples": self.examples[:10],
        }

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)


# ---------------------------------------------------------------- running and checking


def relocated(pipeline, root: Path):
    """A copy of ``pipeline`` whose sinks write under ``root/<sink uid>``."""
    clone = copy.copy(pipeline)
    clone._nodes = {}
    for nid, n in pipeline._nodes.items():
        payload = n.payload
        if n.kind == OpKind.SINK:
            payload = payload.relocated(root / n.uid)
        clone._nodes[nid] = Node(n.id, n.kind, n.name, payload, n.uid, list(n.inputs))
    clone.checkpoint = copy.copy(pipeline.checkpoint)
    return clone


def committed_state(storage, manifest: dict[str, Any], root: Path) -> dict[str, dict]:
    """Keyed state of every operator in a manifest, all subtasks merged."""
    out = {}
    for uid, entry in manifest["operators"].items():
        st = HeapKeyedState(uid, lambda k: 0, (0, 0))
        st.restore_rows(storage.read_operator_rows(manifest, root, uid), entry.get("states", {}))
        out[uid] = st.as_dict()
    return out


def loop_logs(storage, manifest: dict[str, Any], root: Path, loops) -> dict[str, list[Any]]:
    """Records each loop head logged in transit at a committed epoch: head uid -> records."""
    out: dict[str, list[Any]] = {}
    for lp in loops:
        entry = manifest["operators"].get(lp.uid)
        if entry is None:
            continue
        st = HeapKeyedState(lp.uid, lambda k: 0, (0, 0))
        st.restore_rows(storage.read_operator_rows(manifest, root, lp.uid), entry.get("states", {}))
        out[lp.uid] = [r for recs in st.as_dict().get("in_transit", {}).values() for r in recs]
    return out


def channel_state_records(pipeline, manifest: dict[str, Any]) -> list[tuple[int, int, Any]]:
    """The channel state of a committed epoch (unaligned mode): (node id, input edge, records)
    per recorded batch, each channel's in the order recorded; [] without channel state."""
    out: list[tuple[int, int, Any]] = []
    if not manifest.get("channel_state"):
        return out
    plan: PhysicalPlan = pipeline.plan(int(manifest["parallelism"]))  # channel ids are the run's
    for _task, entry in sorted(manifest.get("channel_state", {}).items()):
        blob = base64.b64decode(entry["data"])
        for channel, records, _keys, _label in decode_channel_state(blob):
            if records is None:  # a watermark: no records
                continue
            ch = plan.channels[channel]
            src_node = plan.chains[ch.src[0]].out_edges[ch.out_edge].node
            dst = plan.nodes[ch.dst_node]
            edge = next(i for i, e in enumerate(dst.inputs) if e.src == src_node)
            out.append((ch.dst_node, edge, records))
    return out


def recorded_completion(pipeline, storage, manifest: dict[str, Any], root: Path, gated: Iterable[str],
                        in_flight: list[tuple[int, int, Any]]) -> tuple[dict, dict]:
    """A committed epoch with its channel state fed in, for the recorded-order check: the
    keyed operators in ``gated`` (those that log their order) keep their committed state and
    process the channel state in the epochs that logged it; the others (batch-at-a-time
    keyed functions, which the reference never gates) process it now. Returns (process uid
    -> state, sink uid -> records the channel state emitted)."""
    ref = Reference(pipeline)
    ref.restore(storage, manifest, root)
    for uid in gated:
        ref.follow(uid, [])  # gated, and never released
    for node_id, edge, records in in_flight:
        ref.inject(node_id, edge, records)
    return ref.state(), ref.sinks


def complete_epoch(pipeline, storage, manifest: dict[str, Any], root: Path, loops) -> tuple[dict, dict, int]:
    """A committed epoch run to its fixpoint: its state with the loop heads' logs and the
    channel state (unaligned mode) fed back in.

    Returns (process uid -> state, sink uid -> records the completion emitted, records logged).
    """
    logs = loop_logs(storage, manifest, root, loops)
    logged = sum(len(v) for v in logs.values())
    in_flight = channel_state_records(pipeline, manifest)
    if in_flight:
        ref = Reference(pipeline)
        ref.restore(storage, manifest, root)
        for node_id, edge, records in in_flight:  # before the loop logs: they were cut earlier in the loop
            ref.inject(node_id, edge, records)
        for lp in loops:
            if logs.get(lp.uid):
                ref.inject(lp.dst, lp.edge, logs[lp.uid])
        return ({uid: v for uid, v in ref.state().items() if uid not in {lp.uid for lp in loops}}, ref.sinks,
                logged)
    if not logged:
        return {uid: v for uid, v in committed_state(storage, manifest, root).items()
                if uid not in {lp.uid for lp in loops}}, {}, 0
    ref = Reference(pipeline)
    ref.restore(storage, manifest, root)
    for lp in loops:
        if logs.get(lp.uid):
            ref.inject(lp.dst, lp.edge, logs[lp.uid])
    return ref.state(), ref.sinks, logged


def check_run(pipeline, storage, sink_root: Path, expected_output: dict[str, collections.Counter] | None,
              exactly_once: bool = True, report: OracleReport | None = None) -> OracleReport:
    """Check a finished run's committed output and every retained epoch against the reference."""
    report = report or OracleReport()
    sinks = {uid: sink_root / uid for uid in pipeline.sinks}
    if expected_output is not None:
        for uid, folder in sinks.items():
            got = _sink_lines(pipeline.sinks[uid], folder)
            want = expected_output.get(uid, collections.Counter())
            lost, dup = want - got, got - want
            report.lost += sum(lost.values())
            report.duplicated += sum(dup.values())
            report.records_expected += sum(want.values())
            report.records_committed += sum(got.values())
            for rec in list(lost)[:3]:
                report.note(f"sink {uid}: lost {rec}")
            for rec in list(dup)[:3]:
                report.note(f"sink {uid}: duplicated or unexpected {rec}")
    progress = {uid: _SinkProgress(pipeline.sinks[uid], folder) for uid, folder in sinks.items()}
    loops = pipeline.plan().loops
    ref = Reference(pipeline)
    for epoch in storage.list_checkpoints():
        manifest, root = storage.load_manifest(epoch)
        offsets = {uid: {int(k): int(v) for k, v in s["offsets"].items()} for uid, s in manifest["sources"].items()}
        ref.feed(offsets, *manifest_event_time(manifest))
        ref_states = ref.state()
        report.epochs_checked += 1
        report.channel_state_records += manifest["metrics"].get("channel_state_records", 0)
        got_states, completion_out, logged = complete_epoch(pipeline, storage, manifest, root, loops)
        report.loop_records_logged += logged
        for uid in set(ref_states) | set(got_states):
            want_st: dict[str, dict[Any, Any]] = ref_states.get(uid, {})
            got_st: dict[str, dict[Any, Any]] = got_states.get(uid, {})
            for name in set(want_st) | set(got_st):
                w, g = want_st.get(name, {}), got_st.get(name, {})
                for key in set(w) | set(g):
                    if canonical(w.get(key)) != canonical(g.get(key)):
                        if exactly_once:
                            report.mismatched_state += 1
                            report.note(f"epoch {epoch} {uid}.{name}[{key!r}]: committed {g.get(key)!r}, "
                                        f"reference {w.get(key)!r}")
        if exactly_once:
            for uid in sinks:
                got, want = progress[uid].advance(epoch, ref.sinks.get(uid, []))
                if completion_out.get(uid):  # what the records in transit at the cut go on to emit
                    got = got + _encoded(completion_out[uid], pipeline.sinks[uid].encoder)
                if got != want:
                    report.mismatched_epoch_output += 1
                    missing, extra = sum((want - got).values()), sum((got - want).values())
                    report.note(f"epoch {epoch} sink {uid}: {missing} missing, {extra} extra")
    return report


def check_exactly_once(
    build: Callable[[], Any],
    run: Callable[[Any, str, Any], Any],
    workdir: str | os.PathLike[str] | None = None,
    whole_output: bool = True,
    compare: str = "recorded",
) -> OracleReport:
    """Run ``build()`` once without failures and once with them, and check the second.

    ``run(pipeline, checkpoint_dir, failures_on)`` runs a relocated pipeline; the oracle
    keeps every checkpoint (num_retained is raised) so each epoch can be checked.
    ``workdir`` is a local folder or an S3 prefix (``s3://bucket/prefix``): both runs'
    checkpoints and output go under it.

    ``compare="recorded"`` (the default) judges pipelines whose output depends on the order
    records arrive in (union, rebalance, several sources, loops): both runs log the order
    their keyed operators processed each key's records (``recorded_order``), and the
    reference replays that order (``check_run_recorded``). ``compare="strict"`` compares the
    chaos run's output with the failure-free run's and the order-free reference, which only
    deterministic pipelines pass. At-least-once runs are always compared strictly.
    """
    from .backends import location

    if compare not in ("recorded", "strict"):
        raise ValueError(f"compare must be 'recorded' or 'strict', got {compare!r}")
    work = location(workdir or tempfile.mkdtemp(prefix="epochstream-oracle-"))
    results = {}
    for label, failing in (("reference", False), ("chaos", True)):
        p = relocated(build(), work / label / "out")
        p.checkpoint.num_retained = 1_000_000
        logs: dict[str, str] = {}
        runnable = p
        if compare == "recorded" and implications(p.mode).exactly_once:
            runnable, logs = record_order(p, work / label / "out")
        results[label] = (p, logs, run(runnable, str(work / label / "chk"), failing))
    ref_p, ref_logs, _ = results["reference"]
    expected: dict[str, collections.Counter[Any]] | None = {
        uid: _sink_lines(sink, work / "reference" / "out" / uid) for uid, sink in ref_p.sinks.items()}
    chaos_p, chaos_logs, chaos_result = results["chaos"]
    exactly_once = implications(chaos_p.mode).exactly_once
    report = OracleReport(restarts=getattr(chaos_result, "restarts", 0), at_least_once=not exactly_once)
    bounded = _bounded(chaos_p) and whole_output
    if exactly_once and compare == "recorded":
        report.compare = "recorded"
        if bounded:
            check_failure_free_recorded(ref_p, ref_logs, work / "reference" / "out", report)
        storage = _chaos_storage(chaos_p, work)
        return check_run_recorded(chaos_p, chaos_logs, storage, work / "chaos" / "out",
                                  expected if bounded else None, bounded, report)
    if not bounded:
        expected = None  # runs of an unbounded job stop at different points: check per epoch only
    if exactly_once and expected is not None:
        # the failure-free run must itself match the sequential reference on its full input
        if bounded:
            ref_sinks, _ = reference_run(chaos_p, None)
            for uid, recs in ref_sinks.items():
                if _encoded(recs, chaos_p.sinks[uid].encoder) != expected.get(uid):
                    report.mismatched_epoch_output += 1
                    report.note(f"failure-free run of sink {uid} differs from the sequential reference")
    storage = _chaos_storage(chaos_p, work)
    return check_run(chaos_p, storage, work / "chaos" / "out", expected, exactly_once, report)


def _chaos_storage(chaos_p, work):
    from .backends import open_storage

    if chaos_p.checkpoint.state_backend == "delta":  # committed state read back from the Delta tables
        from .backends.delta import DeltaCheckpointStorage

        return DeltaCheckpointStorage(str(work / "chaos" / "chk"))
    return open_storage(str(work / "chaos" / "chk"))


# ---------------------------------------------------------------- recorded order


def _follow_all(ref: Reference, orders: dict[str, dict[int, list[tuple[Any, Any]]]], after: int,
                upto: int | None) -> None:
    """Hand the reference the logged entries of epochs in (after, upto] (None: all later)."""
    for uid, per_epoch in orders.items():
        ref.follow(uid, [x for e in sorted(per_epoch) if after < e and (upto is None or e <= upto)
                         for x in per_epoch[e]])


def _note_unexpected(report: OracleReport, where: str, unexpected: list[tuple[str, Any, Any]]) -> None:
    report.inputs_duplicated += len(unexpected)
    for uid, key, _rid in unexpected[:3]:
        report.note(f"{where}: operator {uid} processed a record of key {key!r} that the input does not "
                    f"produce again (duplicated or made up)")


def check_failure_free_recorded(pipeline, logs: dict[str, str], sink_root: Any, report: OracleReport) -> None:
    """The failure-free run against the reference replayed in the order it recorded."""
    ref = Reference(pipeline)
    orders = read_orders(sink_root, logs)
    _follow_all(ref, orders, 0, None)
    ref.feed(None)
    unexpected, waiting = ref.settle()
    for uid, recs in ref.sinks.items():
        got = _sink_lines(pipeline.sinks[uid], sink_root / uid)
        if _encoded(recs, pipeline.sinks[uid].encoder) != got:
            report.mismatched_epoch_output += 1
            report.note(f"failure-free run of sink {uid} differs from the sequential reference replayed in its "
                        f"recorded order")
    if unexpected or any(waiting.values()):
        report.mismatched_epoch_output += 1
        report.note(f"failure-free run: {len(unexpected)} logged records the input does not produce, "
                    f"{sum(waiting.values())} produced records no epoch processed")


def check_run_recorded(pipeline, logs: dict[str, str], storage, sink_root: Any,
                       failure_free: dict[str, collections.Counter] | None, whole_input: bool,
                       report: OracleReport) -> OracleReport:
    """Check a finished run against the reference replayed in the run's own recorded order.

    For every retained epoch n: the reference takes the logged entries of epochs <= n and the
    input prefix epoch n's offsets name; each keyed operator processes each key's records in
    the logged order. A logged record the reference does not produce is a duplicate
    (``inputs_duplicated``); a produced record no committed epoch processed is lost
    (``inputs_lost``, counted after the last epoch; earlier it is a state mismatch unless a
    loop head logged records in transit at that cut). Committed state at n must equal the
    reference's, and committed output of epochs <= n the reference's output. At the end,
    the whole committed output against the reference's gives ``lost`` and ``duplicated``
    lines, and against the failure-free run's ``order_differs`` (allowed).
    """
    sinks = {uid: sink_root / uid for uid in pipeline.sinks}
    orders = read_orders(sink_root, logs)
    progress = {uid: _SinkProgress(pipeline.sinks[uid], folder) for uid, folder in sinks.items()}
    loops = pipeline.plan().loops
    loop_uids = {lp.uid for lp in loops}
    ref = Reference(pipeline)
    for uid in orders:
        ref.follow(uid, [])  # gate from the start: nothing runs before the log says so
    previous, logged = 0, 0
    for epoch in storage.list_checkpoints():
        manifest, root = storage.load_manifest(epoch)
        _follow_all(ref, orders, previous, epoch)
        previous = epoch
        offsets = {uid: {int(k): int(v) for k, v in s["offsets"].items()} for uid, s in manifest["sources"].items()}
        ref.feed(offsets, *manifest_event_time(manifest))
        unexpected, waiting = ref.settle()
        _note_unexpected(report, f"epoch {epoch}", unexpected)
        report.epochs_checked += 1
        logged = sum(len(v) for v in loop_logs(storage, manifest, root, loops).values()) if loops else 0
        report.loop_records_logged += logged
        in_flight = channel_state_records(pipeline, manifest)
        report.channel_state_records += sum(len(r) for _n, _e, r in in_flight)
        completed_states, completion_out = recorded_completion(pipeline, storage, manifest, root, orders, in_flight) \
            if in_flight else (None, {})
        if not logged and not in_flight:
            for uid, n in waiting.items():
                if n:
                    report.mismatched_state += 1
                    report.note(f"epoch {epoch} {uid}: {n} records of the input prefix reached it in the reference "
                                f"but no committed epoch processed them")
        want_states = ref.state()
        got_states = {uid: st for uid, st in (completed_states or committed_state(storage, manifest, root)).items()
                      if uid not in loop_uids}
        for uid in set(want_states) | set(got_states):
            want_st, got_st = want_states.get(uid, {}), got_states.get(uid, {})
            for name in set(want_st) | set(got_st):
                w, g = want_st.get(name, {}), got_st.get(name, {})
                for key in set(w) | set(g):
                    if canonical(w.get(key)) != canonical(g.get(key)):
                        report.mismatched_state += 1
                        report.note(f"epoch {epoch} {uid}.{name}[{key!r}]: committed {g.get(key)!r}, reference "
                                    f"in recorded order {w.get(key)!r}")
        for uid in sinks:
            got, want = progress[uid].advance(epoch, ref.sinks.get(uid, []))
            if completion_out.get(uid):  # what the channel state goes on to emit without keyed state
                got = got + _encoded(completion_out[uid], pipeline.sinks[uid].encoder)
            if got != want:
                report.mismatched_epoch_output += 1
                missing, extra = sum((want - got).values()), sum((got - want).values())
                report.note(f"epoch {epoch} sink {uid}: {missing} missing, {extra} extra (reference in recorded "
                            f"order)")
    if whole_input:  # a bounded job must have read everything: the rest is lost if no epoch holds it
        _follow_all(ref, orders, previous, None)
        ref.feed(None)
        unexpected, waiting = ref.settle()
        _note_unexpected(report, "after the last epoch", unexpected)
    else:
        waiting = {uid: len(ref.waiting_records(uid)) for uid in orders}
    if logged:
        report.note(f"the last epoch's loop heads logged {logged} records in transit: not counted as lost")
    else:
        report.inputs_lost += sum(waiting.values())
        for uid in waiting:
            for r in ref.waiting_records(uid)[:3]:
                report.note(f"operator {uid}: lost {r!r} (no committed epoch processed it)")
        if any(waiting.values()):
            ref.ungate()  # what the lost records would have emitted counts as lost output
    for uid, folder in sinks.items():
        got = _sink_lines(pipeline.sinks[uid], folder)
        want = _encoded(ref.sinks.get(uid, []), pipeline.sinks[uid].encoder)
        lost, dup = want - got, got - want
        report.lost += sum(lost.values())
        report.duplicated += sum(dup.values())
        report.records_expected += sum(want.values())
        report.records_committed += sum(got.values())
        for rec in list(lost)[:3]:
            report.note(f"sink {uid}: lost {rec}")
        for rec in list(dup)[:3]:
            report.note(f"sink {uid}: duplicated or unexpected {rec}")
        if failure_free is not None:
            report.order_differs += sum((failure_free.get(uid, collections.Counter()) - got).values())
    return report


def _bounded(pipeline) -> bool:
    return all(s.bounded for s in pipeline.sources.values())
