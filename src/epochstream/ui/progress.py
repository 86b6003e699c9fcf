"""The terminal's live status line for ``epochstream run`` and ``chaos`` (tqdm).

On a terminal, one line updated in place: records/s, epochs completed, the last epoch's
duration, restarts and kills, read twice a second from the job's own dashboard document
(``GET /ui/data`` on its HTTP server). Nothing is shown with ``--json`` or when stderr is
not a terminal (``wanted``), so scripts and pipes see exactly what they saw before.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import urllib.request
from typing import Any, TextIO

from tqdm import tqdm


def wanted(json_output: bool, stream: TextIO | None = None) -> bool:
    """A status line only for people: not with ``--json``, only on a terminal."""
    stream = stream if stream is not None else sys.stderr
    return not json_output and bool(getattr(stream, "isatty", lambda: False)())


def status_text(label: str, job: dict[str, Any]) -> str:
    """The line for one ``model.dashboard`` job summary."""
    rate = job.get("records_per_second")
    last = job.get("last_epoch_seconds")
    return (f"{label} {job.get('state') or ''}: "
            f"{'-' if rate is None else f'{rate:,.0f}'} records/s | "
            f"{job.get('completed_epochs') or 0} epochs | "
            f"last epoch {'-' if last is None else f'{last:.2f}s'} | "
            f"{job.get('restarts') or 0} restarts | {job.get('kills') or 0} kills")


def finished(result: Any) -> dict[str, Any]:
    """``status_text`` fields of a finished job's ``JobResult``."""
    seconds = result.seconds or 0.0
    return {"state": "FINISHED", "completed_epochs": len(result.completed_epochs), "restarts": result.restarts,
            "kills": len(result.metrics.get("kills") or []),
            "records_per_second": result.records_in / seconds if seconds > 0 else None}


class StatusLine:
    """Polls a running job's dashboard document and keeps one terminal line up to date.

    ``on_start`` is the driver's callback (its argument names the job's endpoint); ``close``
    stops polling and ends the line, with the finished job's own counts when given: a short job
    can end between two polls, and the line left on screen should say how it ended. Poll
    failures (the job just ended) are ignored.
    """

    def __init__(self, label: str, stream: TextIO | None = None, every: float = 0.5) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Any = None
        self._last: dict[str, Any] = {}

    def on_start(self, info: dict[str, Any]) -> None:
        # the size once, through shutil (COLUMNS/LINES, else the terminal's, else 80x24): tqdm's
        # own reading of a terminal that never had a size set (0x0) shows nothing at all
        size = shutil.get_terminal_size()
        self._bar = tqdm(total=None, bar_format="{desc}", file=self.stream, leave=True, ncols=max(40, size.columns),
                         nrows=max(2, size.lines))
        self._bar.set_description_str(f"{self.label} {info.get('name', '')}: starting", refresh=True)
        url = str(info["endpoint"]).rstrip("/") + "/ui/data"
        self._thread = threading.Thread(target=self._poll, args=(url,), name="epochstream-status", daemon=True)
        self._thread.start()

    def _poll(self, url: str) -> None:
        while not self._stop.wait(self.every):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    job = json.loads(r.read())["job"]
            except (OSError, ValueError, KeyError):
                continue
            if self._bar is not None and not self._stop.is_set():
                self._last = job
                self._bar.set_description_str(status_text(self.label, job), refresh=True)

    def close(self, final: dict[str, Any] | None = None) -> None:
        """Stop polling; ``final`` (fields of a ``status_text`` job) overrides the last poll."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._bar is not None:
            if final is not None:
                self._bar.set_description_str(status_text(self.label, {**self._last, **final}), refresh=True)
            self._bar.close()
            self._bar = None
