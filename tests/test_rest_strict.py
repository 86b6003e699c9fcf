"""The job's HTTP API acts only on requests it read completely and understood, from its owner.

Regression tests for issue 18 item 3 and issue 14 item 6, over a real socket on 127.0.0.1
(raw bytes, so a client library cannot tidy the request up): a body shorter than its
Content-Length, ``{"savepoint": "no"}``, ``{"target-directory": 42}``, ``Content-Length: abc``
and ``-1``, a 300 MB body, malformed JSON, no or a wrong token, and a fuzz run (hypothesis)
whose every request is judged by an independent model of what is valid: a valid request is
submitted exactly once, any other is refused with a 4xx and submits nothing, and nothing
appears on disk. Fast: no job runs; the test plays the driver loop's part (``control.drain``).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochstream.deploy import jobs
from epochstream.deploy.control import JobControl
from epochstream.deploy.httpbody import MAX_BODY
from epochstream.deploy.rest import RestClient, RestError, RestServer

JOB = "feedc0de" * 4
TOKEN = "s3cret-token-of-the-owner"


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path the server wrongly acted on would appear here
    control = JobControl()
    control.publish(state="RUNNING")
    server = RestServer(JOB, control, lambda: {"counts": {"completed": 0}}, default_target=str(tmp_path / "sp"),
                        token=TOKEN).start()
    yield server, control, tmp_path
    server.close()


def raw_any(server: RestServer, data: bytes, shut: bool = True, timeout: float = 15.0) -> bytes:
    """Send ``data`` as is; the whole answer, as bytes."""
    host, port = server.httpd.socket.getsockname()[:2]
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def raw(server: RestServer, data: bytes, shut: bool = True, timeout: float = 15.0) -> tuple[int, dict]:
    """Send ``data`` as is; the status code and JSON body of the answer."""
    head, _, body = raw_any(server, data, shut, timeout).partition(b"\r\n\r\n")
    code = int(head.split(b" ", 2)[1])
    return code, json.loads(body or b"{}")


def post(path: str, body: bytes, length: str | None = None, token: str | None = TOKEN, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def submitted(control: JobControl) -> int:
    return len(control.drain())


def test_a_body_that_never_fully_arrived_is_refused(api):
    server, control, _ = api
    body = b'{"savepoint": false}'
    code, doc = raw(server, post(f"/jobs/{JOB}/stop", body, length=str(len(body) + 50)))
    assert code == 400 and "incomplete: 20 of 70 bytes" in doc["errors"][0]
    assert submitted(control) == 0


@pytest.mark.parametrize("body, field", [
    (b'{"savepoint": "no"}', "savepoint"),
    (b'{"savepoint": 0}', "savepoint"),
    (b'{"target-directory": 42}', "target-directory"),
    (b'{"target-directory": ["a"]}', "target-directory"),
    (b'{"target-directory": ""}', "target-directory"),
    (b'{"savepiont": false}', "savepiont"),
])
def test_fields_are_validated_by_type_and_named(api, body, field):
    server, control, tmp = api
    code, doc = raw(server, post(f"/jobs/{JOB}/stop", body, length=str(len(body))))
    assert code == 400 and f"field {field!r}" in doc["errors"][0], doc
    assert submitted(control) == 0
    assert sorted(os.listdir(tmp)) == []  # no ./42 folder


@pytest.mark.parametrize("length", ["abc", "-1", "+5", " 1 2", "0x10", "1e3"])
def test_a_content_length_that_is_not_a_number_is_refused(api, length):
    server, control, _ = api
    code, doc = raw(server, post(f"/jobs/{JOB}/savepoints", b"{}", length=length))
    assert code == 400 and "Content-Length" in doc["errors"][0]
    assert submitted(control) == 0


def test_a_huge_body_is_refused_before_it_is_read(api):
    """A 300 MB Content-Length is answered 413 at once, from the headers alone."""
    server, control, _ = api
    code, doc = raw(server, post(f"/jobs/{JOB}/savepoints", b"{" + b" " * 1000, length=str(300 * 2**20)),
                    shut=False)
    assert code == 413 and f"larger than the {MAX_BODY} bytes" in doc["errors"][0]
    assert submitted(control) == 0


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b"null", b"\xff\xfe", b'"stop"'])
def test_malformed_json_is_refused(api, body):
    server, control, _ = api
    code, doc = raw(server, post(f"/jobs/{JOB}/stop", body, length=str(len(body))))
    assert code == 400, doc
    assert submitted(control) == 0


def test_chunked_bodies_are_refused(api):
    server, control, _ = api
    code, _doc = raw(server, post(f"/jobs/{JOB}/stop", b"2\r\n{}\r\n0\r\n\r\n", extra="Transfer-Encoding: chunked"))
    assert code == 411 and submitted(control) == 0


@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN + "x"])
def test_every_post_needs_the_owners_token(api, token):
    server, control, _ = api
    code, doc = raw(server, post(f"/jobs/{JOB}/stop", b"{}", length="2", token=token))
    assert code == 401 and "token" in doc["errors"][0]
    with pytest.raises(RestError, match="HTTP 401"):
        RestClient(server.endpoint, token=token).savepoint(JOB, None, stop=True, savepoint=False)
    assert submitted(control) == 0
    assert RestClient(server.endpoint).call("GET", f"/jobs/{JOB}")["state"] == "RUNNING"  # reading needs none


def test_a_valid_request_is_acted_on_once(api):
    server, control, tmp = api
    body = json.dumps({"target-directory": str(tmp / "here"), "savepoint": True}).encode()
    code, doc = raw(server, post(f"/jobs/{JOB}/stop", body, length=str(len(body))))
    assert code == 202 and "request-id" in doc
    [req] = control.drain()
    assert req.stop and req.target == str(tmp / "here")
    code, _doc = raw(server, post(f"/jobs/{JOB}/stop", b'{"savepoint": false}', length="20"))
    [req] = control.drain()
    assert code == 202 and req.stop and req.target is None


def test_the_registry_file_is_only_its_users(tmp_path, monkeypatch):
    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    path = jobs.register({"id": "abcd", "name": "n", "endpoint": "http://127.0.0.1:7/", "pid": os.getpid(),
                          "token": "tok"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert jobs.token_for("http://127.0.0.1:7") == "tok"
    assert jobs.token_for("http://127.0.0.1:8") is None


# ---------------------------------------------------------------- fuzz

FIELDS = ["target-directory", "targetDirectory", "savepoint", "savepoints", "target", ""]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2), st.just("no"), st.just("true"))
BODIES = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=40),
    st.sampled_from([b"", b"{}", b"{", b"[]", b"null", b"1", b'{"savepoint": true}', b"\xff"]),
)


def expected_ok(path: str, body: bytes, length_kind: str, token_ok: bool) -> bool:
    """An independent model of a request the API must accept (and then act on exactly once)."""
    if length_kind != "exact" or not token_ok or path not in ("stop", "savepoints"):
        return False
    if not body.strip():
        return True  # all defaults: a savepoint (or stop with one) into the default dir
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(doc, dict):
        return False
    allowed = {"target-directory", "targetDirectory"} | ({"savepoint"} if path == "stop" else set())
    if set(doc) - allowed:
        return False
    for k in ("target-directory", "targetDirectory"):
        if k in doc and not (doc[k] is None or (isinstance(doc[k], str) and doc[k])):
            return False
    if "savepoint" in doc and not isinstance(doc["savepoint"], bool):
        return False
    return True


TRIED = {"requests": 0, "accepted": 0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["stop", "savepoints", "checkpoints", "nope", ""]), body=BODIES,
       length_kind=st.sampled_from(["exact", "exact", "exact", "more", "junk", "none"]),
       token_ok=st.booleans())
def test_fuzz_the_post_endpoints(api, path, body, length_kind, token_ok):
    server, control, tmp = api
    length = {"exact": str(len(body)), "more": str(len(body) + 7), "junk": "12a", "none": None}[length_kind]
    if length_kind == "none":  # no length: no body (as a POST without one)
        body_sent = b""
        ok = expected_ok(path, b"", "exact", token_ok)
    else:
        body_sent = body
        ok = expected_ok(path, body, length_kind, token_ok)
    doc_path = f"/jobs/{JOB}/{path}" if path else f"/jobs/{JOB}"
    code, doc = raw(server, post(doc_path, body_sent, length=length, token=TOKEN if token_ok else "x"))
    n = submitted(control)
    TRIED["requests"] += 1
    TRIED["accepted"] += n
    if ok:
        assert code == 202 and n == 1, (code, doc)
    else:
        assert 400 <= code < 500 and n == 0, (code, doc)
    assert [p for p in os.listdir(tmp)] == []  # no request wrote anything




def test_concurrent_requests_do_not_block_each_other(api):
    """A client that sends headers and never its body does not stall the others (threaded server, timeout)."""
    server, control, _ = api
    host, port = server.httpd.socket.getsockname()[:2]
    stalled = socket.create_connection((host, port))
    stalled.sendall(post(f"/jobs/{JOB}/stop", b"", length="10"))
    done = threading.Event()

    def other():
        assert RestClient(server.endpoint, token=TOKEN).call("GET", "/jobs")["jobs"][0]["id"] == JOB
        done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert done.is_set()
    stalled.settimeout(15)
    answer = stalled.recv(65536)
    stalled.close()
    assert b" 400 " in answer.split(b"\r\n")[0] and submitted(control) == 0


RAW_TRIED = {"requests": 0}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "G\x00T", "post"]),
       path=st.one_of(st.sampled_from([f"/jobs/{JOB}/stop", f"/jobs/{JOB}/savepoints", "/metrics", "/ui/data", "/",
                                       "/ui/../../etc/passwd", f"/jobs/{JOB}/savepoints/x"]),
                      st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30)),
       headers=st.lists(st.tuples(st.sampled_from(["Content-Length", "Authorization", "Transfer-Encoding", "X-A",
                                                   "Content-Type"]),
                                  st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20)),
                        max_size=4),
       body=st.binary(max_size=64))
def test_fuzz_any_request_never_acts_without_the_token(api, method, path, headers, body):
    """Whatever arrives without the token: no 5xx, nothing submitted, the server keeps answering."""
    server, control, tmp = api
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers if k != "Authorization")
    answer = raw_any(server, head.encode("latin-1") + b"\r\n" + body)
    RAW_TRIED["requests"] += 1
    if answer:
        status = answer.split(b"\r\n", 1)[0].split(b" ")
        # 501 only for a method HTTP does not know; everything else is the client's fault (4xx) or served
        unknown = method not in ("GET", "POST", "PUT", "DELETE", "HEAD", "PATCH")
        assert len(status) >= 2 and (not status[1].startswith(b"5") or (unknown and status[1] == b"501")), answer[:200]
    assert submitted(control) == 0
    assert os.listdir(tmp) == []
    assert RestClient(server.endpoint).call("GET", "/jobs")["jobs"][0]["id"] == JOB


def test_fuzz_report():
    """Prints what the fuzz runs tried (pytest -s shows it); runs after them (file order)."""
    print(f"\nREST fuzz: {TRIED['requests']} POSTs, {TRIED['accepted']} valid ones acted on once, "
          f"{TRIED['requests'] - TRIED['accepted']} refused with nothing done; {RAW_TRIED['requests']} arbitrary "
          f"requests without the token, none acted on")
    assert TRIED["requests"] in (0, 400) and RAW_TRIED["requests"] in (0, 200)
