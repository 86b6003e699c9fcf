"""Incremental RocksDB checkpoints (``backends/rocksdb_checkpoint.py``): SST files uploaded once,
shared by the checkpoints that need them, collected when none does, verified on restore.

Exactly-once under failures (kills, fail points around the manifest, writers dying mid-upload)
is in ``test_exactly_once.py::test_exactly_once_with_incremental_rocksdb_checkpoints``; rescaling
from such a checkpoint in ``test_rescale.py::test_rescale_from_an_incremental_rocksdb_checkpoint``.
"""

from __future__ import annotations

import collections
import pickle
import re
from pathlib import Path

import pytest

from epochstream.backends import open_storage, rocksdb_checkpoint
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.backends.rocksdb_state import RocksDBKeyedState
from epochstream.cli import build_parser
from epochstream.runtime.state import ValueStateDescriptor
from epochstream.snapshot.manifest import CheckpointError, StateFileRef
from pipelines import ROCKSDB_TEST_DIR, check_running_counts, committed_output, running_count, sim_run, without_fsync

N = 600


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def _rocks_refs(m: dict) -> list[StateFileRef]:
    return [StateFileRef.from_json(f) for op in m["operators"].values() for f in op["files"]
            if f.get("format") == "rocksdb"]


def _job(tmp_path: Path, **knobs):
    p = running_count(n=N, keys=11, out=tmp_path / "out", emit_ids=True, parallelism=2,
                      state_backend_type="rocksdb", **knobs)
    p.checkpoint.num_retained = 2
    return p


def test_sst_files_are_shared_between_epochs_and_collected_when_no_checkpoint_needs_them(tmp_path):
    p = _job(tmp_path)
    result = sim_run(p, tmp_path / "chk", seed=4)
    assert len(result.completed_epochs) >= 6
    assert check_running_counts(committed_output(tmp_path / "out" / "counts"), set(range(N))) == []
    storage = LocalCheckpointStorage(tmp_path / "chk")
    epochs = storage.list_checkpoints()
    assert len(epochs) == 2, "retention keeps num_retained checkpoints"
    manifests = [storage.load_manifest(e)[0] for e in epochs]
    shared = [{f.path for r in _rocks_refs(m) for f in r.shared} for m in manifests]
    assert shared[0] and shared[1]

    def reused(m: dict) -> bool:  # a shared file's name starts with the epoch that uploaded it
        return any(int(re.match(r"e(\d+)-", Path(f).name).group(1)) < int(m["epoch"])  # type: ignore[union-attr]
                   for f in {f.path for r in _rocks_refs(m) for f in r.shared})

    # a retained checkpoint refers to SST files an earlier epoch uploaded (not both need to: a
    # compaction right before a capture rewrites every file, and RocksDB compacts when it likes)
    reusing = [m for m in manifests if reused(m)]
    assert reusing, shared
    refs = _rocks_refs(reusing[-1])
    # that epoch uploaded less than it refers to: the rest was uploaded by earlier epochs
    assert sum(r.written for r in refs) < sum(r.bytes + sum(f.bytes for f in r.shared) for r in refs)
    # garbage collection: every SST file on disk is named by a retained checkpoint
    on_disk = {s.relative_to(storage.root).as_posix() for s in storage.root.rglob("*.sst")}
    assert on_disk == shared[0] | shared[1]
    # and the files of the newest checkpoint give the committed state back
    counts = collections.Counter()
    for _kg, kb, _name, vb in storage.read_operator_rows(manifests[1], storage.root, "count"):
        counts[pickle.loads(kb)] = pickle.loads(vb)
    assert sum(counts.values()) == N


def test_no_incremental_writes_rows_instead_of_sst_files(tmp_path):
    sim_run(_job(tmp_path, incremental=False), tmp_path / "chk", seed=4)
    m, _root = LocalCheckpointStorage(tmp_path / "chk").latest()
    assert not _rocks_refs(m) and all(f["full"] for f in m["operators"]["count"]["files"])
    assert not list((tmp_path / "chk").rglob("*.sst"))


def test_cli_flag_switches_incremental_checkpoints():
    ap = build_parser()
    assert ap.parse_args(["run", "x:y", "--no-incremental"]).incremental is False
    assert ap.parse_args(["run", "x:y", "--incremental"]).incremental is True
    assert ap.parse_args(["run", "x:y"]).incremental is None


def _one_checkpoint(tmp_path: Path) -> tuple[LocalCheckpointStorage, dict, StateFileRef]:
    storage = LocalCheckpointStorage(tmp_path / "chk")
    b = RocksDBKeyedState("op", lambda k: k % 16, (0, 15), local_dir=ROCKSDB_TEST_DIR, sst_incremental=True)
    h = b.handle(ValueStateDescriptor("v"))
    for k in range(500):
        b.keys.key = k
        h.update(k * 2)
    kc = b.capture(1)
    ref = storage.pre_commit("op", 0, 1, "t", kc.rows, kc.key_group_range, kc.full)
    b.close()
    return storage, {"operators": {"op": {"files": [ref.to_json()]}}}, ref


def test_a_damaged_or_missing_sst_file_is_named(tmp_path):
    storage, m, ref = _one_checkpoint(tmp_path)
    rows = list(storage.read_operator_rows(m, storage.root, "op"))
    assert sorted(pickle.loads(r[1]) for r in rows) == list(range(500))
    assert {pickle.loads(r[3]) for r in rows if pickle.loads(r[1]) == 7} == {14}
    sst = storage.root / ref.shared[0].path
    data = sst.read_bytes()
    sst.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(CheckpointError, match=re.escape(str(sst)) + ".*sha256"):
        list(storage.read_operator_rows(m, storage.root, "op"))
    sst.unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(sst)) + " of operator 'op' .*is missing"):
        list(storage.read_operator_rows(m, storage.root, "op"))


@pytest.mark.parametrize("in_process", [True, False])
def test_key_group_filter_reads_only_the_requested_range(tmp_path, monkeypatch, in_process):
    """In a process that uses RocksDB, and through the reader process in one that does not (a
    job master: it forks workers later); a read stopped early leaves the reader ready for the next."""
    storage, m, _ref = _one_checkpoint(tmp_path)
    monkeypatch.setattr(rocksdb_checkpoint, "_USED_HERE", in_process)
    rows = list(storage.read_operator_rows(m, storage.root, "op", (4, 6)))
    assert rows and {r[0] for r in rows} == {4, 5, 6}
    assert sorted(pickle.loads(r[1]) for r in rows) == [k for k in range(500) if 4 <= k % 16 <= 6]
    it = iter(storage.read_operator_rows(m, storage.root, "op"))
    assert [next(it)[0] for _ in range(3)] == [0, 0, 0]
    it.close()  # type: ignore[attr-defined]
    assert len(list(storage.read_operator_rows(m, storage.root, "op"))) == 500


def test_incremental_rocksdb_checkpoints_on_s3(s3_url, tmp_path):
    """The same files on S3 (moto's server): shared SST objects under ``shared/``, restore from them."""
    p = _job(tmp_path)
    sim_run(p, s3_url, seed=5, duration=0.004)
    storage = open_storage(s3_url)
    m, root = storage.latest()
    refs = _rocks_refs(m)
    assert refs and all(f.path.startswith("shared/") and f.path.endswith(".sst") for r in refs for f in r.shared)
    consumed = sum(m["sources"]["src"]["offsets"].values())
    assert 0 < consumed < N
    sim_run(_job(tmp_path), s3_url + "-2", seed=6, restore=str(storage.checkpoint_dir(m["epoch"])))
    assert check_running_counts(committed_output(tmp_path / "out" / "counts"), set(range(N))) == []


def test_the_local_driver_refuses_rocksdb_in_a_process_that_already_opened_one(tmp_path, monkeypatch):
    """RocksDB's background threads do not survive fork: workers forked from a process that
    opened a DB hang on their own DBs. A clear error instead of workers that stop heartbeating."""
    from epochstream.runtime.errors import ConfigurationError

    monkeypatch.setattr(rocksdb_checkpoint, "_USED_HERE", True)
    p = running_count(n=50, out=tmp_path / "out", parallelism=2, state_backend_type="rocksdb")
    with pytest.raises(ConfigurationError, match="do not survive fork.*fresh process"):
        p.run(deployment="local", checkpoint_dir=str(tmp_path / "chk"))
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_restore_opens_the_checkpoint_as_its_db_and_the_next_capture_uploads_only_new_files(tmp_path):
    """Flink's RocksDB restore: the checkpoint's files become the DB (no rows re-inserted), key
    groups outside the new range are deleted, and when the checkpoint is the job's own the files
    are shared on: the first capture after the restore uploads only what was written since."""
    storage, m, ref1 = _one_checkpoint(tmp_path)
    assert storage.native_checkpoint(m, storage.root, "op", (0, 15)) is not None
    # a range that the one file does not cover, or rows, are read as rows instead
    assert storage.native_checkpoint({"operators": {"op": {"files": []}}}, storage.root, "op", (0, 15)) is None
    assert storage.native_checkpoint(m, storage.root, "op", (8, 20)) is None

    def restored(key_groups, reuse):
        b = RocksDBKeyedState("op", lambda k: k % 16, key_groups, local_dir=ROCKSDB_TEST_DIR, sst_incremental=True)
        # an operator's open() declares its states before the restore: first "t" (id 0), then "v" (id 1),
        # where the checkpoint has "v" as id 0; the handles must follow the checkpoint's ids
        early = (b.handle(ValueStateDescriptor("t")), b.handle(ValueStateDescriptor("v")))
        ref, handle, base = storage.native_checkpoint(m, storage.root, "op", key_groups)
        b.restore_checkpoint(storage.store, base, ref, handle, {"v": "value"}, reuse_files=reuse)
        return b, early

    b, (t, h) = restored((0, 15), reuse=True)
    assert b.as_dict() == {"v": {k: k * 2 for k in range(500)}}
    b.keys.key = 7
    assert h.value() == 14 and t.value() is None  # the handle declared before the restore reads the DB
    t.update("t7")
    assert h.value() == 14 and t.value() == "t7"
    w = b.handle(ValueStateDescriptor("w"))  # a state declared after the restore gets a fresh id
    for k in range(3):
        b.keys.key = k
        h.update(-k)
        w.update("new")
    kc = b.capture(2)
    ref2 = storage.pre_commit("op", 0, 2, "t", kc.rows, kc.key_group_range, kc.full)
    old = {f.path for f in ref1.shared}
    assert old <= {f.path for f in ref2.shared}, "the restored checkpoint's SST files are shared on"
    uploaded = ref2.new_bytes - ref2.bytes  # less its handle
    assert 0 < uploaded == sum(f.bytes for f in ref2.shared if f.path not in old)
    m2 = {"operators": {"op": {"files": [ref2.to_json()]}}}
    rows = {(name, pickle.loads(kb)): pickle.loads(vb) for _kg, kb, name, vb in
            storage.read_operator_rows(m2, storage.root, "op")}
    assert rows == {**{("v", k): k * 2 for k in range(500)}, **{("v", k): -k for k in range(3)},
                    **{("w", k): "new" for k in range(3)}, ("t", 7): "t7"}
    b.close()

    # rescaled: only key groups 4..6 are left; not the job's own files: the next capture is full
    part, _handles = restored((4, 6), reuse=False)
    assert part.as_dict() == {"v": {k: k * 2 for k in range(500) if 4 <= k % 16 <= 6}}
    kc = part.capture(3)
    ref3 = storage.pre_commit("op", 0, 3, "t", kc.rows, kc.key_group_range, kc.full)
    assert not old & {f.path for f in ref3.shared} and ref3.full
    part.close()
