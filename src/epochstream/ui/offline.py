"""A finished job's dashboard from its checkpoint folder: ``epochstream ui --checkpoint-dir DIR``.

The manifests a job leaves (the retained ones: ``CheckpointConfig.num_retained``) carry
each epoch's metrics (phases, per-task alignment or hold, bytes, source offsets) and the
job graph, so the same pages are served from them (``cli.cmd_ui`` runs the job's HTTP
server on them), read-only: the job's state is FINISHED and every POST answers 409. What
only a live job knows (the full epoch history, aborted epochs, restarts, service traffic
by kind) shows as far as the manifests record it.
"""

from __future__ import annotations

from typing import Any

from ..backends import open_storage
from ..snapshot.manifest import CheckpointError
from ..snapshot.manifest_view import ManifestView
from .app import Dashboard
from .model import dashboard


def checkpoint_rows(storage) -> list[dict[str, Any]]:
    """One row per checkpoint in ``storage``: epoch, status (``damaged`` with the error),
    kind, full or incremental, bytes, files, staged outputs, path."""
    rows: list[dict[str, Any]] = []
    for epoch in storage.list_checkpoints():
        try:
            m = ManifestView.of(storage.load_manifest(epoch)[0])
        except CheckpointError as exc:
            rows.append({"epoch": epoch, "status": "damaged", "error": str(exc)})
            continue
        except OSError:  # discarded (retention) between the listing and the read
            continue
        files = m.state_files
        metrics = m.metrics
        rows.append({
            "epoch": epoch, "status": "completed", "kind": m.kind, "path": str(storage.checkpoint_dir(epoch)),
            "created_at": m.created_at,
            "incremental": any(not f.full for f in files),
            "state_bytes": sum(f.bytes for f in files),
            "bytes": metrics.get("bytes", 0), "files": len(files),
            "duration_seconds": metrics.get("trigger_to_manifest_seconds"),
            "staged_outputs": sum(len(s) for s in m.staged.values()),
        })
    return rows


def status_from_manifests(storage) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The status a live job would publish, as far as its manifests tell; and the manifests."""
    manifests = []
    for epoch in storage.list_checkpoints():
        try:
            manifests.append(storage.load_manifest(epoch)[0])
        except CheckpointError:
            continue
    if not manifests:
        raise CheckpointError(f"{storage.root}: no readable checkpoint manifest: nothing to show")
    last = manifests[-1]
    epochs = []
    prev_total: int | None = None
    for m in manifests:
        total = sum(int(o) for s in m.get("sources", {}).values() for o in s.get("offsets", {}).values())
        epochs.append({"epoch": m["epoch"], "state": "completed", "kind": m.get("kind"),
                       "created_at": m.get("created_at"), "records": None if prev_total is None else total - prev_total,
                       **m.get("metrics", {})})
        prev_total = total
    traffic: dict[str, dict[str, int]] = {}
    for e in epochs:
        for kind, n in e.get("service_messages", {}).items():  # per-epoch counts, named as the live job's kinds
            name = {"markers": "marker", "triggers": "trigger", "acks": "ack"}.get(kind, kind)
            traffic.setdefault(name, {"messages": 0, "bytes": 0, "entries": 0})["messages"] += int(n)
    status = {
        "jid": last.get("job_id"), "name": last.get("job"), "state": "FINISHED", "mode": last.get("mode"),
        "deployment": last.get("deployment"), "parallelism": last.get("parallelism"),
        "max-parallelism": last.get("max_parallelism"), "checkpoint-dir": str(storage.root),
        "completed-epochs": len(manifests), "latest-epoch": last["epoch"], "epochs": epochs,
        "traffic": traffic, "restarts": 0,
    }
    return status, manifests


def offline_dashboard(checkpoint_dir: str) -> Dashboard:
    storage = open_storage(checkpoint_dir)
    if not storage.exists():
        raise CheckpointError(f"checkpoint dir {storage.root} does not exist")
    status, manifests = status_from_manifests(storage)
    graph = manifests[-1].get("graph")
    rows = checkpoint_rows(storage)
    doc = dashboard(status, graph, rows, live=False)
    return Dashboard(lambda: doc, cache_seconds=3600.0)
