"""The Delta state table as an append-only changelog, compacted: exactly-once under crashes
between an epoch's append and its compaction and during a compaction, every retained epoch
readable after compactions, deletes as tombstones, and tables of the old MERGE layout.

No Spark (the simulator and delta-rs only): fast. That Spark reads the changelog's state
(``read_state``) is shown in tests/test_delta.py.
"""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pytest

from epochstream import ValueStateDescriptor
from epochstream.api.functions import KeyedProcessFunction
from epochstream.backends.delta import DeltaCheckpointStorage, DeltaSink, history, state_at, tables
from epochstream.backends.delta.changelog import fold
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from epochstream.state import query as state_query
from pipelines import _key, input_records, make_pipeline, sim_run, without_fsync

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
N, KEYS = 240, 5


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


class CountToFour(KeyedProcessFunction):
    """Counts 1, 2, 3 per key, then clears its state (a delete: a tombstone in the changelog)
    and emits 4; the next record starts again at 1."""

    def open(self, ctx) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        n = self.count.value() + 1
        if n == 4:
            self.count.clear()
        else:
            self.count.update(n)
        return ((ctx.key, n),)


def counting(*, out=None, mode: str = "aligned", compact_every: int = 2, n: int = N, num_retained: int = 3,
             **knobs):
    p = make_pipeline("delta-changelog", parallelism=2, mode=mode, interval=knobs.pop("interval", 0.002), **knobs)
    p.checkpoint.state_backend = "delta"
    p.checkpoint.num_retained = num_retained
    p.checkpoint.delta_compact_every = compact_every
    target = str(out) + "/counts" if out is not None else "/nonexistent/epochstream-placeholder"
    (p.from_collection(input_records(n, KEYS), uid="src").key_by(_key).process(CountToFour(), uid="count")
     .sink(DeltaSink(target, SCHEMA), uid="counts"))
    return p


def file_state(chk, epoch: int) -> dict:
    """The committed ``count`` state of a checkpoint from its snapshot files (no Delta)."""
    files = LocalCheckpointStorage(chk)
    manifest, root = files.load_manifest(epoch)
    out: dict = {}
    for _g, k, _s, v in files.read_operator_rows(manifest, root, "count"):  # the chain, oldest first
        if v is None:
            out.pop(pickle.loads(k), None)
        else:
            out[pickle.loads(k)] = pickle.loads(v)
    return out


def delta_state(storage: DeltaCheckpointStorage, epoch: int) -> dict:
    """The same state as the Delta backend reads it: the changelog at the epoch's version, folded."""
    manifest, root = storage.load_manifest(epoch)
    return {pickle.loads(k): pickle.loads(v) for _g, k, _s, v in storage.read_operator_rows(manifest, root, "count")}


def epoch_txns(table: str) -> list[int]:
    return sorted(h["meta"]["epoch"] for h in history(table)
                  if h["meta"] and h["meta"].get("epoch", 0) > 0 and not tables.is_compaction(h["meta"]))


# ---------------------------------------------------------------- the fold


def test_fold_takes_the_newest_row_per_key_up_to_an_epoch_and_drops_tombstones():
    rows = pa.table({
        "key_group": [1, 1, 2, 1, 2, 3], "key": [b"a", b"a", b"b", b"a", b"b", b"c"],
        "state": ["s"] * 6, "value": [b"1", b"2", b"1", None, b"9", None], "epoch": [1, 2, 2, 3, 4, 4]})
    as_dict = lambda t: {r["key"]: r["value"] for r in t.to_pylist()}  # noqa: E731
    assert as_dict(fold(rows, 1)) == {b"a": b"1"}
    assert as_dict(fold(rows, 2)) == {b"a": b"2", b"b": b"1"}
    assert as_dict(fold(rows, 3)) == {b"b": b"1"}  # a's tombstone at epoch 3 deletes it
    assert as_dict(fold(rows)) == {b"b": b"9"}  # c was deleted without ever being written
    assert fold(rows.slice(0, 0)).num_rows == 0


def test_a_partial_full_capture_tombstones_exactly_the_keys_it_no_longer_has(tmp_path):
    """A full capture of some key-group ranges (not all: the table is not replaced) must delete
    the keys the table holds in those ranges that the capture lacks, and only those."""
    from epochstream.backends.delta.changelog import missing_keys
    from epochstream.backends.delta.schema import COLUMNS

    table = str(tmp_path / "t")
    schema = pa.schema([pa.field(c.name, c.arrow, nullable=c.nullable) for c in COLUMNS])
    tables.create(table, schema, {tables.FORMAT_PROPERTY: tables.STATE_FORMAT}, "app")
    rows = pa.table({"key_group": [1, 1, 5, 9, 9], "key": [b"a", b"a", b"b", b"c", b"d"], "state": ["s"] * 5,
                     "value": [b"1", b"2", None, b"1", b"1"], "epoch": [1, 2, 2, 1, 2]}, schema=schema)
    tables.append(rows, table, "app", 2, str)
    have = pa.table({"key_group": [1], "key": [b"a"], "state": ["s"]})
    gone = missing_keys(table, [(0, 6)], have)  # a and b are in range; a is still there, b was deleted already
    assert sorted(gone.column("key").to_pylist()) == [b"b"]
    gone = missing_keys(table, [(0, 6), (9, 9)], have)
    assert sorted(gone.column("key").to_pylist()) == [b"b", b"c", b"d"]
    assert missing_keys(table, [(2, 4)], have).num_rows == 0


# ---------------------------------------------------------------- exactly-once with compaction


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_exactly_once_with_crashes_between_an_append_and_its_compaction_and_during_one(mode, tmp_path):
    """The oracle, Delta state and sink, compaction after every append (inline on the simulator):
    crashes after the manifest, between the state append and the sink's, right after an
    epoch's append before the compaction it starts, with a compaction's folded file written
    but not committed, and a worker kill. Every epoch commits once; each retained epoch's
    state read from the compacted changelog equals its snapshot files."""
    failures = dict(kill_times=[0.0031], fail_points={"after_manifest": {2}, "mid_commit": {3},
                                                      "before_compaction": {1}, "compaction": {1}})
    chaos: dict = {}

    def run(p, chk, failing):
        plan = FailureSchedule(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in failures.items()})
        result = sim_run(p, chk, seed=3, failures=plan if failing else None)
        if failing:
            chaos["result"] = result
        return result

    report = check_exactly_once(lambda: counting(mode=mode, n=4 * N, interval=0.001, compact_every=1), run, tmp_path)
    assert report.ok, report.to_json()
    reasons = [f["reason"] for f in chaos["result"].metrics["failovers"]]
    for point in ("after_manifest", "mid_commit", "before_compaction", "at compaction"):
        assert sum(point in r for r in reasons) == 1, reasons
    chk = tmp_path / "chaos" / "chk"
    storage = DeltaCheckpointStorage(chk)
    table = storage.table_path("count")
    completed = storage.list_checkpoints()
    assert epoch_txns(table) == completed  # re-issued appends were skipped, not applied twice
    compactions = [h for h in history(table) if tables.is_compaction(h["meta"])]
    assert compactions, "the run must have compacted"
    for epoch in completed:  # epochs before, between and after compactions
        assert delta_state(storage, epoch) == file_state(chk, epoch), epoch
    folded = state_at(table)
    assert {pickle.loads(k): pickle.loads(v) for k, v in zip(folded.column("key").to_pylist(),
                                                             folded.column("value").to_pylist(), strict=True)} \
        == file_state(chk, completed[-1])


def test_compaction_folds_the_changelog_and_an_older_retained_epoch_still_restores(tmp_path):
    """After compactions the newest version holds one row per live key (plus the appends after
    the last compaction). The newest manifests damaged, ``restore="latest"`` falls back to the
    oldest retained checkpoint, committed before the last compaction: its state is read at its
    own version (time travel past the compaction), the table is rolled back to that version,
    and the job ends with every count emitted exactly once."""
    out, chk, n = tmp_path / "out", tmp_path / "chk", 2 * N
    result = sim_run(counting(out=out, compact_every=2, num_retained=4, n=n, interval=0.001), chk, seed=1)
    storage = DeltaCheckpointStorage(chk)
    table = storage.table_path("count")
    hist = history(table)
    last_compaction = next(h for h in hist if tables.is_compaction(h["meta"]))
    appended_after = sum(1 for h in hist if h["version"] > last_compaction["version"])
    raw = tables.open_table(table).to_pyarrow_table()
    assert raw.num_rows <= KEYS * (1 + appended_after), "the compacted file holds one row per live key"
    retained = storage.list_checkpoints()
    assert retained == result.completed_epochs[-4:]
    oldest, _ = storage.load_manifest(retained[0])
    assert oldest["delta"]["state"]["count"]["version"] < last_compaction["version"]
    for epoch in retained:
        assert delta_state(storage, epoch) == file_state(chk, epoch)
        # read-committed state queries (Python API) through the Delta tables and through the state files agree
        by_delta = state_query(chk, "count", epoch=epoch, storage=storage).select(["key", "value"]).to_pylist()
        by_files = state_query(chk, "count", epoch=epoch).select(["key", "value"]).to_pylist()
        assert sorted(map(str, by_delta)) == sorted(map(str, by_files)) and len(by_delta) == len(file_state(chk, epoch))

    for epoch in retained[1:]:
        (chk / f"chk-{epoch}" / "_metadata.json").write_bytes(b"{damaged")
    sim_run(counting(out=out, compact_every=2, n=n, interval=0.001), chk, seed=1, restore="latest")
    assert any(isinstance(h["meta"], dict) and h["meta"].get("restored_to") == oldest["delta"]["state"]["count"][
        "version"] for h in history(table)), "the table was rolled back past the compaction"
    rows = DeltaSink(str(out / "counts"), SCHEMA).read()
    want = sorted((f"k{k}", i % 4 + 1) for k in range(KEYS) for i in range(n // KEYS))
    assert sorted((r["key"], r["n"]) for r in rows) == want


def test_a_table_of_the_merge_layout_is_read_and_upgraded_in_place(tmp_path):
    """A state table of epochstream before the changelog (``keyed-state-v1``: the state itself,
    one row per key) is a folded changelog: its checkpoints restore from it, and the next
    epoch upgrades it to ``keyed-state-v2`` with one commit that no epoch counts as its own."""
    from deltalake import CommitProperties

    out = tmp_path / "out"
    p = counting(out=out, compact_every=1, n=N // 2)  # compacted after every epoch: one row per live key
    sim_run(p, tmp_path / "chk", seed=1)
    storage = DeltaCheckpointStorage(tmp_path / "chk")
    table = storage.table_path("count")
    newest = history(table)[0]["meta"]
    assert tables.is_compaction(newest)
    # what a v1 table looks like: the v1 property, and content that is the state
    raw = tables.open_table(table).to_pyarrow_table()
    assert raw.num_rows == len({(r["key_group"], r["key"]) for r in raw.to_pylist()})
    # (the property is set by a commit labelled as maintenance, so that no epoch counts it; a real
    # v1 table's newest commit is its last epoch's MERGE, which reads the same)
    label = {"userMetadata": json.dumps({**newest, "token": "downgraded-for-the-test"})}
    tables.open_table(table).alter.set_table_properties(
        {tables.FORMAT_PROPERTY: tables.STATE_FORMAT_V1}, raise_if_not_exists=False,
        commit_properties=CommitProperties(custom_metadata=label))
    before = storage.list_checkpoints()

    sim_run(counting(out=out, compact_every=0), tmp_path / "chk", seed=1, restore="latest")
    assert tables.properties(table)[tables.FORMAT_PROPERTY] == tables.STATE_FORMAT
    upgrades = [h for h in history(table) if isinstance(h["meta"], dict) and "upgraded_from" in h["meta"]]
    assert len(upgrades) == 1 and tables.is_compaction(upgrades[0]["meta"])
    after = storage.list_checkpoints()
    assert after[-1] > before[-1]
    for epoch in after:
        assert delta_state(storage, epoch) == file_state(tmp_path / "chk", epoch), epoch
    rows = DeltaSink(str(out / "counts"), SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", i % 4 + 1) for k in range(KEYS) for i in range(N // KEYS))


def test_the_storage_pickles_without_the_job_masters_compaction_machinery(tmp_path):
    """The spark driver ships the storage to its tasks: the lock and the compactor thread stay
    with the job master, a copy starts with its own."""
    import cloudpickle

    storage = DeltaCheckpointStorage(tmp_path / "chk", compact_every=4)
    storage._owed["t"] = 3
    copy = cloudpickle.loads(cloudpickle.dumps(storage))
    assert copy.root == storage.root and copy.compact_every == 4 and copy._owed == {}
    with copy._lock:  # a working lock of its own
        assert copy._lock is not storage._lock


def test_a_rescaled_restore_reads_the_compacted_changelog_by_key_group_ranges(tmp_path):
    """Stop after some epochs (compacted on the way), restore at parallelism 3: each new
    subtask reads its key groups of the folded state, and every count is emitted once."""
    from epochstream.deploy.failures import JobFailedError

    out, chk, n = tmp_path / "out", tmp_path / "chk", 2 * N
    with pytest.raises(JobFailedError):
        sim_run(counting(out=out, compact_every=1, n=n, interval=0.001, restart_attempts=0), chk, seed=1,
                failures=FailureSchedule(fail_points={"after_commit": {4}}))
    table = DeltaCheckpointStorage(chk).table_path("count")
    assert any(tables.is_compaction(h["meta"]) for h in history(table))
    sim_run(counting(out=out, compact_every=1, n=n, interval=0.001), chk, seed=1, restore="latest", parallelism=3)
    manifest, _ = DeltaCheckpointStorage(chk).latest()
    assert {f["subtask"] for f in manifest["operators"]["count"]["files"]} == {0, 1, 2}
    rows = DeltaSink(str(out / "counts"), SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in rows) == sorted(
        (f"k{k}", i % 4 + 1) for k in range(KEYS) for i in range(n // KEYS))
