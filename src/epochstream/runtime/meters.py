"""Per-task IO counters and time shares: Flink's ``numRecordsIn``/``numRecordsOut`` and
``busyTimeMsPerSecond``/``backPressuredTimeMsPerSecond``/``idleTimeMsPerSecond``.

Theory of operation. Counting is plain data in the core: a task counts the rows it took in
(``Task.records_in``, read or received) and its chain the rows it put out (``OutputBuffers``
rows drained into batches for its output channels, plus the rows its sinks took), so a
columnar batch counts its rows, never 1. Timing needs a clock, so the core only does the
arithmetic: ``LoopTimes`` splits the wall time of a driver's loop among the tasks it runs,
with every ``now`` passed in. A worker loop turns in *rounds*; in each round a task is

- **busy** for the time its own ``step`` (and the hand-over of its actions) took,
- **backpressured** for the rest of the round if it could not put out what it wanted to: a
  source the loop throttled (backpressure watermarks) while it still had input, a task with
  output queued on a link that has no credit left; and, when it still had work, for the time
  the loop spent on tasks downstream of it in the same worker (local channels have no credit:
  there the consumer holds the producer back by holding the thread they share),
- **idle** for the rest otherwise (no input, or the loop ran tasks unrelated to it).

The three add up to the wall time, as in Flink, where they are measured per task thread;
here one loop thread runs several tasks, so time a task waits while a co-located task works
is the waiting task's backpressured or idle time, never its busy time.

``WorkerSample`` is what a worker reports (cumulative per task, with its own clock), and
``RunMeters`` is the driver's pure bookkeeping of those reports: totals over the run's
attempts (monotone, as counters must be) and the change over the last ``window`` seconds
of the running attempt, from which ``ui.model.task_metrics`` derives rates and shares.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

#: per task: (records in, records out, busy s, backpressured s, idle s, late records dropped,
#: dead letters), cumulative
TaskCounts = tuple[int, int, float, float, float, int, int]
#: the names of ``TaskCounts``' fields, in order
COUNT_NAMES = ("records_in", "records_out", "busy_seconds", "backpressured_seconds", "idle_seconds",
               "late_records_dropped", "dead_letters")


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """A worker's counters at ``at`` (seconds, the worker's monotonic clock): task key
    (``"chain.subtask"``) -> ``TaskCounts`` since the attempt began."""

    at: float
    tasks: dict[str, TaskCounts]

    def __reduce__(self) -> tuple[Any, ...]:  # pickled on every heartbeat: fields in order, not slot by slot
        return WorkerSample, (self.at, self.tasks)


def task_key(task: tuple[int, int]) -> str:
    """The key a task goes by in metrics, manifests and the dashboard: ``"chain.subtask"``."""
    return f"{task[0]}.{task[1]}"


class LoopTimes:
    """Busy / backpressured / idle seconds per task of one loop (see the module docstring).

    Invariant: for every task, ``busy + backpressured + idle`` == the time from ``start`` to
    the last ``round_end``, up to float rounding (busy is capped at the round's length).
    """

    def __init__(self, tasks: Iterable[Any], now: float, downstream: "dict[Any, frozenset[Any]] | None" = None) -> None:
        """``downstream``: task -> the tasks of the same loop its output channels lead to."""
        self.busy: dict[Any, float] = {t: 0.0 for t in tasks}
        self.downstream = {t: (downstream or {}).get(t, frozenset()) for t in self.busy}
        self.backpressured: dict[Any, float] = dict.fromkeys(self.busy, 0.0)
        self.idle: dict[Any, float] = dict.fromkeys(self.busy, 0.0)
        #: busy seconds of each task in the current round
        self._round: dict[Any, float] = dict.fromkeys(self.busy, 0.0)
        self._began = now

    def worked(self, task: Any, seconds: float) -> None:
        """``task`` was busy for ``seconds`` in this round."""
        self._round[task] += seconds

    def round_end(self, now: float, blocked: "set[Any] | frozenset[Any]",
                  pending: "set[Any] | frozenset[Any]" = frozenset()) -> None:
        """The round that began at the previous ``round_end`` ends at ``now``; tasks in
        ``blocked`` could not put out their output during it, tasks in ``pending`` had work
        left (a source with input, a non-empty mailbox)."""
        length = max(0.0, now - self._began)
        self._began = now
        rnd = self._round
        for task, worked in rnd.items():
            busy = min(worked, length)
            rest = length - busy
            self.busy[task] += busy
            if task in blocked:
                self.backpressured[task] += rest
            elif task in pending:  # held back only while the thread served its consumers
                held = min(rest, sum(rnd[d] for d in self.downstream[task]))
                self.backpressured[task] += held
                self.idle[task] += rest - held
            else:
                self.idle[task] += rest
        for task in rnd:
            rnd[task] = 0.0


class RunMeters:
    """The driver's view of every task's counters over a run (pure: samples come with times).

    ``base`` holds the totals of finished attempts; ``history`` the running attempt's samples
    per worker, the newest last, trimmed to ``window`` seconds (at least two are kept).
    """

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.base: dict[str, list[float]] = {}
        self.history: dict[int, deque[WorkerSample]] = {}

    def sample(self, worker: int, sample: WorkerSample | None) -> None:
        if sample is None:
            return
        hist = self.history.setdefault(worker, deque())
        if hist and sample.at < hist[-1].at:  # never from another attempt: new_attempt clears
            return
        hist.append(sample)
        while len(hist) > 2 and sample.at - hist[1].at >= self.window:
            hist.popleft()

    def new_attempt(self) -> None:
        """The running attempt ended: its last counts join the run's totals."""
        for hist in self.history.values():
            for task, counts in hist[-1].tasks.items():
                acc = self.base.setdefault(task, [0, 0, 0.0, 0.0, 0.0, 0, 0])
                for i, v in enumerate(counts):
                    acc[i] += v
        self.history.clear()

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Task key -> run totals (``records_in``, ``records_out``, ``busy_seconds``, ...) and,
        once a worker reported twice, ``window``: the change over the last ``window`` seconds
        (``seconds`` of its clock and the same seven counts)."""
        names = COUNT_NAMES
        out: dict[str, dict[str, Any]] = {}
        for task, acc in self.base.items():
            out[task] = dict(zip(names, acc, strict=True))
        for hist in self.history.values():
            newest = hist[-1]
            oldest = hist[0]
            for task, counts in newest.tasks.items():
                row = out.setdefault(task, dict.fromkeys(names, 0))
                for name, v in zip(names, counts, strict=True):
                    row[name] += v
                before = oldest.tasks.get(task)
                if before is not None and newest.at > oldest.at:
                    delta = dict(zip(names, (a - b for a, b in zip(counts, before, strict=True)), strict=True))
                    row["window"] = {"seconds": newest.at - oldest.at, **delta}
        return dict(sorted(out.items()))
