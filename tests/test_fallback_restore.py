"""Sinks after a fallback restore (issue 14, finding 3).

When the newest checkpoint's manifest is damaged after its epoch committed, recovery restores
the one before it and replays the damaged epoch's input. A FileSink must take back (set aside)
the committed parts of epochs after the restored one, or the replay duplicates them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epochstream.backends.sinks import ROLLED_BACK, FileSink
from epochstream.deploy.restore import Restored, RollbackError, roll_back_newer_output
from pipelines import check_running_counts, committed_output, running_count, sim_run, without_fsync

N = 400


@pytest.fixture(autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def flip_bytes(path: Path) -> None:
    """Damage a file in place: invert a few bytes in its middle."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + 8, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_restore_latest_after_a_damaged_newest_manifest_does_not_duplicate_output(tmp_path):
    out, chk = tmp_path / "out", tmp_path / "chk"
    first = sim_run(running_count(n=N, parallelism=3, emit_ids=True, out=out, interval=0.002), chk)
    epochs = first.completed_epochs
    assert len(epochs) >= 3
    newest = max(epochs)
    flip_bytes(chk / f"chk-{newest}" / "_metadata.json")
    before = committed_output(out / "counts")
    assert check_running_counts(before, set(range(N))) == []

    second = sim_run(running_count(n=N, parallelism=2, emit_ids=True, out=out, interval=0.002), chk,
                     restore="latest")
    assert second.restarts == 0
    records = committed_output(out / "counts")
    assert check_running_counts(records, set(range(N))) == []  # every id once, counts 1..n per key
    aside = list((out / "counts" / ROLLED_BACK).glob("*/part-*.jsonl"))
    assert aside and all(f"-e{newest:08d}-" in p.name for p in aside)
    assert any(p.name.startswith(f"chk-{newest}.damaged-") for p in chk.iterdir())


class _AppendOnly:
    """A sink that can say which later epochs it committed but not take them back."""

    def __repr__(self) -> str:
        return "AppendOnly()"

    def committed_epochs_after(self, uid, epoch):
        return [e for e in (3, 4) if e > epoch]


def test_a_sink_that_cannot_roll_back_makes_recovery_refuse_naming_the_epochs(tmp_path):
    restored = Restored(2, {"sinks": {}}, tmp_path, tmp_path / "chk-2")
    with pytest.raises(RollbackError, match=r"epochs \[3, 4\].*'t'.*new sink location"):
        roll_back_newer_output({"t": _AppendOnly()}, restored)
    roll_back_newer_output({"t": _AppendOnly()}, Restored(4, {"sinks": {}}, tmp_path, tmp_path / "chk-4"))


def test_roll_back_moves_only_this_sinks_newer_parts(tmp_path):
    sink = FileSink(tmp_path)
    for e in (1, 2, 3):
        for uid in ("a", "b"):
            (tmp_path / f"part-e{e:08d}-{uid}-s0.jsonl").write_text(json.dumps([uid, e]) + "\n")
    assert sink.roll_back("a", 1) == [2, 3]
    assert sorted(p.name for p in tmp_path.glob("part-*")) == [
        "part-e00000001-a-s0.jsonl", "part-e00000001-b-s0.jsonl", "part-e00000002-b-s0.jsonl",
        "part-e00000003-b-s0.jsonl"]
    assert sink.roll_back("a", 1) == []
