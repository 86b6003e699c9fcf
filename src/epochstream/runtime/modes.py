"""The snapshot modes a pipeline runs in, and what each one implies.

A mode is named once, by the user (``Pipeline(mode="aligned")``, ``--mode``), and read in many
places: the task builder picks a gate, the workers decide whether markers overtake, the job
master counts markers or trAcker messages, the dashboard picks a view. Each of them reads one
implication of ``SnapshotMode.implies`` instead of comparing mode names, so the table below is
the only place that says which mode does what.

A ``StrEnum``, so a member equals its name (``SnapshotMode.TRACKER == "tracker"``): the API and
the CLI take plain strings, and status documents and manifests carry the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SnapshotMode(StrEnum):
    """How a pipeline's epochs end and are snapshotted."""

    #: barrier alignment (Chandy-Lamport, Flink's aligned checkpoints), the default
    ALIGNED = "aligned"
    #: markers overtake queued records, which are stored as channel state
    UNALIGNED = "unaligned"
    #: no markers in the data: the trAcker's firm bounds end epochs out of band
    TRACKER = "tracker"
    #: markers are not aligned: a channel past its marker is not held back, so a restore may
    #: replay records the snapshot already counted
    AT_LEAST_ONCE = "at-least-once"

    @property
    def implies(self) -> ModeImplications:
        """What this mode means for the gates, links, counters and views."""
        return _IMPLIES[self]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeImplications:
    """What a mode decides, one flag per decision the drivers and tasks make."""

    #: every record is counted in exactly one completed epoch (else at least one)
    exactly_once: bool
    #: epochs end by the trAcker's bounds, not by markers in the data (tasks get a
    #: ``FirmBoundGate``; channel state of an unaligned snapshot cannot be replayed)
    tracks: bool
    #: markers overtake the records queued ahead of them, which become channel state
    overtakes: bool
    #: ``aligned_timeout`` applies: an aligned epoch may switch to unaligned when it waits too long
    times_out_alignment: bool


_IMPLIES = {
    SnapshotMode.ALIGNED: ModeImplications(exactly_once=True, tracks=False, overtakes=False,
                                           times_out_alignment=True),
    SnapshotMode.UNALIGNED: ModeImplications(exactly_once=True, tracks=False, overtakes=True,
                                             times_out_alignment=True),
    SnapshotMode.TRACKER: ModeImplications(exactly_once=True, tracks=True, overtakes=False,
                                           times_out_alignment=False),
    SnapshotMode.AT_LEAST_ONCE: ModeImplications(exactly_once=False, tracks=False, overtakes=False,
                                                 times_out_alignment=False),
}

#: the mode names, sorted (the API's and the CLI's error messages list them)
MODE_NAMES = tuple(sorted(m.value for m in SnapshotMode))


def implications(mode: str) -> ModeImplications:
    """What ``mode`` (a member or its name) implies; ``ValueError`` for an unknown name."""
    return SnapshotMode(mode).implies
