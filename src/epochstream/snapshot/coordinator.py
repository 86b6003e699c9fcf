"""The epoch-commit coordinator: a two-phase commit per epoch, as a sans-IO state machine.

Theory of operation. An epoch moves PENDING -> PREPARED -> COMPLETED, or to ABORTED.

- *Trigger*: ``poll(now)`` starts epoch n when the interval has passed since the last
  trigger, ``min_pause`` has passed since the last completion, and fewer than
  ``max_concurrent`` epochs are pending; ``request(now, kind)`` starts one on demand (a
  savepoint, or the *final* epoch of a bounded job). The driver delivers ``TriggerEpoch``
  to every source task.
- *Prepare* (phase one): every task acknowledges n once its snapshot is pre-committed
  (written to storage) and its sinks' output is staged. The last ack makes the epoch
  PREPARED and returns ``CompleteEpoch``: the driver writes the manifest atomically (the
  commit point) and calls ``manifest_written``.
- *Commit* (phase two): ``CommitEpoch`` tells the driver to commit sinks (idempotently;
  re-issued on recovery from the manifest) and to notify tasks. Epochs complete in order.
- *Abort*: a decline, a timeout or a failed manifest write aborts the epoch (staged output
  stays pending and commits with the next completed epoch). More than
  ``tolerable_failed`` consecutive failures returns ``FailJob``. ``fail(now)`` (a worker
  died) aborts everything pending; the driver then restores and builds a new coordinator.

No clocks, no I/O: time comes in as ``now``; decisions go out as actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Hashable, Iterable

from ..runtime.errors import ProtocolError


class EpochState(Enum):
    PENDING = "pending"
    PREPARED = "prepared"
    COMPLETED = "completed"
    ABORTED = "aborted"


CHECKPOINT, SAVEPOINT, FINAL = "checkpoint", "savepoint", "final"


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class TriggerEpoch:
    epoch: int
    kind: str


@dataclass(frozen=True)
class CompleteEpoch:
    """All tasks acked: write the manifest of ``epoch`` (atomically), then call manifest_written."""

    epoch: int
    kind: str
    acks: dict[Hashable, Any]


@dataclass(frozen=True)
class CommitEpoch:
    epoch: int
    kind: str


@dataclass(frozen=True)
class AbortEpoch:
    epoch: int
    reason: str


@dataclass(frozen=True)
class FailJob:
    reason: str


@dataclass(frozen=True)
class JobFinished:
    epoch: int


# ---------------------------------------------------------------- config / bookkeeping


CoordinatorAction = TriggerEpoch | CompleteEpoch | CommitEpoch | AbortEpoch | FailJob | JobFinished
"""What ``EpochCoordinator``'s events return, in the order the driver must carry it out."""


@dataclass(frozen=True)
class CoordinatorConfig:
    interval: float | None = 1.0
    max_concurrent: int = 1
    min_pause: float = 0.0
    timeout: float = 600.0
    tolerable_failed: int = 0


@dataclass
class EpochRecord:
    epoch: int
    kind: str
    triggered_at: float
    state: EpochState = EpochState.PENDING
    acks: dict[Hashable, Any] = field(default_factory=dict)
    ack_times: dict[Hashable, float] = field(default_factory=dict)
    prepared_at: float | None = None
    completed_at: float | None = None
    reason: str = ""


class EpochCoordinator:
    def __init__(
        self, tasks: Iterable[Hashable], config: CoordinatorConfig, last_completed: int = 0, now: float = 0.0
    ) -> None:
        self.tasks = frozenset(tasks)
        self.config = config
        #: newest completed epoch; epochs are numbered from it + 1 after a restore
        self.last_completed = last_completed
        self.next_epoch = last_completed + 1
        self.epochs: dict[int, EpochRecord] = {}
        #: the PENDING and PREPARED epochs, oldest first (epochs only grow): every query of a
        #: tick reads this, so its cost follows the epochs in flight, not the job's whole history
        self._open: dict[int, EpochRecord] = {}
        self.last_trigger = now
        self.last_completion = now
        self.consecutive_failures = 0
        self.final_requested = False
        self.final_epoch: int | None = None
        self.finished = False
        self.failed = False

    # ------------------------------------------------------------ queries
    def pending(self) -> list[int]:
        return list(self._open)

    def next_deadline(self, now: float) -> float | None:
        """Earliest time ``poll`` has something to do (for the simulator's clock and driver
        timers); a time <= now means ``poll(now)`` will act."""
        if self.failed or self.finished:
            return None
        cfg = self.config
        # epochs are triggered in order, so the oldest pending one times out first
        oldest = next((r for r in self._open.values() if r.state is EpochState.PENDING), None)
        times = [] if oldest is None else [oldest.triggered_at + cfg.timeout]
        if len(self._open) < cfg.max_concurrent and self.final_epoch is None:
            if self.final_requested:
                times.append(now)
            elif cfg.interval is not None:
                times.append(self._periodic_due(cfg.interval))
        return min(times) if times else None

    # ------------------------------------------------------------ events
    def poll(self, now: float) -> list[CoordinatorAction]:
        if self.failed or self.finished:
            return []
        actions: list[CoordinatorAction] = []
        cfg = self.config
        for rec in list(self._open.values()):
            if rec.state is EpochState.PENDING and now >= rec.triggered_at + cfg.timeout:
                actions += self._abort(rec, f"epoch {rec.epoch} timed out after {cfg.timeout}s", now)
        if self.failed:
            return actions
        if self.final_requested and self.final_epoch is None and len(self.pending()) < cfg.max_concurrent:
            actions.append(self._trigger(FINAL, now))
        elif (
            cfg.interval is not None
            and self.final_epoch is None
            and len(self.pending()) < cfg.max_concurrent
            and now >= self._periodic_due(cfg.interval)
        ):
            actions.append(self._trigger(CHECKPOINT, now))
        return actions

    def request(self, now: float, kind: str = CHECKPOINT) -> list[CoordinatorAction]:
        """Start an epoch now (savepoint or manual checkpoint), regardless of the interval."""
        if self.failed or self.finished:
            raise ProtocolError("EpochCoordinator", "failed" if self.failed else "finished", f"request({kind})")
        if kind == FINAL:
            self.final_requested = True
            return self.poll(now)
        return [self._trigger(kind, now)]

    def ack(self, task: Hashable, epoch: int, info: Any, now: float) -> list[CoordinatorAction]:
        rec = self._record(task, epoch, "ack")
        if rec is not None and task in rec.acks:
            raise ProtocolError("EpochCoordinator", f"epoch {epoch} {rec.state.value}", "ack",
                                f"duplicate ack from {task}")
        if rec is None or rec.state is not EpochState.PENDING:
            if rec is not None:
                rec.acks[task] = info  # late ack of an aborted epoch: harmless, but remembered
            return []
        rec.acks[task] = info
        rec.ack_times[task] = now
        if len(rec.acks) < len(self.tasks):
            return []
        # Epochs complete in order: an older epoch still pending keeps this one waiting.
        return self._prepare_ready(now)

    def decline(self, task: Hashable, epoch: int, reason: str, now: float) -> list[CoordinatorAction]:
        rec = self._record(task, epoch, "decline")
        if rec is None or rec.state not in (EpochState.PENDING, EpochState.PREPARED):
            return []
        return self._abort(rec, f"task {task} declined epoch {epoch}: {reason}", now)

    def manifest_written(self, epoch: int, now: float, drained: bool = True) -> list[CoordinatorAction]:
        """The manifest of ``epoch`` is durable. ``drained=False``: the epoch cut through
        records still circulating in a loop (its loop heads logged some), so if it is the
        final epoch the job is not finished and another final epoch follows."""
        rec = self.epochs.get(epoch)
        if rec is None or rec.state is not EpochState.PREPARED:
            raise ProtocolError("EpochCoordinator", rec.state.value if rec else "unknown", f"manifest_written({epoch})")
        rec.state = EpochState.COMPLETED
        del self._open[epoch]
        rec.completed_at = now
        self.last_completed = epoch
        self.last_completion = now
        self.consecutive_failures = 0
        actions: list[CoordinatorAction] = [CommitEpoch(epoch, rec.kind)]
        # older epochs can no longer complete: they were aborted or are subsumed
        for old in [e for e in self.pending() if e < epoch]:
            actions += self._abort(self.epochs[old], f"subsumed by epoch {epoch}", now, count=False)
        if self.final_epoch is not None and epoch >= self.final_epoch:
            if drained:
                self.finished = True
                actions.append(JobFinished(epoch))
            else:
                self.final_epoch = None  # poll triggers the next final epoch
        return actions + self._prepare_ready(now)

    def manifest_failed(self, epoch: int, reason: str, now: float) -> list[CoordinatorAction]:
        rec = self.epochs.get(epoch)
        if rec is None or rec.state is not EpochState.PREPARED:
            raise ProtocolError("EpochCoordinator", rec.state.value if rec else "unknown", f"manifest_failed({epoch})")
        return self._abort(rec, f"writing the manifest of epoch {epoch} failed: {reason}", now)

    def fail(self, now: float, reason: str) -> list[CoordinatorAction]:
        """A worker died: abort everything in flight; the driver restores and starts a new coordinator."""
        actions: list[CoordinatorAction] = []
        for e in self.pending():
            actions += self._abort(self.epochs[e], f"job failover: {reason}", now, count=False)
        self.failed = True
        return actions

    # ------------------------------------------------------------ internals
    def _periodic_due(self, interval: float) -> float:
        # one expression for both poll and next_deadline, so they agree to the last bit
        return max(self.last_trigger + interval, self.last_completion + self.config.min_pause)

    def _record(self, task: Hashable, epoch: int, event: str) -> EpochRecord | None:
        if task not in self.tasks:
            raise ProtocolError("EpochCoordinator", "running", event, f"unknown task {task}")
        if epoch >= self.next_epoch:
            raise ProtocolError("EpochCoordinator", "running", f"{event}({epoch})", "epoch was never triggered")
        return self.epochs.get(epoch)

    def _trigger(self, kind: str, now: float) -> TriggerEpoch:
        epoch = self.next_epoch
        self.next_epoch += 1
        self.epochs[epoch] = self._open[epoch] = EpochRecord(epoch, kind, now)
        self.last_trigger = now
        if kind == FINAL:
            self.final_epoch = epoch
        return TriggerEpoch(epoch, kind)

    def _prepare_ready(self, now: float) -> list[CoordinatorAction]:
        """Move the oldest fully-acked epoch to PREPARED if nothing older is still pending."""
        if any(r.state is EpochState.PREPARED for r in self._open.values()):
            return []  # one manifest at a time, in order
        for e in self.pending():
            rec = self.epochs[e]
            if len(rec.acks) < len(self.tasks):
                return []
            rec.state = EpochState.PREPARED
            rec.prepared_at = now
            return [CompleteEpoch(e, rec.kind, dict(rec.acks))]
        return []

    def _abort(self, rec: EpochRecord, reason: str, now: float, count: bool = True) -> list[CoordinatorAction]:
        rec.state = EpochState.ABORTED
        self._open.pop(rec.epoch, None)
        rec.reason = reason
        rec.completed_at = now
        actions: list[CoordinatorAction] = [AbortEpoch(rec.epoch, reason)]
        if rec.epoch == self.final_epoch:
            self.final_epoch = None  # try the final epoch again
        if count:
            self.consecutive_failures += 1
            if self.consecutive_failures > self.config.tolerable_failed:
                self.failed = True
                actions.append(
                    FailJob(f"{self.consecutive_failures} consecutive failed epochs (tolerable: "
                            f"{self.config.tolerable_failed}); last: {reason}")
                )
                return actions
        return actions + self._prepare_ready(now)

    def stats(self) -> list[dict[str, Any]]:
        """Per-epoch timings for metrics and ``checkpoints list``."""
        out = []
        for e in sorted(self.epochs):
            r = self.epochs[e]
            out.append(
                {
                    "epoch": e,
                    "kind": r.kind,
                    "state": r.state.value,
                    "triggered_at": r.triggered_at,
                    "prepare_seconds": None if r.prepared_at is None else r.prepared_at - r.triggered_at,
                    "complete_seconds": None if r.completed_at is None else r.completed_at - r.triggered_at,
                    "reason": r.reason,
                }
            )
        return out
