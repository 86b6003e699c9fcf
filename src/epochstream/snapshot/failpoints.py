"""The named moments of an epoch's commit and recovery where a test may crash the job master.

A chaos run or a test's ``FailureSchedule.fail_points`` names these moments; the job master,
``deploy.restore.recover`` and the Delta state backend call their ``FailPoint`` with them.
A ``StrEnum``, so a schedule written with plain strings (``{"mid_commit": {3}}``) matches.
"""

from __future__ import annotations

from enum import StrEnum


class FailPointName(StrEnum):
    """Where a crash may be injected, in the order an epoch reaches them."""

    #: the epoch completed, its manifest not yet written
    BEFORE_MANIFEST = "before_manifest"
    #: the manifest is written, nothing of it committed
    AFTER_MANIFEST = "after_manifest"
    #: between two commits of the same epoch (Delta state tables, sinks)
    MID_COMMIT = "mid_commit"
    #: every sink committed the epoch
    AFTER_COMMIT = "after_commit"
    #: a restart is recovering the restored epoch's state and sinks
    RECOVERY = "recovery"
    #: Delta state: a table's changelog is due for compaction, nothing folded yet
    BEFORE_COMPACTION = "before_compaction"
    #: Delta state: the folded file is written, not committed
    COMPACTION = "compaction"


#: the fail points of every storage (the compaction ones are the Delta state backend's only)
COMMIT_POINTS = (FailPointName.BEFORE_MANIFEST, FailPointName.AFTER_MANIFEST, FailPointName.MID_COMMIT,
                 FailPointName.AFTER_COMMIT, FailPointName.RECOVERY)
