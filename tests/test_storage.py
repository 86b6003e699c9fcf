"""The local checkpoint storage (backends/local.py): state files, manifests, retention."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream.backends.local import METADATA, LocalCheckpointStorage
from epochstream.snapshot.manifest import (
    FORMAT,
    FORMAT_VERSION,
    AckInfo,
    CheckpointError,
    ManifestBuilder,
    StateFileRef,
    encode_manifest,
)

JOB = {"job": "storage-test", "parallelism": 1, "max_parallelism": 128, "mode": "aligned", "deployment": "sim"}

ROWS = [
    (0, b"k1", "count", b"\x80\x04K\x01."),
    (5, b"k2", "count", None),  # tombstone
    (127, b"", "seen", b"\x00\xff"),
    (64, "ключ".encode(), "état", b"v"),
]


def rows_of(table) -> list[tuple]:
    cols = [table.column(n).to_pylist() for n in ("key_group", "key", "state", "value")]
    return list(zip(*cols, strict=True))


def manifest(storage: LocalCheckpointStorage, epoch: int, files: list[StateFileRef], **extra) -> dict:
    """A real manifest, assembled the way the job master does (full captures only)."""
    builder = ManifestBuilder(JOB)
    ops = {f.operator for f in files}
    info = AckInfo((0, 0), epoch, tuple(files), chains={op: (epoch,) for op in ops},
                   kinds={op: {"count": "value"} for op in ops}, offsets={"src": {0: epoch * 10}})
    return builder.build(epoch, "checkpoint", {(0, 0): info}, extra)


def write(storage, op="count-op", subtask=0, epoch=1, attempt="0", rows=ROWS, kgr=(0, 127), full=True):
    return storage.write_state(op, subtask, epoch, attempt, list(rows), kgr, full)


@pytest.fixture
def storage(tmp_path):
    return LocalCheckpointStorage(tmp_path / "chk")


# ---------------------------------------------------------------- state files


def test_state_file_round_trip(storage):
    ref = write(storage, epoch=3, attempt="x7")
    assert ref.path == "shared/count-op/0/e3-ax7.parquet"
    path = storage.root / ref.path
    assert path.is_file()
    assert ref.bytes == path.stat().st_size and ref.rows == len(ROWS)
    assert (ref.operator, ref.subtask, ref.epoch, ref.key_group_range, ref.full) == ("count-op", 0, 3, (0, 127), True)
    assert rows_of(storage.read_state(ref)) == ROWS
    # the reference survives its JSON form (it lives in the manifest)
    assert StateFileRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_a_save_delay_still_writes_the_same_state_file(tmp_path, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("epochstream.backends.local.time.sleep", slept.append)
    delayed = LocalCheckpointStorage(tmp_path / "chk", save_delay=0.25)
    ref = write(delayed, epoch=3, attempt="x7")
    assert slept == [0.25]  # one sleep per state save, of the configured length
    assert rows_of(delayed.read_state(ref)) == ROWS
    assert LocalCheckpointStorage(tmp_path / "chk2").save_delay == 0.0
    with pytest.raises(ValueError, match="save_delay"):
        LocalCheckpointStorage(tmp_path / "chk3", save_delay=-1)


def test_empty_state_file_round_trip(storage):
    ref = write(storage, rows=[])
    assert ref.rows == 0
    assert rows_of(storage.read_state(ref)) == []


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 32767),
            st.binary(max_size=20),
            st.text(min_size=1, max_size=8),
            st.none() | st.binary(max_size=40),
        ),
        max_size=30,
    )
)
def test_state_file_round_trip_property(rows):
    with tempfile.TemporaryDirectory() as d:
        s = LocalCheckpointStorage(d)
        ref = write(s, rows=rows, kgr=(0, 32767))
        assert rows_of(s.read_state(ref)) == rows


def test_flipped_byte_is_reported_with_the_file_path(storage):
    ref = write(storage)
    path = storage.root / ref.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as ei:
        storage.read_state(ref)
    assert str(path) in str(ei.value) and "damaged" in str(ei.value) and "count-op" in str(ei.value)


def test_truncated_state_file_is_reported_with_the_file_path(storage):
    ref = write(storage)
    path = storage.root / ref.path
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as ei:
        storage.read_state(ref)
    msg = str(ei.value)
    assert str(path) in msg and str(ref.bytes) in msg and str(ref.bytes - 10) in msg


def test_missing_state_file_is_reported_with_the_file_path(storage):
    ref = write(storage)
    path = storage.root / ref.path
    path.unlink()
    with pytest.raises(CheckpointError, match="missing") as ei:
        storage.read_state(ref)
    assert str(path) in str(ei.value)


def test_state_files_of_different_subtasks_epochs_and_attempts_do_not_collide(storage):
    refs = [
        write(storage, subtask=0, epoch=1, attempt="0", rows=ROWS[:1]),
        write(storage, subtask=1, epoch=1, attempt="0", rows=ROWS[1:2]),
        write(storage, subtask=0, epoch=2, attempt="0", rows=ROWS[2:3]),
        write(storage, subtask=0, epoch=1, attempt="1", rows=ROWS[3:]),
    ]
    assert len({r.path for r in refs}) == 4
    assert [rows_of(storage.read_state(r)) for r in refs] == [ROWS[:1], ROWS[1:2], ROWS[2:3], ROWS[3:]]


def test_distinct_operator_uids_get_distinct_state_files(storage):
    a = write(storage, op="count/op", rows=ROWS[:1])
    b = write(storage, op="count_op", rows=ROWS[1:])
    assert a.path != b.path
    assert rows_of(storage.read_state(a)) == ROWS[:1]


def test_read_operator_rows_applies_files_in_order_and_filters_key_groups(storage):
    full = write(storage, epoch=1, rows=[(1, b"a", "s", b"1"), (100, b"b", "s", b"2")], kgr=(0, 127))
    inc = write(storage, epoch=2, rows=[(1, b"a", "s", None), (100, b"b", "s", b"3")], kgr=(0, 127), full=False)
    m = manifest(storage, 2, [full])
    m["operators"]["count-op"]["files"] = [full.to_json(), inc.to_json()]
    rows = list(storage.read_operator_rows(m, storage.root, "count-op"))
    assert rows == [(1, b"a", "s", b"1"), (100, b"b", "s", b"2"), (1, b"a", "s", None), (100, b"b", "s", b"3")]
    assert list(storage.read_operator_rows(m, storage.root, "count-op", (64, 127))) == [
        (100, b"b", "s", b"2"), (100, b"b", "s", b"3")]
    assert list(storage.read_operator_rows(m, storage.root, "no-such-op")) == []


# ---------------------------------------------------------------- manifests


def unsealed(m: dict) -> dict:
    """A manifest as read, without the checksum the commit added."""
    return {k: v for k, v in m.items() if k != "checksum"}


def test_write_manifest_is_atomic_and_parses(storage):
    ref = write(storage)
    m = manifest(storage, 4, [ref])
    folder = storage.write_manifest(m)
    assert folder == storage.checkpoint_dir(4)
    assert sorted(p.name for p in folder.iterdir()) == [METADATA]  # no temp file left behind
    assert unsealed(json.loads((folder / METADATA).read_text())) == m
    # rewriting (a re-issued commit) still leaves exactly one well-formed file
    storage.write_manifest(m)
    assert sorted(p.name for p in folder.iterdir()) == [METADATA]
    loaded, root = storage.load_manifest(4)
    assert unsealed(loaded) == m and root == storage.root


def test_load_manifest_by_epoch_folder_or_file(storage):
    m = manifest(storage, 2, [write(storage, epoch=2)])
    folder = storage.write_manifest(m)
    for location in (2, folder, str(folder), folder / METADATA):
        loaded, root = storage.load_manifest(location)
        assert unsealed(loaded) == m and root == storage.root


def test_self_contained_savepoint_resolves_files_against_its_own_folder(storage, tmp_path):
    m = manifest(storage, 2, [], self_contained=True)
    sp = tmp_path / "savepoints" / "sp-1"
    sp.mkdir(parents=True)
    (sp / METADATA).write_bytes(encode_manifest(m))
    loaded, root = storage.load_manifest(sp)
    assert loaded["self_contained"] is True and root == sp


def _put(storage, epoch: int, text: str | bytes) -> Path:
    d = storage.checkpoint_dir(epoch)
    d.mkdir(parents=True, exist_ok=True)
    p = d / METADATA
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def _valid_text(storage, epoch) -> str:
    return json.dumps(manifest(storage, epoch, []), indent=1, sort_keys=True)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("garbage", "corrupt or truncated"),
        ("truncated", "corrupt or truncated"),
        ("empty", "corrupt or truncated"),
        ("list", "not an epochstream checkpoint manifest"),
        ("other-json", "not an epochstream checkpoint manifest"),
        ("version-999", "format version 999 is not supported"),
        ("no-operators", "lacks 'operators'"),
    ],
)
def test_load_manifest_rejects_bad_content_with_a_clear_message(storage, case, fragment):
    valid = _valid_text(storage, 3)
    text = {
        "garbage": "{this is not json",
        "truncated": valid[: len(valid) // 2],
        "empty": "",
        "list": "[1, 2, 3]",
        "other-json": json.dumps({"hello": "world"}),
        "version-999": json.dumps({**json.loads(valid), "format_version": 999}),
        "no-operators": json.dumps({k: v for k, v in json.loads(valid).items() if k != "operators"}),
    }[case]
    path = _put(storage, 3, text)
    with pytest.raises(CheckpointError) as ei:
        storage.load_manifest(3)
    msg = str(ei.value)
    assert str(path) in msg and fragment in msg, msg


def test_version_message_names_the_supported_version(storage):
    _put(storage, 1, json.dumps({**json.loads(_valid_text(storage, 1)), "format_version": 999}))
    with pytest.raises(CheckpointError, match=f"written by a newer epochstream; this epochstream reads versions "
                                              f"1 to {FORMAT_VERSION}"):
        storage.load_manifest(1)


def test_load_manifest_of_a_directory_without_metadata(storage, tmp_path):
    root_like = tmp_path / "not-a-checkpoint"
    (root_like / "chk-1").mkdir(parents=True)
    with pytest.raises(CheckpointError) as ei:
        storage.load_manifest(root_like)
    msg = str(ei.value)
    assert str(root_like) in msg and METADATA in msg and "not a checkpoint" in msg


def test_load_manifest_of_a_missing_checkpoint(storage):
    with pytest.raises(CheckpointError, match="does not exist") as ei:
        storage.load_manifest(42)
    assert str(storage.checkpoint_dir(42) / METADATA) in str(ei.value)


def test_manifest_with_invalid_utf8_is_a_checkpoint_error_and_skipped_by_latest(storage):
    storage.write_manifest(manifest(storage, 1, []))
    raw = _valid_text(storage, 2).encode()
    _put(storage, 2, raw[:10] + b"\xff\xfe" + raw[12:])  # a few flipped bits on disk
    with pytest.raises(CheckpointError):
        storage.load_manifest(2)
    assert storage.latest()[0]["epoch"] == 1


def test_storage_root_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        LocalCheckpointStorage(f)


# ---------------------------------------------------------------- listing and latest


def test_list_checkpoints_orders_numerically_and_ignores_other_folders(storage):
    for e in (10, 9, 2):
        storage.write_manifest(manifest(storage, e, []))
    storage.checkpoint_dir(11).mkdir()  # no manifest yet: not a checkpoint
    (storage.root / "chk-x").mkdir()
    (storage.root / "savepoint-3").mkdir()
    assert storage.list_checkpoints() == [2, 9, 10]


def test_latest_returns_none_for_an_empty_or_missing_dir(tmp_path):
    assert LocalCheckpointStorage(tmp_path / "nothing-here").latest() is None
    assert LocalCheckpointStorage(tmp_path).latest() is None


def test_latest_skips_a_corrupt_newest_manifest(storage):
    storage.write_manifest(manifest(storage, 1, []))
    storage.write_manifest(manifest(storage, 2, []))
    _put(storage, 3, _valid_text(storage, 3)[:-20])  # torn write of the newest
    _put(storage, 4, json.dumps({"format": FORMAT, "format_version": 999}))
    m, root = storage.latest()
    assert m["epoch"] == 2 and root == storage.root


def test_latest_is_none_when_every_manifest_is_damaged(storage):
    _put(storage, 1, "{")
    _put(storage, 2, "[]")
    assert storage.latest() is None


# ---------------------------------------------------------------- retention


def _names(storage) -> set[str]:
    shared = storage.root / "shared"
    return {p.relative_to(storage.root).as_posix() for p in shared.rglob("*") if p.is_file()}


def test_collect_garbage_keeps_retained_and_future_files(storage):
    e1 = write(storage, epoch=1)
    e2 = write(storage, epoch=2)
    e3 = write(storage, epoch=3)
    e4 = write(storage, epoch=4)
    other = write(storage, op="other", subtask=1, epoch=2)
    retained = [manifest(storage, 1, [e1]), manifest(storage, 3, [e3])]
    removed = storage.collect_garbage(retained, keep_after=3)
    assert removed == 2
    assert _names(storage) == {e1.path, e3.path, e4.path}
    assert not (storage.root / e2.path).exists() and not (storage.root / other.path).exists()
    assert storage.collect_garbage(retained, keep_after=3) == 0  # idempotent


def test_collect_garbage_keeps_every_file_a_chained_manifest_names(storage):
    full = write(storage, epoch=1)
    inc = write(storage, epoch=2, full=False)
    m = manifest(storage, 2, [inc])
    m["operators"]["count-op"]["files"] = [full.to_json(), inc.to_json()]
    assert storage.collect_garbage([m], keep_after=2) == 0
    assert _names(storage) == {full.path, inc.path}


def test_collect_garbage_without_shared_folder(storage):
    assert storage.collect_garbage([], keep_after=0) == 0


def test_remove_orphans_deletes_everything_not_named(storage):
    live = write(storage, epoch=1)
    later = write(storage, epoch=5)  # a capture of an epoch that never completed
    tmp = storage.root / "shared" / "count-op" / "0" / ".e6-a0.parquet.tmp-123"
    tmp.write_bytes(b"half")
    removed = storage.remove_orphans([manifest(storage, 1, [live])])
    assert removed == 2
    assert _names(storage) == {live.path}
    assert not (storage.root / later.path).exists() and not tmp.exists()


def test_discard_removes_the_checkpoint_folder(storage):
    storage.write_manifest(manifest(storage, 1, []))
    storage.write_manifest(manifest(storage, 2, []))
    storage.discard(1)
    storage.discard(99)  # nothing there: fine
    assert storage.list_checkpoints() == [2]
    assert not os.path.exists(storage.checkpoint_dir(1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 127), st.binary(max_size=6), st.sampled_from(["a", "b"]),
                          st.one_of(st.none(), st.binary(max_size=6))), max_size=40))
def test_columnar_capture_rows_encode_as_their_row_tuples(rows):
    """A heap capture's columns (``ColumnRows``, encoded from one join per column) give the same
    Parquet table as the same rows as tuples; runs of one state name are kept in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from epochstream.backends.objects import encode_state_counted
    from epochstream.runtime.messages import ColumnRows

    rows = sorted(rows, key=lambda r: r[2])  # the heap captures state by state
    states = [(name, sum(1 for r in rows if r[2] == name)) for name in ("a", "b") if any(r[2] == name for r in rows)]
    cols = ColumnRows([r[0] for r in rows], [r[1] for r in rows], states, [r[3] for r in rows])
    assert list(cols) == rows and len(cols) == len(rows)
    data, count = encode_state_counted(cols)
    want, _ = encode_state_counted(list(rows))
    assert count == len(rows)
    assert pq.read_table(pa.BufferReader(data)).equals(pq.read_table(pa.BufferReader(want)))


def test_parquet_table_holds_no_reference_to_the_callers_bytes():
    """``pq.read_table(pa.BufferReader(data))`` left ``data`` referenced by an Arrow pool thread
    after the read returned (26 of 200 reads here). At interpreter exit that thread's release
    needs the GIL, and the process aborted ("terminate called without an active exception",
    apache/arrow#34314; it failed CI). ``parquet_table`` reads a copy in the calling thread:
    the caller's bytes are never referenced once it returns."""
    import sys

    from epochstream.backends.objects import encode_state, parquet_table

    rows = [(g, f"k{g}".encode(), "count", b"v") for g in range(50)]
    data = encode_state(rows)
    lingering = 0
    for _ in range(200):
        before = sys.getrefcount(data)
        table = parquet_table(data)
        lingering += sys.getrefcount(data) > before
        assert table.num_rows == len(rows)
        del table
    assert lingering == 0
