"""Linux /proc helpers shared by the peer scripts (start-up time and CPU accounting).

Not used inside any dataflow/UDF code, so PyFlink workers never need to import it.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List


def _stat_fields(pid: int | str) -> List[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5); [0] = state


def process_start_time() -> float:
    """Epoch time this process was exec'd, so "seconds_incl_startup" includes interpreter start."""
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + int(_stat_fields("self")[19]) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_ticks(root: int) -> Dict[int, int]:
    """utime+stime (clock ticks) of `root` and every live descendant, by pid."""
    parent: Dict[int, int] = {}
    cpu: Dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = _stat_fields(d)
            except OSError:  # exited meanwhile
                continue
            parent[int(d)] = int(f[1])
            cpu[int(d)] = int(f[11]) + int(f[12])
    out: Dict[int, int] = {}
    for pid, ticks in cpu.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            out[pid] = ticks
    return out


class TreeCpuSampler:
    """CPU seconds used by this process and all its descendants while it ran.

    Samples /proc every `period` s in a thread and keeps each pid's last value, so
    processes that exit or get re-parented before the end (PyFlink's Python workers,
    bytewax's worker processes) are still counted, minus at most their last period.
    """

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.seen: Dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.seen.update(_tree_cpu_ticks(os.getpid()))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample()
        return sum(self.seen.values()) / os.sysconf("SC_CLK_TCK")
