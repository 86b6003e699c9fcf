"""The run around the attempts: failure injection, run bookkeeping and the restart loop.

``Driver`` is the base of every driver (sim, local, spark). ``run`` prepares the restore
(``restore.find_restore``, ``check_compatible``, ``resolve_sources``), then runs attempts
under the pipeline's restart strategy (``deploy.restart``; tenacity drives the loop): each
attempt first ``recover``s storage and sinks to the checkpoint it starts from, then runs the
job until it finishes or fails; a retryable failure rolls back to the latest completed
checkpoint. A subclass supplies ``attempt``, ``clock`` and ``pause``; the per-attempt policy
they share lives in ``attempt.AttemptController``, which ``new_attempt`` builds.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import tenacity

from ..backends import location
from ..runtime.errors import ConfigurationError, EpochStreamError
from ..runtime.modes import implications
from ..snapshot.manifest import CheckpointError
from ..tracker.traffic import ServiceTraffic
from .attempt import AttemptController
from .control import SavepointRequest
from .failures import Failover, FailureSchedule, InjectedFailure, JobFailedError
from .lease import FencedError, Lease, check_fence
from .master import JobMaster
from .persist import SinkStagingError
from .restore import Restored, check_compatible, find_restore, recover, resolve_sources
from .result import RunRecord
from .slots import SlotsUnavailableError
from .tracking import make_tracking, uses_event_time

log = logging.getLogger("epochstream")


def _retryable(exc: BaseException) -> bool:
    """Failures a restart can cure; a damaged checkpoint or an impossible set-up cannot."""
    if isinstance(exc, (CheckpointError, ConfigurationError, FencedError, SlotsUnavailableError)):
        return False
    return isinstance(exc, (Failover, InjectedFailure, SinkStagingError, EpochStreamError))


class Driver:
    """What every driver shares: failure injection, run bookkeeping, the restart strategy.

    A subclass supplies ``attempt`` (run the job once from ``restored`` until it finishes or
    raises), ``clock`` (seconds since the run began, real or virtual) and ``pause`` (wait
    the restart delay).
    """

    def __init__(self, pipeline, storage, failures: FailureSchedule | None, parallelism: int | None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False, *, job_id: str | None = None,
                 lease: Lease | None = None, allow_sources_from_start: bool = False) -> None:
        self.pipeline = pipeline
        self.plan = pipeline.plan(parallelism)
        if self.plan.loops and uses_event_time(pipeline):
            # a loop's entry would wait for a watermark (or time bound) from its own loop head
            raise ConfigurationError(
                f"event time (a source with timestamps) is not supported in a pipeline with loops "
                f"{[lp.uid for lp in self.plan.loops]}: time cannot progress round a cycle yet"
            )
        self.storage = storage
        #: Flink-style 32-hex job id: the lease holder's (``run_pipeline`` chooses it), or new
        #: for a driver built directly (never from a seeded generator)
        self.job_id = job_id or secrets.token_hex(16)
        #: the run's lease on its checkpoint folder (``run_pipeline`` takes it); each attempt is recorded in it
        self.lease = lease
        #: a source with no offsets in the restored checkpoint may start from the beginning
        self.allow_sources_from_start = allow_sources_from_start
        #: default target of savepoints (Flink's execution.checkpointing.savepoint-dir)
        self.savepoint_dir = str(location(savepoint_dir)) if savepoint_dir else None
        #: a stop asked for (at the end of ``duration`` or of bounded input, or over REST); with a
        #: target the final epoch becomes a savepoint
        self.stop_request: SavepointRequest | None = None
        if stop_with_savepoint:
            if not savepoint_dir:
                raise ConfigurationError("stop_with_savepoint needs a savepoint_dir")
            self.stop_request = SavepointRequest(self.savepoint_dir, stop=True)
        #: a stop was asked while the job ran (REST): asked again after a failover until it completes
        self.stop_asked = False
        self.master: JobMaster | None = None
        #: what the restore dropped and what started empty (``restore.check_compatible``)
        self.restore_notes: list[str] = []
        self.failures = failures or FailureSchedule()
        #: how often each fail point was reached (``FailureSchedule.fail_points`` counts occurrences)
        self.point_counts: dict[str, int] = {}
        #: what the run has done: the status and ``JobResult`` read it
        self.record = RunRecord()
        self.last_failure: float | None = None
        #: unique file names per run (``attempt_id``), never from a seeded rng; set when the run starts
        self.run_id = ""

    def fail_point(self, name: str) -> None:
        n = self.point_counts[name] = self.point_counts.get(name, 0) + 1
        if n in self.failures.fail_points.get(name, ()):
            self.record.injected += 1
            self.record.landed.append(f"fail_point/{name}")
            raise InjectedFailure(f"injected crash at {name} (occurrence {n})")

    def clock(self) -> float:
        raise NotImplementedError

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` before the next attempt (real or virtual time)."""
        raise NotImplementedError

    def attempt(self, restored: Restored | None, attempt_id: str, duration: float | None) -> None:
        raise NotImplementedError

    def on_failover(self) -> None:
        """Called after every counted failure (``record.restarts`` is up to date): publish it."""

    def prepare(self, restore: str | None, allow_non_restored_state: bool) -> Restored | None:
        """Find and check what the run starts from (before anything is started or written)."""
        restored = find_restore(self.storage, restore)
        if restored:
            self.restore_notes = check_compatible(self.plan, self.pipeline, restored, allow_non_restored_state,
                                                  self.allow_sources_from_start)
        resolve_sources(self.plan, self.pipeline, restored)
        return restored

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None) -> None:
        """Run under the pipeline's restart strategy (``deploy.restart``; tenacity drives the
        loop): on a failure, roll back to the latest completed checkpoint (or the one the run
        started from) and try again while the strategy allows. A damaged checkpoint or an
        impossible set-up is not retried."""
        self.run_prepared(self.prepare(restore, allow_non_restored_state), duration)

    def run_prepared(self, restored: Restored | None, duration: float | None) -> None:
        """``run`` from what ``prepare`` returned, for a driver that called it already."""
        initial = restored
        self.run_id = secrets.token_hex(4)
        strategy = self.pipeline.restart_strategy
        failure_times: list[float] = []
        record = self.record
        current: dict[str, Any] = {"restored": restored, "delay": None}  # the strategy's next delay

        def once() -> None:
            if self.lease is not None:  # from here on, writes of earlier attempts are refused
                self.lease.begin_attempt(self.attempt_id())
            recover(self.storage, self.pipeline.sinks, current["restored"], self.fail_point, self.pipeline.name,
                    self.plan.parallelism)
            self.attempt(current["restored"], self.attempt_id(), duration)

        def failed(state: tenacity.RetryCallState) -> None:  # after every retryable failure
            exc = state.outcome.exception() if state.outcome else None  # set before `after` runs
            reason = (exc.reason if isinstance(exc, Failover) else None) or f"{type(exc).__name__}: {exc}"
            if self.master is not None:  # savepoints in flight die with the attempt (a stop stays asked)
                for req in self.master.savepoints.values():
                    req.fail(f"the job failed over before the savepoint completed: {reason.splitlines()[0]}")
            self.last_failure = self.clock()
            failure_times.append(self.last_failure)
            record.failover_log.append({"time": self.last_failure, "reason": reason})
            log.warning("job %s failing over: %s", self.pipeline.name, reason.splitlines()[0])
            record.restarts += 1
            current["delay"] = strategy.decide(failure_times, self.last_failure)
            self.on_failover()

        def give_up(state: tenacity.RetryCallState) -> bool:
            return current["delay"] is None

        def restore_latest(state: tenacity.RetryCallState) -> None:
            current["restored"] = find_restore(self.storage, "latest") or initial
            resolve_sources(self.plan, self.pipeline, current["restored"])

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_retryable),
            stop=give_up,
            wait=lambda state: current["delay"] or 0.0,
            sleep=self.pause,
            after=failed,
            before_sleep=restore_latest,
            reraise=False,
        )
        try:
            retrying(once)
        except tenacity.RetryError as err:
            exc = err.last_attempt.exception()
            record.restarts -= 1  # the failure the strategy refused is not a restart
            reason = record.failover_log[-1]["reason"]
            raise JobFailedError(
                f"job {self.pipeline.name!r} failed: {strategy.describe()} (restarts: {record.restarts}); "
                f"last failure: {reason}"
            ) from exc

    def attempt_id(self) -> str:
        """The current attempt's id, ``<run id>.<restart>``: names its files and fences older attempts."""
        return f"{self.run_id}.{self.record.restarts}"

    def collect(self, master: JobMaster) -> None:
        """Move what the job master finished into the run's record."""
        record = self.record
        if master.completed:
            record.completed.extend(master.completed)
            master.completed = []
        if master.epoch_log:
            record.epoch_log.extend(master.epoch_log)
            master.epoch_log = []
        if master.written:
            record.savepoints.extend(master.written)
            master.written = []

    def new_master(self, restored: Restored | None, now: float, deployment: str,
                   traffic: ServiceTraffic | None = None, workers: int | None = None) -> JobMaster:
        self.master = JobMaster(self.pipeline, self.plan, self.storage, restored, now, self.fail_point, deployment,
                                job_id=self.job_id, stop_request=self.stop_request, traffic=traffic, workers=workers)
        if self.lease is not None:
            storage, attempt = self.storage, self.attempt_id()
            self.master.fence = lambda: check_fence(storage, attempt)
        return self.master

    def new_attempt(self, restored: Restored | None, attempt: str, now: float, deployment: str,
                    traffic: ServiceTraffic, workers: int | None = None,
                    stop_at: float | None = None) -> AttemptController:
        """One attempt's job master, trAcker agent (tracker mode) and controller. ``workers``:
        the workers that report over control connections (None: the simulator's tasks)."""
        tracking = (make_tracking(self.plan, restored, traffic, self.pipeline, attempt)
                    if implications(self.pipeline.mode).tracks else None)
        master = self.new_master(restored, now, deployment, traffic=traffic, workers=workers)
        if tracking is not None:
            master.explain_timeout = tracking.undrained_loops
        sources = sum(1 for c in self.plan.chains if c.is_source) * self.plan.parallelism
        return AttemptController(master, tracking, traffic, sources=sources, workers=workers or 0, stop_at=stop_at,
                                 stop_request=self.stop_request, stop_asked=self.stop_asked)
