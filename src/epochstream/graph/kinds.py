"""The kinds of logical operator, as one enum every layer compares against.

A ``StrEnum`` so that a kind still equals its name (``OpKind.MAP == "map"``): manifests and
savepoints written before the enum existed store kinds as plain strings and stay readable.
"""

from __future__ import annotations

from enum import StrEnum


class OpKind(StrEnum):
    """What a ``graph.plan.Node`` does; the first eight come from the API, the last two from
    the planner's loop expansion (``graph.cycles``) and may not appear in a user's graph."""

    SOURCE = "source"
    MAP = "map"
    FLAT_MAP = "flat_map"
    FILTER = "filter"
    #: a function of a whole Arrow RecordBatch (``Stream.map_batches``)
    MAP_BATCHES = "map_batches"
    #: a keyed process function (``key_by(...).process(...)``, ``reduce``, windows)
    PROCESS = "process"
    SINK = "sink"
    #: a loop's entry (``Stream.iterate``): passes records on
    ITERATE = "iterate"
    #: the receiving end of a cut back edge: logs and re-emits what is in flight (Algorithm 7)
    LOOP_HEAD = "loop_head"
    #: the sending end of a cut back edge: hands records to the loop head in the same worker
    LOOP_TAIL = "loop_tail"
