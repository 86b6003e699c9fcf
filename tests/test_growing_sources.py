"""Growing sources (``Source.grows``: a Kafka topic's new partitions), without a broker: which
subtask takes a new split and from where, after a fresh start and after a restore, and that a
restore accepts a checkpoint with fewer splits than the source now has. The real-broker test
is tests/test_kafka.py::test_partitions_added_while_running_are_read_exactly_once."""

from __future__ import annotations

import pytest

from epochstream.runtime.reader import SplitReader
from epochstream.runtime.sources import Source
from epochstream.snapshot.manifest import CheckpointError


class _Growing(Source):
    """Unbounded splits of numbers; ``add()`` creates a split (``discover`` takes it in)."""

    grows = True

    def __init__(self, splits: int, start: int = 0) -> None:
        self.num_splits = splits
        self.data: list[list[int]] = [list(range(100 * s, 100 * s + 10)) for s in range(splits)]
        self.pending = 0
        self.start = start
        self.looks = 0

    def add(self) -> None:
        self.data.append(list(range(100 * len(self.data), 100 * len(self.data) + 10)))
        self.pending += 1

    def discover(self, now: float, force: bool = False) -> None:
        self.looks += 1
        self.num_splits += self.pending
        self.pending = 0

    def split_length(self, split: int):
        return None

    def start_offset(self, split: int) -> int:
        return self.start  # "latest"-like for the splits known when built

    def discovered_start_offset(self, split: int) -> int:
        return 0

    def read(self, split, offset, count):
        return self.data[split][offset:offset + count]


def _drain(reader: SplitReader) -> list[int]:
    out: list[int] = []
    for _ in range(8):
        for _label, records, _offset in reader.read(100, 0.0):
            out.extend(records)
    return out


def test_each_new_split_goes_to_the_subtask_that_owns_its_index():
    sources = [_Growing(2) for _ in range(2)]  # one copy per worker, as after unpickling
    readers = [SplitReader(src, "g", [s for s in range(2) if s % 2 == i], {}, None, owner=(i, 2))
               for i, src in enumerate(sources)]
    assert sorted(_drain(readers[0]) + _drain(readers[1])) == list(range(10)) + list(range(100, 110))
    for src in sources:
        src.add()
        src.add()
    got = [_drain(r) for r in readers]
    assert got[0] == list(range(200, 210)) and got[1] == list(range(300, 310))
    assert readers[0].splits == [0, 2] and readers[1].splits == [1, 3]
    assert readers[0].offsets == {0: 10, 2: 10}


def test_subtasks_sharing_one_source_object_both_take_their_new_splits():
    src = _Growing(2)
    readers = [SplitReader(src, "g", [i], {}, None, owner=(i, 2)) for i in range(2)]
    for r in readers:
        _drain(r)
    src.add()
    src.add()
    assert _drain(readers[0]) == list(range(200, 210))  # its discover takes in both splits
    assert _drain(readers[1]) == list(range(300, 310))  # the other reader still sees split 3 as new


def test_a_restore_resumes_named_splits_and_reads_newer_ones_from_their_beginning():
    src = _Growing(3, start=5)
    reader = SplitReader(src, "g", [0, 1, 2], {0: 7, 1: 2}, None, owner=(0, 1))
    assert reader.offsets == {0: 7, 1: 2, 2: 0}  # split 2 is newer than the checkpoint
    fresh = SplitReader(_Growing(3, start=5), "g", [0, 1, 2], {}, None, owner=(0, 1))
    assert fresh.offsets == {0: 5, 1: 5, 2: 5}  # a fresh start uses the source's start
    grown = SplitReader(src, "g", [0], {0: 7, 3: 4}, None, owner=(0, 1))
    src.add()
    _drain(grown)
    assert grown.offsets[3] == 10  # the restored offset of a split added later: 4 -> read to the end


def test_restore_checks_accept_fewer_splits_only_for_growing_sources():
    from epochstream import Pipeline
    from epochstream.deploy.restore import resolve_sources

    class _Plan:
        parallelism = 2

    growing = _Growing(4)
    p = Pipeline("g")
    p.from_source(growing, uid="g")
    resolve_sources(_Plan(), p, _restored({"g": 2}))
    assert growing.num_splits == 4
    fixed = _Growing(4)
    fixed.grows = False
    q = Pipeline("f")
    q.from_source(fixed, uid="f")
    with pytest.raises(CheckpointError, match="4 splits, the checkpoint 2"):
        resolve_sources(_Plan(), q, _restored({"f": 2}))


def _restored(splits: dict[str, int]):
    from epochstream.deploy.restore import Restored

    manifest = {"sources": {uid: {"offsets": {str(s): 0 for s in range(n)}, "splits": n} for uid, n in splits.items()}}
    return Restored(1, manifest, None, None)
