"""Built-in keyed functions behind KeyedStream conveniences."""

from __future__ import annotations

import math
from typing import Any, Callable

from ..runtime.state import MapStateDescriptor, ValueStateDescriptor
from .functions import KeyedProcessFunction


class ReduceFunction(KeyedProcessFunction):
    """Running ``fn(acc, value)`` per key; emits the new accumulator for every record."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def open(self, ctx) -> None:
        self.acc = ctx.state(ValueStateDescriptor("reduce"))

    def process(self, value, ctx):
        cur = self.acc.value()
        new = value if cur is None else self.fn(cur, value)
        self.acc.update(new)
        return (new,)


class TumblingEventTimeWindows:
    """Fixed-size, non-overlapping event-time windows ``[k * size, (k + 1) * size)``.

    ``timestamp`` reads a record's event time (the same function the source was given,
    unless a map moved it). Make ``size`` a multiple of ``TrackerConfig.time_slack`` so
    window ends fall on time-label boundaries and close without an extra label of delay.
    """

    def __init__(self, size: float, timestamp: Callable[[Any], float]) -> None:
        if not size > 0:
            raise ValueError(f"window size must be > 0, got {size}")
        self.size = size
        self.timestamp = timestamp

    @classmethod
    def of(cls, size: float, timestamp: Callable[[Any], float]) -> "TumblingEventTimeWindows":
        return cls(size, timestamp)

    def start_of(self, ts: float) -> float:
        return math.floor(ts / self.size) * self.size


class WindowAggregateFunction(KeyedProcessFunction):
    """Per key and window: ``add(acc, value)`` from ``create()``; when event time passes the
    window's end, emit ``(key, window_start, window_end, result(acc))`` and forget the window.

    Records older than the watermark (only possible if a map moved timestamps back) are
    late: dropped and counted in ``late_records``, as Flink drops them by default.
    """

    uses_event_time = True

    def __init__(self, windows: TumblingEventTimeWindows, create: Callable[[], Any],
                 add: Callable[[Any, Any], Any], result: Callable[[Any], Any] = lambda acc: acc) -> None:
        self.windows = windows
        self.create, self.add, self.result = create, add, result
        self.late_records = 0

    def open(self, ctx) -> None:
        self.acc = ctx.state(MapStateDescriptor("windows"))
        self.timers = ctx.timer_service()

    def process(self, value, ctx):
        ts = self.windows.timestamp(value)
        start = self.windows.start_of(ts)
        end = start + self.windows.size
        if ts < self.timers.current_watermark():
            self.late_records += 1
            return None
        acc = self.acc.get(start)
        if acc is None:
            acc = self.create()
            # Flink's window timer: window.maxTimestamp(), the last instant inside the window
            self.timers.register_event_time_timer(math.nextafter(end, -math.inf))
        self.acc.put(start, self.add(acc, value))
        return None

    def on_timer(self, timestamp, ctx):
        start = self.windows.start_of(timestamp)
        acc = self.acc.get(start)
        if acc is None:
            return None
        self.acc.remove(start)
        return ((ctx.key, start, start + self.windows.size, self.result(acc)),)
