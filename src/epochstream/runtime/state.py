"""Keyed state: descriptors, PyFlink-style handles, and the heap backend that captures it.

The heap backend keeps one dict per declared state (key -> value) and a *dirty set* of the
keys written since the last capture. A capture at an epoch bound pickles only those keys
(an incremental snapshot, a changelog) or every key (a full one), synchronously, so later
in-place mutation cannot leak into a snapshot; the bytes are written in the background by
the driver. Compaction of the chain is spread over a *round* of captures, each adding a
share of the keys, so no epoch after the first pickles the whole state (``capture``).

As in Flink's heap backend, a value fetched with ``value()`` / ``get()`` and mutated in
place is only recorded when written back (``update``, ``add``, ``put``).
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, overload

from ..graph.keygroups import canonical_key
from .errors import StateSerializationError
from .messages import ColumnRows, KeyedCapture
from .types import TypeInformation, column_type, typed_column_name

_PICKLE = pickle.HIGHEST_PROTOCOL


# ---------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class StateDescriptor:
    """Names a piece of keyed state. ``type_info`` (``Types.LONG()`` ...) is optional: state is
    always pickled; a declared type is checked at each capture and gives the state a typed
    column where a backend has columns (Delta)."""

    name: str
    type_info: Any = None

    kind = "value"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"state descriptor needs a non-empty name, got {self.name!r}")


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor):
    """One value per key; ``value()`` returns ``default`` (None) when unset."""

    default: Any = None
    kind = "value"


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor):
    """A list per key."""

    kind = "list"


@dataclass(frozen=True)
class MapStateDescriptor(StateDescriptor):
    """A dict per key; ``type_info`` may be a (key type, value type) pair."""

    kind = "map"


# ---------------------------------------------------------------- handles


class _KeyContext:
    """The current key, shared by every handle of one operator instance."""

    __slots__ = ("key",)

    def __init__(self) -> None:
        self.key: Any = None


class _Table:
    """Values of one declared state; ``dirty`` holds keys written since the last capture."""

    __slots__ = ("name", "kind", "data", "dirty", "type")

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind
        self.data: dict[Any, Any] = {}
        self.dirty: set[Any] = set()
        #: the declared column type (None: pickled only)
        self.type: TypeInformation | None = None


class ValueState:
    __slots__ = ("_t", "_k", "_default")

    def __init__(self, table: _Table, keys: _KeyContext, default: Any) -> None:
        self._t, self._k, self._default = table, keys, default

    def value(self) -> Any:
        v = self._t.data.get(self._k.key, _MISSING)
        if v is _MISSING:
            d = self._default
            # a fresh copy per key, so mutating a default never leaks into other keys
            return d if type(d) in _IMMUTABLE else copy.deepcopy(d)
        return v

    def update(self, value: Any) -> None:
        k = self._k.key
        self._t.data[k] = value
        self._t.dirty.add(k)

    def clear(self) -> None:
        k = self._k.key
        if self._t.data.pop(k, _MISSING) is not _MISSING:
            self._t.dirty.add(k)


class ListState:
    __slots__ = ("_t", "_k")

    def __init__(self, table: _Table, keys: _KeyContext) -> None:
        self._t, self._k = table, keys

    def get(self) -> list[Any]:
        values: list[Any] = self._t.data.get(self._k.key, [])
        return values

    def add(self, value: Any) -> None:
        k = self._k.key
        lst = self._t.data.get(k)
        if lst is None:
            self._t.data[k] = [value]
        else:
            lst.append(value)
        self._t.dirty.add(k)

    def add_all(self, values: Iterable[Any]) -> None:
        for v in values:
            self.add(v)

    def update(self, values: Iterable[Any]) -> None:
        k = self._k.key
        self._t.data[k] = list(values)
        self._t.dirty.add(k)

    def clear(self) -> None:
        k = self._k.key
        if self._t.data.pop(k, _MISSING) is not _MISSING:
            self._t.dirty.add(k)


class MapState:
    __slots__ = ("_t", "_k")

    def __init__(self, table: _Table, keys: _KeyContext) -> None:
        self._t, self._k = table, keys

    def _map(self) -> dict[Any, Any]:
        entries: dict[Any, Any] = self._t.data.get(self._k.key, _EMPTY)
        return entries

    def get(self, key: Any) -> Any:
        return self._map().get(key)

    def put(self, key: Any, value: Any) -> None:
        k = self._k.key
        m = self._t.data.get(k)
        if m is None:
            self._t.data[k] = {key: value}
        else:
            m[key] = value
        self._t.dirty.add(k)

    def put_all(self, entries: dict[Any, Any]) -> None:
        for key, value in entries.items():
            self.put(key, value)

    def contains(self, key: Any) -> bool:
        return key in self._map()

    def remove(self, key: Any) -> None:
        k = self._k.key
        m = self._t.data.get(k)
        if m is not None and key in m:
            del m[key]
            if not m:
                del self._t.data[k]
            self._t.dirty.add(k)

    def keys(self) -> Iterator[Any]:
        return iter(list(self._map().keys()))

    def values(self) -> Iterator[Any]:
        return iter(list(self._map().values()))

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list(self._map().items()))

    def is_empty(self) -> bool:
        return not self._map()

    def clear(self) -> None:
        k = self._k.key
        if self._t.data.pop(k, _MISSING) is not _MISSING:
            self._t.dirty.add(k)


_MISSING = object()
_IMMUTABLE = frozenset({type(None), int, float, str, bool, bytes, complex, tuple, frozenset})
_EMPTY: dict[Any, Any] = {}


# ---------------------------------------------------------------- backend


class _Round:
    """A materialisation spread over ``parts`` captures: the keys each state held at the
    round's first capture (``start``), handed out one part per capture."""

    __slots__ = ("start", "parts", "done", "keys")

    def __init__(self, start: int, parts: int, keys: dict[str, list[Any]]) -> None:
        self.start, self.parts, self.done, self.keys = start, parts, 0, keys

    def share(self, name: str) -> list[Any]:
        """This capture's part of state ``name``'s keys (none for a state made since the start:
        all its keys were written since, so they are in the links anyway)."""
        keys = self.keys.get(name, ())
        size = -(-len(keys) // self.parts)
        return list(keys[self.done * size:(self.done + 1) * size])

    def advance(self) -> bool:
        """One part captured; whether that was the last."""
        self.done += 1
        return self.done >= self.parts


class HeapKeyedState:
    """All keyed state of one operator instance (one subtask of one ``process`` operator)."""

    def __init__(self, operator_uid: str, key_group_of: Callable[[Any], int], key_group_range: tuple[int, int],
                 key_type: TypeInformation | None = None) -> None:
        self.operator_uid = operator_uid
        #: the key's declared type (``key_by(..., key_type=)``), checked at each capture
        self.key_type = key_type
        self.keys = _KeyContext()
        self.tables: dict[str, _Table] = {}
        self._key_group_of = key_group_of
        self.key_group_range = key_group_range
        #: epochs whose captures rebuild the state: [last full, increments...]
        self.chain: list[int] = []
        self.force_full = True
        #: newest time label whose timers fired here (None: the operator has no event time; -1:
        #: no label is complete yet, set by its ``TimerService``)
        self.event_time: int | None = None
        #: the materialisation in progress, spread over captures (``capture``)
        self._round: _Round | None = None

    @overload
    def handle(self, descriptor: ValueStateDescriptor) -> ValueState: ...

    @overload
    def handle(self, descriptor: ListStateDescriptor) -> ListState: ...

    @overload
    def handle(self, descriptor: MapStateDescriptor) -> MapState: ...

    @overload
    def handle(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState: ...

    def handle(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState:
        kind = descriptor.kind
        table = self.tables.get(descriptor.name)
        if table is None:
            table = self.tables[descriptor.name] = _Table(descriptor.name, kind)
        elif table.kind != kind:
            raise ValueError(
                f"operator {self.operator_uid!r}: state {descriptor.name!r} is declared as {table.kind} "
                f"state and again as {kind} state"
            )
        typ = column_type(kind, descriptor.type_info)
        if typ is not None:
            typed_column_name(descriptor.name)  # a typed state needs a name that can be a column
            if table.type is not None and table.type != typ:
                raise ValueError(
                    f"operator {self.operator_uid!r}: state {descriptor.name!r} is declared with type "
                    f"{table.type.sql} and again with {typ.sql}"
                )
            table.type = typ
        if kind == "value":
            return ValueState(table, self.keys, getattr(descriptor, "default", None))
        if kind == "list":
            return ListState(table, self.keys)
        if kind == "map":
            return MapState(table, self.keys)
        raise ValueError(f"unknown state kind {kind!r}")

    def keys_of(self, name: str) -> list[Any]:
        """Keys holding a value in state ``name`` (a copy: callers may write while iterating)."""
        table = self.tables.get(name)
        return list(table.data) if table is not None else []

    def capture(self, epoch: int, incremental: bool = True, full_every: int = 10) -> KeyedCapture:
        """Serialize the state at an epoch bound: the keys written since the last capture, or
        every key (a full capture: not incremental, the first after a restore, or ``full_every``
        1).

        Materialisation is spread over epochs, so no epoch waits for a full snapshot (the
        heap's p99 at 1M keys was the full capture every ``full_every``-th epoch): once the
        chain has ``full_every`` links a *round* starts, which lists the keys at this bound and
        adds one ``full_every``-th of them (their current values) to each of the next
        ``full_every`` captures. When a round ends, the links before its first capture are
        dropped: every key live at the round's start was captured during it (or deleted,
        and its tombstone is in a link since), and every key written since is in a link since,
        so the links from the round's start rebuild the state. The chain stays under
        2 * ``full_every`` links.
        """
        full = not incremental or self.force_full or not self.chain or (
            full_every <= 1 and len(self.chain) >= full_every)
        if full:
            self._round = None
        elif self._round is None and len(self.chain) >= full_every:
            self._round = _Round(epoch, full_every, {t.name: list(t.data) for t in self.tables.values()})
        rnd = self._round
        key_type = self.key_type
        dumps = pickle.dumps
        all_keys: list[Any] = []
        kbytes: list[bytes] = []
        vbytes: list[bytes | None] = []
        states: list[tuple[str, int]] = []
        for table in self.tables.values():
            data = table.data
            keys = list(data) if full else list(table.dirty)
            if rnd is not None:  # this capture's share of the round: live keys not written anyway
                dirty = table.dirty
                keys += [k for k in rnd.share(table.name) if k in data and k not in dirty]
            if table.type is not None or key_type is not None:
                self._check_types(table, keys, key_type)
            try:  # one comprehension per column: no tuple per row, no per-row calls but the pickles
                kb = [dumps(k, _PICKLE) for k in keys]
                vb = ([dumps(v, _PICKLE) for v in data.values()] if full
                      else [None if (v := data.get(k, _MISSING)) is _MISSING else dumps(v, _PICKLE) for k in keys])
            except Exception:
                self._raise_unpicklable(table, keys)
                raise
            all_keys += keys
            kbytes += kb
            vbytes += vb
            if keys:
                states.append((table.name, len(keys)))
            table.dirty = set()
        kg_of = self._key_group_of
        many = getattr(kg_of, "many", None)
        kgs = many(all_keys) if many is not None else [kg_of(k) for k in all_keys]
        rows = ColumnRows(kgs, kbytes, states, vbytes)
        if full:
            self.chain = [epoch]
            self.force_full = False
        else:
            self.chain.append(epoch)
            if rnd is not None and rnd.advance():  # the round is over: it rebuilds the state alone
                self.chain = self.chain[self.chain.index(rnd.start):]
                self._round = None
        kinds = tuple((t.name, t.kind) for t in self.tables.values())
        types = tuple((t.name, t.type.to_json()) for t in self.tables.values() if t.type is not None)
        return KeyedCapture(self.operator_uid, rows, full, tuple(self.chain), self.key_group_range, kinds,
                            self.event_time, types, None if key_type is None else key_type.to_json())

    def _raise_unpicklable(self, table: _Table, keys: Iterable[Any]) -> None:
        """Find the key whose key or value does not pickle and say what and where."""
        data = table.data
        for key in keys:
            value = data.get(key)
            try:
                pickle.dumps(key, _PICKLE)
                pickle.dumps(value, _PICKLE)
            except Exception as exc:  # pickling user values: report what and where
                raise StateSerializationError(
                    f"operator {self.operator_uid!r}, state {table.name!r}, key {key!r}: value of type "
                    f"{type(value).__name__} cannot be pickled ({exc}); keyed state values "
                    f"must be picklable"
                ) from exc

    def _check_types(self, table: _Table, keys: Iterable[Any], key_type: TypeInformation | None) -> None:
        """Declared types are a contract: a value that breaks it fails the capture (and so the
        epoch) here, in the task, before anything could reach a typed column."""
        data, typ = table.data, table.type
        for key in keys:
            why = None if key_type is None else key_type.check(key)
            if why and key_type is not None:
                raise StateSerializationError(
                    f"operator {self.operator_uid!r}: key {key!r} does not fit the declared key type "
                    f"{key_type.sql}: {why}"
                )
            if typ is not None:
                value = data.get(key)
                why = typ.check(value)
                if why:
                    raise StateSerializationError(
                        f"operator {self.operator_uid!r}, state {table.name!r}, key {key!r}: the value does not fit "
                        f"the declared type {typ.sql}: {why}"
                    )

    def restore_rows(self, rows: Iterable[tuple[int, bytes, str, bytes | None]], kinds: dict[str, str]) -> None:
        """Apply rows of a file chain in order (later rows win; ``None`` deletes)."""
        loads = pickle.loads
        for _kg, kbytes, name, vbytes in rows:
            table = self.tables.get(name)
            if table is None:
                table = self.tables[name] = _Table(name, kinds.get(name, "value"))
            key = canonical_key(loads(kbytes))  # an unpickled NaN is a new object: the one NaN key
            if vbytes is None:
                table.data.pop(key, None)
            else:
                table.data[key] = loads(vbytes)

    def entries(self, name: str) -> list[tuple[Any, Any]]:
        """(key, value) of every key holding a value in state ``name`` (a copy)."""
        table = self.tables.get(name)
        return list(table.data.items()) if table is not None else []

    def drop_key(self, key: Any) -> None:
        """Drop every piece of state of ``key`` (expiry timers)."""
        for table in self.tables.values():
            if table.data.pop(key, _MISSING) is not _MISSING:
                table.dirty.add(key)

    def close(self) -> None:
        """Nothing to release: the state lives in dicts."""
        return None

    #: a dict lookup costs less than collecting a batch's keys: ``begin_batch`` does nothing
    prefetches = False

    def begin_batch(self, keys: list[Any]) -> None:
        """The keys a batch is about to touch (``RocksDBKeyedState`` reads them at once)."""
        return None

    def end_batch(self) -> None:
        return None

    def as_dict(self) -> dict[str, dict[Any, Any]]:
        """Plain copy of all state (tests, queries)."""
        return {name: dict(t.data) for name, t in self.tables.items() if t.data}


class KeyedStateBackend(Protocol):
    """What tasks, contexts and timers use of a keyed-state backend: ``HeapKeyedState`` (Flink's
    ``hashmap``) or ``backends.rocksdb_state.RocksDBKeyedState`` (``rocksdb``)."""

    operator_uid: str
    key_type: TypeInformation | None
    keys: _KeyContext
    key_group_range: tuple[int, int]
    chain: list[int]
    force_full: bool
    event_time: int | None

    @overload
    def handle(self, descriptor: ValueStateDescriptor) -> ValueState: ...

    @overload
    def handle(self, descriptor: ListStateDescriptor) -> ListState: ...

    @overload
    def handle(self, descriptor: MapStateDescriptor) -> MapState: ...

    @overload
    def handle(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState: ...

    def keys_of(self, name: str) -> list[Any]: ...

    def entries(self, name: str) -> list[tuple[Any, Any]]: ...

    def drop_key(self, key: Any) -> None: ...

    def capture(self, epoch: int, incremental: bool = True, full_every: int = 10) -> KeyedCapture: ...

    def restore_rows(self, rows: Iterable[tuple[int, bytes, str, bytes | None]], kinds: dict[str, str]) -> None: ...

    def as_dict(self) -> dict[str, dict[Any, Any]]: ...

    def close(self) -> None: ...

    #: whether ``begin_batch`` does anything (callers skip collecting a batch's keys otherwise)
    prefetches: bool

    def begin_batch(self, keys: list[Any]) -> None: ...

    def end_batch(self) -> None: ...


#: builds one keyed operator subtask's backend: (operator uid, key -> key group, key-group range, key type)
KeyedStateFactory = Callable[[str, Callable[[Any], int], tuple[int, int], "TypeInformation | None"],
                             KeyedStateBackend]


# ---------------------------------------------------------------- operator (non-keyed) state

#: how operator state is redistributed when a job restores at another parallelism (Flink's
#: ``OperatorStateHandle.Mode``): SPLIT deals the entries of all subtasks' lists out evenly,
#: UNION gives every subtask all entries, BROADCAST gives every subtask subtask 0's copy
SPLIT, UNION, BROADCAST = "split", "union", "broadcast"
OPERATOR_STATE_MODES = (SPLIT, UNION, BROADCAST)


class OperatorListState:
    """A list held by one subtask of an operator, not scoped to a key (split or union mode)."""

    __slots__ = ("_items",)

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def get(self) -> list[Any]:
        return self._items

    def add(self, value: Any) -> None:
        self._items.append(value)

    def add_all(self, values: Iterable[Any]) -> None:
        self._items.extend(values)

    def update(self, values: Iterable[Any]) -> None:
        self._items[:] = list(values)

    def clear(self) -> None:
        self._items.clear()


class BroadcastState:
    """A dict every subtask holds the same copy of (the function must keep it identical)."""

    __slots__ = ("_map",)

    def __init__(self, data: dict[Any, Any]) -> None:
        self._map = data

    def get(self, key: Any) -> Any:
        return self._map.get(key)

    def put(self, key: Any, value: Any) -> None:
        self._map[key] = value

    def remove(self, key: Any) -> None:
        self._map.pop(key, None)

    def contains(self, key: Any) -> bool:
        return key in self._map

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list(self._map.items()))

    def keys(self) -> Iterator[Any]:
        return iter(list(self._map.keys()))

    def clear(self) -> None:
        self._map.clear()


class OperatorStateBackend:
    """The operator state of one operator subtask: named lists (split/union) and dicts (broadcast).

    Operator state is meant to be small (offsets, buffers, a rule table): every capture is
    full and travels inline in the manifest, as Flink keeps small state in ``_metadata``.
    """

    def __init__(self, operator_uid: str, subtask: int) -> None:
        self.operator_uid = operator_uid
        self.subtask = subtask
        #: name -> (mode, value): a list for split/union, a dict for broadcast
        self.entries: dict[str, tuple[str, Any]] = {}

    def handle(self, descriptor: StateDescriptor, mode: str) -> OperatorListState | BroadcastState:
        if mode not in OPERATOR_STATE_MODES:
            raise ValueError(
                f"operator {self.operator_uid!r}: operator state mode must be one of {OPERATOR_STATE_MODES}, "
                f"got {mode!r}"
            )
        entry = self.entries.get(descriptor.name)
        if entry is None:
            value: Any = {} if mode == BROADCAST else []
            entry = self.entries[descriptor.name] = (mode, value)
        elif entry[0] != mode:
            raise ValueError(
                f"operator {self.operator_uid!r}: operator state {descriptor.name!r} is declared with mode "
                f"{entry[0]!r} and again with {mode!r}"
            )
        return BroadcastState(entry[1]) if mode == BROADCAST else OperatorListState(entry[1])

    def capture(self) -> tuple[tuple[str, str, bytes], ...]:
        """(name, mode, pickled value) per state; broadcast state only from subtask 0 (all copies are equal)."""
        out = []
        for name, (mode, value) in self.entries.items():
            if mode == BROADCAST and self.subtask != 0:
                continue
            try:
                out.append((name, mode, pickle.dumps(value, _PICKLE)))
            except Exception as exc:
                raise StateSerializationError(
                    f"operator {self.operator_uid!r}, operator state {name!r}: cannot be pickled ({exc})"
                ) from exc
        return tuple(out)

    def restore(self, name: str, mode: str, value: Any) -> None:
        """Install a redistributed value (see ``snapshot.rescale.redistribute``)."""
        if mode not in OPERATOR_STATE_MODES:
            raise ValueError(f"operator {self.operator_uid!r}: unknown operator state mode {mode!r} for {name!r}")
        self.entries[name] = (mode, dict(value) if mode == BROADCAST else list(value))

    def as_dict(self) -> dict[str, Any]:
        return {name: value for name, (_mode, value) in self.entries.items()}
