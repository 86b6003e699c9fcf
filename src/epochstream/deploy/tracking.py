"""trAcker mode's driver side: the chain graph's segments and the tracking agent of an attempt.

``make_tracking`` cuts the chain graph into segments and starts a ``TrackingAgent`` at the
restored epoch (with a time dimension when a source has timestamps: ``firing_segments``
names the segments whose timers fire); ``Tracking`` bundles them for the driver loop, which
feeds the agent the workers' tracker reports and fans its NEOSS out (``Tracking.notes``).
``new_local_tracker`` is the worker side's counterpart, one per worker. Batch and token ids
come from ``ids_seed``: fixed per attempt and task, so a seeded simulation replays.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

from ..graph.kinds import OpKind
from ..graph.plan import PhysicalPlan
from ..runtime.messages import TaskId
from ..runtime.traits import OperatorTraits
from ..tracker.agent import TrackingAgent
from ..tracker.local import LocalTracker
from ..tracker.messages import NEOSS
from ..tracker.segments import Segmentation, build_segments, chain_graph
from ..tracker.traffic import ServiceTraffic
from .restore import Restored


@dataclass
class Tracking:
    """trAcker mode's driver-side objects for one attempt: segments and the tracking agent."""

    segmentation: Any
    agent: TrackingAgent
    traffic: ServiceTraffic

    def chains_of(self, segment: int) -> tuple[int, ...]:
        return tuple(self.segmentation.segments[segment])

    def undrained_loops(self, epoch: int) -> list[dict[str, Any]]:
        """Loops (cyclic segments) that hold ``epoch`` back: everything upstream has passed
        it, but records of an epoch <= ``epoch`` are still going round inside. In tracker
        mode such an epoch ends only when its loop drains, so a loop that never drains
        holds its epoch (and, through the firm bounds, every later one) forever."""
        seg, agent = self.segmentation, self.agent
        out = []
        for s, cyclic in enumerate(seg.cyclic):
            if not cyclic or agent.bound(s) >= epoch or agent.cap(s) < epoch:
                continue
            flight = {e: bal for e, (_x, bal) in agent.in_flight(s).items() if e <= epoch}
            out.append({"segment": s, "chains": list(seg.segments[s]), "bound": agent.bound(s),
                        "in_flight": {str(e): bal for e, bal in flight.items()}})
        return out

    def notes(self, neoss) -> list[tuple[tuple[int, ...], Any]]:
        """(chains, note) per notification that has receivers (source segments have none):
        the epoch of a NEOSS, or the ``WindowEnd`` itself; tasks take both through ``on_neoss``."""
        receivers = self.agent.processes
        assert receivers is not None, "make_tracking names every segment's processes"
        return [(self.chains_of(n.segment), n.epoch if type(n) is NEOSS else n)
                for n in neoss if receivers.get(n.segment)]


def uses_event_time(pipeline) -> bool:
    """Some source has timestamps: batches carry time labels and timers can fire (tracker mode)."""
    return pipeline is not None and any(getattr(s, "timestamp", None) is not None for s in pipeline.sources.values())


def firing_segments(plan: PhysicalPlan, seg_of: Mapping[Hashable, int]) -> dict[int, list[TaskId]]:
    """Segments with an operator that declares event-time use -> their processes (tasks)."""
    firing: dict[int, list[TaskId]] = {}
    for c in plan.chains:
        if any(OperatorTraits.of(plan.nodes[n].payload).uses_event_time for n in c.nodes
               if plan.nodes[n].kind == OpKind.PROCESS):
            firing.setdefault(seg_of[c.id], [])
    for c in plan.chains:
        if seg_of[c.id] in firing:
            firing[seg_of[c.id]].extend((c.id, s) for s in range(plan.parallelism))
    return firing


def chain_is_stateless(plan: PhysicalPlan, chain) -> bool:
    """What ``ChainRuntime.stateless`` will say once the chain opens, from the plan alone: only
    keyed process functions and loop heads declare state, timers or epoch hooks."""
    return not any(plan.nodes[n].kind in (OpKind.PROCESS, OpKind.LOOP_HEAD) for n in chain.nodes)


def pass_through_chains(plan: PhysicalPlan, pipeline) -> frozenset[int]:
    """Chains that will pass later epochs through (``TrackerConfig.pass_through``) and may share
    a segment (``TrackerConfig.merge_pass_through``): stateless, neither source nor loop head, no
    event time. Known before any task opens, so the job master and every worker cut the same
    segments (``build_segments`` keeps chains of a loop apart itself)."""
    cfg = getattr(pipeline, "tracker", None)
    if cfg is None or not cfg.pass_through or not getattr(cfg, "merge_pass_through", False) \
            or uses_event_time(pipeline):
        return frozenset()
    return frozenset(c.id for c in plan.chains
                     if not c.is_source and not c.is_loop_head and chain_is_stateless(plan, c))


def tracking_segments(plan: PhysicalPlan, pipeline=None) -> Segmentation:
    """trAcker mode's segments of ``plan``: the chain graph condensed, pass-through chains merged
    into one segment where ``pipeline`` allows it (one cut for the master and all workers)."""
    return build_segments(*chain_graph(plan), merge=pass_through_chains(plan, pipeline))


def make_tracking(plan: PhysicalPlan, restored: Restored | None, traffic: ServiceTraffic,
                  pipeline=None, attempt: str = "") -> Tracking:
    """Segments of the chain graph and a tracking agent that starts at the restored epoch
    (with a time dimension when ``pipeline`` uses event time)."""
    segmentation = tracking_segments(plan, pipeline)
    seg_of = segmentation.segment_of
    p = plan.parallelism
    promisers: dict[int, list[TaskId]] = {}
    processes: dict[int, list[str]] = {}
    for c in plan.chains:
        # a worker hosts one task of every chain: NEOSS of one agent step go to it in one message;
        # source chains end their epochs themselves and get none
        if not c.is_source:
            processes[seg_of[c.id]] = [f"worker-{w}" for w in range(p)]
        if c.is_source:
            promisers.setdefault(seg_of[c.id], []).extend((c.id, s) for s in range(p))
    firing = firing_segments(plan, seg_of) if uses_event_time(pipeline) else None
    agent = TrackingAgent(segmentation, promisers, last_closed=restored.epoch if restored else 0,
                          processes=processes, traffic=traffic, firing=firing,
                          token_seed=ids_seed(attempt, (-1, -1)))
    return Tracking(segmentation, agent, traffic)


def new_local_tracker(pipeline, worker: int, now: float) -> LocalTracker:
    """The local tracker of one worker, configured by the pipeline's ``TrackerConfig``."""
    cfg = pipeline.tracker
    return LocalTracker(worker, aggregate=cfg.aggregate, flush_interval=cfg.flush_interval,
                        flush_count=cfg.flush_count, now=now, flush_on_promise=cfg.flush_on_promise)


def ids_seed(attempt: str, tid: TaskId) -> int:
    """A 64-bit seed for the ids task ``tid`` draws in ``attempt`` (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(f"{attempt}/{tid}".encode(), digest_size=8).digest(), "little")
