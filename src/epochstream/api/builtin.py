"""Built-in keyed functions behind KeyedStream conveniences."""

from __future__ import annotations

from typing import Any, Callable

from ..runtime.state import ValueStateDescriptor
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
