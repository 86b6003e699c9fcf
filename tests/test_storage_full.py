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
