"""The batching policy: how many rows a source reads at once and how long output may wait.

Flink's network buffers leave a task when they are full or when the *buffer timeout* passes;
Spark hands a stateful function a whole micro-batch. ``BatchPolicy`` is both knobs in one:

* ``rows``: a source reads up to ``rows`` records per read, and an output channel whose
  buffer holds ``rows`` rows is sent at the end of the step that filled it;
* ``linger``: seconds a buffered row may wait for more before its channel is sent anyway.
  ``0`` (the default) sends every buffer at the end of every step, which is what tasks did
  before the policy existed: lowest latency, batches as large as one step makes them.

An epoch bound, a change of time label, a watermark and a source running dry still send
everything at once (``Task._flush``), so a batch never spans two epochs or two time labels,
and the linger adds at most ``linger`` seconds per exchange to an epoch's trigger-to-commit
time. Pure: the task passes its clock in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: rows per read and per output batch when the pipeline does not say (the former ``batch_size``)
DEFAULT_BATCH_ROWS = 1024


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """``rows`` per read and per full output buffer; ``linger`` seconds a buffered row may wait."""

    rows: int = DEFAULT_BATCH_ROWS
    linger: float = 0.0

    def __post_init__(self) -> None:
        check_batching(self.rows, self.linger)


def check_batching(rows: object, linger: object) -> None:
    """Raise ``ValueError``/``TypeError`` naming the knob for a batch size or linger out of range."""
    if isinstance(rows, bool) or not isinstance(rows, int):
        raise TypeError(f"batch_rows must be an int, got {rows!r}")
    if rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {rows}")
    if isinstance(linger, bool) or not isinstance(linger, (int, float)):
        raise TypeError(f"batch_linger must be seconds (a number), got {linger!r}")
    if not (math.isfinite(linger) and linger >= 0):
        raise ValueError(f"batch_linger must be >= 0 seconds and finite, got {linger}")
