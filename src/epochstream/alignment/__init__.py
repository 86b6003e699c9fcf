"""Barrier (marker) alignment: Carbone's Algorithm 6, exactly-once and at-least-once, and
unaligned snapshots (markers overtake queued records, which become channel state), and the
overtaking step at a sender's link queue."""

from .barrier import BarrierAligner
from .overtaking import overtake
from .unaligned import UnalignedGate

__all__ = ["BarrierAligner", "UnalignedGate", "overtake"]
