"""Distributed garbage collection against caching (paper 000 §5.4, Figure 13c), on the simulator.

The paper's workload: a depth search over a follower graph. Users are keys; a user's state is
her set of subscribers (followers). A stream of neighbourhood queries enters the system; a
query of root r visits r, then every follower of r, then every follower of those, up to
``--depth`` hops, and every visit reads the visited user's subscriber set. The search runs in a
loop (``iterate`` / ``close_with``), so its dataflow is cyclic. Paper: 4 nodes, 20 queries/s.

The graph is SYNTHETIC: no Twitter graph is reachable from this machine. It is a directed
Chung-Lu graph (expected-degree model, edge-sampling variant): ``users x mean_degree`` edges
"a follows b" are drawn with a chosen with probability proportional to an out-weight and b
proportional to an in-weight; the weights are independent power laws P(w) ~ w^-gamma with
gamma = ``--gamma`` (2.2 by default, close to the 2.276 Kwak et al. (WWW 2010) fit to Twitter's
follower counts), minimum 1, capped at ``--max-degree``; self-loops and duplicates are
dropped.

Per-key substream tracking (``epochstream.tracker.keys``). A visit of user u is a message
referencing key u. Each process (a subtask of the front or of the search) has a
``LocalKeyTracker``: the front records SND of a query's first visit (the substream starts,
paper §3.1's SND(pred, M, {})); the search records SND of each visit it emits and then RCV of
the visit it processed (the chain rule). Trackers flush every ``--flush-ms`` (or 1000 events)
to one ``KeyTrackingAgent`` over a link of ``--agent-delay-ms``; the agent's ``KeyFree(u)``
reaches u's process ``--agent-delay-ms`` later. The trackers and the agent run inside the
simulated processes on the simulator's virtual clock (the epochstream job itself runs in
tracker mode with 1 s epochs, as any job would).

Memory policies, all replayed over the same run's trace of state reads and KeyFree notes:

* ``gc``: a user's subscriber set is loaded on the first read and dropped when KeyFree for
  her reaches her process (no budget: its footprint is reported, mean and peak);
* ``lru``: an LRU cache of ``budget`` users;
* ``lru+ttl``: the same, and an entry not read for ``ttl`` is dropped (for several TTLs; a TTL
  can only add misses at a fixed budget, it saves memory).

A read is a miss when the user's subscriber set is not in memory. Reported: misses / reads.

Writes benchmarks/results/distributed_gc.csv and .png and prints a summary table. Not a test.

    python benchmarks/paper/distributed_gc.py [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import RESULTS, pyplot, write_csv  # noqa: E402
from epochstream import CheckpointConfig, DiscardingSink, KeyedProcessFunction, Pipeline  # noqa: E402
from epochstream.backends.local import LocalCheckpointStorage  # noqa: E402
from epochstream.deploy.sim import SimConfig, SimDriver  # noqa: E402
from epochstream.tracker import BatchIds  # noqa: E402
from epochstream.tracker.keys import KeyMessage, KeyTrackingAgent, LocalKeyTracker  # noqa: E402


# ---------------------------------------------------------------------------- the synthetic graph
def chung_lu_followers(users: int, mean_degree: float, gamma: float, max_degree: int,
                       seed: int) -> list[np.ndarray]:
    """subscribers[u] = the users who follow u, from a directed Chung-Lu graph (see module doc)."""
    rng = np.random.default_rng(seed)

    def weights() -> np.ndarray:
        # inverse-CDF power law with minimum 1: P(w > x) = x^-(gamma - 1)
        w = (1.0 - rng.random(users)) ** (-1.0 / (gamma - 1.0))
        return np.minimum(w, max_degree)

    w_out, w_in = weights(), weights()
    m = int(users * mean_degree)
    a = rng.choice(users, size=m, p=w_out / w_out.sum())  # follower
    b = rng.choice(users, size=m, p=w_in / w_in.sum())  # followee
    keep = a != b
    edges = np.unique(np.stack([b[keep], a[keep]], axis=1), axis=0)  # (followee, follower), deduplicated
    starts = np.searchsorted(edges[:, 0], np.arange(users + 1))
    return [edges[starts[u]:starts[u + 1], 1] for u in range(users)]


# ---------------------------------------------------------------------------- per-key tracking hub
class Hub:
    """The local key trackers, the agent and the links between them, on the simulator's clock.

    Shared by every subtask (one simulator process runs them all). ``tick`` runs before every
    step of a tracked function: it flushes each tracker that fell due (at the time it fell
    due: no event can have been recorded at that tracker since, because recording goes
    through ``tick`` first) and applies the agent's messages that have arrived by now.
    """

    def __init__(self, args) -> None:
        self.driver: SimDriver | None = None
        self.flush = args.flush_ms / 1000
        self.delay = args.agent_delay_ms / 1000
        self.trackers: dict[tuple[str, int], LocalKeyTracker] = {}
        self.last_event: dict[tuple[str, int], float] = {}
        self.agent = KeyTrackingAgent()
        self.inbox: list[tuple[float, int, KeyMessage]] = []
        self.n = 0
        self.ids = BatchIds(args.seed * 7919 + 1)
        #: (time, key) of every state read, and (time KeyFree reaches the key's process, key)
        self.reads: list[tuple[float, int]] = []
        self.frees: list[tuple[float, int]] = []
        self.next_progress = 0.0
        self.progress_every = args.seconds / 10
        self.wall0 = time.perf_counter()

    def now(self) -> float:
        assert self.driver is not None
        return self.driver.now

    def tracker(self, proc: tuple[str, int]) -> LocalKeyTracker:
        t = self.trackers.get(proc)
        if t is None:
            t = self.trackers[proc] = LocalKeyTracker(proc, flush_interval=self.flush, flush_count=1000,
                                                      now=self.now())
        return t

    def tick(self, proc: tuple[str, int]) -> LocalKeyTracker:
        now = self.now()
        for p, t in self.trackers.items():
            if t.has_pending() and (t.due(now) or t.pending_events >= 1000):
                sent = max(t.last_flush + self.flush, self.last_event.get(p, 0.0))
                for msg in t.flush(min(sent, now)):
                    self.n += 1
                    heapq.heappush(self.inbox, (min(sent, now) + self.delay, self.n, msg))
        self._apply(now)
        self.last_event[proc] = now
        if now >= self.next_progress:
            self.next_progress += self.progress_every
            print(f"    virtual {now:6.1f} s, {len(self.reads):,} reads, {self.agent.live_keys:,} keys referenced, "
                  f"wall {time.perf_counter() - self.wall0:.0f} s", flush=True)
        return self.tracker(proc)

    def _apply(self, now: float) -> None:
        while self.inbox and self.inbox[0][0] <= now:
            at, _, msg = heapq.heappop(self.inbox)
            for f in self.agent.receive(msg):
                self.frees.append((at + self.delay, f.key))

    def drain(self) -> None:
        """After the job: flush what is left and apply everything."""
        now = self.now()
        for t in self.trackers.values():
            for msg in t.flush(now):
                self.n += 1
                heapq.heappush(self.inbox, (now + self.delay, self.n, msg))
        self._apply(float("inf"))


class Front(KeyedProcessFunction):
    """Turns a query into the first visit of its root: the key's substream may start here."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def __deepcopy__(self, memo):
        return Front(self.hub)

    def open(self, ctx):
        self.proc = ("front", ctx.subtask_index)

    def process(self, q, ctx):
        qid, root = q
        t = self.hub.tick(self.proc)
        mid = next(self.hub.ids)
        t.snd(mid, (root,))
        return ((qid, root, 0, mid),)


class Search(KeyedProcessFunction):
    """Visit user u: read her subscriber set, emit a visit of each subscriber below the depth."""

    def __init__(self, hub: Hub, subscribers: list[np.ndarray], depth: int) -> None:
        self.hub, self.subscribers, self.depth = hub, subscribers, depth

    def __deepcopy__(self, memo):
        return Search(self.hub, self.subscribers, self.depth)

    def open(self, ctx):
        self.proc = ("search", ctx.subtask_index)

    def process(self, v, ctx):
        qid, user, d, mid = v
        t = self.hub.tick(self.proc)
        self.hub.reads.append((self.hub.now(), user))
        out = [("hit", qid, user)]
        if d < self.depth:
            for f in self.subscribers[user].tolist():
                cid = next(self.hub.ids)
                t.snd(cid, (f,))  # SNDs of the outputs ...
                out.append((qid, f, d + 1, cid))
        t.rcv(mid, (user,))  # ... before the RCV of the input (the chain rule)
        return out


def _user(v):
    return v[1]


def _is_visit(v):
    return v[0] != "hit"


def _is_hit(v):
    return v[0] == "hit"


def run_search(args, subscribers: list[np.ndarray], record_cost: float) -> Hub:
    hub = Hub(args)
    rng = np.random.default_rng(args.seed + 1)
    n = int(args.rate * args.seconds)
    if args.roots == "uniform":
        roots = rng.integers(0, len(subscribers), size=n).tolist()
    else:  # in proportion to the follower count: the neighbourhoods people ask about are the big ones
        deg = np.array([len(s) for s in subscribers], dtype=float) + 1.0
        roots = rng.choice(len(subscribers), size=n, p=deg / deg.sum()).tolist()
    p = Pipeline("distributed-gc", parallelism=args.workers, mode="tracker", batch_size=64,
                 checkpoint=CheckpointConfig(interval=1.0, max_concurrent=1, num_retained=1))
    q = p.generate(lambda i: (i, roots[i]), count=len(roots), uid="queries", splits=1)
    loop = q.key_by(lambda r: r[1]).process(Front(hub), uid="front").iterate(uid="loop")
    step = loop.key_by(_user).process(Search(hub, subscribers, args.depth), uid="search")
    loop.close_with(step.filter(_is_visit))
    step.filter(_is_hit).sink(DiscardingSink(), uid="results")
    cfg = SimConfig(source_rate=args.rate, source_batch=1, check_invariants=False, record_cost=record_cost)
    with tempfile.TemporaryDirectory(prefix="es-gc-") as chk:
        driver = SimDriver(p, LocalCheckpointStorage(chk), seed=args.seed, config=cfg)
        hub.driver = driver
        driver.run(None, False, None)
    hub.drain()
    return hub


# ---------------------------------------------------------------------------- memory policies
def replay_gc(reads, frees) -> dict:
    events = sorted([(t, 1, k) for t, k in reads] + [(t, 0, k) for t, k in frees])
    resident: set[int] = set()
    misses = peak = 0
    area, last_t = 0.0, events[0][0] if events else 0.0
    for t, kind, k in events:
        area += len(resident) * (t - last_t)
        last_t = t
        if kind == 1:
            if k not in resident:
                misses += 1
                resident.add(k)
                peak = max(peak, len(resident))
        else:
            resident.discard(k)
    span = (events[-1][0] - events[0][0]) if events else 1.0
    return {"misses": misses, "mean_resident": area / span if span > 0 else 0.0, "peak_resident": peak}


def replay_lru(reads, budget: int, ttl: float | None) -> dict:
    cache: OrderedDict[int, float] = OrderedDict()
    misses = 0
    for t, k in reads:
        last = cache.get(k)
        if last is not None and (ttl is None or t - last <= ttl):
            cache.move_to_end(k)
        else:
            misses += 1
            cache.pop(k, None)
            if len(cache) >= budget:
                cache.popitem(last=False)
        cache[k] = t
    return {"misses": misses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=50_000)
    ap.add_argument("--mean-degree", type=float, default=10.0)
    ap.add_argument("--gamma", type=float, default=2.2, help="power-law exponent of both degree weights")
    ap.add_argument("--max-degree", type=int, default=2000)
    ap.add_argument("--depth", type=int, default=2, help="hops of a neighbourhood query")
    ap.add_argument("--roots", choices=("uniform", "popular"), default="uniform",
                    help="query roots: uniform over users, or in proportion to their follower count + 1")
    ap.add_argument("--workers", type=int, default=4, help="paper: 4 nodes")
    ap.add_argument("--rate", type=float, default=20.0, help="queries/s (paper: 20)")
    ap.add_argument("--seconds", type=float, default=30.0, help="virtual seconds of queries")
    ap.add_argument("--flush-ms", type=float, default=5.0, help="local key trackers' flush interval")
    ap.add_argument("--agent-delay-ms", type=float, default=0.5, help="one-way delay to and from the agent")
    ap.add_argument("--budgets", default="0.001,0.002,0.005,0.01,0.02,0.05,0.1,0.25,0.5",
                    help="LRU budgets as fractions of the users")
    ap.add_argument("--ttls", default="0.01,0.1,1", help="TTLs (seconds) for lru+ttl")
    ap.add_argument("--record-costs-us", default="2,200,1000",
                    help="CPU time per record in the simulator (2 = its default; 200 = a visit that reads "
                         "its state from a store); one run per value")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="20,000 users, 10 virtual seconds")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.seconds = 20_000, 10.0
    t0 = time.perf_counter()
    subscribers = chung_lu_followers(args.users, args.mean_degree, args.gamma, args.max_degree, args.seed)
    deg = np.array([len(s) for s in subscribers])
    print(f"synthetic Chung-Lu follower graph: {args.users:,} users, {deg.sum():,} follow edges, mean "
          f"{deg.mean():.1f} followers, max {deg.max():,}, gamma {args.gamma} [{time.perf_counter() - t0:.1f}s]")
    budgets = [max(1, int(float(b) * args.users)) for b in args.budgets.split(",")]
    ttls = [float(x) for x in args.ttls.split(",")]
    rows: list[dict] = []
    gcs: dict[float, dict] = {}
    for cost_us in [float(c) for c in args.record_costs_us.split(",")]:
        print(f"depth-{args.depth} neighbourhood queries ({args.roots} roots), {args.rate:g}/s for "
              f"{args.seconds:g} virtual s, "
              f"{args.workers} workers, {cost_us:g} us per record, simulator; load {os.getloadavg()[0]:.2f}")
        hub = run_search(args, subscribers, cost_us / 1e6)
        reads, frees = hub.reads, hub.frees
        print(f"  {len(reads):,} reads, {len(frees):,} KeyFree notes, {hub.agent.messages:,} tracker messages "
              f"({hub.agent.reports:,} key reports) [{time.perf_counter() - t0:.0f}s]")
        assert hub.agent.live_keys == 0, "every key's substream must end once the job has drained"
        gc = gcs[cost_us] = replay_gc(reads, frees)
        common = {"record_cost_us": cost_us, "users": args.users, "depth": args.depth, "roots": args.roots,
                  "reads": len(reads)}
        rows.append({**common, "policy": "gc", "budget_keys": "", "ttl_s": "", "misses": gc["misses"],
                     "miss_ratio": gc["misses"] / len(reads), "mean_resident": round(gc["mean_resident"], 1),
                     "peak_resident": gc["peak_resident"]})
        distinct = len({k for _t, k in reads})
        rows.append({**common, "policy": "lru-unbounded", "budget_keys": distinct, "ttl_s": "", "misses": distinct,
                     "miss_ratio": distinct / len(reads), "mean_resident": "", "peak_resident": distinct})
        same = max(1, round(gc["mean_resident"]))
        r = replay_lru(reads, same, None)
        rows.append({**common, "policy": "lru-at-gc-mean-memory", "budget_keys": same, "ttl_s": "",
                     "misses": r["misses"], "miss_ratio": r["misses"] / len(reads), "mean_resident": "",
                     "peak_resident": same})
        for b in budgets:
            for ttl in [None, *ttls]:
                r = replay_lru(reads, b, ttl)
                rows.append({**common, "policy": "lru" if ttl is None else "lru+ttl", "budget_keys": b,
                             "ttl_s": "" if ttl is None else ttl, "misses": r["misses"],
                             "miss_ratio": r["misses"] / len(reads), "mean_resident": "", "peak_resident": b})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = ("distributed_gc_quick" if args.quick else "distributed_gc") + ("" if args.roots == "uniform" else
                                                                             f"_{args.roots}")
    write_csv(out / f"{name}.csv", rows)
    for cost_us, gc in gcs.items():
        sel_c = [r for r in rows if r["record_cost_us"] == cost_us]
        reads_n = sel_c[0]["reads"]
        print(f"\ncache-miss ratio (misses / state reads), SYNTHETIC graph, {cost_us:g} us per record, "
              f"{reads_n:,} reads")
        print(f"  gc (trAcker key substreams): {gc['misses'] / reads_n:.4f}   memory: mean "
              f"{gc['mean_resident']:.0f} users, peak {gc['peak_resident']:,}")
        eq = next(r for r in sel_c if r["policy"] == "lru-at-gc-mean-memory")
        unb = next(r for r in sel_c if r["policy"] == "lru-unbounded")
        print(f"  lru with gc's mean memory ({eq['budget_keys']:,} users): {eq['miss_ratio']:.4f} "
              f"({eq['misses'] / max(1, gc['misses']):.2f}x gc's misses); unbounded memory (every user ever read "
              f"misses once): {unb['miss_ratio']:.4f}")
        print(f"  {'budget (users)':>14} {'lru':>8} "
              + " ".join(f"{'ttl ' + format(t, 'g') + 's':>10}" for t in ttls) + f" {'lru / gc':>9}")
        for b in budgets:
            sel = [r for r in sel_c if r["budget_keys"] == b]
            lru = next(r for r in sel if r["policy"] == "lru")
            print(f"  {b:>14,} {lru['miss_ratio']:>8.4f} "
                  + " ".join(f"{next(r for r in sel if r['ttl_s'] == t)['miss_ratio']:>10.4f}" for t in ttls)
                  + f" {lru['misses'] / max(1, gc['misses']):>8.1f}x")
    print("  paper (Twitter graph, 4 nodes, 20 queries/s): about an order of magnitude fewer misses with gc")
    _plot(rows, budgets, ttls, gcs, out / f"{name}.png")
    print(f"\nwrote {out / (name + '.csv')} and {out / (name + '.png')} [{time.perf_counter() - t0:.0f}s]")
    return 0


def _plot(rows, budgets, ttls, gcs, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(gcs), figsize=(6 * len(gcs), 4), sharey=True, squeeze=False)
    for ax, (cost_us, gc) in zip(axes[0], gcs.items(), strict=True):
        sel = [r for r in rows if r["record_cost_us"] == cost_us]
        lru = [next(r for r in sel if r["budget_keys"] == b and r["policy"] == "lru")["miss_ratio"] for b in budgets]
        ax.plot(budgets, lru, marker="o", label="LRU")
        for t in ttls:
            ys = [next(r for r in sel if r["budget_keys"] == b and r["ttl_s"] == t)["miss_ratio"] for b in budgets]
            ax.plot(budgets, ys, marker="x", linestyle="--", label=f"LRU + TTL {t:g} s")
        ax.axhline(next(r for r in sel if r["policy"] == "gc")["miss_ratio"], color="k",
                   label="distributed GC (trAcker)")
        ax.axvline(max(1.0, gc["mean_resident"]), color="k", linestyle=":", label="GC mean memory")
        ax.axvline(gc["peak_resident"], color="grey", linestyle=":", label="GC peak memory")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cache budget (users in memory)")
        ax.set_ylabel("cache-miss ratio")
        ax.set_title(f"Fig. 13c, synthetic power-law graph, {cost_us:g} us/record (simulator)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
