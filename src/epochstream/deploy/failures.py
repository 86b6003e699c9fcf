"""What can go wrong in a run, on purpose or not, and how the restart loop tells them apart.

``FailureSchedule`` says which failures the simulator and chaos runs inject (worker kills,
crashes of the job master at named *fail points*, failed state writes). ``Failover`` and
``InjectedFailure`` are failures the restart strategy rolls back from; ``JobFailedError`` is
what a run raises once the strategy gives up. Fail points are named protocol moments
(``before_manifest``, ``after_manifest``, ``mid_commit``, ``after_commit``, ``recovery``):
the job master and ``restore.recover`` call a ``FailPoint`` there, and the driver's
``fail_point`` raises when the schedule says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..chaos.kills import KillMoment, KillTarget
from ..chaos.plan import ChaosPlan
from ..chaos.verdict import WRITE_FAILURE, kill_kind
from ..runtime.errors import ConfigurationError, EpochStreamError
from ..snapshot.failpoints import COMMIT_POINTS, FailPointName

if TYPE_CHECKING:
    import random as _random

FailPoint = Callable[[str], None]
"""Called with a fail point's name at that protocol moment; raises to inject a crash."""


class InjectedFailure(Exception):
    """A failure injected on purpose (simulator, chaos); recovered like a real crash."""


class JobFailedError(EpochStreamError):
    """The job failed and the restart strategy gave up; carries the last cause."""


@dataclass
class FailureSchedule:
    """What goes wrong, and when. Occurrence numbers count from 1 over the whole run."""

    kill_times: list[float] = field(default_factory=list)
    #: local and spark drivers (optional, per kill): due also once the run has completed this many
    #: epochs, whichever comes first (chaos draws both from one fraction of a failure-free run)
    kill_epochs: list[int] = field(default_factory=list)
    fail_points: dict[str, set[int]] = field(default_factory=dict)
    write_failures: set[int] = field(default_factory=set)
    #: local and spark drivers, per kill in ``kill_times`` order (missing: "now", "worker"): the
    #: protocol moment the kill waits for (a ``chaos.kills.KillMoment``) and what it kills (a
    #: ``chaos.kills.KillTarget``); the simulator kills at once, a worker
    kill_moments: list[str] = field(default_factory=list)
    kill_targets: list[str] = field(default_factory=list)

    def chaos_plan(self, choose: Callable[[int], int], moment_timeout: float,
                   moments: bool = True) -> ChaosPlan:
        """The plan of this schedule's kills (``chaos.plan``); ``choose`` picks a victim among n
        workers; ``moments`` False: every kill now, of a worker (the simulator's)."""
        try:
            return ChaosPlan(kill_times=self.kill_times, kill_epochs=self.kill_epochs if moments else (),
                             moments=self.kill_moments if moments else (),
                             targets=self.kill_targets if moments else (), choose=choose,
                             moment_timeout=moment_timeout)
        except ValueError as exc:
            raise ConfigurationError(f"FailureSchedule: {exc}") from None

    def requested(self, moments: bool = True) -> list[str]:
        """The kind of every failure asked for (``chaos.verdict``); ``moments`` False: the
        simulator's, whose kills are all of a worker, at once."""
        kinds = []
        for i in range(len(self.kill_times)):
            moment = self.kill_moments[i] if moments and i < len(self.kill_moments) else KillMoment.NOW
            target = self.kill_targets[i] if moments and i < len(self.kill_targets) else KillTarget.WORKER
            kinds.append(kill_kind(target, moment))
        kinds += [f"fail_point/{name}" for name, occurrences in sorted(self.fail_points.items()) for _ in occurrences]
        return kinds + [WRITE_FAILURE] * len(self.write_failures)

    @classmethod
    def random(cls, rng: _random.Random, kills: int, horizon: float, *, start: float = 0.0,
               epochs: int | None = None, captures: int | None = None) -> "FailureSchedule":
        """``kills`` failures, a mix of worker kills in ``[start, horizon)`` virtual seconds,
        job-master crashes at fail points and failed state writes. ``epochs`` and ``captures``
        (a failure-free run's completed epochs and state captures) bound which occurrence of a
        fail point and which capture is drawn, so that each one comes in a run at least as
        long; the ``recovery`` point is drawn only beside another failure (it needs a recovery)."""
        sched = cls()
        points = list(COMMIT_POINTS)
        last_epoch = 4 if epochs is None else max(1, min(4, epochs))
        last_capture = 20 if captures is None else max(1, min(20, captures))
        for _ in range(kills):
            r = rng.random()
            if r < 0.6:
                sched.kill_times.append(rng.uniform(start, horizon))
            elif r < 0.9:
                point = rng.choice(points)
                occurrences = sched.fail_points.setdefault(point, set())
                n = rng.randint(1, last_epoch)
                occurrences.add(1 if point is FailPointName.RECOVERY else n)
            else:
                sched.write_failures.add(rng.randint(1, last_capture))
        if FailPointName.RECOVERY in sched.fail_points and len(sched.requested(moments=False)) == 1:
            sched.fail_points = {FailPointName.BEFORE_MANIFEST: {1}}
        sched.kill_times.sort()
        return sched


class Failover(Exception):
    """A failure the restart strategy handles by rolling back to the latest completed epoch."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def no_fail(point: str) -> None:
    """The ``FailPoint`` of a run without injected crashes."""
    return None
