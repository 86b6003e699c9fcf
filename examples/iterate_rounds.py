"""An iterative computation with a bounded number of rounds per input record.

Each record (id, x) goes round a Collatz step until x reaches 1 or it has taken ROUNDS
rounds; a keyed counter per bucket counts the rounds taken (a checkpointed state that a
rollback must not double). Flink's ``iterate()``/``closeWith`` shape.

Run it:  python examples/iterate_rounds.py [aligned|tracker]
"""

import sys

from epochstream import FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

ROUNDS = 20


class Step(KeyedProcessFunction):
    def open(self, ctx):
        self.rounds = ctx.state(ValueStateDescriptor("rounds", default=0))

    def process(self, record, ctx):
        rid, x, r = record
        self.rounds.update(self.rounds.value() + 1)
        yield (rid, x // 2 if x % 2 == 0 else 3 * x + 1, r + 1)


def build(out="out/rounds", mode="aligned"):
    p = Pipeline("rounds", parallelism=2, mode=mode, checkpoint_interval=0.05)
    loop = p.from_collection([(i, 1 + i % 97, 0) for i in range(20_000)], uid="numbers").iterate(uid="loop")
    step = loop.key_by(lambda r: r[0] % 64).process(Step(), uid="step")
    loop.close_with(step.filter(lambda r: r[1] != 1 and r[2] < ROUNDS))
    step.filter(lambda r: r[1] == 1 or r[2] >= ROUNDS).sink(FileSink(out), uid="done")
    return p


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "aligned"
    result = build(mode=mode).run(deployment="local", checkpoint_dir=f"checkpoints/rounds-{mode}")
    print(f"{mode}: epochs {result.completed_epochs} in {result.seconds:.2f}s")
