"""What the benchmark scripts share: percentiles, memory of processes, CSV and PNG output, progress lines.

Only measurement plumbing lives here; workloads and pipelines stay in their scripts, so a script reads
top to bottom as the experiment it runs. Every function is safe to import in a forked worker (no
threads or files opened at import).

Percentiles use one method everywhere, so figures of different scripts compare: the value at 0-based
index ``floor(q * n)`` of the sorted sample, capped at the last (for p50 the upper median, for p99 of
fewer than 100 values the maximum). It needs no interpolation, so a percentile is always a measured value.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from benchmarks.peers._procinfo import MachineCpu, TreeCpuSampler

__all__ = ["RESULTS", "MachineCpu", "TreeCpuSampler", "children_rss_mb", "command_line", "log", "percentile",
           "private_mb", "pyplot", "read_csv", "rss_mb", "write_csv"]

#: where every script writes by default (``--out``)
RESULTS = Path(__file__).resolve().parent / "results"

T0 = time.monotonic()


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values`` by the index ``floor(q * n)``; NaN when empty.

    >>> percentile([4, 1, 3, 2], 0.5), percentile(range(1, 101), 0.99), percentile([7.0], 0.99)
    (3, 100, 7.0)
    """
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(q * len(s)))]


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of one process in MB (``VmRSS``); NaN if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def children_rss_mb() -> dict[int, float]:
    """Resident set size (MB) of every child process of this one (the local driver's workers)."""
    me = os.getpid()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me:  # ppid
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[int(entry)] = int(line.split()[1]) / 1024.0
        except (OSError, IndexError, ValueError):
            continue
    return out


def private_mb(pid: int) -> float:
    """Memory private to one process (MB; Private_Clean + Private_Dirty of smaps_rollup): unlike
    RSS, not the pages a forked worker still shares with the job master (whose heap holds
    whatever earlier runs of a benchmark left), so runs do not inherit each other's memory."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1])
    except OSError:
        return float("nan")
    return total / 1024.0


def command_line() -> str:
    """The command this process runs, as a result file records it (``# command:``)."""
    return " ".join(sys.argv)


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]], fieldnames: Sequence[str] | None = None, *,
              restval: Any = "", extrasaction: str = "raise", notes: Iterable[str] = ()) -> None:
    """Write ``rows`` (columns: ``fieldnames``, else the first row's keys), then ``# command:`` and one
    ``# <note>`` line per note, so each result file says how it was made (``read_csv`` skips them)."""
    fields = list(fieldnames) if fieldnames is not None else (list(rows[0]) if rows else [])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval=restval, extrasaction=extrasaction)  # type: ignore[arg-type]
        w.writeheader()
        w.writerows(rows)
        f.write(f"# command: {command_line()}\n")
        for note in notes:
            f.write(f"# {note}\n")


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a result CSV, without its ``#`` comment lines."""
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display; imported on first use: slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log(msg: str) -> None:
    """A progress line: seconds since start and the 1-minute load (the machine is shared)."""
    print(f"[{time.monotonic() - T0:6.0f}s load {os.getloadavg()[0]:4.1f}] {msg}", flush=True)

