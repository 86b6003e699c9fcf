"""Write benchmarks/RESULTS.md: one current table per question, from the result files in benchmarks/results/.

``SECTIONS`` below is the whole mapping: question -> script -> result file(s) -> the columns shown. Each
``Source`` names one result file, how its rows become table rows (``table``), and the command that made it.
A file's own ``# command:`` line wins over the command written here; a command marked ``inferred`` was
rebuilt from the file's columns and the docs, since that run did not record its flags. A row's date is the
date of the last commit that changed the file's content (renames do not count). A file that does not exist
yet gives a "not run yet" row, so a section can name a run before anyone has made it.

    python benchmarks/report.py            # rewrite benchmarks/RESULTS.md
    python benchmarks/report.py --check    # exit 1 if RESULTS.md is not what the result files give
    python benchmarks/report.py --unmapped # result files no section shows (earlier runs, logs, traces)

Percentiles of per-epoch files are computed here with ``harness.percentile``, the method the scripts use.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, percentile  # noqa: E402

Row = dict[str, str]
Table = Callable[[list[Row]], list[dict[str, object]]]

# ---------------------------------------------------------------- how rows become table rows


def num(v: object) -> float:
    """A CSV cell as a number (NaN when empty or not a number)."""
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


def median(values: Iterable[object]) -> float:
    """Median of the cells that are numbers (NaN if none)."""
    xs = [x for x in map(num, values) if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def keep(rows: list[Row], **eq: str | tuple[str, ...]) -> list[Row]:
    """The rows whose columns have the given values (a tuple: any of them)."""
    def ok(r: Row) -> bool:
        return all(r.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in eq.items())
    return [r for r in rows if ok(r)]


def as_is(**rename: str) -> Table:
    """Every row, columns renamed ``shown=csv_column`` (unnamed columns pass through)."""
    def table(rows: list[Row]) -> list[dict[str, object]]:
        return [{**r, **{shown: r.get(col, "") for shown, col in rename.items()}} for r in rows]
    return table


def medians(keys: Sequence[str], values: Mapping[str, str], first: Sequence[str] = ()) -> Table:
    """One row per value of ``keys``: the median over its rows (repeats) of each ``values`` column
    (``shown=csv_column``), the first row's ``first`` columns, and ``runs``, the rows it had."""
    def table(rows: list[Row]) -> list[dict[str, object]]:
        out = []
        for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
            group = [r for r in rows if tuple(r[k] for k in keys) == key]
            out.append({**dict(zip(keys, key, strict=True)), **{k: group[0].get(k, "") for k in first},
                        "runs": len(group),
                        **{shown: median(r.get(col) for r in group) for shown, col in values.items()}})
        return out
    return table


def per_epoch(keys: Sequence[str], value: str, skip: int = 1, scale: float = 1.0,
              first: Sequence[str] = (), maxima: Sequence[str] = ()) -> Table:
    """One row per value of ``keys`` of a file with a row per epoch: ``epochs`` and the p50 / p99 of
    ``value`` (times ``scale``) over the epochs after the first ``skip`` of each run (the warm-up), the
    first row's ``first`` columns and the maximum of each ``maxima`` column."""
    def table(rows: list[Row]) -> list[dict[str, object]]:
        out = []
        for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
            group = [r for r in rows if tuple(r[k] for k in keys) == key]
            later = [r for r in group if num(r.get("epoch")) > skip] or group
            xs = [num(r[value]) * scale for r in later if not math.isnan(num(r[value]))]
            out.append({**dict(zip(keys, key, strict=True)), **{k: group[0].get(k, "") for k in first},
                        "epochs": len(xs), "p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99),
                        **{f"max_{k}": max((num(r[k]) for r in group), default=float("nan")) for k in maxima}})
        return out
    return table


def then(a: Callable[[list[Row]], list[Row]], b: Table) -> Table:
    """``b`` applied to the rows ``a`` keeps."""
    return lambda rows: b(a(rows))


def label(table: Table, **labels: str | Callable[[dict[str, object]], object]) -> Table:
    """``table`` with constant or computed columns added to each row."""
    def out(rows: list[Row]) -> list[dict[str, object]]:
        res = table(rows)
        return [{**r, **{k: (v(r) if callable(v) else v) for k, v in labels.items()}} for r in res]
    return out


def worst_of(keys: Sequence[str], low: Mapping[str, str], high: Mapping[str, str], first: Sequence[str] = ()) -> Table:
    """One row per value of ``keys``: the worst repeat of each figure, the lowest of ``low`` columns
    (rates) and the highest of ``high`` ones (times), as ``shown=csv_column``; ``runs``: its rows."""
    def pick(group: list[Row], col: str, fn: Callable[[list[float]], float]) -> float:
        xs = [x for x in (num(r.get(col)) for r in group) if not math.isnan(x)]
        return fn(xs) if xs else float("nan")

    def table(rows: list[Row]) -> list[dict[str, object]]:
        out = []
        for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
            group = [r for r in rows if tuple(r[k] for k in keys) == key]
            out.append({**dict(zip(keys, key, strict=True)), **{k: group[0].get(k, "") for k in first},
                        "runs": len(group), **{shown: pick(group, col, min) for shown, col in low.items()},
                        **{shown: pick(group, col, max) for shown, col in high.items()}})
        return out
    return table


# ---------------------------------------------------------------- the mapping


@dataclass(frozen=True)
class Source:
    """One result file of a section, how it is tabled and the command that produced it."""

    file: str
    command: str = ""
    table: Table = field(default=as_is())
    inferred: bool = False  # the command was rebuilt from the file and the docs, not recorded


@dataclass(frozen=True)
class Section:
    """A question users ask, the script that answers it and the columns of its table (key, header)."""

    title: str
    question: str
    script: str
    columns: tuple[tuple[str, str], ...]
    sources: tuple[Source, ...]
    note: str = ""
    group: str = ""  # a heading above a run of related sections


def cols(*pairs: str) -> tuple[tuple[str, str], ...]:
    """``"key:header"`` strings as (key, header) pairs (header defaults to the key)."""
    return tuple((p.split(":", 1)[0], p.split(":", 1)[-1]) for p in pairs)


BP = "python benchmarks/epochs/backpressure.py"
ST = "python benchmarks/state/state_scale.py"
SBM = "python benchmarks/state/state_beyond_memory.py"
SUS = "python3 benchmarks/paper/sustainable_throughput.py"
R = "benchmarks/results"

_bp_cols = cols("mode", "debloat:debloating", "k", "setting", "epochs", "p50:p50 s", "p99:p99 s",
                "max_channel_bytes:channel state max, bytes", "records_per_s:records/s", "recovery_s:recovery s")


def _bp(setting: str) -> Table:
    return label(per_epoch(("mode", "debloat", "k"), "trigger_to_commit_s", first=("records_per_s", "recovery_s"),
                           maxima=("channel_bytes",)), setting=setting)


_ss_cols = cols("system", "keys", "rate:offered/s", "records_per_s:records/s", "epochs", "p50:p50 s", "p99:p99 s",
                "peak_rss_mb_per_worker:peak RSS per worker, MB", "restore_run_s:restore run s")


def _ss(rows: list[Row]) -> list[dict[str, object]]:
    return label(per_epoch(("backend", "state_backend_type", "keys"), "trigger_to_commit_s", skip=0,
                           first=("rate", "records_per_s", "peak_rss_mb_per_worker", "restore_run_s")),
                 system=lambda r: f"epochstream {r['backend']}, {r['state_backend_type']}")(rows)


_spark_state = as_is(rate="", p50="batch_p50_s", p99="batch_p99_s", epochs="micro_batches",
                     peak_rss_mb_per_worker="peak_rss_mb_jvm", system="backend")

_sbm_cols = cols("keys", "rocksdb_memory_mb:rocksdb_memory_mb", "rows_per_s:rows/s", "epochs",
                 "trigger_to_manifest_p50_s:p50 s", "trigger_to_manifest_p99_s:p99 s",
                 "max_rss_mb_per_worker:max RSS per worker, MB", "max_private_mb_per_worker:max private MB",
                 "checkpoint_folder_mib:checkpoint MiB", "restore_run_s:restore run s")

_ps_cols = cols("workload", "keys", "system", "variant", "rows_per_s:rows/s", "latency_kind:latency",
                "latency_p50_ms:p50 ms", "latency_p99_ms:p99 ms", "cpu_busy_pct:machine busy %", "state_ok:state ok")
_PACED = ("python benchmarks/spark/pyspark_stateful.py --keys 100,10000 --es-rows 8000000,10000000 --es-rates "
         "x1.1,x1.0/x1.05 --es-rate-seconds 30 --batch-rows 65536 --batch-linger 0.05 --skip-batches 1 "
         "--spark-batches 2 --no-processor --no-real-time --name ")

_kafka_cols = cols("system", "guarantee", "interval_s:interval s", "records_per_s:records/s steady",
                   "records_per_s_with_startup:records/s from start", "latency_rate:latency load/s",
                   "p50_ms:p50 ms", "p99_ms:p99 ms", "cpu_busy_pct:machine busy %", "x_spark:x Spark")

_peer_cols = cols("workload", "system", "settings", "records_per_s:records/s", "latency")


def _latency(p50: str, p99: str, unit: str) -> Callable[[dict[str, object]], str]:
    def cell(r: dict[str, object]) -> str:
        a, b = num(r.get(p50)), num(r.get(p99))
        return "" if math.isnan(a) and math.isnan(b) else f"{fmt(a)} / {fmt(b)} {unit}"
    return cell


_peer_throughput = label(then(lambda rows: [r for r in keep(rows, repeat="1") if r["system"] != "python-loop"
                                           and r["variant"] != "latency"], as_is()),
                         workload="keyed running count, 1,000 keys", latency="",
                         settings=lambda r: ", ".join(x for x in (r.get("variant"), r.get("settings")) if x))
_TP29 = ("python benchmarks/epochs/throughput.py --records 1000000 --repeats 1 --peers pyflink-tuned,pyflink-thread,"
         "flink-sql --pyflink-records 300000 --vector-records 0 --memory-seconds 0 --name ")

_spikes_cols = cols("driver", "discipline", "mode", "save_ms:save ms", "steady_p50_ms:steady p50 ms",
                    "spike_p99_ms:spike p99 ms", "spike_max_ms:spike max ms", "spike_epoch_median_ms:typical epoch ms")
_window_cols = cols("driver", "mode", "workers", "stragglers", "windows", "p50_ms:p50 ms", "p99_ms:p99 ms",
                    "floor_p50_ms:floor p50 ms", "floor_p99_ms:floor p99 ms",
                    "over_floor_p50_ms:over floor p50 ms", "over_floor_p99_ms:over floor p99 ms")
_WL = "python benchmarks/paper/window_latency.py --seconds 60 --no-baseline "


def _gc_pivot(rows: list[Row]) -> list[dict[str, object]]:
    """One row per record cost and root choice: GC's misses and memory beside the LRU caches'."""
    out = []
    for cost, roots in dict.fromkeys((r["record_cost_us"], r["roots"]) for r in rows):
        mine = [r for r in rows if (r["record_cost_us"], r["roots"]) == (cost, roots)]

        def miss(policy: str, budget: str = "", ttl: str = "", mine: list[Row] = mine) -> float:
            hit = [r for r in mine if r["policy"] == policy and (not budget or r["budget_keys"] == budget)
                   and (not ttl or r["ttl_s"] == ttl)]
            return num(hit[0]["miss_ratio"]) if hit else float("nan")

        gc = next((r for r in mine if r["policy"] == "gc"), {})
        out.append({"record_cost_us": cost, "roots": roots, "gc": miss("gc"),
                    "gc_memory": f"{fmt(num(gc.get('mean_resident')))} / {fmt(num(gc.get('peak_resident')))}",
                    "lru_gc_mean": miss("lru-at-gc-mean-memory"), "lru_100": miss("lru", "100"),
                    "lru_1000": miss("lru", "1000"), "lru_5000": miss("lru", "5000"),
                    "lru_ttl": miss("lru+ttl", "1000", "0.1"), "floor": miss("lru-unbounded")})
    return out


def _spark_epochs(rows: list[Row]) -> list[dict[str, object]]:
    """spark.py's epochs per driver (a row per epoch, seconds) beside its throughput runs' median."""
    epochs = per_epoch(("deployment",), "seconds", skip=0, scale=1000)(keep(rows, kind="trigger_to_commit"))
    return [{**r, "setting": f"{r['deployment']} driver, keyed count, 0.5 s epochs",
             "rows_per_s": median(x["records_per_second"] for x in keep(rows, kind="throughput",
                                                                       deployment=str(r["deployment"])))}
            for r in epochs]


def _failover(what: str, value: str, by: str = "") -> Table:
    def table(rows: list[Row]) -> list[dict[str, object]]:
        out = []
        for key in dict.fromkeys(r.get(by, "") for r in rows):
            xs = [num(r[value]) for r in rows if r.get(by, "") == key and not math.isnan(num(r[value]))]
            out.append({"what": what, "setup": key, "events": len(xs), "p50": percentile(xs, 0.5),
                        "max": max(xs, default=float("nan"))})
        return out
    return table


SECTIONS: tuple[Section, ...] = (
    Section(
        "Throughput per mode",
        "How many records/s does a keyed running count reach on the local driver (2 workers), with and without "
        "epochs, on the row and the vectorised path, against a plain Python loop on one core?",
        "epochs/throughput.py",
        cols("system", "variant", "records", "records_per_s:records/s", "p50_ms:latency p50 ms",
             "p99_ms:latency p99 ms", "workers_cpu_per_wall:cores used", "runs"),
        (Source("throughput_rows.csv", "python benchmarks/epochs/throughput.py --records 1000000 --repeats 1 "
                "--vector-records 0 --memory-seconds 0 --name throughput_rows",
                medians(("system", "variant"), {"records_per_s": "records_per_s", "p50_ms": "p50_ms",
                        "p99_ms": "p99_ms", "workers_cpu_per_wall": "workers_cpu_per_wall"}, ("records",)),
                inferred=True),
         Source("throughput_vectorised.csv", "python benchmarks/epochs/throughput.py --records 1000000 --repeats 2 "
                "--vector-records 10000000 --memory-seconds 0 --baseline-src BASELINE/src --name throughput_vectorised",
                then(lambda rows: keep(rows, variant="vectorised"),
                     medians(("system", "variant"), {"records_per_s": "records_per_s",
                             "workers_cpu_per_wall": "workers_cpu_per_wall"}, ("records",))),
                inferred=True)),
        note="Latency is source to sink with 1 s epochs (variant `latency`). Bytewax ran in the same run, "
             "with 1 s snapshots and without.",
    ),
    Section(
        "Epoch time and trigger-to-visible latency",
        "How long does an epoch take from its trigger until its output is committed (visible), and what do "
        "the source's batch size and linger trade for it?",
        "epochs/batching.py, spark/spark.py",
        cols("setting", "rows_per_s:rows/s", "epochs", "p50:trigger -> commit p50 ms",
             "p99:trigger -> commit p99 ms", "rows_per_key_call:rows per key call", "runs"),
        (Source("batching.csv", "python benchmarks/epochs/batching.py --rows 10000000 --interval 0.5",
                label(medians(("batch_rows", "batch_linger_ms"),
                              {"rows_per_s": "rows_per_s", "epochs": "periodic_epochs",
                               "p50": "trigger_to_commit_p50_ms", "p99": "trigger_to_commit_p99_ms",
                               "rows_per_key_call": "rows_per_key_call"}),
                      setting=lambda r: f"local driver, batch_rows {r['batch_rows']}, "
                                        f"linger {r['batch_linger_ms']} ms")),
         Source("spark.csv", "python benchmarks/spark/spark.py", _spark_epochs)),
    ),
    Section(
        "Backpressure",
        "How long do epochs take when a downstream stage is k times slower than the source, per mode, with and "
        "without buffer debloating?",
        "epochs/backpressure.py",
        _bp_cols,
        (Source("backpressure_cut10ms.csv", f"{BP} --factors 0.5,2,10 --seconds 15 --name backpressure_cut10ms",
                _bp("defaults")),
         Source("backpressure_aligned_timeout.csv",
                f"{BP} --factors 0.5,2,10 --seconds 15 --modes aligned-timeout --name backpressure_aligned_timeout",
                _bp("aligned_timeout 0.2 s"), inferred=True),
         Source("backpressure_batch128_target100ms.csv",
                f"{BP} --factors 0.5,10 --seconds 15 --modes aligned,tracker --debloat on --batch-rows 128 "
                "--debloat-target 0.1 --name backpressure_batch128_target100ms",
                _bp("batch_rows 128, debloat target 0.1 s"), inferred=True),
         Source("backpressure_skew.csv", f"{BP} --factors 0.5,10 --debloat on --skew --name backpressure_skew",
                _bp("one hot key"), inferred=True),
         Source("backpressure_spark.csv", f"{BP} --factors 0.5,10 --debloat on --driver spark --name "
                "backpressure_spark", _bp("spark driver"), inferred=True),
         Source("backpressure_kill.csv", f"{BP} --factors 0.5,10 --debloat on --kill --name backpressure_kill",
                _bp("a worker killed mid-run"), inferred=True)),
        note="p50 / p99 of epoch trigger -> commit over each run's epochs after the first (the warm-up).",
    ),
    Section(
        "State size and scale",
        "What happens to throughput, epoch time and memory as the keyed state grows from 10K to 10M keys, on the "
        "heap and on RocksDB, against Spark's RocksDB state store?",
        "state/state_scale.py",
        _ss_cols,
        (Source("state_scale_records_per_s.csv", f"{ST} --keys 10000,1000000 --rate 1000000 --seconds 3 "
                "--backends files --name state_scale_records_per_s", _ss, inferred=True),
         Source("state_scale_1m_files_delta.csv", f"{ST} --keys 1000000 --rate 30000 --seconds 40 --interval 1 "
                "--backends files,delta --name state_scale_1m_files_delta", _ss, inferred=True),
         Source("state_scale_1m_memory.csv", f"{ST} --keys 1000000 --rate 30000 --seconds 40 --interval 2 "
                "--backends files --state-backend-types rocksdb,hashmap --incremental-modes on "
                "--rocksdb-memory-mb 64 --name state_scale_1m_memory", _ss),
         Source("state_scale_vs_spark.csv", f"{ST} --keys 10000,1000000 --rate 100000 --seconds 10 --backends files "
                "--state-backend-types hashmap,rocksdb --restore --spark --name state_scale_vs_spark", _ss,
                inferred=True),
         Source("state_scale_vs_spark_spark.csv", f"{ST} --keys 10000,1000000 --rate 100000 --seconds 10 --backends "
                "files --state-backend-types hashmap,rocksdb --restore --spark --name state_scale_vs_spark",
                _spark_state, inferred=True)),
        note="p50 / p99 of epoch trigger -> commit (Spark: of its micro-batches) over every epoch.",
    ),
    Section(
        "State beyond memory (RocksDB)",
        "Does a job keep going with more keys than its workers' memory holds, and what does `rocksdb_memory_mb` "
        "do to each worker's memory?",
        "state/state_beyond_memory.py",
        _sbm_cols,
        tuple(Source(f"state_beyond_memory_{n}.csv", f"{SBM} --keys {k} --interval 5 --name state_beyond_memory_{n}",
                     inferred=True) for n, k in (("1m_batch_scope", 1_000_000), ("5m_batch_scope", 5_000_000),
                                                  ("10m_batch_scope", 10_000_000)))
        + (Source("state_beyond_memory_50m_m64.csv", f"{SBM} --keys 50000000 --interval 5 --rocksdb-memory-mb 64 "
                  "--name state_beyond_memory_50m_m64"),)
        + tuple(Source(f"state_beyond_memory_{n}.csv", f"{pre}{SBM} --keys {k} --interval 5 --rocksdb-memory-mb "
                       f"{m} --name state_beyond_memory_{n}", inferred=True)
                for n, k, m, pre in (("100k_m64", 100_000, 64, ""), ("5m_m16", 5_000_000, 16, ""),
                                     ("5m_m64", 5_000_000, 64, ""), ("5m_m256", 5_000_000, 256, ""),
                                     ("5m_m64_arena2", 5_000_000, 64, "MALLOC_ARENA_MAX=2 "))),
        note="Vectorised keyed count, one update per key, local driver p = 2; p50 / p99 of trigger -> manifest.",
    ),
    Section(
        "RocksDB memory",
        "Does RocksDB stay within `rocksdb_memory_mb` as one worker's share of keys grows (one DB in one process)?",
        "state/rocksdb_memory.py",
        cols("keys", "seconds", "rss_mb:RSS MB", "rss_growth_mb:RSS growth MB",
             "block_cache_usage_mb:block cache MB", "block_cache_pinned_usage_mb:pinned MB",
             "cur_size_all_mem_tables_mb:memtables MB", "total_sst_files_size_mb:SST MB"),
        (Source("rocksdb_memory_25m_m64.csv", "python benchmarks/state/rocksdb_memory.py --keys 25000000 "
                "--memory-mb 64 --name rocksdb_memory_25m_m64", inferred=True),),
    ),
    Section(
        "RocksDB restore",
        "How long does a restore take when checkpoint files are opened as the DB, against re-inserting rows?",
        "state/rocksdb_restore.py",
        cols("kind", "keys", "restore_s:restore s (median)", "checkpoint_mib:checkpoint MiB",
             "next_capture_uploaded_bytes:next capture uploads, bytes", "runs"),
        (Source("rocksdb_restore.csv", "python benchmarks/state/rocksdb_restore.py --keys 2000000",
                medians(("kind",), {"restore_s": "restore_s", "checkpoint_mib": "checkpoint_mib",
                                    "next_capture_uploaded_bytes": "next_capture_uploaded_bytes"}, ("keys",))),),
    ),
    Section(
        "Checkpoint backends",
        "How long do the local, S3 and Delta backends take to write, commit and restore 10 MB to 1 GB of state?",
        "state/backends.py",
        cols("backend", "state_mb:state MB", "snapshot", "runs:epochs", "mb:written MB (median)",
             "pre_commit_s:pre-commit s", "commit_s:commit s", "restore:restore s"),
        (Source("backends.csv", "python benchmarks/state/backends.py",
                lambda rows: [{**r, "mb": r["mb"] / 1e6, "restore": median(
                    x["restore_s"] for x in keep(rows, phase="restore", backend=str(r["backend"]),
                                                 state_mb=str(r["state_mb"]), snapshot=str(r["snapshot"])))}
                              for r in medians(("backend", "state_mb", "snapshot"),
                                               {"mb": "snapshot_bytes", "pre_commit_s": "pre_commit_s",
                                                "commit_s": "commit_s"})(keep(rows, phase="epoch"))]),),
    ),
    Section(
        "PySpark wrappers against Spark",
        "How do `applyInPandasWithState` and `transformWithStateInPandas` jobs on epochstream compare with the same "
        "code on Spark Structured Streaming, in rows/s and latency?",
        "spark/pyspark_stateful.py, spark/pyspark_keyed_count.py",
        _ps_cols,
        tuple(Source(f"pyspark_stateful_at_spark_rate_{n}.csv", _PACED + f"pyspark_stateful_at_spark_rate_{n}")
              for n in range(1, 5))
        + (Source("pyspark_stateful.csv", table=then(lambda rows: [r for r in rows if r["workload"] != "keyed count"],
                                                     as_is())),
           Source("pyspark_keyed_count.csv", "python benchmarks/spark/pyspark_keyed_count.py",
                  as_is(workload="layout", variant="batch_size", latency_p50_ms="trigger_to_commit_p50_s",
                        latency_p99_ms="trigger_to_commit_p99_s"))),
        note="The `at_spark_rate` runs pace epochstream at Spark's measured rate (x1.0-x1.1) so latencies compare "
             "at equal load; four runs of the same command.",
    ),
    Section(
        "Kafka pipeline",
        "Kafka -> keyed count -> Kafka exactly once: records/s and record latency (due -> visible at "
        "read_committed) against Spark Structured Streaming and PyFlink's KafkaSink.",
        "kafka/kafka.py",
        _kafka_cols,
        (Source("kafka_count_100ms.csv", "python benchmarks/kafka/kafka.py --intervals 0.1 --name kafka_count_100ms"),
         Source("kafka_count_all_systems.csv", "python benchmarks/kafka/kafka.py --pyflink process,thread "
                "--name kafka_count_all_systems",
                inferred=True),
         Source("kafka_count_spark_real_time.csv", "python benchmarks/kafka/kafka.py --real-time --intervals 1.0 "
                "--name kafka_count_spark_real_time",
                then(lambda rows: [r for r in rows if r["system"].startswith("spark-real-time")], as_is()),
                inferred=True)),
        note="Latency load: 50% of each system's rate with start-up. Spark's Real-time Mode refuses the keyed "
             "count; its rows are the refusal and a stateless pass-through (see their `note`).",
    ),
    Section(
        "Kafka JSON -> pandas state -> Kafka",
        "The pipeline PySpark users run: JSON records from Kafka, parsed, PySpark's own pandas state functions "
        "unchanged, results back to Kafka. Rows/s, epoch time and end-to-end latency against Spark Structured "
        "Streaming running the same functions, the worst of the repeats.",
        "kafka/kafka_json_pandas.py",
        cols("keys", "function", "system", "mode", "path", "guarantee", "runs", "rows_per_s:rows/s",
             "epoch_p99_ms:epoch p99 ms", "latency_rate:load/s", "p99_ms:e2e p99 ms",
             "same_load_rate:Spark's load/s", "same_load_p99_ms:e2e p99 ms at Spark's load", "check"),
        tuple(Source(name, "python benchmarks/kafka/kafka_json_pandas.py",
                     worst_of(("keys", "function", "system", "mode", "path"), {"rows_per_s": "rows_per_s"},
                              {"epoch_p99_ms": "epoch_p99_ms", "p99_ms": "p99_ms",
                               "same_load_p99_ms": "same_load_p99_ms"},
                              first=("guarantee", "latency_rate", "same_load_rate", "check")))
              for name in ("kafka_json_pandas.csv", "kafka_json_pandas_transform.csv", "kafka_json_pandas_100k.csv",
                           "kafka_json_pandas_pyflink.csv")),
        note="Paths: `arrow` is `from_kafka` (Arrow batches) -> `from_json`; `dicts` and `batches` feed the same "
             "records without Kafka (Python dicts from a collection; Arrow batches built by hand). Spark's "
             "Kafka sink is at-least-once; epochstream's is exactly-once. At 50% of epochstream's own rate the "
             "load generator (one Python process producing 45-195K JSON records/s) shares the 2 cores with the "
             "job and the broker: the machine is 99% busy and the generator falls behind (`generator_lag_ms`), "
             "so the comparison is at Spark's load. Master CPU per million outputs: "
             "`kafka_json_pandas_master_cpu_*.csv`.",
    ),
    Section(
        "Peers: Flink, PyFlink, Bytewax, Spark",
        "The same workloads on PyFlink (at Flink's defaults and tuned), Flink SQL, Bytewax and Spark, side by side "
        "with epochstream in the same run.",
        "epochs/throughput.py, epochs/backpressure.py, kafka/kafka.py",
        _peer_cols,
        (Source("throughput_pyflink_peers.csv", _TP29 + "throughput_pyflink_peers", _peer_throughput),
         Source("throughput_pyflink_peers_run2.csv", _TP29 + "throughput_pyflink_peers_run2", _peer_throughput),
         Source("throughput_rows.csv", "python benchmarks/epochs/throughput.py --records 1000000 --repeats 1 "
                "--vector-records 0 --memory-seconds 0 --name throughput_rows",
                then(lambda rows: keep(rows, system="bytewax"), _peer_throughput), inferred=True),
         Source("backpressure_pyflink.csv", f"{BP} --rate 500 --batch-rows 16 --factors 0.5,10 --seconds 40 "
                "--modes aligned,unaligned --debloat on --peers pyflink --name backpressure_pyflink",
                label(per_epoch(("mode", "k"), "trigger_to_commit_s", first=("records_per_s", "driver")),
                      workload=lambda r: f"backpressure k = {fmt(r['k'])}, checkpoint end to end",
                      system=lambda r: "PyFlink 2.3" if str(r["mode"]).startswith("pyflink") else "epochstream",
                      settings=lambda r: r["mode"], latency=_latency("p50", "p99", "s"))),
         Source("kafka_count_pyflink_quick.csv", "python benchmarks/kafka/kafka.py --quick --pyflink "
                "--name kafka_count_pyflink_quick",
                label(as_is(), workload=lambda r: f"Kafka keyed count, {fmt(r['interval_s'])} s interval",
                      settings=lambda r: r.get("guarantee", ""), latency=_latency("p50_ms", "p99_ms", "ms")))),
        note="Bytewax 0.21 and PyFlink 2.3.0 run in their own venvs, made by `benchmarks/peers/run_peers.py`. "
             "Spark runs beside epochstream in the PySpark and Kafka sections above.",
    ),
    Section(
        "Notification latency (Figure 10)",
        "How long after an epoch ends at the sources does each downstream task learn its bound, with markers "
        "(aligned) and with the trAcker, as the graph grows?",
        "paper/notification_latency.py",
        cols("driver", "mode", "graph_size:N", "workers", "granularity", "samples", "p50_ms:p50 ms", "p99_ms:p99 ms",
             "max_ms:max ms"),
        (Source("notification_latency.csv", "python benchmarks/paper/notification_latency.py",
                label(as_is(), driver="simulator")),
         Source("notification_latency_local.csv", "python benchmarks/paper/notification_latency.py --deployment local",
                label(as_is(), driver="local"))),
        group="trAcker paper reproduction",
    ),
    Section(
        "Service traffic (Figure 10)",
        "How many control messages per epoch do markers and the trAcker send on RR-N?",
        "paper/traffic.py",
        cols("mode", "graph_size:N", "workers", "granularity", "epochs", "service_messages:messages",
             "messages_per_epoch:per epoch", "service_bytes:bytes"),
        (Source("traffic.csv", "python benchmarks/paper/traffic.py"),),
        group="trAcker paper reproduction",
    ),
    Section(
        "Cycles",
        "What does a loop cost each mode: the loop head's log in aligned mode, longer epochs in tracker mode?",
        "paper/cycles.py",
        cols("mode", "rounds", "records_per_s:records/s", "passes_per_s:passes/s", "epochs", "epoch_p50_ms:p50 ms",
             "epoch_p99_ms:p99 ms", "log_records_max:log records max"),
        (Source("cycles.csv", "python benchmarks/paper/cycles.py --records 250000"),),
        group="trAcker paper reproduction",
    ),
    Section(
        "Distributed garbage collection (Figure 13c)",
        "How often does a per-key cache miss when the trAcker frees per-key substreams, against LRU caches?",
        "paper/distributed_gc.py",
        cols("record_cost_us:µs per record", "roots", "gc:GC misses", "gc_memory:GC memory mean / peak",
             "lru_gc_mean:LRU at GC's mean", "lru_100:LRU 100", "lru_1000:LRU 1,000", "lru_5000:LRU 5,000",
             "lru_ttl:LRU+TTL 0.1 s, 1,000", "floor:floor (every user once)"),
        (Source("distributed_gc.csv", "python benchmarks/paper/distributed_gc.py", _gc_pivot),
         Source("distributed_gc_quick_popular.csv", "python benchmarks/paper/distributed_gc.py --quick --roots popular",
                _gc_pivot)),
        note="Miss ratios (lower is better).",
        group="trAcker paper reproduction",
    ),
    Section(
        "Sustainable throughput by granularity (Figure 13b)",
        "The highest rate each setting sustains on RR-30 (20 workers x 2 cores, simulator): no tracking, and the "
        "trAcker with one epoch per record.",
        "paper/sustainable_throughput.py",
        cols("setup", "rate:rate/s", "records_done:records", "read_ratio:read ratio", "growth",
             "drain_ratio:drain ratio", "p50_ms:p50 ms", "p99_ms:p99 ms", "sustained"),
        (Source("sustainable_throughput.csv", f"{SUS} --merge {R}/sustainable_throughput_none.csv,"
                f"{R}/sustainable_throughput_t1.csv,{R}/sustainable_throughput_t1_5ms_24k_long.csv,"
                f"{R}/sustainable_throughput_t1_5ms_32k.csv --name sustainable_throughput"),),
        note="Merged from four runs (their commands are in docs/PAPER.md). Markers were last run with earlier "
             "costs (`sustainable_throughput_agent26us_unmerged.csv`).",
        group="trAcker paper reproduction",
    ),
    Section(
        "Snapshot spikes (Figure 12)",
        "How much do record latencies rise while an epoch's snapshot is taken, with blocking and asynchronous saves?",
        "paper/snapshot_spikes.py",
        _spikes_cols,
        (Source("snapshot_spikes_sim.csv", "python benchmarks/paper/snapshot_spikes.py --quick",
                label(as_is(), driver="simulator"), inferred=True),
         Source("snapshot_spikes_local.csv", "python benchmarks/paper/snapshot_spikes.py --driver local --quick",
                then(lambda rows: keep(rows, repeat="median"), label(as_is(), driver="local")))),
        note="Spikes are minus the steady p50. The local rows are medians of 3 interleaved runs.",
        group="trAcker paper reproduction",
    ),
    Section(
        "Window latency with stragglers (Figure 13a)",
        "How late do NEXMark Q8 windows fire when workers pause, with markers and with the trAcker?",
        "paper/window_latency.py, paper/window_latency_local.py",
        _window_cols,
        (Source("window_latency.csv", "python benchmarks/paper/window_latency.py",
                then(lambda rows: keep(rows, stragglers="off"), label(as_is(), driver="simulator"))),
         Source("window_latency_stragglers_w2_20.csv", _WL + "--workers 2,5,10,20 "
                "--name window_latency_stragglers_w2_20",
                label(as_is(), driver="simulator")),
         Source("window_latency_stragglers_w30.csv", _WL + "--workers 30 --name window_latency_stragglers_w30",
                label(as_is(), driver="simulator")),
         Source("window_latency_local_stragglers.csv", "python benchmarks/paper/window_latency_local.py --seconds 60 "
                "--name window_latency_local_stragglers", label(as_is(), driver="local"))),
        note="Runs without stragglers last 5 virtual seconds, those with stragglers 60 s. The floor is how long a "
             "pause covering the window's end still lasted: no protocol fires earlier.",
        group="trAcker paper reproduction",
    ),
    Section(
        "Failover and worker loss",
        "How long from a frozen or killed worker to a failover, and to the job committing again?",
        "failures/freeze_failover.py, failures/worker_loss.py, spark/spark.py",
        cols("what", "setup", "events", "p50:p50 s", "max:max s"),
        (Source("freeze_failover.csv", "python benchmarks/failures/freeze_failover.py",
                lambda rows: _failover("SIGSTOP -> failover (heartbeat timeout 10 s)", "freeze_to_failover_s")(rows)
                + _failover("failover -> recovered", "recovery_s")(rows)),
         Source("worker_loss_spare_5kills.csv", "python benchmarks/failures/worker_loss.py --setups spare --spares 2 "
                "--kills 5 --gap 45 --out benchmarks/results/worker_loss_spare_5kills",
                _failover("Spark Worker killed -> next epoch", "kill_to_next_epoch_s", "setup")),
         Source("worker_loss.csv", "python benchmarks/failures/worker_loss.py --setups restarted --kills 3 --gap 45",
                then(lambda rows: keep(rows, setup="restarted"),
                     _failover("Spark Worker killed -> next epoch", "kill_to_next_epoch_s", "setup"))),
         Source("spark.csv", "python benchmarks/spark/spark.py",
                then(lambda rows: keep(rows, kind="recovery"),
                     _failover("task Python worker SIGKILL -> all tasks restored", "seconds", "target")))),
    ),
    Section(
        "Out-of-order input",
        "What does event-time reordering cost a source reader, per disorder pattern?",
        "epochs/out_of_order.py",
        cols("case", "records", "seconds", "records_per_second:records/s", "runs", "late"),
        (Source("out_of_order.csv", "python benchmarks/epochs/out_of_order.py"),),
    ),
    Section(
        "JSON codec",
        "What do `from_json` decoding and `encode_json` cost per record?",
        "kafka/json_codec.py",
        cols("what", "way", "rows", "us_per_record:µs per record"),
        (Source("json_codec.csv", "python benchmarks/kafka/json_codec.py"),),
    ),
)

# ---------------------------------------------------------------- files, dates, commands


def read_rows(path: Path) -> tuple[list[Row], str]:
    """A result file's rows and its ``# command:`` line (without the prefix; empty if none)."""
    import csv

    with open(path, newline="") as f:
        lines = f.readlines()
    command = next((ln[len("# command:"):].strip() for ln in lines if ln.startswith("# command:")), "")
    return list(csv.DictReader(ln for ln in lines if not ln.startswith("#"))), command


def result_date(path: Path) -> str:
    """Date of the last commit that changed the file's content; 'not committed' for a new file."""
    out = subprocess.run(["git", "log", "--follow", "--diff-filter=AMC", "-1", "--format=%cs", "--", path.name],
                         cwd=path.parent, capture_output=True, text=True).stdout.strip()
    return out or f"not committed ({date.fromtimestamp(path.stat().st_mtime).isoformat()})"


def current_command(command: str, file: str) -> str:
    """``command`` as it is run now: each ``benchmarks/<script>.py`` at the script's path in its question's
    folder, and ``--name`` the result file's name (a file renamed after its run keeps its old one)."""
    def script(m: re.Match[str]) -> str:
        if (ROOT / m.group(0)).exists():
            return m.group(0)
        moved = sorted(HERE.glob(f"*/{m.group(1)}.py"))
        return moved[0].relative_to(ROOT).as_posix() if len(moved) == 1 else m.group(0)

    def name(m: re.Match[str]) -> str:
        stem = Path(file).stem
        return m.group(0) if stem == m.group(2) or stem.startswith(m.group(2) + "_") else m.group(1) + stem

    command = re.sub(r"benchmarks/([\w/]+?)\.py\b", script, command)
    return re.sub(r"(--name[ =])(\S+)", name, command)


def shown_command(recorded: str, source: Source) -> str:
    """The command of a row: the file's own line (run as ``python ...``), else the mapping's."""
    if recorded:
        cmd = recorded if recorded.split()[0].startswith(("python", "PYTHONPATH")) else f"python {recorded}"
        return f"`{current_command(cmd, source.file)}`"
    return f"`{source.command}`" + (" (flags inferred)" if source.inferred else "")


def fmt(v: object) -> str:
    """A cell: numbers rounded by their size (whole numbers with thousands separators), NaN empty, text as is."""
    if v is None or isinstance(v, bool):
        return "" if v is None else str(v)
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            return v.replace("|", "/").replace("\n", " ")
    else:
        x = float(v)  # type: ignore[arg-type]
    if math.isnan(x):
        return ""
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a >= 100 or x == int(x):
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def section_rows(section: Section, results: Path) -> list[list[str]]:
    """The table cells of one section: its columns, then the result file with its date, then the command."""
    out = []
    for src in section.sources:
        path = results / src.file
        if not path.exists():
            out.append(["not run yet"] + [""] * (len(section.columns) - 1) + [f"`{src.file}` (not run yet)",
                                                                               shown_command("", src)])
            continue
        rows, recorded = read_rows(path)
        when = result_date(path)
        for r in src.table(rows):
            out.append([fmt(r.get(key, "")) for key, _ in section.columns]
                       + [f"`{src.file}` ({when})", shown_command(recorded, src)])
    return out


def render(results: Path = RESULTS) -> str:
    """The whole RESULTS.md."""
    lines = ["# Benchmark results", "",
             "Current figures, one table per question, generated by `python benchmarks/report.py` from the files in",
             "`benchmarks/results/` (edit the mapping in `benchmarks/report.py`, not this file). Each row names its",
             "result file, the date of that file's last commit and the command that produced it. \"Flags inferred\"",
             "marks a run that did not record its flags: they were rebuilt from the file and the docs. Every number",
             "was measured on a shared 2-core machine, so compare rows of the same file.",
             "`benchmarks/README.md` says how to run each script.", ""]
    group = ""
    for s in SECTIONS:
        if s.group != group:
            group = s.group
            if group:
                lines += [f"## {group}", ""]
        scripts = ", ".join(f"`benchmarks/{x}`" for x in s.script.split(", "))
        lines += [f"{'###' if s.group else '##'} {s.title}", "",
                  f"{s.question} {'Scripts' if ',' in s.script else 'Script'}: {scripts}.", ""]
        header = [h for _, h in s.columns] + ["result (date)", "command"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in section_rows(s, results)]
        if s.note:
            lines += ["", s.note]
        lines.append("")
    mapped = {src.file for s in SECTIONS for src in s.sources}
    others = [p for p in results.iterdir() if p.name not in mapped]
    lines += ["## Other result files", "",
              f"`benchmarks/results/` holds {len(others)} more files: runs of setups no section shows, earlier runs",
              "that the docs cite, PNGs, logs, per-sample traces (`*_rss.csv`) and targets.",
              "`python benchmarks/report.py --unmapped` lists them.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the result files")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    ap.add_argument("--unmapped", action="store_true", help="list the result files no section shows")
    args = ap.parse_args(argv)
    if args.unmapped:
        mapped = {src.file for s in SECTIONS for src in s.sources}
        print("\n".join(sorted(p.name for p in args.results.iterdir() if p.name not in mapped)))
        return 0
    text = render(args.results)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out} is {'up to date' if same else 'out of date: run python benchmarks/report.py'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
