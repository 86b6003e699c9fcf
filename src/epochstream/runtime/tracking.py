"""What a task needs to take part in trAcker mode (kept apart so tasks stay mode-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TaskTracking:
    """The worker's local tracker, this task's segment, where each output channel leads,
    and the task's batch-id generator."""

    tracker: Any
    segment: int
    out_segment: dict[int, int]
    ids: Any
    #: event time: seconds per coarse time label (None: the pipeline has no event time)
    slack: float | None = None
