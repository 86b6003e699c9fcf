"""PySpark's state handles (``StatefulProcessorHandle``, ``ValueState``, ``ListState``,
``MapState``) backed by epochstream keyed state.

Each Spark state variable is one declared epochstream state of the same name, so it is
captured per epoch, restored, rescaled by key group and stored by every backend like
native state. Entries carry their TTL expiry with them: a value is stored as
``(value, expires_ms)`` (``expires_ms`` None without TTL), a list as a list of such pairs
and a map as ``{user key: (value, expires_ms)}``. Values are tuples in the schema's field
order, as Spark hands them out.

TTL follows Spark: an update sets ``expires = batch processing time + ttl``; an entry whose
``expires <= current batch processing time`` is invisible at once and removed at the next
epoch bound (Spark removes it at the end of the micro-batch). Timers of a key live in the
reserved state ``$timers`` as a sorted tuple of expiry times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from pyspark.sql.streaming.stateful_processor import ListState, MapState, StatefulProcessorHandle, ValueState

from ..runtime.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from .schema import DataType, SchemaError, state_tuple, state_value, struct_schema

if TYPE_CHECKING:
    from .operators import TransformWithState

#: reserved state names (Spark state variable names cannot clash: they may not start with "$")
TIMERS = "$timers"
EVENT_TIME = "$eventTime"

#: Spark's ``StatefulProcessorHandleState`` in order: ``init`` runs in CREATED,
#: ``handleInputRows`` (and ``handleInitialState``) in INITIALIZED, ``handleExpiredTimer`` in
#: DATA_PROCESSED, ``close`` in TIMER_PROCESSED; CLOSED after it
PHASES = ("CREATED", "INITIALIZED", "DATA_PROCESSED", "TIMER_PROCESSED", "CLOSED")
#: Spark's name of each time mode in its error messages (``TimeMode.toString``)
_TIME_MODE_NAMES = {"none": "NoTime", "processingtime": "ProcessingTime", "eventtime": "EventTime"}


#: what PySpark's state client puts before the state server's error for each handle
#: operation (``stateful_processor_api_client.py``): the user sees this text, not the bare one
_CLIENT_PREFIX = {
    "get_value_state": "Error initializing value state: ",
    "get_list_state": "Error initializing list state: ",
    "get_map_state": "Error initializing map state: ",
    "delete_if_exists": "Error deleting state: ",
    "register_timer": "Error register timer: ",
    "delete_timer": "Error deleting timer: ",
    # Spark's client turns any error of list_timers into an empty iterator; here it raises
    "list_timers": "",
}


def invalid_handle_state(operation: str, phase: str) -> Exception:
    """Spark's error for a handle operation in the wrong phase: its state server raises it,
    PySpark's client reports it as a ``PySparkRuntimeError`` with its own prefix (measured
    on Spark 4.2, tests/test_pyspark_differential.py)."""
    from pyspark.errors import PySparkRuntimeError

    return PySparkRuntimeError(
        f"{_CLIENT_PREFIX[operation]}[STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_STATE] "
        f"Failed to perform stateful processor operation={operation} with invalid handle state={phase}. "
        "SQLSTATE: 42802"
    )


def invalid_time_mode(operation: str, time_mode: str) -> Exception:
    from pyspark.errors import PySparkRuntimeError

    return PySparkRuntimeError(
        f"{_CLIENT_PREFIX[operation]}[STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_MODE] "
        f"Failed to perform stateful processor operation={operation} with invalid timeMode="
        f"{_TIME_MODE_NAMES[time_mode]} SQLSTATE: 42802"
    )


#: PySpark's client text for each call on a state variable whose server side is gone
#: (``value_state_client.py``, ``list_state_client.py``, ``map_state_client.py``); the list
#: client says "value state" for list calls, as Spark does
_DELETED_PREFIX = {
    ("value", "exists"): "Error checking value state exists",
    ("value", "get"): "Error getting value state",
    ("value", "update"): "Error updating value state",
    ("value", "clear"): "Error clearing value state",
    ("list", "exists"): "Error checking value state exists",
    ("list", "put"): "Error updating value state",
    ("list", "appendValue"): "Error updating value state",
    ("list", "appendList"): "Error updating value state",
    ("list", "clear"): "Error clearing value state",
    ("map", "exists"): "Error checking map state exists",
    ("map", "getValue"): "Error getting value",
    ("map", "containsKey"): "Error checking if map state contains key",
    ("map", "updateValue"): "Error updating map state value",
    ("map", "removeKey"): "Error removing key from map state",
    ("map", "clear"): "Error clearing map state",
}


def deleted_variable(kind: str, name: str, call: str) -> Exception:
    """What Spark raises on a state variable after ``deleteIfExists``: its state server no
    longer knows the name and answers "<Kind> state <name> is not initialized."."""
    from pyspark.errors import PySparkRuntimeError

    return PySparkRuntimeError(f"{_DELETED_PREFIX[kind, call]}: {kind.capitalize()} state {name} is not initialized.")


def _check_ttl(ttl: int | None, name: str, time_mode: str) -> int | None:
    if ttl is None:
        return None
    if time_mode != "processingtime":
        raise ValueError(
            f"Cannot use TTL for state={name} in timeMode={time_mode}, use time_mode='processingtime' instead "
            f"(Spark: STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL)"
        )
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
        raise ValueError(f"state {name!r}: ttlDurationMs must be a positive int, got {ttl!r} "
                         f"(Spark: TTL_MUST_BE_POSITIVE)")
    return ttl


class _Var:
    """What every state variable shares: its operator, name, schema and TTL."""

    #: "value", "list" or "map" (Spark's error texts name it)
    kind: str

    def __init__(self, op: "TransformWithState", name: str, ttl: int | None) -> None:
        self._op, self._name, self._ttl = op, name, ttl

    @property
    def _deleted(self) -> bool:
        """Spark's client objects are bound by name: one works while the state server knows
        the name (declared in ``init`` and not deleted since), whichever object declared it."""
        return self._name not in self._op.variables

    def _check(self, call: str) -> None:
        if self._deleted:
            raise deleted_variable(self.kind, self._name, call)

    def _expires(self) -> int | None:
        return None if self._ttl is None else self._op.batch_time_ms + self._ttl

    def _live(self, expires: int | None) -> bool:
        return expires is None or expires > self._op.batch_time_ms


class EpochValueState(_Var, ValueState):
    """``ValueState``: one row per grouping key."""

    kind = "value"

    def __init__(self, op, name: str, schema, ttl: int | None) -> None:
        _Var.__init__(self, op, name, ttl)
        self._schema = struct_schema(schema, f"value state {name!r} schema")
        self._h = op.ctx.state(ValueStateDescriptor(name))

    def exists(self) -> bool:
        self._check("exists")
        v = self._h.value()
        return v is not None and self._live(v[1])

    def get(self) -> tuple | None:
        self._check("get")
        v = self._h.value()
        if v is None or not self._live(v[1]):
            return None
        return state_value(v[0], self._schema)

    def update(self, newValue: tuple) -> None:
        self._check("update")
        self._h.update((state_tuple(newValue, self._schema, f"value state {self._name!r}"), self._expires()))

    def clear(self) -> None:
        self._check("clear")
        self._h.clear()

    def _purge_expired(self) -> None:
        v = self._h.value()
        if v is not None and not self._live(v[1]):
            self._h.clear()


class EpochListState(_Var, ListState):
    """``ListState``: a list of rows per grouping key; with TTL each element expires alone."""

    kind = "list"

    def __init__(self, op, name: str, schema, ttl: int | None) -> None:
        _Var.__init__(self, op, name, ttl)
        self._schema = struct_schema(schema, f"list state {name!r} schema")
        self._h = op.ctx.state(ListStateDescriptor(name))

    def exists(self) -> bool:
        self._check("exists")
        return any(self._live(e) for _v, e in self._h.get())

    def get(self) -> Iterator[tuple]:
        if self._deleted:  # Spark's client ends the iterator on the server's error
            return iter([])
        schema = self._schema
        return iter([state_value(v, schema) for v, e in self._h.get() if self._live(e)])

    def _rows(self, values: list[tuple], call: str) -> list[tuple]:
        self._check(call)
        if values is None:
            raise SchemaError(f"list state {self._name!r}.{call}: None (Spark: ILLEGAL_STATE_STORE_VALUE.NULL_VALUE)")
        values = list(values)
        if not values:
            raise SchemaError(
                f"list state {self._name!r}.{call}: an empty list (Spark: ILLEGAL_STATE_STORE_VALUE.EMPTY_LIST_VALUE)"
            )
        exp = self._expires()
        return [(state_tuple(v, self._schema, f"list state {self._name!r}"), exp) for v in values]

    def put(self, newState: list[tuple]) -> None:
        self._h.update(self._rows(newState, "put"))

    def appendValue(self, newState: tuple) -> None:
        self._check("appendValue")
        exp = self._expires()
        self._h.add((state_tuple(newState, self._schema, f"list state {self._name!r}"), exp))

    def appendList(self, newState: list[tuple]) -> None:
        self._h.add_all(self._rows(newState, "appendList"))

    def clear(self) -> None:
        self._check("clear")
        self._h.clear()

    def _purge_expired(self) -> None:
        entries = self._h.get()
        if entries and any(not self._live(e) for _v, e in entries):
            live = [(v, e) for v, e in entries if self._live(e)]
            if live:
                self._h.update(live)
            else:
                self._h.clear()


class EpochMapState(_Var, MapState):
    """``MapState``: a map of user-key rows to value rows per grouping key."""

    kind = "map"

    def __init__(self, op, name: str, key_schema, value_schema, ttl: int | None) -> None:
        _Var.__init__(self, op, name, ttl)
        self._kschema = struct_schema(key_schema, f"map state {name!r} user key schema")
        self._vschema = struct_schema(value_schema, f"map state {name!r} value schema")
        self._h = op.ctx.state(MapStateDescriptor(name))

    def _key(self, key: tuple) -> tuple:
        return state_tuple(key, self._kschema, f"map state {self._name!r} user key")

    def exists(self) -> bool:
        self._check("exists")
        return any(self._live(e) for _v, e in self._h.values())

    def getValue(self, key: tuple) -> tuple | None:
        self._check("getValue")
        entry = self._h.get(self._key(key))
        if entry is None or not self._live(entry[1]):
            return None
        return state_value(entry[0], self._vschema)

    def containsKey(self, key: tuple) -> bool:
        self._check("containsKey")
        return self.getValue(key) is not None

    def updateValue(self, key: tuple, value: tuple) -> None:
        self._check("updateValue")
        stored = state_tuple(value, self._vschema, f"map state {self._name!r} value")
        self._h.put(self._key(key), (stored, self._expires()))

    def iterator(self) -> Iterator[tuple[tuple, tuple]]:
        if self._deleted:  # Spark's client ends the iterator on the server's error
            return iter([])
        ks, vs = self._kschema, self._vschema
        return iter([(state_value(k, ks), state_value(v, vs)) for k, (v, e) in self._h.items() if self._live(e)])

    def keys(self) -> Iterator[tuple]:
        if self._deleted:  # Spark's client ends the iterator on the server's error
            return iter([])
        return iter([state_value(k, self._kschema) for k, (_v, e) in self._h.items() if self._live(e)])

    def values(self) -> Iterator[tuple]:
        if self._deleted:  # Spark's client ends the iterator on the server's error
            return iter([])
        return iter([state_value(v, self._vschema) for _k, (v, e) in self._h.items() if self._live(e)])

    def removeKey(self, key: tuple) -> None:
        self._check("removeKey")
        self._h.remove(self._key(key))

    def clear(self) -> None:
        self._check("clear")
        self._h.clear()

    def _purge_expired(self) -> None:
        for k, (_v, e) in self._h.items():
            if not self._live(e):
                self._h.remove(k)


class EpochStatefulProcessorHandle(StatefulProcessorHandle):
    """The handle a ``StatefulProcessor`` gets in ``init``: state variables and timers of
    the current grouping key, over the operator's epochstream keyed state."""

    def __init__(self, op: "TransformWithState") -> None:
        self._op = op

    def _in_init(self, operation: str) -> None:
        """State variables are declared and deleted in ``init`` only (Spark: CREATED)."""
        if self._op.phase != "CREATED":
            raise invalid_handle_state(operation, self._op.phase)

    def _declare(self, name: str, kind: str, ttl: int | None):
        self._in_init(f"get_{kind}_state")
        if not isinstance(name, str) or not name or name.startswith("$"):
            raise ValueError(f"state name must be a non-empty string not starting with '$', got {name!r}")
        ttl = _check_ttl(ttl, name, self._op.time_mode)
        known = self._op.variables.get(name)
        if known is not None and known[0] != kind:
            raise ValueError(f"state {name!r} is already declared as {known[0]} state, not {kind} state")
        if known is not None:  # Spark's state server refuses it and goes on (measured on Spark 4.2)
            from pyspark.errors import PySparkRuntimeError

            raise PySparkRuntimeError(
                f"Error initializing {kind} state: {kind.capitalize()} state {name} already exists"
            )
        return ttl

    def getValueState(self, stateName: str, schema: DataType | str, ttlDurationMs: int | None = None) -> ValueState:
        ttl = self._declare(stateName, "value", ttlDurationMs)
        var = EpochValueState(self._op, stateName, schema, ttl)
        self._op.variables[stateName] = ("value", var)
        return var

    def getListState(self, stateName: str, schema: DataType | str, ttlDurationMs: int | None = None) -> ListState:
        ttl = self._declare(stateName, "list", ttlDurationMs)
        var = EpochListState(self._op, stateName, schema, ttl)
        self._op.variables[stateName] = ("list", var)
        return var

    def getMapState(
        self,
        stateName: str,
        userKeySchema: DataType | str,
        valueSchema: DataType | str,
        ttlDurationMs: int | None = None,
    ) -> MapState:
        ttl = self._declare(stateName, "map", ttlDurationMs)
        var = EpochMapState(self._op, stateName, userKeySchema, valueSchema, ttl)
        self._op.variables[stateName] = ("map", var)
        return var

    def _timer_call(self, operation: str) -> None:
        """Timers need a time mode and a current key: from ``handleInputRows`` (or
        ``handleInitialState``) through ``handleExpiredTimer``, as Spark checks them."""
        op = self._op
        if op.time_mode == "none":
            raise invalid_time_mode(operation, op.time_mode)
        if op.phase not in ("INITIALIZED", "DATA_PROCESSED"):
            raise invalid_handle_state(operation, op.phase)

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._timer_call("register_timer")
        self._op.timers.register(self._op.ctx.key, int(expiryTimestampMs))

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._timer_call("delete_timer")
        self._op.timers.delete(self._op.ctx.key, int(expiryTimestampMs))

    def listTimers(self) -> Iterator[int]:
        self._timer_call("list_timers")
        return iter(self._op.timers.list(self._op.ctx.key))

    def deleteIfExists(self, stateName: str) -> None:
        """Drop state variable ``stateName`` for every key of this subtask (Spark purges the
        whole column family). Only in ``init``, as in Spark; the variable's object raises on
        any later use."""
        self._in_init("delete_if_exists")
        ctx = self._op.ctx
        current = ctx.key
        for key in ctx.keys(stateName):
            ctx.set_current_key(key)
            for kind in ("value", "list", "map"):
                try:
                    h = ctx.state({"value": ValueStateDescriptor, "list": ListStateDescriptor,
                                   "map": MapStateDescriptor}[kind](stateName))
                except ValueError:
                    continue
                h.clear()
                break
        ctx.set_current_key(current)
        self._op.variables.pop(stateName, None)  # its objects raise on use from now on (_Var._deleted)


class Timers:
    """Timers of one operator subtask: per key in keyed state (``$timers``), plus an
    in-memory heap of (expiry, seq, key) to find the expired ones without a scan. The heap
    is rebuilt from the state after every restore; entries of deleted timers are skipped
    when they come up."""

    def __init__(self, op: "TransformWithState") -> None:
        import heapq

        self._op = op
        self._h = op.ctx.state(ValueStateDescriptor(TIMERS))
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0
        self._push = heapq.heappush
        self._pop = heapq.heappop
        ctx = op.ctx
        current = ctx.key
        for key in ctx.keys(TIMERS):  # restored timers
            ctx.set_current_key(key)
            for ts in self._h.value() or ():
                self._push(self._heap, (ts, self._next(), key))
        ctx.set_current_key(current)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def register(self, key: Any, ts: int) -> None:
        current = tuple(self._h.value() or ())
        if ts in current:
            return
        self._h.update(tuple(sorted(current + (ts,))))
        if self._op.tracker_time is not None:
            self._op.tracker_time.register_event_time_timer(ts)  # the trAcker fires it (tracker mode)
        else:
            self._push(self._heap, (ts, self._next(), key))

    def delete(self, key: Any, ts: int) -> None:
        current = self._h.value()
        if current and ts in current:
            rest = tuple(t for t in current if t != ts)
            if rest:
                self._h.update(rest)
            else:
                self._h.clear()
            if self._op.tracker_time is not None:
                self._op.tracker_time.delete_event_time_timer(ts)

    def has(self, ts: int) -> bool:
        """The current key has a timer at ``ts``."""
        return ts in (self._h.value() or ())

    def list(self, key: Any) -> list[int]:
        return list(self._h.value() or ())

    def expired(self, threshold: int) -> Iterator[tuple[Any, int]]:
        """Pop every (key, expiry) with expiry <= threshold in expiry order; the caller makes
        the key current, runs the user's handler and then deletes the timer."""
        heap, ctx = self._heap, self._op.ctx
        while heap and heap[0][0] <= threshold:
            ts, _seq, key = self._pop(heap)
            ctx.set_current_key(key)
            if ts in (self._h.value() or ()):
                yield key, ts
