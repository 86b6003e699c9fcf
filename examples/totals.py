"""The README's example: per-customer totals with Value, List and Map state.

Run it:  python examples/totals.py
"""

from epochstream import (
    FileSink,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    Pipeline,
    ValueStateDescriptor,
)


class Totals(KeyedProcessFunction):
    def open(self, ctx):                       # declare keyed state once per subtask
        self.total = ctx.state(ValueStateDescriptor("total", default=0))
        self.items = ctx.state(ListStateDescriptor("items"))
        self.by_kind = ctx.state(MapStateDescriptor("by_kind"))

    def process(self, order, ctx):             # ctx.key is the current key
        self.total.update(self.total.value() + order["amount"])
        self.items.add(order["id"])
        self.by_kind.put(order["kind"], (self.by_kind.get(order["kind"]) or 0) + 1)
        yield {"customer": ctx.key, "total": self.total.value()}

orders = [{"id": i, "customer": f"c{i % 7}", "amount": i % 13, "kind": "ab"[i % 2]} for i in range(10_000)]

p = Pipeline("totals", parallelism=2, max_parallelism=128, mode="aligned", checkpoint_interval=0.5)
(p.from_collection(orders)                     # replayable: one offset per split
  .filter(lambda o: o["amount"] > 0)
  .key_by(lambda o: o["customer"])
  .process(Totals(), uid="totals")             # uid: the name state is stored under
  .sink(FileSink("out/totals"), uid="sink"))   # only committed epochs become visible files

result = p.run(deployment="local", checkpoint_dir="checkpoints/totals")
print(result.completed_epochs, result.latest_checkpoint)
