"""The batching policy (``runtime.batching``): ``Pipeline(batch_rows=, batch_linger=)``.

* a ``Task`` driven by hand with its own clock: without a linger every step sends all its
  output (as before the policy); with one, a channel is sent once it holds ``batch_rows``
  rows, the rest when the oldest row waited ``linger`` seconds, and an epoch bound sends
  everything before its marker (aligned) or its promise (trAcker);
* the trAcker's chain rule under a partial flush: the RCVs of the input wait for the rest
  of the output it caused;
* whole runs on the simulator and the local driver: source reads never exceed
  ``batch_rows``, a keyed batch function sees many rows per key per call, and the counts are
  exact. The exactly-once oracle suites draw a linger too (tests/test_exactly_once.py, ``Chaos``).
"""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pytest

from epochstream import Pipeline
from epochstream.api.pipeline import CheckpointConfig
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.backends.sinks import FileSink
from epochstream.deploy.assembly import build_tasks
from epochstream.graph.keygroups import assign_to_key_group, default_max_parallelism, key_group_table
from epochstream.runtime.batching import BatchPolicy
from epochstream.runtime.chain import OutputBuffers
from epochstream.runtime.messages import Batch, Marker, Send
from epochstream.runtime.tracking import TaskTracking, Tracked
from pipelines import committed_output, sim_run
from test_task_parts import _Recorder


class Passthrough:
    """A keyed ``process`` that forwards every record."""

    def open(self, ctx: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def process(self, value: Any, ctx: Any) -> Any:
        return (value,)


def _tasks(tmp_path, rows: int, linger: float):
    """The source task of: 0..999 (one split) keyed into a pass-through operator at
    parallelism 2, even records to subtask 0 and odd ones to subtask 1, so its output buffers
    are two hash channels filling alike."""
    p = Pipeline("batching", parallelism=2, batch_rows=rows, batch_linger=linger)
    m = default_max_parallelism(2)
    table = key_group_table(m, 2)
    by_subtask = {table[assign_to_key_group(k, m)]: k for k in range(50)}
    keys = (by_subtask[0], by_subtask[1])  # even records go to subtask 0, odd ones to subtask 1
    p.from_collection(list(range(1000)), splits=1, uid="src").key_by(lambda x: keys[x % 2]).process(
        Passthrough(), uid="pass")
    plan = p.plan()
    tasks = build_tasks(p, plan, None, LocalCheckpointStorage(tmp_path / "chk"), None)
    source = next(t for t in tasks.values() if t.is_source and t.reader is not None and t.reader.splits)
    return source


def _sent(actions: list[Any]) -> list[tuple[int, Any]]:
    return [(a.channel, a.message) for a in actions if type(a) is Send]


def test_without_a_linger_every_step_sends_everything(tmp_path):
    src = _tasks(tmp_path, rows=100, linger=0.0)
    sent = _sent(src.step(0.0, budget=10))
    assert sorted(len(m) for _c, m in sent) == [5, 5]  # both channels, at once
    assert src.flush_deadline() is None
    src.check_invariants()


def test_a_channel_is_sent_when_it_holds_batch_rows_rows(tmp_path):
    src = _tasks(tmp_path, rows=8, linger=10.0)
    assert _sent(src.step(0.0, budget=6)) == []  # 3 + 3 rows wait
    assert src.flush_deadline() == 10.0
    src.check_invariants()
    assert _sent(src.step(0.1, budget=6)) == []  # 6 + 6
    sent = _sent(src.step(0.2, budget=6))  # 9 + 9: both full
    assert sorted(len(m) for _c, m in sent) == [9, 9]
    assert src.flush_deadline() is None
    # rows keep their order per channel
    even = next(m for _c, m in sent if m.records[0] % 2 == 0)
    assert even.records == list(range(0, 18, 2))
    src.check_invariants()


def test_a_full_channel_leaves_alone_and_the_rest_waits(tmp_path):
    src = _tasks(tmp_path, rows=4, linger=10.0)
    out = src.chain.out
    ch_even, ch_odd = sorted(out.records)
    out.records[ch_even].extend([0, 2, 4])  # as if an earlier step had buffered uneven output
    out.keys[ch_even].extend([0, 0, 0])
    src._pending_since = 0.0
    sent = _sent(src.step(1.0, budget=2))  # one more row each: even holds 4 (full), odd 1
    assert [(c, m.records) for c, m in sent] == [(ch_even, [0, 2, 4, 0])]
    assert out.fill() == {ch_odd: 1}
    assert src.flush_deadline() == 10.0  # the waiting row's clock did not restart
    src.check_invariants()


def test_the_linger_sends_what_waited_long_enough(tmp_path):
    src = _tasks(tmp_path, rows=1000, linger=0.5)
    assert _sent(src.step(1.0, budget=4)) == []
    assert _sent(src.step(1.2, budget=4)) == []
    assert src.flush_deadline() == 1.5
    sent = _sent(src.step(1.5, budget=4))  # the deadline: everything, 6 + 6 rows
    assert sorted(len(m) for _c, m in sent) == [6, 6]
    assert src.flush_deadline() is None
    assert _sent(src.step(1.6, budget=2)) == []  # a new wait starts with the next rows
    assert src.flush_deadline() == pytest.approx(2.1)


def test_a_throttled_source_still_sends_when_the_linger_is_up(tmp_path):
    src = _tasks(tmp_path, rows=1000, linger=0.5)
    src.step(0.0, budget=4)
    assert _sent(src.step(0.2, budget=4, read_source=False)) == []
    assert sorted(len(m) for _c, m in _sent(src.step(0.5, budget=4, read_source=False))) == [2, 2]


def test_an_epoch_bound_cuts_the_batch_before_its_marker(tmp_path):
    src = _tasks(tmp_path, rows=1000, linger=100.0)
    src.step(0.0, budget=10)
    src.trigger(1)
    actions = src.step(0.1, budget=10)
    sent = _sent(actions)
    # the 10 rows of epoch 1 leave before marker 1 on each channel; the 10 read after wait in epoch 2
    batches = [(c, m) for c, m in sent if type(m) is Batch]
    markers = [(c, m) for c, m in sent if type(m) is Marker]
    assert sorted(len(m) for _c, m in batches) == [5, 5] and {m.epoch for _c, m in batches} == {1}
    assert len(markers) == 2 and all(sent.index(b) < sent.index(mk) for b in batches for mk in markers
                                     if b[0] == mk[0])
    assert src.epoch == 2 and src.chain.out.pending() == 10


def test_a_dry_source_sends_everything(tmp_path):
    src = _tasks(tmp_path, rows=5000, linger=100.0)
    sent = _sent(src.step(0.0, budget=5000))
    assert sum(len(m) for _c, m in sent) == 1000 and src.flush_deadline() is None


def test_a_partial_flush_reports_the_sends_but_not_yet_their_cause():
    out = OutputBuffers([7, 8], keyed=set())
    rec = _Recorder()
    p = Tracked(out, TaskTracking(rec, segment=2, out_segment={7: 5, 8: 6}, ids=itertools.count(100)))
    out.records[7].extend(["a", "b"])
    out.records[8].append("c")
    received = [Batch(3, ["cause"], id=42)]
    actions: list[Any] = []
    p.flush(3, 0, received, actions, only=[7])
    assert [(a.channel, a.message.records) for a in actions] == [(7, ["a", "b"])]
    assert rec.calls == [("snd", 100, 3, 5, 0)] and received  # the RCV waits for channel 8
    p.flush(3, 0, received, actions)
    assert rec.calls[1:] == [("snd", 101, 3, 6, 0), ("rcv", 42, 3, 2, 0)] and received == []


def test_output_buffers_fill_counts_rows_and_columns():
    out = OutputBuffers([1, 2, 3], keyed=set())
    out.records[1].extend([{"k": 1}] * 3)
    out.add_columns(2, pa.record_batch({"k": [1, 2]}))
    out.records[2].append({"k": 3})
    assert out.fill() == {1: 3, 2: 3}
    drained = out.drain(1, 0, only=[2])
    assert [(c, len(b)) for c, b in drained] == [(2, 2), (2, 1)] and out.fill() == {1: 3}


@pytest.mark.parametrize("rows, linger, error", [
    (0, 0.0, ValueError), (-3, 0.0, ValueError), (2.5, 0.0, TypeError), (True, 0.0, TypeError),
    (10, -0.001, ValueError), (10, float("nan"), ValueError), (10, float("inf"), ValueError), (10, "5ms", TypeError),
])
def test_out_of_range_knobs_are_refused(rows, linger, error):
    with pytest.raises(error, match="batch_rows" if error is TypeError and not isinstance(linger, str) or rows != 10
                       else "batch_linger"):
        Pipeline("bad", batch_rows=rows, batch_linger=linger)
    with pytest.raises(error):
        BatchPolicy(rows, linger)


def test_batch_size_is_the_former_name_of_batch_rows():
    assert Pipeline("a", batch_size=64).batch_rows == 64
    assert Pipeline("b").batch_rows == 1024 and Pipeline("b").batch_linger == 0.0
    p = Pipeline("c", batch_rows=32)
    assert p.batch_size == 32
    p.batch_size = 16
    assert p.batching == BatchPolicy(16, 0.0)
    with pytest.raises(ValueError, match="former name"):
        Pipeline("d", batch_size=8, batch_rows=16)


# ---------------------------------------------------------------- whole runs


class CountBatches:
    """``process_batches``: a running count per key; emits (key, count, rows in this call)."""

    def open(self, ctx: Any) -> None:
        from epochstream.runtime.state import ValueStateDescriptor

        self.count = ctx.state(ValueStateDescriptor("n"))

    def process_batch(self, key: Any, batch: Any, ctx: Any) -> Any:
        n = (self.count.value() or 0) + batch.num_rows
        self.count.update(n)
        return pa.record_batch({"k": [key], "n": [n], "rows": [batch.num_rows]})


#: rows of every source read (the map_batches right after the source; the simulator runs in this process)
READS: list[int] = []


def _record_read(batch: Any) -> Any:
    READS.append(batch.num_rows)
    return batch


def _keyed_count(out, rows: int, linger: float, n: int = 20_000, keys: int = 10, interval: float = 0.002,
                 mode: str = "aligned") -> Pipeline:
    p = Pipeline("keyed-count", parallelism=2, mode=mode, batch_rows=rows, batch_linger=linger,
                 checkpoint=CheckpointConfig(interval=interval), restart_attempts=0)

    def gen(start: int, stop: int) -> Any:
        return pa.record_batch({"k": pa.array([i % keys for i in range(start, stop)], pa.int64())})

    (p.generate_batches(gen, count=n, uid="src", block_rows=256).map_batches(_record_read)
     .key_by("k").process_batches(CountBatches(), uid="count").sink(FileSink(out), uid="out"))
    return p


def _check_counts(out, n: int, keys: int) -> list[int]:
    """Each key's counts grow to exactly n / keys; returns the rows per call."""
    rows = committed_output(out)
    final: dict[int, int] = {}
    for r in rows:
        final[r["k"]] = max(final.get(r["k"], 0), r["n"])
    assert final == {k: n // keys for k in range(keys)}
    assert sum(r["rows"] for r in rows) == n
    return [r["rows"] for r in rows]


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_sim_reads_at_most_batch_rows_and_a_linger_gives_bigger_calls(tmp_path, mode):
    calls = {}
    for linger in (0.0, 0.005):  # virtual seconds; 6,000 rows take ~0.15 s, epochs every 0.02 s
        READS.clear()
        out = tmp_path / f"out-{linger}"
        p = _keyed_count(out, rows=300, linger=linger, n=6_000, interval=0.02, mode=mode)
        result = sim_run(p, tmp_path / f"chk-{linger}", seed=3)
        assert len(result.completed_epochs) >= 3  # epochs cut the lingering batches, and still commit
        assert READS and max(READS) <= 300
        calls[linger] = _check_counts(out, 6_000, 10)
    # the same rows in fewer, larger calls per key
    assert len(calls[0.005]) < len(calls[0.0])
    assert sum(calls[0.005]) / len(calls[0.005]) > sum(calls[0.0]) / len(calls[0.0])


@pytest.mark.slow
def test_local_driver_linger_gives_bigger_calls_and_exact_counts(tmp_path):
    """Real processes and time: 5 ms steps of a 2-worker job, rows per call with and without a linger."""
    means = {}
    for linger in (0.0, 0.05):
        out = tmp_path / f"out-{linger}"
        p = _keyed_count(out, rows=2048, linger=linger, n=200_000, keys=10, interval=0.2)
        p.run("local", checkpoint_dir=str(tmp_path / f"chk-{linger}"))
        calls = _check_counts(out, 200_000, 10)
        means[linger] = sum(calls) / len(calls)
    assert means[0.05] > means[0.0], means
