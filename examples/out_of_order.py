"""Out-of-order event time: a watermark per split (``max_out_of_orderness``), late records
sent to a side output (``late_records=OutputTag(...)``, ``get_side_output``) instead of being
dropped, windows closing on the watermark in both modes.

Run it:  python examples/out_of_order.py
"""

import random

from epochstream import FileSink, OutputTag, Pipeline, TumblingEventTimeWindows

rng = random.Random(7)
# sensor readings (sensor, ts): mostly up to 4 s behind the newest, every 50th one 30 s behind (late)
readings = [(f"sensor{rng.randrange(5)}", max(0.0, i * 0.05 - (30.0 if i % 50 == 49 else rng.uniform(0, 4))))
            for i in range(20_000)]

for mode in ("aligned", "tracker"):
    p = Pipeline(f"readings-{mode}", parallelism=2, mode=mode, checkpoint_interval=0.2)
    late = OutputTag("late-readings")
    on_time = p.from_collection(readings, timestamps=lambda r: r[1], max_out_of_orderness=5.0, late_records=late)
    (on_time
      .key_by(lambda r: r[0])
      .window(TumblingEventTimeWindows.of(60.0, timestamp=lambda r: r[1]))
      .count(uid="per-minute")
      .sink(FileSink(f"out/readings-{mode}"), uid="sink"))
    on_time.get_side_output(late).sink(FileSink(f"out/late-readings-{mode}"), uid="late")
    result = p.run(deployment="local", checkpoint_dir=f"checkpoints/readings-{mode}")
    windows = FileSink(f"out/readings-{mode}").read()
    late_out = FileSink(f"out/late-readings-{mode}").read()
    print(f"{mode}: {len(windows)} windows, {sum(w[3] for w in windows)} readings counted, "
          f"{len(late_out)} late readings in the side output, "
          f"{result.metrics['late_records_dropped']} dropped")
