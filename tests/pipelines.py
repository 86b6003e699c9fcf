"""Shared pipeline builders for the test suites (import as ``from pipelines import ...``).

Every builder returns a *fresh* ``Pipeline`` on each call (the exactly-once oracle calls a
builder twice: once for the failure-free reference run and once for the chaos run), and
takes the same keyword knobs (see ``make_pipeline``): ``parallelism``, ``mode``,
``interval`` (checkpoint interval in *virtual* seconds), ``batch_size`` (rows per read and
per full output buffer), ``batch_linger`` (virtual seconds output may wait to fill up),
``max_concurrent``, ``tolerable_failed``, ``restart_attempts``, ``max_parallelism``,
``incremental``, plus ``n`` (input size) and ``out`` (where the sinks write).

    from pipelines import BUILDERS, running_count, sim_run, committed_output
    p = running_count(parallelism=3, interval=0.0005, out=tmp_path / "out")
    result = sim_run(p, tmp_path / "chk", seed=7)
    records = committed_output(tmp_path / "out" / "counts")

Input records are ``(key, id)`` tuples with a unique integer ``id`` so that a lost or
doubled record is visible. Keys are strings ``"k0".."k{keys-1}"``; record ``i`` has key
``"k{i % keys}"``. The sources are split across subtasks, so records of one key arrive
at a keyed operator from several channels, in an order that depends on the schedule.

With ``columnar=True`` (every builder in ``BUILDERS``; ``LAYOUTS`` names both ways) the same
input comes from a columnar source (``from_arrow`` or ``generate_batches``, columns ``key``
and ``id``) as Arrow batches, keyed by column (``key_by("key")``), through some row operators
(which see dict rows) and some columnar ones (``map_batches``, ``process_batches``); the
operator uids and state names are those of the row variant.

What each builder emits is chosen so that it does **not** depend on that order (as the
oracle requires, see DESIGN.md "How correctness is shown"): running counts ``(key, n)``
form the multiset ``{(key, 1..n_key)}`` whatever the order; lists are compared as
multisets; histograms commute. The exception is ``emit_ids=True`` (``running_count``,
``union_chain``), whose ``(key, n, id)`` output pins which id got which count: use it only
with direct invariant checks (``check_running_counts``), never with the oracle's
run-vs-run comparison.

Sinks: with ``out=None`` the sinks are placeholders that the oracle relocates
(``oracle.relocated``) and that refuse to stage output if run as they are. When you run a
pipeline yourself, pass ``out=tmp_path / "out"``; sink ``uid`` writes to ``out / uid``
(read it back with ``committed_output``).

Virtual time: ``sim_run`` runs a pipeline in the simulator at ``SOURCE_RATE`` records/s
per source subtask, so 200-300 records take a few virtual milliseconds and the default
``interval=0.0005`` gives several epochs per run (fewer at higher parallelism, where a run
is shorter; each epoch costs about 1-3 virtual ms of alignment and snapshot writing).

Speed: ``without_fsync()`` skips fsync in the storage while a test runs (see there).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from epochstream import (
    CheckpointConfig,
    CollectionSource,
    FileSink,
    KeyedBatchFunction,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.backends import location
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.sim import FailureSchedule, SimConfig

__all__ = [
    "BUILDERS",
    "LAYOUTS",
    "SINK_FORMATS",
    "SOURCE_RATE",
    "BatchRunningCount",
    "CollectIds",
    "Histogram",
    "RunningCount",
    "TagWithCount",
    "arrow_input",
    "check_running_counts",
    "committed_output",
    "gen_batch",
    "histogram",
    "input_records",
    "list_state",
    "make_pipeline",
    "running_count",
    "sim_run",
    "two_sinks",
    "two_stage",
    "union_chain",
    "union_chain_ids",
    "without_fsync",
]

#: records/s per source subtask in ``sim_run``: 200 records take ~2.5 (parallelism 4) to 10
#: (parallelism 1) virtual milliseconds
SOURCE_RATE = 20_000.0



class _PlaceholderSink(FileSink):
    """The sink of a pipeline built with ``out=None``: relocating it gives a real FileSink;
    staging output through it fails, so no test writes to a shared folder by mistake."""

    def relocated(self, path) -> FileSink:
        return FileSink(path, self._encoder, self._decoder, self.format, self.schema)

    def pre_commit(self, uid, subtask, epoch, attempt, records):
        raise RuntimeError(
            f"sink {uid!r} of a pipeline built with out=None: pass out=tmp_path / 'out' to the builder, "
            f"or run it through the oracle (which relocates sinks)"
        )


# ---------------------------------------------------------------- inputs


def input_records(n: int, keys: int, start: int = 0) -> list[tuple[str, int]]:
    """``n`` records ``(key, id)`` with ids ``start .. start+n-1`` and key ``"k{id % keys}"``."""
    return [(f"k{i % keys}", i) for i in range(start, start + n)]


def _gen_record(keys: int, start: int):
    """The record function for ``Pipeline.generate``: i -> ``(key, start + i)``."""

    def gen(i: int) -> tuple[str, int]:
        rid = start + i
        return (f"k{rid % keys}", rid)

    return gen


def _key(record: Any) -> Any:
    return record[0]


def _rid(record: Any) -> int:
    """The id of a record: ``(key, id)`` tuples on the row path, ``{"key", "id"}`` dicts when a
    row operator reads a columnar batch."""
    return record["id"] if type(record) is dict else record[1]


def arrow_input(n: int, keys: int, start: int = 0) -> pa.Table:
    """``input_records(n, keys, start)`` as a Table with columns ``key`` and ``id``."""
    ids = list(range(start, start + n))
    return pa.table({"key": pa.array([f"k{i % keys}" for i in ids], pa.string()), "id": pa.array(ids, pa.int64())})


def gen_batch(keys: int, start: int):
    """The batch function for ``Pipeline.generate_batches``: rows [a, b) are ``_gen_record``'s."""

    def gen(a: int, b: int) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(arrow_input(b - a, keys, start + a).to_pydict(),
                                          schema=arrow_input(0, keys).schema)

    return gen


def _mod(ids: pa.Array, m: int) -> pa.Array:
    """``ids % m`` for non-negative ints with Arrow kernels (integer division truncates)."""
    return pc.subtract(ids, pc.multiply(pc.divide(ids, m), m))


def _prefixed(prefix: str, values: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(prefix, pc.cast(values, pa.string()), "")


# ---------------------------------------------------------------- keyed functions


class RunningCount(KeyedProcessFunction):
    """ValueState ``count`` per key; emits ``(key, n)`` (or ``(key, n, id)`` with ``emit_ids``).

    The DESIGN's invariant: for every key the emitted counts are exactly 1..n.
    """

    def __init__(self, emit_ids: bool = False) -> None:
        self.emit_ids = emit_ids

    def open(self, ctx) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        n = self.count.value() + 1
        self.count.update(n)
        if self.emit_ids:
            return ((ctx.key, n, _rid(value)),)
        return ((ctx.key, n),)


class BatchRunningCount(KeyedBatchFunction):
    """``RunningCount`` on Arrow batches: ValueState ``count`` per key, one call per key per batch,
    emitting the rows ``{"key": key, "n": c + 1 .. c + rows}`` (plus ``id`` with ``emit_ids``)."""

    def __init__(self, emit_ids: bool = False) -> None:
        self.emit_ids = emit_ids

    def open(self, ctx) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process_batch(self, key, batch, ctx):
        c, rows = self.count.value(), batch.num_rows
        self.count.update(c + rows)
        out = {"key": pa.array([key] * rows, pa.string()), "n": pa.array(range(c + 1, c + rows + 1), pa.int64())}
        if self.emit_ids:
            out["id"] = batch.column("id")
        return pa.record_batch(out)


class CollectIds(KeyedProcessFunction):
    """ListState ``ids`` per key (every id appended once); emits ``(key, len(ids))``."""

    def open(self, ctx) -> None:
        self.ids = ctx.state(ListStateDescriptor("ids"))

    def process(self, value, ctx):
        self.ids.add(_rid(value))
        return ((ctx.key, len(self.ids.get())),)


class Histogram(KeyedProcessFunction):
    """MapState ``hist`` per key: bucket ``id % buckets`` -> count; emits ``(key, bucket, count)``."""

    def __init__(self, buckets: int = 4) -> None:
        self.buckets = buckets

    def open(self, ctx) -> None:
        self.hist = ctx.state(MapStateDescriptor("hist"))

    def process(self, value, ctx):
        b = _rid(value) % self.buckets
        c = (self.hist.get(b) or 0) + 1
        self.hist.put(b, c)
        return ((ctx.key, b, c),)


class TagWithCount(KeyedProcessFunction):
    """First stage of ``two_stage``: ValueState ``seen`` per key; passes ``(key, id)`` on unchanged."""

    def open(self, ctx) -> None:
        self.seen = ctx.state(ValueStateDescriptor("seen", default=0))

    def process(self, value, ctx):
        self.seen.update(self.seen.value() + 1)
        return (value,)


# ---------------------------------------------------------------- pipelines


#: where the tests' RocksDB keyed state lives: tmpfs where the machine has one. Creating a RocksDB
#: fsyncs its MANIFEST (~50 ms on this disk, 3 ms on tmpfs), and the property suites open a DB per
#: keyed subtask per attempt; a simulated crash cannot observe the difference (as ``without_fsync``)
ROCKSDB_TEST_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def make_pipeline(
    name: str,
    *,
    parallelism: int = 2,
    mode: str = "aligned",
    interval: float | None = 0.0005,
    batch_size: int = 8,
    batch_linger: float = 0.0,
    max_concurrent: int = 1,
    tolerable_failed: int = 0,
    restart_attempts: int = 30,
    max_parallelism: int | None = None,
    incremental: bool = True,
    aligned_timeout: float | None = None,
    state_backend_type: str = "hashmap",
    full_every: int = 10,
) -> Pipeline:
    """An empty Pipeline with the test knobs applied (restart_delay 0: the sim has its own);
    ``state_backend_type``: where keyed state lives while the job runs (hashmap or rocksdb);
    ``full_every``: how long a chain of increments grows (the heap's materialisation rounds)."""
    return Pipeline(
        name,
        parallelism=parallelism,
        max_parallelism=max_parallelism,
        mode=mode,
        checkpoint=CheckpointConfig(
            interval=interval,
            max_concurrent=max_concurrent,
            tolerable_failed=tolerable_failed,
            incremental=incremental,
            state_backend_type=state_backend_type,
            full_every=full_every,
            rocksdb_dir=ROCKSDB_TEST_DIR,
        ),
        batch_rows=batch_size,
        batch_linger=batch_linger,
        restart_attempts=restart_attempts,
        restart_delay=0.0,
        aligned_timeout=aligned_timeout,
    )


def _sink(out: str | Path | None, uid: str, sink_format: str = "jsonl") -> FileSink:
    """The FileSink of sink ``uid`` (``sink_format``: ``jsonl`` or ``parquet``, ``SINK_FORMATS``)."""
    if out is None:
        where = Path(tempfile.gettempdir()) / "epochstream-placeholder-sink" / uid
        return _PlaceholderSink(where, format=sink_format)
    return FileSink(location(out) / uid, format=sink_format)  # a local folder or an s3:// prefix


def running_count(*, n: int = 300, keys: int = 7, out=None, emit_ids: bool = False, columnar: bool = False,
                  sink_format: str = "jsonl", source_delay: float = 0.0, **knobs: Any) -> Pipeline:
    """collection -> key_by(key) -> RunningCount [uid "count"] -> sink "counts".

    Emits ``(key, n)``; with ``emit_ids=True`` ``(key, n, id)`` (not for the oracle).
    ``columnar``: from_arrow -> key_by("key") -> process_batches(BatchRunningCount) [uid "count"],
    emitting ``{"key", "n"}`` (``{"key", "n", "id"}``) rows. ``source_delay`` (rows only):
    seconds per record in a map chained to the source, so a run lasts at least
    ``n / parallelism * source_delay`` seconds however fast the machine is.
    """
    p = make_pipeline("running-count", **knobs)
    if columnar:
        (
            p.from_arrow(arrow_input(n, keys), uid="src")
            .key_by("key")
            .process_batches(BatchRunningCount(emit_ids), uid="count")
            .sink(_sink(out, "counts", sink_format), uid="counts")
        )
        return p
    src = p.from_collection(input_records(n, keys), uid="src")
    if source_delay:
        src = src.map(_sleeping(source_delay), name="paced")
    (
        src.key_by(_key)
        .process(RunningCount(emit_ids), uid="count")
        .sink(_sink(out, "counts", sink_format), uid="counts")
    )
    return p


def list_state(*, n: int = 300, keys: int = 7, out=None, columnar: bool = False,
              sink_format: str = "jsonl", **knobs: Any) -> Pipeline:
    """collection -> key_by -> CollectIds [uid "ids"] (ListState of ids) -> sink "lengths".
    ``columnar``: from_arrow -> key_by("key") -> CollectIds (a row function on Arrow batches)."""
    p = make_pipeline("list-state", **knobs)
    src = p.from_arrow(arrow_input(n, keys), uid="src") if columnar else p.from_collection(input_records(n, keys),
                                                                                          uid="src")
    (
        src
        .key_by("key" if columnar else _key)
        .process(CollectIds(), uid="ids")
        .sink(_sink(out, "lengths", sink_format), uid="lengths")
    )
    return p


def histogram(*, n: int = 300, keys: int = 5, buckets: int = 4, out=None, columnar: bool = False,
              sink_format: str = "jsonl", **knobs: Any) -> Pipeline:
    """generate -> key_by -> Histogram [uid "hist"] (MapState bucket -> count) -> sink "hist".
    ``columnar``: generate_batches (blocks of 16 rows) -> key_by("key") -> Histogram."""
    p = make_pipeline("histogram", **knobs)
    if columnar:
        src = p.generate_batches(gen_batch(keys, 0), count=n, uid="gen", block_rows=16)
    else:
        src = p.generate(_gen_record(keys, 0), count=n, uid="gen")
    (
        src
        .key_by("key" if columnar else _key)
        .process(Histogram(buckets), uid="hist")
        .sink(_sink(out, "hist", sink_format), uid="hist-out")
    )
    return p


def _explode(record: tuple[str, int]) -> list[tuple[str, int]]:
    """flat_map: every id divisible by 5 also yields a derived record with id + 1_000_000."""
    key, rid = record
    return [(key, rid), (key, rid + 1_000_000)] if rid % 5 == 0 else [(key, rid)]


def _relabel(record: tuple[str, int]) -> tuple[str, int]:
    """map: re-key onto fewer keys (so both sources share keys)."""
    key, rid = record
    return (f"k{rid % 4}", rid)


def _relabel_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``_relabel`` on a batch: key ``"k{id % 4}"``."""
    return batch.set_column(0, "key", _prefixed("k", _mod(batch.column("id"), 4)))


def _explode_row(record: dict) -> list[dict]:
    return [{"key": k, "id": i} for k, i in _explode((record["key"], record["id"]))]


def union_chain(*, n: int = 300, out=None, emit_ids: bool = False, columnar: bool = False,
                sink_format: str = "jsonl", split: bool = False, **knobs: Any) -> Pipeline:
    """Two sources, union, rebalance, map/flat_map/filter, then a keyed running count.

    ``a`` = collection of ids 0..n-1; ``b`` = generate ids 100000..100000+n/2-1,
    rebalanced, then map (re-key to 4 keys) -> flat_map (ids % 5 == 0 doubled) ->
    filter (drops ids % 7 == 3). ``a.union(b)`` -> key_by -> RunningCount [uid "count"]
    -> sink "counts". ``union_chain_ids(n)`` is the set of ids that reach the count.
    ``columnar``: ``a`` from_arrow, ``b`` generate_batches rebalanced in slices, then map_batches
    (the re-key), flat_map and filter on dict rows; the union keyed by column "key".
    ``split``: rebalanced again after the re-key, so ``b``'s path is two neighbouring stateless
    chains (with pass-through, one merged trAcker segment).
    """
    if n >= 100_000:
        raise ValueError("union_chain keeps ids unique only for n < 100000")
    p = make_pipeline("union-chain", **knobs)
    if columnar:
        a = p.from_arrow(arrow_input(n, 4), uid="a")
        b = (
            p.generate_batches(gen_batch(4, 100_000), count=max(n // 2, 1), uid="b", block_rows=8)
            .rebalance()
            .map_batches(_relabel_batch)
        )
        if split:
            b = b.rebalance()
        b = (
            b.flat_map(_explode_row)
            .filter(lambda r: r["id"] % 7 != 3)
        )
        a.union(b).key_by("key").process(RunningCount(emit_ids), uid="count").sink(
            _sink(out, "counts", sink_format), uid="counts")
        return p
    a = p.from_collection(input_records(n, 4), uid="a")
    b = (
        p.generate(_gen_record(4, 100_000), count=max(n // 2, 1), uid="b")
        .rebalance()
        .map(_relabel)
    )
    if split:
        b = b.rebalance()
    b = (
        b.flat_map(_explode)
        .filter(lambda r: r[1] % 7 != 3)
    )
    a.union(b).key_by(_key).process(RunningCount(emit_ids), uid="count").sink(
        _sink(out, "counts", sink_format), uid="counts")
    return p


def union_chain_ids(n: int = 300) -> set[int]:
    """The ids ``union_chain(n=n)`` feeds into its keyed count, computed without the framework."""
    ids = set(range(n))
    for i in range(max(n // 2, 1)):
        for _, rid in _explode(_relabel(("", 100_000 + i))):
            if rid % 7 != 3:
                ids.add(rid)
    return ids


def _with_bucket(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Adds column ``m`` = ``"m{id % 3}"`` (two_stage's second key, as a column)."""
    return batch.append_column("m", _prefixed("m", _mod(batch.column("id"), 3)))


def two_stage(*, n: int = 300, keys: int = 7, out=None, columnar: bool = False,
              sink_format: str = "jsonl", **knobs: Any) -> Pipeline:
    """Two keyed stages in sequence: process -> key_by -> process.

    collection -> key_by(key) -> TagWithCount [uid "stage1"] (ValueState, passes records on)
    -> key_by(id % 3) -> CollectIds [uid "stage2"] (ListState of ids) -> sink "stage2-out".
    ``columnar``: from_arrow -> map_batches (adds column m = "m{id % 3}") -> key_by(["key", "m"])
    (tuple keys) -> TagWithCount (dict rows) -> key_by("m") (a column key on rows) -> CollectIds.
    """
    p = make_pipeline("two-stage", **knobs)
    if columnar:
        (
            p.from_arrow(arrow_input(n, keys), uid="src")
            .map_batches(_with_bucket)
            .key_by(["key", "m"])
            .process(TagWithCount(), uid="stage1")
            .key_by("m")
            .process(CollectIds(), uid="stage2")
            .sink(_sink(out, "stage2-out", sink_format), uid="stage2-out")
        )
        return p
    (
        p.from_collection(input_records(n, keys), uid="src")
        .key_by(_key)
        .process(TagWithCount(), uid="stage1")
        .key_by(lambda r: f"m{r[1] % 3}")
        .process(CollectIds(), uid="stage2")
        .sink(_sink(out, "stage2-out", sink_format), uid="stage2-out")
    )
    return p


def two_sinks(*, n: int = 300, keys: int = 7, out=None, columnar: bool = False,
              sink_format: str = "jsonl", **knobs: Any) -> Pipeline:
    """One source feeding two sinks: the raw records to sink "raw" (every id once) and a
    keyed running count [uid "count"] to sink "counts". ``columnar``: the source is from_arrow,
    the raw branch a row map over its batches, the count keyed by column "key"."""
    p = make_pipeline("two-sinks", **knobs)
    if columnar:
        src = p.from_arrow(arrow_input(n, keys), uid="src")
        src.map(lambda r: ["raw", r["key"], r["id"]]).sink(_sink(out, "raw", sink_format), uid="raw")
    else:
        src = p.from_collection(input_records(n, keys), uid="src")
        src.map(lambda r: ["raw", r[0], r[1]]).sink(_sink(out, "raw", sink_format), uid="raw")
    src.key_by("key" if columnar else _key).process(RunningCount(), uid="count").sink(
        _sink(out, "counts", sink_format), uid="counts")
    return p


#: how records travel, for parametrized tests: builder knobs of each layout (every builder takes them)
LAYOUTS = {"rows": {}, "columns": {"columnar": True}}
#: the FileSink formats, for parametrized tests: builder knobs of each (every builder takes them)
SINK_FORMATS = {"jsonl": {}, "parquet": {"sink_format": "parquet"}}

#: name -> builder, for parametrized tests
BUILDERS = {
    "running_count": running_count,
    "list_state": list_state,
    "histogram": histogram,
    "union_chain": union_chain,
    "two_stage": two_stage,
    "two_sinks": two_sinks,
}


# ---------------------------------------------------------------- running and reading


def sim_run(
    pipeline: Pipeline,
    checkpoint_dir: str | Path,
    *,
    seed: int = 0,
    failures: FailureSchedule | None = None,
    restore: str | None = None,
    source_rate: float = SOURCE_RATE,
    sim: SimConfig | None = None,
    **kwargs: Any,
):
    """``pipeline.run`` in the simulator with the tests' source rate (or ``sim``); returns the JobResult."""
    return pipeline.run(
        deployment="sim",
        checkpoint_dir=str(checkpoint_dir),
        restore=restore,
        seed=seed,
        sim=sim or SimConfig(source_rate=source_rate),
        failures=failures,
        **kwargs,
    )


def committed_output(sink_dir: str | Path) -> list[Any]:
    """Committed records of one FileSink folder (``part-*.jsonl`` or ``part-*.parquet``;
    staging is ignored).

    JSON turns tuples into lists, and a Parquet row comes back as the list of its column
    values in column order; records come back in file-name order (epoch, subtask).
    """
    import pyarrow.parquet as pq

    out: list[Any] = []
    for p in sorted(Path(sink_dir).glob("part-*")):
        if p.suffix == ".parquet":
            out.extend(list(row.values()) for row in pq.read_table(p).to_pylist())
        elif p.suffix == ".jsonl":
            with open(p, encoding="utf-8") as f:
                out.extend(json.loads(line) for line in f if line.strip())
    return out


def check_running_counts(records: Iterable[Any], expected_ids: Iterable[int] | None = None) -> list[str]:
    """The DESIGN's invariant on ``(key, n, id)`` output; returns the violations (empty = fine).

    Every id appears exactly once (and, given ``expected_ids``, exactly those ids), and for
    every key the counts are exactly 1..n: no gap (lost state update), no repeat (doubled one).
    """
    problems: list[str] = []
    ids = collections.Counter()
    counts: dict[Any, list[int]] = collections.defaultdict(list)
    for rec in records:
        key, n, rid = rec
        ids[rid] += 1
        counts[key].append(n)
    for rid, c in ids.items():
        if c != 1:
            problems.append(f"id {rid} appears {c} times")
    if expected_ids is not None:
        want = set(expected_ids)
        missing = want - set(ids)
        extra = set(ids) - want
        if missing:
            problems.append(f"{len(missing)} ids missing, e.g. {sorted(missing)[:5]}")
        if extra:
            problems.append(f"{len(extra)} unexpected ids, e.g. {sorted(extra)[:5]}")
    for key, ns in counts.items():
        if sorted(ns) != list(range(1, len(ns) + 1)):
            dup = sorted(v for v, c in collections.Counter(ns).items() if c > 1)
            gaps = sorted(set(range(1, max(ns) + 1)) - set(ns))
            problems.append(f"key {key!r}: counts are not 1..{len(ns)} (repeated {dup[:5]}, missing {gaps[:5]})")
    return problems


# ---------------------------------------------------------------- speed


class _OsWithoutFsync:
    """``os`` with a no-op ``fsync``: every other attribute is the real one."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        return None


@contextlib.contextmanager
def without_fsync():
    """Skip fsync in the local checkpoint storage (and the FileSink, which shares its writer).

    On the test machines an fsync costs 3-6 ms, and a simulated run does hundreds of them;
    it dominates the suite's runtime. The simulator injects crashes as exceptions inside one
    process, which sees its own writes whether or not they reached the disk, so skipping the
    flush changes no observable behaviour here (durability across power loss is not what these
    tests check). Set ``EPOCHSTREAM_TEST_FSYNC=1`` to keep real fsyncs.
    """
    from epochstream.backends import local

    if os.environ.get("EPOCHSTREAM_TEST_FSYNC") == "1":
        yield
        return
    real = local.os
    local.os = _OsWithoutFsync()
    try:
        yield
    finally:
        local.os = real


def committed_counts(chk, uid: str = "count", state: str = "count") -> dict:
    """key -> value of ValueState ``state`` of operator ``uid`` in the newest checkpoint.

    Read with the storage API and pickle only, on purpose independent of the oracle's code,
    so checks built on it do not share the oracle's bugs."""
    storage = LocalCheckpointStorage(chk)
    manifest, root = storage.latest()
    out = {}
    for _kg, kbytes, name, vbytes in storage.read_operator_rows(manifest, root, uid):
        if name != state:
            continue
        if vbytes is None:
            out.pop(pickle.loads(kbytes), None)
        else:
            out[pickle.loads(kbytes)] = pickle.loads(vbytes)
    return out


# ---------------------------------------------------------------- typed state (typed Delta columns)


class TypedProfile(KeyedProcessFunction):
    """Keyed state of every declared type: a typed key, value states (LONG, DOUBLE, a row),
    a list of strings, a map string -> long, and one untyped state (pickled only).

    Emits ``(key, n)`` like ``RunningCount``; ``declare`` may leave out types (schema changes).
    """

    def __init__(self, declare: tuple[str, ...] = ("count", "total", "recent", "buckets", "last")) -> None:
        self.declare = declare

    def open(self, ctx) -> None:
        from epochstream import Types

        t = lambda name, typ: typ if name in self.declare else None  # noqa: E731
        self.count = ctx.state(ValueStateDescriptor("count", t("count", Types.LONG()), default=0))
        self.total = ctx.state(ValueStateDescriptor("total", t("total", Types.DOUBLE()), default=0.0))
        self.recent = ctx.state(ListStateDescriptor("recent", t("recent", Types.STRING())))
        self.buckets = ctx.state(MapStateDescriptor("buckets", t("buckets", (Types.STRING(), Types.LONG()))))
        self.last = ctx.state(ValueStateDescriptor(
            "last", t("last", Types.ROW_NAMED(["id", "even"], [Types.LONG(), Types.BOOLEAN()]))))
        self.seen = ctx.state(ValueStateDescriptor("seen", default=frozenset()))

    def process(self, value, ctx):
        i = value[1]
        n = self.count.value() + 1
        self.count.update(n)
        self.total.update(self.total.value() + i * 0.5)
        # the three largest ids and the largest one: state that does not depend on arrival order
        top = sorted([int(s[2:]) for s in self.recent.get()] + [i])[-3:]
        self.recent.update([f"id{j}" for j in top])
        b = f"b{i % 3}"
        self.buckets.put(b, (self.buckets.get(b) or 0) + 1)
        last = self.last.value()
        if last is None or i > last[0]:
            self.last.update((i, i % 2 == 0))
        self.seen.update(self.seen.value() | {i % 7})
        return ((ctx.key, n),)


def typed_profile(*, n: int = 200, keys: int = 5, out=None, declare=None, key_type=True, sink=None,
                  **knobs: Any) -> Pipeline:
    """collection -> key_by(key_type=STRING) -> TypedProfile [uid "profile"] -> sink."""
    from epochstream import Types

    p = make_pipeline("typed-profile", **knobs)
    fn = TypedProfile() if declare is None else TypedProfile(declare)
    (
        p.from_collection(input_records(n, keys), uid="src")
        .key_by(_key, key_type=Types.STRING() if key_type else None)
        .process(fn, uid="profile")
        .sink(sink if sink is not None else _sink(out, "counts"), uid="counts")
    )
    return p


#: crashes at each delicate point of a Delta-backed epoch: a worker kill mid-epoch and a failed
#: state write (pre-commit), a crash after the manifest (before any Delta commit), after the state
#: append and before the sink append (mid_commit), during recovery (after the state re-issue,
#: before the sinks'), and, in pipelines that compact often (``delta_compact_every``), between an
#: epoch's state append and the compaction it starts, and during a compaction (its folded file
#: written, not committed)
DELTA_CHAOS = dict(
    kill_times=[0.0031],
    write_failures={3},
    fail_points={"after_manifest": {2}, "mid_commit": {3}, "recovery": {4}, "before_compaction": {1},
                 "compaction": {2}},
)


def delta_chaos_run(seed: int = 3):
    """The oracle's ``run`` for Delta suites: ``DELTA_CHAOS`` (a fresh schedule each run) when failing."""
    def run(p, chk, failing):
        failures = FailureSchedule(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in DELTA_CHAOS.items()})
        return sim_run(p, chk, seed=seed, failures=failures if failing else None)

    return run


class PacedSource(CollectionSource):
    """A collection read at a bounded pace (``pause`` seconds per batch): the run lasts long
    enough in real time, even on an idle machine, for kills to land while records flow."""

    def __init__(self, items, num_splits: int, pause: float) -> None:
        super().__init__(items, num_splits)
        self.pause = pause

    def read(self, split: int, offset: int, count: int):
        time.sleep(self.pause)
        return super().read(split, offset, count)


def _paced_record(keys: int, delay: float):
    """``_gen_record`` that sleeps ``delay`` seconds per record (a source slower than its consumers)."""
    gen = _gen_record(keys, 0)

    def paced(i: int) -> tuple[str, int]:
        if delay:
            time.sleep(delay)
        return gen(i)

    return paced


def _sleeping(delay: float):
    """map: the record unchanged after ``delay`` seconds (a deliberately slow stage)."""

    def slow(record: Any) -> Any:
        if delay:
            time.sleep(delay)
        return record

    return slow


def paced(*, n: int = 10**9, keys: int = 7, out=None, source_delay: float = 0.0, sink_delay: float = 0.0,
          **knobs: Any) -> Pipeline:
    """generate (``source_delay`` s per record) -> key_by -> map "slow" (``sink_delay`` s per record)
    -> sink "paced": with ``sink_delay`` the last chain is the bottleneck and its upstream is
    backpressured; with ``source_delay`` the source is, and nothing downstream waits on output."""
    p = make_pipeline("paced", **knobs)
    (
        p.generate(_paced_record(keys, source_delay), count=n, uid="gen")
        .key_by(_key)
        .map(_sleeping(sink_delay), name="slow")
        .sink(_sink(out, "paced"), uid="paced-out")
    )
    return p
