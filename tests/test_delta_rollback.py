"""Delta tables after a fallback restore (issue 14, item 4).

The newest checkpoint's manifest is damaged after their epochs committed to the Delta
sink and state tables; ``restore="latest"`` restores the epoch before them. Recovery must take
the tables back to that epoch's version (Delta RESTORE) and commit the replayed epochs under
a new app id: Delta keeps an app's ``txnVersion`` across RESTORE, so reusing it would skip the
replay (lost output and state), and one (app id, txnVersion) would name two contents. A crash
before the first new manifest makes recovery meet the already rolled-back tables again.

Judged by the exactly-once oracle (recorded order) in both modes, plus the Delta logs
themselves: no (app id, txnVersion) is ever committed twice. delta-rs only, no JVM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from epochstream.backends.delta import (
    DeltaCheckpointStorage,
    DeltaConflictError,
    DeltaSink,
    history,
    version_of_epoch,
)
from epochstream.deploy.sim import FailureSchedule
from epochstream.oracle import check_exactly_once
from pipelines import RunningCount, _key, input_records, make_pipeline, sim_run, without_fsync

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
N, KEYS = 400, 5


@pytest.fixture(autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def delta_count(mode: str, state_backend: str = "delta"):
    p = make_pipeline("delta-rollback", parallelism=2, mode=mode, interval=0.0006)
    p.checkpoint.state_backend = state_backend
    (
        p.from_collection(input_records(N, KEYS), uid="src")
        .key_by(_key)
        .process(RunningCount(), uid="count")
        .sink(DeltaSink(Path("/nonexistent/epochstream-placeholder"), SCHEMA), uid="counts")
    )
    return p


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data) // 2 + 8, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def txn_commits(table: Path) -> dict[tuple[str, int], list[int]]:
    """(appId, txnVersion) -> the Delta versions whose commit carries that app transaction,
    read from the table's ``_delta_log`` JSON files (Delta's own record, not ours)."""
    out: dict[tuple[str, int], list[int]] = {}
    for f in sorted((table / "_delta_log").glob("[0-9]*.json")):
        for line in f.read_text().splitlines():
            txn = json.loads(line).get("txn") if line.strip() else None
            if txn:
                out.setdefault((txn["appId"], int(txn["version"])), []).append(int(f.stem))
    return out


def fallback_run(seen: dict):
    """The oracle's chaos run: a whole run, the two newest manifests damaged, a restore of
    ``latest`` whose first manifest attempt crashes (so recovery meets the rolled-back tables
    a second time), then on to the end."""
    def run(p, chk, failing):
        if not failing:
            return sim_run(p, chk)
        first = sim_run(p, chk)
        damaged = sorted(first.completed_epochs)[-1:]
        assert len(first.completed_epochs) >= 3, first.completed_epochs
        for epoch in damaged:
            flip_bytes(Path(chk) / f"chk-{epoch}" / "_metadata.json")
        seen["damaged"] = damaged
        return sim_run(p, chk, restore="latest", failures=FailureSchedule(fail_points={"before_manifest": {1}}))

    return run


@pytest.mark.parametrize(("mode", "state_backend"), [("aligned", "delta"), ("tracker", "delta"),
                                                     ("aligned", "files")])
def test_fallback_restore_rolls_delta_sink_and_state_back_without_reusing_a_txn_version(mode, state_backend,
                                                                                          tmp_path):
    seen: dict = {}
    report = check_exactly_once(lambda: delta_count(mode, state_backend), fallback_run(seen), tmp_path)
    assert report.ok, report.to_json()
    assert report.lost == report.duplicated == 0 and report.records_committed == N
    assert report.restarts >= 1  # the crash before the first new manifest
    restored = min(seen["damaged"]) - 1
    sink_table = tmp_path / "chaos" / "out" / "counts"
    state_table = Path(DeltaCheckpointStorage(tmp_path / "chaos" / "chk").table_path("count"))
    for table in (sink_table, state_table) if state_backend == "delta" else (sink_table,):
        rollbacks = [h for h in history(str(table)) if h["operation"] == "RESTORE"]
        assert len(rollbacks) == 1, (table, rollbacks)  # the second recovery found it done
        meta = rollbacks[0]["meta"]
        assert meta["epoch"] == restored and set(seen["damaged"]) <= set(meta["rolled_back"])
        txns = txn_commits(table)
        # (app, 0) is the table's creation and its properties, two commits by design (tables.create)
        reused = {k: v for k, v in txns.items() if len(v) > 1 and k[1] > 0}
        assert not reused, reused  # Delta skipped nothing and no transaction version names two contents
        # the replayed epochs were committed, under the new app id
        assert any(app == meta["epochstream"] and v > restored for app, v in txns), txns
    # the sink table's live epochs are exactly the completed checkpoints (the rolled-back ones are gone)
    completed = DeltaCheckpointStorage(tmp_path / "chaos" / "chk").list_checkpoints()
    assert [e for e, _v in DeltaSink(sink_table, SCHEMA).epochs()] == completed


def test_a_foreign_commit_after_the_restored_version_is_not_undone(tmp_path):
    """Rollback takes back only epochstream's own commits: another writer's is named, not undone."""
    from deltalake import write_deltalake

    sink = DeltaSink(tmp_path / "t", SCHEMA)
    sink.start("counts", "job", None)
    app = sink.manifest_entry("counts")["app_id"]
    for epoch in (1, 2):
        staged = sink.pre_commit("counts", 0, epoch, "a", [("k", epoch)])
        sink.commit_epoch("counts", epoch, [staged])
    v1 = version_of_epoch(str(tmp_path / "t"), app, 1)
    write_deltalake(str(tmp_path / "t"), pa.table({"key": ["x"], "n": [9]}), mode="append")  # someone else
    with pytest.raises(DeltaConflictError, match=rf"version {v1 + 2} \(WRITE\) was written by another writer"):
        sink.recover("counts", [], epoch=1)
    assert sorted(r["n"] for r in sink.read()) == [1, 2, 9]  # nothing was undone
