"""Typed columns in Delta state tables: declared key and state types become real Spark SQL
columns beside the pickled bytes, written by the same one transaction per epoch.

Real Spark and real Delta tables on the local filesystem (slow). Shown here:

* the exactly-once oracle in both modes under crashes in pre-commit, after the manifest,
  mid-commit and during recovery, with typed state; at EVERY epoch's Delta version each
  typed column equals its pickled value decoded (the typed view never drifts from the
  state restores read), and Spark SQL sees the committed counts through them;
* a state declared with a type by a later job version (restored from the same checkpoint
  dir): the MERGE of the next epoch adds the column (schema evolution inside the epoch's
  one transaction) and fills it for every row, old ones included;
* a state declared with another type than its column has is refused before the epoch's
  checkpoint exists, nothing is written, and the corrected job resumes exactly once.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from epochstream import CheckpointError, Types
from epochstream.backends.delta import DeltaCheckpointStorage, history, read_state, tables
from epochstream.deploy.failures import JobFailedError
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from epochstream.runtime.types import TypeInformation
from pipelines import (
    TypedProfile,
    committed_output,
    delta_chaos_run,
    input_records,
    make_pipeline,
    sim_run,
    typed_profile,
    without_fsync,
)

pytestmark = pytest.mark.slow

N, KEYS = 200, 5


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def delta_profile(**knobs):
    p = typed_profile(n=knobs.pop("n", N), keys=KEYS, interval=knobs.pop("interval", 0.002), **knobs)
    p.checkpoint.state_backend = "delta"
    return p


def epoch_versions(table: str) -> list[tuple[int, int]]:
    """(epoch, Delta version) of epochstream's state transactions, oldest first."""
    return sorted((h["meta"]["epoch"], h["version"]) for h in history(table)
                  if h["meta"] and h["meta"].get("epoch") and not tables.is_compaction(h["meta"]))


def assert_typed_equals_pickled(spark, table: str, version: int, columns: dict[str, TypeInformation]) -> int:
    """Every typed column at ``version`` equals the decoded pickles of its row; returns rows checked."""
    rows = read_state(spark, table, version=version).collect()  # the changelog folded at the version
    for r in rows:
        key = pickle.loads(r["key"])
        if "typed_key" in columns:
            assert r["typed_key"] == key, (version, r)
        for col, t in columns.items():
            if col == "typed_key":
                continue
            got = r[col]
            if r["state"] != col[len("typed_"):]:
                assert got is None, (version, r["state"], col)
                continue
            want = t.plain(pickle.loads(r["value"]))
            if t.name == "map":
                got, want = dict(got), dict(want)
            elif t.name == "row":
                got = got.asDict()
            assert got == want, (version, key, col)
    return len(rows)


COLUMNS = {
    "typed_key": Types.STRING(), "typed_count": Types.LONG(), "typed_total": Types.DOUBLE(),
    "typed_recent": Types.LIST(Types.STRING()), "typed_buckets": Types.MAP(Types.STRING(), Types.LONG()),
    "typed_last": Types.ROW_NAMED(["id", "even"], [Types.LONG(), Types.BOOLEAN()]),
}

@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_typed_delta_columns(spark, mode, tmp_path):
    report = check_exactly_once(lambda: delta_profile(mode=mode), delta_chaos_run(), tmp_path)
    assert report.ok, report.to_json()
    assert report.restarts >= 3, report.to_json()
    storage = DeltaCheckpointStorage(tmp_path / "chaos" / "chk")
    table = storage.table_path("profile")
    versions = epoch_versions(table)
    assert [e for e, _v in versions] == storage.list_checkpoints()  # one transaction per epoch, re-issues skipped
    for _epoch, version in versions:
        assert assert_typed_equals_pickled(spark, table, version, COLUMNS) > 0
    # Spark SQL on the typed view alone: every key's count and the ids it saw
    final = versions[-1][1]
    rows = (read_state(spark, table, version=final).filter("state IN ('count', 'last')")
            .selectExpr("typed_key", "typed_count", "typed_last.id AS last_id").collect())
    counts = {r["typed_key"]: r["typed_count"] for r in rows if r["typed_count"] is not None}
    last = {r["typed_key"]: r["last_id"] for r in rows if r["last_id"] is not None}
    assert counts == {f"k{i}": N // KEYS for i in range(KEYS)}
    assert last == {f"k{i}": max(j for k, j in input_records(N, KEYS) if k == f"k{i}") for i in range(KEYS)}
    manifest, _ = storage.latest()
    assert manifest["delta"]["state"]["profile"]["columns"] == {c: t.to_json() for c, t in COLUMNS.items()}


def test_a_state_typed_by_a_later_job_version_gets_its_column_filled_for_every_row(spark, tmp_path):
    """Version 1 of the job declares only ``count``; version 2, restored from the same
    checkpoint dir, declares every type. The next epoch's MERGE adds the columns (one
    transaction: schema evolution) and writes them for every key, including keys that
    version 2 never touches again."""
    chk, out = tmp_path / "chk", tmp_path / "out"
    p1 = delta_profile(out=out, declare=("count",), key_type=False, restart_attempts=0)
    with pytest.raises(JobFailedError):
        sim_run(p1, chk, seed=1, failures=FailureSchedule(fail_points={"after_commit": {2}}))
    storage = DeltaCheckpointStorage(chk)
    table = storage.table_path("profile")
    before = spark.read.format("delta").load(table).schema.fieldNames()
    assert [c for c in before if c.startswith("typed_")] == ["typed_count"]

    sim_run(delta_profile(out=out), chk, seed=1, restore="latest")
    versions = epoch_versions(table)
    final = versions[-1][1]
    assert assert_typed_equals_pickled(spark, table, final, COLUMNS) == KEYS * 6
    assert [e for e, _v in versions] == storage.list_checkpoints()
    # the counts are exact across the version change
    assert counts_exact(out, N)
    # a job that stops declaring a type keeps the column filled from the table's own type
    sim_run(delta_profile(out=out, n=2 * N, declare=("count",)), tmp_path / "chk", seed=1, restore="latest")
    final = epoch_versions(table)[-1][1]
    assert assert_typed_equals_pickled(spark, table, final, COLUMNS) == KEYS * 6
    assert counts_exact(out, 2 * N)


def counts_exact(out: Path, n: int) -> bool:
    """The committed ``(key, count)`` output is exactly 1..n/KEYS per key: nothing lost or doubled."""
    got = sorted(tuple(r) for r in committed_output(out / "counts"))
    return got == sorted((f"k{k}", c) for k in range(KEYS) for c in range(1, n // KEYS + 1))


def committed_sink(out: Path):
    from epochstream import FileSink

    return FileSink(out / "counts")


def test_a_column_type_conflict_names_both_types(spark, tmp_path):
    """Same state, declared BIGINT in the table and INT by the job (the values fit both):
    the capture passes, the commit point refuses with both types named, nothing is written."""
    chk, out = tmp_path / "chk", tmp_path / "out"
    with pytest.raises(JobFailedError):
        sim_run(delta_profile(out=out, restart_attempts=0), chk, seed=1,
                failures=FailureSchedule(fail_points={"after_commit": {2}}))
    storage = DeltaCheckpointStorage(chk)
    table = storage.table_path("profile")
    checkpoints, versions = storage.list_checkpoints(), len(history(table))

    class CountAsInt(TypedProfile):
        def open(self, ctx):
            from epochstream import ValueStateDescriptor

            self.declare = ("total", "recent", "buckets", "last")
            super().open(ctx)
            self.count = ctx.state(ValueStateDescriptor("count", Types.INT(), default=0))

    p = make_pipeline("typed-profile", restart_attempts=0, interval=0.002)
    p.checkpoint.state_backend = "delta"
    (p.from_collection(input_records(N, KEYS), uid="src").key_by(lambda r: r[0], key_type=Types.STRING())
     .process(CountAsInt(), uid="profile").sink(committed_sink(out), uid="counts"))
    with pytest.raises((JobFailedError, CheckpointError)) as exc:
        sim_run(p, chk, seed=1, restore="latest")
    msg = str(exc.value)
    assert "typed_count is declared as INT" in msg and "holds it as BIGINT" in msg, msg
    assert storage.list_checkpoints() == checkpoints
    assert len(history(table)) == versions


class TypesTotalLate(TypedProfile):
    """Declares ``total`` as DOUBLE only from id ``LATE`` on (a lazily declared state type)."""

    LATE = 330

    def process(self, value, ctx):
        if value[1] >= self.LATE:
            from epochstream import ValueStateDescriptor

            self.total = ctx.state(ValueStateDescriptor("total", Types.DOUBLE(), default=0.0))
        return super().process(value, ctx)


def test_a_type_declared_mid_run_fills_the_column_for_keys_not_touched_since(spark, tmp_path):
    """After the declaration only key k0 gets records, so incremental captures hold k0 alone;
    the epoch that first carries the type still writes ``typed_total`` for every key (the
    whole state goes into that epoch's MERGE)."""
    records = input_records(150, KEYS) + [("k0", i) for i in range(150, 420)]
    p = make_pipeline("typed-late", interval=0.002)
    p.checkpoint.state_backend = "delta"
    (p.from_collection(records, uid="src").key_by(lambda r: r[0], key_type=Types.STRING())
     .process(TypesTotalLate(declare=("count",)), uid="profile").sink(committed_sink(tmp_path / "out"), uid="counts"))
    result = sim_run(p, tmp_path / "chk", seed=1)
    assert len(result.completed_epochs) >= 3
    storage = DeltaCheckpointStorage(tmp_path / "chk")
    table = storage.table_path("profile")
    final = epoch_versions(table)[-1][1]
    columns = {"typed_key": Types.STRING(), "typed_count": Types.LONG(), "typed_total": Types.DOUBLE()}
    assert assert_typed_equals_pickled(spark, table, final, columns) == KEYS * 6
    totals = {r["typed_key"]: r["typed_total"] for r in read_state(spark, table, version=final)
              .filter("state = 'total'").collect()}
    want: dict[str, float] = {}
    for k, i in records:
        want[k] = want.get(k, 0.0) + i * 0.5
    assert totals == want
    # the scenario: epochs before the declaration had no such column, and the epoch that added
    # it captured k0 alone (an incremental capture that does not hold the other keys)
    def columns_at(version: int) -> list[str]:
        return spark.read.format("delta").option("versionAsOf", version).load(table).schema.fieldNames()

    added = next((e, v) for e, v in epoch_versions(table) if "typed_total" in columns_at(v))
    assert added[0] > 1
    changed = spark.read.format("delta").option("versionAsOf", added[1] - 1).load(table).filter(
        f"epoch = {added[0] - 1}").count()
    assert changed <= 6, "the epoch before the declaration must already touch k0 alone"
