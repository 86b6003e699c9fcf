"""PySpark's stateful operators on epochstream: semantics of the handle, TTL, timers,
event time and GroupState, driven through the runtime's own interface.

``Harness`` builds what a task builds for a keyed operator (``HeapKeyedState``,
``Context``, the operator's ``open``) and calls ``apply_batch`` and ``on_epoch_end``
as ``ChainRuntime`` does, with a clock the test moves. Differential tests against Spark
itself are in ``test_pyspark_differential.py``; exactly-once, rescaling and the drivers
in ``test_pyspark_exactly_once.py``.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.streaming.state import GroupStateTimeout
from pyspark.sql.types import LongType, StructField, StructType

from epochstream import Pipeline
from epochstream.pyspark.operators import ApplyInPandasWithState, TransformWithState
from epochstream.pyspark.schema import SchemaError, parse_schema
from epochstream.runtime.context import Context
from epochstream.runtime.state import HeapKeyedState, OperatorStateBackend


class Clock:
    def __init__(self, ms: int = 1_000) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


class Harness:
    """One operator subtask, fed like ChainRuntime feeds it; ``restart()`` restores its
    state from a capture into a fresh copy (what a failover does). ``source="arrow"`` feeds
    each batch as one Arrow RecordBatch (keys None), as the chain does after a columnar source."""

    def __init__(self, make_op, source: str = "rows") -> None:
        self.make_op = make_op
        self.source = source
        self.clock = Clock()
        self.state = HeapKeyedState("op", lambda k: 0, (0, 0))
        self.operator = OperatorStateBackend("op", 0)
        self.ctx = Context(self.state, 0, 1, "op", None, self.operator)
        self.op = make_op(self.clock)
        self.op.open(self.ctx)
        self.epoch = 0

    def feed(self, *records) -> list[dict]:
        """One micro-batch: the batch, then (``micro_batch="epoch"``, the default) the calls for
        what the operator kept, as event time makes it run them before a timer fires."""
        recs = list(records)
        if self.source == "arrow":
            out = rows_of(self.op.apply_batch(pa.RecordBatch.from_pylist(recs), None, self.ctx))
        else:
            out = rows_of(self.op.apply_batch(recs, [self.op.key_of(r) for r in recs], self.ctx))
        return out + rows_of(self.op.drain_input(self.ctx))

    def bound(self) -> list[dict]:
        self.epoch += 1
        return rows_of(self.op.on_epoch_end(self.epoch, self.ctx))

    def restart(self) -> None:
        cap = self.state.capture(self.epoch, incremental=False)
        self.state = HeapKeyedState("op", lambda k: 0, (0, 0))
        self.state.restore_rows(cap.rows, dict(cap.kinds))
        ops = self.operator.capture()
        self.operator = OperatorStateBackend("op", 0)
        for name, mode, data in ops:
            self.operator.restore(name, mode, pickle.loads(data))
        self.ctx = Context(self.state, 0, 1, "op", None, self.operator)
        self.op = self.make_op(self.clock)
        self.op.open(self.ctx)

    def value(self, name: str, key) -> object:
        return self.state.as_dict().get(name, {}).get(key)


def rows_of(out) -> list[dict]:
    """A wrapper's output as rows: pandas output leaves as one RecordBatch per input batch."""
    if out is None:
        return []
    return out if isinstance(out, list) else out.to_pylist(maps_as_pydicts="strict")


#: batches as dict rows, or as Arrow RecordBatches (the wrappers' columnar path)
SOURCES = ("rows", "arrow")

# ---------------------------------------------------------------- processors


class Everything(StatefulProcessor):
    """Value, List and Map state, a TTL'd value, processing-time timers."""

    def __init__(self, ttl: int | None = None, timer_after: int | None = None) -> None:
        self.ttl, self.timer_after = ttl, timer_after

    def init(self, handle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "c long")
        self.ids = handle.getListState("ids", StructType([StructField("id", LongType())]))
        self.parity = handle.getMapState("parity", "p long", "n long")
        self.recent = handle.getValueState("recent", "id long", self.ttl) if self.ttl else None

    def handleInputRows(self, key, rows, timerValues):
        for pdf in rows:
            for i in pdf["id"]:
                n = (self.count.get() or (0,))[0] + 1
                self.count.update((n,))
                self.ids.appendValue((i,))  # numpy int64: normalised like Spark
                p = (int(i) % 2,)
                self.parity.updateValue(p, ((self.parity.getValue(p) or (0,))[0] + 1,))
                if self.recent is not None:
                    self.recent.update((i,))
                yield pd.DataFrame({"k": [key[0]], "n": [n]})
        if self.timer_after is not None:
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + self.timer_after)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        recent = self.recent.get() if self.recent is not None else None
        yield pd.DataFrame({"k": [key[0]], "n": [-expiredTimerInfo.getExpiryTimeInMs()],
                            })
        self.fired = (key, recent, list(self.handle.listTimers()))

    def close(self) -> None:
        pass


def tws(processor, time_mode="processingtime", **kw):
    return lambda clock: TransformWithState(processor, "k string, n long", time_mode, "k", clock=clock, **kw)


# ---------------------------------------------------------------- state


@pytest.mark.parametrize("source", SOURCES)
def test_value_list_and_map_state_per_key(source):
    h = Harness(tws(Everything(), "none"), source)
    out = h.feed({"k": "a", "id": 1}, {"k": "b", "id": 2}, {"k": "a", "id": 3})
    out += h.feed({"k": "a", "id": 4})
    assert sorted((r["k"], r["n"]) for r in out) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert h.value("count", ("a",)) == ((3,), None)
    assert h.value("ids", ("a",)) == [((1,), None), ((3,), None), ((4,), None)]
    assert h.value("parity", ("a",)) == {(1,): ((2,), None), (0,): ((1,), None)}
    assert all(type(v[0][0]) is int for v in h.value("ids", ("a",)))  # numpy scalars became ints


@pytest.mark.parametrize("source", SOURCES)
def test_state_survives_a_restore(source):
    h = Harness(tws(Everything(), "none"), source)
    h.feed({"k": "a", "id": 1})
    h.restart()
    out = h.feed({"k": "a", "id": 2})
    assert out == [{"k": "a", "n": 2}]
    assert h.value("ids", ("a",)) == [((1,), None), ((2,), None)]


@pytest.mark.parametrize("source", SOURCES)
def test_one_call_per_key_per_batch_with_the_rows_of_that_key_in_arrival_order(source):
    calls = []

    class Spy(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            frames = list(rows)
            calls.append((key, [list(f["id"]) for f in frames]))
            return iter([])

    h = Harness(tws(Spy(), "none"), source)
    h.feed({"k": "b", "id": 1}, {"k": "a", "id": 2}, {"k": "b", "id": 3})
    assert calls == [(("b",), [[1, 3]]), (("a",), [[2]])]


class Spy(StatefulProcessor):
    """Logs each ``handleInputRows`` call: the key and the ids of each frame it got."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def init(self, handle):
        pass

    def handleInputRows(self, key, rows, timerValues):
        self.calls.append((key, [list(f["id"]) for f in rows]))
        yield pd.DataFrame({"k": [key[0]], "n": [len(self.calls)]})


def feed_batches(h: Harness, batches: list[list[dict]], kinds: list[str]) -> list[dict]:
    """``apply_batch`` per batch (as the chain hands them over, no drain between)."""
    out: list[dict] = []
    for recs, kind in zip(batches, kinds, strict=True):
        if kind == "arrow":
            out += rows_of(h.op.apply_batch(pa.RecordBatch.from_pylist(recs), None, h.ctx))
        else:
            out += rows_of(h.op.apply_batch(recs, [h.op.key_of(r) for r in recs], h.ctx))
    return out


EPOCH_INPUT = [[{"k": "b", "id": 1}, {"k": "a", "id": 2}], [{"k": "b", "id": 3}, {"k": "c", "id": 4}],
               [{"k": "a", "id": 5}, {"k": "b", "id": 6}]]


@pytest.mark.parametrize("kinds", [["rows"] * 3, ["arrow"] * 3, ["rows", "arrow", "rows"]])
def test_one_call_per_key_per_epoch_with_all_its_rows_in_arrival_order(kinds):
    """Spark's granularity (``micro_batch="epoch"``, the default): nothing is called while the
    epoch's batches arrive; at the bound each key gets one call with every row it got in the
    epoch, keys in first-appearance order. Consecutive batches of one kind make one frame per
    key; a change between rows and Arrow starts another frame of the same iterator."""
    calls: list = []
    h = Harness(tws(Spy(calls), "none"))
    assert feed_batches(h, EPOCH_INPUT, kinds) == [] and calls == []
    out = h.bound()
    ids = {k: [i for frame in frames for i in frame] for (k,), frames in calls}
    assert [k for (k,), _ in calls] == ["b", "a", "c"]
    assert ids == {"b": [1, 3, 6], "a": [2, 5], "c": [4]}
    assert sorted(r["k"] for r in out) == ["a", "b", "c"]
    frames = dict((k, f) for (k,), f in calls)
    if kinds[0] == kinds[1] == kinds[2]:
        assert frames["b"] == [[1, 3, 6]]
    else:  # rows, then Arrow, then rows: three runs
        assert frames["b"] == [[1], [3], [6]]
    # the next epoch starts empty
    assert h.bound() == [] and len(calls) == 3


def test_micro_batch_batch_calls_once_per_key_per_runtime_batch():
    """The former granularity, selectable: each runtime batch runs its calls at once."""
    calls: list = []
    h = Harness(tws(Spy(calls), "none", micro_batch="batch"))
    out = feed_batches(h, EPOCH_INPUT, ["rows"] * 3)
    assert [(k, f) for (k,), f in calls] == [("b", [[1]]), ("a", [[2]]), ("b", [[3]]), ("c", [[4]]),
                                               ("a", [[5]]), ("b", [[6]])]
    assert len(out) == 6 and h.bound() == []


@pytest.mark.parametrize("source", SOURCES)
def test_max_rows_per_trigger_runs_the_calls_early(source):
    """Once ``max_rows_per_trigger`` rows wait, their calls run (a micro-batch cut short) and
    the output leaves with that batch; the rest waits for the bound."""
    calls: list = []
    h = Harness(tws(Spy(calls), "none", max_rows_per_trigger=4))
    out = feed_batches(h, EPOCH_INPUT, [source] * 3)
    assert [(k, sum(f, [])) for (k,), f in calls] == [("b", [1, 3]), ("a", [2]), ("c", [4])]
    assert sorted(r["k"] for r in out) == ["a", "b", "c"]
    out = h.bound()
    assert [(k, sum(f, [])) for (k,), f in calls[3:]] == [("a", [5]), ("b", [6])]
    assert sorted(r["k"] for r in out) == ["a", "b"]


@pytest.mark.parametrize("source", SOURCES)
def test_group_state_gets_one_call_per_key_per_epoch_and_timeouts_after_it(source):
    """applyInPandasWithState: one call per key at the bound with every frame of the epoch;
    a key without data in the epoch times out after the data, as in Spark's micro-batch."""
    h = Harness(group_state())
    feed_batches(h, [[{"k": "a"}, {"k": "b"}]], [source])
    assert sorted((r["k"], r["n"]) for r in h.bound()) == [("a", 1), ("b", 1)]
    h.clock.ms += 50
    assert feed_batches(h, [[{"k": "a"}], [{"k": "a"}]], [source] * 2) == []
    h.clock.ms += 100  # b's timeout (1 100) is below the batch time: b times out, a does not
    assert sorted((r["k"], r["n"]) for r in h.bound()) == [("a", 3), ("b", -1)]


def test_micro_batch_arguments_are_checked():
    with pytest.raises(ValueError, match="micro_batch must be 'epoch'"):
        TransformWithState(Spy([]), "k string, n long", "none", "k", micro_batch="trigger")
    with pytest.raises(ValueError, match="max_rows_per_trigger must be an int >= 1"):
        ApplyInPandasWithState(counter, "k string, n long", "n long", "Update", GroupStateTimeout.NoTimeout, "k",
                               max_rows_per_trigger=0)


@pytest.mark.parametrize("input_schema", [None, "a long, b string, t timestamp, x double, y long"])
def test_an_arrow_batch_reaches_the_user_as_its_rows_do(input_schema):
    """The columnar path hands each key the frame the row path makes of that key's rows:
    same keys in the same order, same dtypes (nulls in one key only, tz-aware timestamps,
    columns cast to and filled from input_schema), same values, a 0-based index."""
    import datetime

    utc = datetime.timezone.utc

    def seen_by(source):
        calls = []

        def spy(key, pdf_iter, state):
            for pdf in pdf_iter:
                calls.append((key, pdf))
            return iter([])

        h = Harness(lambda c: ApplyInPandasWithState(spy, "a long", "n long", "Update", GroupStateTimeout.NoTimeout,
                                                     ["a", "b"], input_schema=input_schema, clock=c), source)
        rows = [{"a": i % 3, "b": "pq"[i % 2], "t": datetime.datetime(2024, 1, 1, i, tzinfo=utc),
                 "x": None if i % 4 == 1 else float(i)} for i in range(12)]
        h.feed(*rows)  # nulls in some keys' rows (the row path infers float64 then, as Arrow's double gives)
        h.feed(*rows[2:5])  # a batch without nulls: one conversion for all keys
        return calls

    rows_calls, arrow_calls = seen_by("rows"), seen_by("arrow")
    assert [k for k, _ in arrow_calls] == [k for k, _ in rows_calls]
    for (_, want), (_, got) in zip(rows_calls, arrow_calls, strict=True):
        pd.testing.assert_frame_equal(got, want)
    assert str(arrow_calls[0][1]["t"].dtype).startswith("datetime64") and arrow_calls[0][1]["t"].dt.tz is None


def test_map_state_api():
    seen = {}

    class Maps(StatefulProcessor):
        def init(self, handle):
            self.m = handle.getMapState("m", "name string", "v long, w string")

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                for name, v in zip(pdf["name"], pdf["v"], strict=True):
                    self.m.updateValue((name,), (v, name * 2))
            self.m.removeKey(("gone",))
            seen.update(exists=self.m.exists(), has_x=self.m.containsKey(("x",)), get=self.m.getValue(("x",)),
                        missing=self.m.getValue(("nope",)), keys=sorted(self.m.keys()),
                        values=sorted(self.m.values()), items=sorted(self.m.iterator()))
            return iter([])

    h = Harness(lambda c: TransformWithState(Maps(), "k string", "none", "k", clock=c))
    h.feed({"k": "a", "name": "x", "v": 1}, {"k": "a", "name": "y", "v": 2}, {"k": "a", "name": "gone", "v": 3})
    assert seen == dict(exists=True, has_x=True, get=(1, "xx"), missing=None, keys=[("x",), ("y",)],
                        values=[(1, "xx"), (2, "yy")], items=[(("x",), (1, "xx")), (("y",), (2, "yy"))])


def test_list_state_put_append_and_clear():
    seen = []

    class Lists(StatefulProcessor):
        def init(self, handle):
            self.l = handle.getListState("l", "v long")

        def handleInputRows(self, key, rows, timerValues):
            list(rows)
            seen.append(self.l.exists())
            self.l.put([(1,), (2,)])
            self.l.appendList([(3,)])
            self.l.appendValue((4,))
            seen.append(list(self.l.get()))
            self.l.clear()
            seen.append((self.l.exists(), list(self.l.get())))
            return iter([])

    h = Harness(lambda c: TransformWithState(Lists(), "k string", "none", "k", clock=c))
    h.feed({"k": "a"})
    assert seen == [False, [(1,), (2,), (3,), (4,)], (False, [])]


def test_delete_if_exists_drops_a_variable_for_every_key():
    class Old(StatefulProcessor):
        def init(self, handle):
            self.v = handle.getValueState("old", "v long")

        def handleInputRows(self, key, rows, timerValues):
            list(rows)
            self.v.update((1,))
            return iter([])

    class New(StatefulProcessor):
        def init(self, handle):
            handle.deleteIfExists("old")

        def handleInputRows(self, key, rows, timerValues):
            return iter([])

    h = Harness(lambda c: TransformWithState(Old(), "k string", "none", "k", clock=c))
    h.feed({"k": "a"}, {"k": "b"})
    assert set(h.state.as_dict()["old"]) == {("a",), ("b",)}
    h.make_op = lambda c: TransformWithState(New(), "k string", "none", "k", clock=c)
    h.restart()
    assert "old" not in h.state.as_dict()


# ---------------------------------------------------------------- TTL


def test_ttl_hides_a_value_once_the_batch_time_reaches_its_expiry_and_the_bound_removes_it():
    proc = Everything(ttl=100)
    h = Harness(tws(proc))
    h.clock.ms = 1_000
    h.feed({"k": "a", "id": 1})
    assert h.value("recent", ("a",)) == ((1,), 1_100)
    h.clock.ms = 1_099
    h.feed({"k": "b", "id": 2})
    h.op.ctx.set_current_key(("a",))
    assert h.op.variables["recent"][1].get() == (1,)
    h.clock.ms = 1_100  # expires <= batch time: expired (Spark's StateTTL.isExpired)
    h.feed({"k": "b", "id": 3})
    h.op.ctx.set_current_key(("a",))
    assert h.op.variables["recent"][1].get() is None and not h.op.variables["recent"][1].exists()
    assert h.value("recent", ("a",)) is not None  # invisible, not yet removed
    h.bound()
    assert h.value("recent", ("a",)) is None
    assert h.value("recent", ("b",)) == ((3,), 1_200)


def test_ttl_of_list_and_map_entries_expires_each_entry_alone():
    class Ttl(StatefulProcessor):
        def init(self, handle):
            self.l = handle.getListState("l", "v long", 50)
            self.m = handle.getMapState("m", "k long", "v long", 50)

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                for v in pdf["v"]:
                    self.l.appendValue((v,))
                    self.m.updateValue((v,), (v,))
            yield pd.DataFrame({"k": [key[0]], "n": [len(list(self.l.get())) * 100 + len(list(self.m.keys()))]})

    h = Harness(lambda c: TransformWithState(Ttl(), "k string, n long", "processingtime", "k", clock=c))
    h.clock.ms = 0
    assert h.feed({"k": "a", "v": 1}) == [{"k": "a", "n": 101}]
    h.clock.ms = 30
    assert h.feed({"k": "a", "v": 2}) == [{"k": "a", "n": 202}]
    h.clock.ms = 60  # the first entries (expiry 50) are gone, the second (80) live
    assert h.feed({"k": "a", "v": 3}) == [{"k": "a", "n": 202}]
    h.bound()
    assert [v for v, _e in h.value("l", ("a",))] == [(2,), (3,)]
    assert sorted(h.value("m", ("a",))) == [(2,), (3,)]


def test_ttl_needs_processing_time_mode_as_in_spark():
    with pytest.raises(ValueError, match="Cannot use TTL for state=recent"):
        Harness(tws(Everything(ttl=10), "none"))  # at init(), when the variable is declared


# ---------------------------------------------------------------- timers


@pytest.mark.parametrize("source", SOURCES)
def test_processing_time_timers_fire_after_the_data_of_a_batch_and_at_epoch_bounds(source):
    proc = Everything(timer_after=500)
    h = Harness(tws(proc), source)
    h.clock.ms = 1_000
    assert [r["n"] for r in h.feed({"k": "a", "id": 1})] == [1]
    assert h.value("$timers", ("a",)) == (1_500,)
    h.clock.ms = 1_499
    assert h.bound() == []
    h.clock.ms = 1_500
    assert h.bound() == [{"k": "a", "n": -1_500}]
    assert proc.fired == (("a",), None, [1_500])  # listTimers still shows it inside the handler
    assert h.value("$timers", ("a",)) is None  # deleted after the handler, as Spark does
    h.clock.ms = 2_000
    out = h.feed({"k": "b", "id": 2})  # b's new timer 2500 is not due; nothing else is left
    assert [r["n"] for r in out] == [1]


def test_timers_survive_a_restore_and_fire_once():
    proc = Everything(timer_after=10)
    h = Harness(tws(proc))
    h.clock.ms = 0
    h.feed({"k": "a", "id": 1}, {"k": "b", "id": 2})
    h.restart()
    h.clock.ms = 10
    fired = h.bound()
    assert sorted(r["k"] for r in fired) == ["a", "b"]
    assert h.bound() == []


def test_register_list_and_delete_timers():
    seen = []

    class T(StatefulProcessor):
        def init(self, handle):
            self.h = handle

        def handleInputRows(self, key, rows, timerValues):
            list(rows)
            for t in (30, 10, 20, 10):
                self.h.registerTimer(t + 10_000)
            self.h.deleteTimer(10_020)
            self.h.deleteTimer(99)  # absent: nothing happens
            seen.append(list(self.h.listTimers()))
            return iter([])

    h = Harness(lambda c: TransformWithState(T(), "k string", "processingtime", "k", clock=c))
    h.feed({"k": "a"})
    assert seen == [[10_010, 10_030]]


def test_timers_need_a_time_mode():
    class T(StatefulProcessor):
        def init(self, handle):
            self.h = handle

        def handleInputRows(self, key, rows, timerValues):
            self.h.registerTimer(5)
            return iter([])

    h = Harness(lambda c: TransformWithState(T(), "k string", "none", "k", clock=c))
    with pytest.raises(PySparkRuntimeError, match="STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_MODE"
                       "] Failed to perform stateful processor operation=register_timer with invalid timeMode=NoTime"):
        h.feed({"k": "a"})


def test_timer_values_per_time_mode():
    seen = []

    class T(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            list(rows)
            seen.append((timerValues.getCurrentProcessingTimeInMs(), timerValues.getCurrentWatermarkInMs()))
            return iter([])

    for mode, extra in (("none", {}), ("processingtime", {}), ("eventtime", {"event_time": "t"})):
        h = Harness(lambda c, mode=mode, extra=extra: TransformWithState(T(), "k string", mode, "k", clock=c, **extra))
        h.clock.ms = 777
        h.feed({"k": "a", "t": 5_000})
    assert seen == [(-1, -1), (777, 0), (777, 0)]  # as Spark 4.2 reports them


# ---------------------------------------------------------------- event time


class Sessions(StatefulProcessor):
    """Event time: counts rows per key and emits the count when the watermark passes the
    key's last event time + 1000 ms (an event-time timer)."""

    def init(self, handle):
        self.handle = handle
        self.count = handle.getValueState("count", "c long")
        self.last = handle.getValueState("last", "t long")

    def handleInputRows(self, key, rows, timerValues):
        for pdf in rows:
            for t in pdf["t"]:
                self.count.update(((self.count.get() or (0,))[0] + 1,))
                last = (self.last.get() or (0,))[0]
                if t > last:
                    for old in list(self.handle.listTimers()):
                        self.handle.deleteTimer(old)
                    self.last.update((t,))
                    self.handle.registerTimer(int(t) + 1_000)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        yield pd.DataFrame({"k": [key[0]], "n": [self.count.get()[0]]})
        self.count.clear()
        self.last.clear()


def sessions(clock):
    return TransformWithState(Sessions(), "k string, n long", "eventtime", "k", event_time="t",
                              watermark_delay_ms=500, clock=clock)


def test_event_time_timers_fire_when_the_watermark_advances_at_an_epoch_bound():
    """Late rows as Spark 4.2 drops them (measured: tests/test_pyspark_differential.py): a
    row of epoch N is late at or below the watermark as of the start of epoch N-1 (Spark's
    previous micro-batch's watermark, ``max event time of epochs <= N-2 - delay``); timers
    fire against the current one."""
    h = Harness(sessions)
    h.feed({"k": "a", "t": 1_000}, {"k": "a", "t": 1_200}, {"k": "b", "t": 1_100})
    assert h.op.watermark_ms == 0
    assert h.bound() == []  # watermark 1200 - 500 = 700; rows of epoch 1 are late at or below 0
    assert (h.op.watermark_ms, h.op.late_ms) == (700, 0)
    h.feed({"k": "c", "t": 3_000})
    assert h.feed({"k": "a", "t": 650}) == []  # 650 <= 700 but > 0: kept, as Spark keeps it
    assert h.value("count", ("a",)) == ((3,), None)
    assert sorted((r["k"], r["n"]) for r in h.bound()) == [("a", 3), ("b", 1)]  # watermark 2500
    assert (h.op.watermark_ms, h.op.late_ms) == (2_500, 700)
    # 700 late, 701 kept; its timer (1 701) is below the current watermark and fires after the data
    assert h.feed({"k": "d", "t": 700}, {"k": "d", "t": 701}) == [{"k": "d", "n": 1}]
    assert h.value("count", ("c",)) == ((1,), None)


def test_the_watermark_is_restored_from_the_keys_event_times():
    """After a restore the watermark comes back from the keys' event times and the late
    threshold (one epoch older, not derivable from them) from the operator's own state."""
    h = Harness(sessions)
    h.feed({"k": "a", "t": 10_000})
    h.bound()
    h.feed({"k": "a", "t": 12_000})
    h.bound()
    assert (h.op.watermark_ms, h.op.late_ms) == (11_500, 9_500)
    h.restart()
    assert (h.op.watermark_ms, h.op.late_ms) == (11_500, 9_500)
    assert h.feed({"k": "b", "t": 9_400}) == [] and h.value("count", ("b",)) is None  # still late
    assert h.feed({"k": "b", "t": 9_600}) == [{"k": "b", "n": 1}]  # kept; its timer fires at once


@pytest.mark.parametrize("source", SOURCES)
def test_timestamp_columns_arrive_naive_in_utc_and_drive_event_time(source):
    import datetime

    seen = []

    class T(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                seen.append((str(pdf["t"].dtype), pdf["t"].iloc[0]))
            return iter([])

    h = Harness(lambda c: TransformWithState(T(), "k string", "eventtime", "k", event_time="t",
                                             input_schema="k string, t timestamp", clock=c), source)
    h.feed({"k": "a", "t": datetime.datetime(2024, 1, 1, 0, 0, 1)})
    h.bound()
    assert seen[0][0].startswith("datetime64") and seen[0][1] == pd.Timestamp("2024-01-01 00:00:01")
    assert h.op.watermark_ms == 1_704_067_201_000


def test_event_time_mode_needs_an_event_time_column():
    with pytest.raises(ValueError, match="event_time"):
        TransformWithState(Sessions(), "k string, n long", "eventtime", "k")


# ---------------------------------------------------------------- rows mode


def test_row_mode_passes_rows_and_takes_rows():
    class Rows(StatefulProcessor):
        def init(self, handle):
            self.c = handle.getValueState("c", "c long")

        def handleInputRows(self, key, rows, timerValues):
            n = sum(1 for r in rows if isinstance(r, Row) and r.k == key[0])
            self.c.update(((self.c.get() or (0,))[0] + n,))
            yield Row(k=key[0], n=self.c.get()[0])

    h = Harness(lambda c: TransformWithState(Rows(), "k string, n long", "none", "k", rows="row", clock=c))
    assert h.feed({"k": "a"}, {"k": "a"}) == [{"k": "a", "n": 2}]
    assert h.feed(Row(k="a", x=1)) == [{"k": "a", "n": 3}]


# ---------------------------------------------------------------- applyInPandasWithState


def counter(key, pdf_iter, state):
    """Counts rows per key; on a processing-time timeout emits the count and removes it."""
    if state.hasTimedOut:
        yield pd.DataFrame({"k": [key[0]], "n": [-state.get[0]]})
        state.remove()
        return
    n = sum(len(pdf) for pdf in pdf_iter) + (state.get[0] if state.exists else 0)
    state.update((n,))
    state.setTimeoutDuration(100)
    yield pd.DataFrame({"k": [key[0]], "n": [n]})


def group_state(func=counter, timeout=GroupStateTimeout.ProcessingTimeTimeout, **kw):
    return lambda clock: ApplyInPandasWithState(func, "k string, n long", "n long", "Update", timeout, "k",
                                                clock=clock, **kw)


@pytest.mark.parametrize("source", SOURCES)
def test_group_state_update_and_processing_time_timeout(source):
    h = Harness(group_state(), source)
    h.clock.ms = 1_000
    assert h.feed({"k": "a"}, {"k": "a"}, {"k": "b"}) == [{"k": "a", "n": 2}, {"k": "b", "n": 1}]
    assert h.value("$groupState", ("a",)) == ((2,), 1_100)
    h.clock.ms = 1_050
    assert h.feed({"k": "a"}) == [{"k": "a", "n": 3}]  # a's timeout moves to 1150
    h.clock.ms = 1_100  # b's timeout 1100 is not strictly below 1100
    assert h.bound() == []
    h.clock.ms = 1_101
    assert h.bound() == [{"k": "b", "n": -1}]
    assert h.value("$groupState", ("b",)) is None
    h.restart()
    h.clock.ms = 1_200
    assert h.feed({"k": "c"}) == [{"k": "c", "n": 1}, {"k": "a", "n": -3}]  # data first, then timeouts


@pytest.mark.parametrize("source", SOURCES)
def test_group_state_timeout_is_reset_on_every_call(source):
    def once(key, pdf_iter, state):
        list(pdf_iter)
        if not state.exists:
            state.update((1,))
            state.setTimeoutDuration(10)
        return iter([])

    h = Harness(group_state(once), source)
    h.clock.ms = 0
    h.feed({"k": "a"})
    assert h.value("$groupState", ("a",)) == ((1,), 10)
    h.feed({"k": "a"})  # no timeout set in this call: Spark clears it
    assert h.value("$groupState", ("a",)) == ((1,), -1)
    h.clock.ms = 100
    assert h.bound() == []


@pytest.mark.parametrize("source", SOURCES)
def test_group_state_event_time_timeout(source):
    def session(key, pdf_iter, state):
        if state.hasTimedOut:
            yield pd.DataFrame({"k": [key[0]], "n": [state.get[0]]})
            state.remove()
            return
        rows = pd.concat(list(pdf_iter))
        n = len(rows) + (state.get[0] if state.exists else 0)
        state.update((n,))
        state.setTimeoutTimestamp(int(rows["t"].max()) + 1_000)

    h = Harness(group_state(session, GroupStateTimeout.EventTimeTimeout, event_time="t"), source)
    h.feed({"k": "a", "t": 1_000}, {"k": "b", "t": 5_000})
    assert h.op.watermark_ms == 0
    # the bound advances the watermark to 5000, then a's timeout 2000 < 5000 fires (Spark: in the
    # no-data micro-batch that follows); b's 6000 waits
    assert h.bound() == [{"k": "a", "n": 1}]
    assert h.op.watermark_ms == 5_000
    assert h.value("$groupState", ("a",)) is None and h.value("$groupState", ("b",)) == ((1,), 6_000)


def test_group_state_errors_are_pysparks_own():
    def bad(key, pdf_iter, state):
        state.setTimeoutTimestamp(5)  # processing-time timeout configured
        return iter([])

    h = Harness(group_state(bad))
    with pytest.raises(Exception, match="CANNOT_WITHOUT|set timeout"):
        h.feed({"k": "a"})


# ---------------------------------------------------------------- errors and unsupported parts


def test_initial_state_of_another_type_is_refused():
    p = Pipeline("x")
    with pytest.raises(TypeError, match="initial_state of Everything must be a pandas DataFrame"):
        p.from_collection([{"k": "a"}]).transform_with_state(Everything(), "k string, n long", key="k",
                                                              initial_state=[("a", pd.DataFrame())])


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="StatefulProcessor"):
        TransformWithState(object(), "k string", "none", "k")
    with pytest.raises(ValueError, match="time_mode"):
        TransformWithState(Everything(), "k string", "realtime", "k")
    with pytest.raises(ValueError, match="output_mode"):
        TransformWithState(Everything(), "k string", "none", "k", output_mode="complete")
    with pytest.raises(ValueError, match="timeout_conf"):
        ApplyInPandasWithState(counter, "k string", "n long", "update", "Sometimes", "k")
    with pytest.raises(TypeError, match="key="):
        Pipeline("x").from_collection([{"k": 1}]).transform_with_state(Everything(), "k string")


def test_state_values_must_fit_their_schema():
    class Bad(StatefulProcessor):
        def init(self, handle):
            self.v = handle.getValueState("v", "a long, b long")
            self.l = handle.getListState("l", "a long")

        def handleInputRows(self, key, rows, timerValues):
            which = list(rows)[0]["what"][0]
            if which == "arity":
                self.v.update((1,))
            elif which == "none":
                self.v.update(None)
            elif which == "empty":
                self.l.put([])
            return iter([])

    h = Harness(lambda c: TransformWithState(Bad(), "k string", "none", "k", clock=c))
    with pytest.raises(SchemaError, match="has 1 item"):
        h.feed({"k": "a", "what": "arity"})
    with pytest.raises(SchemaError, match="NULL_VALUE"):
        h.feed({"k": "a", "what": "none"})
    with pytest.raises(SchemaError, match="EMPTY_LIST_VALUE"):
        h.feed({"k": "a", "what": "empty"})


@pytest.mark.parametrize("source", SOURCES)
def test_output_must_fit_the_output_schema(source):
    class Out(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            yield pd.DataFrame({"k": [key[0]]})  # no "n"

    h = Harness(lambda c: TransformWithState(Out(), "k string, n long", "none", "k", clock=c), source)
    with pytest.raises(SchemaError, match=r"lacks column\(s\) \['n'\]"):
        h.feed({"k": "a"})


@pytest.mark.parametrize("frame", [
    pd.DataFrame({"n": [1, 2], "extra": ["x", "y"], "t": pd.to_datetime([0, 1_000], unit="ms"), "k": ["a", None]}),
    pd.DataFrame([["a", 1, pd.Timestamp("2024-01-01", tz="Europe/Paris")]]),  # by position, tz-aware
    pd.DataFrame({"k": ["a"], "n": [1.0], "t": [None]}),  # a float that fits long, a null timestamp
    pd.DataFrame({"k": ["a"], "n": ["one"], "t": [None]}),  # does not fit
    pd.DataFrame({"k": ["a"], "n": [1.5], "t": [None]}),  # would lose data
    pd.DataFrame([["a", 1, None]], columns=["k", "n", "n"]),  # a label twice
])
def test_the_columnar_output_conversion_gives_what_the_row_path_gives(frame):
    from epochstream.pyspark.schema import arrow_schema, batches_to_records, frames_to_batches, frames_to_records

    schema = parse_schema("k string, n long, t timestamp")
    arrow_out = arrow_schema(schema)

    def convert(fn):
        try:
            return fn([frame.copy()], schema, arrow_out, "f")
        except Exception as exc:  # noqa: BLE001 - the same error type either way
            return type(exc)

    want = convert(frames_to_records)
    got = convert(lambda *a: batches_to_records(frames_to_batches(*a), arrow_out))
    assert got == want


_FRAMES = [
    lambda: pd.DataFrame({"k": ["a"], "n": [1]}),
    lambda: pd.DataFrame({"n": [2, 3], "k": ["b", None], "extra": [0.5, 1.5]}),  # other order, an extra column
    lambda: pd.DataFrame({"k": ["c"], "n": [float("nan")]}),  # float: NaN is null
    lambda: pd.DataFrame({"k": ["d"], "n": [2 ** 60 + 1]}),  # exact only if never made a float
    lambda: pd.DataFrame({"k": ["e"], "n": [True]}),  # bool beside ints: object dtype when concatenated
    lambda: pd.DataFrame([["f", 7]]),  # by position
    lambda: pd.DataFrame({"k": pd.Series([], dtype=object), "n": pd.Series([], dtype="int64")}),  # empty
    lambda: pd.DataFrame({"k": ["g"], "n": ["seven"]}),  # does not fit
    # the same labels and dtypes in other block layouts: blocks in another order, an int
    # block holding an extra column, columns spread so a block's placement is not a slice
    lambda: pd.DataFrame({"n": [8]}).assign(k=["h"])[["k", "n"]],
    lambda: pd.DataFrame({"k": ["i"], "n": [9], "extra": [10]}),
    lambda: pd.DataFrame({"a": [1], "b": [2], "k": ["j"], "n": [11]}),
    lambda: _unconsolidated("l", 12),
]


def _unconsolidated(k: str, n: int) -> pd.DataFrame:
    """A frame whose int columns sit in two blocks (a column added after construction)."""
    df = pd.DataFrame({"k": [k], "other": [0]})
    df["n"] = [n]
    return df


@given(st.lists(st.integers(0, len(_FRAMES) - 1), max_size=8))
@settings(max_examples=150, deadline=None)
def test_frames_of_many_calls_convert_together_as_each_alone(picks):
    """One input batch's output frames (one call per key) are converted together, as Spark's
    serializer concatenates them; the records, and any error, are those of converting each
    frame on its own."""
    from epochstream.pyspark.schema import arrow_schema, batches_to_records, frames_to_batches, take_frames

    schema = parse_schema("k string, n long")
    arrow_out = arrow_schema(schema)

    def outcome(fn):
        try:
            return fn()
        except SchemaError as exc:
            return str(exc)

    def alone():
        return batches_to_records([b for i in picks for b in frames_to_batches([_FRAMES[i]()], schema, arrow_out,
                                                                               f"call {i}")], arrow_out)

    def together():
        pending = [x for i in picks for x in take_frames([_FRAMES[i]()], schema, arrow_out, f"call {i}")]
        return batches_to_records(pending, arrow_out)

    assert outcome(together) == outcome(alone)


def test_each_keys_frame_is_its_rows_alone_with_a_0_based_index():
    """``pandas_groups`` hands each key a view of one pandas conversion of the sorted batch:
    equal to ``iloc[...].reset_index(drop=True)`` of it, and a key's frame changed in place
    (or given a column) leaves every other key's frame as it was."""
    from epochstream.pyspark.schema import pandas_groups, row_slicer

    batch = pa.RecordBatch.from_pylist([{"k": i % 3, "v": float(i), "s": f"r{i}"} for i in range(10)])
    groups = pandas_groups(batch, ["k"], None, "test")
    assert [k for k, _ in groups] == [(0,), (1,), (2,)]
    for (k,), pdf in groups:
        want = pd.DataFrame({"k": [k] * len(range(k, 10, 3)), "v": [float(i) for i in range(k, 10, 3)],
                             "s": [f"r{i}" for i in range(k, 10, 3)]})
        pd.testing.assert_frame_equal(pdf, want)
    first, second = groups[0][1], groups[1][1]
    first["v"] += 100.0
    first.loc[0, "s"] = "changed"
    first["extra"] = 1
    assert second["v"].tolist() == [1.0, 4.0, 7.0] and second["s"].tolist() == ["r1", "r4", "r7"]
    assert list(second.columns) == ["k", "v", "s"]

    df = pd.DataFrame({"a": range(6), "b": list("uvwxyz")})
    cut = row_slicer(df)
    for start, stop in [(0, 0), (0, 6), (2, 5), (5, 6)]:
        pd.testing.assert_frame_equal(cut(start, stop), df.iloc[start:stop].reset_index(drop=True))


def test_a_keys_frame_of_every_spark_type_is_its_rows_and_its_own_axes():
    """``row_slicer`` builds each key's frame from its blocks' row slices: for a batch of
    every type Spark converts (ints, floats, bools, strings, timestamps, dates, decimals,
    lists) the frame equals ``iloc[...].reset_index(drop=True)``, dtypes included, and a
    user renaming one frame's index or columns, or adding a column, changes no other key's."""
    import datetime
    import decimal

    from epochstream.pyspark.schema import row_slicer, spark_pandas

    n = 9
    batch = pa.RecordBatch.from_pydict({
        "i": pa.array(range(n), pa.int64()),
        "i32": pa.array(range(n), pa.int32()),
        "f": pa.array([x / 2 for x in range(n)]),
        "b": pa.array([x % 2 == 0 for x in range(n)]),
        "s": pa.array([f"s{x}" for x in range(n)]),
        "t": pa.array([datetime.datetime(2026, 1, 1, 0, 0, x) for x in range(n)], pa.timestamp("us")),
        "d": pa.array([datetime.date(2026, 1, 1 + x) for x in range(n)]),
        "m": pa.array([decimal.Decimal(f"{x}.25") for x in range(n)], pa.decimal128(10, 2)),
        "l": pa.array([[x, x + 1] for x in range(n)]),
    })
    df = spark_pandas(batch)
    cut = row_slicer(df)
    frames = [cut(0, 3), cut(3, 4), cut(4, 9), cut(9, 9)]
    for (start, stop), got in zip([(0, 3), (3, 4), (4, 9), (9, 9)], frames, strict=True):
        want = df.iloc[start:stop].reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want)
        assert list(got.dtypes) == list(want.dtypes)
        assert isinstance(got.index, pd.RangeIndex) and got.index.start == 0
    first, second = frames[0], frames[2]
    first.index.name = "renamed"
    first.columns.name = "cols"
    first.rename(columns={"i": "x"}, inplace=True)
    first["new"] = 1
    assert second.index.name is None and second.columns.name is None
    assert list(second.columns) == list(df.columns) and second["i"].tolist() == [4, 5, 6, 7, 8]
    assert df.index.name is None and list(df.columns) == list(batch.schema.names)


def test_output_frames_of_every_layout_convert_together_as_each_alone():
    """The frames a micro-batch's calls yield are joined a block at a time where their blocks
    agree and column by column where they do not; either way the batch is what converting
    each frame alone gives, for ints, floats, strings and timestamps in any block layout."""
    import datetime

    from epochstream.pyspark.schema import (
        Frame,
        _block_columns,
        arrow_schema,
        batches_of,
        frames_to_batches,
        take_frames,
    )

    schema = parse_schema("k string, n long, x double, t timestamp")
    arrow_out = arrow_schema(schema)
    t0 = datetime.datetime(2026, 1, 1)

    def frame(i: int) -> pd.DataFrame:
        return pd.DataFrame({"k": [f"k{i}"], "n": [i], "x": [i / 4], "t": [t0 + datetime.timedelta(seconds=i)]})

    def ints_apart(i: int) -> pd.DataFrame:  # the int column in a block of its own
        df = pd.DataFrame({"k": [f"k{i}"], "x": [i / 4], "t": [t0 + datetime.timedelta(seconds=i)]})
        df["n"] = [i]
        return df

    def two_ints(i: int) -> pd.DataFrame:  # schema "n" beside an extra int in one block
        return pd.DataFrame({"extra": [-i], "n": [i], "k": [f"k{i}"], "x": [i / 4],
                             "t": [t0 + datetime.timedelta(seconds=i)]})

    for make in ([frame] * 6, [two_ints] * 5, [frame, ints_apart, frame, two_ints, ints_apart] * 2):
        frames = [m(i) for i, m in enumerate(make)]
        taken = [x for i, df in enumerate(frames) for x in take_frames([df], schema, arrow_out, f"call {i}")]
        assert all(type(x) is Frame for x in taken)
        together = pa.Table.from_batches(batches_of(taken, arrow_out), schema=arrow_out)
        alone = pa.Table.from_batches([b for df in frames for b in frames_to_batches([df], schema, arrow_out, "f")],
                                      schema=arrow_out)
        assert together.equals(alone), (together.to_pylist(), alone.to_pylist())
    # one block layout throughout: the block path applies; the ints in blocks of their own
    # beside frames without: it does not (the columns are joined one by one)
    same = take_frames([two_ints(1), two_ints(2)], schema, arrow_out, "f")
    assert _block_columns(same, [1, 3, 2]) is not None
    mixed = take_frames([frame(1), ints_apart(2)], schema, arrow_out, "f")
    assert _block_columns(mixed, [0, 1]) is None


def test_ddl_schemas_parse_without_a_jvm():
    assert parse_schema("a long, b string").simpleString() == "struct<a:bigint,b:string>"
    assert parse_schema("long").simpleString() == "bigint"
    assert parse_schema("a: array<int>, m map<string, double>, d decimal(10, 2)").simpleString() == (
        "struct<a:array<int>,m:map<string,double>,d:decimal(10,2)>"
    )
    with pytest.raises(SchemaError, match="unknown type 'lung'"):
        parse_schema("a lung")


# ---------------------------------------------------------------- Spark's conversions and handle lifecycle


class Point(NamedTuple):
    x: int
    y: str


class Nested(StatefulProcessor):
    """Structs nested in Value, List and Map state; timestamps and maps in and out."""

    def init(self, handle):
        self.v = handle.getValueState("v", "p struct<x long, y string>, n long")
        self.l = handle.getListState("l", "p struct<x long, y string>")
        self.m = handle.getMapState("m", "k struct<a long>", "p struct<x long, q struct<z string>>")

    def handleInputRows(self, key, rows, timerValues):
        pdf = pd.concat(list(rows))
        self.v.update((Point(int(pdf["id"].iloc[0]), "a"), 2))  # a NamedTuple in a struct field
        self.l.appendValue(({"x": 3, "y": "b"},))  # a dict for a struct
        self.m.updateValue(((1,),), (Row(x=4, q=("c",)),))
        v, listed, (mk, mv) = self.v.get(), list(self.l.get()), next(self.m.iterator())
        yield pd.DataFrame({"k": [key[0]], "px": [v[0].x], "ly": [listed[0][0].y], "ka": [mk[0].a],
                            "qz": [mv[0].q.z], "tdtype": [str(pdf["t"].dtype)], "tns": [int(pdf["t"].iloc[0].value)],
                            "m": [{"x": 1, "y": 2}]})


NESTED_OUT = "k string, px long, ly string, ka long, qz string, tdtype string, tns long, m map<string, bigint>"


@pytest.mark.parametrize("source", SOURCES)
def test_state_structs_come_back_as_rows_and_frames_convert_as_spark(source):
    import datetime

    h = Harness(lambda c: TransformWithState(Nested(), NESTED_OUT, "none", "k", clock=c,
                                             input_schema="k string, id long, t timestamp"),
                source)
    t = datetime.datetime(2024, 1, 2, 3, 4, 5, 123456)
    (out,) = h.feed({"k": "a", "id": 7, "t": t})
    assert out == {"k": "a", "px": 7, "ly": "b", "ka": 1, "qz": "c", "tdtype": "datetime64[ns]",
                   "tns": int(pd.Timestamp(t).value), "m": {"x": 1, "y": 2}}
    # stored as plain tuples: checkpoints hold no pyspark classes
    assert h.value("v", ("a",)) == (((7, "a"), 2), None)
    assert type(h.value("v", ("a",))[0][0]) is tuple


def test_group_state_nested_struct_is_a_row_and_a_namedtuple_is_accepted():
    seen = []

    def f(key, pdfs, state):
        for _ in pdfs:
            pass
        if state.exists:
            seen.append((state.get[0].x, state.get[0].y, state.get[1]))
        state.update((Point(len(seen) + 1, "z"), 5))
        yield pd.DataFrame({"k": [key[0]]})

    h = Harness(lambda c: ApplyInPandasWithState(f, "k string", "p struct<x long, y string>, n long", "Update",
                                                 GroupStateTimeout.NoTimeout, "k", clock=c))
    h.feed({"k": "a"})
    h.feed({"k": "a"})
    assert seen == [(1, "z", 5)]


@pytest.mark.parametrize("micro_batch", ["batch", "epoch"])
def test_pandas_output_leaves_as_one_record_batch_per_micro_batch(micro_batch):
    """``"batch"``: one RecordBatch per input batch; ``"epoch"``: nothing until the bound,
    then one RecordBatch of the epoch's output."""
    class Echo(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                yield pd.DataFrame({"k": pdf["k"], "id": pdf["id"]})

    h = Harness(lambda c: TransformWithState(Echo(), "k string, id long", "none", "k", clock=c,
                                             micro_batch=micro_batch))
    recs = [{"k": "ab"[i % 2], "id": i} for i in range(6)]
    out = h.op.apply_batch(recs, [h.op.key_of(r) for r in recs], h.ctx)
    if micro_batch == "epoch":
        assert out is None
        out = h.op.on_epoch_end(1, h.ctx)
    assert isinstance(out, pa.RecordBatch) and out.num_rows == 6
    assert sorted(out.to_pylist(), key=lambda r: r["id"]) == recs


class Lifecycle(StatefulProcessor):
    """Calls ``what`` (a function of the handle and self) in the phase ``where``."""

    def __init__(self, where: str, what) -> None:
        self.where, self.what = where, what

    def init(self, handle):
        self.h = handle
        self.gone = handle.getValueState("gone", "n long")
        handle.deleteIfExists("gone")
        if self.where == "init":
            self.what(self)

    def handleInputRows(self, key, rows, timerValues):
        if self.where == "rows":
            self.what(self)
        self.h.registerTimer(1)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        if self.where == "timer":
            self.what(self)
        return iter([])


INVALID = "[STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_STATE] Failed to perform stateful " \
          "processor operation={} with invalid handle state={}. SQLSTATE: 42802"


@pytest.mark.parametrize("where,what,message", [
    ("rows", lambda s: s.h.getValueState("late", "n long"), INVALID.format("get_value_state", "INITIALIZED")),
    ("rows", lambda s: s.h.getListState("late", "n long"), INVALID.format("get_list_state", "INITIALIZED")),
    ("timer", lambda s: s.h.getMapState("late", "n long", "n long"), INVALID.format("get_map_state",
                                                                                     "DATA_PROCESSED")),
    ("rows", lambda s: s.h.deleteIfExists("gone"), INVALID.format("delete_if_exists", "INITIALIZED")),
    ("init", lambda s: s.h.registerTimer(5), INVALID.format("register_timer", "CREATED")),
    ("init", lambda s: s.h.listTimers(), INVALID.format("list_timers", "CREATED")),
    ("rows", lambda s: s.gone.get(), "Error getting value state: Value state gone is not initialized."),
    ("timer", lambda s: s.gone.update((1,)), "Error updating value state: Value state gone is not initialized."),
])
def test_handle_operations_check_their_phase_as_spark(where, what, message):
    h = Harness(lambda c: TransformWithState(Lifecycle(where, what), "k string", "processingtime", "k", clock=c)) \
        if where != "init" else None
    with pytest.raises(PySparkRuntimeError) as info:
        if h is None:
            Harness(lambda c: TransformWithState(Lifecycle(where, what), "k string", "processingtime", "k", clock=c))
        else:
            h.feed({"k": "a"})
    assert message in str(info.value)


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
@pytest.mark.parametrize("which", ["tws", "group_state"])
def test_base_exceptions_in_user_code_fail_the_job_naming_the_operator(tmp_path, exc, which):
    from epochstream import CheckpointConfig, FileSink
    from epochstream.runtime.errors import EpochStreamError

    class Exits(StatefulProcessor):
        def init(self, handle):
            pass

        def handleInputRows(self, key, rows, timerValues):
            raise exc

    def exits(key, pdfs, state):
        raise exc

    p = Pipeline("exits", parallelism=1, checkpoint=CheckpointConfig(interval=0.01), restart_attempts=0)
    s = p.from_collection([{"k": "a", "id": 1}], uid="input")
    if which == "tws":
        s = s.transform_with_state(Exits(), "k string", key="k", uid="the-op")
    else:
        s = s.apply_in_pandas_with_state(exits, "k string", "n long", "Update", GroupStateTimeout.NoTimeout,
                                         key="k", uid="the-op")
    s.sink(FileSink(tmp_path / "out"), uid="out")
    with pytest.raises(EpochStreamError) as info:
        p.run(deployment="sim", checkpoint_dir=str(tmp_path / "chk"))
    text = repr(info.value) + repr(info.value.__cause__) + repr(getattr(info.value.__cause__, "__cause__", None))
    assert "the-op" in text and type(exc).__name__ in text, text


def test_initial_state_seeds_each_key_once_before_its_rows():
    from epochstream.runtime.state import OperatorStateBackend

    class Seeded(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.n = handle.getValueState("n", "n long")

        def handleInitialState(self, key, initialState, timerValues):
            self.n.update((int(initialState["n"].sum()),))
            self.handle.registerTimer(10**13)  # allowed here, as in Spark

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                n = (self.n.get() or (0,))[0] + len(pdf)
                self.n.update((n,))
                yield pd.DataFrame({"k": [key[0]], "n": [n]})

    seeds = pa.table({"k": ["a", "a", "b"], "n": [10, 5, 20]})
    op = TransformWithState(Seeded(), "k string, n long", "processingtime", "k", clock=Clock(), initial_state=seeds,
                            micro_batch="batch")
    state = HeapKeyedState("op", lambda k: 0, (0, 0))
    backend = OperatorStateBackend("op", 0)
    ctx = Context(state, 0, 1, "op", None, backend)
    op.open(ctx)
    assert rows_of(op.apply_batch([{"k": "a"}], [("a",)], ctx)) == [{"k": "a", "n": 16}]
    assert state.as_dict()["n"][("b",)] == ((20,), None) and state.as_dict()["$timers"][("b",)] == (10**13,)
    # opened again with its operator state restored (a failover): not seeded again
    again = TransformWithState(Seeded(), "k string, n long", "processingtime", "k", clock=Clock(), initial_state=seeds)
    again.open(Context(state, 0, 1, "op", None, backend))
    assert state.as_dict()["n"][("a",)] == ((16,), None)
    with pytest.raises(SchemaError, match=r"lacks the grouping column\(s\) \['k'\]"):
        TransformWithState(Seeded(), "k string, n long", "none", "k", initial_state=pd.DataFrame({"x": [1]}))


def test_late_rows_are_judged_against_the_watermark_as_of_the_previous_epochs_start():
    """With job-wide event time (here a TimerService advanced by hand, as the trAcker or the
    aligned watermarks advance it) a row is late against the watermark read at the last epoch
    bound (Spark: the previous micro-batch's, eventTimeWatermarkForLateEvents); timers fire as
    event time passes them (Spark: against the current one, eventTimeWatermarkForEviction)."""
    from epochstream.runtime.state import OperatorStateBackend
    from epochstream.runtime.timers import TimerService

    class Sess(StatefulProcessor):
        def init(self, handle):
            self.h = handle

        def handleInputRows(self, key, rows, timerValues):
            for pdf in rows:
                for t in pdf["t"]:
                    self.h.registerTimer(int(t) + 100)
                    yield pd.DataFrame({"k": [key[0]], "t": [int(t)], "wm": [timerValues.getCurrentWatermarkInMs()]})

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
            yield pd.DataFrame({"k": [key[0]], "t": [-expiredTimerInfo.getExpiryTimeInMs()],
                                "wm": [timerValues.getCurrentWatermarkInMs()]})

    state = HeapKeyedState("op", lambda k: 0, (0, 0))
    timers = TimerService(state)
    ctx = Context(state, 0, 1, "op", timers, OperatorStateBackend("op", 0))
    op = TransformWithState(Sess(), "k string, t long, wm long", "eventtime", "k", event_time="t", clock=Clock())
    op.open(ctx)

    def feed(k, t):  # a micro-batch: kept, then run (as before a timer fires)
        return rows_of(op.apply_batch([{"k": k, "t": t}], [(k,)], ctx)) + rows_of(op.drain_input(ctx))

    assert feed("a", 1_000) == [{"k": "a", "t": 1_000, "wm": 0}]
    fired: list = []
    timers.advance(1, 2_000.0, lambda ts: fired.extend(op.on_timer(ts, ctx)))
    assert fired == [{"k": "a", "t": -1_100, "wm": 1_999}]
    assert feed("b", 500) == [{"k": "b", "t": 500, "wm": 1_999}]  # late only against the newer watermark: kept
    assert rows_of(op.on_epoch_end(1, ctx)) == []
    assert feed("c", 1_500) == [{"k": "c", "t": 1_500, "wm": 1_999}]  # epoch 1: late at or below 0 (epoch 0's start)
    assert rows_of(op.on_epoch_end(2, ctx)) == []
    assert feed("d", 1_999) == []  # epoch 2: late at or below epoch 1's start watermark, 1 999


def test_a_micro_batchs_frames_are_freed_before_the_collector_is_back():
    """The frames a user call gets and yields are released by reference counting before the
    cyclic collector, paused during a micro-batch's calls, runs again: no collection sees one
    of them alive (at 10,000 keys one that did scanned and promoted every frame of the
    micro-batch, a tenth of its CPU). The output is the frames' rows."""
    import gc
    import weakref

    seen: list[weakref.ref] = []
    alive_at_collections: list[int] = []

    def count(key, pdfs, state):
        c = state.get[0] if state.exists else 0
        for pdf in pdfs:
            seen.append(weakref.ref(pdf))
            c += len(pdf)
        state.update((c,))
        out = pd.DataFrame({"k": [key[0]], "c": [c]})
        seen.append(weakref.ref(out))
        yield out

    def watch(phase, info):
        if phase == "start":
            alive_at_collections.append(sum(ref() is not None for ref in seen))

    h = Harness(lambda clock: ApplyInPandasWithState(count, "k long, c long", "c long", "Update",
                                                     GroupStateTimeout.NoTimeout, key="k", clock=clock),
                source="arrow")
    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(watch)
    try:
        out = h.feed(*[{"k": i % 300, "v": i} for i in range(1500)]) + h.bound()
    finally:
        gc.callbacks.remove(watch)
        if not was:
            gc.disable()
    assert len(seen) == 600 and all(ref() is None for ref in seen)
    assert not any(alive_at_collections), alive_at_collections
    assert sorted((r["k"], r["c"]) for r in out) == [(k, 5) for k in range(300)]
