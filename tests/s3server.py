"""A real S3 endpoint for the tests: moto's HTTP server, and a fault-injecting proxy in front of it.

``MotoS3`` runs ``moto.server.ThreadedMotoServer`` on a free port of 127.0.0.1 in this
process; requests go over real HTTP through boto3, so signing, retries, timeouts and error
parsing are the production code paths. ``FaultProxy`` is a small HTTP/1.1 proxy that
forwards every request to moto unless a ``Fault`` matches it, in which case it answers with
an S3 error (500 ``InternalError``, 503 ``SlowDown``, ...), closes the connection without an
answer, delays the request before or after forwarding it, or SIGKILLs the process that sent
it (boto3 clients of epochstream put ``pid/<pid>`` in their user agent) while the upload is
in flight.

Fixtures (imported by ``conftest.py``): ``moto_s3`` (one server per session), ``s3_env``
(AWS_* variables pointing boto3 at it, fake credentials), ``s3_url`` (a fresh bucket per
test, as ``s3://bucket/prefix``) and ``fault_proxy`` (a proxy per test, stopped afterwards).
Other suites (Delta, Spark S3A) can use the same fixtures.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

REGION = "us-east-1"
#: moto accepts any key unless authentication is switched on (see ``MotoS3.require_auth``)
FAKE_KEY, FAKE_SECRET = "testing", "testing"
_buckets = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    """moto's server on a free local port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def client(self, endpoint: str | None = None, key: str = FAKE_KEY, secret: str = FAKE_SECRET):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=endpoint or self.url, region_name=REGION, aws_access_key_id=key,
            aws_secret_access_key=secret, config=Config(s3={"addressing_style": "path"}))

    def iam(self):
        import boto3

        return boto3.session.Session().client("iam", endpoint_url=self.url, region_name=REGION,
                                              aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET)

    def require_auth(self, on: bool) -> None:
        """Switch moto's request authentication on (every request checked against its IAM
        users and signatures) or off (any key accepted), server-wide."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("POST", "/moto-api/reset-auth", body=b"0" if on else b"inf")
        resp = conn.getresponse()
        resp.read()
        conn.close()
        assert resp.status == 200, resp.status

    def new_bucket(self, label: str = "t") -> str:
        name = f"es-{re.sub(r'[^a-z0-9-]', '-', label.lower())[:40]}-{next(_buckets)}".strip("-")
        self.client().create_bucket(Bucket=name)
        return name


class MotoS3Process(MotoS3):
    """moto's server in a child process: for clients that keep Python's GIL while they wait for
    an answer (delta-rs does in some calls), which an in-process server could then never give."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()


# ---------------------------------------------------------------- fault-injecting proxy


@dataclass
class Fault:
    """What to do with requests that match ``method`` and the ``path`` regex (searched in the
    URL path, e.g. ``/bucket/prefix/chk-3/_metadata.json``).

    ``action``: ``"error"`` (answer ``status`` with S3 error ``code``), ``"reset"`` (close
    the connection without answering), ``"outage"`` (this request and every request after it,
    of any method and path, have their connection closed without an answer: S3 is down,
    for ``seconds`` or, with ``seconds=0``, until ``FaultProxy.end_outage``), ``"delay"`` (sleep
    ``seconds`` before forwarding),
    ``"delay_response"`` (forward, then sleep ``seconds`` before answering), ``"kill_sender"``
    (SIGKILL the pid in the user agent, then close the connection). ``times``: how many
    matching requests it applies to (None: all), after skipping the first ``skip``."""

    method: str
    path: str
    action: str
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    times: int | None = 1
    skip: int = 0
    seen: int = 0
    applied: int = 0
    killed: list[int] = field(default_factory=list)

    def matches(self, method: str, path: str) -> bool:
        if method != self.method or not re.search(self.path, path):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.applied >= self.times):
            return False
        self.applied += 1
        return True


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` that injects ``faults`` (first match wins)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, int, str]] = []  # method, path, status (0: none), action
        self.lock = threading.Lock()
        #: while an outage lasts: when it ends (monotonic; inf: until ``end_outage``); None: no outage
        self.down_until: float | None = None
        #: (start, end) of every outage, monotonic seconds
        self.outages: list[tuple[float, float | None]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                return None

            def _handle(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self.thread.start()

    def add(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def down(self) -> bool:
        """Whether S3 is in an outage now (ends a timed one that is over)."""
        with self.lock:
            if self.down_until is not None and time.monotonic() >= self.down_until:
                self.end_outage()
            return self.down_until is not None

    def end_outage(self) -> None:
        """S3 is back: requests are forwarded again (the lock may be held by the caller)."""
        if self.down_until is not None:
            self.outages[-1] = (self.outages[-1][0], time.monotonic())
        self.down_until = None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self, method: str, path: str, action: str | None = None) -> int:
        return sum(1 for m, p, _s, a in self.log
                   if m == method and re.search(path, p) and (action is None or a == action))

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        path = h.path.split("?", 1)[0]
        with self.lock:
            fault = None if self.down_until is not None else next(
                (f for f in self.faults if f.matches(h.command, path)), None)
            if fault is not None and fault.action == "outage":
                now = time.monotonic()
                self.down_until = now + fault.seconds if fault.seconds > 0 else float("inf")
                self.outages.append((now, None))
        if self.down():
            self.log.append((h.command, path, 0, "outage"))
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        action = fault.action if fault else "forward"
        if fault and fault.action == "error":
            self.log.append((h.command, path, fault.status, action))
            payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                       f'<Message>injected by the test proxy</Message></Error>').encode()
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(payload)
            return
        if fault and fault.action in ("reset", "kill_sender"):
            if fault.action == "kill_sender":
                m = re.search(r"pid/(\d+)", h.headers.get("User-Agent", ""))
                if m and int(m.group(1)) != os.getpid():
                    os.kill(int(m.group(1)), signal.SIGKILL)
                    fault.killed.append(int(m.group(1)))
            self.log.append((h.command, path, 0, action))
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if fault and fault.action == "delay":
            time.sleep(fault.seconds)
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "proxy-connection")}
        conn.request(h.command, h.path, body=body if (body or h.command in ("PUT", "POST")) else None,
                     headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if fault and fault.action == "delay_response":
            time.sleep(fault.seconds)
        self.log.append((h.command, path, resp.status, action))
        try:
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    h.send_header(k, v)
            h.send_header("Content-Length", resp.getheader("Content-Length") if h.command == "HEAD"
                          and resp.getheader("Content-Length") else str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        except OSError:  # the client gave up (timeout) meanwhile
            h.close_connection = True


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def moto_s3():
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_s3_process():
    server = MotoS3Process()
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    """Point boto3's default chain at the moto server (inherited by forked workers)."""
    env = {
        "AWS_ACCESS_KEY_ID": FAKE_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": moto_s3.url,
        "EPOCHSTREAM_S3_MAX_ATTEMPTS": "6",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return env


@pytest.fixture
def s3_url(moto_s3, s3_env, request) -> str:
    """A fresh bucket for this test, as ``s3://<bucket>/run``."""
    return f"s3://{moto_s3.new_bucket(request.node.name)}/run"


@pytest.fixture
def fault_proxy(moto_s3):
    proxy = FaultProxy(moto_s3.port)
    yield proxy
    proxy.stop()


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, every: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
