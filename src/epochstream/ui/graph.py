"""The job graph as the dashboard draws it: chains (operators fused into one task), the
edges between them with their partitioning, loops, and trAcker mode's segments."""

from __future__ import annotations

from typing import Any

from ..graph.plan import PhysicalPlan
from ..tracker.segments import build_segments, chain_graph


def job_graph(plan: PhysicalPlan, mode: str, segmentation: Any = None) -> dict[str, Any]:
    """JSON-ready: ``chains`` (id, name, operators, source/loop head), ``edges`` (chain ->
    chain, partitioning, phantom for a loop's back edge), ``loops`` and ``segments``
    (lists of chain ids, topological; trAcker mode's unit of progress tracking; the job's own
    ``segmentation`` if given, where pass-through chains may share one)."""
    chains = []
    for c in plan.chains:
        ops = [{"id": n, "name": plan.nodes[n].name, "kind": str(plan.nodes[n].kind), "uid": plan.nodes[n].uid}
               for n in c.nodes]
        chains.append({"id": c.id, "name": c.name, "operators": ops, "source": c.is_source,
                       "loop_head": c.is_loop_head})
    edges = sorted({(c.id, e.dst_chain, e.partition, e.phantom) for c in plan.chains for e in c.out_edges})
    if segmentation is None:
        segmentation = build_segments(*chain_graph(plan))
    return {
        "parallelism": plan.parallelism,
        "max_parallelism": plan.max_parallelism,
        "mode": mode,
        "chains": chains,
        "edges": [{"src": a, "dst": b, "partition": p, "phantom": ph} for a, b, p, ph in edges],
        "loops": [{"uid": lp.uid, "members": [plan.nodes[m].name for m in lp.members if m in plan.nodes]}
                  for lp in plan.loops],
        "segments": [list(s) for s in segmentation.segments],
    }
