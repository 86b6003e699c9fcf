"""Recovery after losing a machine: Worker kill -> next completed epoch, spark driver on a real
standalone cluster (Master + one-core Workers from the pip-installed pyspark package).

Workload: an unbounded generated source -> key_by -> a keyed running count -> a discarding
sink, parallelism 2, checkpoint interval 0.2 s, product restart defaults (fixed delay 0.5 s).
The driver's chaos kills ``--kills`` times the target ``machine`` (SIGKILL of the standalone
Worker JVM and of the executor JVM it started; their Python workers die with them), at most
once per attempt, spaced ``--gap`` seconds. Two set-ups:

- ``restarted``: two Workers; a Worker is started again as soon as one is lost (the machine
  comes back), so the lost task waits for a new executor JVM on it;
- ``spare``: three Workers, one a warm spare (its Python worker started and epochstream
  imported by the driver); the lost task is placed on the spare at once, and a new Worker is
  started to be the next spare (the driver warms it while the job runs).

Measured per kill, on the driver's clock: kill -> failover, failure -> every task of the next
attempt ready (``recovery_seconds``), and kill -> the first epoch that attempt completed.
Writes benchmarks/results/worker_loss.csv and worker_loss.png; prints p50 and max per set-up.
Not a test: timings vary with the load.

    python benchmarks/failures/worker_loss.py [--kills 5] [--gap 25] [--setups restarted,spare] [--spares 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the standalone cluster helper of the slow suite

from benchmarks.harness import RESULTS, pyplot, read_csv, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor  # noqa: E402
from epochstream.deploy.failures import FailureSchedule  # noqa: E402
from epochstream.deploy.spark import spark_session  # noqa: E402
from spark_standalone import StandaloneCluster  # noqa: E402


class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.n = ctx.state(ValueStateDescriptor("n", default=0))

    def process(self, value, ctx):
        self.n.update(self.n.value() + 1)
        return ((ctx.key, self.n.value()),)


def build() -> Pipeline:
    p = Pipeline("worker-loss", parallelism=2, batch_size=256, restart_attempts=1000,
                 checkpoint=CheckpointConfig(interval=0.2, timeout=600.0))
    (p.generate(lambda i: (i % 64, i), count=None, uid="gen")
     .key_by(lambda r: r[0]).process(Count(), uid="count").sink(DiscardingSink(), uid="out"))
    return p


def _keep_workers(cluster: StandaloneCluster, want: int, stop: threading.Event) -> None:
    """Start a Worker whenever fewer than ``want`` are alive (the lost machine comes back)."""
    while not stop.is_set():
        if sum(w.poll() is None for w in cluster.workers) < want:
            cluster.add_worker()
        time.sleep(0.1)


def run_setup(setup: str, kills: int, gap: float, work: Path, spares: int = 1) -> list[dict]:
    workers = 2 + spares if setup == "spare" else 2
    cluster = StandaloneCluster(work / setup, workers=workers)
    stop = threading.Event()
    keeper = threading.Thread(target=_keep_workers, args=(cluster, workers, stop), daemon=True)
    session = None
    try:
        session = spark_session(cluster.url, {"spark.ui.enabled": "false", "spark.executor.cores": "1",
                                              "spark.executor.memory": "512m", "spark.driver.host": "127.0.0.1",
                                              "spark.driver.bindAddress": "127.0.0.1"})
        session.sparkContext.setLogLevel("ERROR")
        keeper.start()
        kill_times = [gap + i * gap for i in range(kills)]
        failures = FailureSchedule(kill_times=kill_times, kill_moments=["now"] * kills,
                                   kill_targets=["machine"] * kills)
        result = build().run(deployment="spark", checkpoint_dir=str(work / setup / "chk"), failures=failures,
                             duration=kill_times[-1] + gap, spark=session, seed=3)
    finally:
        stop.set()
        if session is not None:
            session.stop()
        cluster.stop()
    epochs = [e["time"] for e in result.metrics["epochs"] if e.get("state") == "completed" and "time" in e]
    failovers = [f["time"] for f in result.metrics["failovers"]]
    ready = result.metrics["recovery_seconds"]  # failure -> every task ready, one per failover that recovered
    rows = []
    for i, k in enumerate(result.metrics["kills"]):
        j = next((j for j, t in enumerate(failovers) if t >= k["time"]), None)
        row = {"setup": setup, "kill": i + 1, "killed_at": round(k["time"], 3), "kill_to_failover_s": "",
               "failure_to_ready_s": "", "kill_to_next_epoch_s": "", "restarts": result.restarts}
        if j is not None:
            row["kill_to_failover_s"] = round(failovers[j] - k["time"], 3)
            if j < len(ready):
                row["failure_to_ready_s"] = round(ready[j], 3)
                up = failovers[j] + ready[j]
                after = [t for t in epochs if t > up]  # the first epoch of the attempt that replaced the lost one
                if after:
                    row["kill_to_next_epoch_s"] = round(after[0] - k["time"], 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--gap", type=float, default=25.0, help="seconds between kills (and before the first)")
    ap.add_argument("--setups", default="restarted,spare")
    ap.add_argument("--spares", type=int, default=1,
                    help="spare Workers of the spare set-up (more than one when a Worker takes longer than --gap to "
                         "come back and be warmed)")
    ap.add_argument("--out", default=str(RESULTS / "worker_loss"))
    args = ap.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="worker-loss-") as work:
        for setup in args.setups.split(","):
            rows += run_setup(setup, args.kills, args.gap, Path(work), args.spares)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["spares"] = args.spares if r["setup"] == "spare" else 0
        r["gap_s"] = args.gap
    if out.with_suffix(".csv").exists():  # keep the other set-ups' rows of an earlier run
        rows = [r for r in read_csv(out.with_suffix(".csv")) if r["setup"] not in args.setups.split(",")] + rows
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    write_csv(out.with_suffix(".csv"), rows, list(dict.fromkeys(k for r in rows for k in r)), restval="")
    print(f"{'setup':>10} {'kills':>5} {'measured':>8} {'p50 s':>7} {'max s':>7} {'ready p50 s':>11}")
    series = {}
    for setup in setups:
        mine = [r for r in rows if r["setup"] == setup]
        lat = [float(r["kill_to_next_epoch_s"]) for r in mine if r["kill_to_next_epoch_s"] != ""]
        ready = [float(r["failure_to_ready_s"]) for r in mine if r["failure_to_ready_s"] != ""]
        series[setup] = lat
        print(f"{setup:>10} {len(mine):>5} {len(lat):>8} {statistics.median(lat) if lat else float('nan'):>7.2f} "
              f"{max(lat) if lat else float('nan'):>7.2f} {statistics.median(ready) if ready else float('nan'):>11.2f}")
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (setup, lat) in enumerate(series.items()):
        ax.scatter([i] * len(lat), lat, label=setup)
    ax.axhline(10.0, color="tab:red", linestyle="--", label="10 s target")
    ax.set_xticks(range(len(series)), list(series))
    ax.set_ylabel("Worker kill -> next completed epoch (s)")
    ax.set_title("spark driver, standalone cluster, parallelism 2")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    return 0 if all(series.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
