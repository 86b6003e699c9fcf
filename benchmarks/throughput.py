"""Throughput and latency of the local driver, with and without epochs, against Bytewax (and PyFlink).

Workload (the same for every system, see benchmarks/peers/README.md): record i is
``("k{i % keys}", 1)``; map (value * 1); key by the key; a keyed running count in
ValueState emitting ``(key, count)``; a sink that discards. Parallelism / workers 2.

Variants of epochstream, interleaved with the peers in every repetition so machine noise
hits all of them alike:
- ``epochs-1s``: aligned epochs every second (snapshots + 2PC);
- ``no-epochs``: only the final epoch of the bounded job;
- ``latency``: epochs every second; every 64th count carries its source timestamp to the
  sink, which records source-to-sink latency (ms).
Each epochstream run is checked: the final committed state must hold exactly N counts.

Writes benchmarks/results/throughput.csv and throughput.png; prints a summary table.
Not a test: nothing here asserts timings.

    python benchmarks/throughput.py [--records 3000000] [--repeats 3] [--peers bytewax,pyflink]

``--baseline-src DIR`` also runs the epochstream variants from another source tree (the
``src`` folder of a checkout of an earlier commit, e.g. a ``git worktree``), interleaved
with this tree's in the same repetitions, as system ``epochstream@baseline``; both then run
in a child process each, so neither has the benchmark's own process to itself.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from epochstream import DiscardingSink, FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.oracle import committed_state  # noqa: E402

KEYS = 1000


class RunningCount(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        n = self.count.value() + value[1]
        self.count.update(n)
        return ((ctx.key, n),)


class RunningCountStamped(RunningCount):
    def process(self, value, ctx):
        n = self.count.value() + value[1]
        self.count.update(n)
        return ((ctx.key, n, value[2]),)


def _record(i: int):
    return (f"k{i % KEYS}", 1)


def _stamped(i: int):
    return (f"k{i % KEYS}", 1, time.perf_counter())  # CLOCK_MONOTONIC: comparable across processes


def _sample_latency(r) -> bool:
    return r[1] % 64 == 0


def _latency_ms(r) -> float:
    return (time.perf_counter() - r[2]) * 1000.0


def build(records: int, interval: float | None, latency_dir: str | None = None) -> Pipeline:
    p = Pipeline("throughput", parallelism=2, checkpoint_interval=interval)
    if latency_dir is None:
        (p.generate(_record, count=records, uid="src")
         .map(lambda r: (r[0], r[1] * 1))
         .key_by(lambda r: r[0])
         .process(RunningCount(), uid="count")
         .sink(DiscardingSink(), uid="sink"))
    else:
        (p.generate(_stamped, count=records, uid="src")
         .map(lambda r: (r[0], r[1] * 1, r[2]))
         .key_by(lambda r: r[0])
         .process(RunningCountStamped(), uid="count")
         .filter(_sample_latency)
         .map(_latency_ms)
         .sink(FileSink(latency_dir), uid="latency"))
    return p


def run_epochstream(records: int, variant: str) -> dict:
    interval = None if variant == "no-epochs" else 1.0
    with tempfile.TemporaryDirectory(prefix="es-bench-") as tmp:
        lat_dir = os.path.join(tmp, "lat") if variant == "latency" else None
        p = build(records, interval, lat_dir)
        cpu0 = _children_cpu()
        t0 = time.perf_counter()
        result = p.run(deployment="local", checkpoint_dir=os.path.join(tmp, "chk"))
        seconds = time.perf_counter() - t0
        workers_cpu = _children_cpu() - cpu0  # CPU of the reaped worker processes
        storage = LocalCheckpointStorage(os.path.join(tmp, "chk"))
        manifest, root = storage.latest()
        total = sum(committed_state(storage, manifest, root)["count"]["count"].values())
        if total != records:
            raise RuntimeError(f"epochstream {variant}: committed counts sum to {total}, expected {records}")
        row = {"system": "epochstream", "variant": variant, "snapshot_interval": interval or 0,
               "records": records, "seconds": seconds, "records_per_s": records / seconds,
               "epochs": len(result.completed_epochs), "workers": 2, "p50_ms": "", "p99_ms": "",
               "workers_cpu_per_wall": round(workers_cpu / seconds, 2)}
        if lat_dir:
            lat = sorted(FileSink(lat_dir).read())
            row["p50_ms"] = lat[len(lat) // 2]
            row["p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        return row


def run_epochstream_in(src: str, records: int, variant: str) -> dict:
    """One epochstream run with the package imported from ``src``, in a child process."""
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, __file__, "--single", variant, "--records", str(records)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"epochstream from {src}, {variant}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_peer_row(system: str, records: int, interval: float) -> dict:
    from benchmarks.peers.run_peers import run_peer

    res = run_peer(system, records=records, keys=KEYS, snapshot_interval=interval, workers=2)
    return {"system": system, "variant": "snapshots-1s" if interval else "no-snapshots",
            "snapshot_interval": interval, "records": records, "seconds": res["seconds"],
            "records_per_s": res["records_per_s"], "epochs": "", "workers": 2, "p50_ms": "", "p99_ms": ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=3_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default="bytewax", help="comma list of bytewax, pyflink ('' for none)")
    ap.add_argument("--pyflink-records", type=int, default=200_000, help="PyFlink is ~100x slower")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--baseline-src", help="src folder of an earlier checkout to compare with, in the same run")
    ap.add_argument("--single", help=argparse.SUPPRESS)  # one epochstream run, a JSON row on stdout
    args = ap.parse_args(argv)
    if args.single:
        print(json.dumps(run_epochstream(args.records, args.single)))
        return 0
    peers = [p for p in args.peers.split(",") if p]
    systems = ["epochstream"] + (["epochstream@baseline"] if args.baseline_src else [])
    plan = [(system, v) for v in ("epochs-1s", "no-epochs", "latency") for system in systems]
    plan += [(peer, iv) for peer in peers for iv in (1.0, 0.0)]
    rows: list[dict] = []
    total = args.repeats * len(plan)
    done = 0
    for rep in range(args.repeats):
        for system, variant in plan:
            done += 1
            label = variant if system.startswith("epochstream") else ("snapshots 1s" if variant else "no snapshots")
            print(f"[{done}/{total}] repeat {rep + 1}: {system} {label} ...",
                  end=" ", flush=True)
            if system == "epochstream@baseline":
                row = {**run_epochstream_in(args.baseline_src, args.records, variant), "system": system}
            elif system == "epochstream" and args.baseline_src:
                row = run_epochstream_in(str(HERE.parent / "src"), args.records, variant)
            elif system == "epochstream":
                row = run_epochstream(args.records, variant)
            else:
                n = args.pyflink_records if system == "pyflink" else args.records
                row = run_peer_row(system, n, variant)
            row["repeat"] = rep + 1
            rows.append(row)
            cores = f", workers used {row['workers_cpu_per_wall']} cores" if row.get("workers_cpu_per_wall") else ""
            print(f"{row['records_per_s']:,.0f} records/s{cores}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = ["system", "variant", "repeat", "records", "seconds", "records_per_s", "snapshot_interval", "epochs",
              "workers", "workers_cpu_per_wall", "p50_ms", "p99_ms"]
    with open(out / "throughput.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})
    med: dict[tuple[str, str], float] = {}
    for key in sorted({(r["system"], r["variant"]) for r in rows}):
        med[key] = statistics.median(r["records_per_s"] for r in rows if (r["system"], r["variant"]) == key)
    lat = [r for r in rows if r["variant"] == "latency"]
    print("\nmedian records/s (2 workers, keyed running count, 1000 keys)")
    print(f"  {'system':<21} {'variant':<14} {'records/s':>12}")
    for (system, variant), v in med.items():
        print(f"  {system:<21} {variant:<14} {v:>12,.0f}")
    ratio = med[("epochstream", "epochs-1s")] / med[("epochstream", "no-epochs")]
    print(f"\nepochs every 1 s vs no epochs: {ratio:.2f} (target >= 0.9)")
    for variant in ("epochs-1s", "no-epochs"):
        if ("epochstream@baseline", variant) in med:
            print(f"this tree / baseline ({args.baseline_src}), {variant}: "
                  f"{med[('epochstream', variant)] / med[('epochstream@baseline', variant)]:.3f}")
    if ("bytewax", "snapshots-1s") in med:
        print(f"epochstream / Bytewax, both with 1 s snapshots: "
              f"{med[('epochstream', 'epochs-1s')] / med[('bytewax', 'snapshots-1s')]:.2f} (target >= 1)")
    if ("pyflink", "snapshots-1s") in med:
        print(f"epochstream / PyFlink, both with 1 s snapshots: "
              f"{med[('epochstream', 'epochs-1s')] / med[('pyflink', 'snapshots-1s')]:.1f}")
    if lat:
        print(f"latency source->sink with 1 s epochs: p50 {statistics.median(r['p50_ms'] for r in lat):.1f} ms, "
              f"p99 {statistics.median(r['p99_ms'] for r in lat):.1f} ms (median over repeats)")
    _plot(med, lat, out / "throughput.png")
    print(f"\nwrote {out / 'throughput.csv'} and {out / 'throughput.png'}")
    return 0


def _plot(med, lat, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{s}\n{v}" for s, v in med]
    colors = ["tab:blue" if s == "epochstream" else "tab:cyan" if s.startswith("epochstream") else "tab:gray"
              for s, _ in med]
    ax.bar(labels, [v / 1000 for v in med.values()], color=colors)
    ax.set_ylabel("thousand records / s (median)")
    ax.set_title("keyed running count, 2 workers")
    ax.tick_params(axis="x", labelsize=8)
    if lat:
        ax2.bar(["p50", "p99"], [statistics.median(r["p50_ms"] for r in lat),
                                 statistics.median(r["p99_ms"] for r in lat)], color="tab:blue")
        ax2.set_ylabel("ms")
        ax2.set_title("latency, 1 s epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
