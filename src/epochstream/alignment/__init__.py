"""Barrier (marker) alignment: Carbone's Algorithm 6, exactly-once and at-least-once."""

from .barrier import BarrierAligner

__all__ = ["BarrierAligner"]
