"""Where a run starts from: choosing a completed checkpoint and making it safe to run on.

``find_restore`` picks the checkpoint or savepoint (``"latest"`` or a path, possibly in
another store); ``check_compatible`` refuses one the pipeline cannot take over, naming what
differs; ``resolve_sources`` settles elastic sources' split counts from it; ``recover``
finishes the commits its manifest promised and clears what later, unfinished epochs left
behind. The drivers call ``recover`` before every attempt, so a rollback after a failover is
the same code as a restore at start-up; ``assembly.build_tasks`` then reads the state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..backends import location, open_storage, scheme_of
from ..backends.base import commits_in_subtasks
from ..graph.kinds import OpKind
from ..graph.plan import PhysicalPlan
from ..snapshot.failpoints import FailPointName
from ..snapshot.manifest import CheckpointError
from ..snapshot.manifest_view import ManifestView
from .failures import FailPoint, no_fail

log = logging.getLogger("epochstream")


@dataclass
class Restored:
    """A completed checkpoint chosen for (re)start."""

    epoch: int
    manifest: dict[str, Any]
    root: Any
    path: Any
    #: the storage that reads it, if not the job's own (a savepoint in another store, e.g. S3)
    reader: Any = None

    @cached_property
    def view(self) -> ManifestView:
        """The manifest's fields, typed (read once; the manifest was validated when loaded)."""
        return ManifestView.of(self.manifest)


def find_restore(storage, restore: str | None) -> Restored | None:
    """The checkpoint ``restore`` names (None: start empty; ``"latest"``: the newest completed
    one in ``storage``, None if there is none; else a checkpoint or savepoint path)."""
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
    view = ManifestView.of(manifest)
    epoch = view.epoch
    newer = [e for e in storage.list_checkpoints() if e > epoch]
    if restore != "latest" and newer and root.resolve() == storage.root.resolve():
        raise CheckpointError(
            f"cannot restore chk-{epoch} into {storage.root}: it already holds newer checkpoints "
            f"{newer[:5]} that new epochs would overwrite; restore it into a new checkpoint dir "
            f"(checkpoint_dir=NEW, restore='{root / f'chk-{epoch}'}')"
        )
    restored = Restored(epoch, manifest, root, root if view.self_contained else root / f"chk-{epoch}", reader)
    restored.view = view  # the cached property, read once
    return restored


def check_compatible(plan: PhysicalPlan, pipeline, restored: Restored, allow_non_restored_state: bool,
                     allow_sources_from_start: bool = False) -> list[str]:
    """Refuse a checkpoint or savepoint this pipeline cannot take over, naming what differs.

    State maps to operators by uid, as in Flink: the job's name may differ (a renamed or
    forked job takes over its savepoint), but every uid that holds state in the checkpoint
    must exist in the pipeline as the same kind of operator, unless
    ``allow_non_restored_state`` drops the state of the missing ones. Max parallelism may
    never change: it fixes the key groups.

    The other way round, a source of the pipeline with no offsets in the checkpoint would
    start from the beginning and replay its whole input into sinks that already hold the
    output committed up to the checkpoint (a renamed uid does exactly that): refused unless
    ``allow_sources_from_start``. Returns what the restore drops and what starts empty,
    one line each (also logged as warnings)."""
    m = restored.view
    what = "savepoint" if m.is_savepoint else "checkpoint"
    where = f"{what} {restored.path}"
    other_job = m.job != pipeline.name
    origin = f" (a {what} of job {m.job!r}{', id ' + m.job_id if m.job_id else ''}; this job is " \
             f"{pipeline.name!r})" if other_job else ""
    if m.max_parallelism != plan.max_parallelism:
        raise CheckpointError(
            f"{where} was taken with max_parallelism {m.max_parallelism}, the job now has "
            f"{plan.max_parallelism}: max parallelism fixes the key groups and cannot change once state exists; "
            f"restore with max_parallelism={m.max_parallelism} (--max-parallelism {m.max_parallelism}) "
            f"at any parallelism up to it"
        )
    if m.has_channel_state and m.parallelism != plan.parallelism:
        raise CheckpointError(
            f"{where} is an unaligned snapshot holding channel state (records in flight at the cut, "
            f"{m.metrics.get('channel_state_records', '?')} records) taken at parallelism {m.parallelism}; "
            f"channel state is kept per input channel and cannot be moved to parallelism {plan.parallelism}. "
            f"Restore it at parallelism {m.parallelism} (--parallelism {m.parallelism}), take a savepoint "
            f"(savepoints and stops with savepoint are aligned in every mode and hold no channel state) and "
            f"restore that savepoint at "
            f"parallelism {plan.parallelism}"
        )
    nodes = {n.uid: n for n in plan.nodes.values() if n.uid}
    held = {**{uid: OpKind.PROCESS for uid in m.operators}, **{uid: OpKind.SOURCE for uid in m.sources}}
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
    notes = []
    for uid in unknown:  # allowed by allow_non_restored_state, or refused above
        op = m.operators.get(uid)
        states = (op.states or op.operator_states) if op is not None else ()
        what_state = f"state {', '.join(repr(s) for s in states)}" if states else (
            "source offsets" if uid in m.sources else "state")
        notes.append(f"dropping {what_state} of operator {uid!r} (not in the pipeline)")
    stateful = sorted(uid for uid, n in nodes.items() if kind_of[uid] == OpKind.PROCESS and uid not in held)
    notes.extend(f"operator {uid!r} has no state in the {what}: it starts empty" for uid in stateful)
    fresh = sorted(uid for uid in pipeline.sources if uid not in m.sources)
    if fresh and pipeline.sinks and not allow_sources_from_start:
        raise CheckpointError(
            f"{where}: source(s) {fresh} have no offsets in the {what} (it has {sorted(m.sources)}): they would "
            f"start from the beginning and replay their whole input into sinks {sorted(pipeline.sinks)} that already "
            f"hold the output committed up to epoch {m.epoch}. If a source's uid was renamed, give it back its "
            f"old uid; to replay on purpose pass allow_sources_from_start=True (--allow-sources-from-start)"
        )
    notes.extend(f"source {uid!r} has no offsets in the {what}: it starts from the beginning" for uid in fresh)
    for note in notes:
        log.warning("restore from %s: %s", where, note)
    for uid, src in pipeline.sources.items():
        splits = m.source_splits(uid)
        _adopt(src, m, uid)
        if splits is not None and src.grows and splits > src.num_splits:
            src.discover(0.0, force=True)  # partitions created since the pipeline was built
        if splits is not None and splits != src.num_splits and not src.elastic and \
                not (src.grows and splits < src.num_splits):
            raise CheckpointError(
                f"{where}: source {uid!r} had {splits} splits, the source now has {src.num_splits}; offsets are "
                f"kept per split, so the split count cannot change (build the source without splits= to adopt "
                f"the {what}'s count)"
            )
    return notes


def _adopt(src: Any, manifest: ManifestView, uid: str) -> None:
    """Let a source see the split ids the checkpoint holds offsets for (a Kafka source reads an
    older checkpoint's ids as they were written: ``KafkaSource.adopt_checkpoint``)."""
    adopt = getattr(src, "adopt_checkpoint", None)
    entry = manifest.sources.get(uid)
    if adopt is not None and entry is not None:
        adopt(entry.offsets.keys())


def resolve_sources(plan: PhysicalPlan, pipeline, restored: Restored | None) -> None:
    """Settle elastic sources' split counts: the checkpoint's on a restore, else the parallelism.

    Splits are then dealt to source subtasks by ``split % parallelism``, so a restore at
    another parallelism reassigns them with their offsets."""
    for uid, src in pipeline.sources.items():
        if restored:
            _adopt(src, restored.view, uid)
        want = restored.view.source_splits(uid) if restored else None
        if want is None:
            want = plan.parallelism if src.elastic else src.num_splits
        if src.grows and want > src.num_splits:
            src.discover(0.0, force=True)
        # a growing source keeps the splits it found since the checkpoint
        if want != src.num_splits and not (src.grows and want < src.num_splits):
            if not src.elastic:
                raise CheckpointError(f"source {uid!r} has {src.num_splits} splits, the checkpoint {want}")
            src.resplit(want)


def recover(storage, sinks: dict[str, Any], restored: Restored | None, fail_point: FailPoint = no_fail,
            job: str | None = None, parallelism: int = 1) -> None:
    """Finish what the restored checkpoint promised and clear what came after it.

    Commits named by the manifest are re-issued (idempotent): first the state commits of a
    storage that commits per epoch (Delta: ``recover_epoch``), then the sinks'; staged output
    of later epochs is dropped, and the storage deletes state files no manifest names and sets
    aside damaged checkpoints whose epochs will be written again (the ``recover`` verbs).
    Sinks that commit once per epoch (``epoch_transactions``) are started first with the
    restored manifest, which names their transaction ids; sinks whose subtasks commit
    (``commits_in_subtasks``) fence the producers that need it (the attempt runs at
    ``parallelism``) and produce again what Kafka lacks.
    """
    staged = restored.manifest["sinks"] if restored else {}
    if restored is not None:
        roll_back_newer_output(sinks, restored)
    recover_state = getattr(storage, "recover_epoch", None)
    if restored is not None and recover_state is not None and restored.reader is None:
        fail_point(FailPointName.RECOVERY)
        recover_state(restored.manifest, restored.root, fail_point)
    for uid, sink in sorted(sinks.items()):
        fail_point(FailPointName.RECOVERY)
        entry = staged.get(uid, {})
        manifest = restored.manifest if restored else None
        if commits_in_subtasks(sink):
            sink.start(uid, job or (restored.view.job if restored else "job"), manifest)
            slots = entry.get("transactions", {}).get("slots")
            sink.recover(uid, entry.get("staged", []), epoch=restored.epoch if restored else None,
                         previous=restored.view.parallelism if restored else 0, parallelism=parallelism,
                         slots=slots)
        elif getattr(sink, "epoch_transactions", False):
            sink.start(uid, job or (restored.view.job if restored else "job"), manifest)
            delta_epoch = restored.epoch if restored is not None and entry.get("delta") else None
            sink.recover(uid, entry.get("staged", []), epoch=delta_epoch)
        else:
            sink.recover(uid, entry.get("staged", []))
    storage.recover(restored.epoch if restored else None)


class RollbackError(CheckpointError):
    """A restore would replay epochs whose output a sink committed and cannot take back."""


def roll_back_newer_output(sinks: dict[str, Any], restored: Restored) -> None:
    """Take back committed output of epochs after the restored one, before the replay
    writes those epochs again (else it is duplicated, and the epoch numbers are reused
    with other content).

    A sink with ``roll_back(uid, epoch)`` sets that output aside (``FileSink``). A sink
    that can only tell which later epochs it committed (``committed_epochs_after(uid,
    epoch)``) and cannot take them back makes recovery refuse, naming the epochs and the
    way out. Sinks with neither are left as they are."""
    for uid, sink in sorted(sinks.items()):
        roll_back = getattr(sink, "roll_back", None)
        if roll_back is not None:
            roll_back(uid, restored.epoch)
            continue
        committed_after = getattr(sink, "committed_epochs_after", None)
        newer = committed_after(uid, restored.epoch) if committed_after is not None else []
        if newer:
            raise RollbackError(
                f"restoring epoch {restored.epoch} ({restored.path}) would replay epochs {newer[:10]} whose output "
                f"sink {uid!r} ({sink!r}) already committed and cannot take back, so it would be duplicated; "
                f"restore the newest checkpoint that holds epoch {newer[-1]} (repair or recover its "
                f"_metadata.json), or write to a new sink location"
            )
