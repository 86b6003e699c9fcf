"""Linux /proc helpers shared by the peer scripts and the benchmarks (start-up time, CPU
accounting, how busy the whole machine was).

Not used inside any dataflow/UDF code, so PyFlink workers never need to import it.
"""

from __future__ import annotations

import os
import threading
import time
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


def _machine_ticks() -> List[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal (guest time is
    already in user), in clock ticks summed over every CPU."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:9]]


class MachineCpu:
    """How busy the whole machine was while something ran: its CPU share in use, the share
    the hypervisor took (steal), and in what share of its one-second samples no CPU was left
    (idle below 5%).

    A latency percentile measured on a shared two-vCPU VM says as much about the machine as
    about the job; these say whether there was CPU to spare while it was measured. Samples
    /proc/stat once per ``period`` in a thread.
    """

    def __init__(self, period: float = 1.0, duration: float | None = None) -> None:
        """``duration``: the window closes on its own after that many seconds (a load of known
        length inside a longer run); otherwise at ``stop``."""
        self.period = period
        self.duration = duration
        self.first = self.last = _machine_ticks()
        self.seconds = 0
        self.saturated = 0
        self._closed = False  # the window closed on its own: ``last`` is its end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        end = None if self.duration is None else time.monotonic() + self.duration
        while not self._stop.wait(self.period if end is None else max(0.0, min(self.period, end - time.monotonic()))):
            now = _machine_ticks()
            delta = [b - a for a, b in zip(self.last, now, strict=True)]
            self.last = now
            total = sum(delta)
            if total > 0:
                self.seconds += 1
                self.saturated += delta[3] + delta[4] < 0.05 * total
            if end is not None and time.monotonic() >= end:
                self._closed = True
                return

    def stop(self) -> Dict[str, float]:
        """``cpu_busy_pct``, ``cpu_steal_pct`` over the whole window and ``cpu_saturated_pct``,
        the share of its samples with no CPU left."""
        self._stop.set()
        self._thread.join()
        delta = [b - a for a, b in zip(self.first, self.last if self._closed else _machine_ticks(), strict=True)]
        total = sum(delta) or 1
        idle, steal = delta[3] + delta[4], delta[7]
        return {"cpu_busy_pct": round(100.0 * (total - idle - steal) / total, 1),
                "cpu_steal_pct": round(100.0 * steal / total, 1),
                "cpu_saturated_pct": round(100.0 * self.saturated / self.seconds, 1) if self.seconds else float("nan")}
