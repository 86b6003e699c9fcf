"""Liveness: heartbeats between the job master and its workers, decided without I/O.

A worker that dies closes its control connection, and the driver sees that at once. A
worker that is alive but silent (a SIGSTOPped or swapped-out process, a hung host, a
partitioned network) closes nothing: without heartbeats, the job would wait for the
checkpoint timeout (600 s by default) with no epoch completing and nothing logged.

Theory of operation (Flink's ``heartbeat.interval`` / ``heartbeat.timeout``). Every worker
sends a ``Heartbeat`` on its control connection every ``interval`` seconds from its main
loop. One task step can legitimately take longer than the timeout (a keyed pandas function
over a 65,536-row batch at 10,000 keys, on a loaded machine), so while a step runs longer
than the interval a pulse thread of the worker sends heartbeats that say how long the loop
has been inside it (``busy_for``). A frozen process (SIGSTOP, swapped out, a host cut off)
stops both and goes silent; a user function that never returns keeps pulsing, and is
declared failed once one step has lasted ``step_timeout`` seconds. The driver counts *any*
message from a worker as a sign of life. A worker
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
#: one task step longer than this declares its worker stuck (Flink has no such bound: a task
#: stuck in user code waits for the checkpoint timeout there)
DEFAULT_STEP_TIMEOUT = 120.0


@dataclass(frozen=True)
class HeartbeatConfig:
    """``interval``: seconds between a worker's heartbeats; ``timeout``: seconds of silence
    after which a worker is declared failed (must exceed the interval); ``startup_timeout``:
    seconds a worker may take from its launch to ``Ready`` (restoring its state);
    ``step_timeout``: seconds one task step (a user function's call on a batch) may last
    before its worker is declared failed (stuck)."""

    interval: float = DEFAULT_INTERVAL
    timeout: float = DEFAULT_TIMEOUT
    startup_timeout: float = 120.0
    step_timeout: float = DEFAULT_STEP_TIMEOUT

    def __post_init__(self) -> None:
        if not (self.interval > 0 and self.timeout > 0):
            raise ConfigurationError(f"heartbeat interval and timeout must be positive seconds, got interval "
                                     f"{self.interval!r}, timeout {self.timeout!r}")
        if not self.startup_timeout > 0:
            raise ConfigurationError(
                f"heartbeat startup_timeout must be positive seconds, got {self.startup_timeout!r}")
        if not self.step_timeout > self.interval:
            raise ConfigurationError(f"heartbeat step_timeout ({self.step_timeout!r} s) must be longer than the "
                                     f"heartbeat interval ({self.interval} s)")
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
    #: not silent: its loop has been inside one task step for ``silent_for`` seconds
    stuck: bool = False

    @property
    def reason(self) -> str:
        if self.stuck:
            return (f"worker {self.worker} has been inside one task step for {self.silent_for:.1f} s (heartbeat "
                    f"step timeout {self.timeout:g} s): declared failed (a user function that does not return?)")
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
        #: workers whose loop is inside a long task step: worker -> when the step began
        self.busy_since: dict[int, float] = {}

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

    def busy(self, worker: int, now: float, busy_for: float | None) -> None:
        """A heartbeat from ``worker``: from its loop (``busy_for`` None: the loop turns) or from
        its pulse thread while a step has run ``busy_for`` seconds (measured by the worker, so
        no clocks are compared across machines)."""
        if worker not in self.last_heard:
            return
        if busy_for is None:
            self.busy_since.pop(worker, None)
        else:
            self.busy_since[worker] = min(self.busy_since.get(worker, now), now - busy_for)

    def forget_all(self) -> None:
        """Stop watching (the driver sent ``Stop``: workers leave their loops and go quiet)."""
        self.last_heard.clear()
        self.starting.clear()
        self.busy_since.clear()

    def expired(self, now: float) -> list[WorkerSilent]:
        """Workers silent for at least ``timeout`` seconds (before ``Ready``: ``startup_timeout``
        since their launch), longest silent first."""
        timeout, startup = self.config.timeout, self.config.startup_timeout
        out = [WorkerSilent(w, now - t, timeout) for w, t in self.last_heard.items() if now - t >= timeout]
        out += [WorkerSilent(w, now - t, startup, True) for w, t in self.starting.items() if now - t >= startup]
        step, named = self.config.step_timeout, {s.worker for s in out}
        out += [WorkerSilent(w, now - t, step, stuck=True) for w, t in self.busy_since.items()
                if now - t >= step and w not in named]
        return sorted(out, key=lambda s: -s.silent_for)

    def next_deadline(self) -> float | None:
        """When the next worker would expire if nothing comes from it."""
        due = [t + self.config.timeout for t in self.last_heard.values()]
        due += [t + self.config.startup_timeout for t in self.starting.values()]
        due += [t + self.config.step_timeout for t in self.busy_since.values()]
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
