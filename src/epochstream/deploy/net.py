"""TCP connections between Spark tasks and the driver: authenticated, framed, selectable.

Every connection is a ``multiprocessing.connection.Connection`` over a TCP socket, so the
worker loop (``deploy.worker``) and the driver loop (``deploy.cluster``) use it exactly like
the local driver's pipes: length-prefixed pickled messages, ``poll``/``recv``/``send``, and
``multiprocessing.connection.wait`` on many at once. Both ends prove they hold the attempt's
random ``authkey`` (the HMAC challenge ``Listener``/``Client`` use), so a task of an older
attempt, or anything else on the network, cannot join a newer attempt's mesh. Unlike
``Listener.accept``, ``Server.accept`` takes a timeout, so a driver waiting for tasks can
notice that the Spark job died before they connected. ``TCP_NODELAY`` is set: envelopes are
often small, and Nagle's algorithm would hold them back.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge


def _wrap(sock: socket.socket) -> Connection:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(True)
    return Connection(sock.detach())


class Server:
    """A listening socket that hands out authenticated connections."""

    def __init__(self, host: str, authkey: bytes, port: int = 0) -> None:
        self.authkey = authkey
        self.sock = socket.create_server((host, port), backlog=128)
        self.address: tuple[str, int] = (host, self.sock.getsockname()[1])

    def accept(self, timeout: float | None = None) -> Connection | None:
        """The next authenticated connection, or None if none arrives within ``timeout`` s."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        raw, _addr = self.sock.accept()
        conn = _wrap(raw)
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:
            try:
                conn.close()
            except Exception:
                pass
            raise
        return conn

    def close(self) -> None:
        self.sock.close()


def connect(address: tuple[str, int], authkey: bytes, timeout: float = 60.0) -> Connection:
    """Connect to a ``Server`` (retrying while it is not up yet) and authenticate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(address, timeout=10)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
    conn = _wrap(sock)
    answer_challenge(conn, authkey)
    deliver_challenge(conn, authkey)
    return conn


#: where member ``i`` dials member ``j`` that listens at ``address``: ``route(i, j, address)``
#: (None: the address itself). A test puts a fault proxy on a link this way.
MeshRoute = Callable[[int, int, tuple[str, int]], tuple[str, int]]


def mesh(index: int, addresses: list[tuple[str, int]], server: Server, authkey: bytes,
         timeout: float = 60.0, route: MeshRoute | None = None) -> dict[int, Connection]:
    """One connection to every other member: member ``index`` connects to every lower
    member and accepts every higher one (member 0 only accepts, so the set-up never waits in
    a cycle). Each connecting side first sends its index."""
    peers: dict[int, Connection] = {}
    for j in range(index):
        conn = connect(route(index, j, addresses[j]) if route is not None else addresses[j], authkey, timeout)
        conn.send(index)
        peers[j] = conn
    deadline = time.monotonic() + timeout
    while len(peers) < len(addresses) - 1:
        accepted = server.accept(max(0.0, deadline - time.monotonic()))
        if accepted is None:
            missing = sorted(set(range(len(addresses))) - set(peers) - {index})
            raise TimeoutError(f"member {index}: members {missing} did not connect within {timeout}s")
        j = accepted.recv()
        peers[j] = accepted
    return peers
