"""Incremental reachability over a stream of edge insertions: a loop (paper 000 §5.5, BFS).

Every edge (u, v) goes to the task of node u, which remembers v as a neighbour; when a
node is reached for the first time it emits ("out", node) and sends ("reach", w) round the
loop to each neighbour w. The epoch snapshots stay exactly-once although records go round:
aligned mode logs what is in flight at the loop head, tracker mode ends an epoch when the
loop has drained it.

Run it:    python examples/reachability.py [aligned|tracker]
Chaos it:  epochstream chaos examples/reachability.py:build --deployment sim --kills 3
"""

import sys

from epochstream import FileSink, KeyedProcessFunction, ListStateDescriptor, Pipeline, ValueStateDescriptor

ROOT = 0


class Reach(KeyedProcessFunction):
    def open(self, ctx):
        self.neighbours = ctx.state(ListStateDescriptor("neighbours"))
        self.reached = ctx.state(ValueStateDescriptor("reached", default=False))

    def process(self, record, ctx):            # ctx.key is the node
        kind, node = record[0], record[1]
        if kind == "edge":                     # ("edge", u, v), keyed by u
            self.neighbours.add(record[2])
            if self.reached.value() or node == ROOT:
                yield ("reach", record[2])
        elif not self.reached.value() and node != ROOT:   # ("reach", node): first time here
            self.reached.update(True)
            yield ("out", node)
            for w in self.neighbours.get():
                yield ("reach", w)


def edges(n=3000, nodes=1000):
    x = 7
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        yield ("edge", x % nodes, (x // nodes) % nodes)


def build(out="out/reachability", mode="aligned"):
    p = Pipeline("reachability", parallelism=2, mode=mode, checkpoint_interval=0.05)
    loop = p.from_collection(list(edges()), uid="edges").iterate(uid="bfs")   # a loop starts here
    step = loop.key_by(lambda r: r[1]).process(Reach(), uid="reach")
    loop.close_with(step.filter(lambda r: r[0] == "reach"))                  # ... and feeds back here
    step.filter(lambda r: r[0] == "out").sink(FileSink(out), uid="reached")
    return p


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "aligned"
    result = build(mode=mode).run(deployment="local", checkpoint_dir=f"checkpoints/reachability-{mode}")
    logged = [e["loop_log_records"] for e in result.metrics["epochs"] if e["state"] == "completed"]
    print(f"{mode}: epochs {result.completed_epochs}, records in flight logged per epoch {logged}")
