"""A running job's small HTTP API (local driver), shaped like Flink's REST API.

Served by a daemon thread of the driver process on 127.0.0.1 (an ephemeral port unless
one is given); the CLI finds the endpoint through ``deploy.jobs``. Bodies are JSON.

=======  ===========================================  =============================================
method   path                                         what
=======  ===========================================  =============================================
GET      /jobs                                        ``{"jobs": [{"id", "status"}]}``
GET      /jobs/<id>                                   status: name, state, parallelism, epochs, ...
GET      /jobs/<id>/checkpoints                       completed checkpoints on storage + epoch history
POST     /jobs/<id>/savepoints                        ``{"target-directory": DIR}`` -> 202 ``{"request-id"}``
GET      /jobs/<id>/savepoints/<request-id>           ``{"status": {"id": IN_PROGRESS|COMPLETED|FAILED},
                                                      "operation": {"location"} | {"failure-cause"}}``
POST     /jobs/<id>/stop                              ``{"target-directory": DIR?, "savepoint": bool}``
                                                      -> 202 ``{"request-id"}`` (poll as a savepoint)
=======  ===========================================  =============================================

Errors are ``{"errors": [message]}`` with 400 (bad request), 404 (unknown job, request or
path) or 409 (the job is not running).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from ..snapshot.manifest import CheckpointError
from .control import COMPLETED, FAILED, JobControl, SavepointRequest


class RestServer:
    """The HTTP API of one job; ``checkpoints()`` is read on the serving thread (storage reads only)."""

    def __init__(self, job_id: str, control: JobControl, checkpoints: Callable[[], dict[str, Any]],
                 default_target: str | None, port: int = 0) -> None:
        self.job_id = job_id
        self.control = control
        self.checkpoints = checkpoints
        self.default_target = default_target
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="epochstream-rest", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.httpd.socket.getsockname()[:2]  # = server_address (typeshed: or bytes)
        return f"http://{host}:{port}"

    def start(self) -> "RestServer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    # -- routing (called on the serving thread)
    def route(self, method: str, parts: list[str], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if parts == ["jobs"] and method == "GET":
            return 200, {"jobs": [{"id": self.job_id, "status": self.control.status().get("state")}]}
        if len(parts) < 2 or parts[0] != "jobs":
            return 404, {"errors": [f"no such path /{'/'.join(parts)}"]}
        if parts[1] != self.job_id:
            return 404, {"errors": [f"job {parts[1]} is not this job ({self.job_id})"]}
        rest = parts[2:]
        status = self.control.status()
        if method == "GET" and not rest:
            return 200, status
        if method == "GET" and rest == ["checkpoints"]:
            try:
                doc = self.checkpoints()
            except CheckpointError as exc:
                return 500, {"errors": [str(exc)]}
            doc["history"] = status.get("epochs", [])
            return 200, doc
        if method == "GET" and len(rest) == 2 and rest[0] == "savepoints":
            found = self.control.request(rest[1])
            if found is None:
                return 404, {"errors": [f"no savepoint request {rest[1]}"]}
            return 200, found
        if method == "POST" and rest in (["savepoints"], ["stop"]):
            if status.get("state") not in ("RUNNING", "RESTARTING", "CREATED"):
                return 409, {"errors": [f"job {self.job_id} is {status.get('state')}, not running"]}
            stop = rest == ["stop"]
            target = body.get("target-directory") or body.get("targetDirectory")
            wants_savepoint = bool(body.get("savepoint", True)) if stop else True
            if wants_savepoint:
                target = target or self.default_target
                if not target:
                    return 400, {"errors": ["no target directory: give target-directory, or start the job with "
                                            "a savepoint dir (--savepoint-dir)"]}
            else:
                target = None
            req = self.control.submit(SavepointRequest(str(target) if target else None, stop=stop))
            return 202, {"request-id": req.id}
        return 404, {"errors": [f"no {method} /{'/'.join(parts)}"]}


def _handler(server: RestServer):
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            body: dict[str, Any] = {}
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except ValueError as exc:
                    return self._reply(400, {"errors": [f"bad JSON body: {exc}"]})
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            try:
                code, doc = server.route(method, parts, body)
            except Exception as exc:  # never kill the serving thread
                code, doc = 500, {"errors": [f"{type(exc).__name__}: {exc}"]}
            self._reply(code, doc)

        def _reply(self, code: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, fmt: str, *args: Any) -> None:
            return None

    return Handler


# ---------------------------------------------------------------- client (the CLI's side)


class RestError(RuntimeError):
    """The job answered with an error (``status``: its HTTP code) or could not be reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RestClient:
    def __init__(self, endpoint: str, timeout: float = 10.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                errors = json.loads(exc.read()).get("errors", [])
            except ValueError:
                errors = []
            raise RestError(f"{method} {path}: HTTP {exc.code}: {'; '.join(errors) or exc.reason}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise RestError(f"cannot reach the job at {self.endpoint}: {exc}") from None

    def job_id(self) -> str:
        jobs = self.call("GET", "/jobs")["jobs"]
        if not jobs:
            raise RestError(f"no job at {self.endpoint}")
        return jobs[0]["id"]

    def savepoint(self, job_id: str, target: str | None, stop: bool = False, savepoint: bool = True,
                  wait: float | None = 300.0, poll: float = 0.1) -> dict[str, Any]:
        """Trigger a savepoint (or a stop) and, unless ``wait`` is None, wait for its outcome."""
        body: dict[str, Any] = {"target-directory": target} if target else {}
        if stop:
            body["savepoint"] = savepoint
        rid = self.call("POST", f"/jobs/{job_id}/{'stop' if stop else 'savepoints'}", body)["request-id"]
        if wait is None:
            return {"request-id": rid, "status": {"id": "IN_PROGRESS"}}
        deadline = time.monotonic() + wait
        while True:
            doc = self.call("GET", f"/jobs/{job_id}/savepoints/{rid}")
            if doc["status"]["id"] in (COMPLETED, FAILED):
                return doc
            if time.monotonic() > deadline:
                raise RestError(f"savepoint request {rid} still in progress after {wait}s")
            time.sleep(poll)
