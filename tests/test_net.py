"""The spark driver's transport on real sockets (fast: threads on localhost, no Spark).

- ``deploy.net``: a mesh of members gets exactly one authenticated connection per pair, a
  wrong key is refused, a member that never shows up is named in a timeout.
- ``deploy.worker.PeerLink``: data envelopes stop at the credit window until the receiver
  hands credits back, control envelopes overtake waiting data, and every channel stays FIFO.
"""

from __future__ import annotations

import secrets
import threading
import time
from multiprocessing import AuthenticationError

import pytest

from epochstream.deploy.flow import WINDOW
from epochstream.deploy.net import Server, connect, mesh
from epochstream.deploy.protocol import Backpressure, Credit
from epochstream.deploy.worker import PeerLink


def _mesh(n: int, key: bytes):
    servers = [Server("127.0.0.1", key) for _ in range(n)]
    addresses = [s.address for s in servers]
    out: dict[int, dict] = {}
    errors: list[BaseException] = []

    def member(i):
        try:
            out[i] = mesh(i, addresses, servers[i], key, timeout=20)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in servers:
        s.close()
    assert not errors, errors
    return out


def test_mesh_connects_every_pair_once():
    key = secrets.token_bytes(16)
    peers = _mesh(4, key)
    assert {i: sorted(p) for i, p in peers.items()} == {i: [j for j in range(4) if j != i] for i in range(4)}
    # the connection i -> j is the one j holds for i: a message crosses it
    for i in range(4):
        for j in range(4):
            if i != j:
                peers[i][j].send(("hello", i, j))
    for i in range(4):
        for j in range(4):
            if i != j:
                assert peers[j][i].recv() == ("hello", i, j)
    for p in peers.values():
        for c in p.values():
            c.close()


def test_wrong_key_is_refused():
    server = Server("127.0.0.1", b"right-key-123456")
    result: list = []
    t = threading.Thread(target=lambda: result.append(_accept(server)))
    t.start()
    with pytest.raises(AuthenticationError):
        connect(server.address, b"wrong-key-123456", timeout=5)
    t.join(10)
    server.close()
    assert result and isinstance(result[0], AuthenticationError)


def _accept(server):
    try:
        return server.accept(10)
    except BaseException as exc:
        return exc


def test_missing_member_is_named():
    key = secrets.token_bytes(16)
    servers = [Server("127.0.0.1", key) for _ in range(3)]
    with pytest.raises(TimeoutError, match=r"members \[1, 2\] did not connect"):
        mesh(0, [s.address for s in servers], servers[0], key, timeout=0.5)
    for s in servers:
        s.close()


def test_credit_window_stops_data_not_control():
    key = secrets.token_bytes(16)
    peers = _mesh(2, key)
    a, b = peers[0][1], peers[1][0]
    link = PeerLink(a)
    link.start()
    for i in range(WINDOW + 5):
        link.send_data([(7, i)])
    deadline = time.monotonic() + 10
    while link.sent < WINDOW and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert link.sent == WINDOW and link.backlog == 5  # the rest waits for credit
    link.send_control(Backpressure(True))
    got = [b.recv() for _ in range(WINDOW + 1)]
    assert got[-1] == Backpressure(True)  # overtook the data waiting for credit
    assert [env[0][1] for env in got[:-1]] == list(range(WINDOW))  # FIFO
    link.on_credit(Credit(5))
    got = [b.recv() for _ in range(5)]
    assert [env[0][1] for env in got] == list(range(WINDOW, WINDOW + 5))
    deadline = time.monotonic() + 10  # the sender thread counts a message after the peer may have read it
    while (link.backlog, link.credit) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.backlog == 0 and link.credit == 0
    link.close()
    link.thread.join(5)
    a.close()
    b.close()
