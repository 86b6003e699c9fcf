"""Event time of one task: the label of its buffered output and, in the aligned modes, its
input watermark.

Theory of operation. Records carry event time as coarse *labels*, ``floor(ts / slack)``.
A task's output is buffered under one label (``out_time``) and flushed whenever the label
changes, so a batch never spans two labels. In the aligned modes time travels as
punctuation: each input channel brings increasing ``Watermark(t)``s, and the task's
watermark is their minimum (Flink's rule): when that minimum grows, the task fires its
timers up to it and forwards it. In trAcker mode labels ride on the batches instead and the
agent's ``WindowEnd`` says when a label is complete, so only ``out_time`` and the log are
used.

Sans-IO and pure: this object only does the arithmetic; the task flushes, fires and
forwards.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .errors import ProtocolError

#: entries a task keeps in ``time_log`` (a bound on memory in long jobs; a benchmark that reads
#: every label of a long run raises it before the run builds its tasks)
TIME_LOG_LENGTH = 4096


class EventClock:
    """Watermark arithmetic and the output label of one task."""

    __slots__ = ("slack", "out_time", "_channel_wm", "watermark", "time_log", "_replayed")

    def __init__(self, slack: float | None, channels: Iterable[int]) -> None:
        #: seconds per time label (None: the pipeline has no event time)
        self.slack = slack
        #: time label of the output being buffered (0 while event time is off)
        self.out_time = 0
        #: aligned modes: newest watermark per input channel (-1: none yet); each only grows
        self._channel_wm: dict[int, int] = {c: -1 for c in channels}
        #: minimum of the channel watermarks once it last grew; only grows
        self.watermark = -1
        #: newest entries (label, now): a source promised the label, or the task fired timers
        #: up to it (window latency = fire time - promise time; benchmarks/paper/window_latency.py)
        self.time_log: deque[tuple[int, float]] = deque(maxlen=TIME_LOG_LENGTH)
        #: channels whose watermark came from restored channel state (unaligned mode): the
        #: restored sender may announce that watermark again (it was sent before the cut, and
        #: a source recomputes its bound from the records after it), so one that does not grow
        #: is a repeat, not an error, until the channel's watermark grows past it
        self._replayed: set[int] = set()

    def on_watermark(self, channel: int, label: int) -> int | None:
        """``Watermark(label)`` was taken from ``channel``: the task's new watermark if it grew.

        >>> c = EventClock(1.0, [0, 1])
        >>> c.on_watermark(0, 5) is None, c.on_watermark(1, 3), c.on_watermark(1, 9)
        (True, 3, 5)
        """
        if label <= self._channel_wm[channel]:
            if channel in self._replayed:
                return None
            raise ProtocolError("EventClock", f"watermark {self._channel_wm[channel]} on channel {channel}",
                                f"Watermark({label})", "watermarks must increase per channel")
        self._channel_wm[channel] = label
        self._replayed.discard(channel)
        low = min(self._channel_wm.values())
        if low <= self.watermark:
            return None
        self.watermark = low
        return low

    def replayed(self, channel: int, label: int) -> int | None:
        """``Watermark(label)`` of ``channel`` replayed from restored channel state: taken like
        any other, and its sender may send it again once (``on_watermark``)."""
        low = self.on_watermark(channel, label)
        self._replayed.add(channel)
        return low
