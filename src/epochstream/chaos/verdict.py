"""Did the chaos run's failures happen? A chaos run whose failures did not land proves nothing.

``judge`` compares what a run was asked to inject with what it injected and what failed over.
A failure is named by its *kind*: ``<target>/<moment>`` for a kill (``worker/alignment``),
``fail_point/<name>`` for a crash of the job master, ``write_failure`` for a failed state
write. A kill or a crash is *due* a failover; a failed state write is not (a pipeline may
tolerate it by declining the epoch). The verdict fails, naming what is missing, when fewer
failures of a kind landed than were requested, or when fewer failovers followed than the
landed kills and crashes were due.

>>> v = judge(["worker/now", "worker/now", "fail_point/mid_commit"], ["worker/now"], failovers=1)
>>> v.ok, v.problems
(False, ('1 of 1 fail_point/mid_commit failures did not land', '1 of 2 worker/now failures did not land'))
>>> judge(["worker/alignment"], ["worker/alignment/timeout"], failovers=1).ok
True
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

#: the kind of a failed state write; it is due no failover
WRITE_FAILURE = "write_failure"


def kill_kind(target: str, moment: str) -> str:
    """The kind of a kill: what it hits and the protocol moment it waited for."""
    return f"{target}/{moment}"


def base_kind(kind: str) -> str:
    """A landed kill's kind without how it came (``worker/alignment/timeout`` -> ``worker/alignment``)."""
    parts = kind.split("/")
    return "/".join(parts[:2])


@dataclass(frozen=True, slots=True)
class KindCount:
    """One kind of failure: requested, and landed in the run."""

    kind: str
    requested: int
    landed: int

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "requested": self.requested, "landed": self.landed}


@dataclass(frozen=True, slots=True)
class ChaosVerdict:
    """What was asked and what happened; ``ok`` only if every requested failure landed and failed over."""

    kinds: tuple[KindCount, ...]
    #: failures that landed and are due a failover (kills and job-master crashes)
    due_failovers: int
    failovers: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def requested(self) -> int:
        return sum(k.requested for k in self.kinds)

    @property
    def landed(self) -> int:
        return sum(k.landed for k in self.kinds)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "requested": self.requested, "landed": self.landed,
                "due_failovers": self.due_failovers, "failovers": self.failovers,
                "kinds": [k.as_dict() for k in self.kinds], "problems": list(self.problems)}


def judge(requested: Sequence[str], landed: Sequence[str], *, failovers: int) -> ChaosVerdict:
    """The verdict on a run asked for ``requested`` failures (kinds) in which ``landed`` were
    injected (kinds, a kill's possibly with ``/timeout`` or ``/final``) and ``failovers`` happened.
    A failure that landed without having been requested (a later attempt's) counts as landed."""
    asked = Counter(requested)
    got = Counter(base_kind(k) for k in landed)
    kinds = tuple(KindCount(kind, asked[kind], got[kind]) for kind in sorted(asked.keys() | got.keys()))
    problems = [f"{k.requested - k.landed} of {k.requested} {k.kind} failures did not land"
                for k in kinds if k.landed < k.requested]
    due = sum(k.landed for k in kinds if k.kind != WRITE_FAILURE)
    if failovers < due:
        problems.append(f"{due} kills and crashes landed but only {failovers} failovers followed")
    return ChaosVerdict(kinds, due, failovers, tuple(problems))
