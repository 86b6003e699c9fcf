"""Event-time timers of one keyed operator subtask, kept in its keyed state.

Why in keyed state: a timer belongs to a key, so it must move with the key's key group on
rescaling and come back with the key's state after a failure (Flink keeps timers in the
state backend for the same reason). The table ``__timers__`` maps a key to
``{timestamp: kind}``; an in-memory heap indexes it for firing and is rebuilt from the
table after a restore. Heap entries whose timer was deleted are skipped when popped.

Event time comes from the trAcker (paper 000 §4.2): a ``WindowEnd`` for label t says every
record with a timestamp below ``(t + 1) * slack`` has been processed here, so a timer for
timestamp T fires once ``T < watermark``, Flink's rule "no more records with timestamp
<= T". Records with later timestamps may already have been processed (a soft bound), so
``on_timer(T)`` must not depend on records after T, as in Flink.

Two kinds: ``user`` timers call the function's ``on_timer``; ``expire`` timers drop every
piece of state of their key (distributed garbage collection: the key can receive no more
records, so its state is dead).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from .state import KeyedStateBackend, MapStateDescriptor

TIMERS = "__timers__"
USER = "user"
EXPIRE = "expire"


class TimerService:
    """PyFlink's ``TimerService`` for event time, plus key expiry."""

    __slots__ = ("_state", "_keys", "_timers", "_heap", "_seq", "watermark", "expired_keys", "enabled")

    def __init__(self, state: KeyedStateBackend, enabled: bool = True) -> None:
        self._state = state
        if state.event_time is None:  # an operator with event time: no label is complete yet
            state.event_time = -1
        self._keys = state.keys
        self._timers = state.handle(MapStateDescriptor(TIMERS))
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        #: every record with a timestamp below it has been processed (-inf: nothing known)
        self.watermark = float("-inf")
        #: keys whose state an expiry timer dropped (metric)
        self.expired_keys = 0
        #: False where no WindowEnd will ever come (the operator declared no event-time use)
        self.enabled = enabled

    # ------------------------------------------------------------ PyFlink's names
    def current_watermark(self) -> float:
        return self.watermark

    def register_event_time_timer(self, timestamp: float) -> None:
        """Call ``on_timer(timestamp, ctx)`` for the current key once event time passes it."""
        self._register(timestamp, USER)

    def delete_event_time_timer(self, timestamp: float) -> None:
        timers = self._timers
        if timers.contains(timestamp) and timers.get(timestamp) == USER:
            timers.remove(timestamp)

    def expire_key_at(self, timestamp: float) -> None:
        """The current key receives no record with a timestamp > ``timestamp``: drop all of
        its state in this operator once event time passes it."""
        self._register(timestamp, EXPIRE)

    # ------------------------------------------------------------ runtime side
    def rebuild(self) -> None:
        """Index the timers restored into the state table."""
        self._heap = [(ts, next(self._seq), key) for key, entries in self._state.entries(TIMERS) for ts in entries]
        heapq.heapify(self._heap)

    def advance(self, label: int, watermark: float, on_timer: Callable[[float], None]) -> None:
        """Time label ``label`` (watermark ``watermark``) is complete: fire every timer below
        the watermark in timestamp order."""
        self._state.event_time = label
        if watermark <= self.watermark:
            return
        self.watermark = watermark
        heap, keys, timers = self._heap, self._keys, self._timers
        while heap and heap[0][0] < watermark:
            ts, _seq, key = heapq.heappop(heap)
            keys.key = key
            if not timers.contains(ts):
                continue  # deleted, or fired through a duplicate entry
            kind = timers.get(ts)
            self._timers.remove(ts)
            if kind == EXPIRE:
                self._drop_key(key)
            else:
                on_timer(ts)

    def advance_keys(self, label: int, watermark: float, watermark_of: Callable[[Any], float], ceiling: float,
                     on_timer: Callable[[float], None]) -> None:
        """Fire each key's timers below that key's own watermark (``watermark_of(key)``, at most
        ``ceiling``); everywhere, event time is complete up to ``label`` (``watermark``). The
        oracle's reference replays subtasks whose snapshots saw different event times
        (unaligned mode) this way."""
        self._state.event_time = label
        floor = max(self.watermark, watermark)
        heap, keys, timers = self._heap, self._keys, self._timers
        held: list[tuple[float, int, Any]] = []
        while heap and heap[0][0] < ceiling:
            entry = heapq.heappop(heap)
            ts, _seq, key = entry
            own = watermark_of(key)
            if ts >= own:
                held.append(entry)  # this key's subtask had not reached ``ts`` yet
                continue
            keys.key = key
            if not timers.contains(ts):
                continue
            kind = timers.get(ts)
            self._timers.remove(ts)
            if kind == EXPIRE:
                self._drop_key(key)
            else:
                self.watermark = max(floor, own)  # what the key's subtask saw when it fired
                on_timer(ts)
        self.watermark = floor
        for entry in held:
            heapq.heappush(heap, entry)

    def advances(self, watermark: float) -> bool:
        """Whether ``advance`` to ``watermark`` moves event time (and so may fire timers,
        including ones that input not yet processed would register)."""
        return watermark > self.watermark

    def _register(self, timestamp: float, kind: str) -> None:
        if not self.enabled:
            raise RuntimeError(
                "event-time timers need an operator that declares event-time use: define on_timer() or set "
                "uses_event_time = True on the function, and run the pipeline with mode='tracker'"
            )
        timers = self._timers
        if timers.get(timestamp) == USER and kind == EXPIRE:
            return  # an expiry never hides a user timer at the same instant
        timers.put(timestamp, kind)
        heapq.heappush(self._heap, (timestamp, next(self._seq), self._keys.key))

    def _drop_key(self, key: Any) -> None:
        self._state.drop_key(key)
        self.expired_keys += 1
