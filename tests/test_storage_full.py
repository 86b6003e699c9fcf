"""The checkpoint folder fills up (issue 14, faults beyond kills).

ENOSPC is injected in the storage layer (the local object store's writes; mounting a small
tmpfs needs privileges this test cannot assume): for a window of writes the device is full,
then space is free again. The job must fail over with an error that says so, leave every
completed checkpoint intact (the oracle reads each one) and no partial files behind, and
resume from the latest completed checkpoint once writes succeed, exactly once.
"""

from __future__ import annotations

import errno
import io
from functools import partial
from pathlib import Path

import pytest

from epochstream.backends import local as local_store
from epochstream.backends.objects import StorageFullError
from epochstream.oracle import check_exactly_once
from pipelines import SOURCE_RATE, sim_run, union_chain, without_fsync


class _FullDevice:
    """``open`` for the local store whose writes fail with ENOSPC for writes [first, last)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.writes, self.refused = first, last, 0, 0

    def __call__(self, path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        if "w" not in mode:
            return f
        self.writes += 1
        if not self.first <= self.writes < self.last:
            return f
        self.refused += 1
        device = self

        class Full(io.BufferedWriter):
            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

        f.close()
        device.last_path = path
        return Full(open(path, "wb"))


@pytest.fixture(autouse=True)
def _no_fsync():
    with without_fsync():
        yield


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_checkpoint_folder_full_fails_over_clearly_and_resumes_exactly_once(tmp_path, mode, monkeypatch):
    device = _FullDevice(first=12, last=16)
    results = {}

    def run(p, chk, failing):
        with pytest.MonkeyPatch.context() as mp:
            if failing:
                mp.setattr(local_store, "open", device, raising=False)
            results[failing] = sim_run(p, chk, seed=5, source_rate=SOURCE_RATE)
        return results[failing]

    build = partial(union_chain, n=300, emit_ids=True, parallelism=2, batch_size=3, interval=0.0005, mode=mode)
    report = check_exactly_once(build, run, tmp_path)
    chaos = results[True]
    assert device.refused == 4
    reasons = [f["reason"] for f in chaos.metrics["failovers"]]
    assert chaos.restarts >= 1 and any("no space left" in r for r in reasons), reasons
    assert report.ok, report.to_json()
    assert report.epochs_checked >= 2  # every completed checkpoint was read back and checked
    leftovers = [p for p in Path(tmp_path / "chaos").rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def test_storage_full_error_names_the_path_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setattr(local_store, "open", _FullDevice(1, 2), raising=False)
    store = local_store.LocalObjects(tmp_path)
    with pytest.raises(StorageFullError, match=r"no space left writing .*x\.bin \(3 bytes\).*free space") as info:
        store.put(tmp_path / "x.bin", b"abc")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert list(tmp_path.iterdir()) == []  # neither the object nor its temporary file
    store.put(tmp_path / "x.bin", b"abc")  # space is free again
    assert (tmp_path / "x.bin").read_bytes() == b"abc"


def test_a_streamed_file_on_a_full_device_leaves_nothing_and_goes_whole_once_space_is_free(tmp_path, monkeypatch):
    """``put_file`` (RocksDB's SST files, copied in chunks) fails like ``put`` on a full device,
    and once space is free the object is the file, byte for byte."""
    src = tmp_path / "src" / "000012.sst"
    src.parent.mkdir()
    src.write_bytes(bytes(range(256)) * (3 * local_store.COPY_CHUNK // 256 + 7))  # several chunks
    store = local_store.LocalObjects(tmp_path / "store")
    dest = store.root / "shared" / "000012.sst"
    monkeypatch.setattr(local_store, "open", _FullDevice(1, 2), raising=False)
    with pytest.raises(StorageFullError, match=rf"000012\.sst \({src.stat().st_size} bytes\)"):
        store.put_file(dest, src)
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []
    store.put_file(dest, src)
    back = tmp_path / "back.sst"
    store.get_file(dest, back)
    assert back.read_bytes() == src.read_bytes() == dest.read_bytes()
    with pytest.raises(local_store.ObjectMissingError, match="none.sst does not exist"):
        store.get_file(dest.parent / "none.sst", tmp_path / "none.sst")
