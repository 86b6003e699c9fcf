"""Liveness: heartbeats between the job master and its workers, decided without I/O.

A worker that dies closes its control connection, and the driver sees that at once. A
worker that is alive but silent (a SIGSTOPped or swapped-out process, a hung host, a
partitioned network) closes nothing: without heartbeats, the job would wait for the
checkpoint timeout (600 s by default) with no epoch completing and nothing logged.

Theory of operation (Flink's ``heartbeat.interval`` / ``heartbeat.timeout``). Every worker
sends a ``Heartbeat`` on its control connection every ``interval`` seconds from its main
loop, so a loop that stops turning (a frozen process, a user function that never returns)
goes silent too. The driver counts *any* message from a worker as a sign of life. A worker
is watched from its launch until the driver sends ``Stop``; before its ``Ready`` (building
its tasks and restoring state, which may take long for large state) it may stay silent for
``startup_timeout`` seconds instead of ``timeout``. Once nothing has come from it for
``timeout`` seconds, ``HeartbeatMonitor.expired`` names it, and the driver fails the job
over with ``WorkerSilent.reason`` (logs, the REST status and ``JobResult.metrics
["failovers"]`` carry it). A driver that was itself busy (a long sink commit) must not blame
its workers for messages it did not read: before it acts on an expiry it checks the
worker's connection for unread messages and reports them with ``heard`` instead.

Everything here takes ``now`` as an argument (seconds, the driver's monotonic clock) and
holds no clock, thread or socket, like ``attempt.py``; ``cluster.py`` does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.errors import ConfigurationError

#: defaults: a silent worker is declared failed within 10 s (Flink's default is 50 s)
DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class HeartbeatConfig:
    """``interval``: seconds between a worker's heartbeats; ``timeout``: seconds of silence
    after which a worker is declared failed (must exceed the interval); ``startup_timeout``:
    seconds a worker may take from its launch to ``Ready`` (restoring its state)."""

    interval: float = DEFAULT_INTERVAL
    timeout: float = DEFAULT_TIMEOUT
    startup_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not (self.interval > 0 and self.timeout > 0):
            raise ConfigurationError(f"heartbeat interval and timeout must be positive seconds, got interval "
                                     f"{self.interval!r}, timeout {self.timeout!r}")
        if not self.startup_timeout > 0:
            raise ConfigurationError(
                f"heartbeat startup_timeout must be positive seconds, got {self.startup_timeout!r}")
        if self.timeout <= self.interval:
            raise ConfigurationError(f"heartbeat timeout ({self.timeout} s) must be longer than the heartbeat "
                                     f"interval ({self.interval} s), or every worker would be declared failed")


@dataclass(frozen=True, slots=True)
class WorkerSilent:
    """Decision: ``worker`` has sent nothing for ``silent_for`` seconds, past ``timeout``."""

    worker: int
    silent_for: float
    timeout: float
    #: it never reported ``Ready`` (silent since its launch)
    starting: bool = False

    @property
    def reason(self) -> str:
        if self.starting:
            return (f"worker {self.worker} was not ready {self.silent_for:.1f} s after its launch (heartbeat "
                    f"startup timeout {self.timeout:g} s): declared failed (stopped, hung or cut off)")
        return (f"worker {self.worker} sent no heartbeat for {self.silent_for:.1f} s (heartbeat timeout "
                f"{self.timeout:g} s): declared failed (stopped, hung or cut off)")


class HeartbeatMonitor:
    """The job master's view of its workers' liveness, for one attempt."""

    def __init__(self, config: HeartbeatConfig) -> None:
        self.config = config
        #: worker -> when the driver last heard from it (invariant: only watched workers)
        self.last_heard: dict[int, float] = {}
        #: workers launched that have not reported ``Ready`` yet: worker -> launch time
        self.starting: dict[int, float] = {}

    def launched(self, worker: int, now: float) -> None:
        """``worker`` was started: it has ``startup_timeout`` seconds to report ``Ready``."""
        self.starting[worker] = now

    def watch(self, worker: int, now: float) -> None:
        """Start watching ``worker`` with the heartbeat timeout (its ``Ready`` arrived)."""
        self.starting.pop(worker, None)
        self.last_heard[worker] = now

    def heard(self, worker: int, now: float) -> None:
        """Any message from ``worker``: it is alive."""
        if worker in self.last_heard:
            self.last_heard[worker] = max(self.last_heard[worker], now)

    def forget_all(self) -> None:
        """Stop watching (the driver sent ``Stop``: workers leave their loops and go quiet)."""
        self.last_heard.clear()
        self.starting.clear()

    def expired(self, now: float) -> list[WorkerSilent]:
        """Workers silent for at least ``timeout`` seconds (before ``Ready``: ``startup_timeout``
        since their launch), longest silent first."""
        timeout, startup = self.config.timeout, self.config.startup_timeout
        out = [WorkerSilent(w, now - t, timeout) for w, t in self.last_heard.items() if now - t >= timeout]
        out += [WorkerSilent(w, now - t, startup, True) for w, t in self.starting.items() if now - t >= startup]
        return sorted(out, key=lambda s: -s.silent_for)

    def next_deadline(self) -> float | None:
        """When the next worker would expire if nothing comes from it."""
        due = [t + self.config.timeout for t in self.last_heard.values()]
        due += [t + self.config.startup_timeout for t in self.starting.values()]
        return min(due) if due else None


class HeartbeatSender:
    """A worker's side: whether a heartbeat is due at ``now``."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self.last_sent = now

    def due(self, now: float) -> bool:
        if now - self.last_sent >= self.interval:
            self.last_sent = now
            return True
        return False
