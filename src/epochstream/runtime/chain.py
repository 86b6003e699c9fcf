"""One subtask of an operator chain, compiled into closures that push whole batches.

Python pays per call, so records move through a chain a batch at a time: ``map`` is one
list comprehension per batch, a keyed ``process`` one loop. Outputs land in per-channel
buffers that the task flushes as ``Batch`` messages, always before a marker, so no batch
spans two epochs.

A batch is a list of records or one Arrow RecordBatch (``runtime.columns``). Row operators
make rows of a RecordBatch once per batch; ``map_batches`` and keyed batch functions make a
RecordBatch of rows once per batch. Routers pass RecordBatches on whole (forward), in even
slices (rebalance) or cut per destination with Arrow kernels (``key_by`` column names); a
``key_by`` function makes rows first.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, cast

from ..graph.keygroups import (
    CANONICAL_TYPES,
    KeyGroupOf,
    assign_to_key_group,
    canonical_key,
    distinct_keys,
    key_group_table,
    key_groups_of,
)
from ..graph.kinds import OpKind
from ..graph.plan import FORWARD, HASH, Chain, ColumnKey, Node, PhysicalPlan
from .columns import (
    as_record_batch,
    concat,
    even_slices,
    from_rows,
    is_columnar_batch,
    key_columns,
    keys_of,
    split_by_code,
    to_rows,
)
from .context import Context
from .errors import SchemaError, UserFunctionError
from .messages import END_OF_TIME, Batch, KeyedCapture, SinkCapture
from .state import HeapKeyedState, KeyedStateBackend, KeyedStateFactory, OperatorStateBackend
from .timers import TimerService
from .traits import OperatorTraits

#: a batch of records (a list, or an Arrow RecordBatch) and their keys (or None) into an operator
Push = Callable[[Any, "list[Any] | None"], None]
#: builds the ``Context`` of one keyed operator subtask (``runtime.context.Context``)
ContextFactory = Callable[[KeyedStateBackend, int, int, str, "TimerService | None", "OperatorStateBackend | None"],
                          Context]

#: distinct keys a column-keyed router remembers the key group of before it starts afresh
KEY_GROUP_MEMO = 1 << 16


#: key types whose key group is a function of the value alone, equal values alike (``key_bytes``
#: encodes 1, 1.0 and True, and -0.0 and 0.0, the same): a dict keyed by them may cache routes
VALUE_KEYS = frozenset({str, int, float, bool, bytes})
#: item types of tuple keys that may cache routes too: a tuple's bytes are its items' (``key_bytes``),
#: so equal tuples of these share them (the PySpark wrappers key by tuples of their grouping columns)
_TUPLE_ITEMS = VALUE_KEYS | {type(None)}


def _cacheable(key: Any) -> bool:
    """Whether ``key``'s route may be cached by value (see ``VALUE_KEYS``)."""
    t = type(key)
    if t in VALUE_KEYS:
        return True
    if t is tuple:  # a loop, not all(): ~0.25 us against ~0.7 us per key
        for x in key:
            if type(x) not in _TUPLE_ITEMS:
                return False
        return True
    return False
#: routes cached per router at most (then the cache starts again)
ROUTE_CACHE = 1 << 16


class OutputBuffers:
    """Per-channel record buffers of one task.

    Rows go to ``records`` (and their keys to ``keys`` on hash channels), appended by the
    routers directly. RecordBatches go through ``add_columns`` to ``columns``, which keeps the
    channel's FIFO order: rows buffered before a RecordBatch move into ``columns`` ahead of it.
    """

    __slots__ = ("records", "keys", "columns", "rows_out")

    def __init__(self, channels: list[int], keyed: set[int]) -> None:
        self.records: dict[int, list[Any]] = {c: [] for c in channels}
        self.keys: dict[int, list[Any] | None] = {c: ([] if c in keyed else None) for c in channels}
        #: channel -> its pending output that came as RecordBatches, in order, with any rows
        #: buffered before each as ``(rows, keys)``; only channels with such output are present
        #: (rows appended to ``records`` afterwards follow all of it)
        self.columns: dict[int, list[Any]] = {}
        #: rows drained into batches so far (a task's numRecordsOut to its channels; ``runtime.meters``)
        self.rows_out = 0

    def add_columns(self, channel: int, batch: Any) -> None:
        segments = self.columns.get(channel)
        if segments is None:
            segments = self.columns[channel] = []
        rows = self.records[channel]
        if rows:
            keys = self.keys[channel]
            segments.append((rows, keys))
            self.records[channel] = []
            if keys is not None:
                self.keys[channel] = []
        segments.append(batch)

    def drain(self, epoch: int, time: int = 0, only: "list[int] | None" = None) -> list[tuple[int, Batch]]:
        """The buffered output as batches, per channel in FIFO order (``only``: of these channels)."""
        out: list[tuple[int, Batch]] = []
        columns = self.columns
        bufs = self.records
        for ch, recs in (bufs.items() if only is None else [(c, bufs[c]) for c in only]):
            if columns and ch in columns:
                for records, keys in _merged(columns.pop(ch)):
                    out.append((ch, Batch(epoch, records, keys, 0, time)))
                    self.rows_out += len(records)
            if recs:
                keys = self.keys[ch]
                out.append((ch, Batch(epoch, recs, keys, 0, time)))
                self.rows_out += len(recs)
                self.records[ch] = []
                if keys is not None:
                    self.keys[ch] = []
        return out

    def pending(self) -> int:
        return sum(len(r) for r in self.records.values()) + sum(
            len(seg[0]) if type(seg) is tuple else seg.num_rows for segs in self.columns.values() for seg in segs)

    def fill(self) -> dict[int, int]:
        """Rows buffered per channel, for the channels holding any (the batching policy's view)."""
        fill = {ch: len(recs) for ch, recs in self.records.items() if recs}
        for ch, segs in self.columns.items():
            fill[ch] = fill.get(ch, 0) + sum(len(seg[0]) if type(seg) is tuple else seg.num_rows for seg in segs)
        return fill


def _merged(segments: list[Any]) -> list[tuple[Any, "list[Any] | None"]]:
    """A channel's columnar segments as batches: runs of RecordBatches of one schema become one
    RecordBatch (keys travel in the columns: None), rows stay as they came."""
    out: list[tuple[Any, list[Any] | None]] = []
    run: list[Any] = []
    for seg in segments:
        if type(seg) is not tuple and (not run or seg.schema == run[0].schema):
            run.append(seg)
            continue
        if run:
            out.append((concat(run), None))
            run = []
        if type(seg) is tuple:
            out.append(seg)
        else:
            run.append(seg)
    if run:
        out.append((concat(run), None))
    return out


class ChainRuntime:
    """The compiled operators of one chain subtask."""

    def __init__(self, plan: PhysicalPlan, chain: Chain, subtask: int, context_factory: ContextFactory,
                 event_time: bool = False, keyed_state: KeyedStateFactory | None = None) -> None:
        """``event_time``: operators that declare event-time use get a ``TimerService``;
        ``keyed_state`` builds the keyed state of each ``process`` operator (None: the heap)."""
        self._keyed_state: KeyedStateFactory = keyed_state or HeapKeyedState
        self.plan = plan
        self.event_time = event_time
        #: (fn, ctx, timers, downstream, uid) of operators with event-time timers
        self.timed: list[tuple[Any, Any, TimerService, Push, str]] = []
        self.chain = chain
        self.subtask = subtask
        self.states: dict[str, KeyedStateBackend] = {}
        #: per keyed operator uid: its operator (non-keyed) state of this subtask
        self.operator_states: dict[str, OperatorStateBackend] = {}
        #: per sink uid: the writer collecting this subtask's output of the current epoch
        self.sink_writers: dict[str, Any] = {}
        #: per sink uid: how to make its writer, and the (write, write_batch) its operator calls
        self._sink_makers: dict[str, tuple[Callable[[], Any], list[Any]]] = {}
        #: rows this subtask's sinks took (with ``out.rows_out``, its numRecordsOut; ``runtime.meters``)
        self.records_sunk = 0
        #: rows counted by the runtime's own operators, by name (``dead_letters``: records
        #: ``from_json`` sent to its dead-letter output; replays count again)
        self.counters: dict[str, int] = {}
        self.functions: list[tuple[Any, Any]] = []  # (user fn, ctx) to open/close
        #: per keyed operator uid: what its function can do, read once when it is compiled
        self.traits: dict[str, OperatorTraits] = {}
        self.contexts: list[Any] = []
        #: keyed functions with an ``on_epoch_end`` hook: (fn, ctx, downstream push, label)
        self._epoch_hooks: list[tuple[Any, Any, Push, str]] = []
        out_channels = plan.outputs[(chain.id, subtask)]
        all_channels = [c for chans in out_channels for c in chans]
        edges = zip(chain.out_edges, out_channels, strict=True)
        keyed = {c for oe, chans in edges if oe.partition == HASH for c in chans}
        self.out = OutputBuffers(all_channels, keyed)
        self._kg_table = key_group_table(plan.max_parallelism, plan.parallelism)
        self._rr = subtask  # rebalance cursor, offset per subtask to spread load
        self._context_factory = context_factory
        self.entry: dict[int, Push] = {}
        for nid in reversed(chain.nodes):
            self.entry[nid] = self._compile(nid)

    # ------------------------------------------------------------ compile
    def _downstream(self, nid: int) -> Push:
        """Fan a batch out to in-chain consumers and out edges of node ``nid``."""
        targets: list[Push] = []
        for other in self.chain.nodes:
            n = self.plan.nodes[other]
            if other != nid and other not in self.chain.heads and any(e.src == nid for e in n.inputs):
                targets.append(self.entry[other])
        out_channels = self.plan.outputs[(self.chain.id, self.subtask)]
        for oe in self.chain.out_edges:
            if oe.node == nid:
                dst = self.plan.nodes[oe.dst_node]
                where = f"key_by({oe.key_fn}) from {self.plan.nodes[nid].name!r} to {dst.uid or dst.name!r}"
                targets.append(self._router(oe.partition, oe.key_fn, out_channels[oe.index],
                                            self.plan.nodes[nid].name, where))
        if not targets:
            return _discard
        if len(targets) == 1:
            return targets[0]

        def fan_out(records: Any, keys: list[Any] | None) -> None:
            for t in targets:
                t(records, keys)

        return fan_out

    def _router(self, partition: str, key_fn: Callable[[Any], Any] | None, channels: list[int], name: str,
                where: str = "") -> Push:
        buffers = self.out.records
        add_columns = self.out.add_columns
        if partition == FORWARD:
            def forward(records: Any, keys: list[Any] | None) -> None:
                if type(records) is not list:
                    add_columns(channels[0], records)
                    return
                buffers[channels[0]].extend(records)

            return forward
        if partition == HASH:
            table = self._kg_table
            m = self.plan.max_parallelism
            keybufs = cast(dict[int, list[Any]], self.out.keys)  # a hash channel always has a key list
            key_of = _required_key_fn(key_fn, name)
            by_columns = self._column_router(key_fn, channels, where) if isinstance(key_fn, ColumnKey) else None

            def by_key(records: Any, keys: list[Any] | None) -> None:
                if type(records) is not list:
                    if by_columns is not None:
                        by_columns(records)
                        return
                    records = to_rows(records)  # a key function takes rows: make them once per batch
                ks: list[Any] = []
                add_key = ks.append
                try:
                    for r in records:
                        add_key(key_of(r))
                except Exception as exc:
                    raise UserFunctionError(f"key_by function after {name!r} failed", exc,
                                            record=records[len(ks)]) from exc
                get = route.get
                chs = [get(k) if _cacheable(k) else None for k in ks]
                misses = [i for i, ch in enumerate(chs) if ch is None]
                if misses:  # hashed as a batch (the murmur round vectorised): many keys, few repeats
                    if len(route) + len(misses) > ROUTE_CACHE:
                        route.clear()
                    for i, kg in zip(misses, key_groups_of([ks[i] for i in misses], m), strict=True):
                        k = ks[i]
                        dest = chs[i] = channels[table[kg]]
                        if _cacheable(k):
                            route[k] = dest
                for r, k, c in zip(records, ks, chs, strict=True):
                    buffers[c].append(r)  # type: ignore[index]  # every None was filled above
                    keybufs[c].append(k)  # type: ignore[index]

            #: key -> output channel of the keys seen lately (murmur in Python was a third of a
            #: keyed record's cost); only keys whose key group follows from their value (``_cacheable``)
            route: dict[Any, int] = {}
            return by_key

        n = len(channels)

        def round_robin(records: Any, keys: list[Any] | None) -> None:
            if type(records) is not list:  # even slices, starting where the cursor is
                for part, offset, length in even_slices(records.num_rows, n, self._rr):
                    add_columns(channels[part], records.slice(offset, length))
                self._rr = (self._rr + records.num_rows) % n
                return
            i = self._rr
            for r in records:
                buffers[channels[i % n]].append(r)
                i += 1
            self._rr = i % n

        return round_robin

    def _column_router(self, key: ColumnKey, channels: list[int], where: str) -> Callable[[Any], None]:
        """Route a RecordBatch by its key columns: the key group of each distinct key
        (``keygroups.distinct_keys``; hashed once, then remembered in a bounded memo), its destination
        subtask from the key-group table, spread over the rows with one ``take``, then one
        slice of the batch per destination (``columns.split_by_code``)."""
        import pyarrow as pa

        m = self.plan.max_parallelism
        table = self._kg_table
        add_columns = self.out.add_columns
        memo: dict[Any, int] = {}

        def by_columns(batch: Any) -> None:
            codes, keys = distinct_keys(key_columns(batch, key, where), key.tuple_key)
            if len(memo) > KEY_GROUP_MEMO:
                memo.clear()
            dests = []
            for k in keys:
                kg = memo.get(k)
                if kg is None:
                    kg = memo[k] = assign_to_key_group(k, m)
                dests.append(table[kg])
            if len(set(dests)) == 1:  # one destination (always at parallelism 1): the batch as it is
                add_columns(channels[dests[0]], batch)
                return
            for d, part in split_by_code(batch, pa.array(dests, pa.int32()).take(codes)):
                add_columns(channels[d], part)

        return by_columns

    def _compile(self, nid: int) -> Push:
        node = self.plan.nodes[nid]
        kind, fn, label = node.kind, node.payload, node.uid or node.name
        down = self._downstream(nid) if kind != OpKind.SINK else None
        push: Push = _discard if down is None else down  # a sink pushes nowhere

        if kind == OpKind.SOURCE or kind == OpKind.ITERATE:
            return push  # records pass on unchanged
        if kind == OpKind.LOOP_TAIL:
            def loop_tail(records: Any, keys: list[Any] | None) -> None:
                # what goes round a loop travels as rows: the loop head logs records one by one
                push(records if type(records) is list else to_rows(records), keys)

            return loop_tail
        if kind == OpKind.LOOP_HEAD:
            # the head's only state: its log of in-transit records (loops.head), kept as
            # keyed state under the head's uid so every backend stores it like any other;
            # the key is the subtask's first key group, so a restore at another parallelism
            # hands each log to the subtask that owns that key group
            kg_range = self.plan.key_group_range(self.subtask)
            uid = _uid(node)
            self.states[uid] = HeapKeyedState(uid, _key_is_key_group, kg_range)
            return push
        if kind == OpKind.MAP:

            def op_map(records: Any, keys: list[Any] | None) -> None:
                if type(records) is not list:
                    records = to_rows(records)
                out: list[Any] = []
                add = out.append
                try:
                    for r in records:
                        add(fn(r))
                except Exception as exc:  # the failing record is the one after the last output
                    raise UserFunctionError(f"map {label!r} failed", exc, record=records[len(out)]) from exc
                push(out, None)

            return op_map
        if kind == OpKind.FILTER:

            def op_filter(records: Any, keys: list[Any] | None) -> None:
                if type(records) is not list:
                    records = to_rows(records)
                out: list[Any] = []
                r: Any = None
                try:
                    for r in records:
                        if fn(r):
                            out.append(r)
                except Exception as exc:
                    raise UserFunctionError(f"filter {label!r} failed", exc, record=r) from exc
                if out:
                    push(out, None)

            return op_filter
        if kind == OpKind.FLAT_MAP:

            def op_flat_map(records: Any, keys: list[Any] | None) -> None:
                if type(records) is not list:
                    records = to_rows(records)
                out: list[Any] = []
                extend = out.extend
                r: Any = None
                try:
                    for r in records:
                        extend(fn(r))
                except Exception as exc:
                    raise UserFunctionError(f"flat_map {label!r} failed", exc, record=r) from exc
                if out:
                    push(out, None)

            return op_flat_map
        if kind == OpKind.SINK:
            make = getattr(fn, "writer", None) or ListWriter
            writer = make()
            self.sink_writers[_uid(node)] = writer
            # a columnar sink's writer takes a RecordBatch whole; row sinks get dict rows
            cell: list[Any] = [writer.write, getattr(writer, "write_batch", None)]  # ``bucket_sinks`` swaps them
            self._sink_makers[_uid(node)] = (make, cell)

            def op_sink(records: Any, keys: list[Any] | None) -> None:
                self.records_sunk += len(records)
                write, write_batch = cell
                try:
                    if type(records) is list:
                        write(records)
                    elif write_batch is not None:
                        write_batch(records)
                    else:
                        write(to_rows(records))
                except SchemaError as exc:
                    raise SchemaError(f"sink {label!r}: {exc}") from None
                except Exception as exc:
                    raise UserFunctionError(f"sink {label!r} could not take records", exc) from exc

            return op_sink
        if kind == OpKind.MAP_BATCHES and OperatorTraits.of(fn).takes_any_records:
            return self._compile_any_records(fn, label, push)
        if kind == OpKind.MAP_BATCHES:
            where = f"map_batches {label!r}"

            def op_map_batches(records: Any, keys: list[Any] | None) -> None:
                batch = from_rows(records, where) if type(records) is list else records
                try:
                    out = fn(batch)
                except Exception as exc:
                    raise UserFunctionError(f"{where} failed", exc) from exc
                out = as_record_batch(out, where)
                if out is not None and out.num_rows:
                    push(out, None)

            return op_map_batches
        if kind == OpKind.PROCESS:
            return self._compile_process(node, push)
        raise ValueError(f"unknown operator kind {kind!r}")

    def _compile_any_records(self, fn: Any, label: str, push: Push) -> Push:
        """An operator of the runtime's own (``from_json``, the side-output splitters) that takes
        records as they come, a list of rows or a RecordBatch, and returns either, None, or a
        tuple of them (each pushed on in order). One with a ``counter`` adds the rows it puts
        out to ``counters[counter]`` (``dead_letters``: a task metric)."""
        counter = getattr(fn, "counter", None)
        counters = self.counters
        if counter is not None:
            counters.setdefault(counter, 0)

        def op_any(records: Any, keys: list[Any] | None) -> None:
            try:
                out = fn(records)
            except SchemaError as exc:
                raise SchemaError(f"{label!r}: {exc}") from None
            except Exception as exc:
                raise UserFunctionError(f"{label!r} failed", exc) from exc
            for part in out if type(out) is tuple else (out,):
                if part is None or not len(part):
                    continue
                push(part, None)
                if counter is not None:
                    counters[counter] += len(part)

        return op_any

    def _compile_process(self, node: Node, down: Push) -> Push:
        uid = _uid(node)
        kg_range = self.plan.key_group_range(self.subtask)
        m = self.plan.max_parallelism
        key_types = {e.key_type for e in node.inputs if e.key_type is not None}
        if len(key_types) > 1:
            raise ValueError(f"operator {uid!r}: its inputs declare different key types {sorted(map(repr, key_types))}")
        state = self._keyed_state(uid, KeyGroupOf(m), kg_range,
                                  key_types.pop() if key_types else None)
        self.states[uid] = state
        op_state = self.operator_states[uid] = OperatorStateBackend(uid, self.subtask)
        fn = copy.deepcopy(node.payload)  # one instance per subtask, as Flink deserializes one each
        traits = self.traits[uid] = OperatorTraits.of(fn)
        timers = TimerService(state) if self.event_time and traits.uses_event_time else None
        ctx = self._context_factory(state, self.subtask, self.plan.parallelism, uid, timers, op_state)
        if timers is not None:
            self.timed.append((fn, ctx, timers, down, uid))
        self.functions.append((fn, ctx))
        self.contexts.append(ctx)
        keyslot = state.keys
        key_of = _required_key_fn(node.inputs[0].key_fn if node.inputs else None, uid)
        label = uid
        if traits.ends_epochs:
            self._epoch_hooks.append((fn, ctx, down, label))
        if traits.columnar_keyed:
            apply = fn.apply

            def op_process_columns(records: Any, keys: list[Any] | None) -> None:
                out = apply(records, keyslot, ctx, label, state)
                if out is not None:
                    down(out, None)

            return op_process_columns
        if traits.applies_batches:
            return self._compile_apply_batch(fn, traits.takes_record_batches, ctx, key_of, label, down)
        process = fn.process
        prefetches = getattr(state, "prefetches", False)
        key_fn = node.inputs[0].key_fn if node.inputs else None
        where = f"key_by({key_fn}) into {label!r}"

        def op_process(records: Any, keys: list[Any] | None) -> None:
            if type(records) is not list:  # columnar: keys from the key columns, rows once per batch
                keys = keys_of(records, key_fn, where) if isinstance(key_fn, ColumnKey) else None
                records = to_rows(records)
            if keys is None:  # fed directly by a source in tests, or columnar with a key function
                keys = [key_of(r) for r in records]
            out: list[Any] = []
            extend = out.extend
            value: Any = None
            if prefetches:  # the batch's keys at once (RocksDB: one multi-get, one write batch)
                keys = [canonical_key(k) if type(k) in CANONICAL_TYPES else k for k in keys]
                try:
                    distinct = list(dict.fromkeys(keys))
                except TypeError:  # an unhashable key: fails in the state access, per record, as before
                    distinct = []
                state.begin_batch(distinct)
            try:
                for value, key in zip(records, keys, strict=True):
                    keyslot.key = canonical_key(key) if type(key) in CANONICAL_TYPES else key
                    res = process(value, ctx)
                    if res is not None:
                        if type(res) in _NOT_RECORD_ITERABLES:
                            raise TypeError(
                                f"process() returned a {type(res).__name__}; return or yield an iterable of "
                                f"records, e.g. (record,)"
                            )
                        extend(res)
            except Exception as exc:
                raise UserFunctionError(f"process {label!r} failed", exc, key=keyslot.key, record=value) from exc
            finally:
                if prefetches:
                    state.end_batch()
            if out:
                down(out, None)

        return op_process

    @staticmethod
    def _compile_apply_batch(fn: Any, whole: bool, ctx: Context, key_of: Callable[[Any], Any], label: str,
                             down: Push) -> Push:
        """A keyed function that takes the whole batch (``apply_batch(records, keys, ctx)``)
        and returns its output records; it sets the current key itself (the PySpark wrappers
        group a batch per key and call the user once per key). ``whole`` (``takes_record_batches``):
        it gets a RecordBatch as it came (keys None) and groups it itself."""
        apply_batch = fn.apply_batch

        def op_apply_batch(records: Any, keys: list[Any] | None) -> None:
            if type(records) is not list:
                if whole:
                    keys = None
                else:
                    records = to_rows(records)
                    keys = [key_of(r) for r in records]
            elif keys is None:
                keys = [key_of(r) for r in records]
            try:
                out = apply_batch(records, keys, ctx)
            except Exception as exc:
                raise UserFunctionError(f"process {label!r} failed", exc, key=ctx.key) from exc
            if out:
                down(out, None)

        return op_apply_batch

    # ------------------------------------------------------------ lifecycle
    def open(self, epoch: int) -> None:
        for _fn, _ctx, timers, _down, _uid in self.timed:
            timers.rebuild()
        for fn, ctx in self.functions:
            ctx.epoch = epoch
            try:
                fn.open(ctx)
            except Exception as exc:
                raise UserFunctionError(f"open() of {ctx.operator_uid!r} failed", exc, subtask=self.subtask) from exc

    def fire_timers(self, label: int, slack: float) -> None:
        """Event time reached time label ``label``: fire the timers it passes."""
        watermark = float("inf") if label >= END_OF_TIME else (label + 1) * slack
        for fn, ctx, timers, down, uid in self.timed:
            # a function that keeps input for one call per key (the PySpark wrappers' epoch
            # micro-batch) runs it before event time moves: the timers that data registers
            # below the new watermark fire now, and every timer follows the data before it
            drain = fn.drain_input if self.traits[uid].drains_input else None
            if drain is not None and timers.advances(watermark):
                try:
                    drained = drain(ctx)
                except Exception as exc:
                    raise UserFunctionError(f"process {uid!r} failed", exc, key=ctx.key) from exc
                if drained is not None and len(drained):
                    down(drained, None)
            out: list[Any] = []

            def on_timer(ts: float, fn: Any = fn, ctx: Any = ctx, out: list[Any] = out) -> None:
                res = fn.on_timer(ts, ctx)
                if res is not None:
                    out.extend(res)

            try:
                timers.advance(label, watermark, on_timer)
            except Exception as exc:
                raise UserFunctionError(f"on_timer of {uid!r} failed", exc, key=ctx.key) from exc
            if out:
                down(out, None)

    def close(self) -> None:
        for fn, _ctx in self.functions:
            try:
                fn.close()
            except Exception:
                pass
        for state in self.states.values():  # a RocksDB backend closes and removes its local DB
            state.close()

    @property
    def stateless(self) -> bool:
        """Nothing of this chain but its sinks' output is in a snapshot or bound to an epoch: no
        keyed or operator state, no event-time timers, no epoch-end hooks (sinks can be
        bucketed by epoch: ``bucket_sinks``)."""
        return not (self.states or self.operator_states or self.timed or self._epoch_hooks)

    def bucket_sinks(self) -> None:
        """Every sink writes into a writer of the epoch last given to ``set_epoch`` and
        ``capture(epoch)`` takes that epoch's writer: records of several epochs can be sunk in
        any order (trAcker pass-through; FlameStream's output barrier buffers by time too)."""
        for uid, (make, cell) in self._sink_makers.items():
            if self.sink_writers[uid].take():
                raise ValueError(f"sink {uid!r}: bucket_sinks after records were written")
            buckets = EpochBuckets(make)
            self.sink_writers[uid] = buckets
            cell[0], cell[1] = buckets.write, buckets.write_batch

    @property
    def late_records(self) -> int:
        """Records this subtask's window functions dropped as late (Flink's window
        ``numLateRecordsDropped``; ``WindowAggregateFunction.late_records``)."""
        counts = (getattr(fn, "late_records", 0) for fn, _ctx in self.functions)
        return sum(c for c in counts if type(c) is int)

    @property
    def dead_letters(self) -> int:
        """Records this subtask's ``from_json`` operators sent to their dead-letter outputs."""
        return self.counters.get("dead_letters", 0)

    @property
    def records_out(self) -> int:
        """Rows put out: drained onto output channels or taken by this chain's sinks."""
        return self.out.rows_out + self.records_sunk

    def set_epoch(self, epoch: int) -> None:
        for ctx in self.contexts:
            ctx.epoch = epoch
        for w in self.sink_writers.values():
            if type(w) is EpochBuckets:
                w.epoch = epoch

    def set_now(self, now: float) -> None:
        """The driver's time of the current step (virtual in the simulator), for functions
        that ask for processing time through ``ctx.now``."""
        for ctx in self.contexts:
            ctx.now = now

    def end_epoch(self, epoch: int) -> None:
        """Run the ``on_epoch_end(epoch, ctx)`` hooks at the bound of ``epoch``, before the
        task's flush and capture: their output belongs to ``epoch`` and their state changes
        are in its snapshot (timers that fire at an epoch bound, TTL clean-up, input kept for
        one call per key per epoch). Upstream hooks run first (operators are compiled from the
        chain's end), so what one emits reaches the next before that one's bound. A hook
        returns records or one RecordBatch."""
        for fn, ctx, down, label in reversed(self._epoch_hooks):
            try:
                out = fn.on_epoch_end(epoch, ctx)
            except Exception as exc:
                raise UserFunctionError(f"on_epoch_end of {label!r} failed at epoch {epoch}", exc,
                                        subtask=self.subtask) from exc
            if out is not None and len(out):
                down(out if type(out) is list or is_columnar_batch(out) else list(out), None)

    def capture(
        self, epoch: int, incremental: bool, full_every: int
    ) -> tuple[tuple[KeyedCapture, ...], tuple[SinkCapture, ...], tuple[tuple[str, str, str, bytes], ...]]:
        keyed = tuple(s.capture(epoch, incremental, full_every) for s in self.states.values())
        sinks = tuple(SinkCapture(uid, epoch, w.take_epoch(epoch) if type(w) is EpochBuckets else w.take())
                      for uid, w in self.sink_writers.items())
        ops = tuple((uid, name, mode, data) for uid, b in self.operator_states.items()
                    for name, mode, data in b.capture())
        return keyed, sinks, ops


_NOT_RECORD_ITERABLES = frozenset({str, bytes, dict})


def _uid(node: Node) -> str:
    if node.uid is None:
        raise ValueError(f"operator {node.name!r} ({node.kind}) needs a uid: its state or output is checkpointed")
    return node.uid


def _required_key_fn(key_fn: Callable[[Any], Any] | None, name: str) -> Callable[[Any], Any]:
    """``key_fn``, or one that says which keyed input lacks it (called only if keys are missing)."""
    if key_fn is not None:
        return key_fn

    def no_key(record: Any) -> Any:
        raise ValueError(f"{name!r}: a keyed input without a key function")

    return no_key


def _key_is_key_group(key: int) -> int:
    return key


def _discard(records: Any, keys: list[Any] | None) -> None:
    return None


class EpochBuckets:
    """A sink's writers, one per epoch (``ChainRuntime.bucket_sinks``): ``write`` goes to the
    writer of ``epoch``; ``take_epoch(n)`` hands over epoch n's output and drops its writer."""

    __slots__ = ("make", "epoch", "buckets")

    def __init__(self, make: Callable[[], Any], epoch: int = 0) -> None:
        self.make = make
        self.epoch = epoch
        #: epoch -> its writer, for the epochs written and not yet taken
        self.buckets: dict[int, Any] = {}

    def _writer(self) -> Any:
        w = self.buckets.get(self.epoch)
        if w is None:
            w = self.buckets[self.epoch] = self.make()
        return w

    def write(self, records: list[Any]) -> None:
        self._writer().write(records)

    def write_batch(self, batch: Any) -> None:
        w = self._writer()
        wb = getattr(w, "write_batch", None)
        if wb is not None:
            wb(batch)
        else:
            w.write(to_rows(batch))

    def take_epoch(self, epoch: int) -> Any:
        w = self.buckets.pop(epoch, None)
        return (w if w is not None else self.make()).take()


class ListWriter:
    """Default sink writer: keep the epoch's records until the epoch's capture."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[Any] = []

    def write(self, records: list[Any]) -> None:
        self.records.extend(records)

    def take(self) -> list[Any]:
        out, self.records = self.records, []
        return out
