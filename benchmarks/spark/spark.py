"""The spark driver against the local driver: throughput, recovery after kills, trigger to commit.

Workload: record i is ``("k{i % 1000}", 1)``; key by the key; a keyed running count in
ValueState emitting ``(key, count)``; a sink that discards; parallelism 2, aligned epochs
every ``--interval`` seconds. The same pipeline runs on the local driver (forked processes,
pipes) and on the spark driver (barrier tasks in Spark's Python workers, TCP), interleaved
in every repetition so machine noise hits both alike. Throughput is records / seconds of the
run proper (``run_seconds``: from the first attempt's launch to the end, so the spark
driver's job submission is in it; the one-off SparkSession start and Python-worker warm-up
are not). Each run is checked: its final committed state must hold exactly N counts.

Recovery: a run on the spark driver with ``--kills`` SIGKILLs (default 10) of a task's
Python worker (``--target executor`` with a ``local-cluster`` master kills executor JVMs);
recovery time = failure detected -> every task of the resubmitted job up and restored.

Trigger to commit: every completed epoch of the throughput runs (per driver).

Writes benchmarks/results/spark.csv (one row per run or kill) and spark.png; prints a
summary. Not a test: nothing here asserts timings.

    python benchmarks/spark/spark.py [--records 1200000] [--repeats 3] [--kills 10] [--master local[2,4]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks.harness import RESULTS, percentile, pyplot, write_csv  # noqa: E402
from epochstream import DiscardingSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.failures import FailureSchedule  # noqa: E402
from epochstream.deploy.restart import FixedDelayRestart  # noqa: E402
from epochstream.deploy.spark import spark_session  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

KEYS = 1000


class RunningCount(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        n = self.count.value() + value[1]
        self.count.update(n)
        return ((ctx.key, n),)


def _record(i: int):
    return (f"k{i % KEYS}", 1)


def _key(r):
    return r[0]


def pipeline(records: int, interval: float, parallelism: int = 2) -> Pipeline:
    p = Pipeline("spark-bench", parallelism=parallelism, checkpoint_interval=interval, batch_size=1024,
                 restart_strategy=FixedDelayRestart(100, 0.0))
    p.generate(_record, count=records, uid="gen").key_by(_key).process(RunningCount(), uid="count") \
        .sink(DiscardingSink(), uid="out")
    return p


def run_once(deployment: str, records: int, interval: float, spark, failures=None):
    chk = tempfile.mkdtemp(prefix=f"bench-spark-{deployment}-")
    options = {"spark": spark} if deployment == "spark" else {}
    result = pipeline(records, interval).run(deployment=deployment, checkpoint_dir=chk, failures=failures,
                                             **options)
    manifest, root = LocalCheckpointStorage(chk).latest()
    total = sum(committed_state(LocalCheckpointStorage(chk), manifest, root)["count"]["count"].values())
    if total != records:  # every record counted exactly once, or the numbers mean nothing
        raise SystemExit(f"{deployment}: committed counts sum to {total}, expected {records}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--kill-records", type=int, default=1_500_000, help="input of the run with kills")
    ap.add_argument("--master", default="local[2,4]")
    ap.add_argument("--target", default="worker", choices=["worker", "executor"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    spark = spark_session(args.master, {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    print(f"SparkSession on {args.master} started in {time.perf_counter() - t0:.1f}s", flush=True)
    rows: list[dict] = []
    epochs: dict[str, list[float]] = {"local": [], "spark": []}
    warm = pipeline(1 << 14, args.interval)  # warm-up: Python workers, imports
    warm.run(deployment="spark", checkpoint_dir=tempfile.mkdtemp(prefix="bench-spark-warm-"), spark=spark)

    for rep in range(args.repeats):
        for deployment in ("local", "spark"):
            r = run_once(deployment, args.records, args.interval, spark)
            secs = r.metrics["run_seconds"]
            ttc = [e["trigger_to_commit_seconds"] for e in r.metrics["epochs"] if e["state"] == "completed"]
            epochs[deployment] += ttc
            rows.append({"kind": "throughput", "deployment": deployment, "repeat": rep, "records": args.records,
                         "seconds": round(secs, 4), "records_per_second": round(args.records / secs, 1),
                         "epochs": len(ttc), "trigger_to_commit_median_ms": round(1e3 * statistics.median(ttc), 2)})
            print(f"[{rep + 1}/{args.repeats}] {deployment:5s} {args.records / secs:10.0f} rec/s "
                  f"({secs:.2f}s, {len(ttc)} epochs)", flush=True)

    # recovery: kills spread over the run; one kill per attempt, each after the job is back
    print(f"recovery: {args.kills} kills of the {args.target} on {args.master} ...", flush=True)
    failures = FailureSchedule(kill_times=[1.0 + 0.5 * i for i in range(args.kills)],
                               kill_targets=[args.target] * args.kills)
    r = run_once("spark", args.kill_records, args.interval, spark, failures)
    rec = r.metrics["recovery_seconds"]
    # not strict: a kill whose recovery the run did not see (it ended or failed first) has no entry in rec
    for i, (k, s) in enumerate(zip(r.metrics["kills"], rec, strict=False)):
        rows.append({"kind": "recovery", "deployment": "spark", "repeat": i, "seconds": round(s, 4),
                     "target": k["target"]})
        print(f"  kill {i + 1}: {k['target']} of worker {k['worker']} at {k['time']:.1f}s -> recovered in {s:.2f}s",
              flush=True)
    for deployment, values in epochs.items():
        for v in values:
            rows.append({"kind": "trigger_to_commit", "deployment": deployment, "seconds": round(v, 5)})
    spark.stop()

    fields = ["kind", "deployment", "repeat", "records", "seconds", "records_per_second", "epochs",
              "trigger_to_commit_median_ms", "target"]
    write_csv(out / "spark.csv", rows, fields)

    tput = {d: statistics.median(r["records_per_second"] for r in rows
                                 if r["kind"] == "throughput" and r["deployment"] == d) for d in ("local", "spark")}
    ratio = tput["spark"] / tput["local"]
    print()
    print(f"{'metric':<42} {'local':>12} {'spark':>12}")
    print(f"{'throughput, median (records/s)':<42} {tput['local']:>12.0f} {tput['spark']:>12.0f}")
    print(f"{'spark / local throughput':<42} {'':>12} {ratio:>12.2f}")
    med = {d: 1e3 * statistics.median(epochs[d]) for d in epochs}
    p95 = {d: 1e3 * percentile(epochs[d], 0.95) for d in epochs}
    print(f"{'epoch trigger -> commit, median (ms)':<42} {med['local']:>12.1f} {med['spark']:>12.1f}")
    print(f"{'epoch trigger -> commit, p95 (ms)':<42} {p95['local']:>12.1f} {p95['spark']:>12.1f}")
    if rec:
        print(f"{'recovery after a kill, median / max (s)':<42} {statistics.median(rec):>12.2f} {max(rec):>12.2f}"
              f"   ({len(rec)} kills, {r.restarts} restarts)")
    _plot(out, rows, epochs, rec, ratio)
    print(f"wrote {out / 'spark.csv'} and {out / 'spark.png'}")


def _plot(out: Path, rows, epochs, rec, ratio) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for i, d in enumerate(("local", "spark")):
        v = [r["records_per_second"] for r in rows if r["kind"] == "throughput" and r["deployment"] == d]
        ax[0].scatter([i] * len(v), v)
        ax[0].bar(i, statistics.median(v), alpha=0.4)
    ax[0].set_xticks([0, 1], ["local driver", "spark driver"])
    ax[0].set_ylabel("records/s (keyed running count, p=2)")
    ax[0].set_title(f"throughput (spark/local = {ratio:.2f})")
    ax[1].boxplot([[1e3 * x for x in epochs["local"]], [1e3 * x for x in epochs["spark"]]])
    ax[1].set_xticks([1, 2], ["local", "spark"])
    ax[1].set_ylabel("ms")
    ax[1].set_title("epoch trigger -> commit")
    if rec:
        ax[2].bar(range(1, len(rec) + 1), rec)
        ax[2].axhline(statistics.median(rec), color="k", ls="--", label=f"median {statistics.median(rec):.1f}s")
        ax[2].legend()
    ax[2].set_xlabel("kill")
    ax[2].set_ylabel("s")
    ax[2].set_title("recovery after a kill (spark driver)")
    fig.tight_layout()
    fig.savefig(out / "spark.png", dpi=110)


if __name__ == "__main__":
    main()
