"""Event-time pipelines for the tests (trAcker mode): windows, a NEXMark Q8 join, key expiry.

Every builder returns a fresh pipeline (the oracle builds twice) and writes to ``out / uid``
(or to placeholder sinks the oracle relocates when ``out`` is None). Inputs are sorted by
timestamp in each split (sources require timestamps not to decrease within a split), except
``window_counts(out_of_order=True)``, whose source bounds the disorder
(``max_out_of_orderness``) and drops late records.
The expected results are computed here from the input alone, independently of the
runtime and of the oracle's reference.
"""

from __future__ import annotations

import collections
import math
import random
from pathlib import Path
from typing import Any

from epochstream import (
    CheckpointConfig,
    FileSink,
    KeyedProcessFunction,
    MapStateDescriptor,
    OutputTag,
    Pipeline,
    TrackerConfig,
    TumblingEventTimeWindows,
    ValueStateDescriptor,
)
from pipelines import ROCKSDB_TEST_DIR

WINDOW = 10.0
SLACK = 1.0


def _pipeline(name: str, parallelism: int, interval: float, mode: str = "tracker", **tracker: Any) -> Pipeline:
    """``tracker``: TrackerConfig fields, ``batch_linger`` (the batching policy's linger) and
    ``state_backend_type`` (hashmap or rocksdb: where keyed state, timers included, lives)."""
    linger = tracker.pop("batch_linger", 0.0)
    state_type = tracker.pop("state_backend_type", "hashmap")
    return Pipeline(name, parallelism=parallelism, mode=mode,
                    checkpoint=CheckpointConfig(interval=interval, incremental=True, full_every=3,
                                                state_backend_type=state_type, rocksdb_dir=ROCKSDB_TEST_DIR),
                    tracker=TrackerConfig(time_slack=SLACK, **tracker), batch_size=16, batch_linger=linger)


def _sink(out: Path | None, uid: str) -> FileSink:
    return FileSink((out / uid) if out is not None else Path("/nonexistent-relocate-me") / uid)


# ---------------------------------------------------------------- tumbling window counts


#: out-of-order inputs: records come up to this many seconds behind the newest (the bound
#: the source is given), and every ``LATE_EVERY``-th record ``LATE_BY`` seconds behind (late)
MAX_DELAY = 3.0
LATE_EVERY = 7
LATE_BY = 9.0


def window_input(n: int, keys: int, seed: int = 1, out_of_order: bool = False) -> list[tuple[str, int, float]]:
    """(key, id, timestamp): timestamps grow by ~0.3 per record; ``out_of_order``: each is
    pushed back by up to ``MAX_DELAY`` seconds, and every ``LATE_EVERY``-th by ``LATE_BY``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = i * 0.3
        if out_of_order:
            ts = max(0.0, ts - (LATE_BY if i % LATE_EVERY == LATE_EVERY - 1 else rng.uniform(0, MAX_DELAY)))
        out.append((f"k{rng.randrange(keys)}", i, round(ts, 3)))
    return out


def window_counts(parallelism: int = 2, n: int = 400, keys: int = 7, out: Path | None = None,
                  interval: float = 0.002, mode: str = "tracker", out_of_order: bool = False,
                  late_side_output: bool = False, **tracker: Any) -> Pipeline:
    """``out_of_order``: the input of ``window_input(out_of_order=True)`` read with
    ``max_out_of_orderness=MAX_DELAY`` (late records dropped, or with ``late_side_output``
    sent to a side output, through a map, to the sink ``late``)."""
    p = _pipeline("window-counts", parallelism, interval, mode, **tracker)
    data = window_input(n, keys, out_of_order=out_of_order)
    tag = OutputTag("late")
    s = p.from_collection(data, timestamps=lambda r: r[2], uid="events",
                          max_out_of_orderness=MAX_DELAY if out_of_order else None,
                          late_records=tag if late_side_output else "drop")
    if late_side_output:
        s.get_side_output(tag).map(_mark_late).sink(_sink(out, "late"), uid="late")
    counts = s.key_by(lambda r: r[0]).window(TumblingEventTimeWindows.of(WINDOW, lambda r: r[2])).count(uid="win")
    counts.sink(_sink(out, "windows"), uid="windows")
    if out_of_order:  # every record the source keeps, so a wrongly kept late record shows in the output
        s.sink(_sink(out, "kept"), uid="kept")
    return p


def _mark_late(record: tuple[str, int, float]) -> tuple[str, int, float, str]:
    return (*record, "late")


def on_time(records: list[tuple[str, int, float]], splits: int, max_delay: float) -> list[tuple[str, int, float]]:
    """The records a source with ``max_out_of_orderness=max_delay`` keeps (the documented
    rule, written out here independently of the runtime): record i is in split i % splits;
    it is late when its time label is below floor((newest earlier timestamp of its split -
    max_delay) / SLACK)."""
    newest: dict[int, float] = {}
    kept = []
    for i, r in enumerate(records):
        split = i % splits
        if split in newest and math.floor(r[2] / SLACK) < math.floor((newest[split] - max_delay) / SLACK):
            continue
        newest[split] = max(newest.get(split, r[2]), r[2])
        kept.append(r)
    return kept


def expected_window_counts(n: int = 400, keys: int = 7, out_of_order: bool = False,
                           parallelism: int = 2) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    data = window_input(n, keys, out_of_order=out_of_order)
    if out_of_order:
        data = on_time(data, parallelism, MAX_DELAY)
    for k, _i, ts in data:
        start = math.floor(ts / WINDOW) * WINDOW
        c[(k, start, start + WINDOW)] += 1
    return collections.Counter({(k, s, e, v): 1 for (k, s, e), v in c.items()})


# ---------------------------------------------------------------- NEXMark Q8: new persons who opened auctions


def q8_input(persons: int, auctions: int, seed: int = 2):
    """Person records ("P", id, name, ts) and auction records ("A", auction, seller, ts)."""
    rng = random.Random(seed)
    ps = [("P", i, f"name{i}", round(rng.uniform(0, 60), 2)) for i in range(persons)]
    aus = [("A", a, rng.randrange(persons), round(rng.uniform(0, 60), 2)) for a in range(auctions)]
    return sorted(ps, key=lambda r: r[3]), sorted(aus, key=lambda r: r[3])


class Q8Join(KeyedProcessFunction):
    """Per person and window: remember the person's name and whether they opened an
    auction; at the window's end emit (person, name, window start) if both happened."""

    def open(self, ctx) -> None:
        self.windows = ctx.state(MapStateDescriptor("windows"))
        self.timers = ctx.timer_service()

    def process(self, value, ctx):
        start = math.floor(value[3] / WINDOW) * WINDOW
        seen = self.windows.get(start) or [None, False]
        if not self.windows.contains(start):
            self.timers.register_event_time_timer(math.nextafter(start + WINDOW, -math.inf))
        if value[0] == "P":
            seen = [value[2], seen[1]]
        else:
            seen = [seen[0], True]
        self.windows.put(start, seen)

    def on_timer(self, timestamp, ctx):
        start = math.floor(timestamp / WINDOW) * WINDOW
        seen = self.windows.get(start)
        self.windows.remove(start)
        if seen and seen[0] is not None and seen[1]:
            return ((ctx.key, seen[0], start),)
        return None


def q8(parallelism: int = 2, persons: int = 60, auctions: int = 150, out: Path | None = None,
       interval: float = 0.002, mode: str = "tracker", **tracker: Any) -> Pipeline:
    p = _pipeline("nexmark-q8", parallelism, interval, mode, **tracker)
    ps, aus = q8_input(persons, auctions)
    people = p.from_collection(ps, timestamps=lambda r: r[3], uid="persons")
    opened = p.from_collection(aus, timestamps=lambda r: r[3], uid="auctions")
    joined = people.union(opened).key_by(lambda r: r[1] if r[0] == "P" else r[2]).process(Q8Join(), uid="q8")
    joined.sink(_sink(out, "q8-out"), uid="q8-out")
    return p


def expected_q8(persons: int = 60, auctions: int = 150) -> collections.Counter:
    ps, aus = q8_input(persons, auctions)
    names = {(pid, math.floor(ts / WINDOW) * WINDOW): name for _t, pid, name, ts in ps}
    opened = {(seller, math.floor(ts / WINDOW) * WINDOW) for _t, _a, seller, ts in aus}
    return collections.Counter({(pid, names[(pid, w)], w): 1 for (pid, w) in names if (pid, w) in opened})


# ---------------------------------------------------------------- key expiry (distributed GC)


def auction_input(auctions: int, bids: int, seed: int = 3):
    """Auctions open at ``a`` seconds and close 5 s later; bids ("B", auction, price, ts)
    fall inside their auction's lifetime, so a closed auction's key receives nothing more."""
    rng = random.Random(seed)
    out = []
    for _ in range(bids):
        a = rng.randrange(auctions)
        out.append(("B", a, rng.randrange(1, 1000), round(a + rng.uniform(0, 4.99), 2)))
    return sorted(out, key=lambda r: r[3])


class WinningBid(KeyedProcessFunction):
    """Highest bid per auction, emitted when the auction closes; then the key's state is
    dead and ``expire_key_at`` drops it (the paper's distributed garbage collection)."""

    def open(self, ctx) -> None:
        self.best = ctx.state(ValueStateDescriptor("best"))
        self.bids = ctx.state(ValueStateDescriptor("bids", default=0))
        self.timers = ctx.timer_service()

    def process(self, value, ctx):
        closes = float(value[1]) + 5.0
        if self.best.value() is None:
            self.timers.register_event_time_timer(math.nextafter(closes, -math.inf))
            self.timers.expire_key_at(closes)
        if self.best.value() is None or value[2] > self.best.value():
            self.best.update(value[2])
        self.bids.update(self.bids.value() + 1)

    def on_timer(self, timestamp, ctx):
        return ((ctx.key, self.best.value(), self.bids.value()),)


def winning_bids(parallelism: int = 2, auctions: int = 20, bids: int = 300, out: Path | None = None,
                 interval: float = 0.002, mode: str = "tracker", **tracker: Any) -> Pipeline:
    p = _pipeline("winning-bids", parallelism, interval, mode, **tracker)
    s = p.from_collection(auction_input(auctions, bids), timestamps=lambda r: r[3], uid="bids")
    s.key_by(lambda r: r[1]).process(WinningBid(), uid="winner").sink(_sink(out, "winners"), uid="winners")
    return p


def expected_winning_bids(auctions: int = 20, bids: int = 300) -> collections.Counter:
    best: dict[int, int] = {}
    count: collections.Counter = collections.Counter()
    for _b, a, price, _ts in auction_input(auctions, bids):
        best[a] = max(best.get(a, 0), price)
        count[a] += 1
    return collections.Counter({(a, best[a], count[a]): 1 for a in best})


def window_counts_out_of_order(**knobs: Any) -> Pipeline:
    """``window_counts`` over an out-of-order input, late records dropped at the source."""
    return window_counts(out_of_order=True, **knobs)


def window_counts_late_side_output(**knobs: Any) -> Pipeline:
    """``window_counts`` over an out-of-order input, late records sent to a side output."""
    return window_counts(out_of_order=True, late_side_output=True, **knobs)


def expected_late(n: int = 400, keys: int = 7, parallelism: int = 2) -> collections.Counter:
    """The side output's records: the input the ``on_time`` rule leaves out, marked by the map."""
    data = window_input(n, keys, out_of_order=True)
    kept = set(on_time(data, parallelism, MAX_DELAY))
    return collections.Counter((*r, "late") for r in data if r not in kept)


BUILDERS = {"window_counts": window_counts, "q8": q8, "winning_bids": winning_bids,
            "window_counts_out_of_order": window_counts_out_of_order,
            "window_counts_late_side_output": window_counts_late_side_output}
#: name -> (sink uid, expected output given the parallelism: the out-of-order input's late
#: records depend on which split each record is in)
EXPECTED = {"window_counts": ("windows", lambda parallelism: expected_window_counts()),
            "q8": ("q8-out", lambda parallelism: expected_q8()),
            "winning_bids": ("winners", lambda parallelism: expected_winning_bids()),
            "window_counts_out_of_order": ("windows", lambda parallelism: expected_window_counts(
                out_of_order=True, parallelism=parallelism)),
            "window_counts_late_side_output": ("late", lambda parallelism: expected_late(parallelism=parallelism))}
