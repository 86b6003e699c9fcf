"""What a chaos kill hits, the protocol moment it waits for, and the actions a plan returns.

The enums are ``StrEnum``: a member equals its name's string, so a ``FailureSchedule`` of
plain strings, the CLI's choices and the JSON kill log all read the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class KillTarget(StrEnum):
    """What a kill hits."""

    #: the worker's (Python) process
    WORKER = "worker"
    #: the Spark executor JVM the worker runs in
    EXECUTOR = "executor"
    #: the executor JVM and the standalone Worker that started it: a lost machine
    MACHINE = "machine"
    #: SIGSTOP of the worker's process: alive but silent until heartbeats time out
    FREEZE = "freeze"

    @property
    def driver_kills_now(self) -> bool:
        """The driver kills these itself, at once: they wait for no protocol moment."""
        return self in (KillTarget.FREEZE, KillTarget.MACHINE)


class KillMoment(StrEnum):
    """The protocol moment a kill waits for."""

    #: at once
    NOW = "now"
    #: a worker's task is aligning markers
    ALIGNMENT = "alignment"
    #: a worker is writing a snapshot
    SNAPSHOT_WRITE = "snapshot_write"
    #: a completed epoch reached the worker, before its sinks commit it
    SINK_COMMIT = "sink_commit"
    #: the driver's own: in the middle of the job master's commit (its ``mid_commit`` fail point)
    COMMIT = "commit"

    @property
    def in_worker(self) -> bool:
        """The worker itself dies at this moment (``protocol.Die``); ``commit`` is the driver's."""
        return self is not KillMoment.COMMIT

    @property
    def comes_with_final_epoch(self) -> bool:
        """A final epoch commits too: a kill waiting for a commit may wait for it."""
        return self in (KillMoment.COMMIT, KillMoment.SINK_COMMIT)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmKill:
    """Kill ``worker`` when ``moment`` comes: the worker is told (``protocol.Die``), or for
    ``commit`` the driver kills at its next commit. The kill log gets its entry now."""

    at: float
    worker: int
    target: KillTarget
    moment: KillMoment


@dataclass(frozen=True, kw_only=True, slots=True)
class Kill:
    """Kill ``worker`` now. ``armed``: the kill was logged when it was armed, and ``moment``
    is that entry's moment as it now reads (``alignment/timeout``, ``sink_commit/final``)."""

    at: float
    worker: int
    target: KillTarget
    moment: str
    armed: bool


KillAction = ArmKill | Kill
