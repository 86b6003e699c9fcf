"""Word count with exactly-once keyed state and a transactional file sink.

Run it:  epochstream run examples/wordcount.py:build --deployment local
or:      python examples/wordcount.py
"""

from __future__ import annotations

import os
import re

from epochstream import FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

TEXT = """
Epochs cut the stream into slices; markers flow with the records and align at every task.
When every task has seen the marker of an epoch, its state is complete for that epoch,
the snapshot is written in the background, and a manifest makes the epoch visible at once.
Failures roll every task back to the latest completed epoch; sources rewind to its offsets,
and the output of an epoch is committed exactly once.
"""


def lines(i: int) -> str:
    """Line i of an endless text: the sample repeated, so the job runs for a few epochs."""
    sample = [ln for ln in TEXT.strip().splitlines()]
    return sample[i % len(sample)]


class CountWords(KeyedProcessFunction):
    """Running count per word; emits (word, count) for every occurrence."""

    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, word, ctx):
        n = self.count.value() + 1
        self.count.update(n)
        yield (word, n)


def build() -> Pipeline:
    out = os.environ.get("DEMO_DIR", "demo-output")
    p = Pipeline("wordcount", parallelism=2, checkpoint_interval=0.5)
    (
        p.generate(lines, count=int(os.environ.get("DEMO_LINES", 200_000)), uid="lines")
        .flat_map(lambda line: re.findall(r"[a-z]+", line.lower()))
        .filter(lambda w: len(w) > 2)
        .key_by(lambda w: w)
        .process(CountWords(), uid="counts")
        .sink(FileSink(f"{out}/counts"), uid="counts-sink")
    )
    return p


if __name__ == "__main__":
    out = os.environ.get("DEMO_DIR", "demo-output")
    result = build().run(deployment="local", checkpoint_dir=os.path.join(out, "checkpoints"))
    print(result.to_json())
