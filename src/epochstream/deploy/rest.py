"""A running job's small HTTP API (local and spark drivers), shaped like Flink's REST API.

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
GET      /, /ui/<asset>, /ui/data                     the dashboard, its assets and data (``ui.app``)
GET      /metrics                                     Prometheus text (``ui.metrics``)
=======  ===========================================  =============================================

Errors are ``{"errors": [message]}`` with 400 (bad request: a body that is incomplete, not
JSON, or has a field of the wrong type or unknown; the message names the field), 401 (a POST
without the job's token), 404 (unknown job, request or path), 409 (the job is not running),
405 (another method), 411 (a chunked body) or 413 (a body over ``httpbody.MAX_BODY``); a refused request changes
nothing. Every POST carries ``Authorization: Bearer <token>``: the job's token, stored with its
registry entry (``deploy.jobs``) in a file only its user can read. The dashboard's pages and
``/metrics`` (``ui``) are served by the same server.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from ..snapshot.manifest import CheckpointError
from .control import COMPLETED, FAILED, JobControl, SavepointRequest
from .httpbody import BadRequest, SavepointBody, StopBody, authorized, body_length, parse, read_body

#: what a page hook returns: HTTP status, content type, body
Page = tuple[int, str, bytes]


class RestServer:
    """The HTTP API of one job; ``checkpoints()`` is read on the serving thread (storage reads only).

    ``token``: the owner's secret every POST must carry (``httpbody.authorized``; a fresh one
    when not given). ``pages``: GET paths the API does not own (the dashboard, ``/metrics``;
    ``ui.app``), asked with the path's parts; None from it means "not mine" (404).
    """

    def __init__(self, job_id: str, control: JobControl, checkpoints: Callable[[], dict[str, Any]],
                 default_target: str | None, port: int = 0, token: str | None = None,
                 pages: Callable[[list[str]], Page | None] | None = None) -> None:
        self.job_id = job_id
        self.control = control
        self.checkpoints = checkpoints
        self.default_target = default_target
        self.token = token or secrets.token_urlsafe(24)
        self.pages = pages
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
    def get(self, parts: list[str]) -> tuple[int, dict[str, Any]]:
        if parts == ["jobs"]:
            return 200, {"jobs": [{"id": self.job_id, "status": self.control.status().get("state")}]}
        if len(parts) < 2 or parts[0] != "jobs":
            return 404, {"errors": [f"no such path /{'/'.join(parts)}"]}
        if parts[1] != self.job_id:
            return 404, {"errors": [f"job {parts[1]} is not this job ({self.job_id})"]}
        rest = parts[2:]
        status = self.control.status()
        if not rest:
            return 200, status
        if rest == ["checkpoints"]:
            try:
                doc = self.checkpoints()
            except CheckpointError as exc:
                return 500, {"errors": [str(exc)]}
            doc["history"] = status.get("epochs", [])
            return 200, doc
        if len(rest) == 2 and rest[0] == "savepoints":
            found = self.control.request(rest[1])
            if found is None:
                return 404, {"errors": [f"no savepoint request {rest[1]}"]}
            return 200, found
        return 404, {"errors": [f"no GET /{'/'.join(parts)}"]}

    def post_model(self, parts: list[str]) -> type[SavepointBody] | None:
        """The body model of a POST path of this job, None if there is no such POST."""
        if len(parts) == 3 and parts[0] == "jobs" and parts[1] == self.job_id:
            return {"savepoints": SavepointBody, "stop": StopBody}.get(parts[2])
        return None

    def post(self, parts: list[str], body: SavepointBody) -> tuple[int, dict[str, Any]]:
        """A validated POST (``post_model`` gave its model, the body passed it)."""
        status = self.control.status()
        if status.get("state") not in ("RUNNING", "RESTARTING", "WAITING_FOR_SLOTS", "CREATED"):
            return 409, {"errors": [f"job {self.job_id} is {status.get('state')}, not running"]}
        stop = isinstance(body, StopBody)
        wants_savepoint = body.savepoint if isinstance(body, StopBody) else True
        target = body.target
        if wants_savepoint:
            target = target or self.default_target
            if not target:
                return 400, {"errors": ["no target directory: give target-directory, or start the job with "
                                        "a savepoint dir (--savepoint-dir)"]}
        else:
            target = None
        req = self.control.submit(SavepointRequest(target, stop=stop))
        return 202, {"request-id": req.id}


def _handler(server: RestServer):
    class Handler(BaseHTTPRequestHandler):
        #: seconds a connection may stay silent (a body that never arrives is not waited for)
        timeout = 5.0

        def _parts(self) -> list[str]:
            return [p for p in self.path.split("?")[0].split("/") if p]

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            try:
                length = body_length(self.headers)
                read_body(self.rfile.read, length)  # a GET's body means nothing, but is read whole
            except BadRequest as exc:
                return self._reply(exc.status, {"errors": [str(exc)]})
            parts = self._parts()
            try:
                page = server.pages(parts) if server.pages is not None else None
                if page is not None:
                    return self._send(*page)
                code, doc = server.get(parts)
            except Exception as exc:  # never kill the serving thread
                code, doc = 500, {"errors": [f"{type(exc).__name__}: {exc}"]}
            self._reply(code, doc)

        def do_POST(self) -> None:  # noqa: N802
            parts = self._parts()
            try:
                length = body_length(self.headers)
                model = server.post_model(parts)
                if model is None:
                    raise BadRequest(404, f"no POST /{'/'.join(parts)}")
                if not authorized(self.headers.get("Authorization"), server.token):
                    raise BadRequest(401, "this job's token is required (Authorization: Bearer TOKEN; the CLI "
                                          "reads it from the job's registry file)")
                body = parse(model, read_body(self.rfile.read, length))
                assert isinstance(body, SavepointBody)
                code, doc = server.post(parts, body)
            except BadRequest as exc:
                self.close_connection = True  # whatever else the peer sends is not read
                code, doc = exc.status, {"errors": [str(exc)]}
            except Exception as exc:  # never kill the serving thread
                code, doc = 500, {"errors": [f"{type(exc).__name__}: {exc}"]}
            self._reply(code, doc)

        def _not_allowed(self) -> None:
            self.close_connection = True
            self._reply(405, {"errors": [f"{self.command} is not allowed here (GET, or POST to stop and savepoints)"]})

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815 - http.server's names

        def _reply(self, code: int, doc: dict[str, Any]) -> None:
            self._send(code, "application/json", json.dumps(doc, default=str).encode())

        def _send(self, code: int, content_type: str, data: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

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
    """The CLI's side; ``token``: the job's (``deploy.jobs``), sent with every request."""

    def __init__(self, endpoint: str, timeout: float = 10.0, token: str | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self.token = token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.endpoint + path, data=data, method=method, headers=headers)
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


# ---------------------------------------------------------------- a finished job's dashboard


def offline_server(checkpoint_dir: str, port: int = 0) -> RestServer:
    """The HTTP server of a finished job, read from its checkpoint folder (``ui.offline``):
    the same dashboard, ``/metrics`` and GETs as a live job's; every POST answers 409."""
    from ..backends import open_storage
    from ..ui.offline import checkpoint_rows, offline_dashboard

    board = offline_dashboard(checkpoint_dir)
    job = board.doc()["job"]
    control = JobControl()
    control.publish(jid=job["id"], name=job["name"], state="FINISHED", mode=job["mode"],
                    deployment=job["deployment"], parallelism=job["parallelism"], epochs=board.doc()["epochs"])
    storage = open_storage(checkpoint_dir)
    return RestServer(str(job["id"] or "offline"), control, lambda: {"checkpoints": checkpoint_rows(storage)},
                      default_target=None, port=port, pages=board.page).start()
