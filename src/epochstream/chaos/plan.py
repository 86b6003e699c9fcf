"""``ChaosPlan``: which kill comes next, given the run's progress and the time.

The plan holds the schedule (kill times in run seconds, and optionally a count of completed
epochs that makes a kill due as well, whichever comes first; a moment and a target per kill)
and where the run is in it; the driver tells it of attempts, of the final epoch being asked,
of the job master's commit, and asks it each loop step for actions (``chaos.kills``) that it
carries out with signals. Nothing here reads a clock or draws a random number: the victim
is chosen by the ``choose`` the driver passes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .kills import ArmKill, Kill, KillAction, KillMoment, KillTarget


@dataclass(frozen=True, kw_only=True, slots=True)
class _Armed:
    at: float
    worker: int
    target: KillTarget
    moment: KillMoment


class ChaosPlan:
    """The kills of one run: at most one per attempt, so every kill causes its own failover.

    A kill waiting for a protocol moment that has not come within ``moment_timeout`` seconds
    is carried out at once (logged as ``<moment>/timeout``), and so is one still waiting when
    the attempt asks for its final epoch (``<moment>/final``): its moment may not come again
    (a final epoch need not hold any channel), and a kill counted as injected must happen. A
    ``commit`` or ``sink_commit`` kill waits: the final epoch commits too. A kill still due when
    the job has ended did not land, and a chaos run reports it (``chaos.verdict``).

    >>> plan = ChaosPlan(kill_times=[1.0], moments=["alignment"], choose=lambda n: n - 1)
    >>> plan.step(0.5, workers=2, final=False)
    []
    >>> plan.step(1.2, workers=2, final=False)
    [ArmKill(at=1.2, worker=1, target=<KillTarget.WORKER: 'worker'>, moment=<KillMoment.ALIGNMENT: 'alignment'>)]
    >>> [k.moment for k in plan.step(4.3, workers=2, final=False)], plan.done
    (['alignment/timeout'], 1)
    >>> by_epochs = ChaosPlan(kill_times=[9.0], kill_epochs=[3], choose=lambda n: 0)
    >>> by_epochs.step(0.5, workers=2, final=False, completed=2)
    []
    >>> [k.at for k in by_epochs.step(0.6, workers=2, final=False, completed=3)]
    [0.6]
    """

    def __init__(self, *, kill_times: Sequence[float], kill_epochs: Sequence[int] = (), moments: Sequence[str] = (),
                 targets: Sequence[str] = (), choose: Callable[[int], int], moment_timeout: float = 3.0) -> None:
        #: per kill, in time order: when (run seconds), the moment it waits for, what it hits
        self.times = list(kill_times)
        #: per kill (optional): due also once the run has completed this many epochs, so that a run
        #: faster than the one its times were drawn from still takes its kills mid-run
        self.epochs = list(kill_epochs)
        if len(self.epochs) > len(self.times) or self.epochs != sorted(self.epochs):
            raise ValueError(f"kill_epochs {self.epochs} must be in order, at most one per kill time")
        self.moments = [KillMoment(m) for m in moments]
        self.targets = [KillTarget(t) for t in targets]
        #: picks the victim among the attempt's n workers (the driver's seeded generator)
        self.choose = choose
        self.moment_timeout = moment_timeout
        #: kills carried out or armed so far (each counts as injected; the index of the next)
        self.done = 0
        self._attempt_killed = False
        self._armed: _Armed | None = None
        #: an armed ``commit`` kill, until the job master's next commit
        self._at_commit: _Armed | None = None

    def new_attempt(self) -> None:
        """An attempt begins: it may take the next kill; what the last one armed is gone."""
        self._attempt_killed = False
        self._armed = None
        self._at_commit = None

    def next_due(self) -> float | None:
        """When the next kill is due (run seconds; None: none is left)."""
        return self.times[self.done] if self.done < len(self.times) else None

    def due(self, now: float, completed: int) -> bool:
        """The next kill is due: its time has come, or the run has completed its epochs."""
        i = self.done
        if i >= len(self.times):
            return False
        return now >= self.times[i] or (i < len(self.epochs) and completed >= self.epochs[i])

    def step(self, now: float, *, workers: int, final: bool, completed: int = 0) -> list[KillAction]:
        """The actions due at ``now`` (run seconds) in an attempt of ``workers`` workers;
        ``final``: the attempt has asked for its final epoch and it has not finished;
        ``completed``: epochs the run has completed."""
        armed = self._armed
        if armed is not None:
            final = final and not armed.moment.comes_with_final_epoch
            if final or now - armed.at >= self.moment_timeout:
                self._armed = self._at_commit = None
                late = "final" if final else "timeout"
                return [Kill(at=now, worker=armed.worker, target=armed.target, moment=f"{armed.moment}/{late}",
                             armed=True)]
            return []
        i = self.done
        if self._attempt_killed or not self.due(now, completed):
            return []
        self.done += 1
        self._attempt_killed = True
        moment = self.moments[i] if i < len(self.moments) else KillMoment.NOW
        target = self.targets[i] if i < len(self.targets) else KillTarget.WORKER
        victim = self.choose(workers)
        if moment is KillMoment.NOW or target.driver_kills_now:
            return [Kill(at=now, worker=victim, target=target, moment=KillMoment.NOW, armed=False)]
        self._armed = _Armed(at=now, worker=victim, target=target, moment=moment)
        if moment is KillMoment.COMMIT:
            self._at_commit = self._armed
        return [ArmKill(at=now, worker=victim, target=target, moment=moment)]

    def at_commit(self, now: float) -> Kill | None:
        """The job master is in the middle of a commit: the armed ``commit`` kill, if any."""
        armed = self._at_commit
        if armed is None:
            return None
        self._armed = self._at_commit = None
        return Kill(at=now, worker=armed.worker, target=armed.target, moment=armed.moment, armed=True)
