"""The one document behind the dashboard, ``/metrics`` and the terminal's status line.

``dashboard(status, graph, checkpoints)`` turns a job's published status (live: the
driver's ``JobControl``; offline: ``offline.status_from_manifests``) into rows the page
plots: one per epoch (phases, per-task alignment or hold, bytes, input), per-task input
rates, service traffic by kind and the restarts. Live jobs add every task's throughput and
backpressure (``task_metrics``, from the workers' counters: ``runtime.meters``). Pure: no
I/O, no clock.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

#: the epoch-log fields the page reads, with the phase durations derived from them
PHASES = ("alignment_seconds_max", "write_seconds_max", "prepare_seconds", "manifest_seconds", "commit_seconds")


def _when(iso: Any) -> float | None:
    """Seconds since the epoch of an ISO timestamp (a manifest's ``created_at``), None if absent."""
    if not isinstance(iso, str):
        return None
    try:
        return _dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def epoch_row(entry: dict[str, Any]) -> dict[str, Any]:
    """One epoch of the log (completed or aborted) as the page plots it."""
    row: dict[str, Any] = {"epoch": entry.get("epoch"), "state": entry.get("state"), "kind": entry.get("kind")}
    if entry.get("state") != "completed":
        row["reason"] = entry.get("reason")
        return row
    prepare = entry.get("prepare_seconds") or 0.0
    to_manifest = entry.get("trigger_to_manifest_seconds") or prepare
    row.update({
        "created_at": entry.get("created_at"),
        "time": _when(entry.get("created_at")),
        "records": entry.get("records"),
        "bytes": entry.get("bytes", 0),
        "files": entry.get("files", 0),
        "alignment_seconds_max": entry.get("alignment_seconds_max", 0.0),
        "write_seconds_max": entry.get("write_seconds_max", 0.0),
        "prepare_seconds": prepare,
        "manifest_seconds": max(0.0, to_manifest - prepare),
        "commit_seconds": entry.get("commit_seconds"),
        "duration_seconds": entry.get("trigger_to_commit_seconds", to_manifest),
        "held_records": entry.get("held_records", 0),
        # unaligned mode: records the markers overtook, written with the snapshot
        "channel_state_records": entry.get("channel_state_records", 0),
        "channel_state_bytes": entry.get("channel_state_bytes", 0),
        "tasks": entry.get("tasks", {}),
        "service_messages": entry.get("service_messages", {}),
        "service_messages_total": entry.get("service_messages_total", 0),
    })
    return row


def task_rates(rows: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """Task -> records/s its sources read between consecutive completed epochs (None for the
    first epoch, whose start is not known); only tasks that read a source appear."""
    done = [r for r in rows if r["state"] == "completed"]
    tasks = sorted({t for r in done for t, info in r["tasks"].items() if info.get("source_offset")})
    out: dict[str, list[float | None]] = {t: [] for t in tasks}
    prev: dict[str, Any] | None = None
    for r in done:
        for t in tasks:
            rate = None
            if prev is not None and r["time"] is not None and prev["time"] is not None and r["time"] > prev["time"]:
                a = prev["tasks"].get(t, {}).get("source_offset")
                b = r["tasks"].get(t, {}).get("source_offset")
                if a is not None and b is not None:
                    rate = max(0, b - a) / (r["time"] - prev["time"])
            out[t].append(rate)
        prev = r
    return out


#: Flink's backpressure levels by the share of time blocked on output: up to 10% OK, up to 50% LOW
BACKPRESSURE_LEVELS = ((0.10, "OK"), (0.50, "LOW"), (1.0, "HIGH"))


def backpressure_level(ratio: float) -> str:
    """``OK``, ``LOW`` or ``HIGH`` for the share of time (0..1) a task was backpressured."""
    for bound, level in BACKPRESSURE_LEVELS:
        if ratio <= bound:
            return level
    return "HIGH"


def task_metrics(meters: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Task -> Flink's IO metrics from ``RunMeters.as_dict()``: ``records_in``/``records_out``
    (rows over the run), ``late_records_dropped`` (a source's late records, Flink's
    ``numLateRecordsDropped``), ``dead_letters`` (records ``from_json`` could not decode), their
    rates and the busy / backpressured / idle milliseconds per second
    over the last window, and the backpressure level (rates and shares None before a task's
    worker reported twice). The shares add up to 1000 ms/s: each is taken over the time the
    worker accounted, not over its clock, so a late round never makes them exceed a second."""
    out: dict[str, dict[str, Any]] = {}
    for task, m in meters.items():
        row: dict[str, Any] = {"records_in": m["records_in"], "records_out": m["records_out"],
                               "late_records_dropped": m.get("late_records_dropped", 0),
                               "dead_letters": m.get("dead_letters", 0),
                               "records_in_per_second": None, "records_out_per_second": None,
                               "busy_ms_per_second": None, "backpressured_ms_per_second": None,
                               "idle_ms_per_second": None, "backpressure": None, "window_seconds": None}
        w = m.get("window")
        if w:
            row["window_seconds"] = w["seconds"]
            row["records_in_per_second"] = w["records_in"] / w["seconds"]
            row["records_out_per_second"] = w["records_out"] / w["seconds"]
            accounted = w["busy_seconds"] + w["backpressured_seconds"] + w["idle_seconds"]
            if accounted > 0:
                for key in ("busy", "backpressured", "idle"):
                    row[f"{key}_ms_per_second"] = 1000.0 * w[f"{key}_seconds"] / accounted
                row["backpressure"] = backpressure_level(w["backpressured_seconds"] / accounted)
        out[task] = row
    return out


def dashboard(status: dict[str, Any], graph: dict[str, Any] | None, checkpoints: list[dict[str, Any]],
              live: bool = True) -> dict[str, Any]:
    """The page's data: job summary, graph, epochs, checkpoints, rates, traffic, restarts."""
    rows = [epoch_row(e) for e in status.get("epochs", [])]
    done = [r for r in rows if r["state"] == "completed"]
    last = done[-1] if done else None
    rates = task_rates(rows)
    job_rate = None
    if len(done) >= 2 and done[-1]["time"] and done[-2]["time"] and done[-1]["time"] > done[-2]["time"]:
        job_rate = (done[-1]["records"] or 0) / (done[-1]["time"] - done[-2]["time"])
    failovers = status.get("failovers", [])
    recovery = status.get("recovery-seconds", [])
    restarts = [{"time": f.get("time"), "reason": f.get("reason"),
                 "recovery_seconds": recovery[i] if i < len(recovery) else None} for i, f in enumerate(failovers)]
    committed_records = status.get("records-committed", sum(r["records"] or 0 for r in done))
    return {
        "live": live,
        "job": {
            "id": status.get("jid"), "name": status.get("name"), "state": status.get("state"),
            "mode": status.get("mode"), "deployment": status.get("deployment"),
            "parallelism": status.get("parallelism"), "max_parallelism": status.get("max-parallelism"),
            "checkpoint_dir": status.get("checkpoint-dir"), "duration_seconds": status.get("duration"),
            "restarts": status.get("restarts", 0), "kills": len(status.get("kills", [])),
            "completed_epochs": status.get("completed-epochs", len(done)),
            "aborted_epochs": status.get("aborted-epochs", sum(1 for r in rows if r["state"] == "aborted")),
            "records_in": status.get("records-in"), "committed_records": committed_records,
            "records_per_second": job_rate,
            "last_epoch": last["epoch"] if last else None,
            "last_epoch_seconds": last["duration_seconds"] if last else None,
            "last_epoch_bytes": last["bytes"] if last else None,
            "last_epoch_channel_state_bytes": last["channel_state_bytes"] if last else None,
        },
        "graph": graph,
        "epochs": rows,
        "checkpoints": checkpoints,
        "task_rates": rates,
        "task_metrics": status.get("task-metrics", {}),
        "traffic": status.get("traffic", {}),
        "restarts": restarts,
    }
