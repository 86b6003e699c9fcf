"""A TCP fault proxy for the spark driver's mesh: delays, drops and resets a link between two tasks.

The spark driver takes ``mesh_route(i, j, address) -> address``: where task ``i`` dials task
``j``. ``MeshRoute`` (picklable, shipped to the Spark tasks) asks the test's
``TcpFaultProxy`` over a small control connection for a forwarder to ``address`` and dials
that instead. Every forwarder relays bytes both ways through real sockets and applies the
proxy's faults:

* ``delay``: every chunk waits this long before it goes on (order kept), all the time;
* the n-th forwarder opened (one per attempt with two tasks) gets ``plan[n]``, if any:
  ``("reset", after)``: once the link has relayed ``after`` bytes (a point in the job's
  progress, whatever the machine's speed) both sockets are torn down (``shutdown``, then
  ``close`` with ``SO_LINGER`` 0: an RST): each task sees its peer connection end;
  ``("drop", after)``: from then on bytes are read and thrown away in both directions, the
  connection stays open (a black hole: a cut link TCP has not noticed yet).
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import time
from typing import Any


def _rst_close(sock: socket.socket) -> None:
    """Abort a connection with an RST. ``close`` alone would wait for the relay threads blocked in
    ``recv`` on it (the kernel keeps the file open until they return): ``shutdown`` wakes them."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Forwarder:
    """One relayed link: listens once, dials the target, pumps both ways with the faults."""

    def __init__(self, proxy: TcpFaultProxy, target: tuple[str, int], fault: tuple[str, int] | None) -> None:
        self.proxy, self.target, self.fault = proxy, target, fault
        self.relayed = 0
        self.ended = 0  # directions whose source has closed
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.dropping = False
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True, name="tcp-fault-forwarder").start()

    def _run(self) -> None:
        self.listener.settimeout(120)
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        finally:
            self.listener.close()
        upstream = socket.create_connection(self.target, timeout=30)
        for s in (client, upstream):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.socks = [client, upstream]
        for src, dst in ((client, upstream), (upstream, client)):
            q: queue.Queue = queue.Queue()
            threading.Thread(target=self._read, args=(src, q), daemon=True).start()
            threading.Thread(target=self._write, args=(dst, q), daemon=True).start()
        if self.fault is not None:
            kind, after = self.fault  # the link may end first (the attempt failed otherwise): no fault then
            while self.relayed < after and self.ended < 2:
                time.sleep(0.01)
            if self.ended >= 2:
                return
            self.proxy.events.append((kind, time.monotonic()))
            if kind == "reset":
                self.closed = True
                for s in self.socks:
                    _rst_close(s)
            elif kind == "drop":
                self.dropping = True

    def _read(self, src: socket.socket, q: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                q.put(None)
                return
            if not self.dropping:
                q.put((time.monotonic(), data))

    def _write(self, dst: socket.socket, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                self.ended += 1
                if not self.closed:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                return
            at, data = item
            wait = at + self.proxy.delay - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self.dropping:
                continue
            try:
                dst.sendall(data)
                self.relayed += len(data)
                self.proxy.relayed += len(data)
            except OSError:
                return


class TcpFaultProxy:
    """The control server (in the test process) that opens a forwarder per mesh link."""

    def __init__(self, delay: float = 0.0, plan: list[tuple[str, int] | None] | None = None) -> None:
        self.delay = delay
        self.plan = list(plan or [])
        self.opened: list[tuple[int, int, tuple[str, int]]] = []
        self.events: list[tuple[str, float]] = []
        self.relayed = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True, name="tcp-fault-proxy").start()

    def route(self) -> MeshRoute:
        return MeshRoute(self.address)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                req = json.loads(conn.makefile("r").readline())
                with self.lock:
                    n = len(self.opened)
                    self.opened.append((req["from"], req["to"], tuple(req["target"])))
                    fault = self.plan[n] if n < len(self.plan) else None
                fwd = _Forwarder(self, tuple(req["target"]), fault)
                conn.sendall((json.dumps({"listen": list(fwd.address)}) + "\n").encode())

    def stop(self) -> None:
        self.server.close()


class MeshRoute:
    """``mesh_route`` of the spark driver: dial task j through the test's proxy."""

    def __init__(self, controller: tuple[str, int]) -> None:
        self.controller = tuple(controller)

    def __call__(self, i: int, j: int, address: tuple[str, int]) -> tuple[str, int]:
        with socket.create_connection(self.controller, timeout=30) as c:
            c.sendall((json.dumps({"from": i, "to": j, "target": list(address)}) + "\n").encode())
            answer: Any = json.loads(c.makefile("r").readline())
        host, port = answer["listen"]
        return host, int(port)
