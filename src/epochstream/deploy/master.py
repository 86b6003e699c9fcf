"""The job master: the sans-IO ``EpochCoordinator`` plus the I/O its actions ask for.

One ``JobMaster`` per attempt, in the driver process. It takes the attempt's events (acks,
declines, epoch requests, savepoint and stop requests, polls) and carries out what the
coordinator answers: beginning an epoch in storage and sinks, building and writing the
manifest (with the epoch's metrics), committing state and sinks in order, writing savepoints,
retaining and discarding old checkpoints. ``MasterOutput`` is what the driver still has to
do: trigger epochs on the workers, or fail the attempt over. Fail points sit at the
protocol's most delicate moments (before a manifest, between manifest and sink commit, in
the middle of a sink commit), so chaos runs can crash the master exactly there.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from ..backends import open_object_storage
from ..backends.base import commits_in_subtasks
from ..backends.objects import StorageAccessError
from ..graph.plan import PhysicalPlan
from ..runtime.messages import TaskId
from ..runtime.modes import implications
from ..snapshot.coordinator import (
    FINAL,
    SAVEPOINT,
    AbortEpoch,
    CommitEpoch,
    CompleteEpoch,
    CoordinatorConfig,
    EpochCoordinator,
    FailJob,
    JobFinished,
    TriggerEpoch,
)
from ..snapshot.failpoints import FailPointName
from ..snapshot.manifest import AckInfo, CheckpointError, IncompleteChainError, ManifestBuilder
from ..snapshot.manifest_view import ManifestView
from ..tracker.traffic import ServiceTraffic
from ..ui.graph import job_graph
from .control import IN_PROGRESS, SavepointRequest
from .failures import FailPoint, no_fail
from .lease import check_not_held
from .restore import Restored
from .tracking import tracking_segments

log = logging.getLogger("epochstream")


@dataclass
class MasterOutput:
    """What the job master wants the driver to do."""

    triggers: list[TriggerEpoch] = field(default_factory=list)
    #: epochs committed here, in order: sinks that commit in their subtasks are told of them
    committed: list[int] = field(default_factory=list)
    failover: str | None = None


class JobMaster:
    """Runs one attempt's epochs from trigger to commit; see the module docstring.

    Its fields, by role:

    - **protocol**: ``coordinator`` (the sans-IO epoch state machine), ``builder`` (the
      manifest of each epoch, from acks and declines), ``drain_final``, ``finished``;
    - **storage and sinks**: ``storage``, ``sinks``, ``manifests`` (written, not yet
      committed), ``retained`` (completed manifests kept, oldest first), ``num_retained``;
    - **requests from outside**: ``savepoints`` (by epoch), ``stop_request``;
    - **results the driver collects** (``Driver.collect`` empties them): ``completed``,
      ``epoch_log``, ``written`` (savepoint folders);
    - **metrics**: ``traffic``, ``trigger_messages``, ``explain_timeout``.

    Every event method takes ``now`` and returns a ``MasterOutput``; the I/O it does itself
    (storage, sinks) is the part of an epoch's lifecycle only the driver process can do.
    """

    def __init__(
        self,
        pipeline,
        plan: PhysicalPlan,
        storage,
        restored: Restored | None,
        now: float,
        fail_point: FailPoint = no_fail,
        deployment: str = "sim",
        job_id: str = "",
        stop_request: SavepointRequest | None = None,
        traffic: ServiceTraffic | None = None,
        workers: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.job_id = job_id
        #: savepoint requests by the epoch that takes them
        self.savepoints: dict[int, SavepointRequest] = {}
        #: a stop (with a savepoint if it has a target): taken by the final epoch, whenever that commits
        self.stop_request = stop_request
        #: savepoint folders written by this attempt
        self.written: list[str] = []
        #: the attempt's service-traffic counter (tracker messages per epoch)
        self.traffic = traffic
        #: trigger messages per epoch: one per worker (local, spark) or per source task (sim)
        self.trigger_messages = workers if workers is not None else sum(
            1 for c in plan.chains if c.is_source) * plan.parallelism
        self.plan = plan
        self.storage = storage
        self.sinks = pipeline.sinks
        #: sources told of each completed epoch's offsets (Kafka: the consumer group's offsets)
        self.offset_committers = {uid: src for uid, src in pipeline.sources.items()
                                  if hasattr(src, "epoch_completed")}
        cfg = pipeline.checkpoint
        self.num_retained = cfg.num_retained
        self.coordinator = EpochCoordinator(
            plan.tasks,
            CoordinatorConfig(cfg.interval, cfg.max_concurrent, cfg.min_pause, cfg.timeout, cfg.tolerable_failed),
            last_completed=restored.epoch if restored else 0,
            now=now,
        )
        job = {
            "job": pipeline.name,
            "job_id": job_id,
            "parallelism": plan.parallelism,
            "max_parallelism": plan.max_parallelism,
            "mode": pipeline.mode,
            "deployment": deployment,
        }
        self.builder = ManifestBuilder(job, restored.epoch if restored else 0)
        self.fail_point = fail_point
        self.manifests: dict[int, dict[str, Any]] = {}
        #: completed manifests kept in storage, oldest first (damaged ones are skipped)
        self.retained: list[dict[str, Any]] = _readable_manifests(storage)
        self.finished = False
        self.completed: list[int] = []
        self.epoch_log: list[dict[str, Any]] = []
        #: tracker mode: epoch -> loops still holding it (``Tracking.undrained_loops``), asked on a timeout
        self.explain_timeout: Callable[[int], list[dict[str, Any]]] | None = None
        #: the final epoch must cut through empty loops (a bounded job whose sources are exhausted)
        self.drain_final = False
        #: sum of every source split's offset in the last committed (or restored) manifest: an
        #: epoch's ``records`` (input it covers) is its own sum minus this one
        self.offsets_total = _offsets_total(restored.view) if restored else 0
        #: the job graph as the dashboard draws it, kept in every manifest (``epochstream ui`` reads it)
        self.graph = job_graph(plan, pipeline.mode, tracking_segments(plan, pipeline))
        #: raises ``lease.FencedError`` once this attempt no longer holds the checkpoint folder
        #: (checked before the manifest and the sinks are committed); the driver sets it
        self.fence: Callable[[], None] = _unfenced

    # -- events from the driver
    def poll(self, now: float) -> MasterOutput:
        return self._run(self.coordinator.poll(now), now)

    def request(self, now: float, kind: str, drain: bool = False) -> MasterOutput:
        """Start an epoch now. ``drain`` (a final epoch once every source is exhausted): the job
        ends only with a final epoch whose loop heads logged nothing, so no record is left
        going round a loop; a job stopped by ``duration`` ends at once (a restore replays the logs)."""
        if kind == FINAL:
            self.drain_final = drain
        return self._run(self.coordinator.request(now, kind), now)

    def ack(self, info: AckInfo, now: float) -> MasterOutput:
        self.builder.record(info)
        return self._run(self.coordinator.ack(info.task, info.epoch, info, now), now)

    def decline(self, task: TaskId, epoch: int, reason: str, now: float,
                staged: dict[str, tuple[str, ...]] | None = None) -> MasterOutput:
        self.builder.record_decline(task, epoch)
        if staged:  # output staged before the failed state write still commits later
            self.builder.record(AckInfo(task, epoch, staged=staged))
        return self._run(self.coordinator.decline(task, epoch, reason, now), now)

    def next_deadline(self, now: float) -> float | None:
        return self.coordinator.next_deadline(now)

    def savepoint(self, now: float, request: SavepointRequest) -> MasterOutput:
        """Take a savepoint now (an on-demand epoch), or stop the job with a final epoch that
        becomes one; ``request`` tracks the outcome."""
        if self.finished or self.coordinator.failed or self.coordinator.final_requested:
            request.fail("the job is stopping or finished; no new savepoint can be taken")
            return MasterOutput()
        if request.stop:
            self.stop_request = request
            return self._run(self.coordinator.request(now, FINAL), now)
        actions = self.coordinator.request(now, SAVEPOINT)
        trigger = actions[0]
        assert isinstance(trigger, TriggerEpoch), "a savepoint request triggers its epoch at once"
        request.epoch = trigger.epoch
        self.savepoints[request.epoch] = request
        return self._run(actions, now)

    # -- carrying out the coordinator's actions
    def _run(self, actions: list[Any], now: float) -> MasterOutput:
        out = MasterOutput()
        queue = list(actions)
        undrained = ""
        while queue:
            a = queue.pop(0)
            if isinstance(a, TriggerEpoch):
                self.storage.begin(a.epoch)
                for sink in self.sinks.values():
                    if hasattr(sink, "begin"):  # sinks written before the interface may lack it
                        sink.begin(a.epoch)
                out.triggers.append(a)
            elif isinstance(a, CompleteEpoch):
                queue += self._write_manifest(a, now)
            elif isinstance(a, CommitEpoch):
                self._commit(a.epoch)
                out.committed.append(a.epoch)
            elif isinstance(a, AbortEpoch):
                entry = {"epoch": a.epoch, "state": "aborted", "reason": a.reason}
                loops = self.explain_timeout(a.epoch) if self.explain_timeout and "timed out" in a.reason else []
                if loops:
                    entry["undrained_loops"] = loops
                    undrained = (f"; its loop never drained in tracker mode (an epoch ends only when no record of it "
                                 f"is left going round): {loops}")
                    log.warning("epoch %d aborted: %s%s", a.epoch, a.reason, undrained)
                else:
                    undrained = ""
                    log.info("epoch %d aborted: %s", a.epoch, a.reason)
                self.storage.abort(a.epoch)  # its staged sink output commits with the next epoch
                self.epoch_log.append(entry)
                req = self.savepoints.pop(a.epoch, None)
                if req is not None:
                    req.fail(f"savepoint epoch {a.epoch} aborted: {a.reason}")
            elif isinstance(a, FailJob):
                out.failover = a.reason + undrained
            elif isinstance(a, JobFinished):
                self.finished = True
                for req in self.savepoints.values():
                    req.fail("the job finished before the savepoint epoch completed")
        return out

    def _write_manifest(self, a: CompleteEpoch, now: float) -> list[Any]:
        try:
            created = _dt.datetime.now(_dt.timezone.utc).isoformat()
            manifest = self.builder.build(a.epoch, a.kind, a.acks, {"created_at": created, "graph": self.graph})
        except IncompleteChainError as exc:
            return self.coordinator.manifest_failed(a.epoch, str(exc), now)
        manifest["metrics"].update(self._epoch_metrics(a, now))
        for uid, sink in self.sinks.items():  # transaction ids of sinks that commit per epoch or per subtask
            if uid not in manifest["sinks"]:
                continue
            if getattr(sink, "epoch_transactions", False):
                manifest["sinks"][uid]["delta"] = sink.manifest_entry(uid)
            elif commits_in_subtasks(sink):
                manifest["sinks"][uid]["transactions"] = sink.manifest_entry(uid)
        self.fail_point(FailPointName.BEFORE_MANIFEST)
        self.fence()
        try:
            self.storage.commit(manifest)
        except StorageAccessError:
            raise  # credentials or permissions: no later epoch can do better
        except OSError as exc:
            return self.coordinator.manifest_failed(a.epoch, f"{type(exc).__name__}: {exc}", now)
        self.fail_point(FailPointName.AFTER_MANIFEST)
        self.manifests[a.epoch] = manifest
        # a final epoch whose loop heads logged records in transit has not drained its loops:
        # the job goes on (another final epoch) until one cuts through empty loops
        # (unaligned mode: the same for records a final epoch's markers overtook, its channel state)
        logged = manifest["metrics"].get("loop_log_records", 0) + manifest["metrics"].get("channel_state_records", 0)
        drained = not (self.drain_final and logged)
        if not drained and a.kind == FINAL:
            log.info("final epoch %d cut through %d records still in loops; another final epoch follows",
                     a.epoch, logged)
        return self.coordinator.manifest_written(a.epoch, now, drained=drained)

    def _epoch_metrics(self, a: CompleteEpoch, now: float) -> dict[str, Any]:
        """What the manifest records about how epoch ``a.epoch`` went (beyond bytes and files):
        when it was triggered, how long until every task had acked, each task's alignment (or
        trAcker hold), write time, bytes and held records, and the service messages it cost."""
        rec = self.coordinator.epochs[a.epoch]
        tasks = {}
        for task, info in sorted(a.acks.items()):
            tid = cast(TaskId, task)  # the coordinator is generic over task ids; the master's are TaskIds
            tasks[f"{tid[0]}.{tid[1]}"] = {
                "alignment_seconds": round(info.alignment_seconds, 6),
                "write_seconds": round(info.write_seconds, 6),
                "ack_seconds": round(rec.ack_times.get(tid, now) - rec.triggered_at, 6),
                "bytes": info.bytes,
                "held_records": info.held_records,
                "channel_state_records": info.channel_state_records,
                "channel_state_bytes": info.channel_state_bytes,
                # the source offsets this task had reached (sum over its splits): per-task input rates
                "source_offset": sum(sum(o.values()) for o in info.offsets.values()),
            }
        messages = {"triggers": self.trigger_messages, "acks": len(a.acks)}
        if implications(self.pipeline.mode).tracks:
            tally = self.traffic.by_epoch.get(a.epoch) if self.traffic is not None else None
            messages["tracker"] = tally.messages if tally else 0
        else:  # every channel carries exactly one marker per epoch
            messages["markers"] = len(self.plan.channels)
        return {
            "trigger_to_manifest_seconds": round(now - rec.triggered_at, 6),
            "prepare_seconds": round((rec.prepared_at or now) - rec.triggered_at, 6),
            "tasks": tasks,
            "service_messages": messages,
            "service_messages_total": sum(messages.values()),
        }

    def _commit(self, epoch: int) -> None:
        manifest = self.manifests.pop(epoch)
        self.fence()
        t_commit = time.perf_counter()
        commit_state = getattr(self.storage, "commit_epoch", None)
        if commit_state is not None:  # Delta: one transaction per operator, before the sinks
            commit_state(manifest, self.fail_point)
        first = commit_state is None
        for uid, entry in sorted(manifest["sinks"].items()):
            if commits_in_subtasks(self.sinks[uid]):
                continue  # its subtasks commit, told by the driver (``MasterOutput.committed``)
            if getattr(self.sinks[uid], "epoch_transactions", False):
                if not first:
                    self.fail_point(FailPointName.MID_COMMIT)
                first = False
                self.sinks[uid].commit_epoch(uid, epoch, entry["staged"])
                continue
            for rel in entry["staged"]:
                if not first:
                    self.fail_point(FailPointName.MID_COMMIT)
                first = False
                self.sinks[uid].commit([rel])
        commit_seconds = time.perf_counter() - t_commit
        for uid, src in self.offset_committers.items():
            if uid in manifest["sources"]:
                src.epoch_completed(manifest["sources"][uid]["offsets"])
        self.fail_point(FailPointName.AFTER_COMMIT)
        self._take_savepoint(epoch, manifest)
        self.builder.completed(epoch, manifest)
        self.completed.append(epoch)
        rec = self.coordinator.epochs[epoch]
        assert rec.completed_at is not None, "CommitEpoch follows manifest_written, which sets completed_at"
        total = _offsets_total(ManifestView.of(manifest))
        records, self.offsets_total = total - self.offsets_total, total
        self.epoch_log.append({
            "epoch": epoch, "state": "completed", "kind": rec.kind, "created_at": manifest.get("created_at"),
            "records": records,
            **manifest["metrics"],
            "prepare_seconds": None if rec.prepared_at is None else rec.prepared_at - rec.triggered_at,
            "commit_seconds": commit_seconds,
            "trigger_to_commit_seconds": rec.completed_at - rec.triggered_at,
        })
        self.retained.append(manifest)
        while len(self.retained) > self.num_retained:
            old = self.retained.pop(0)
            self.storage.discard(int(old["epoch"]))
        self.storage.collect_garbage(self.retained, keep_after=epoch)

    def _take_savepoint(self, epoch: int, manifest: dict[str, Any]) -> None:
        """Write the savepoint a request asked of this (committed) epoch; a failed write fails
        the request, never the job: the epoch is committed either way."""
        from ..backends.savepoint import write_savepoint

        req = self.savepoints.pop(epoch, None)
        stop = self.stop_request
        if req is None and manifest["kind"] == FINAL and stop is not None and stop.status == IN_PROGRESS:
            req = stop
            req.epoch = epoch
            if not req.target:  # a plain stop: the final checkpoint is the result
                req.complete(str(self.storage.checkpoint_dir(epoch)))
                return
        if req is None:
            return
        try:
            check_not_held(open_object_storage(req.target), "write a savepoint into it", self.job_id)
            folder = write_savepoint(self.storage, manifest, self.storage.root, req.target, self.job_id)
        except (OSError, CheckpointError) as exc:
            log.error("savepoint of epoch %d failed: %s", epoch, exc)
            req.fail(f"writing the savepoint of epoch {epoch} failed: {type(exc).__name__}: {exc}")
            return
        log.info("savepoint of epoch %d written to %s", epoch, folder)
        self.written.append(str(folder))
        req.complete(str(folder))


def _unfenced() -> None:
    return None


def _readable_manifests(storage) -> list[dict[str, Any]]:
    out = []
    for epoch in storage.list_checkpoints():
        try:
            out.append(storage.load_manifest(epoch)[0])
        except CheckpointError:
            continue
    return out


def _offsets_total(manifest: ManifestView) -> int:
    """Sum of every source split's offset in ``manifest`` (records read up to its cut)."""
    return sum(sum(src.offsets.values()) for src in manifest.sources.values())
