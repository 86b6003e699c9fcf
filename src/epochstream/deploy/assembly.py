"""Assembling an attempt's tasks: chains with their restored state, gates and trackers.

``build_tasks`` turns the physical plan into the tasks of one worker (or of all, for the
simulator), each at the epoch after the restored one: keyed state is read by key group
(only this subtask's range), operator state is redistributed by its mode
(``snapshot.rescale``), source offsets come from the manifest, and every task gets the
gate of the job's mode (a ``BarrierAligner`` in the aligned modes, a ``FirmBoundGate`` with
its ``TaskTracking`` in trAcker mode).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, cast

from ..alignment import BarrierAligner, UnalignedGate
from ..alignment.channel_state import ChannelStateRecorder, decode_channel_state
from ..backends.rocksdb_state import keyed_state_factory
from ..graph.plan import PhysicalPlan
from ..loops.task import LoopHeadTask
from ..runtime.chain import ChainRuntime
from ..runtime.context import Context
from ..runtime.errors import ProtocolError
from ..runtime.gate import Gate, Overtaking
from ..runtime.messages import TaskId
from ..runtime.modes import implications
from ..runtime.task import ConsumingTask, SourceTask, Task, TaskConfig
from ..runtime.tracking import TaskTracking
from ..snapshot.manifest import CheckpointError, channel_state_of, operator_state_parts
from ..snapshot.rescale import redistribute
from ..tracker.gate import FirmBoundGate
from ..tracker.local import BatchIds, LocalTracker
from .restore import Restored
from .tracking import ids_seed, tracking_segments, uses_event_time


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
    implies = implications(pipeline.mode)
    start_epoch = restored.epoch + 1 if restored else 1
    offsets: dict[str, dict[int, int]] = {}
    max_timestamps: dict[str, dict[int, float]] = {}
    if restored:
        for uid, s in restored.view.sources.items():
            offsets[uid] = dict(s.offsets)
            if s.max_timestamps:  # where each split's watermark resumes (bounded out-of-orderness)
                max_timestamps[uid] = dict(s.max_timestamps)
    tasks: dict[TaskId, Task] = {}
    cfg = pipeline.checkpoint
    tracker_mode = implies.tracks
    #: aligned with a timeout (``Pipeline.aligned_timeout``): epochs start aligned, go unaligned on time-out
    timeout = getattr(pipeline, "aligned_timeout", None)
    event_time = uses_event_time(pipeline)
    slack = pipeline.tracker.time_slack if event_time else None
    if tracker_mode:
        segmentation = tracking_segments(plan, pipeline)
        seg_of, cyclic = segmentation.segment_of, segmentation.cyclic
        merged = {c for seg in segmentation.segments if len(seg) > 1 and not segmentation.cyclic[seg_of[seg[0]]]
                  for c in seg}
        #: stateless chains process records of any epoch at once (``ConsumingTask.pass_through``)
        pass_through = pipeline.tracker.pass_through and not event_time
    keyed_state = keyed_state_factory(cfg)  # hashmap (None) or rocksdb
    for tid in plan.tasks:
        if worker is not None and plan.worker_of(tid) != worker:
            continue
        chain = ChainRuntime(plan, plan.chains[tid[0]], tid[1], Context, event_time=event_time,
                             keyed_state=keyed_state)
        if restored:
            _restore_chain(chain, restored, storage, plan.parallelism, tid[1])
        chain.open(start_epoch)
        tracking = None
        gate: Gate
        if tracker_mode:
            if trackers is None:
                raise ValueError("build_tasks: trAcker mode needs each worker's LocalTracker (trackers=...)")
            through = pass_through and chain.stateless and not cyclic[seg_of[tid[0]]] \
                and not plan.chains[tid[0]].is_source and not plan.chains[tid[0]].is_loop_head
            if tid[0] in merged and not through:
                raise ProtocolError("build_tasks", f"chain {tid[0]} shares segment {seg_of[tid[0]]}",
                                    "open", "a chain merged into a pass-through segment must pass through "
                                    "(the plan called it stateless, the opened chain is not)")
            gate = FirmBoundGate(seg_of[tid[0]], last_closed=start_epoch - 1, firm=not through)
            out_segment = {ch: seg_of[plan.channels[ch].dst[0]] for chans in plan.outputs[tid] for ch in chans}
            tracking = TaskTracking(trackers[tid[1]], seg_of[tid[0]], out_segment, BatchIds(ids_seed(attempt, tid)),
                                    slack)
        elif gates_overtake(pipeline.mode, timeout) and gate_factory is None and not plan.chains[tid[0]].is_loop_head:
            gate = UnalignedGate(plan.inputs[tid], last_completed=start_epoch - 1, aligned_timeout=timeout)
        else:
            gate = (gate_factory or (lambda chans: BarrierAligner(chans, implies.exactly_once)))(plan.inputs[tid])
            if isinstance(gate, BarrierAligner):
                gate.reset(start_epoch - 1)
        config = TaskConfig(start_epoch=start_epoch, incremental=cfg.incremental, full_every=cfg.full_every,
                            source_offsets=offsets, tracking=tracking, event_time_slack=None if tracker_mode else slack,
                            batching=getattr(pipeline, "batching", None), source_max_timestamps=max_timestamps)
        task = tasks[tid] = _task(plan, tid, chain, gate, config)
        if restored:
            _restore_channel_state(task, restored, pipeline.mode)
    return tasks


def gates_overtake(mode: str, aligned_timeout: float | None) -> bool:
    """Do a job's gates take markers early (``UnalignedGate``: unaligned, or aligned with a
    timeout)? Loop heads aside, which align on their phantom channel."""
    return implications(mode).overtakes or aligned_timeout is not None


def _task(plan: PhysicalPlan, tid: TaskId, chain: ChainRuntime, gate: Gate, config: TaskConfig) -> Task:
    """The task of ``tid``'s role: it reads a source, or it consumes (a loop head, or any other
    chain; with a channel-state recorder when its gate overtakes, passing through in trAcker
    mode when its gate is soft)."""
    spec = plan.chains[tid[0]]
    if spec.is_source:
        return SourceTask(plan, tid, chain, config)
    recorder = ChannelStateRecorder(cast(Overtaking, gate), tid) if gate.overtakes else None
    kind = LoopHeadTask if spec.is_loop_head else ConsumingTask
    task = kind(plan, tid, chain, gate, config, recorder)
    if config.tracking is not None and not gate.exactly_once:
        task.pass_through()
    return task


def _restore_channel_state(task: Task, restored: Restored, mode: str) -> None:
    """Unaligned mode's channel state of ``task``: replayed before any new input."""
    blob = channel_state_of(restored.manifest, task.id)
    if not blob:
        return
    if implications(mode).tracks:
        raise CheckpointError(
            f"{restored.path} is an unaligned snapshot with channel state (task {task.id}); trAcker mode cannot "
            f"replay it: restore it with mode 'unaligned' or 'aligned', then switch modes from a later checkpoint")
    try:
        entries = decode_channel_state(blob)
    except Exception as exc:
        raise CheckpointError(f"{restored.path}: channel state of task {task.id} cannot be read: {exc!r}") from None
    try:
        task.restore_channel_state(entries)
    except ProtocolError as exc:  # the job's graph changed: channel ids no longer match
        raise CheckpointError(
            f"{restored.path}: the channel state of task {task.id} names input channels this job does not have "
            f"({exc}); the pipeline's graph changed since the unaligned snapshot. Restore it with the graph it was "
            f"taken with, take a savepoint (savepoints hold no channel state) and restore that") from None


def _restore_chain(chain: ChainRuntime, restored: Restored, storage, parallelism: int, subtask: int) -> None:
    """Load the keyed and operator state of every operator of ``chain`` the checkpoint holds."""
    for uid, state in chain.states.items():
        entry = restored.manifest["operators"].get(uid)
        if entry is None:
            continue
        reader = restored.reader or storage
        kinds = entry.get("states", {})
        native = getattr(state, "restore_checkpoint", None)
        found = None
        if native is not None and hasattr(reader, "native_checkpoint"):
            found = reader.native_checkpoint(restored.manifest, restored.root, uid, state.key_group_range)
        if native is not None and found is not None:  # one RocksDB checkpoint holds the range: open it as the DB
            ref, handle, base = found
            own = restored.reader is None and str(base) == str(storage.root)
            native(reader.store, base, ref, handle, kinds, reuse_files=own)
        else:  # keyed state moves by key group: read only the rows of this subtask's range
            rows = reader.read_operator_rows(restored.manifest, restored.root, uid, state.key_group_range)
            state.restore_rows(rows, kinds)
        state.event_time = entry.get("event_time", state.event_time)
        for name, value in _operator_state(restored, uid, parallelism, subtask).items():
            chain.operator_states[uid].restore(name, *value)


def _operator_state(restored: Restored, uid: str, parallelism: int, subtask: int) -> dict[str, tuple[str, Any]]:
    """Operator state of ``uid`` for one new subtask, redistributed by each state's mode."""
    old_p = restored.view.parallelism
    out = {}
    for name, (mode, parts) in operator_state_parts(restored.manifest, uid).items():
        try:
            values = {s: pickle.loads(data) for s, data in parts.items()}
        except Exception as exc:
            raise CheckpointError(
                f"{restored.path}: operator state {name!r} of {uid!r} cannot be read: {exc!r}") from None
        out[name] = (mode, redistribute(mode, values, old_p, parallelism)[subtask])
    return out
