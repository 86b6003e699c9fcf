"""Barrier (marker) alignment: Carbone's Algorithm 6, exactly-once and at-least-once, and
unaligned snapshots (markers overtake queued records, which become channel state)."""

from .barrier import BarrierAligner
from .unaligned import UnalignedGate

__all__ = ["BarrierAligner", "UnalignedGate"]
