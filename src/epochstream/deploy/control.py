"""Requests from outside a running job (savepoints, stop) and the status it publishes.

The REST thread (``deploy.rest``) and the driver loop share one ``JobControl``: the
thread submits commands and reads a published status; the loop drains the commands
between its own steps and publishes. The lock guards only the published dicts; the job
master never runs on the REST thread.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

IN_PROGRESS, COMPLETED, FAILED = "IN_PROGRESS", "COMPLETED", "FAILED"


@dataclass
class SavepointRequest:
    """One triggered savepoint (or stop, with or without a savepoint), as Flink's trigger id."""

    target: str | None
    stop: bool = False
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    status: str = IN_PROGRESS
    epoch: int | None = None
    location: str | None = None
    error: str | None = None
    #: when the request entered the job (time.time())
    created: float = field(default_factory=time.time)

    # the status is set last: a reader on another thread never sees COMPLETED without a location
    def complete(self, location: str | None) -> None:
        self.location = location
        self.status = COMPLETED

    def fail(self, error: str) -> None:
        if self.status == IN_PROGRESS:
            self.error = error
            self.status = FAILED

    def to_json(self) -> dict[str, Any]:
        """Flink's asynchronous-operation shape: ``status.id`` and ``operation``."""
        op: dict[str, Any] = {}
        if self.status == COMPLETED:
            op["location"] = self.location
        elif self.status == FAILED:
            op["failure-cause"] = {"class": "SavepointFailed", "stack-trace": self.error}
        return {"request-id": self.id, "status": {"id": self.status}, "operation": op, "epoch": self.epoch,
                "stop": self.stop, "target-directory": self.target}


class JobControl:
    """The mailbox between the REST thread and the driver loop."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}
        self._requests: dict[str, SavepointRequest] = {}
        #: requests whose outcome a client has read
        self._told: set[str] = set()

    # -- REST thread
    def submit(self, request: SavepointRequest) -> SavepointRequest:
        with self._lock:
            self._requests[request.id] = request
        self._commands.put(request)
        return request

    def request(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            r = self._requests.get(request_id)
            if r is None:
                return None
            doc = r.to_json()
            if doc["status"]["id"] != IN_PROGRESS:
                self._told.add(request_id)
            return doc

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)

    # -- driver loop
    def drain(self) -> list[SavepointRequest]:
        out = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def untold(self) -> list[str]:
        """Finished requests whose outcome no client has read yet (the driver lingers for them)."""
        with self._lock:
            return [i for i, r in self._requests.items() if r.status != IN_PROGRESS and i not in self._told]

    def fail_pending(self, reason: str) -> None:
        with self._lock:
            for r in self._requests.values():
                r.fail(reason)

    def publish(self, **status: Any) -> None:
        with self._lock:
            self._status.update(status)
