"""The pipeline builder: PySpark/Flink-style fluent streams over a logical graph."""

from __future__ import annotations

from dataclasses import dataclass, is_dataclass, replace
from typing import Any, Callable, Iterable, Sequence

from ..deploy.flow import DEFAULT_TARGET as DEFAULT_DEBLOAT_TARGET
from ..deploy.liveness import HeartbeatConfig
from ..deploy.restart import ExponentialDelayRestart, FixedDelayRestart, RestartStrategy
from ..deploy.result import JobResult
from ..deploy.slots import DEFAULT_SLOT_WAIT_TIMEOUT
from ..graph.kinds import OpKind
from ..graph.plan import FORWARD, HASH, REBALANCE, ColumnKey, Edge, Node, PhysicalPlan, build_plan, uid_of
from ..runtime.batching import DEFAULT_BATCH_ROWS, BatchPolicy
from ..runtime.modes import MODE_NAMES, SnapshotMode
from ..runtime.sources import CollectionSource, GeneratorSource, Source

MODES = MODE_NAMES
_UNSET = object()
DEPLOYMENTS = ("sim", "local", "spark")


STATE_BACKENDS = ("files", "delta")
#: where a running job keeps its keyed state (Flink's ``state.backend.type``)
STATE_BACKEND_TYPES = ("hashmap", "rocksdb")


@dataclass
class CheckpointConfig:
    """Flink's checkpoint options, in seconds (``execution.checkpointing.*``)."""

    interval: float | None = 1.0
    max_concurrent: int = 1
    min_pause: float = 0.0
    timeout: float = 600.0
    tolerable_failed: int = 0
    num_retained: int = 3
    #: incremental checkpoints: the heap writes the keys changed since the last capture (a chain
    #: of files, full every ``full_every``); RocksDB (with the files state backend) uploads only
    #: SST files no earlier capture uploaded and shares the rest (Flink's incremental RocksDB
    #: checkpoints; ``backends.rocksdb_checkpoint``). False: every capture is written in full
    incremental: bool = True
    #: with incremental snapshots, every ``full_every``-th capture of an operator is full (compaction)
    full_every: int = 10
    #: where committed keyed state goes besides the snapshot files: "files" (nowhere else) or
    #: "delta" (a Delta table per operator, one transaction per epoch; needs Spark and the jars)
    state_backend: str = "files"
    #: "delta": a state table is an append-only changelog, compacted (in the background) once it
    #: holds this many epochs since its last compaction; 0 never compacts
    delta_compact_every: int = 10
    #: where the running job keeps keyed state (Flink's ``state.backend.type``): "hashmap" (Python
    #: dicts, the default) or "rocksdb" (a local RocksDB per keyed operator subtask: state larger
    #: than memory; needs ``pip install 'epochstream[rocksdb]'``). Checkpoints are the same rows.
    state_backend_type: str = "hashmap"
    #: "rocksdb": local directory for the DBs (None: the system temp dir); scratch, never restored from
    rocksdb_dir: str | None = None
    #: "rocksdb": memory bound of each keyed operator subtask's DB in MiB (block cache with the
    #: write buffers charged to it; Flink's ``state.backend.rocksdb.memory.fixed-per-slot``)
    rocksdb_memory_mb: int = 64

    def __post_init__(self) -> None:
        if self.state_backend_type not in STATE_BACKEND_TYPES:
            raise ValueError(
                f"state_backend_type must be one of {STATE_BACKEND_TYPES}, got {self.state_backend_type!r}")
        if self.rocksdb_memory_mb < 8:
            raise ValueError(f"rocksdb_memory_mb must be >= 8, got {self.rocksdb_memory_mb}")
        if self.state_backend not in STATE_BACKENDS:
            raise ValueError(f"state_backend must be one of {STATE_BACKENDS}, got {self.state_backend!r}")
        if self.interval is not None and self.interval <= 0:
            raise ValueError(f"checkpoint interval must be > 0 seconds or None, got {self.interval}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.num_retained < 1:
            raise ValueError(f"num_retained must be >= 1, got {self.num_retained}")
        if self.delta_compact_every < 0:
            raise ValueError(f"delta_compact_every must be >= 0, got {self.delta_compact_every}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {self.full_every}")
        if self.min_pause < 0 or self.timeout <= 0 or self.tolerable_failed < 0:
            raise ValueError("min_pause >= 0, timeout > 0 and tolerable_failed >= 0 are required")


@dataclass
class TrackerConfig:
    """trAcker mode's local trackers: XOR-fold SND/RCV reports per (segment, epoch) and flush
    every ``flush_interval`` seconds or ``flush_count`` events; ``aggregate=False`` sends one
    report per event (the paper's "without optimisation"). ``flush_on_promise=False``: a
    source's promise waits for the next timed flush instead of flushing at once (FlameStream's
    LocalAcker; one message per interval when epochs are a few records long)."""

    aggregate: bool = True
    flush_interval: float | None = 0.005
    flush_count: int | None = 1000
    #: event time: the synchronization slack delta of paper 000 §4.2, in timestamp units;
    #: a record's coarse time label is floor(timestamp / time_slack). Window and timer
    #: boundaries should be multiples of it; smaller means finer labels, more reports.
    time_slack: float = 1.0
    flush_on_promise: bool = True
    #: stateless chains (no keyed or operator state, timers or epoch hooks; not in a loop) hold
    #: nothing back: they process records of any epoch at once, pass each record's epoch on to
    #: its output and sink it into that epoch's writer, so only stateful operators wait for
    #: NEOSS (FlameStream's maps never wait, and its output barrier buffers by time)
    pass_through: bool = False
    #: with ``pass_through``: neighbouring pass-through chains are tracked as one segment, so a
    #: record's RCV at a chain and the SND of its output fold into one report (about half the
    #: reports on a path of stateless chains); the segment is bound once all of it has drained
    #: an epoch, which is when its last chain would be anyway (``tracker.segments.merge_groups``)
    merge_pass_through: bool = True

    def __post_init__(self) -> None:
        if not self.time_slack > 0:
            raise ValueError(f"TrackerConfig: time_slack must be > 0, got {self.time_slack}")
        if self.aggregate and self.flush_interval is None and self.flush_count is None:
            raise ValueError("TrackerConfig: with aggregate=True set flush_interval or flush_count (or both)")
        if self.flush_interval is not None and self.flush_interval < 0:
            raise ValueError(f"TrackerConfig: flush_interval must be >= 0, got {self.flush_interval}")
        if self.flush_count is not None and self.flush_count < 1:
            raise ValueError(f"TrackerConfig: flush_count must be >= 1, got {self.flush_count}")


def _with(strategy: RestartStrategy, field: str, value: Any) -> RestartStrategy:
    """``strategy`` with one field changed (the built-in strategies are frozen dataclasses)."""
    if not (is_dataclass(strategy) and hasattr(strategy, field)):
        raise ValueError(f"{type(strategy).__name__} has no {field!r}; set Pipeline.restart_strategy instead")
    changed: RestartStrategy = replace(strategy, **{field: value})
    return changed


@dataclass(frozen=True)
class OutputTag:
    """Names a side output, as Flink's ``OutputTag("late-data", Types.STRING())``: give it to
    a source as ``late_records=tag`` and take the stream with ``get_side_output(tag)``.
    ``type_info`` is optional and only documents the records' type."""

    tag_id: str
    type_info: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.tag_id, str) or not self.tag_id:
            raise ValueError(f"OutputTag needs a non-empty name, got {self.tag_id!r}")


class Stream:
    """A stream of records; each method adds an operator and returns the new stream."""

    def __init__(self, pipeline: "Pipeline", heads: list[Edge]) -> None:
        self._p = pipeline
        self._heads = heads
        #: side outputs of the operator that made this stream (a source's late records)
        self._side_outputs: dict[OutputTag, Stream] = {}

    def get_side_output(self, tag: OutputTag) -> "Stream":
        """The records sent to side output ``tag`` (Flink's ``getSideOutput``): a source's
        late records when it was built with ``late_records=tag``, or ``from_json``'s dead
        letters with ``dead_letter=tag``."""
        side = self._side_outputs.get(tag)
        if side is None:
            have = sorted(t.tag_id for t in self._side_outputs) or "none"
            raise ValueError(f"this stream has no side output {tag.tag_id!r} (its side outputs: {have}); "
                             f"pass late_records=OutputTag({tag.tag_id!r}) to its source, or "
                             f"dead_letter=OutputTag({tag.tag_id!r}) to from_json")
        return side

    # -- stateless transformations
    def map(self, fn: Callable[[Any], Any], name: str = "map") -> "Stream":
        return self._p._add(OpKind.MAP, name, fn, self._heads)

    def flat_map(self, fn: Callable[[Any], Iterable[Any]], name: str = "flat_map") -> "Stream":
        return self._p._add(OpKind.FLAT_MAP, name, fn, self._heads)

    def filter(self, fn: Callable[[Any], bool], name: str = "filter") -> "Stream":
        return self._p._add(OpKind.FILTER, name, fn, self._heads)

    def map_batches(self, fn: Callable[[Any], Any], name: str = "map_batches") -> "Stream":
        """``fn(batch)`` on whole Arrow RecordBatches, returning a RecordBatch or Table (or None).
        Columnar input passes as it is; rows (dicts) are made into a RecordBatch once per batch.
        For exactly-once, the output must not depend on where batches are cut (a row-wise map,
        a filter, added columns): a replay after a failure cuts them differently."""
        return self._p._add(OpKind.MAP_BATCHES, name, fn, self._heads)

    def from_json(self, schema: Any, column: str = "value", keep: Sequence[str] = (), *,
                  dead_letter: Any = None, max_record_bytes: int | None = 1 << 20, uid: str | None = None,
                  name: str = "from_json") -> "Stream":
        """Spark's ``from_json`` for a stream: the JSON objects in ``column`` (binary or string:
        a Kafka record's ``value``) become typed columns of ``schema`` (a Spark DDL string such as
        ``"k string, v long NOT NULL, ts timestamp"``, a ``pyspark.sql.types.StructType`` or a
        pyarrow Schema), one Arrow RecordBatch per input batch, decoded with one call of
        pyarrow's JSON reader, plus the ``keep`` columns carried over (``("key", "timestamp")``).
        As in Spark, a missing nullable field is null and fields the schema does not name are
        ignored. Rows (dicts with ``column``) work too: the column is made once per batch.

        A record that does not decode (malformed JSON, not an object, a value of the wrong type,
        a NOT NULL field missing or null, empty or null, more than ``max_record_bytes``) goes to
        the dead-letter output as ``{"topic", "partition", "offset" (when the input has them),
        "reason", "value"}`` (``reason`` names the field and the problem); it is counted
        (``JobResult.metrics["dead_letters"]``) and never stops the job. ``dead_letter``: an
        ``OutputTag`` (``get_side_output(tag)`` of the returned stream) or a sink; None (the
        default) writes them exactly once as JSON lines under
        ``<checkpoint_dir>/dead-letters/<uid>/`` and logs a WARNING naming the first of each
        epoch (per subtask). See ``runtime.jsoncodec``."""
        from ..runtime.jsoncodec import DeadLetter, JsonDecoder
        from ..runtime.sideoutput import MainOutput, SideOutput

        uid = uid or f"from_json-{len(self._p._nodes)}"
        decoder = JsonDecoder(schema, column, tuple(keep) if not isinstance(keep, str) else (keep,),
                              max_record_bytes, what=f"from_json {uid!r}")
        raw = self._p._add(OpKind.MAP_BATCHES, name, decoder, self._heads)
        main = self._p._add(OpKind.MAP_BATCHES, f"{name}_rows", MainOutput(DeadLetter), raw._heads)
        side = self._p._add(OpKind.MAP_BATCHES, "dead_letters", SideOutput(DeadLetter, "dead_letters"), raw._heads)
        if isinstance(dead_letter, OutputTag):
            main._side_outputs[dead_letter] = side
        elif dead_letter is None:
            from ..backends.sinks import DeadLetterFiles

            side.sink(DeadLetterFiles(uid), uid=f"{uid}-dead-letters", name="dead_letters_sink")
        elif isinstance(dead_letter, str) or not hasattr(dead_letter, "pre_commit"):
            raise TypeError(f"from_json {uid!r}: dead_letter must be an OutputTag or a sink, got {dead_letter!r}")
        else:
            side.sink(dead_letter, uid=f"{uid}-dead-letters", name="dead_letters_sink")
        return main

    # -- partitioning
    def key_by(self, key_fn: Callable[[Any], Any] | str | Sequence[str], key_type: Any = None) -> "KeyedStream":
        """Partition by ``key_fn(record)``, or by columns: ``key_by("k")`` (the key is the
        column's value) or ``key_by(["a", "b"])`` (the tuple of values). Column keys route
        Arrow batches without a Python call per row and give a key the same key group as the
        function ``lambda r: r["k"]`` (or ``(r["a"], r["b"])``) would on dict rows.
        ``key_type`` (``Types.STRING()`` ...) is optional, as in PyFlink: it is checked at each
        snapshot and types the key column of committed state."""
        if isinstance(key_fn, str):
            key_fn = ColumnKey((key_fn,))
        elif isinstance(key_fn, (list, tuple)):
            key_fn = ColumnKey(tuple(key_fn), tuple_key=True)
        elif not callable(key_fn):
            raise TypeError(f"key_by needs a function of the record or column name(s), got {key_fn!r}")
        if isinstance(key_fn, ColumnKey):
            self._check_columns(key_fn)
        if key_type is not None:
            from ..runtime.types import TypeInformation

            if not isinstance(key_type, TypeInformation):
                raise TypeError(f"key_by(key_type=...) needs a type from epochstream.Types, got {key_type!r}")
        return KeyedStream(self._p, [Edge(e.src, HASH, key_fn, key_type) for e in self._heads])

    def _check_columns(self, key: ColumnKey) -> None:
        """A ``key_by`` right after a source whose schema is known when the pipeline is built
        (``from_arrow``, ``from_parquet``) names a missing column now; elsewhere the first batch
        does (at run time, before its epoch can commit)."""
        from ..runtime.errors import SchemaError

        for e in self._heads:
            node = self._p._nodes[e.src]
            if not (node.kind == OpKind.SOURCE and getattr(node.payload, "schema_known_when_built", False)):
                continue
            schema = node.payload.schema()
            missing = [c for c in key.columns if c not in schema.names]
            if missing:
                raise SchemaError(f"key_by({key}) after source {node.uid!r}: no column {missing[0]!r} "
                                  f"(its columns: {schema.names})")

    def rebalance(self) -> "Stream":
        return Stream(self._p, [Edge(e.src, REBALANCE, None) for e in self._heads])

    def union(self, *others: "Stream") -> "Stream":
        heads = list(self._heads)
        for o in others:
            if o._p is not self._p:
                raise ValueError("union() needs streams of the same pipeline")
            heads.extend(o._heads)
        return Stream(self._p, heads)

    # -- cycles
    def iterate(self, uid: str | None = None, name: str = "iterate") -> "IterativeStream":
        """Start a loop (Flink's ``DataStream.iterate()``): the returned stream carries this
        stream's records and every record later fed back with ``close_with``."""
        uid = uid or f"iterate-{len(self._p._nodes)}"
        s = self._p._add(OpKind.ITERATE, name, Iteration(uid), self._heads, uid=uid)
        return IterativeStream(self._p, s._heads)

    # -- sinks
    def sink(self, sink: Any, uid: str | None = None, name: str = "sink") -> "Stream":
        """Write to a transactional sink: only committed epochs become visible."""
        uid = uid or f"sink-{len(self._p._nodes)}"
        return self._p._add(OpKind.SINK, name, sink, self._heads, uid=uid)

    add_sink = sink

    def process(self, fn: Any, uid: str | None = None, name: str | None = None) -> "Stream":
        raise TypeError("process() needs keyed state: call key_by(...) first")

    def process_batches(self, fn: Any, uid: str | None = None, name: str | None = None) -> "Stream":
        raise TypeError("process_batches() needs keyed state: call key_by(\"col\") first")

    # -- PySpark's stateful operators, run unchanged (epochstream.pyspark; needs pyspark, pandas)
    def transform_with_state(
        self,
        processor: Any,
        output_schema: Any,
        time_mode: str = "none",
        key: str | Sequence[str] | None = None,
        *,
        output_mode: str = "append",
        event_time: str | None = None,
        watermark_delay_ms: int = 0,
        input_schema: Any = None,
        rows: str = "pandas",
        clock: Any = None,
        initial_state: Any = None,
        micro_batch: str = "epoch",
        max_rows_per_trigger: int = 1_000_000,
        uid: str | None = None,
    ) -> "Stream":
        """Run a ``pyspark.sql.streaming.StatefulProcessor`` unchanged, grouped by the
        ``key`` column(s), as ``df.groupBy(key).transformWithStateInPandas(...)`` would
        (``rows="row"``: ``transformWithState`` with Rows). Records in are dicts or Rows;
        records out are dicts of ``output_schema``. ``initial_state`` (Spark's ``initialState``: a
        pandas DataFrame, Arrow table or Spark DataFrame with the key columns) is handed to
        ``handleInitialState`` once per key before its rows, in the job's first run only.
        ``micro_batch``: ``"epoch"`` (one ``handleInputRows`` per key per epoch with all its
        rows, Spark's call per micro-batch; run early once ``max_rows_per_trigger`` rows wait)
        or ``"batch"`` (one per key per runtime batch). See docs/PYSPARK.md."""
        from ..pyspark.operators import TransformWithState

        op = TransformWithState(processor, output_schema, time_mode, _key_columns(key), output_mode, event_time,
                                watermark_delay_ms, input_schema, rows, clock, initial_state, micro_batch,
                                max_rows_per_trigger)
        name = type(processor).__name__
        return self.key_by(op.grouping_key()).process(op, uid=uid, name=name)

    def apply_in_pandas_with_state(
        self,
        func: Callable[..., Any],
        output_schema: Any,
        state_schema: Any,
        output_mode: str,
        timeout_conf: str,
        key: str | Sequence[str] | None = None,
        *,
        event_time: str | None = None,
        watermark_delay_ms: int = 0,
        input_schema: Any = None,
        clock: Any = None,
        micro_batch: str = "epoch",
        max_rows_per_trigger: int = 1_000_000,
        uid: str | None = None,
    ) -> "Stream":
        """Run an ``applyInPandasWithState`` function ``func(key, pdf_iter, state)`` with
        PySpark's ``GroupState`` unchanged, grouped by the ``key`` column(s); ``micro_batch``
        and ``max_rows_per_trigger`` as for ``transform_with_state``. See docs/PYSPARK.md."""
        from ..pyspark.operators import ApplyInPandasWithState

        op = ApplyInPandasWithState(func, output_schema, state_schema, output_mode, timeout_conf, _key_columns(key),
                                    event_time, watermark_delay_ms, input_schema, clock, micro_batch,
                                    max_rows_per_trigger)
        name = getattr(func, "__name__", "apply_in_pandas_with_state")
        return self.key_by(op.grouping_key()).process(op, uid=uid, name=name)


def _key_columns(key: Any) -> Any:
    if key is None:
        raise TypeError("name the grouping column(s) with key=... (Spark: df.groupBy(...))")
    return key


@dataclass
class Iteration:
    """Payload of an ``iterate`` node: whether ``close_with`` has given it its feedback."""

    uid: str
    closed: bool = False


class IterativeStream(Stream):
    """The head of a loop: records entering it plus records fed back with ``close_with``.

    Records fed back travel the loop's *back edge*; the planner cuts it into a loop tail
    and a loop head joined by a phantom channel, which is what lets epochs end in a
    cycle (aligned mode logs what is in transit there; tracker mode treats the loop as one
    segment). A record fed back keeps going round until the body stops feeding it back,
    so the body must eventually drop (or emit) every record, or its epoch never ends.
    """

    def close_with(self, feedback: Stream) -> Stream:
        """Feed ``feedback`` back into this loop (Flink's ``closeWith``); returns it."""
        if feedback._p is not self._p:
            raise ValueError("close_with() needs a stream of the same pipeline")
        node = self._p._nodes[self._heads[0].src]
        if node.payload.closed:
            raise ValueError(f"iteration {node.uid!r} is already closed")
        node.inputs.extend(feedback._heads)
        node.payload.closed = True
        return feedback

    feedback = close_with


class KeyedStream(Stream):
    """A stream partitioned by key: keyed operators see every record of a key."""

    def process(self, fn: Any, uid: str | None = None, name: str | None = None) -> Stream:
        if not hasattr(fn, "process") and not hasattr(fn, "process_element"):
            raise TypeError(f"process() needs a KeyedProcessFunction, got {type(fn).__name__}")
        name = name or type(fn).__name__
        uid = uid or f"{name}-{len(self._p._nodes)}"
        return self._p._add(OpKind.PROCESS, name, fn, self._heads, uid=uid)

    def process_batches(self, fn: Any, uid: str | None = None, name: str | None = None) -> Stream:
        """A keyed function of Arrow batches: ``fn.process_batch(key, batch, ctx)`` once per key
        per batch, with that key's state current (``ctx.state(...)`` declared in ``open(ctx)``,
        as for ``process``); ``batch`` holds the key's rows in arrival order. It returns a
        RecordBatch or Table of output rows (or None). Needs ``key_by`` with column names; rows
        in are made into a batch once per batch. See ``KeyedBatchFunction``.

        For exactly-once, state and output must not depend on where batches are cut (keep
        per-row output, e.g. a running count, or aggregate in state and emit at epoch bounds)."""
        from ..runtime.columns import KeyedBatches

        keys = {e.key_fn for e in self._heads}
        key = next(iter(keys)) if len(keys) == 1 else None
        if not isinstance(key, ColumnKey):
            raise TypeError("process_batches() groups Arrow batches by columns: use key_by(\"col\") or "
                            "key_by([\"a\", \"b\"]) before it, not a key function")
        if not (hasattr(fn, "process_batch") or callable(fn)):
            raise TypeError(f"process_batches() needs a KeyedBatchFunction (or a function of key, batch, ctx), "
                            f"got {type(fn).__name__}")
        name = name or getattr(fn, "__name__", None) or type(fn).__name__
        uid = uid or f"{name}-{len(self._p._nodes)}"
        return self._p._add(OpKind.PROCESS, name, KeyedBatches(fn, key), self._heads, uid=uid)

    def reduce(self, fn: Callable[[Any, Any], Any], uid: str | None = None) -> Stream:
        """Running reduce per key, emitting the new aggregate for every record."""
        from .builtin import ReduceFunction

        return self.process(ReduceFunction(fn), uid=uid, name="reduce")

    def window(self, windows: Any) -> "WindowedStream":
        """Event-time windows per key (``TumblingEventTimeWindows``); needs ``mode="tracker"``
        and a source with ``timestamps=...``: windows close on the trAcker's time bounds."""
        return WindowedStream(self, windows)


class WindowedStream:
    """A keyed stream cut into event-time windows; aggregate each window to one record."""

    def __init__(self, keyed: KeyedStream, windows: Any) -> None:
        self._keyed = keyed
        self._windows = windows

    def aggregate(self, create: Callable[[], Any], add: Callable[[Any, Any], Any],
                  result: Callable[[Any], Any] = lambda acc: acc, uid: str | None = None) -> Stream:
        """Emit ``(key, window_start, window_end, result(acc))`` once event time passes the window."""
        from .builtin import WindowAggregateFunction

        fn = WindowAggregateFunction(self._windows, create, add, result)
        return self._keyed.process(fn, uid=uid, name="window")

    def reduce(self, fn: Callable[[Any, Any], Any], uid: str | None = None) -> Stream:
        """Emit ``(key, window_start, window_end, reduced value)`` per window."""
        return self.aggregate(lambda: _EMPTY, lambda acc, v: v if acc is _EMPTY else fn(acc, v), uid=uid)

    def count(self, uid: str | None = None) -> Stream:
        return self.aggregate(lambda: 0, lambda acc, _v: acc + 1, uid=uid)


class _Empty:
    """Picklable "no value yet" marker for window reduce (state is pickled)."""

    def __reduce__(self):
        return "_EMPTY"


_EMPTY = _Empty()


class Pipeline:
    """A streaming job: sources, operators and sinks, run with exactly-once epochs.

    ``mode``: ``aligned`` (barrier alignment, exactly-once), ``at-least-once`` (barriers
    without blocking) or ``tracker`` (trAcker firm bounds: a central agent tells each task
    when an epoch has no records left upstream; exactly-once, no markers on data channels)
    or ``unaligned`` (Flink's unaligned checkpoints: a marker overtakes the records queued
    ahead of it, which are stored with the snapshot as channel state; exactly-once, nothing
    waits under backpressure; a restore with channel state keeps the parallelism).
    ``aligned_timeout`` (seconds; Flink's ``aligned-checkpoint-timeout``), in mode ``aligned``
    or ``unaligned``: every epoch starts aligned and a task whose epoch waits longer (from the
    first marker it sees queued) switches to unaligned for that epoch (None: mode ``aligned`` never switches, mode
    ``unaligned`` is unaligned from the first marker).
    ``checkpoint_interval`` in seconds (None: only the final epoch of a bounded job, and
    epochs asked for on demand).
    ``batch_rows`` (formerly ``batch_size``; default 1024) and ``batch_linger`` (seconds,
    default 0) are the batching policy (``runtime.batching``): a source reads up to
    ``batch_rows`` records at once, and output to the next stage is sent when a channel holds
    ``batch_rows`` rows or its rows waited ``batch_linger`` seconds, whichever comes first;
    an epoch bound always sends everything. A linger trades latency for bigger batches, so a
    keyed pandas or batch function sees many rows per key per call (docs/OPERATIONS.md).
    ``buffer_debloat_target`` (seconds, default 1; None: off) bounds the data in flight on the
    local and spark drivers by time, as Flink's buffer debloating does: sources pause while a
    worker holds more rows than its operators get through in that time (``deploy.flow``), so
    an epoch waits about that long behind a full queue however slow the operator is.
    """

    def __init__(
        self,
        name: str,
        parallelism: int = 1,
        max_parallelism: int | None = None,
        mode: str = "aligned",
        checkpoint_interval: float | None | object = _UNSET,
        checkpoint: CheckpointConfig | None = None,
        batch_size: int | None = None,
        restart_attempts: int | None = None,
        restart_delay: float | None = None,
        tracker: TrackerConfig | None = None,
        restart_strategy: RestartStrategy | None = None,
        batch_rows: int | None = None,
        batch_linger: float = 0.0,
        heartbeat: HeartbeatConfig | None = None,
        slot_wait_timeout: float = DEFAULT_SLOT_WAIT_TIMEOUT,
        buffer_debloat_target: float | None = DEFAULT_DEBLOAT_TARGET,
        aligned_timeout: float | None = None,
    ) -> None:
        self.name = name
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.mode = mode
        self.checkpoint = checkpoint or CheckpointConfig()
        if checkpoint_interval is not _UNSET:
            if checkpoint_interval is not None and not isinstance(checkpoint_interval, (int, float)):
                raise TypeError(f"checkpoint_interval must be seconds (a number) or None, got {checkpoint_interval!r}")
            self.checkpoint = replace(self.checkpoint, interval=checkpoint_interval)
        if restart_strategy is not None and (restart_attempts is not None or restart_delay is not None):
            raise ValueError("pass either restart_strategy or restart_attempts/restart_delay, not both")
        if (restart_attempts is not None and restart_attempts < 0) or (restart_delay is not None and restart_delay < 0):
            raise ValueError("restart_attempts and restart_delay must be >= 0")
        if restart_strategy is not None and not isinstance(restart_strategy, RestartStrategy):
            raise TypeError(f"restart_strategy must be a RestartStrategy, got {type(restart_strategy).__name__}")
        #: what the drivers do after a failure (``deploy.restart``); the default is Flink's
        #: fixed-delay strategy with 10 attempts 0.5 s apart
        self.restart_strategy: RestartStrategy = restart_strategy or FixedDelayRestart(
            10 if restart_attempts is None else restart_attempts, 0.5 if restart_delay is None else restart_delay)
        self.tracker = tracker or TrackerConfig()
        if batch_size is not None and batch_rows is not None and batch_size != batch_rows:
            raise ValueError(f"batch_size is the former name of batch_rows: give one, "
                             f"not {batch_size} and {batch_rows}")
        rows = batch_rows if batch_rows is not None else batch_size
        #: the batching policy (``runtime.batching``): rows per source read and per full output
        #: buffer, and seconds buffered output may wait for more (0: sent at the end of every step)
        self.batching = BatchPolicy(DEFAULT_BATCH_ROWS if rows is None else rows, batch_linger)
        #: worker liveness on the local and spark drivers (Flink's heartbeat.interval / heartbeat.timeout)
        self.heartbeat = heartbeat or HeartbeatConfig()
        #: spark: seconds an attempt waits for its barrier task slots on a cluster that has too
        #: few, with the status WAITING_FOR_SLOTS, before the job fails (0: fail at once; Flink's
        #: slot.request.timeout; ``deploy.slots``)
        self.slot_wait_timeout = slot_wait_timeout
        self.buffer_debloat_target = buffer_debloat_target
        self.aligned_timeout = aligned_timeout
        self._nodes: dict[int, Node] = {}

    @property
    def mode(self) -> SnapshotMode:
        """How epochs end and are snapshotted (``runtime.modes``); set from its name or a member."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._mode = SnapshotMode(mode)

    @property
    def buffer_debloat_target(self) -> float | None:
        """Seconds of work the data in flight may hold (None: bounded by message counts only)."""
        return self._buffer_debloat_target

    @buffer_debloat_target.setter
    def buffer_debloat_target(self, seconds: float | None) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < float("inf")):
            raise ValueError(f"buffer_debloat_target must be finite seconds > 0, or None for off; got {seconds!r}")
        self._buffer_debloat_target = None if seconds is None else float(seconds)

    @property
    def aligned_timeout(self) -> float | None:
        """Seconds an epoch aligns before a task switches it to unaligned (None: never)."""
        return self._aligned_timeout

    @aligned_timeout.setter
    def aligned_timeout(self, seconds: float | None) -> None:
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
                raise ValueError(f"aligned_timeout must be a number of seconds >= 0 or None, got {seconds!r}")
            if not self.mode.implies.times_out_alignment:
                raise ValueError(f"aligned_timeout needs mode 'aligned' or 'unaligned', not '{self.mode}'")
        self._aligned_timeout = None if seconds is None else float(seconds)

    @property
    def slot_wait_timeout(self) -> float:
        """spark: seconds to wait for barrier task slots before failing (0: at once)."""
        return self._slot_wait_timeout

    @slot_wait_timeout.setter
    def slot_wait_timeout(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise ValueError(f"slot_wait_timeout must be finite seconds >= 0 (0: fail at once), got {seconds!r}")
        self._slot_wait_timeout = float(seconds)

    # -- the batching policy's knobs, like Spark's micro-batch size and Flink's buffer timeout
    @property
    def batch_rows(self) -> int:
        """Rows a source reads at once; an output buffer holding this many is sent."""
        return self.batching.rows

    @batch_rows.setter
    def batch_rows(self, rows: int) -> None:
        self.batching = replace(self.batching, rows=rows)

    #: the former name of ``batch_rows``
    batch_size = batch_rows

    @property
    def batch_linger(self) -> float:
        """Seconds buffered output may wait to fill up to ``batch_rows`` (0: never waits)."""
        return self.batching.linger

    @batch_linger.setter
    def batch_linger(self, seconds: float) -> None:
        self.batching = replace(self.batching, linger=seconds)

    # -- the fixed-delay knobs of earlier versions, kept as views of the restart strategy
    @property
    def restart_attempts(self) -> int | None:
        """Restarts the strategy allows (None: no fixed number, as for failure-rate)."""
        return getattr(self.restart_strategy, "attempts", None)

    @restart_attempts.setter
    def restart_attempts(self, attempts: int) -> None:
        self.restart_strategy = _with(self.restart_strategy, "attempts", attempts)

    @property
    def restart_delay(self) -> float | None:
        return getattr(self.restart_strategy, "delay", getattr(self.restart_strategy, "initial", None))

    @restart_delay.setter
    def restart_delay(self, delay: float) -> None:
        strategy = self.restart_strategy
        if isinstance(strategy, ExponentialDelayRestart):
            self.restart_strategy = replace(strategy, initial=delay, max_delay=max(delay, strategy.max_delay))
        else:
            self.restart_strategy = _with(strategy, "delay", delay)

    # -- sources
    def from_collection(self, items: Sequence[Any], splits: int | None = None, uid: str | None = None,
                        timestamps: Callable[[Any], float] | None = None,
                        max_out_of_orderness: float | None = None, idleness: float | None = None,
                    late_records: Any = "drop") -> Stream:
        """A bounded, replayable source over a collection.

        ``splits`` fixes the number of splits; without it the source is elastic: a fresh start
        uses the job's parallelism, a restore keeps the checkpoint's split count.
        ``timestamps``: the event time of a record in seconds (>= 0); giving it turns event
        time on (timers, windows). Without ``max_out_of_orderness`` timestamps must not
        decrease within a split. ``max_out_of_orderness`` (seconds, Flink's
        ``forBoundedOutOfOrderness``): a split's watermark is its newest timestamp minus this;
        a record behind it is late, dropped and counted (``late_records_dropped``).
        ``late_records``: ``"drop"`` (the default), an ``OutputTag`` (late records go to
        ``get_side_output(tag)`` of the returned stream, Flink's ``sideOutputLateData``) or a
        sink (they are written there, uid ``<uid>-late``).
        ``idleness`` (seconds, Flink's ``withIdleness``): a split with no record for that long
        stops holding the watermark back until it brings records again. See
        ``runtime.watermarks``."""
        source = CollectionSource(items, splits or self.parallelism, elastic=splits is None)
        return self.from_source(source, uid=uid, name="collection", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def generate(
        self, fn: Callable[[int], Any], count: int | None = None, splits: int | None = None, uid: str | None = None,
        timestamps: Callable[[Any], float] | None = None,
        max_out_of_orderness: float | None = None, idleness: float | None = None,
        late_records: Any = "drop",
    ) -> Stream:
        """Deterministic source: record i is ``fn(i)``; ``count=None`` is unbounded. ``splits``,
        ``timestamps``, ``max_out_of_orderness`` and ``idleness`` as in ``from_collection``."""
        source = GeneratorSource(fn, count, splits or self.parallelism, elastic=splits is None)
        return self.from_source(source, uid=uid, name="generate", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def from_dataframe(self, df, uid: str | None = None, path: str | None = None, records: str = "dict") -> Stream:
        """A bounded, replayable source over a Spark DataFrame: its partitions are the splits.

        Builds a snapshot at once (one Spark job writes each partition to Parquet under
        ``path``, which executors must all be able to read on a cluster); records are dicts
        (tuples with ``records="tuple"``, Arrow batches with ``records="arrow"``). See
        ``deploy.sources.DataFrameSource``."""
        from ..deploy.sources import DataFrameSource

        return self.from_source(DataFrameSource(df, path, records), uid=uid, name="dataframe")

    def rate(self, rows_per_second: float, splits: int | None = None, count: int | None = None,
             uid: str | None = None, records: str = "dict") -> Stream:
        """Spark's ``rate`` source: ``{"timestamp", "value"}`` records at ``rows_per_second``,
        unbounded unless ``count`` is given; replayable (timestamps are fixed when built).
        ``records="arrow"``: Arrow batches (columns timestamp float64, value int64)."""
        from ..deploy.sources import RateSource

        return self.from_source(RateSource(rows_per_second, splits or self.parallelism, count, records=records),
                                uid=uid, name="rate")

    def from_parquet(self, path: Any, uid: str | None = None, columns: list[str] | None = None,
                     timestamps: str | Callable[[Any], float] | None = None,
                     max_out_of_orderness: float | None = None, idleness: float | None = None,
                    late_records: Any = "drop") -> Stream:
        """A bounded, replayable columnar source over Parquet files (a file, a folder of
        ``*.parquet`` or a list of files): every row group is a split (files in sorted path
        order). ``columns``: read only these. ``timestamps`` as in ``from_arrow``. The files
        must not change while the job's checkpoints need them. See ``deploy.sources.ParquetSource``."""
        from ..deploy.sources import ParquetSource

        return self.from_source(ParquetSource(path, columns), uid=uid, name="parquet", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def from_arrow(self, data: Any, num_splits: int | None = None, uid: str | None = None,
                   timestamps: str | Callable[[Any], float] | None = None,
                   max_out_of_orderness: float | None = None, idleness: float | None = None,
                    late_records: Any = "drop") -> Stream:
        """A bounded, replayable columnar source over a pyarrow Table, RecordBatch or list of
        RecordBatches (one schema): records travel as Arrow batches. Split s of n holds the
        contiguous rows [s * N // n, (s + 1) * N // n); without ``num_splits`` the source is
        elastic, as in ``from_collection``. ``timestamps``: a column name (or a function of a
        dict row) giving event time; with event time on, records travel as dict rows."""
        from ..runtime.sources import ArrowSource

        source = ArrowSource(data, num_splits or self.parallelism, elastic=num_splits is None)
        return self.from_source(source, uid=uid, name="arrow", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def generate_batches(self, fn: Callable[[int, int], Any], count: int | None = None,
                         num_splits: int | None = None, uid: str | None = None, block_rows: int = 1024,
                         timestamps: str | Callable[[Any], float] | None = None,
                         max_out_of_orderness: float | None = None, idleness: float | None = None,
                    late_records: Any = "drop") -> Stream:
        """Vectorised deterministic source: ``fn(start, stop)`` returns a pyarrow RecordBatch of
        records [start, stop) (record i is row i; it must depend only on start and stop);
        ``count=None`` is unbounded. Rows are dealt to splits in blocks of ``block_rows``
        (``runtime.sources.BatchGeneratorSource``), so a read is one call of ``fn`` per block and
        a replay reads the same rows. ``num_splits`` and ``timestamps`` as in ``from_arrow``."""
        from ..runtime.sources import BatchGeneratorSource

        source = BatchGeneratorSource(fn, count, num_splits or self.parallelism, block_rows,
                                      elastic=num_splits is None)
        return self.from_source(source, uid=uid, name="generate_batches", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def from_kafka(self, bootstrap_servers: str, topics: Any, start: Any = "earliest", end: Any = None,
                   uid: str | None = None, group_id: str | None = None,
                   key_deserializer: Callable[[bytes | None], Any] | None = None,
                   value_deserializer: Callable[[bytes | None], Any] | None = None,
                   timestamps: str | Callable[[Any], float] | None = None,
                   settings: dict[str, Any] | None = None, max_out_of_orderness: float | None = None,
                   idleness: float | None = None, partition_discovery_interval: float | None = 30.0,
                   late_records: Any = "drop", records: str | None = None) -> Stream:
        """A replayable source over Kafka topics (a name, a list, or a compiled regular
        expression): one split per partition, Kafka offsets in the epoch manifest, read at
        ``read_committed``. ``start``: ``"earliest"``, ``"latest"``, a timestamp in ms or
        offsets (``{partition: offset}``, or ``{(topic, partition): offset}``); ``end``: None
        (unbounded), ``"latest"`` (the ends when the job is built) or offsets. Records have
        ``key``, ``value`` (bytes unless a deserializer is given), ``topic``, ``partition``,
        ``offset``, ``timestamp`` (ms) and ``headers``. ``records``: ``"arrow"`` (one Arrow
        RecordBatch per read, built from what the client returned, column by column:
        ``backends.kafka.records``) or ``"dict"`` (a dict per record); None (the default) is
        ``"arrow"`` unless a deserializer is given, which makes Python values per record. Batches
        are what ``from_json``, ``key_by("col")`` and the pandas operators take whole (no
        Python object per record from the consumer to the pandas frame); row operators (``map``,
        ``key_by(fn)``) get dict rows made once per batch, which costs a row-only job about
        0.4 us per record more than dicts made at the source. Offsets are committed to
        ``group_id`` (default ``epochstream-<uid>``) after each epoch completes, for monitoring.
        ``timestamps="kafka"``: the records' Kafka timestamps drive event time (in seconds:
        ``timestamp / 1000``; Arrow batches are labelled with Arrow); or a function of a record
        (seconds). ``max_out_of_orderness``
        and ``idleness`` (seconds) as in ``from_collection``: each partition has its own
        watermark, the source's is the minimum over its partitions that are not idle.
        ``partition_discovery_interval`` (seconds, Flink's ``partition.discovery.interval.ms``;
        None: off): an unbounded source picks up partitions added while it runs (and, over a
        pattern, new matching topics), each read from its beginning; over several topics or a
        pattern splits are named by (topic, partition). ``late_records`` as in
        ``from_collection``. ``bootstrap_servers="memory://<name>"``: the simulator's model of
        a cluster (``backends.kafka.model``, ``deployment="sim"`` only).
        Needs ``epochstream[kafka]``; see ``backends.kafka.source``."""
        from ..backends.kafka.model import ModelKafkaSource, is_model
        from ..backends.kafka.source import KafkaSource

        uid = uid or f"kafka-{len(self._nodes)}"
        source: Source
        if is_model(bootstrap_servers):  # the simulator's in-memory cluster (backends.kafka.model)
            source = ModelKafkaSource(bootstrap_servers, topics, start=start, end=end, group_id=group_id,
                                      key_deserializer=key_deserializer, value_deserializer=value_deserializer,
                                      records=records)
        else:
            source = KafkaSource(bootstrap_servers, topics, start=start, end=end, group_id=group_id,
                                 key_deserializer=key_deserializer, value_deserializer=value_deserializer,
                                 settings=settings, partition_discovery_interval=partition_discovery_interval,
                                 records=records)
        source.uid = uid
        if timestamps == "kafka":
            from ..backends.kafka.source import kafka_event_time

            timestamps = kafka_event_time
            source.timestamp_column = ("timestamp", 1000.0)  # batches: ms, labelled with Arrow
        return self.from_source(source, uid=uid, name="kafka", timestamps=timestamps,
                                max_out_of_orderness=max_out_of_orderness, idleness=idleness,
                                late_records=late_records)

    def from_source(self, source: Source, uid: str | None = None, name: str = "source",
                    timestamps: str | Callable[[Any], float] | None = None,
                    max_out_of_orderness: float | None = None, idleness: float | None = None,
                    late_records: Any = "drop") -> Stream:
        """Any ``runtime.sources.Source``; ``timestamps``, ``max_out_of_orderness`` and
        ``idleness`` as in ``from_collection`` (``timestamps`` may name a dict record's key)."""
        uid = uid or f"source-{len(self._nodes)}"
        source.uid = uid  # named in a columnar source's errors
        if isinstance(timestamps, str):  # a column: rows read it by name, batches are labelled with Arrow
            import operator

            source.timestamp_column = (timestamps, 1.0)
            timestamps = operator.itemgetter(timestamps)
        if timestamps is not None:
            source.timestamp = timestamps
        if max_out_of_orderness is not None or idleness is not None:
            if timestamps is None:
                raise ValueError(f"source {uid!r}: max_out_of_orderness and idleness need timestamps=...")
            if idleness is not None and max_out_of_orderness is None:
                max_out_of_orderness = 0.0  # Flink's forMonotonousTimestamps().withIdleness(...)
            if not (isinstance(max_out_of_orderness, (int, float)) and max_out_of_orderness >= 0):
                raise ValueError(f"source {uid!r}: max_out_of_orderness must be seconds >= 0, "
                                 f"got {max_out_of_orderness!r}")
            if idleness is not None and not (isinstance(idleness, (int, float)) and idleness > 0):
                raise ValueError(f"source {uid!r}: idleness must be seconds > 0, got {idleness!r}")
            source.max_out_of_orderness = float(max_out_of_orderness)
            source.idleness = None if idleness is None else float(idleness)
        if isinstance(late_records, str) and late_records == "drop":
            return self._add(OpKind.SOURCE, name, source, [], uid=uid)
        if isinstance(late_records, str) or late_records is None:
            raise ValueError(f"source {uid!r}: late_records must be 'drop', an OutputTag or a sink, "
                             f"got {late_records!r}")
        if max_out_of_orderness is None:
            raise ValueError(f"source {uid!r}: late_records needs max_out_of_orderness=<seconds> (and timestamps=...)"
                             f"; without it no record is late")
        return self._with_late_output(self._add(OpKind.SOURCE, name, source, [], uid=uid), source, uid,
                                      late_records)

    def _with_late_output(self, raw: Stream, source: Source, uid: str, late_records: Any) -> Stream:
        """The source's records split in two by chained operators: the on-time ones (the
        returned stream) and the late ones, unwrapped, as its side output (``runtime.watermarks``)."""
        from ..runtime.sideoutput import MainOutput, SideOutput
        from ..runtime.watermarks import LateRecord

        source.late_output = True
        # columnar-aware splitters: an Arrow batch of on-time records passes whole
        main = self._add(OpKind.MAP_BATCHES, "on_time", MainOutput(LateRecord), raw._heads)
        side = self._add(OpKind.MAP_BATCHES, "late_records", SideOutput(LateRecord), raw._heads)
        if isinstance(late_records, OutputTag):
            main._side_outputs[late_records] = side
        else:
            side.sink(late_records, uid=f"{uid}-late", name="late_records_sink")
        return main

    # -- building
    def _add(self, kind: OpKind, name: str, payload: Any, inputs: list[Edge], uid: str | None = None) -> Stream:
        nid = len(self._nodes)
        self._nodes[nid] = Node(nid, kind, name, payload, uid, list(inputs))
        return Stream(self, [Edge(nid, FORWARD, None)])

    def plan(self, parallelism: int | None = None) -> PhysicalPlan:
        return build_plan(self.name, self._nodes, parallelism or self.parallelism, self.max_parallelism)

    @property
    def sources(self) -> dict[str, Source]:
        return {uid_of(n): n.payload for n in self._nodes.values() if n.kind == OpKind.SOURCE}

    @property
    def sinks(self) -> dict[str, Any]:
        return {uid_of(n): n.payload for n in self._nodes.values() if n.kind == OpKind.SINK}

    def run(
        self,
        deployment: str = "local",
        checkpoint_dir: Any = None,
        restore: str | None = None,
        seed: int = 0,
        allow_non_restored_state: bool = False,
        duration: float | None = None,
        **options: Any,
    ) -> JobResult:
        """Run the job until its bounded sources are done (or ``duration`` seconds pass).

        ``checkpoint_dir``: a local path, ``s3://bucket/prefix`` (boto3's usual credential
        chain; ``AWS_ENDPOINT_URL`` for an S3-compatible server) or a ``CheckpointStorage``;
        None: a new temporary folder. ``restore``: None (fresh start), ``"latest"`` (newest
        completed checkpoint in ``checkpoint_dir``) or the location of a checkpoint.
        ``allow_non_restored_state`` drops the state of operators the pipeline no longer has;
        ``allow_sources_from_start=True`` (an option) lets a source with no offsets in the
        restored checkpoint start from the beginning although sinks hold committed output.
        ``lease_ttl`` (an option, seconds, default 30): how long the run's lease on the
        checkpoint folder outlives its last heartbeat (``deploy.lease``).
        """
        if deployment not in DEPLOYMENTS:
            raise ValueError(f"deployment must be one of {DEPLOYMENTS}, got {deployment!r}")
        from ..deploy import run_pipeline

        return run_pipeline(
            self,
            deployment=deployment,
            checkpoint_dir=checkpoint_dir,
            restore=restore,
            seed=seed,
            allow_non_restored_state=allow_non_restored_state,
            duration=duration,
            **options,
        )
