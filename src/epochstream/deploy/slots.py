"""Barrier task slots on a cluster that shrank: saying so, waiting for them, or giving up.

A spark-driver attempt is one barrier stage of ``parallelism`` tasks, and Spark starts it only
when that many task slots exist at once (``DAGScheduler.checkBarrierStageWithNumSlots``). When
a Worker is gone, Spark re-checks every ``spark.scheduler.barrier.maxConcurrentTasksCheck.interval``
and, after ``...maxFailures`` checks, fails the job with its ``[SPARK-24819]`` message. The
driver does not leave the waiting to Spark: it reads the slot count itself and, as the user
configured with ``Pipeline.slot_wait_timeout`` (Flink's ``slot.request.timeout``), waits with
a visible ``WAITING_FOR_SLOTS`` status naming the slots needed and available and Spark's own
message, or fails with ``SlotsUnavailableError`` when the wait is over (at once for 0).

``SlotWait`` is the policy (it is given the clock, so it is tested without Spark); the spark
driver (``deploy.spark``) does the I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..runtime.errors import EpochStreamError

#: Flink's slot.request.timeout default (5 minutes)
DEFAULT_SLOT_WAIT_TIMEOUT = 300.0
#: seconds a shortage is reported without Spark's message before the driver stops waiting for it
SPARK_VERDICT_GRACE = 5.0

_SLOT_MESSAGE = re.compile(r"(\[SPARK-24819\][^\n]*)")


class SlotsUnavailableError(EpochStreamError):
    """The cluster had fewer task slots than the job's parallelism for longer than the
    slot-wait timeout (restarting cannot help: the job ends)."""


def spark_slot_message(text: str) -> str | None:
    """Spark's own message of a barrier job that could not get its slots, if ``text`` (a
    Spark job failure) is one; None otherwise."""
    m = _SLOT_MESSAGE.search(text)
    return m.group(1).strip() if m else None


@dataclass
class SlotWait:
    """One attempt's wait for ``needed`` barrier slots (``timeout`` seconds; 0: fail at once)."""

    needed: int
    timeout: float
    master: str
    #: when the shortage was first seen (None: no shortage seen in this attempt)
    since: float | None = None
    available: int | None = None
    #: Spark's own ``[SPARK-24819]`` message, once a submitted stage failed its slot check
    spark_message: str | None = None
    #: every shortage of the attempt, for the run's record: {since, needed, available, spark_message, seconds}
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def waiting(self) -> bool:
        return self.since is not None

    def observe(self, available: int | None, now: float) -> str | None:
        """A slot count read at ``now``; returns a line to log when the shortage starts or changes."""
        if available is None or available >= self.needed:
            return None
        changed = self.since is None or available != self.available
        if self.since is None:
            self.since = now
        self.available = available
        return self.describe(now) if changed else None

    def spark_failed(self, message: str, now: float) -> str:
        """Spark's slot check gave up with ``message``: the shortage is certain."""
        if self.since is None:
            self.since = now
        self.spark_message = message
        return self.describe(now)

    def slots_back(self, now: float) -> str | None:
        """The slots are there again: end the shortage (a line to log, if there was one)."""
        if self.since is None:
            return None
        seconds = now - self.since
        line = (f"{self.needed} barrier task slots are available again on {self.master} after "
                f"{seconds:.1f}s of waiting")
        self.history.append({"since": self.since, "needed": self.needed, "available": self.available,
                             "spark_message": self.spark_message, "seconds": seconds})
        self.since, self.available, self.spark_message = None, None, None
        return line

    def expired(self, now: float) -> bool:
        """The wait is over: past the timeout, and Spark's message is in (or it was given
        ``SPARK_VERDICT_GRACE`` seconds more to arrive)."""
        if self.since is None:
            return False
        over = now - self.since
        if over < self.timeout:
            return False
        return self.spark_message is not None or over >= self.timeout + SPARK_VERDICT_GRACE

    def describe(self, now: float) -> str:
        available = "an unknown number" if self.available is None else str(self.available)
        text = (f"the barrier stage needs {self.needed} task slots at once, {self.master} has {available} "
                f"(waiting {now - (self.since or now):.1f}s of slot_wait_timeout {self.timeout:g}s)")
        if self.spark_message:
            text += f"; Spark: {self.spark_message}"
        return text

    def error(self, now: float) -> SlotsUnavailableError:
        return SlotsUnavailableError(
            f"{self.describe(now)}; giving up. Start Workers (or free cores) until {self.needed} slots exist, "
            f"lower the parallelism (-p), or wait longer (--slot-wait-timeout, Pipeline.slot_wait_timeout)")

    def status(self, now: float) -> dict[str, Any]:
        """The REST status's ``slots`` field while waiting."""
        return {"needed": self.needed, "available": self.available, "waiting-seconds": now - (self.since or now),
                "timeout": self.timeout, "spark-message": self.spark_message, "message": self.describe(now)}
