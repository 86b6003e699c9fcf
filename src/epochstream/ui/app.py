"""The dashboard's side of the job's HTTP server: pages, their data and ``/metrics``.

``Dashboard.page`` is the ``pages`` hook of ``deploy.rest.RestServer`` (GET only): ``/`` and
``/ui/`` the page, ``/ui/<asset>`` its script, style and the vendored uPlot, ``/ui/data``
the ``model.dashboard`` document the page polls, ``/metrics`` the Prometheus text. Assets
come from this package (``static/``), by exact name: a path outside that list is 404.
"""

from __future__ import annotations

import json
import threading
import time
from importlib import resources
from typing import Any, Callable

from .metrics import CONTENT_TYPE, registry_for, render

#: served name -> (file under static/, content type)
ASSETS = {
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "app.css": ("app.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
    "LICENSE-uPlot.txt": ("vendor/LICENSE-uPlot.txt", "text/plain; charset=utf-8"),
}


def asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", ASSETS[name][0]).read_bytes()


class Dashboard:
    """Serves one job's dashboard from ``doc()`` (a ``model.dashboard`` document, built on
    each request unless ``cache_seconds`` says it may be reused: a finished job's never changes)."""

    def __init__(self, doc: Callable[[], dict[str, Any]], cache_seconds: float = 0.0) -> None:
        self._build = doc
        self.cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any]] | None = None
        self.registry = registry_for(self.doc)

    def doc(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.cache_seconds:
                self._cached = (now, self._build())
            return self._cached[1]

    def page(self, parts: list[str]) -> tuple[int, str, bytes] | None:
        if parts == ["metrics"]:
            return 200, CONTENT_TYPE, render(self.registry)
        if parts in ([], ["ui"]):
            return 200, ASSETS["index.html"][1], asset("index.html")
        if len(parts) == 2 and parts[0] == "ui":
            if parts[1] == "data":
                return 200, "application/json", json.dumps(self.doc(), default=str).encode()
            if parts[1] in ASSETS:
                return 200, ASSETS[parts[1]][1], asset(parts[1])
            return 404, "application/json", json.dumps({"errors": [f"no asset {parts[1]!r}"]}).encode()
        return None
