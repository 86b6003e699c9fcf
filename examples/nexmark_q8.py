"""NEXMark Query 8 on event time: people who registered and opened an auction in the same
10-second window. The window closes when the trAcker says no record of it is left anywhere
upstream (mode="tracker"); no watermark travels on the data channels.

Run it:  python examples/nexmark_q8.py
"""

import math
import random

from epochstream import FileSink, KeyedProcessFunction, MapStateDescriptor, Pipeline, TrackerConfig

WINDOW = 10.0
rng = random.Random(8)
# ("P", person, name, ts) and ("A", auction, seller, ts); each source sorted by time
persons = sorted((("P", i, f"person{i}", round(rng.uniform(0, 120), 2)) for i in range(2_000)), key=lambda r: r[3])
auctions = sorted((("A", a, rng.randrange(2_000), round(rng.uniform(0, 120), 2)) for a in range(5_000)),
                  key=lambda r: r[3])


class NewSellers(KeyedProcessFunction):
    def open(self, ctx):
        self.windows = ctx.state(MapStateDescriptor("windows"))   # window start -> [name, opened?]
        self.timers = ctx.timer_service()

    def process(self, event, ctx):
        start = math.floor(event[3] / WINDOW) * WINDOW
        if not self.windows.contains(start):                      # fire after the window's last instant
            self.timers.register_event_time_timer(math.nextafter(start + WINDOW, -math.inf))
        name, opened = self.windows.get(start) or [None, False]
        self.windows.put(start, [event[2], opened] if event[0] == "P" else [name, True])

    def on_timer(self, timestamp, ctx):
        start = math.floor(timestamp / WINDOW) * WINDOW
        name, opened = self.windows.get(start)
        self.windows.remove(start)
        if name is not None and opened:
            yield {"person": ctx.key, "name": name, "window": start}


p = Pipeline("nexmark-q8", parallelism=2, mode="tracker", checkpoint_interval=0.2,
             tracker=TrackerConfig(time_slack=1.0))              # coarse time labels: floor(ts / 1.0)
people = p.from_collection(persons, timestamps=lambda r: r[3], uid="persons")
opened = p.from_collection(auctions, timestamps=lambda r: r[3], uid="auctions")
(people.union(opened)
       .key_by(lambda r: r[1] if r[0] == "P" else r[2])
       .process(NewSellers(), uid="q8")
       .sink(FileSink("out/q8"), uid="q8-sink"))

result = p.run(deployment="local", checkpoint_dir="checkpoints/q8")
print("epochs", result.completed_epochs[-1], "service messages", result.metrics["service_traffic"]["total"]["messages"])
