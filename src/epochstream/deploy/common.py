"""Driver-side pieces every deployment shares: job master, persistence, restore.

The job master wraps the sans-IO ``EpochCoordinator`` with the I/O it asks for: writing
manifests, committing sinks, dropping old checkpoints. ``persist`` turns a task's capture
into files (pre-commit). ``recover`` and ``build_tasks`` roll a job back to a completed
checkpoint. Named *fail points* let the simulator and chaos runs crash the job master at
the protocol's most delicate moments (before a manifest, between manifest and sink
commit, in the middle of a sink commit).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import pickle
import random as _random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import tenacity

from ..alignment import BarrierAligner
from ..backends import location, open_storage, scheme_of
from ..backends.objects import StorageAccessError
from ..graph.kinds import OpKind
from ..graph.plan import PhysicalPlan
from ..runtime.chain import ChainRuntime
from ..runtime.context import Context
from ..runtime.errors import ConfigurationError, EpochStreamError
from ..runtime.messages import TaskCapture, TaskId
from ..runtime.task import Task
from ..runtime.tracking import TaskTracking
from ..loops.task import LoopHeadTask
from ..tracker.agent import TrackingAgent
from ..tracker.gate import FirmBoundGate
from ..tracker.local import BatchIds, LocalTracker
from ..tracker.messages import NEOSS
from ..tracker.segments import build_segments, chain_graph
from ..tracker.traffic import ServiceTraffic
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
from .control import IN_PROGRESS, SavepointRequest
from ..snapshot.manifest import (
    AckInfo,
    CheckpointError,
    IncompleteChainError,
    ManifestBuilder,
    operator_state_parts,
    source_splits,
)
from ..snapshot.rescale import redistribute

log = logging.getLogger("epochstream")


class InjectedFailure(Exception):
    """A failure injected on purpose (simulator, chaos); recovered like a real crash."""


class JobFailedError(Exception):
    """The job failed and the restart strategy gave up; carries the last cause."""


FailPoint = Callable[[str], None]


@dataclass
class FailureSchedule:
    """What goes wrong, and when. Occurrence numbers count from 1 over the whole run."""

    kill_times: list[float] = field(default_factory=list)
    fail_points: dict[str, set[int]] = field(default_factory=dict)
    write_failures: set[int] = field(default_factory=set)
    #: local and spark drivers, per kill in ``kill_times`` order (missing: "now", "worker"): the
    #: protocol moment the kill waits for ("now", "alignment", "snapshot_write", "commit") and
    #: what it kills ("worker": the worker's process; "executor": the Spark executor JVM)
    kill_moments: list[str] = field(default_factory=list)
    kill_targets: list[str] = field(default_factory=list)

    @classmethod
    def random(cls, rng: _random.Random, kills: int, horizon: float) -> "FailureSchedule":
        """``kills`` failures spread over ``horizon`` virtual seconds, a mix of worker kills
        and job-master crashes at fail points."""
        sched = cls()
        points = ["before_manifest", "after_manifest", "mid_commit", "after_commit", "recovery"]
        for _ in range(kills):
            r = rng.random()
            if r < 0.6:
                sched.kill_times.append(rng.uniform(0, horizon))
            elif r < 0.9:
                sched.fail_points.setdefault(rng.choice(points), set()).add(rng.randint(1, 4))
            else:
                sched.write_failures.add(rng.randint(1, 20))
        sched.kill_times.sort()
        return sched


class Failover(Exception):
    """A failure the restart strategy handles by rolling back to the latest completed epoch."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _no_fail(point: str) -> None:
    return None


# ---------------------------------------------------------------- restore


@dataclass
class Restored:
    """A completed checkpoint chosen for (re)start."""

    epoch: int
    manifest: dict[str, Any]
    root: Any
    path: Any
    #: the storage that reads it, if not the job's own (a savepoint in another store, e.g. S3)
    reader: Any = None


def find_restore(storage, restore: str | None) -> Restored | None:
    if restore is None:
        return None
    reader = None
    if restore == "latest":
        found = storage.latest()
        if found is None:
            return None
    else:
        if scheme_of(restore) != scheme_of(str(storage.root)):  # e.g. an S3 savepoint, local checkpoints
            reader = open_storage(str(location(restore).parent))
        found = (reader or storage).load_manifest(restore)
    manifest, root = found
    epoch = int(manifest["epoch"])
    newer = [e for e in storage.list_checkpoints() if e > epoch]
    if restore != "latest" and newer and root.resolve() == storage.root.resolve():
        raise CheckpointError(
            f"cannot restore chk-{epoch} into {storage.root}: it already holds newer checkpoints "
            f"{newer[:5]} that new epochs would overwrite; restore it into a new checkpoint dir "
            f"(checkpoint_dir=NEW, restore='{root / f'chk-{epoch}'}')"
        )
    return Restored(epoch, manifest, root, root if manifest.get("self_contained") else root / f"chk-{epoch}", reader)


def check_compatible(plan: PhysicalPlan, pipeline, restored: Restored, allow_non_restored_state: bool) -> None:
    """Refuse a checkpoint or savepoint this pipeline cannot take over, naming what differs.

    State maps to operators by uid, as in Flink: the job's name may differ (a renamed or
    forked job takes over its savepoint), but every uid that holds state in the checkpoint
    must exist in the pipeline as the same kind of operator, unless
    ``allow_non_restored_state`` drops the state of the missing ones. Max parallelism may
    never change: it fixes the key groups."""
    m = restored.manifest
    what = "savepoint" if m.get("kind") == "savepoint" else "checkpoint"
    where = f"{what} {restored.path}"
    other_job = m["job"] != pipeline.name
    origin = f" (a {what} of job {m['job']!r}{', id ' + m['job_id'] if m.get('job_id') else ''}; this job is " \
             f"{pipeline.name!r})" if other_job else ""
    if int(m["max_parallelism"]) != plan.max_parallelism:
        raise CheckpointError(
            f"{where} was taken with max_parallelism {m['max_parallelism']}, the job now has "
            f"{plan.max_parallelism}: max parallelism fixes the key groups and cannot change once state exists; "
            f"restore with max_parallelism={m['max_parallelism']} (--max-parallelism {m['max_parallelism']}) "
            f"at any parallelism up to it"
        )
    nodes = {n.uid: n for n in plan.nodes.values() if n.uid}
    held = {**{uid: "process" for uid in m["operators"]}, **{uid: "source" for uid in m["sources"]}}
    # a loop head keeps its log as keyed state, like a keyed process
    kind_of = {uid: OpKind.PROCESS if n.kind == OpKind.LOOP_HEAD else n.kind for uid, n in nodes.items()}
    wrong = sorted(f"{uid!r} ({kind} in the {what}, {nodes[uid].kind} in the pipeline)"
                   for uid, kind in held.items() if uid in nodes and kind_of[uid] != kind)
    if wrong:
        raise CheckpointError(f"{where}: operator uid(s) {', '.join(wrong)} are a different kind of operator"
                              f"{origin}; their state cannot be restored")
    unknown = sorted(uid for uid in held if uid not in nodes)
    if unknown and not allow_non_restored_state:
        known = sorted(uid for uid in held if uid in nodes)
        raise CheckpointError(
            f"{where} holds state of operator uid(s) {unknown} that the pipeline does not have{origin}"
            f"{'; uids found: ' + str(known) if known else '; no uid matches: is this the right job?'}. "
            f"Pass allow_non_restored_state=True (--allow-non-restored-state) to drop that state"
        )
    if other_job:
        log.warning("restoring %s into job %r: operators matched by uid", where, pipeline.name)
    for uid, src in pipeline.sources.items():
        splits = source_splits(m, uid)
        if splits is not None and splits != src.num_splits and not src.elastic:
            raise CheckpointError(
                f"{where}: source {uid!r} had {splits} splits, the source now has {src.num_splits}; offsets are "
                f"kept per split, so the split count cannot change (build the source without splits= to adopt "
                f"the {what}'s count)"
            )


def resolve_sources(plan: PhysicalPlan, pipeline, restored: Restored | None) -> None:
    """Settle elastic sources' split counts: the checkpoint's on a restore, else the parallelism.

    Splits are then dealt to source subtasks by ``split % parallelism``, so a restore at
    another parallelism reassigns them with their offsets."""
    for uid, src in pipeline.sources.items():
        want = source_splits(restored.manifest, uid) if restored else None
        if want is None:
            want = plan.parallelism if src.elastic else src.num_splits
        if want != src.num_splits:
            if not src.elastic:
                raise CheckpointError(f"source {uid!r} has {src.num_splits} splits, the checkpoint {want}")
            src.resplit(want)


def recover(storage, sinks: dict[str, Any], restored: Restored | None, fail_point: FailPoint = _no_fail,
            job: str | None = None) -> None:
    """Finish what the restored checkpoint promised and clear what came after it.

    Commits named by the manifest are re-issued (idempotent): first the state commits of a
    storage that commits per epoch (Delta: ``recover_epoch``), then the sinks'; staged output
    of later epochs is dropped, and the storage deletes state files no manifest names and sets
    aside damaged checkpoints whose epochs will be written again (the ``recover`` verbs).
    Sinks that commit once per epoch (``epoch_transactions``) are started first with the
    restored manifest, which names their transaction ids.
    """
    staged = restored.manifest["sinks"] if restored else {}
    recover_state = getattr(storage, "recover_epoch", None)
    if restored is not None and recover_state is not None and restored.reader is None:
        fail_point("recovery")
        recover_state(restored.manifest, restored.root, fail_point)
    for uid, sink in sorted(sinks.items()):
        fail_point("recovery")
        entry = staged.get(uid, {})
        if getattr(sink, "epoch_transactions", False):
            manifest = restored.manifest if restored else None
            sink.start(uid, job or (manifest["job"] if manifest else "job"), manifest)
            sink.recover(uid, entry.get("staged", []), epoch=restored.epoch if entry.get("delta") else None)
        else:
            sink.recover(uid, entry.get("staged", []))
    storage.recover(restored.epoch if restored else None)


@dataclass
class Tracking:
    """trAcker mode's driver-side objects for one attempt: segments and the tracking agent."""

    segmentation: Any
    agent: TrackingAgent
    traffic: ServiceTraffic

    def chains_of(self, segment: int) -> tuple[int, ...]:
        return tuple(self.segmentation.segments[segment])

    def undrained_loops(self, epoch: int) -> list[dict[str, Any]]:
        """Loops (cyclic segments) that hold ``epoch`` back: everything upstream has passed
        it, but records of an epoch <= ``epoch`` are still going round inside. In tracker
        mode such an epoch ends only when its loop drains, so a loop that never drains
        holds its epoch (and, through the firm bounds, every later one) forever."""
        seg, agent = self.segmentation, self.agent
        out = []
        for s, cyclic in enumerate(seg.cyclic):
            if not cyclic or agent.bound(s) >= epoch or agent.cap(s) < epoch:
                continue
            flight = {e: bal for e, (_x, bal) in agent.in_flight(s).items() if e <= epoch}
            out.append({"segment": s, "chains": list(seg.segments[s]), "bound": agent.bound(s),
                        "in_flight": {str(e): bal for e, bal in flight.items()}})
        return out

    def notes(self, neoss) -> list[tuple[tuple[int, ...], Any]]:
        """(chains, note) per notification that has receivers (source segments have none):
        the epoch of a NEOSS, or the ``WindowEnd`` itself; tasks take both through ``on_neoss``."""
        return [(self.chains_of(n.segment), n.epoch if type(n) is NEOSS else n)
                for n in neoss if self.agent.processes.get(n.segment)]


def uses_event_time(pipeline) -> bool:
    """Some source has timestamps: batches carry time labels and timers can fire (tracker mode)."""
    return pipeline is not None and any(getattr(s, "timestamp", None) is not None for s in pipeline.sources.values())


def firing_segments(plan: PhysicalPlan, seg_of: dict[int, int]) -> dict[int, list[TaskId]]:
    """Segments with an operator that declares event-time use -> their processes (tasks)."""
    firing: dict[int, list[TaskId]] = {}
    for c in plan.chains:
        if any(getattr(plan.nodes[n].payload, "uses_event_time", False) for n in c.nodes
               if plan.nodes[n].kind == OpKind.PROCESS):
            firing.setdefault(seg_of[c.id], [])
    for c in plan.chains:
        if seg_of[c.id] in firing:
            firing[seg_of[c.id]].extend((c.id, s) for s in range(plan.parallelism))
    return firing


def make_tracking(plan: PhysicalPlan, restored: Restored | None, traffic: ServiceTraffic,
                  pipeline=None, attempt: str = "") -> Tracking:
    """Segments of the chain graph and a tracking agent that starts at the restored epoch
    (with a time dimension when ``pipeline`` uses event time)."""
    segmentation = build_segments(*chain_graph(plan))
    seg_of = segmentation.segment_of
    p = plan.parallelism
    promisers: dict[int, list[TaskId]] = {}
    processes: dict[int, list[str]] = {}
    for c in plan.chains:
        # a worker hosts one task of every chain: NEOSS of one agent step go to it in one message;
        # source chains end their epochs themselves and get none
        if not c.is_source:
            processes[seg_of[c.id]] = [f"worker-{w}" for w in range(p)]
        if c.is_source:
            promisers.setdefault(seg_of[c.id], []).extend((c.id, s) for s in range(p))
    firing = firing_segments(plan, seg_of) if uses_event_time(pipeline) else None
    agent = TrackingAgent(segmentation, promisers, last_closed=restored.epoch if restored else 0,
                          processes=processes, traffic=traffic, firing=firing,
                          token_seed=_ids_seed(attempt, (-1, -1)))
    return Tracking(segmentation, agent, traffic)


def new_local_tracker(pipeline, worker: int, now: float) -> LocalTracker:
    cfg = pipeline.tracker
    return LocalTracker(worker, aggregate=cfg.aggregate, flush_interval=cfg.flush_interval,
                        flush_count=cfg.flush_count, now=now)


def _ids_seed(attempt: str, tid: TaskId) -> int:
    return int.from_bytes(hashlib.blake2b(f"{attempt}/{tid}".encode(), digest_size=8).digest(), "little")


def build_tasks(
    pipeline,
    plan: PhysicalPlan,
    worker: int | None,
    storage,
    restored: Restored | None,
    gate_factory: Callable[[list[int]], Any] | None = None,
    trackers: dict[int, LocalTracker] | None = None,
    attempt: str = "",
) -> dict[TaskId, Task]:
    """The tasks of one worker (or all, if ``worker`` is None), with restored state.

    In trAcker mode ``trackers`` maps each worker to its local tracker."""
    exactly_once = pipeline.mode != "at-least-once"
    start_epoch = restored.epoch + 1 if restored else 1
    offsets: dict[str, dict[int, int]] = {}
    if restored:
        for uid, s in restored.manifest["sources"].items():
            offsets[uid] = {int(k): int(v) for k, v in s["offsets"].items()}
    tasks: dict[TaskId, Task] = {}
    cfg = pipeline.checkpoint
    tracker_mode = pipeline.mode == "tracker"
    event_time = uses_event_time(pipeline)
    slack = pipeline.tracker.time_slack if event_time else None
    if tracker_mode:
        seg_of = build_segments(*chain_graph(plan)).segment_of
    for tid in plan.tasks:
        if worker is not None and plan.worker_of(tid) != worker:
            continue
        chain = ChainRuntime(plan, plan.chains[tid[0]], tid[1], Context, event_time=event_time)
        if restored:
            for uid, state in chain.states.items():
                entry = restored.manifest["operators"].get(uid)
                if entry is None:
                    continue
                # keyed state moves by key group: read only the rows of this subtask's range
                rows = (restored.reader or storage).read_operator_rows(restored.manifest, restored.root, uid,
                                                                       state.key_group_range)
                state.restore_rows(rows, entry.get("states", {}))
                state.event_time = entry.get("event_time", state.event_time)
                for name, value in _operator_state(restored, uid, plan.parallelism, tid[1]).items():
                    chain.operator_states[uid].restore(name, *value)
        chain.open(start_epoch)
        tracking = None
        if tracker_mode:
            gate = FirmBoundGate(seg_of[tid[0]], last_closed=start_epoch - 1)
            out_segment = {ch: seg_of[plan.channels[ch].dst[0]] for chans in plan.outputs[tid] for ch in chans}
            tracking = TaskTracking(trackers[tid[1]], seg_of[tid[0]], out_segment, BatchIds(_ids_seed(attempt, tid)),
                                    slack)
        else:
            gate = (gate_factory or (lambda chans: BarrierAligner(chans, exactly_once)))(plan.inputs[tid])
            if isinstance(gate, BarrierAligner):
                gate.reset(start_epoch - 1)
        kind = LoopHeadTask if plan.chains[tid[0]].is_loop_head else Task
        tasks[tid] = kind(plan, tid, chain, gate, start_epoch, cfg.incremental, cfg.full_every, offsets, tracking,
                          None if tracker_mode else slack)
    return tasks


def _operator_state(restored: Restored, uid: str, parallelism: int, subtask: int) -> dict[str, tuple[str, Any]]:
    """Operator state of ``uid`` for one new subtask, redistributed by each state's mode."""
    old_p = int(restored.manifest["parallelism"])
    out = {}
    for name, (mode, parts) in operator_state_parts(restored.manifest, uid).items():
        try:
            values = {s: pickle.loads(data) for s, data in parts.items()}
        except Exception as exc:
            raise CheckpointError(f"{restored.path}: operator state {name!r} of {uid!r} cannot be read: {exc!r}") from None
        out[name] = (mode, redistribute(mode, values, old_p, parallelism)[subtask])
    return out


# ---------------------------------------------------------------- persistence (pre-commit)


class SinkStagingError(Exception):
    """Staging sink output failed: the epoch's output would be lost, so the job fails over."""


class StateWriteError(Exception):
    """Writing a state file failed: the task declines the epoch (a tolerable failure).

    ``staged`` is the sink output already pre-committed for the epoch: it must still
    commit with the next completed epoch, so the decline carries it to the job master.
    """

    def __init__(self, message: str, staged: dict[str, tuple[str, ...]]) -> None:
        super().__init__(message)
        self.staged = staged


def persist(storage, sinks: dict[str, Any], capture: TaskCapture, attempt: str,
            fail_state_write: Callable[[], None] | None = None) -> AckInfo:
    """Pre-commit a task's capture: stage sink output first, then write state files.

    Sink output goes first because it cannot be produced again without a rollback; a
    failed state write only costs this epoch (the task's next capture is full).
    """
    t0 = time.perf_counter()
    staged: dict[str, tuple[str, ...]] = {}
    for sc in capture.sinks:
        try:
            rel = sinks[sc.sink_uid].pre_commit(sc.sink_uid, capture.task[1], sc.epoch, attempt, sc.records)
        except Exception as exc:
            raise SinkStagingError(f"sink {sc.sink_uid!r} could not stage epoch {sc.epoch}: {exc}") from exc
        staged[sc.sink_uid] = (rel,) if rel else ()
    files = []
    chains: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, dict[str, str]] = {}
    types: dict[str, dict[str, Any]] = {}
    size = 0
    for kc in capture.keyed:
        try:
            if fail_state_write is not None:
                fail_state_write()
            ref = storage.pre_commit(kc.operator_uid, capture.task[1], capture.epoch, attempt, kc.rows,
                                      kc.key_group_range, kc.full)
        except Exception as exc:
            raise StateWriteError(
                f"state of {kc.operator_uid!r} subtask {capture.task[1]} for epoch {capture.epoch}: "
                f"{type(exc).__name__}: {exc}",
                staged,
            ) from exc
        files.append(ref)
        chains[kc.operator_uid] = kc.chain
        kinds[kc.operator_uid] = dict(kc.kinds)
        if kc.types or kc.key_type is not None:
            types[kc.operator_uid] = dict(kc.types, **({"": kc.key_type} if kc.key_type is not None else {}))
        size += ref.bytes
    return AckInfo(
        capture.task, capture.epoch, tuple(files), chains, kinds, capture.offsets, staged, size,
        capture.alignment_seconds, time.perf_counter() - t0, capture.held_records,
        event_time={kc.operator_uid: kc.event_time for kc in capture.keyed if kc.event_time is not None},
        captured_at=capture.captured_at, operator_state=capture.operator_state,
        loop_log_records=capture.loop_log_records, loop_log_bytes=capture.loop_log_bytes, types=types,
    )


# ---------------------------------------------------------------- job master


@dataclass
class MasterOutput:
    """What the job master wants the driver to do."""

    triggers: list[TriggerEpoch] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    failover: str | None = None


class JobMaster:
    def __init__(
        self,
        pipeline,
        plan: PhysicalPlan,
        storage,
        restored: Restored | None,
        now: float,
        fail_point: FailPoint = _no_fail,
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
        self.retained: list[dict[str, Any]] = []
        for epoch in storage.list_checkpoints():
            try:
                self.retained.append(storage.load_manifest(epoch)[0])
            except CheckpointError:
                continue
        self.finished = False
        self.completed: list[int] = []
        self.epoch_log: list[dict[str, Any]] = []
        #: tracker mode: epoch -> loops still holding it (``Tracking.undrained_loops``), asked on a timeout
        self.explain_timeout: Callable[[int], list[dict[str, Any]]] | None = None
        #: the final epoch must cut through empty loops (a bounded job whose sources are exhausted)
        self.drain_final = False

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
        request.epoch = actions[0].epoch
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
            manifest = self.builder.build(a.epoch, a.kind, a.acks, {"created_at": created})
        except IncompleteChainError as exc:
            return self.coordinator.manifest_failed(a.epoch, str(exc), now)
        manifest["metrics"].update(self._epoch_metrics(a, now))
        for uid, sink in self.sinks.items():  # transaction ids of sinks that commit once per epoch
            if getattr(sink, "epoch_transactions", False) and uid in manifest["sinks"]:
                manifest["sinks"][uid]["delta"] = sink.manifest_entry(uid)
        self.fail_point("before_manifest")
        try:
            self.storage.commit(manifest)
        except StorageAccessError:
            raise  # credentials or permissions: no later epoch can do better
        except OSError as exc:
            return self.coordinator.manifest_failed(a.epoch, f"{type(exc).__name__}: {exc}", now)
        self.fail_point("after_manifest")
        self.manifests[a.epoch] = manifest
        # a final epoch whose loop heads logged records in transit has not drained its loops:
        # the job goes on (another final epoch) until one cuts through empty loops
        logged = manifest["metrics"].get("loop_log_records", 0)
        drained = not (self.drain_final and logged)
        if not drained and a.kind == FINAL:
            log.info("final epoch %d cut through %d records still in loops; another final epoch follows", a.epoch, logged)
        return self.coordinator.manifest_written(a.epoch, now, drained=drained)

    def _epoch_metrics(self, a: CompleteEpoch, now: float) -> dict[str, Any]:
        """What the manifest records about how epoch ``a.epoch`` went (beyond bytes and files):
        when it was triggered, how long until every task had acked, each task's alignment (or
        trAcker hold), write time, bytes and held records, and the service messages it cost."""
        rec = self.coordinator.epochs[a.epoch]
        tasks = {}
        for tid, info in sorted(a.acks.items()):
            tasks[f"{tid[0]}.{tid[1]}"] = {
                "alignment_seconds": round(info.alignment_seconds, 6),
                "write_seconds": round(info.write_seconds, 6),
                "ack_seconds": round(rec.ack_times.get(tid, now) - rec.triggered_at, 6),
                "bytes": info.bytes,
                "held_records": info.held_records,
            }
        messages = {"triggers": self.trigger_messages, "acks": len(a.acks)}
        if self.pipeline.mode == "tracker":
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
        t_commit = time.perf_counter()
        commit_state = getattr(self.storage, "commit_epoch", None)
        if commit_state is not None:  # Delta: one transaction per operator, before the sinks
            commit_state(manifest, self.fail_point)
        first = commit_state is None
        for uid, entry in sorted(manifest["sinks"].items()):
            if getattr(self.sinks[uid], "epoch_transactions", False):
                if not first:
                    self.fail_point("mid_commit")
                first = False
                self.sinks[uid].commit_epoch(uid, epoch, entry["staged"])
                continue
            for rel in entry["staged"]:
                if not first:
                    self.fail_point("mid_commit")
                first = False
                self.sinks[uid].commit([rel])
        commit_seconds = time.perf_counter() - t_commit
        self.fail_point("after_commit")
        self._take_savepoint(epoch, manifest)
        self.builder.completed(epoch, manifest)
        self.completed.append(epoch)
        rec = self.coordinator.epochs[epoch]
        self.epoch_log.append({
            "epoch": epoch, "state": "completed", "kind": rec.kind,
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
            folder = write_savepoint(self.storage, manifest, self.storage.root, req.target, self.job_id)
        except (OSError, CheckpointError) as exc:
            log.error("savepoint of epoch %d failed: %s", epoch, exc)
            req.fail(f"writing the savepoint of epoch {epoch} failed: {type(exc).__name__}: {exc}")
            return
        log.info("savepoint of epoch %d written to %s", epoch, folder)
        self.written.append(str(folder))
        req.complete(str(folder))


# ---------------------------------------------------------------- drivers


def _retryable(exc: BaseException) -> bool:
    """Failures a restart can cure; a damaged checkpoint or an impossible set-up cannot."""
    if isinstance(exc, (CheckpointError, ConfigurationError)):
        return False
    return isinstance(exc, (Failover, InjectedFailure, SinkStagingError, EpochStreamError))


class Driver:
    """What every driver shares: failure injection, run bookkeeping, the restart strategy.

    A subclass supplies ``attempt`` (run the job once from ``restored`` until it finishes or
    raises), ``clock`` (seconds since the run began, real or virtual) and ``pause`` (wait
    the restart delay).
    """

    def __init__(self, pipeline, storage, failures: FailureSchedule | None, parallelism: int | None,
                 savepoint_dir: str | None = None, stop_with_savepoint: bool = False) -> None:
        self.pipeline = pipeline
        self.plan = pipeline.plan(parallelism)
        if self.plan.loops and uses_event_time(pipeline):
            # a loop's entry would wait for a watermark (or time bound) from its own loop head
            raise ConfigurationError(
                f"event time (a source with timestamps) is not supported in a pipeline with loops "
                f"{[lp.uid for lp in self.plan.loops]}: time cannot progress round a cycle yet"
            )
        self.storage = storage
        #: Flink-style 32-hex job id, new for every run (never from a seeded generator)
        self.job_id = secrets.token_hex(16)
        #: default target of savepoints (Flink's execution.checkpointing.savepoint-dir)
        self.savepoint_dir = str(location(savepoint_dir)) if savepoint_dir else None
        #: a stop asked for (at the end of ``duration`` or of bounded input, or over REST); with a
        #: target the final epoch becomes a savepoint
        self.stop_request: SavepointRequest | None = None
        if stop_with_savepoint:
            if not savepoint_dir:
                raise ConfigurationError("stop_with_savepoint needs a savepoint_dir")
            self.stop_request = SavepointRequest(self.savepoint_dir, stop=True)
        #: savepoint folders written during the run
        self.savepoints_written: list[str] = []
        self.master: JobMaster | None = None
        self.failures = failures or FailureSchedule()
        self.restarts = 0
        self.point_counts: dict[str, int] = {}
        self.kills_done = 0
        self.injected = 0  # failures actually injected (kills, fail points, write failures)
        self.failover_log: list[dict[str, Any]] = []
        self.epoch_log: list[dict[str, Any]] = []
        self.completed: list[int] = []
        self.records_in = 0
        self.last_failure: float | None = None
        self._next_delay: float | None = None
        #: service messages of the whole run (markers, SND/RCV reports, promises, NEOSS)
        self.traffic = ServiceTraffic()

    def fail_point(self, name: str) -> None:
        n = self.point_counts[name] = self.point_counts.get(name, 0) + 1
        if n in self.failures.fail_points.get(name, ()):
            self.injected += 1
            raise InjectedFailure(f"injected crash at {name} (occurrence {n})")

    def clock(self) -> float:
        raise NotImplementedError

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` before the next attempt (real or virtual time)."""
        raise NotImplementedError

    def attempt(self, restored: Restored | None, attempt_id: str, duration: float | None) -> None:
        raise NotImplementedError

    def prepare(self, restore: str | None, allow_non_restored_state: bool) -> Restored | None:
        """Find and check what the run starts from (before anything is started or written)."""
        restored = find_restore(self.storage, restore)
        if restored:
            check_compatible(self.plan, self.pipeline, restored, allow_non_restored_state)
        resolve_sources(self.plan, self.pipeline, restored)
        return restored

    def run(self, restore: str | None, allow_non_restored_state: bool, duration: float | None,
            prepared: Restored | None | bool = False) -> None:
        """Run under the pipeline's restart strategy (``deploy.restart``; tenacity drives the
        loop): on a failure, roll back to the latest completed checkpoint (or the one the run
        started from) and try again while the strategy allows. A damaged checkpoint or an
        impossible set-up is not retried. ``prepared``: the result of ``prepare`` if the
        driver called it already."""
        restored = self.prepare(restore, allow_non_restored_state) if prepared is False else prepared
        initial = restored
        run_id = secrets.token_hex(4)  # unique file names per run, never from a seeded rng
        strategy = self.pipeline.restart_strategy
        failure_times: list[float] = []
        current = {"restored": restored}

        def once() -> None:
            recover(self.storage, self.pipeline.sinks, current["restored"], self.fail_point, self.pipeline.name)
            self.attempt(current["restored"], f"{run_id}.{self.restarts}", duration)

        def failed(state: tenacity.RetryCallState) -> None:  # after every retryable failure
            exc = state.outcome.exception()
            reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
            if self.master is not None:  # savepoints in flight die with the attempt (a stop stays asked)
                for req in self.master.savepoints.values():
                    req.fail(f"the job failed over before the savepoint completed: {reason.splitlines()[0]}")
            self.last_failure = self.clock()
            failure_times.append(self.last_failure)
            self.failover_log.append({"time": self.last_failure, "reason": reason})
            log.warning("job %s failing over: %s", self.pipeline.name, reason.splitlines()[0])
            self.restarts += 1
            self._next_delay = strategy.decide(failure_times, self.last_failure)

        def give_up(state: tenacity.RetryCallState) -> bool:
            return self._next_delay is None

        def restore_latest(state: tenacity.RetryCallState) -> None:
            current["restored"] = find_restore(self.storage, "latest") or initial
            resolve_sources(self.plan, self.pipeline, current["restored"])

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_retryable),
            stop=give_up,
            wait=lambda state: self._next_delay or 0.0,
            sleep=self.pause,
            after=failed,
            before_sleep=restore_latest,
            reraise=False,
        )
        try:
            retrying(once)
        except tenacity.RetryError as err:
            exc = err.last_attempt.exception()
            self.restarts -= 1  # the failure the strategy refused is not a restart
            reason = self.failover_log[-1]["reason"]
            raise JobFailedError(
                f"job {self.pipeline.name!r} failed: {strategy.describe()} (restarts: {self.restarts}); "
                f"last failure: {reason}"
            ) from exc

    def collect(self, master: JobMaster) -> None:
        """Move what the job master finished into the run's record."""
        if master.completed:
            self.completed.extend(master.completed)
            master.completed = []
        if master.epoch_log:
            self.epoch_log.extend(master.epoch_log)
            master.epoch_log = []
        if master.written:
            self.savepoints_written.extend(master.written)
            master.written = []

    def new_master(self, restored: Restored | None, now: float, deployment: str,
                   traffic: ServiceTraffic | None = None, workers: int | None = None) -> JobMaster:
        self.master = JobMaster(self.pipeline, self.plan, self.storage, restored, now, self.fail_point, deployment,
                                job_id=self.job_id, stop_request=self.stop_request, traffic=traffic, workers=workers)
        return self.master
