"""Bounded out-of-orderness and idleness (``runtime.watermarks``): the pure rule, the reader's
promises, and end to end in the simulator (late records dropped, counted, watermark state in
the manifest). The exactly-once oracle under failures runs over the out-of-order pipeline in
tests/test_event_time.py (``window_counts_out_of_order`` in its ``BUILDERS``)."""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epochstream import FileSink, JobFailedError, OutputTag, Pipeline
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.runtime.reader import SplitReader
from epochstream.runtime.sources import CollectionSource, Source
from epochstream.runtime.watermarks import LateRecord, SplitWatermarks

sys.path.insert(0, str(Path(__file__).parent))
from event_time_pipelines import (  # noqa: E402
    MAX_DELAY,
    expected_late,
    expected_window_counts,
    on_time,
    window_counts,
    window_input,
)
from pipelines import committed_output, sim_run  # noqa: E402

stamps = st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=60)


# ================================================================ the rule (pure)


@given(ts=stamps, delay=st.sampled_from([0.0, 0.5, 2.0, 7.5]), slack=st.sampled_from([0.25, 1.0, 3.0]))
def test_admitted_records_never_fall_at_or_below_a_promise_made_before_them(ts, delay, slack):
    """The promise of a split (its bound - 1) only grows, and nothing admitted afterwards has
    a label at or below it: that is what lets windows fire on it."""
    w = SplitWatermarks(slack, delay, [0])
    promised = -1
    for t in ts:
        label = int(t // slack)
        if w.admit(0, t, label, -1):
            assert label > promised
        assert w.bound(0) - 1 >= promised
        promised = w.bound(0) - 1


@given(ts=stamps, delay=st.sampled_from([0.0, 0.5, 2.0, 7.5]), slack=st.sampled_from([0.25, 1.0, 3.0]))
def test_a_record_within_the_delay_of_the_newest_is_never_dropped(ts, delay, slack):
    w = SplitWatermarks(slack, delay, [0])
    newest = -math.inf
    dropped = 0
    for t in ts:
        kept = w.admit(0, t, int(t // slack), -1)
        if t >= newest - delay:
            assert kept, (t, newest, delay)
        newest = max(newest, t) if kept else newest
        dropped += not kept
    assert w.late == dropped  # every dropped record is counted


@given(ts=stamps, cut=st.integers(0, 60), delay=st.sampled_from([0.0, 1.5, 4.0]))
def test_a_restore_from_the_state_decides_exactly_as_an_uninterrupted_run(ts, cut, delay):
    """The manifest keeps ``state()``; a reader restored from it drops the same records."""
    whole = SplitWatermarks(1.0, delay, [0, 1])
    decisions = [whole.admit(i % 2, t, int(t), -1) for i, t in enumerate(ts)]
    first = SplitWatermarks(1.0, delay, [0, 1])
    cut = min(cut, len(ts))
    before = [first.admit(i % 2, t, int(t), -1) for i, t in enumerate(ts[:cut])]
    restored = SplitWatermarks(1.0, delay, [0, 1], restored=first.state())
    after = [restored.admit(i % 2, t, int(t), -1) for i, t in enumerate(ts[cut:], start=cut)]
    assert before + after == decisions
    assert first.late + restored.late == whole.late


def test_idleness_starts_counting_at_the_first_question_and_ends_with_a_record():
    w = SplitWatermarks(1.0, 0.0, [0, 1], idleness=5.0)
    assert not w.idle(1, 100.0)  # the clock starts now, not at 0
    assert not w.idle(1, 104.9)
    assert w.idle(1, 105.0)
    w.touched(1, 106.0)
    assert not w.idle(1, 110.0)
    assert not SplitWatermarks(1.0, 0.0, [0]).idle(0, 1e9)  # without idleness never


@pytest.mark.parametrize("delay,idleness", [(-1.0, None), (1.0, 0.0)])
def test_bad_bounds_are_refused(delay, idleness):
    with pytest.raises(ValueError):
        SplitWatermarks(1.0, delay, [0], idleness=idleness)


# ================================================================ the reader


class _Feed(Source):
    """Unbounded splits whose records the test appends (no I/O)."""

    def __init__(self, splits: int) -> None:
        self.num_splits = splits
        self.data: list[list[float]] = [[] for _ in range(splits)]

    def split_length(self, split: int):
        return None

    def read(self, split, offset, count):
        return self.data[split][offset:offset + count]


def _reader(feed: _Feed, delay: float, idleness: float | None, restored=None, late_output=False) -> SplitReader:
    feed.timestamp = float
    feed.max_out_of_orderness = delay
    feed.idleness = idleness
    feed.late_output = late_output
    return SplitReader(feed, "feed", list(range(feed.num_splits)), {}, 1.0, restored)


def _drain(reader: SplitReader, now: float) -> list[float]:
    out = []
    for _ in range(reader.source.num_splits):
        for _label, records, _offset in reader.read(100, now):
            out.extend(records)
    return out


@given(ts=stamps, delay=st.sampled_from([0.0, 1.5, 4.0]), cut=st.integers(1, 20))
def test_the_readers_inlined_rule_keeps_what_the_rule_keeps(ts, delay, cut):
    """The reader applies ``SplitWatermarks.admit`` inlined, in reads of ``cut`` records."""
    feed = _Feed(1)
    feed.data[0] = list(ts)
    reader = _reader(feed, delay, None)
    kept: list[float] = []
    while reader.offsets[0] < len(ts):
        for _label, records, _offset in reader.read(cut, 0.0):
            kept.extend(records)
    rule = SplitWatermarks(1.0, delay, [0])
    assert kept == [t for t in ts if rule.admit(0, t, int(t), -1)]
    assert reader.late_records == rule.late and reader.watermarks.state() == rule.state()


@given(ts=stamps, delay=st.sampled_from([0.0, 1.5, 4.0]), cut=st.integers(1, 20))
def test_a_side_output_reader_sends_on_exactly_the_late_records_above_every_promise(ts, delay, cut):
    """With ``late_records=<tag>`` the reader keeps what the rule keeps and wraps what it
    drops, in offset order; every run's offset is its first record's, and a late record's
    label is above everything promised before it (so no watermark or trAcker promise breaks)."""
    feed = _Feed(1)
    feed.data[0] = list(ts)
    reader = _reader(feed, delay, None, late_output=True)
    rule = SplitWatermarks(1.0, delay, [0])
    seen: list[float] = []
    while reader.offsets[0] < len(ts):
        promised = reader.time_promised
        for label, records, offset in reader.read(cut, 0.0):
            assert label > promised
            for i, r in enumerate(records):
                value = r.record if type(r) is LateRecord else r
                assert value == ts[offset + i]  # the run's offset names its records
                seen.append(r)
        reader.next_time_promise(0.0)
    want = [t if rule.admit(0, t, int(t), -1) else LateRecord(t) for t in ts]
    assert seen == want
    assert reader.late_records == 0 and reader.late_sent == rule.late


def test_runs_name_their_offsets_after_dropped_late_records():
    feed = _Feed(1)
    feed.data[0] = [10.0, 2.0, 11.0, 3.0, 12.5]
    reader = _reader(feed, 1.0, None)
    assert reader.read(10, 0.0) == [(10, [10.0], 0), (11, [11.0], 2), (12, [12.5], 4)]


def test_the_source_watermark_is_the_minimum_over_its_splits():
    feed = _Feed(2)
    reader = _reader(feed, 2.0, None)
    feed.data[0] += [10.0, 12.5]
    _drain(reader, 0.0)
    assert reader.next_time_promise(0.0) is None  # split 1 has said nothing: it holds time back
    feed.data[1] += [7.0]
    _drain(reader, 0.0)
    assert reader.next_time_promise(0.0) == 4  # split 1: floor(7 - 2) - 1; split 0 would allow 9
    feed.data[1] += [30.0]
    _drain(reader, 0.0)
    assert reader.next_time_promise(0.0) == 9


def test_an_idle_split_stops_holding_time_back_and_its_late_records_are_dropped():
    feed = _Feed(2)
    reader = _reader(feed, 1.0, idleness=5.0)
    feed.data[0] += [20.0]
    feed.data[1] += [3.0]
    _drain(reader, 0.0)
    assert reader.next_time_promise(0.0) == 1  # split 1 bounds it: floor(3 - 1) - 1
    feed.data[0] += [40.0]
    _drain(reader, 4.0)
    assert reader.next_time_promise(4.0) is None  # split 1 is quiet, not yet idle
    _drain(reader, 6.0)
    assert reader.next_time_promise(6.0) == 38  # split 1 idle: split 0 alone
    feed.data[1] += [4.0, 39.5]  # split 1 wakes up: 4.0 is behind the promise, 39.5 is not
    kept = _drain(reader, 7.0)
    assert kept == [39.5]
    assert reader.late_records == 1
    assert reader.next_time_promise(7.0) is None  # split 1 active again, at 38.5 - 1 -> 37 < 38


def test_when_every_split_is_idle_the_splits_that_brought_records_decide():
    feed = _Feed(3)
    reader = _reader(feed, 0.0, idleness=1.0)
    assert reader.next_time_promise(0.0) is None  # nothing read, nothing known
    assert reader.next_time_promise(5.0) is None  # all idle, none brought a record: still nothing
    feed.data[0] += [9.0]
    feed.data[1] += [5.0]
    _drain(reader, 6.0)
    assert reader.next_time_promise(6.0) == 4  # splits 0 and 1 active (min 5 - 1); 2 idle, never read
    feed.data[0] += [12.0]
    _drain(reader, 6.5)
    assert reader.next_time_promise(6.5) is None  # split 1 still holds it at 4
    assert reader.next_time_promise(7.2) == 11  # split 1 idle now: split 0 alone
    assert reader.next_time_promise(10.0) is None  # all quiet: min over 0 and 1 is 4, below 11
    feed.data[1] += [6.0, 20.0]  # split 1 wakes up behind the promise: 6.0 is late
    assert _drain(reader, 11.0) == [20.0]
    assert reader.next_time_promise(11.0) == 19  # split 0 idle: split 1 alone decides (Flink's idleness)
    feed.data[0] += [15.0]  # so split 0's next record is late when it wakes
    assert _drain(reader, 11.5) == []
    assert reader.late_records == 2


def test_a_restored_reader_resumes_its_split_watermarks():
    feed = _Feed(1)
    reader = _reader(feed, 2.0, None, restored={0: 50.0})
    assert reader.next_time_promise(0.0) == 47
    feed.data[0] += [10.0, 49.0]
    assert _drain(reader, 0.0) == [49.0]


# ================================================================ end to end (simulator)


MODES = ["aligned", "unaligned", "tracker"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parallelism", [1, 3])
def test_late_records_are_dropped_counted_and_the_rest_counted_once(mode, parallelism, tmp_path):
    n = 400
    p = window_counts(parallelism=parallelism, n=n, out=tmp_path / "out", mode=mode, out_of_order=True)
    result = sim_run(p, tmp_path / "chk", seed=parallelism)
    got = collections.Counter(tuple(r) for r in committed_output(tmp_path / "out" / "windows"))
    assert got == expected_window_counts(n, out_of_order=True, parallelism=parallelism)
    kept = on_time(window_input(n, 7, out_of_order=True), parallelism, MAX_DELAY)
    assert sorted(tuple(r) for r in committed_output(tmp_path / "out" / "kept")) == sorted(kept)
    late = n - len(kept)
    assert late > 0
    assert result.metrics["late_records_dropped"] == late  # no failures: nothing read twice


@pytest.mark.parametrize("mode", MODES)
def test_late_records_go_to_the_side_output_and_the_rest_to_the_windows(mode, tmp_path):
    n, parallelism = 400, 2
    p = window_counts(parallelism=parallelism, n=n, out=tmp_path / "out", mode=mode, out_of_order=True,
                      late_side_output=True)
    result = sim_run(p, tmp_path / "chk", seed=3)
    got = collections.Counter(tuple(r) for r in committed_output(tmp_path / "out" / "windows"))
    assert got == expected_window_counts(n, out_of_order=True, parallelism=parallelism)
    late = collections.Counter(tuple(r) for r in committed_output(tmp_path / "out" / "late"))
    assert late == expected_late(n, parallelism=parallelism) and late
    kept = on_time(window_input(n, 7, out_of_order=True), parallelism, MAX_DELAY)
    assert sorted(tuple(r) for r in committed_output(tmp_path / "out" / "kept")) == sorted(kept)
    assert result.metrics["late_records_dropped"] == 0  # sent on, not dropped


def test_a_sink_as_late_records_writes_them_under_the_sources_uid(tmp_path):
    data = [(0, 10.0), (1, 2.0), (2, 11.0), (3, 12.0)]
    p = Pipeline("late-sink", parallelism=1, mode="aligned")
    s = p.from_collection(data, timestamps=lambda r: r[1], uid="src", max_out_of_orderness=1.0,
                          late_records=FileSink(tmp_path / "late"))
    s.sink(FileSink(tmp_path / "main"), uid="main")
    assert "src-late" in p.sinks
    sim_run(p, tmp_path / "chk", seed=0)
    assert [tuple(r) for r in committed_output(tmp_path / "late")] == [(1, 2.0)]
    assert sorted(tuple(r) for r in committed_output(tmp_path / "main")) == [(0, 10.0), (2, 11.0), (3, 12.0)]


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_records_a_window_drops_as_late_are_counted_in_the_metric(mode, tmp_path):
    """``WindowAggregateFunction.late_records`` (a map moved a timestamp behind the window's
    watermark) reaches ``late_records_dropped`` beside the source's drops, as Flink's window
    operator counts ``numLateRecordsDropped``."""
    from epochstream import TumblingEventTimeWindows

    data = [(i, i * 0.3) for i in range(400)]
    p = Pipeline("window-late", parallelism=1, mode=mode, batch_size=16)
    (p.from_collection(data, timestamps=lambda r: r[1], uid="src")
     .map(lambda r: (r[0], 0.0 if r[0] == 300 else r[1]))
     .key_by(lambda r: 0)
     .window(TumblingEventTimeWindows.of(10.0, lambda r: r[1])).count(uid="win")
     .sink(FileSink(tmp_path / "o"), uid="o"))
    result = sim_run(p, tmp_path / "chk", seed=0)
    assert result.metrics["late_records_dropped"] == 1
    assert sum(r[3] for r in committed_output(tmp_path / "o")) == 399


def test_late_records_option_is_checked_when_the_pipeline_is_built():
    p = Pipeline("x")
    with pytest.raises(ValueError, match="needs max_out_of_orderness"):
        p.from_collection([1.0], timestamps=float, late_records=OutputTag("late"))
    with pytest.raises(ValueError, match="must be 'drop', an OutputTag or a sink"):
        p.from_collection([1.0], timestamps=float, max_out_of_orderness=1.0, late_records="keep")
    s = p.from_collection([1.0], timestamps=float, max_out_of_orderness=1.0, late_records=OutputTag("late"))
    with pytest.raises(ValueError, match="no side output 'other'"):
        s.get_side_output(OutputTag("other"))
    assert s.get_side_output(OutputTag("late")) is s.get_side_output(OutputTag("late"))


def test_a_user_function_error_names_the_offset_of_its_record_after_late_records(tmp_path):
    """The offset the error names is the record's own, not shifted by the late records
    dropped before it in the same read (the reader's runs carry their offsets)."""

    def boom(r):
        if r[0] == 5:
            raise RuntimeError("boom")
        return r

    data = [(0, 10.0), (1, 2.0), (2, 3.0), (3, 11.0), (4, 1.0), (5, 12.0)]
    p = Pipeline("late-offset", parallelism=1, mode="aligned")
    p.restart_attempts = 0
    s = p.from_collection(data, timestamps=lambda r: r[1], uid="src", max_out_of_orderness=1.0)
    s.map(boom, name="boom").sink(FileSink(tmp_path / "o"), uid="o")
    with pytest.raises(JobFailedError, match=r"read from source 'src' split 0 offset 5\)"):
        sim_run(p, tmp_path / "chk", seed=0)


def test_manifests_hold_each_splits_newest_timestamp(tmp_path):
    """Where a restore resumes the watermarks: per split, the newest timestamp among the
    records before the split's offset."""
    n, parallelism = 400, 2
    p = window_counts(parallelism=parallelism, n=n, out=tmp_path / "out", mode="aligned", out_of_order=True)
    sim_run(p, tmp_path / "chk", seed=1)
    data = window_input(n, 7, out_of_order=True)
    storage = LocalCheckpointStorage(tmp_path / "chk")
    checked = 0
    for epoch in storage.list_checkpoints():
        manifest, _root = storage.load_manifest(epoch)
        src = manifest["sources"]["events"]
        for split, offset in src["offsets"].items():
            part = data[int(split)::parallelism][:offset]
            if part:
                assert src["max_timestamps"][split] == max(r[2] for r in part)
                checked += 1
    assert checked >= 4


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_tasks_built_from_a_checkpoint_resume_its_split_watermarks(mode, tmp_path):
    """The restore path (``deploy.assembly.build_tasks``) hands each reader its splits' newest
    timestamps from the manifest, at the checkpoint's parallelism and at another one."""
    from epochstream.deploy.assembly import build_tasks
    from epochstream.deploy.restore import Restored
    from epochstream.tracker.local import LocalTracker

    p = window_counts(parallelism=2, n=400, out=tmp_path / "out", mode="aligned", out_of_order=True)
    sim_run(p, tmp_path / "chk", seed=1)
    storage = LocalCheckpointStorage(tmp_path / "chk")
    epoch = storage.list_checkpoints()[len(storage.list_checkpoints()) // 2]
    manifest, root = storage.load_manifest(epoch)
    want = {int(k): v for k, v in manifest["sources"]["events"]["max_timestamps"].items()}
    assert want
    for parallelism in (2, 3):
        again = window_counts(parallelism=parallelism, n=400, out=tmp_path / "out2", mode=mode, out_of_order=True)
        plan = again.plan()
        trackers = {w: LocalTracker(w) for w in range(parallelism)} if mode == "tracker" else None
        tasks = build_tasks(again, plan, None, storage, Restored(epoch, manifest, root, root / f"chk-{epoch}"),
                            trackers=trackers)
        got: dict[int, float] = {}
        for task in tasks.values():
            if task.reader is not None and task.reader.watermarks is not None:
                got.update(task.reader.watermarks.state())
        assert got == want


def test_max_out_of_orderness_needs_timestamps():
    with pytest.raises(ValueError, match="need timestamps"):
        Pipeline("x").from_collection([1, 2], max_out_of_orderness=1.0)
    with pytest.raises(ValueError, match="max_out_of_orderness must be"):
        Pipeline("x").from_collection([1, 2], timestamps=float, max_out_of_orderness=-1)


def test_without_a_bound_decreasing_timestamps_are_still_refused_and_the_option_is_named(tmp_path):
    p = Pipeline("strict", parallelism=1, mode="aligned")
    s = p.from_collection([(0, 5.0), (1, 1.0)], timestamps=lambda r: r[1], uid="src")
    s.sink(__import__("epochstream").FileSink(tmp_path / "o"), uid="o")
    with pytest.raises(Exception, match="max_out_of_orderness"):
        sim_run(p, tmp_path / "chk", seed=0)


def test_idleness_alone_means_monotonous_timestamps():
    src = CollectionSource([1], 1)
    Pipeline("x").from_source(src, timestamps=float, idleness=3.0)
    assert src.max_out_of_orderness == 0.0 and src.idleness == 3.0
