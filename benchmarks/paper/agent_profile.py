"""Where the trAcker agent's time goes: record its messages in one RR-N g=1 run, replay them alone.

Runs ``sustainable_throughput.run`` once (the trAcker at granularity 1, FlameStream's batching) with
``TrackingAgent.__init__`` and ``receive`` wrapped to keep the agent's arguments and every message, then
replays the messages into a fresh agent: best of 7 in CPU time, a cProfile (CPU time) of one replay, and
each message timed alone with warm caches and with every 7th of ``--cold`` million one-item lists
touched between messages (inside the simulator the agent shares its process with every task, so its
caches are cold). Prints counts per record
(messages, reports, promises) and the timings. A profile, not a benchmark: it writes no files.

    python benchmarks/paper/agent_profile.py [--rate 1000] [--records 60] [--flush-interval 0.0002] [--cold 2]
    python benchmarks/paper/agent_profile.py --calibrate [--flush-interval 0.0002]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.paper import sustainable_throughput as st  # noqa: E402
from epochstream.tracker.agent import TrackingAgent  # noqa: E402


def record(args: argparse.Namespace) -> tuple[tuple, list]:
    """One run; the last agent's constructor arguments and the messages it received, in order."""
    made: list[tuple] = []
    msgs: list[tuple] = []
    spent = [0.0]
    real_init, real_receive = TrackingAgent.__init__, TrackingAgent.receive

    def init(self, *a, **kw):
        made.append(copy.deepcopy((a, kw)))
        real_init(self, *a, **kw)

    def receive(self, m, now):
        msgs.append((m, now))
        t0 = time.thread_time()
        try:
            return real_receive(self, m, now)
        finally:
            spent[0] += time.thread_time() - t0

    TrackingAgent.__init__, TrackingAgent.receive = init, receive  # type: ignore[method-assign]
    try:
        batching = st.Batching(args.flush_interval, False, True, True, True)
        row = st.run(args.graph_size, args.workers, 2, args.rate, args.records, "tracker", 1,
                     st.Costs(22.88e-6, 0.69e-6, 26.2e-6), None, batching)
    finally:
        TrackingAgent.__init__, TrackingAgent.receive = real_init, real_receive  # type: ignore[method-assign]
    print(f"run: {row['records_done']} records, {row['epochs']} epochs, {row['virtual_s']} s of virtual time")
    entries = sum(max(1, len(m.reports) + len(m.promises)) for m, _ in msgs)
    print(f"inside the simulator (CPU, the way the sim charges it, per entry of a message): "
          f"{spent[0] * 1e6 / max(1, len(msgs)):.2f} us/message, {spent[0] * 1e6 / max(1, entries):.2f} us/entry")
    return made[-1], msgs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph-size", type=int, default=30)
    ap.add_argument("--workers", type=int, default=20)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--records", type=int, default=60)
    ap.add_argument("--flush-interval", type=float, default=0.0002)
    ap.add_argument("--calibrate", action="store_true",
                    help="only print sustainable_throughput.calibrate() with this flush interval (batched): the "
                         "costs the benchmark measures inside a simulator run, the agent's per entry")
    ap.add_argument("--cold", type=float, default=2.0,
                    help="millions of small lists, every 7th touched between messages (0: skip)")
    args = ap.parse_args(argv)
    if args.calibrate:
        c = st.calibrate(st.Batching(args.flush_interval, False, True, True, True))
        print(f"calibrate (batched, {args.flush_interval * 1000:g} ms flush): task step {c.step * 1e6:.2f} us, "
              f"SND/RCV event {c.report * 1e6:.2f} us, agent {c.agent * 1e6:.2f} us/entry")
        return 0
    (a, kw), msgs = record(args)
    reports = sum(len(m.reports) for m, _ in msgs)
    promises = sum(len(m.promises) for m, _ in msgs)
    n = args.records
    print(f"messages {len(msgs)}, reports {reports}, promises {promises}; per record: messages {len(msgs) / n:.2f}, "
          f"reports {reports / n:.2f}, promises {promises / n:.2f}, entries {(reports + promises) / n:.2f}")

    def fresh() -> TrackingAgent:
        return TrackingAgent(*copy.deepcopy(a), **copy.deepcopy(kw))

    def replay() -> float:
        agent = fresh()
        t0 = time.thread_time()
        for m, now in msgs:
            agent.receive(m, now)
        return time.thread_time() - t0

    best = min(replay() for _ in range(7))
    print(f"replay, best of 7 (CPU): {best * 1e6 / len(msgs):.2f} us/message, "
          f"{best * 1e6 / max(1, reports + promises):.2f} us/entry")
    prof = cProfile.Profile(time.thread_time)
    agent = fresh()
    prof.enable()
    for m, now in msgs:
        agent.receive(m, now)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
    print(out.getvalue())
    if args.cold:
        big = [[i] for i in range(int(args.cold * 1_000_000))]

        def each(thrash: bool) -> float:
            agent, spent = fresh(), 0.0
            for m, now in msgs:
                if thrash:
                    total = 0
                    for x in big[::7]:
                        total += x[0]
                t0 = time.thread_time()
                agent.receive(m, now)
                spent += time.thread_time() - t0
            return spent * 1e6 / len(msgs)

        print(f"each message timed alone: warm {min(each(False) for _ in range(3)):.2f} us, "
              f"cold ({args.cold:g}M lists between messages) {min(each(True) for _ in range(2)):.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
