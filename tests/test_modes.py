"""The snapshot modes and fail points are enums whose members equal the words users write."""

from __future__ import annotations

import pytest

from epochstream import Pipeline
from epochstream.runtime.modes import MODE_NAMES, SnapshotMode, implications
from epochstream.snapshot.failpoints import COMMIT_POINTS, FailPointName


def test_every_mode_name_is_a_member_and_the_api_takes_both():
    assert MODE_NAMES == ("aligned", "at-least-once", "tracker", "unaligned")
    for name in MODE_NAMES:
        assert Pipeline("p", mode=name).mode is SnapshotMode(name) == name
        assert Pipeline("p", mode=SnapshotMode(name)).mode == name


def test_an_unknown_mode_is_a_value_error_naming_the_modes():
    with pytest.raises(ValueError, match="mode must be one of .*'at-least-once'.*got 'exactly-twice'"):
        Pipeline("p", mode="exactly-twice")
    p = Pipeline("p")
    with pytest.raises(ValueError, match="got 'exactly-twice'"):
        p.mode = "exactly-twice"
    assert p.mode is SnapshotMode.ALIGNED


@pytest.mark.parametrize("mode, exactly_once, tracks, overtakes, times_out", [
    ("aligned", True, False, False, True),
    ("unaligned", True, False, True, True),
    ("tracker", True, True, False, False),
    ("at-least-once", False, False, False, False),
])
def test_what_each_mode_implies(mode, exactly_once, tracks, overtakes, times_out):
    i = implications(mode)
    assert (i.exactly_once, i.tracks, i.overtakes, i.times_out_alignment) == (exactly_once, tracks, overtakes,
                                                                              times_out)
    assert SnapshotMode(mode).implies is i


def test_aligned_timeout_needs_a_mode_that_times_out():
    with pytest.raises(ValueError, match="needs mode 'aligned' or 'unaligned', not 'tracker'"):
        Pipeline("p", mode="tracker", aligned_timeout=1.0)
    assert Pipeline("p", mode="unaligned", aligned_timeout=1.0).aligned_timeout == 1.0


def test_fail_points_match_the_strings_of_a_schedule():
    schedule = {"mid_commit": {3}, "recovery": {1}}
    assert schedule.get(FailPointName.MID_COMMIT) == {3}
    assert {str(p) for p in COMMIT_POINTS} == {"before_manifest", "after_manifest", "mid_commit", "after_commit",
                                               "recovery"}
    assert f"crash at {FailPointName.COMPACTION}" == "crash at compaction"
