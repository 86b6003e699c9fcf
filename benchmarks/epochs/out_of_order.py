"""What bounded out-of-orderness costs a source: records/s of one split's reader.

A ``SplitReader`` (``runtime.reader``) reads 400,000 timestamped records of one split, in
reads of 1,024, cutting runs of one time label and recomputing the time promise after each
read, as a source task does, with no operator behind it (the source's own cost):

- ``strict``: ordered input, no ``max_out_of_orderness`` (labels must not decrease);
- ``bounded-ordered``: the same input with ``max_out_of_orderness=3`` s;
- ``bounded-disordered``: each timestamp up to 2 s behind the pace (every label boundary
  is crossed back and forth, so runs are short);
- ``bounded-late``: as disordered, and every 20th record 10 s behind (dropped as late);
- ``bounded-late-side``: the same input with ``late_records=OutputTag(...)``: the late
  records go on, wrapped, as runs of their own (the side output) instead of being dropped.

Best of ``--repeat`` runs. Writes benchmarks/results/out_of_order.csv and .png and prints a
table. Not a test; the machine is shared, so compare ratios within one run.

    python benchmarks/epochs/out_of_order.py [--records N] [--repeat R]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from epochstream.runtime.reader import SplitReader
from epochstream.runtime.sources import CollectionSource

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402


def inputs(n: int) -> dict[str, tuple[list[tuple[int, float]], float | None, bool]]:
    rng = random.Random(1)
    ordered = [(i, i * 0.001) for i in range(n)]
    disordered = [(i, max(0.0, i * 0.001 - rng.uniform(0, 2))) for i in range(n)]
    late = [(i, max(0.0, t - 10.0)) if i % 20 == 19 else (i, t) for i, t in disordered]
    return {"strict": (ordered, None, False), "bounded-ordered": (ordered, 3.0, False),
            "bounded-disordered": (disordered, 3.0, False), "bounded-late": (late, 3.0, False),
            "bounded-late-side": (late, 3.0, True)}


def measure(data: list[tuple[int, float]], delay: float | None, repeat: int,
            side: bool = False) -> tuple[float, int, int]:
    """(best seconds, runs of one label, records late: dropped, or sent on with ``side``)."""
    src = CollectionSource(data, 1)
    src.timestamp = lambda r: r[1]
    src.max_out_of_orderness = delay
    src.late_output = side
    best, runs, late = float("inf"), 0, 0
    for _ in range(repeat):
        reader = SplitReader(src, "bench", [0], {}, 1.0)
        runs = 0
        t0 = time.perf_counter()
        while reader.has_more():
            runs += len(reader.read(1024, 0.0))
            reader.next_time_promise(0.0)
        best = min(best, time.perf_counter() - t0)
        late = reader.late_sent if side else reader.late_records
    return best, runs, late


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=400_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, (data, delay, side) in inputs(args.records).items():
        secs, runs, late = measure(data, delay, args.repeat, side)
        rows.append({"case": name, "records": args.records, "seconds": round(secs, 4),
                     "records_per_second": round(args.records / secs), "runs": runs, "late": late})
    base = rows[0]["records_per_second"]
    out = RESULTS
    out.mkdir(exist_ok=True)
    write_csv(out / "out_of_order.csv", rows)
    print(f"{'case':20s} {'records/s':>12s} {'vs strict':>10s} {'runs':>8s} {'late':>7s}")
    for r in rows:
        print(f"{r['case']:20s} {r['records_per_second']:12,d} {r['records_per_second'] / base:10.2f} "
              f"{r['runs']:8d} {r['late']:7d}")
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["case"] for r in rows], [r["records_per_second"] / 1e3 for r in rows])
    ax.set_ylabel("K records/s (one split's reader)")
    ax.set_title("Source cost of max_out_of_orderness")
    fig.tight_layout()
    fig.savefig(out / "out_of_order.png", dpi=120)


if __name__ == "__main__":
    main()
