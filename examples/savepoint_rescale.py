"""Savepoint, rescale, query: stop a running job with a savepoint, restore it at another
parallelism, and read its committed state as a pyarrow Table.

Run it:  python examples/savepoint_rescale.py [WORKDIR]

1. An unbounded job (per-sensor counts and sums, keyed state plus a split-mode operator
   state) runs on the local driver at parallelism 2 for two seconds, then stops with a
   savepoint (``stop_with_savepoint``; ``epochstream stop --savepoint DIR JOB`` does the same
   to a job started with ``epochstream run``).
2. The savepoint folder is moved elsewhere (savepoints are self-contained) and the job
   restores from it at parallelism 3: keyed state moves by key group, the operator state is
   dealt out again, the source's splits keep their offsets.
3. ``epochstream.state.query`` reads the committed state of the last completed epoch.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import epochstream.state
from epochstream import (
    CheckpointConfig,
    FileSink,
    KeyedProcessFunction,
    ListStateDescriptor,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.graph.keygroups import assign_key_to_operator


class SensorStats(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))
        self.total = ctx.state(ValueStateDescriptor("total", default=0))
        # non-keyed: this subtask's alarms; on a rescale the entries are dealt out evenly ("split")
        self.alarms = ctx.operator_state(ListStateDescriptor("alarms"), mode="split")

    def process(self, reading, ctx):
        self.count.update(self.count.value() + 1)
        self.total.update(self.total.value() + reading[1])
        if reading[1] == 99 and len(self.alarms.get()) < 100:
            self.alarms.add((ctx.key, self.count.value()))
        if self.count.value() % 100_000 == 0:
            yield (ctx.key, self.count.value(), self.total.value())


def build(parallelism: int, out: Path) -> Pipeline:
    p = Pipeline("sensors", parallelism=parallelism, max_parallelism=64, checkpoint=CheckpointConfig(interval=0.3))
    (p.generate(lambda i: (f"sensor-{i % 10}", i % 100), count=None, uid="readings")  # unbounded, replayable
      .key_by(lambda r: r[0])
      .process(SensorStats(), uid="stats")
      .sink(FileSink(out / "stats"), uid="stats-out"))
    return p


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="epochstream-savepoint-"))
    first = build(2, work / "out").run(deployment="local", checkpoint_dir=str(work / "chk-p2"), duration=2.0,
                                       savepoint_dir=str(work / "savepoints"), stop_with_savepoint=True)
    savepoint = Path(first.savepoints[-1])
    print(f"1. stopped at parallelism 2 with savepoint {savepoint.name} ({first.records_in} records read)")

    moved = work / "moved" / savepoint.name
    shutil.move(str(savepoint), moved)
    second = build(3, work / "out").run(deployment="local", checkpoint_dir=str(work / "chk-p3"),
                                        restore=str(moved), duration=1.0)
    print(f"2. restored {moved} at parallelism {second.metrics['parallelism']}; "
          f"completed epochs {second.completed_epochs}")

    table = epochstream.state.query(work / "chk-p3", "stats", state="count")
    print(f"3. committed state of epoch {table.column('epoch')[0]} (read-committed):")
    for row in table.select(["key", "value", "key_group", "subtask"]).to_pylist():
        assert row["subtask"] == assign_key_to_operator(row["key"], 64, 3)  # the key-group formula
        print(f"   {row['key']:<10} count={row['value']:<8} key_group={row['key_group']:<3} subtask={row['subtask']}")
    print(f"   (the same from the shell: epochstream state query --checkpoint-dir {work / 'chk-p3'} --operator stats)")


if __name__ == "__main__":
    main()
