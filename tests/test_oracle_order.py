"""The oracle on order-dependent pipelines (issue 14, finding 1), and the bugs it must still catch.

``union_chain(emit_ids=True)`` merges two sources (one rebalanced) into a keyed running count
whose output carries each record's id, so which id gets which count depends on arrival order:
a correct chaos run differs from the failure-free run. The strict comparison (what the oracle
did before) calls that loss and duplication; the recorded-order comparison replays the
reference in the order the committed epochs processed each key and passes it. Three planted
bugs must still fail it: a record dropped on replay, a record's state update applied twice,
and the output of an aborted epoch committed by recovery.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from epochstream.backends.sinks import FileSink
from epochstream.deploy import driver as driver_module
from epochstream.oracle import check_exactly_once
from epochstream.recorded_order import Recording, record_id
from epochstream.runtime.messages import Batch
from epochstream.runtime.reader import SplitReader
from epochstream.runtime.task import ConsumingTask
from pipelines import SOURCE_RATE as RATE
from pipelines import sim_run, union_chain, without_fsync

N = 300
SCENARIO = dict(parallelism=3, batch_size=3, interval=0.0005, n=N)


@pytest.fixture(autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def _kills():
    from epochstream.deploy.sim import FailureSchedule

    horizon = 1.2 * N / (SCENARIO["parallelism"] * RATE)
    return FailureSchedule(kill_times=[0.3 * horizon, 0.6 * horizon], write_failures={5},
                           fail_points={"after_manifest": {2}, "before_manifest": {3}})


def _oracle(work: Path, mode: str, compare: str = "recorded", sabotage=None, seed: int = 7):
    def run(p, chk, failing):
        with pytest.MonkeyPatch.context() as mp:
            if failing and sabotage is not None:
                sabotage(mp)
            return sim_run(p, chk, seed=seed, failures=_kills() if failing else None, source_rate=RATE)

    return check_exactly_once(partial(union_chain, mode=mode, emit_ids=True, **SCENARIO), run, work,
                              compare=compare)


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
def test_union_rebalance_running_count_with_ids_passes_in_recorded_order(tmp_path, mode):
    """Finding 1: the strict comparison (today's main) fails a correct run of an order-dependent
    pipeline; the recorded order passes it and reports the differing order, which is allowed."""
    strict = _oracle(tmp_path / "strict", mode, compare="strict")
    assert not strict.ok
    assert strict.lost > 0 and strict.duplicated > 0
    assert any("differs from the sequential reference" in e for e in strict.examples)

    report = _oracle(tmp_path / "recorded", mode)
    assert report.ok, report.to_json()
    assert report.compare == "recorded"
    assert report.restarts >= 3
    assert report.lost == report.duplicated == report.inputs_lost == report.inputs_duplicated == 0
    assert report.mismatched_state == report.mismatched_epoch_output == 0
    assert report.records_committed == report.records_expected > N
    assert report.order_differs > 0  # the runs did process keys in different orders
    assert report.epochs_checked >= 2


# ---------------------------------------------------------------- planted bugs


def _after_restore(mp) -> dict:
    """Patch the driver's restore lookup to flag when an attempt restores a checkpoint."""
    flag = {"restored": 0}
    real = driver_module.find_restore

    def spy(storage, restore):
        r = real(storage, restore)
        if r is not None:
            flag["restored"] += 1
        return r

    mp.setattr(driver_module, "find_restore", spy)
    return flag


def _drop_a_record_on_replay(mp) -> None:
    """After every restore, the first read of a source task loses its first record (the offset
    still advances past it)."""
    flag = _after_restore(mp)
    real = SplitReader.read
    done: set[int] = {0}

    def read(self, budget, *args, **kwargs):
        runs = real(self, budget, *args, **kwargs)
        if flag["restored"] not in done and runs and runs[0][1]:
            done.add(flag["restored"])
            label, records, offset = runs[0]
            runs = [(label, records[1:], offset + 1), *runs[1:]]
        return runs

    mp.setattr(SplitReader, "read", read)


def _apply_an_update_twice(mp) -> None:
    """After every restore, one batch reaching a keyed task is processed twice."""
    flag = _after_restore(mp)
    real = ConsumingTask.receive
    done: set[int] = {0}

    def receive(self, channel, message):
        real(self, channel, message)
        if (flag["restored"] not in done and type(message) is Batch and message.records
                and not self.is_source):
            done.add(flag["restored"])
            real(self, channel, message)

    mp.setattr(ConsumingTask, "receive", receive)


def _commit_aborted_epochs(mp) -> None:
    """Recovery also publishes the staged output of epochs the failover aborted, under part
    names that carry the attempt (as a sink naming files per task attempt would)."""
    real = FileSink.recover

    def recover(self, uid, committed):
        keep = set(committed)
        for key in list(self.store.keys(self.path, "_staging/")):
            if key.endswith(".jsonl") and key not in keep:
                attempt = key.rsplit("-a", 1)[1][: -len(".jsonl")].replace(".", "_")
                final = self.final_name(key).replace(".jsonl", f"-a{attempt}.jsonl")
                self.store.put(self.path / final, self.store.get(self.path / key))
        real(self, uid, committed)

    mp.setattr(FileSink, "recover", recover)


@pytest.mark.parametrize("sabotage", [_drop_a_record_on_replay, _apply_an_update_twice, _commit_aborted_epochs])
def test_recorded_order_still_catches_planted_bugs(tmp_path, sabotage):
    report = _oracle(tmp_path, "aligned", sabotage=sabotage)
    assert not report.ok, report.to_json()
    if sabotage is _drop_a_record_on_replay:
        assert report.inputs_lost > 0 or report.lost > 0
    else:
        assert report.inputs_duplicated > 0 or report.duplicated > 0
    assert report.mismatched_state + report.mismatched_epoch_output > 0


# ---------------------------------------------------------------- pieces


def test_record_id_is_equal_for_equal_records_and_keeps_sequence_order():
    assert record_id({"b": 1, "a": {3, 1, 2}}) == record_id({"a": {2, 3, 1}, "b": 1})
    assert record_id(("k", [1, 2])) != record_id(("k", [2, 1]))
    assert record_id(1) != record_id(1.0) != record_id(True)
    hash(record_id(("k", {"x": [1, (2, 3)]})))


def test_recording_wrapper_logs_before_output_and_delegates(tmp_path):
    from pipelines import RunningCount

    class Ctx:
        key = "k"

    rec = Recording(RunningCount())
    assert rec.uses_event_time is False and rec.inner.emit_ids is False
    import copy
    import pickle

    assert isinstance(copy.deepcopy(rec), Recording)
    assert isinstance(pickle.loads(pickle.dumps(rec)), Recording)
