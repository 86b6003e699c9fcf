"""Keyed operators that run PySpark stateful code unchanged: a ``StatefulProcessor``
(``transformWithStateInPandas`` / ``transformWithState``) and an ``applyInPandasWithState``
function with its ``GroupState``.

Grouping (``micro_batch``). Spark calls the user once per key per micro-batch and
partition, with every row of that key in the trigger. An epoch is Spark's micro-batch, so by
default (``micro_batch="epoch"``) the operator keeps the runtime batches it is handed (Arrow
RecordBatches and rows as they came) and at the epoch's bound, before its state
is captured, calls the user once per key with an iterator over all of that key's frames of
the epoch, keys in first-appearance order, rows in arrival order; then timeouts and timers,
as Spark runs them after the micro-batch's data. The output joins the epoch, so an
exactly-once sink shows it at the same commit as before. ``max_rows_per_trigger`` bounds
what is kept: once that many rows wait the calls run early (a micro-batch cut short, like
Kafka's ``maxOffsetsPerTrigger``). Before job-wide event time moves (a timestamped source) the
waiting rows are processed, so the timers they register below the new watermark fire with it
and a timer never overtakes the data it follows. ``micro_batch="batch"`` calls
the user once per key per runtime batch (the records one upstream subtask sent in one step)
instead: output leaves as soon as the batch is processed, in more, smaller calls.

Time. ``batch_time_ms`` is read once per micro-batch (its calls) and once per epoch bound
from ``clock`` (default: the wall clock in ms, as Spark's batch timestamp), and stays fixed
while they run. Expired timers (and applyInPandasWithState timeouts) fire after the
micro-batch's data, as Spark fires them, and at every epoch bound, so a quiet key still
times out (Spark runs no-data micro-batches for that). Event time: the job's own event time
drives timers where a source has timestamps (the trAcker's time bounds, or aligned
watermarks). Otherwise the watermark advances only at epoch bounds, to ``max event time
seen - delay`` (Spark: at micro-batch boundaries); rows at or below it are dropped as late,
event-time timers fire when it reaches them. That maximum is kept per key in keyed state
(``$eventTime``), so it is snapshotted and rescales with the keys; a subtask's watermark is
then the maximum over its own keys (see docs/PYSPARK.md).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from ..graph.plan import ColumnKey
from ..runtime.columns import concat, to_rows
from ..runtime.errors import UserFunctionError
from ..runtime.state import ListStateDescriptor, ValueStateDescriptor
from ..runtime.timers import TimerService
from .handles import EVENT_TIME, EpochStatefulProcessorHandle, Timers
from .schema import (
    Row,
    StructType,
    arrow_schema,
    as_dicts,
    batches_of,
    batches_to_records,
    concat_output,
    group_state_row,
    named_row,
    pandas_groups,
    row_groups,
    rows_to_records,
    state_tuple,
    struct_schema,
    take_frames,
    to_python,
)

TIME_MODES = ("none", "processingtime", "eventtime")
OUTPUT_MODES = ("append", "update")
GROUP_STATE = "$groupState"
#: union operator state of a wrapper with an event-time column: per subtask, the late-row
#: threshold of the next epoch (the watermark as of the start of the epoch before it), which
#: a restore cannot derive from the keys' event times
LATE_WATERMARK = "$lateWatermark"
#: union operator state of a TransformWithState with an initial state: set once it was read
INITIAL_STATE_DONE = "$initialStateDone"
#: what one user call per key covers: every row of the key in an epoch (Spark's micro-batch),
#: or in one runtime batch
MICRO_BATCHES = ("epoch", "batch")
#: rows a subtask of a wrapper keeps for its per-epoch calls before it runs them early
DEFAULT_MAX_ROWS_PER_TRIGGER = 1_000_000


def initial_table(data: Any, key_columns: tuple[str, ...], label: str) -> Any:
    """Spark's ``initialState`` as an Arrow table: a pandas DataFrame, an Arrow Table or
    RecordBatch, or a Spark DataFrame (read once, on the driver, with ``toArrow``)."""
    import pyarrow as pa

    if data is None:
        return None
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    elif hasattr(data, "toArrow") and hasattr(data, "sparkSession"):  # a pyspark DataFrame
        table = data.toArrow()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        table = pa.Table.from_pandas(data, preserve_index=False)
    else:
        raise TypeError(f"initial_state of {label} must be a pandas DataFrame, an Arrow table or a Spark "
                        f"DataFrame, got {type(data).__name__}")
    missing = [c for c in key_columns if c not in table.column_names]
    if missing:
        from .schema import SchemaError

        raise SchemaError(f"initial_state of {label} lacks the grouping column(s) {missing} "
                          f"(its columns: {table.column_names})")
    return table


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a micro-batch's calls run (on again after,
    if it was on). Each call makes a few hundred short-lived objects (the user's frames,
    GroupStates, Rows) while thousands of the micro-batch's frames are alive, so generation-0
    and -1 collections kept rescanning them: about a quarter of the CPU of a bound at 10,000
    keys. Nothing is lost: cycles made meanwhile are collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


def _clock(clock: Any) -> Callable[[Any], int]:
    """``clock`` -> function of the operator's context returning ms."""
    if clock is None:
        return lambda ctx: _wall_clock_ms()
    if clock == "pipeline":  # the driver's time: virtual seconds in the simulator
        return lambda ctx: int(ctx.now * 1000)
    if callable(clock):
        return lambda ctx: int(clock())
    raise ValueError(f"clock must be None (wall clock), 'pipeline' or a callable returning ms, got {clock!r}")


#: event-time values ``_event_time_ms`` reads as epoch milliseconds with ``int``
_EPOCH_MS_TYPES = frozenset({int, float})


def _event_time_ms(v: Any) -> int:
    if isinstance(v, bool) or v is None:
        raise ValueError(f"event time must be a timestamp or epoch milliseconds, got {v!r}")
    if isinstance(v, (int, float)):
        return int(v)
    v = to_python(v)
    if isinstance(v, datetime.datetime):
        if v.tzinfo is None:  # naive timestamps are UTC (Spark: the session time zone)
            v = v.replace(tzinfo=datetime.timezone.utc)
        return int(v.timestamp() * 1000)
    raise ValueError(f"event time must be a timestamp or epoch milliseconds, got {v!r}")


@dataclass(frozen=True)
class GroupingKey(ColumnKey):
    """The ``key_by`` of a wrapper: Arrow batches are routed on the grouping columns (the key
    is the tuple of their values), rows are keyed by the wrapper's own ``key_of`` (dicts, Rows,
    tuples with ``input_schema``). Both give a record the same key, so the same key group."""

    key_of: Callable[[Any], tuple] | None = field(default=None, compare=False)

    def __call__(self, record: Any) -> Any:
        assert self.key_of is not None, "GroupingKey is built with the wrapper's key_of"
        return self.key_of(record)


class _Rows:
    """Row records kept for one round of calls: dicts in arrival order and their keys, late
    rows already dropped. Consecutive row batches share one, so their rows become Arrow
    together (``schema.row_groups``) and a key gets one frame for them. It holds lists of
    its own: the caller's may be reused once the batch is handed over."""

    __slots__ = ("rows", "keys")

    def __init__(self, rows: list[dict], keys: list[Any]) -> None:
        self.rows, self.keys = list(rows), list(keys)

    def extend(self, other: "_Rows") -> None:
        self.rows.extend(other.rows)
        self.keys.extend(other.keys)


class _Keyed:
    """Shared by both operators: key columns, input conversion, event time and watermark.

    Columnar input. The chain hands ``apply_batch`` a RecordBatch as it came
    (``takes_record_batches``) instead of making rows of it: it is grouped by the key columns
    with Arrow and each key's rows reach the user as a pandas DataFrame
    (``schema.pandas_groups``). Row input (dicts, Rows, tuples) becomes Arrow once per run
    of kept row batches and is cut the same way (``schema.row_groups``), each key's frame
    what converting its rows alone gives. Where rows are needed anyway (an ``event_time``
    column: late rows are dropped row by row; Row-mode ``transform_with_state``) a
    RecordBatch becomes rows once and takes the row path.

    Micro-batches. What one round of calls covers is a list of *segments*: RecordBatches as
    they came, or ``_Rows`` (the row path, late rows already dropped: the late threshold
    moves only at epoch bounds). ``micro_batch="epoch"`` keeps the segments of the
    epoch in ``_pending`` and runs them at the bound (``on_epoch_end``), when event time is
    about to move (``drain_input``) or once ``max_rows_per_trigger`` rows wait;
    ``"batch"`` runs each runtime batch at once.
    """

    #: the chain passes RecordBatches to ``apply_batch`` whole (keys: None)
    takes_record_batches = True

    #: whether the operator's timers are event-time timers (each operator sets it from its mode)
    uses_event_time: bool
    #: the runtime's TimerService when ``uses_event_time`` and the job has event time, else None (set by open)
    tracker_time: TimerService | None

    def __init__(
        self,
        key: str | list[str] | tuple[str, ...],
        output_schema,
        input_schema,
        event_time: str | None,
        watermark_delay_ms: int,
        clock: Any,
        micro_batch: str = "epoch",
        max_rows_per_trigger: int = DEFAULT_MAX_ROWS_PER_TRIGGER,
    ) -> None:
        if micro_batch not in MICRO_BATCHES:
            raise ValueError(f"micro_batch must be 'epoch' (one call per key per epoch, as Spark per micro-batch) "
                             f"or 'batch' (one per key per runtime batch), got {micro_batch!r}")
        if isinstance(max_rows_per_trigger, bool) or not isinstance(max_rows_per_trigger, int) \
                or max_rows_per_trigger < 1:
            raise ValueError(f"max_rows_per_trigger must be an int >= 1, got {max_rows_per_trigger!r}")
        self.micro_batch = micro_batch
        self.max_rows_per_trigger = max_rows_per_trigger
        self.key_columns = (key,) if isinstance(key, str) else tuple(key)
        if not self.key_columns or not all(isinstance(c, str) for c in self.key_columns):
            raise ValueError(f"key must name one or more columns, got {key!r}")
        #: ``key_of`` of a dict: its one key column, or a getter of the tuple of them
        self._one_key = self.key_columns[0] if len(self.key_columns) == 1 else None
        self._key_items = operator.itemgetter(*self.key_columns)
        self.output_schema: StructType = struct_schema(output_schema, "output schema")
        self.input_schema: StructType | None = (
            struct_schema(input_schema, "input schema") if input_schema is not None else None
        )
        if watermark_delay_ms < 0:
            raise ValueError(f"watermark_delay_ms must be >= 0, got {watermark_delay_ms}")
        self.event_time = event_time
        self.watermark_delay_ms = int(watermark_delay_ms)
        self.clock = clock
        self._now = _clock(clock)
        self.batch_time_ms = -1
        self.watermark_ms = 0
        #: rows at or below it are late: Spark's eventTimeWatermarkForLateEvents, the watermark
        #: of the *previous* micro-batch, which is the watermark as of the start of the previous
        #: epoch here (measured on Spark 4.2: a row of batch N is late at or below
        #: ``max event time of batches <= N-2 - delay``). Timers fire against ``watermark_ms``
        #: (Spark's eventTimeWatermarkForEviction, the current batch's), which a job-wide event
        #: time moves within the epoch
        self.late_ms = 0
        #: the watermark as of the start of the current epoch (the late threshold of the next)
        self._epoch_start_ms = 0

    #: what error messages call the user code (the processor's class or the function's name)
    label: str

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a step that calls user code. ``SystemExit``, ``KeyboardInterrupt`` and any other
        ``BaseException`` it raises fail the job (the attempt, under the restart strategy) as an
        ``Exception`` does, instead of escaping the driver: a ``UserFunctionError`` naming the
        operator."""
        try:
            return fn(*args)
        except Exception:
            raise
        except BaseException as exc:
            uid = getattr(getattr(self, "ctx", None), "operator_uid", None)
            where = f"operator {uid!r} ({self.label})" if uid else self.label
            raise UserFunctionError(f"{where}: user code raised {exc!r} in {what}; a BaseException in user "
                                    f"code fails the job as any error does") from exc

    def grouping_key(self) -> GroupingKey:
        """What the wrapper is keyed by (``Stream.key_by``): the grouping columns."""
        return GroupingKey(self.key_columns, tuple_key=True, key_of=self.key_of)

    def _rows_of(self, batch: Any) -> tuple[list[Any], list[Any]]:
        """A RecordBatch as the row path's records and keys."""
        rows = to_rows(batch)
        return rows, [self.key_of(r) for r in rows]

    def _pandas_groups(self, batch: Any, what: str) -> list[tuple[tuple, Any]]:
        return pandas_groups(batch, self.key_columns, self._arrow_in, what)

    # ------------------------------------------------------------ micro-batches
    #: whether a RecordBatch reaches the user without becoming rows (each operator decides)
    _columns_in: bool
    #: segments kept for the epoch's calls (``micro_batch="epoch"``) and their rows (set by open)
    _pending: list[Any]
    _pending_rows: int
    #: the kept segments' calls and the output as the chain takes it (each operator's)
    _drain_output: Callable[[Any], Any]

    def _segment(self, records: Any, keys: list[Any] | None) -> Any:
        """One runtime batch as a segment: a RecordBatch as it came, or its ``_Rows``."""
        if type(records) is not list:
            if self._columns_in:
                return records
            records, keys = self._rows_of(records)
        assert keys is not None, "rows come with their keys"
        return self._kept_rows(records, keys)

    def _buffer(self, records: Any, keys: list[Any] | None) -> bool:
        """Keep a runtime batch for the epoch's calls; whether ``max_rows_per_trigger`` rows
        now wait. Consecutive row batches share one ``_Rows``, so a key gets one frame for
        them; consecutive RecordBatches of one schema are grouped as one (``_by_key``)."""
        seg = self._segment(records, keys)
        pending = self._pending
        if type(seg) is _Rows:
            last = pending[-1] if pending else None
            if type(last) is _Rows:
                last.extend(seg)
            elif seg.rows:
                pending.append(seg)
            self._pending_rows += len(records)
        elif seg.num_rows:
            pending.append(seg)
            self._pending_rows += seg.num_rows
        return self._pending_rows >= self.max_rows_per_trigger

    def _take_pending(self) -> list[Any]:
        segments, self._pending, self._pending_rows = self._pending, [], 0
        return segments

    def _by_key(self, segments: list[Any]) -> dict[Any, list[Any]]:
        """Each key's data over ``segments``, keys in first-appearance order, a key's parts in
        arrival order: pandas frames (a run of RecordBatches of one schema is concatenated and
        grouped once, so a key gets one frame for the run; a ``_Rows`` becomes one frame per
        key) or, in Row mode, lists of row dicts."""
        per_key: dict[Any, list[Any]] = {}
        run: list[Any] = []

        def group_run() -> None:
            if run:
                for key, pdf in self._pandas_groups(concat(run), self.label):
                    parts = per_key.get(key)
                    if parts is None:
                        per_key[key] = [pdf]
                    else:
                        parts.append(pdf)
                run.clear()

        for seg in segments:
            if type(seg) is _Rows:
                group_run()
                for key, part in self._row_parts(seg):
                    parts = per_key.get(key)
                    if parts is None:
                        per_key[key] = [part]
                    else:
                        parts.append(part)
            else:
                if run and seg.schema != run[0].schema:
                    group_run()
                run.append(seg)
        group_run()
        return per_key

    #: whether the user gets pandas frames (else Rows: Row-mode ``transform_with_state``)
    _pandas_in: bool

    def _row_parts(self, seg: _Rows) -> list[tuple[Any, Any]]:
        """``[(key, part)]`` of kept rows, keys in first-appearance order: each key's rows as
        one pandas frame (one Arrow conversion of all the rows, ``schema.row_groups``), or
        in Row mode as a list of dicts."""
        if self._pandas_in:
            return row_groups(seg.rows, seg.keys, self.key_columns, self._arrow_in, self.label)
        groups: dict[Any, list[dict]] = {}
        for r, k in zip(seg.rows, seg.keys, strict=True):
            g = groups.get(k)
            if g is None:
                groups[k] = [r]
            else:
                g.append(r)
        return list(groups.items())

    def _frames(self, parts: list[Any]) -> list[Any]:
        """A key's parts as the user's frames (``_by_key`` made them)."""
        return parts

    def drain_input(self, ctx) -> Any:
        """Job-wide event time is about to move here (``ChainRuntime.fire_timers``): run the
        calls for the rows kept so far first, so the timers they register below the new
        watermark fire with it and a timer follows the data it came after, as when every
        runtime batch ran at once. Its output, or None."""
        if not self._pending:
            return None
        return self._guard(self.label, self._drain_output, ctx)

    # the key function routes records to subtasks; the same tuple is the grouping key
    def key_of(self, record: Any) -> tuple:
        if isinstance(record, dict):  # twice per row (routing, then the receiving chain): no generator
            one = self._one_key
            return (record[one],) if one is not None else self._key_items(record)
        if named_row(record):
            return tuple(record[c] for c in self.key_columns)
        if self.input_schema is not None:
            names = self.input_schema.names
            return tuple(record[names.index(c)] for c in self.key_columns)
        raise TypeError("records must be dicts or pyspark Rows (or tuples with input_schema=...), "
                        f"got {type(record).__name__}")

    def _open_common(self, ctx) -> None:
        self.ctx = ctx
        self._pending = []
        self._pending_rows = 0
        #: the runtime's TimerService when the job has event time (a timestamped source: trAcker
        #: bounds or aligned watermarks); timers then fire from it instead of the epoch-bound watermark
        timers = getattr(ctx, "timers", None)
        self.tracker_time = timers if self.uses_event_time and timers is not None and timers.enabled else None
        self._arrow_in = arrow_schema(self.input_schema) if self.input_schema is not None else None
        self._arrow_out = arrow_schema(self.output_schema)
        self._max_event = None
        if self.event_time is not None:
            self._et = ctx.state(ValueStateDescriptor(EVENT_TIME))
            current = ctx.key
            for key in ctx.keys(EVENT_TIME):  # restored: the watermark is a function of the keys' maxima
                ctx.set_current_key(key)
                v = self._et.value()
                if self._max_event is None or v > self._max_event:
                    self._max_event = v
            ctx.set_current_key(current)
            self.watermark_ms = 0
            self._late = ctx.operator_state(ListStateDescriptor(LATE_WATERMARK), "union")
            if self.tracker_time is not None:
                self._tracker_watermark()
            elif self._max_event is not None:
                self.watermark_ms = max(0, self._max_event - self.watermark_delay_ms)
            self.late_ms, start = self._restored_late(ctx)
            self.watermark_ms = self._epoch_start_ms = max(self.watermark_ms, start)

    def _restored_late(self, ctx) -> tuple[int, int]:
        """The late threshold and epoch-start watermark of the first epoch after a restore, as
        the failure-free run had them: this subtask's stored ones, or after a rescale the
        smallest stored (no row the old subtasks kept is dropped); zeros on a fresh start.
        A job-wide event time (the trAcker, aligned watermarks) starts again from nothing
        after a restore, so the epoch-start watermark is kept too."""
        stored = self._late.get()
        if not stored:
            return 0, 0
        own = [(late, start) for sub, par, late, start in stored
               if par == ctx.parallelism and sub == ctx.subtask_index]
        if own:
            return own[0]
        return min(e[2] for e in stored), min(e[3] for e in stored)

    def _advance_watermark(self) -> None:
        """At an epoch bound: the rows of the next epoch are late against the watermark as of
        the start of the epoch that ends (Spark: the previous micro-batch's), then the
        watermark moves (timers fire against it)."""
        self.late_ms = self._epoch_start_ms
        if self.tracker_time is not None:
            self._tracker_watermark()
        elif self._max_event is not None:
            self.watermark_ms = max(self.watermark_ms, self._max_event - self.watermark_delay_ms)
        self._epoch_start_ms = self.watermark_ms
        self._late.update([(self.ctx.subtask_index, self.ctx.parallelism, self.late_ms, self._epoch_start_ms)])

    def _tracker_watermark(self, firing: int | None = None) -> None:
        """Every record with an event time below the trAcker's bound W has been processed:
        Spark's watermark (rows at or below it are late, timers at or below it fire) is W - 1.
        At the end of bounded input W is infinite (every timer fires, as at Flink's end of
        input); the watermark reported is then the largest event time seen or the expiry of
        the timer firing, whichever is later."""
        tracker = self.tracker_time
        assert tracker is not None, "trAcker watermarks are read only when timers fire from the TimerService"
        w = tracker.watermark
        if w == float("inf"):
            w = max(self._max_event if self._max_event is not None else self.watermark_ms,
                    firing if firing is not None else -(2**63)) + 1
        if w != float("-inf"):
            self.watermark_ms = max(self.watermark_ms, int(math.ceil(w)) - 1)

    def _kept_rows(self, records: list[Any], keys: list[Any]) -> _Rows:
        """Records as dicts with their keys, in arrival order; in event time late rows dropped
        and each key's newest event time kept (row by row: a Python value per row decides)."""
        rows = as_dicts(records, self.input_schema)
        if self.event_time is None:
            return _Rows(rows, keys)
        if self.tracker_time is not None:
            self._tracker_watermark()  # what TimerValues report (timers fire against it)
        # late against the watermark as of the start of the previous epoch (Spark: of the
        # previous micro-batch); it moves only at epoch bounds, whatever drives event time
        col, wm = self.event_time, self.late_ms
        values = list(map(operator.itemgetter(col), rows))
        if set(map(type, values)) <= _EPOCH_MS_TYPES:
            times = list(map(int, values))  # what _event_time_ms gives an int or a float
        else:
            times = list(map(_event_time_ms, values))
        # Spark drops late rows only where event time drives the operator: transformWithState in
        # EventTime mode, applyInPandasWithState with EventTimeTimeout (measured on Spark 4.2)
        if self.uses_event_time:
            kept = [et > wm for et in times]  # late: at or below the watermark (Spark drops it before the operator)
            if not all(kept):
                rows = list(itertools.compress(rows, kept))
                keys = list(itertools.compress(keys, kept))
                times = list(itertools.compress(times, kept))
        maxima: dict[Any, int] = {}
        for k, et in zip(keys, times, strict=True):
            if et > maxima.get(k, -(2**63)):
                maxima[k] = et
        ctx, h = self.ctx, self._et
        for k, et in maxima.items():
            ctx.set_current_key(k)
            old = h.value()
            if old is None or et > old:
                h.update(et)
            if self._max_event is None or et > self._max_event:
                self._max_event = et
        return _Rows(rows, keys)


class TransformWithState(_Keyed):
    """Runs a ``pyspark.sql.streaming.StatefulProcessor`` as an epochstream keyed operator
    (``Stream.transform_with_state``)."""

    def __init__(
        self,
        processor: Any,
        output_schema,
        time_mode: str = "none",
        key: str | list[str] | tuple[str, ...] = "key",
        output_mode: str = "append",
        event_time: str | None = None,
        watermark_delay_ms: int = 0,
        input_schema=None,
        rows: str = "pandas",
        clock: Any = None,
        initial_state: Any = None,
        micro_batch: str = "epoch",
        max_rows_per_trigger: int = DEFAULT_MAX_ROWS_PER_TRIGGER,
    ) -> None:
        from pyspark.sql.streaming.stateful_processor import StatefulProcessor

        super().__init__(key, output_schema, input_schema, event_time, watermark_delay_ms, clock, micro_batch,
                         max_rows_per_trigger)
        if not isinstance(processor, StatefulProcessor):
            raise TypeError(f"transform_with_state needs a pyspark StatefulProcessor, got {type(processor).__name__}")
        mode = str(time_mode).lower()
        if mode not in TIME_MODES:
            raise ValueError(f"time_mode must be one of 'None', 'ProcessingTime', 'EventTime', got {time_mode!r}")
        if mode == "eventtime" and event_time is None:
            raise ValueError("time_mode='eventtime' needs event_time=<column> (Spark: withWatermark on the input)")
        if str(output_mode).lower() not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be 'Append' or 'Update', got {output_mode!r}")
        if rows not in ("pandas", "row"):
            raise ValueError("rows must be 'pandas' (transformWithStateInPandas) or 'row' (transformWithState), "
                             f"got {rows!r}")
        self.processor = processor
        self.label = type(processor).__name__
        #: Spark's ``initialState``: an Arrow table with the key columns, or None
        self.initial_state = initial_table(initial_state, self.key_columns, self.label)
        #: handle phase, as Spark's StatefulProcessorHandleState (handles.PHASES)
        self.phase = "CREATED"
        self.time_mode = mode
        self.output_mode = str(output_mode).lower()
        self.rows = rows
        #: pandas output leaves as one RecordBatch per input batch (rows made of it downstream
        #: carry maps as dicts, ``runtime.columns.to_rows``)
        self._columnar_out = rows == "pandas"
        self._columns_in = event_time is None and rows == "pandas"
        self._pandas_in = rows == "pandas"
        #: event-time timers fire from the trAcker's time bounds where the pipeline has them
        self.uses_event_time = mode == "eventtime"

    # ------------------------------------------------------------ lifecycle
    def open(self, ctx) -> None:
        self._guard("init", self._open, ctx)

    def _open(self, ctx) -> None:
        self._open_common(ctx)
        #: state name -> (kind, handle), filled by the processor's init()
        self.variables: dict[str, tuple[str, Any]] = {}
        self.timers = Timers(self)
        self.batch_time_ms = self._now(ctx) if self.time_mode != "none" else -1
        self.handle = EpochStatefulProcessorHandle(self)
        self.phase = "CREATED"
        self.processor.init(self.handle)
        self.phase = "INITIALIZED"
        if self.initial_state is not None:
            self._seed(ctx)

    def _seed(self, ctx) -> None:
        """``handleInitialState`` for each key of the initial state this subtask owns (its key
        groups), before any row, only in the job's first run. A union-mode operator state
        records that it ran: a restore, at any parallelism, gives every subtask the mark, so
        it never runs again (Spark reads the initial state only in the query's first batch).
        A failure before the first checkpoint starts the job afresh, and seeds it again."""
        done = ctx.operator_state(ListStateDescriptor(INITIAL_STATE_DONE), "union")
        if done.get():
            return
        state = ctx._state  # the subtask's keyed state: its key-group function and range
        lo, hi = state.key_group_range
        owns = state._key_group_of
        tv = self._timer_values()
        seed = self.processor.handleInitialState
        table = self.initial_state
        for batch in table.to_batches():
            groups = pandas_groups(batch, self.key_columns, None, f"{self.label} initial state")
            for key, pdf in groups:
                if not lo <= owns(key) <= hi:
                    continue
                ctx.set_current_key(key)
                if self.rows == "pandas":
                    seed(key, pdf, tv)
                else:
                    for r in pdf.to_dict("records"):
                        seed(key, Row(**r), tv)
        done.add(True)

    def close(self) -> None:
        self._guard("close", self._close)

    def _close(self) -> None:
        self.phase = "TIMER_PROCESSED"
        self.processor.close()
        self.phase = "CLOSED"

    def _timer_values(self):
        from pyspark.sql.streaming.stateful_processor import TimerValues

        if self.time_mode == "none":
            return TimerValues(-1, -1)
        # Spark 4.2 reports watermark 0 in processing-time mode without a watermark (measured)
        return TimerValues(self.batch_time_ms, self.watermark_ms)

    # ------------------------------------------------------------ data
    def process(self, value: Any, ctx) -> Any:
        """One record as a micro-batch of its own (per-record callers: the oracle's sequential
        reference); anything kept for the epoch runs first."""
        return self._guard("handleInputRows", self._process_one, value, ctx)

    def _process_one(self, value: Any, ctx) -> Any:
        key = ctx.key
        out = self._drain(ctx)
        ctx.set_current_key(key)
        out.extend(self._micro_batch([self._segment([value], [key])], ctx))
        return self._emit(out)

    def apply_batch(self, records: Any, keys: list[Any] | None, ctx) -> Any:
        """One input batch. ``micro_batch="epoch"``: kept for the epoch's calls (nothing out
        unless ``max_rows_per_trigger`` rows wait); ``"batch"``: its calls run now. Output:
        records, or one RecordBatch of the output schema in pandas mode (the frames the user
        yielded, concatenated; records when the schema has a map)."""
        return self._guard("handleInputRows", self._apply_batch, records, keys, ctx)

    def _apply_batch(self, records: Any, keys: list[Any] | None, ctx) -> Any:
        if self.micro_batch == "batch":
            return self._emit(self._micro_batch([self._segment(records, keys)], ctx))
        if self._buffer(records, keys):
            return self._emit(self._drain(ctx))
        return None

    def _drain(self, ctx) -> list[Any]:
        segments = self._take_pending()
        return self._micro_batch(segments, ctx) if segments else []

    def _drain_output(self, ctx) -> Any:
        return self._emit(self._drain(ctx))

    def _micro_batch(self, segments: list[Any], ctx) -> list[Any]:
        """One ``handleInputRows`` per key over ``segments`` (an iterator of all its frames,
        or Rows), then the timers that expired, as Spark runs a micro-batch."""
        if self.time_mode != "none":
            self.batch_time_ms = self._now(ctx)
        out: list[Any] = []
        tv = self._timer_values()
        handle_rows = self.processor.handleInputRows
        self.phase = "INITIALIZED"
        pandas = self.rows == "pandas"
        with _collector_paused():
            for key, parts in self._by_key(segments).items():
                ctx.set_current_key(key)
                if pandas:
                    data: Iterator[Any] = iter(self._frames(parts))
                else:
                    data = iter([Row(**r) for rows in parts for r in rows])
                result = handle_rows(key, data, tv)
                if result is not None:
                    out.extend(self._outputs(result, "handleInputRows"))
            self._fire_timers(out)
        return out

    def on_epoch_end(self, epoch: int, ctx) -> Any:
        return self._guard("handleExpiredTimer", self._on_epoch_end, epoch, ctx)

    def _on_epoch_end(self, epoch: int, ctx) -> Any:
        out = self._drain(ctx)  # the epoch's micro-batch, before its state is captured
        if self.event_time is not None:  # the watermark moves in every time mode (Spark: withWatermark)
            self._advance_watermark()
        if self.time_mode != "none":
            self.batch_time_ms = self._now(ctx)
            self._fire_timers(out)
            self._purge_expired()
        return self._emit(out)

    def _outputs(self, result: Iterable[Any], what: str) -> list[Any]:
        """What one user call yielded: RecordBatches (pandas mode) or records (Row mode)."""
        label = f"{self.label}.{what}"
        if self.rows == "pandas":
            return take_frames(result, self.output_schema, self._arrow_out, label)
        return rows_to_records(result, self.output_schema, label)

    def _emit(self, out: list[Any]) -> Any:
        """The output of one input batch as the chain gets it."""
        if self.rows == "pandas":
            return concat_output(out, self._arrow_out, self._columnar_out)
        return out

    def _records(self, out: list[Any]) -> list[dict]:
        return batches_to_records(out, self._arrow_out) if self.rows == "pandas" else out

    def _fire_timers(self, out: list[Any]) -> None:
        if self.time_mode == "none":
            return
        from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo

        if self.tracker_time is not None:
            return  # the runtime fires them through on_timer
        threshold = self.batch_time_ms if self.time_mode == "processingtime" else self.watermark_ms
        tv = self._timer_values()
        on_timer = self.processor.handleExpiredTimer
        self.phase = "DATA_PROCESSED"
        for key, ts in self.timers.expired(threshold):
            result = on_timer(key=key, timerValues=tv, expiredTimerInfo=ExpiredTimerInfo(ts))
            if result is not None:
                out.extend(self._outputs(result, "handleExpiredTimer"))
            self.ctx.set_current_key(key)
            self.timers.delete(key, ts)  # as Spark: the fired timer is deleted after its handler
        self.phase = "INITIALIZED"

    def on_timer(self, timestamp: float, ctx) -> list[dict]:
        """Job-wide event time passed ``timestamp`` for the current key (timestamped sources)."""
        return self._guard("handleExpiredTimer", self._on_timer, timestamp, ctx)

    def _on_timer(self, timestamp: float, ctx) -> list[dict]:
        ts = int(timestamp)
        key = ctx.key
        if not self.timers.has(ts):
            return []
        self._tracker_watermark(ts)
        self.batch_time_ms = self._now(ctx)
        out: list[Any] = []
        self._fire_one(key, ts, out)
        return self._records(out)

    def _fire_one(self, key: Any, ts: int, out: list[Any]) -> None:
        from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo

        ctx = self.ctx
        ctx.set_current_key(key)
        self.phase = "DATA_PROCESSED"
        result = self.processor.handleExpiredTimer(key=key, timerValues=self._timer_values(),
                                                   expiredTimerInfo=ExpiredTimerInfo(ts))
        if result is not None:
            out.extend(self._outputs(result, "handleExpiredTimer"))
        self.phase = "INITIALIZED"
        ctx.set_current_key(key)
        self.timers.delete(key, ts)

    def _purge_expired(self) -> None:
        """Remove entries whose TTL ran out (reads already skip them)."""
        ctx = self.ctx
        for name, (_kind, var) in list(self.variables.items()):
            if var._ttl is None:
                continue
            for key in ctx.keys(name):
                ctx.set_current_key(key)
                var._purge_expired()


class ApplyInPandasWithState(_Keyed):
    """Runs an ``applyInPandasWithState`` function ``func(key, pdf_iter, state)`` with
    PySpark's own ``GroupState`` as an epochstream keyed operator
    (``Stream.apply_in_pandas_with_state``).

    Per key the state is stored as ``(value tuple or None, timeout timestamp)`` in the
    reserved keyed state ``$groupState``. After each call the state is written back as
    Spark's ``FlatMapGroupsWithStateExec`` does: removed without a timeout -> deleted;
    otherwise written when updated, removed or its timeout changed. As in Spark, the
    timeout is reset on every call: set it again in every call that should keep one.
    A key with no data in a batch times out when its timeout timestamp is strictly below
    the batch processing time (``ProcessingTimeTimeout``) or the watermark
    (``EventTimeTimeout``); ``func`` then gets an empty iterator and ``hasTimedOut`` true.
    """

    def __init__(
        self,
        func: Callable[..., Iterable[Any]],
        output_schema,
        state_schema,
        output_mode: str,
        timeout_conf: str,
        key: str | list[str] | tuple[str, ...] = "key",
        event_time: str | None = None,
        watermark_delay_ms: int = 0,
        input_schema=None,
        clock: Any = None,
        micro_batch: str = "epoch",
        max_rows_per_trigger: int = DEFAULT_MAX_ROWS_PER_TRIGGER,
    ) -> None:
        from pyspark.sql.streaming.state import GroupStateTimeout

        super().__init__(key, output_schema, input_schema, event_time, watermark_delay_ms, clock, micro_batch,
                         max_rows_per_trigger)
        if not callable(func):
            raise TypeError(f"apply_in_pandas_with_state needs a function (key, pdf_iter, state), got {func!r}")
        if str(output_mode).lower() not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be 'Append' or 'Update', got {output_mode!r}")
        modes = (GroupStateTimeout.NoTimeout, GroupStateTimeout.ProcessingTimeTimeout,
                 GroupStateTimeout.EventTimeTimeout)
        if timeout_conf not in modes:
            raise ValueError(f"timeout_conf must be one of {modes} (GroupStateTimeout), got {timeout_conf!r}")
        if timeout_conf == GroupStateTimeout.EventTimeTimeout and event_time is None:
            raise ValueError("EventTimeTimeout needs event_time=<column> (Spark: withWatermark on the input)")
        self.func = func
        self.label = getattr(func, "__name__", "func")
        self._columnar_out = True
        self._columns_in = event_time is None
        self._pandas_in = True
        self.state_schema = struct_schema(state_schema, "state schema")
        self.output_mode = str(output_mode).lower()
        self.timeout_conf = timeout_conf
        #: event-time timeouts fire from the trAcker's time bounds where the pipeline has them
        self.uses_event_time = timeout_conf == GroupStateTimeout.EventTimeTimeout

    def open(self, ctx) -> None:
        self._guard("open", self._open, ctx)

    def _open(self, ctx) -> None:
        import heapq

        from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

        self._open_common(ctx)
        self._gs_fields: tuple[tuple[int, int], dict[str, Any]] | None = None
        #: looked up once, not per call
        self._group_state, self._no_timestamp = GroupState, GroupState.NO_TIMESTAMP
        self._no_timeout = GroupStateTimeout.NoTimeout
        self._value_what = f"{self.label}: GroupState value"
        self._state = ctx.state(ValueStateDescriptor(GROUP_STATE))
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0
        self._hpush, self._hpop = heapq.heappush, heapq.heappop
        current = ctx.key
        for key in ctx.keys(GROUP_STATE):  # restored timeouts
            ctx.set_current_key(key)
            _v, ts = self._state.value()
            if ts != -1:
                self._push(ts, key)
        ctx.set_current_key(current)

    def close(self) -> None:
        pass

    def _push(self, ts: int, key: Any) -> None:
        self._seq += 1
        self._hpush(self._heap, (ts, self._seq, key))

    def process(self, value: Any, ctx) -> Any:
        """One record as a micro-batch of its own (per-record callers: the oracle's sequential
        reference); anything kept for the epoch runs first."""
        return self._guard(self.label, self._process_one, value, ctx)

    def _process_one(self, value: Any, ctx) -> Any:
        key = ctx.key
        out = self._drain(ctx)
        ctx.set_current_key(key)
        out.extend(self._micro_batch([self._segment([value], [key])], ctx))
        return concat_output(out, self._arrow_out, self._columnar_out)

    def apply_batch(self, records: Any, keys: list[Any] | None, ctx) -> Any:
        """One input batch. ``micro_batch="epoch"``: kept for the epoch's calls (nothing out
        unless ``max_rows_per_trigger`` rows wait); ``"batch"``: its calls run now. Output: one
        RecordBatch of the output schema (the frames the function yielded, concatenated;
        records when the schema has a map)."""
        return self._guard(self.label, self._apply_batch, records, keys, ctx)

    def _apply_batch(self, records: Any, keys: list[Any] | None, ctx) -> Any:
        if self.micro_batch == "batch":
            out = self._micro_batch([self._segment(records, keys)], ctx)
        elif self._buffer(records, keys):
            out = self._drain(ctx)
        else:
            return None
        return concat_output(out, self._arrow_out, self._columnar_out)

    def _drain(self, ctx) -> list[Any]:
        segments = self._take_pending()
        return self._micro_batch(segments, ctx) if segments else []

    def _drain_output(self, ctx) -> Any:
        return concat_output(self._drain(ctx), self._arrow_out, self._columnar_out)

    def _micro_batch(self, segments: list[Any], ctx) -> list[Any]:
        """One call per key over ``segments`` (an iterator of all its frames), then the
        timeouts of keys without data, as Spark runs a micro-batch."""
        self.batch_time_ms = self._now(ctx)
        with _collector_paused():
            # the input frames and the user's output frames die with _calls' locals, before
            # the collector is back: it would otherwise scan (and promote) every one of them
            return self._calls(segments, ctx)

    def _calls(self, segments: list[Any], ctx) -> list[Any]:
        out: list[Any] = []
        per_key = self._by_key(segments)
        segments.clear()
        set_key, call, frames = ctx.set_current_key, self._call, self._frames
        for key, parts in per_key.items():
            set_key(key)
            out.extend(call(key, iter(frames(parts)), False))
        self._time_out(out, skip=per_key)
        return batches_of(out, self._arrow_out)

    def on_epoch_end(self, epoch: int, ctx) -> Any:
        return self._guard(self.label, self._on_epoch_end, epoch, ctx)

    def _on_epoch_end(self, epoch: int, ctx) -> Any:
        out = self._drain(ctx)  # the epoch's micro-batch, before its state is captured
        self.batch_time_ms = self._now(ctx)
        if self.event_time is not None:
            self._advance_watermark()
        self._time_out(out, skip={})
        return concat_output(out, self._arrow_out, self._columnar_out)

    def _call(self, key: Any, data, timed_out: bool) -> list[Any]:
        """Call the function for ``key``, write its state back; its output as RecordBatches."""
        GroupState = self._group_state  # noqa: N806 - PySpark's class
        none = self._no_timestamp

        stored = self._state.value()
        value, old_timeout = stored if stored is not None else (None, none)
        gs = GroupState.__new__(GroupState)
        fields = gs.__dict__
        fields.update(self._group_state_fields())
        if value is not None:
            fields["_value"] = group_state_row(value, self.state_schema)
            fields["_defined"] = True
        if timed_out:
            fields["_has_timed_out"] = True
        result = self.func(key, data, gs)
        records = [] if result is None else take_frames(result, self.output_schema, self._arrow_out,
                                                        self.label)
        # write back as FlatMapGroupsWithStateExec does
        new_timeout = int(gs._timeout_timestamp)
        if gs._removed and new_timeout == none:
            if stored is not None:
                self._state.clear()
            if self.tracker_time is not None and old_timeout != none:
                self.tracker_time.delete_event_time_timer(old_timeout)  # removed: its timeout goes too
        elif gs._updated or gs._removed or new_timeout != old_timeout:
            new_value = (state_tuple(gs._value, self.state_schema, self._value_what)
                         if gs.exists else None)
            self._state.update((new_value, new_timeout))
            tracker = self.tracker_time
            if tracker is not None and old_timeout != new_timeout:
                if old_timeout != none:
                    tracker.delete_event_time_timer(old_timeout)
                if new_timeout != none:
                    tracker.register_event_time_timer(new_timeout)  # times out once event time passes it
            elif new_timeout != none and self.timeout_conf != self._no_timeout:
                self._push(new_timeout, key)

        return records

    def _group_state_fields(self) -> dict[str, Any]:
        """The attributes PySpark's own ``GroupState.__init__`` gives an undefined, not timed
        out state at the current batch time and watermark; ``_call`` copies them into each
        key's GroupState (then sets the value), instead of running ``__init__`` per key. Made
        by ``__init__`` itself once per batch time and watermark, so they are its own."""
        watermark = self.watermark_ms if self.event_time is not None else self._no_timestamp
        cached = self._gs_fields
        if cached is not None and cached[0][0] == self.batch_time_ms and cached[0][1] == watermark:
            return cached[1]
        at = (self.batch_time_ms, watermark)
        GroupState = self._group_state  # noqa: N806 - PySpark's class
        gs = GroupState(
            # pyspark annotates Row, but an undefined state (defined=False) holds None, as Spark's
            # own serializer passes it (pyspark/sql/pandas/serializers.py, construct_state)
            optionalValue=None,  # type: ignore[arg-type]
            batchProcessingTimeMs=self.batch_time_ms,
            eventTimeWatermarkMs=watermark,
            timeoutConf=self.timeout_conf,
            hasTimedOut=False,
            watermarkPresent=self.event_time is not None,
            defined=False,
            updated=False,
            removed=False,
            timeoutTimestamp=GroupState.NO_TIMESTAMP,
            keyAsUnsafe=b"",
            valueSchema=self.state_schema,
        )
        fields = dict(gs.__dict__)
        self._gs_fields = (at, fields)
        return fields

    def on_timer(self, timestamp: float, ctx) -> list[dict]:
        """Job-wide event time passed the current key's timeout ``timestamp`` (timestamped sources)."""
        return self._guard(self.label, self._on_timer, timestamp, ctx)

    def _on_timer(self, timestamp: float, ctx) -> list[dict]:
        ts = int(timestamp)
        stored = self._state.value()
        if stored is None or stored[1] != ts:
            return []
        self._tracker_watermark(ts)
        self.batch_time_ms = self._now(ctx)
        return batches_to_records(self._call(ctx.key, iter([]), timed_out=True), self._arrow_out)

    def _time_out(self, out: list[Any], skip) -> None:
        from pyspark.sql.streaming.state import GroupStateTimeout

        if self.timeout_conf == GroupStateTimeout.NoTimeout or self.tracker_time is not None:
            return
        threshold = (
            self.batch_time_ms if self.timeout_conf == GroupStateTimeout.ProcessingTimeTimeout else self.watermark_ms
        )
        heap, ctx = self._heap, self.ctx
        later, done = [], set()
        while heap and heap[0][0] < threshold:
            ts, seq, key = self._hpop(heap)
            ctx.set_current_key(key)
            stored = self._state.value()
            if stored is None or stored[1] != ts:
                continue  # stale entry: the timeout was changed or the state removed
            if key in skip or key in done:
                # had data in this batch, or timed out already: not again in this batch
                later.append((ts, seq, key))
                continue
            done.add(key)
            out.extend(self._call(key, iter([]), timed_out=True))
        for entry in later:
            self._hpush(heap, entry)
