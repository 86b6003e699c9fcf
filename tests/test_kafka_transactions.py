"""The bookkeeping of a Kafka sink subtask's transactions (``backends.kafka.transactions``),
driven alone: which slot holds which epoch, what a completed epoch commits, and what recovery
produces again. Sans-IO, so no broker: the real sink (tests/test_kafka.py) and the simulator's
model (tests/test_kafka_model.py) carry the same actions out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream.backends.kafka.transactions import (
    Commit,
    Produce,
    ProduceCommit,
    SubtaskTransactions,
    staged_epoch_subtask,
    to_reproduce,
    transactional_id,
)
from epochstream.runtime.errors import ProtocolError


def test_an_epoch_waits_open_in_its_slot_and_commits_when_its_manifest_exists():
    t = SubtaskTransactions(slots=2)
    assert t.staged(1) == [Produce(0, 1)]
    assert t.staged(2) == [Produce(1, 2)]  # 1 is not committed yet: the next slot
    assert t.completed(1) == [Commit(0, 1)]
    assert t.staged(3) == [Produce(0, 3)]  # slot 0 is free again
    assert t.completed(3) == [Commit(1, 2), Commit(0, 3)]  # oldest first: the markers rise
    assert t.committed == 3 and not t.open
    t.check()


def test_with_every_slot_busy_an_epoch_is_deferred_and_produced_at_its_commit():
    t = SubtaskTransactions(slots=2)
    t.staged(1)
    t.staged(2)
    assert t.staged(3) == []  # deferred: staged only
    assert t.deferred == [3]
    assert t.completed(3) == [Commit(0, 1), Commit(1, 2), ProduceCommit(2, 3)]  # on the spare producer
    t.check()


def test_pre_commits_must_come_in_epoch_order():
    t = SubtaskTransactions()
    t.staged(5)
    with pytest.raises(ProtocolError, match="not newer"):
        t.staged(5)
    t.completed(5)
    with pytest.raises(ProtocolError):
        t.staged(3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stage", "complete"]), st.integers(0, 3)), max_size=40),
       st.integers(1, 3))
def test_every_staged_epoch_commits_once_in_order(steps, slots):
    """Whatever interleaving of pre-commits and completion notices (possibly late, possibly
    skipping aborted epochs): commits come in increasing epoch order,
    each staged epoch commits exactly once, and exactly the epochs up to the newest notice."""
    t = SubtaskTransactions(slots=slots)
    epoch, staged, committed, notice = 0, [], [], 0
    for kind, n in steps:
        if kind == "stage":
            epoch += 1 + n % 2  # aborted epochs leave gaps
            staged.append(epoch)
            acts = t.staged(epoch)
            assert all(type(a) is Produce for a in acts)
        elif kind == "complete":
            notice = max(notice, min(epoch, notice + n))
            acts = t.completed(notice)
            assert all(type(a) in (Commit, ProduceCommit) for a in acts)
            committed += [a.epoch for a in acts]
        t.check()
    assert committed == sorted(committed) and len(committed) == len(set(committed))
    assert committed == [e for e in staged if e <= notice]


def test_names_and_the_recovery_plan():
    assert transactional_id("p-", "out", 3, 1) == "p-out-3-1"
    assert staged_epoch_subtask("_staging/out/e12-s3-a1.2.msgs") == (12, 3)
    staged = ["_staging/out/e5-s0-ax.msgs", "_staging/out/e6-s0-ax.msgs", "_staging/out/e6-s1-ax.msgs",
              "_staging/out/e4-s2-ax.msgs"]
    # subtask 0 has 5 in Kafka, subtask 1 nothing, subtask 2 (a rescaled-away one) has 4
    assert to_reproduce(staged, {0: 5, 2: 4}) == {0: [(6, "_staging/out/e6-s0-ax.msgs")],
                                                 1: [(6, "_staging/out/e6-s1-ax.msgs")]}
    with pytest.raises(ValueError, match="not a staged"):
        staged_epoch_subtask("_staging/out/other.txt")
