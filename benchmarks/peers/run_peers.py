"""Run the peer baselines (Bytewax, PyFlink) in their own virtualenvs.

Each peer lives in benchmarks/.venv-<name>, created on first use, because
apache-flink pins old numpy/pandas/pyarrow that would break the main environment
(and Bytewax is kept out of it too, so the benchmark never changes the project env).

    from benchmarks.peers.run_peers import run_peer
    run_peer("bytewax", records=3_000_000, snapshot_interval=1)   # -> dict
    run_peer("pyflink", records=300_000, python_mode="thread")

or from the shell (extra flags go to the peer script unchanged):

    python benchmarks/peers/run_peers.py bytewax --records 3000000 --snapshot-interval 1
    python benchmarks/peers/run_peers.py matrix 3 results.jsonl   # the README table
    python benchmarks/peers/run_peers.py pyflink-variant tuned --records 200000   # PYFLINK_VARIANTS
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

PEERS_DIR = Path(__file__).resolve().parent
BENCH_DIR = PEERS_DIR.parent


@dataclass(frozen=True)
class Peer:
    requirement: str  # pinned pip requirement installed into the venv
    script: str  # peer script in benchmarks/peers/
    venv: str  # venv dir name under benchmarks/


PEERS: Dict[str, Peer] = {
    "bytewax": Peer("bytewax==0.21.1", "bytewax_keyed_count.py", ".venv-bytewax"),
    # 2.3.0: newest apache-flink; installs on CPython 3.11 (pulls apache-beam 2.61, pemja, numpy 2.1, pyarrow 16).
    "pyflink": Peer("apache-flink==2.3.0", "pyflink_keyed_count.py", ".venv-pyflink"),
}


def ensure_venv(system: str) -> Path:
    """Create benchmarks/.venv-<system> with the pinned peer installed; return its python.

    A marker file records what was installed, so later calls are a cheap no-op
    and a changed pin triggers a re-install.
    """
    peer = PEERS[system]
    root = BENCH_DIR / peer.venv
    python = root / "bin" / "python"
    marker = root / ".peer-installed"
    if marker.exists() and marker.read_text().strip() == peer.requirement and python.exists():
        return python
    if system == "pyflink" and shutil.which("java") is None:
        raise RuntimeError("PyFlink needs a Java runtime (java on PATH); install e.g. openjdk-17-jre-headless")
    if not python.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", peer.requirement], check=True)
    marker.write_text(peer.requirement + "\n")
    return python


def ensure_flink_kafka_jars() -> Path:
    """Fetch Flink's Kafka connector (jars/kafka-flink/pom.xml) into jars/kafka-flink/lib with mvn, as
    scripts/setup.sh fetches the project's jars: again only when the pom changed. Returns the folder."""
    pom = BENCH_DIR.parent / "jars" / "kafka-flink" / "pom.xml"
    lib = pom.parent / "lib"
    stamp = lib / ".pom-sha256"
    want = hashlib.sha256(pom.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == want and any(lib.glob("flink-sql-connector-kafka-*.jar")):
        return lib
    if shutil.which("mvn") is None:
        raise RuntimeError("mvn is needed to fetch Flink's Kafka connector (apt-get install maven)")
    shutil.rmtree(lib, ignore_errors=True)
    subprocess.run(["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies"], check=True)
    stamp.write_text(want + "\n")
    return lib


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole host so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def _flags(kw: Dict[str, Any]) -> List[str]:
    """records=5, snapshot_interval=1, sql=True -> ["--records", "5", "--snapshot-interval", "1", "--sql"].

    True is a bare switch; False and None are left out (the script's default).
    """
    out: List[str] = []
    for k, v in kw.items():
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            out.append(flag)
        elif v is not None and v is not False:
            out += [flag, str(v)]
    return out


# PyFlink at its defaults and at its best (flags of pyflink_keyed_count.py); benchmarks/epochs/throughput.py
# runs these as peers "pyflink" (default), "pyflink-tuned", "pyflink-thread" and "flink-sql".
PYFLINK_TUNING: Dict[str, Any] = {"bundle_size": 100_000, "no_metrics": True, "unaligned": True}
PYFLINK_VARIANTS: Dict[str, Dict[str, Any]] = {
    # Flink 2.3's defaults: Beam worker processes, bundles of 1,000 records, Python metrics on, aligned.
    "default": {"python_mode": "process"},
    # process mode tuned: bundles of 100,000 records, Python metrics off, unaligned checkpoints.
    "tuned": {"python_mode": "process", **PYFLINK_TUNING},
    # thread mode (PEMJA) on a standalone cluster of 2 TaskManagers x 1 slot: one interpreter lock each.
    # Bundles stay at the default 1,000 and checkpoints aligned: with bundle 100,000 and unaligned
    # checkpoints thread mode ran 2-6x slower here (README.md, "PyFlink at its best").
    "thread": {"python_mode": "thread", "cluster": 2, "no_metrics": True},
    # the JVM's ceiling: Flink SQL COUNT(*) GROUP BY over the same keys on the same cluster, no Python.
    "sql": {"sql": True, "cluster": 2},
}


def run_pyflink_variant(variant: str, *, records: int, keys: int = 1000, snapshot_interval: float = 1.0,
                        workers: int = 2, timeout: float = 3600) -> Dict[str, Any]:
    """One PyFlink peer run with the settings of ``PYFLINK_VARIANTS[variant]``; the result has ``settings``."""
    if variant not in PYFLINK_VARIANTS:
        raise ValueError(f"unknown PyFlink variant {variant!r}; known: {', '.join(PYFLINK_VARIANTS)}")
    return run_peer("pyflink", records=records, keys=keys, snapshot_interval=snapshot_interval,
                    workers=workers, timeout=timeout, **PYFLINK_VARIANTS[variant])


def last_json(text: str) -> dict | None:
    """The last JSON object line of a peer script's output (its result), None if it printed none."""
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def flink_error(text: str) -> str:
    """The line that says why a PyFlink job failed: the innermost ``Caused by:`` of a Java trace, else
    the last Python exception line, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    caused = [ln for ln in lines if ln.startswith("Caused by:")]
    if caused:
        return caused[-1][len("Caused by:"):].strip()
    errors = [ln for ln in lines if not ln.startswith(("at ", "File ", "...")) and ("Error" in ln or "Exception" in ln)]
    return (errors or lines or ["no output"])[-1]


def run_peer_args(system: str, args: List[str], timeout: float = 3600, script: str | None = None) -> Dict[str, Any]:
    """Run a peer script with raw CLI args; return its JSON line plus host-load info.

    Adds "cpu_cores_host" (whole machine, average busy cores during the run),
    "cpu_cores_peer" (the peer's own process tree) and "cpu_cores_other" (the rest:
    other work on the machine), so a disturbed run can be spotted: on a 2-core box
    anything much above 0.1 in cpu_cores_other means the numbers are pessimistic.
    """
    python = ensure_venv(system)
    cmd = [str(python), str(PEERS_DIR / (script or PEERS[system].script)), *args]
    busy0, t0 = _busy_jiffies(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    busy = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n"
                           f"stdout tail:\n{proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-4000:]}")
    result: Dict[str, Any] = json.loads(lines[-1])
    result["cpu_cores_host"] = round(busy / wall, 2)
    result["cpu_cores_peer"] = round(result["cpu_seconds"] / wall, 2)
    result["cpu_cores_other"] = round(max(0.0, busy - result["cpu_seconds"]) / wall, 2)
    result["command"] = " ".join(cmd)
    return result


def run_peer(system: str, *, records: int, keys: int = 1000, snapshot_interval: float = 1.0,
             workers: int = 2, timeout: float = 3600, **extra: Any) -> Dict[str, Any]:
    """Run one peer (``"bytewax"`` or ``"pyflink"``) and return its result dict.

    ``extra`` goes to the script as flags, e.g. ``mode="threads"`` (bytewax) or
    ``python_mode="thread"`` (pyflink). Raises RuntimeError if the run fails or the
    output count does not match.
    """
    kw = dict(records=records, keys=keys, snapshot_interval=snapshot_interval, workers=workers, **extra)
    return run_peer_args(system, _flags(kw), timeout=timeout)


# The configurations measured for README.md: (system, records, extra flags).
MATRIX: List[Tuple[str, int, Dict[str, Any]]] = [
    ("bytewax", 5_000_000, {"mode": "processes"}),
    ("bytewax", 5_000_000, {"mode": "threads"}),
    ("pyflink", 500_000, {"python_mode": "thread"}),
    ("pyflink", 200_000, {"python_mode": "process"}),
]


def run_matrix(reps: int = 3, out: Path | None = None) -> List[Dict[str, Any]]:
    """Run every MATRIX config with snapshots every 1 s and off, `reps` times, interleaved
    (so slow drifts in machine load hit all configs alike); print a median table."""
    results: List[Dict[str, Any]] = []
    for _ in range(reps):
        for system, n, extra in MATRIX:
            for interval in (1, 0):
                r = run_peer(system, records=n, snapshot_interval=interval, **extra)
                results.append(r)
                print(json.dumps(r), flush=True)
                if out:
                    with out.open("a") as f:
                        f.write(json.dumps(r) + "\n")
    print("\n| system | mode | N | rec/s, 1 s snapshots | rec/s, no snapshots | ratio | other load (cores) |")
    print("|---|---|---|---|---|---|---|")
    for system, n, extra in MATRIX:
        mode = next(iter(extra.values()))
        def med(interval: int, system: str = system, mode: str = mode) -> float:
            return statistics.median(r["records_per_s"] for r in results if r["system"] == system
                                     and mode in (r.get("mode"), r.get("python_mode"))
                                     and r["snapshot_interval"] == interval)
        other = statistics.median(r["cpu_cores_other"] for r in results if r["system"] == system
                                  and mode in (r.get("mode"), r.get("python_mode")))
        on, off = med(1), med(0)
        print(f"| {system} | {mode} | {n:,} | {on:,.0f} | {off:,.0f} | {on / off:.2f} | {other:.2f} |")
    return results


def _main(argv: List[str]) -> int:
    if argv[:1] == ["pyflink-variant"] and len(argv) > 1:  # pyflink-variant NAME [script flags]
        if argv[1] not in PYFLINK_VARIANTS:
            print(f"unknown PyFlink variant {argv[1]!r}; known: {', '.join(PYFLINK_VARIANTS)}", file=sys.stderr)
            return 2
        print(json.dumps(run_peer_args("pyflink", [*_flags(PYFLINK_VARIANTS[argv[1]]), *argv[2:]])), flush=True)
        return 0
    if argv[:1] == ["matrix"]:
        reps = int(argv[1]) if len(argv) > 1 else 3
        run_matrix(reps, Path(argv[2]) if len(argv) > 2 else None)
        return 0
    if not argv or argv[0] not in PEERS:
        print(f"usage: run_peers.py {{{','.join(PEERS)}}} [peer script flags...]\n"
              f"       run_peers.py pyflink-variant {{{','.join(PYFLINK_VARIANTS)}}} [peer script flags...]\n"
              f"       run_peers.py matrix [REPS [OUT.jsonl]]", file=sys.stderr)
        return 2
    print(json.dumps(run_peer_args(argv[0], argv[1:])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
