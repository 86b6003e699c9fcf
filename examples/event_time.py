"""Event time on the trAcker: tumbling-window counts, and auctions whose keyed state is
dropped once no bid can reach them any more (distributed garbage collection).

Run it:  python examples/event_time.py
"""

import math
import random

from epochstream import (
    FileSink,
    KeyedProcessFunction,
    Pipeline,
    TrackerConfig,
    TumblingEventTimeWindows,
    ValueStateDescriptor,
)

rng = random.Random(1)
clicks = [(f"page{rng.randrange(20)}", round(i * 0.01, 2)) for i in range(20_000)]   # (page, ts), ts grows

p = Pipeline("clicks-per-10s", parallelism=2, mode="tracker", checkpoint_interval=0.2,
             tracker=TrackerConfig(time_slack=1.0))
(p.from_collection(clicks, timestamps=lambda c: c[1])
  .key_by(lambda c: c[0])
  .window(TumblingEventTimeWindows.of(10.0, timestamp=lambda c: c[1]))
  .count(uid="clicks")                                   # (page, start, end, count) when the window closes
  .sink(FileSink("out/clicks"), uid="clicks-sink"))
print("windows:", p.run(deployment="local", checkpoint_dir="checkpoints/clicks").completed_epochs[-1], "epochs")

# auction a opens at t=a and closes at t=a+5; bids fall inside, so after a+5 its key is dead
bids = sorted((("B", a, rng.randrange(1, 500), a + rng.uniform(0, 4.99))
               for a in (rng.randrange(300) for _ in range(20_000))), key=lambda b: b[3])


class WinningBid(KeyedProcessFunction):
    def open(self, ctx):
        self.best = ctx.state(ValueStateDescriptor("best"))
        self.timers = ctx.timer_service()

    def process(self, bid, ctx):
        if self.best.value() is None:
            closes = bid[1] + 5.0
            self.timers.register_event_time_timer(math.nextafter(closes, -math.inf))  # emit the winner
            self.timers.expire_key_at(closes)                                         # then drop the key's state
        self.best.update(max(self.best.value() or 0, bid[2]))

    def on_timer(self, timestamp, ctx):
        yield {"auction": ctx.key, "price": self.best.value()}


q = Pipeline("winning-bids", parallelism=2, mode="tracker", checkpoint_interval=0.2)
(q.from_collection(bids, timestamps=lambda b: b[3])
  .key_by(lambda b: b[1])
  .process(WinningBid(), uid="winner")
  .sink(FileSink("out/winners"), uid="winners"))
print("auctions:", q.run(deployment="local", checkpoint_dir="checkpoints/winners").completed_epochs[-1], "epochs")
