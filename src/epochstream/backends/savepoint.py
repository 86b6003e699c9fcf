"""Savepoints: full, self-contained, relocatable copies of a completed epoch (Flink's canonical savepoint).

A checkpoint is the job's own recovery point: its state files may be increments that
build on files of earlier epochs, named relative to the checkpoint dir, and retention
deletes it. A savepoint is the user's: it is written from a completed checkpoint by
applying each operator subtask's file chain into ONE full file, and everything it needs
lies inside its folder, named by relative paths, so the folder can be copied or moved
anywhere and still restores::

    <target dir>/savepoint-<short job id>-<epoch>/
        _metadata.json                             manifest, kind "savepoint", self_contained
        shared/<uid>/<subtask>/e<epoch>-asavepoint.parquet   one full state file per operator subtask

Source offsets and operator state travel in the manifest. Sink output of the epoch was
committed before the savepoint is written, so a savepoint names no staged output: restoring
one re-commits nothing. The manifest is written last; a savepoint exists exactly when its
``_metadata.json`` does.
"""

from __future__ import annotations

import copy
import datetime as _dt
import pickle
from typing import Any, Iterable

from ..snapshot.manifest import FORMAT_VERSION, CheckpointError, encode_manifest
from ..snapshot.manifest_view import ManifestView
from . import location, open_object_storage, open_storage
from .base import Row
from .objects import METADATA, ObjectExistsError

SAVEPOINT = "savepoint"
PREFIX = "savepoint-"


def write_savepoint(storage, manifest: dict[str, Any], root: Any, target_dir: Any, job_id: str) -> Any:
    """Write a savepoint of the completed checkpoint ``manifest`` (its files under ``root``).

    Reads the checkpoint only through ``storage.read_operator_rows`` and writes through the
    target's own storage (a local folder, or any URL ``open_storage`` knows); returns the
    savepoint's location.
    """
    if not target_dir:
        raise CheckpointError("no savepoint target directory: pass one (or set savepoint_dir / --savepoint-dir)")
    target = location(target_dir)
    epoch = int(manifest["epoch"])
    folder = target / f"{PREFIX}{job_id[:6]}-{epoch}"
    out = open_object_storage(str(folder))
    n = 1
    while out.store.exists(folder / METADATA):  # never overwrite a savepoint
        n += 1
        folder = target / f"{PREFIX}{job_id[:6]}-{epoch}-{n}"
        out = open_object_storage(str(folder))
    try:
        return _write_into(storage, manifest, root, out, folder, job_id)
    except BaseException:
        # a savepoint that failed half-way leaves nothing: no state files, no temporary files
        # (the folder has no manifest, so it never was a savepoint; its name was free)
        try:
            out.store.delete_tree(folder)
            if hasattr(folder, "rmdir"):
                folder.rmdir()
        except OSError:
            pass
        raise


def _write_into(storage, manifest: dict[str, Any], root: Any, out, folder: Any, job_id: str) -> Any:
    epoch = int(manifest["epoch"])
    operators: dict[str, Any] = {}
    total = 0
    for uid, entry in manifest["operators"].items():
        new_entry = {k: copy.deepcopy(v) for k, v in entry.items() if k != "files"}
        new_entry["files"] = []
        by_subtask: dict[int, list[dict[str, Any]]] = {}
        for f in entry["files"]:
            by_subtask.setdefault(int(f["subtask"]), []).append(f)
        for subtask, files in sorted(by_subtask.items()):
            kg_range = tuple(files[0]["key_group_range"])
            only = {"operators": {uid: {"files": files}}}
            rows = _compact(storage.read_operator_rows(only, root, uid, kg_range))
            ref = out.pre_commit(uid, subtask, epoch, SAVEPOINT, rows, kg_range, True)
            new_entry["files"].append(ref.to_json())
            total += ref.bytes
        operators[uid] = new_entry
    sp = {k: copy.deepcopy(v) for k, v in manifest.items() if k not in ("operators", "sinks")}
    sp.update({
        "format_version": FORMAT_VERSION,
        "kind": SAVEPOINT,
        "self_contained": True,
        "job_id": manifest.get("job_id") or job_id,
        "operators": operators,
        # the epoch's output was committed before this savepoint was written: nothing to re-commit
        "sinks": {uid: {"staged": []} for uid in manifest["sinks"]},
        "savepoint": {
            "of_epoch_kind": manifest.get("kind"),
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "bytes": total,
        },
    })
    try:  # written last and only if absent: a savepoint exists exactly when its manifest does
        out.store.put_new(folder / METADATA, encode_manifest(sp))
    except ObjectExistsError:
        raise CheckpointError(f"savepoint {folder} was written by someone else meanwhile") from None
    return folder


def _compact(rows: Iterable[Row]) -> list[Row]:
    """Apply a file chain's rows in order (later rows win, ``None`` deletes) into full rows."""
    latest: dict[tuple[str, Any], Row] = {}
    for kg, kbytes, name, vbytes in rows:
        slot = (name, pickle.loads(kbytes))
        if vbytes is None:
            latest.pop(slot, None)
        else:
            latest[slot] = (kg, kbytes, name, vbytes)
    return list(latest.values())


def load_savepoint(path: Any) -> tuple[dict[str, Any], Any]:
    """The manifest and folder of a savepoint; a checkpoint or anything else raises CheckpointError."""
    loc = location(path)
    manifest, root = open_storage(str(loc.parent)).load_manifest(str(loc))
    if manifest.get("kind") != SAVEPOINT or not manifest.get("self_contained"):
        raise CheckpointError(
            f"{path} is not a savepoint (it is a checkpoint of job {manifest['job']!r}, epoch {manifest['epoch']}); "
            f"checkpoints are removed by retention, not by savepoint dispose"
        )
    return manifest, root


def dispose_savepoint(path: Any) -> Any:
    """Delete a savepoint folder (only a savepoint: anything else is refused and left alone)."""
    _manifest, root = load_savepoint(path)
    store = open_object_storage(str(root)).store
    store.delete(root / METADATA)  # first the commit point: a half-deleted savepoint is no savepoint
    store.delete_tree(root)
    return root


def list_savepoints(directory: Any) -> list[dict[str, Any]]:
    """One row per folder in ``directory`` that holds a savepoint (damaged ones flagged, not skipped)."""
    base = location(directory)
    store = open_object_storage(str(base)).store
    if not store.root_exists():  # a local folder; for S3 the bucket (an empty prefix simply lists nothing)
        raise CheckpointError(f"savepoint dir {base} does not exist")
    folders = sorted({key.split("/", 1)[0] for key in store.keys(base) if key.count("/") == 1
                      and key.endswith("/" + METADATA)})
    rows: list[dict[str, Any]] = []
    for name in folders:
        folder = base / name
        try:
            m, _root = load_savepoint(folder)
        except CheckpointError as exc:
            if name.startswith(PREFIX):
                rows.append({"path": str(folder), "status": "damaged", "error": str(exc)})
            continue
        view = ManifestView.of(m)
        files = view.state_files
        rows.append({
            "path": str(folder),
            "status": "completed",
            "job": view.job,
            "job_id": view.job_id,
            "epoch": view.epoch,
            "created_at": m.get("savepoint", {}).get("created_at") or view.created_at,
            "parallelism": view.parallelism,
            "max_parallelism": view.max_parallelism,
            "mode": view.mode,
            "operators": sorted(view.operators),
            "sources": sorted(view.sources),
            "state_files": len(files),
            "state_bytes": sum(f.bytes for f in files),
        })
    return rows
