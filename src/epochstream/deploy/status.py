"""``StatusPublisher``: what the world sees of a running job (local and spark drivers).

It serves the job's HTTP API (``deploy.rest``) with its dashboard and ``/metrics`` (``ui``),
registers the job for the CLI (``deploy.jobs``), and publishes the status document those read,
built from the run's ``RunRecord``. The driver holds one and calls ``publish`` from its loop;
the REST thread reads what was published (``control.JobControl``), never the driver.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ..snapshot.manifest import CheckpointError
from ..snapshot.manifest_view import ManifestView
from ..tracker.traffic import ServiceTraffic
from ..ui.app import Dashboard
from ..ui.graph import job_graph
from ..ui.model import dashboard, task_metrics
from ..ui.offline import checkpoint_rows
from . import jobs as _jobs
from .control import JobControl
from .rest import RestServer
from .result import RunRecord
from .tracking import tracking_segments

log = logging.getLogger("epochstream")

#: seconds between two status documents the loop publishes (a forced one goes out at once)
PUBLISH_EVERY = 0.1
#: seconds the HTTP API stays up after the run for clients to read their last requests' outcome
LINGER = 5.0


class StatusPublisher:
    """The job's status document, HTTP API and registry entry; see the module docstring.

    ``rest``: serve the API on 127.0.0.1 (``port``; 0: an ephemeral one) and register it;
    ``on_start``: called with the registry entry's short form once the API is up (the CLI
    prints it).
    """

    def __init__(self, *, job_id: str, pipeline, plan, storage, deployment: str, savepoint_dir: str | None,
                 record: RunRecord, rest: bool = True, port: int = 0,
                 on_start: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.job_id = job_id
        self.pipeline = pipeline
        self.plan = plan
        self.storage = storage
        self.deployment = deployment
        self.savepoint_dir = savepoint_dir
        self.record = record
        self.rest = rest
        self.port = port
        self.on_start = on_start
        #: the mailbox between the REST thread and the driver loop
        self.control = JobControl()
        #: the API's address while it is served
        self.endpoint: str | None = None
        self._server: RestServer | None = None
        self._published = 0.0
        #: why the run failed (the status's ``error`` once it ended FAILED)
        self.error: str | None = None

    def start(self, now: float) -> None:
        """Publish CREATED, then serve the API and register the job."""
        self.publish("CREATED", now, force=True)
        if not self.rest:
            return
        server = self._server = RestServer(self.job_id, self.control, self._checkpoints_doc, self.savepoint_dir,
                                           self.port, pages=self._dashboard().page).start()
        self.endpoint = server.endpoint
        name = self.pipeline.name
        _jobs.register({
            "id": self.job_id, "name": name, "endpoint": server.endpoint, "pid": os.getpid(), "token": server.token,
            "deployment": self.deployment, "checkpoint_dir": str(self.storage.root),
            "savepoint_dir": self.savepoint_dir, "started_at": time.time(), "parallelism": self.plan.parallelism,
        })
        log.info("job %s (%s) serves its REST API at %s", name, self.job_id, server.endpoint)
        if self.on_start is not None:
            self.on_start({"id": self.job_id, "name": name, "endpoint": server.endpoint})

    def close(self, state: str, now: float) -> None:
        """The run ended in ``state``: fail open requests, publish it, give clients a moment
        to read their outcomes, stop serving."""
        self.control.fail_pending(f"the job is {state.lower()}")
        self.publish(state, now, force=True)
        if self._server is None:
            return
        _jobs.unregister(self.job_id)
        linger = time.monotonic() + LINGER
        while self.control.untold() and time.monotonic() < linger:
            time.sleep(0.02)
        self._server.close()
        self._server = None

    def publish(self, state: str, now: float, *, force: bool = False, running: ServiceTraffic | None = None,
                extra: dict[str, Any] | None = None) -> None:
        """Publish the status at run second ``now`` (at most every ``PUBLISH_EVERY`` seconds
        unless ``force``); ``running``: the running attempt's service messages, not yet the
        run's; ``extra``: fields of one kind of driver (spark: the slots an attempt waits for)."""
        wall = time.monotonic()
        if not force and wall - self._published < PUBLISH_EVERY:
            return
        self._published = wall
        r, plan = self.record, self.plan
        self.control.publish(
            jid=self.job_id, name=self.pipeline.name, state=state, mode=self.pipeline.mode,
            deployment=self.deployment, parallelism=plan.parallelism,
            **{"max-parallelism": plan.max_parallelism, "checkpoint-dir": str(self.storage.root),
               "savepoint-dir": self.savepoint_dir, "completed-epochs": len(r.completed),
               "latest-epoch": r.completed[-1] if r.completed else None, "records-in": r.records_in},
            restarts=r.restarts, savepoints=list(r.savepoints), epochs=r.epoch_log[-200:],
            **{"last-failover": r.failover_log[-1] if r.failover_log else None},
            # the failover reasons, the same text as in the logs and JobResult (operator, subtask, key, record,
            # source split and offset of a user-function failure)
            failures=[{"time": f["time"], "reason": f["reason"].splitlines()[0]} for f in r.failover_log[-10:]],
            duration=now, error=self.error, **self._progress(running), **(extra or {}),
        )

    def _progress(self, running: ServiceTraffic | None) -> dict[str, Any]:
        """What the dashboard, ``/metrics`` and the status line read beyond the summary (``ui``)."""
        r = self.record
        traffic = ServiceTraffic()
        traffic.merge(r.traffic)
        if running is not None:
            traffic.merge(running)
        return {
            "records-committed": sum(e.get("records") or 0 for e in r.epoch_log),
            "aborted-epochs": sum(1 for e in r.epoch_log if e.get("state") == "aborted"),
            "failovers": r.failover_log[-50:], "recovery-seconds": r.recovery_seconds[-50:],
            "kills": r.kills[-50:], "traffic": traffic.as_dict()["by_kind"],
            "task-metrics": task_metrics(r.meters.as_dict()),
        }

    def _dashboard(self) -> Dashboard:
        """The dashboard and ``/metrics`` of this job (``ui``), from the published status."""
        graph = job_graph(self.plan, self.pipeline.mode, tracking_segments(self.plan, self.pipeline))
        rows: dict[str, Any] = {"key": None, "rows": []}

        def build() -> dict[str, Any]:
            status = self.control.status()
            key = (status.get("completed-epochs"), status.get("state"))
            if key != rows["key"]:  # storage is read again only when an epoch completed
                rows["key"], rows["rows"] = key, checkpoint_rows(self.storage)
            return dashboard(status, graph, rows["rows"])

        return Dashboard(build, cache_seconds=0.0)

    def _checkpoints_doc(self) -> dict[str, Any]:
        """GET /jobs/<id>/checkpoints: what storage holds (read on the REST thread, read-only)."""
        rows = []
        for epoch in self.storage.list_checkpoints():
            try:
                m = ManifestView.of(self.storage.load_manifest(epoch)[0])
            except CheckpointError as exc:
                rows.append({"epoch": epoch, "status": "damaged", "error": str(exc)})
                continue
            rows.append({"epoch": epoch, "status": "completed", "kind": m.kind,
                         "path": str(self.storage.checkpoint_dir(epoch)), "created_at": m.created_at,
                         "parallelism": m.parallelism, "metrics": dict(m.metrics)})
        done = [r for r in rows if r["status"] == "completed"]
        return {"counts": {"completed": len(done)}, "latest": done[-1] if done else None, "checkpoints": rows}
