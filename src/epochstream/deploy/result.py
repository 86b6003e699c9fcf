"""What a run reports: ``RunRecord`` is filled as the run goes, ``JobResult`` is what it becomes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..runtime.meters import RunMeters
from ..tracker.traffic import ServiceTraffic
from ..ui.model import task_metrics


@dataclass
class JobResult:
    """What ``Pipeline.run`` returns."""

    job: str
    checkpoint_dir: str
    completed_epochs: list[int]
    latest_checkpoint: str | None
    restarts: int
    records_in: int
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)
    #: savepoint folders written during the run (triggered, or the stop-with-savepoint one last)
    savepoints: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "checkpoint_dir": self.checkpoint_dir,
            "completed_epochs": self.completed_epochs,
            "latest_checkpoint": self.latest_checkpoint,
            "restarts": self.restarts,
            "records_in": self.records_in,
            "seconds": round(self.seconds, 6),
            "savepoints": self.savepoints,
            "metrics": self.metrics,
        }


@dataclass(kw_only=True)
class SimFlowCounts:
    """The simulator with flow control (``SimConfig.flow``), over every attempt."""

    #: data envelopes that waited for credit
    credit_waits: int = 0
    #: source reads held back by backpressure
    throttled_reads: int = 0


@dataclass(kw_only=True)
class RunRecord:
    """What a run has done so far, every driver alike; the status and ``JobResult`` read it."""

    #: epochs completed, in order
    completed: list[int] = field(default_factory=list)
    #: one entry per epoch the job master finished (completed or aborted)
    epoch_log: list[dict[str, Any]] = field(default_factory=list)
    #: one entry per failure: its time (run seconds) and reason
    failover_log: list[dict[str, Any]] = field(default_factory=list)
    #: savepoint folders written
    savepoints: list[str] = field(default_factory=list)
    restarts: int = 0
    #: records the sources read in attempts that finished
    records_in: int = 0
    #: failures actually injected (kills, fail points, write failures)
    injected: int = 0
    #: the simulator: state captures persisted, every attempt (``FailureSchedule.write_failures`` counts them)
    captures: int = 0
    #: the kind of every failure injected (``chaos.verdict``: ``worker/alignment``, ``fail_point/mid_commit``, ...)
    landed: list[str] = field(default_factory=list)
    #: every chaos kill of the multi-process drivers: time, worker, target, moment
    kills: list[dict[str, Any]] = field(default_factory=list)
    #: seconds from each failure to every worker of the next attempt being ready
    recovery_seconds: list[float] = field(default_factory=list)
    #: spark: every wait of an attempt for its barrier slots (``deploy.slots``)
    slot_waits: list[dict[str, Any]] = field(default_factory=list)
    #: service messages of the whole run (markers, SND/RCV reports, promises, NEOSS)
    traffic: ServiceTraffic = field(default_factory=ServiceTraffic)
    #: every task's counters (``runtime.meters``)
    meters: RunMeters = field(default_factory=RunMeters)
    #: the simulator with flow control only
    sim_flow: SimFlowCounts | None = None

    def result(self, *, job: str, checkpoint_dir: str, latest_checkpoint: str | None, seconds: float,
               run_seconds: float, virtual_seconds: float | None, about: dict[str, Any]) -> JobResult:
        """The ``JobResult``; ``about``: what the run was (deployment, parallelism, mode, ...)."""
        tasks = task_metrics(self.meters.as_dict())
        return JobResult(
            job=job,
            checkpoint_dir=checkpoint_dir,
            completed_epochs=list(self.completed),
            latest_checkpoint=latest_checkpoint,
            restarts=self.restarts,
            records_in=self.records_in,
            seconds=seconds,
            metrics={
                "epochs": self.epoch_log,
                "failovers": self.failover_log,
                "failures_injected": self.injected,
                "failures_landed": self.landed,
                "state_captures": self.captures,
                "recovery_seconds": self.recovery_seconds,
                "kills": self.kills,
                "virtual_seconds": virtual_seconds,
                # seconds from the start of the first attempt (after driver set-up such as Spark warm-up)
                "run_seconds": run_seconds,
                "service_traffic": self.traffic.as_dict(),
                # per task: rows in and out, rates, busy / backpressured / idle ms/s (multi-process drivers)
                "tasks": tasks,
                # records sources dropped as late (max_out_of_orderness), replays counted again
                "late_records_dropped": sum(t.get("late_records_dropped", 0) for t in tasks.values()),
                # records from_json sent to its dead-letter output, replays counted again
                "dead_letters": sum(t.get("dead_letters", 0) for t in tasks.values()),
                **about,
                # spark: every wait of an attempt for its barrier slots (deploy.slots)
                "slot_waits": self.slot_waits,
                # the simulator with flow control (SimConfig.flow): data envelopes that waited for
                # credit, and source reads held back by backpressure, over every attempt
                "sim_flow": None if self.sim_flow is None else asdict(self.sim_flow),
            },
            savepoints=list(self.savepoints),
        )
