"""Restoring at another parallelism: which state each new subtask gets (pure functions).

Keyed state moves by key group: a new subtask reads, from the checkpoint's files, only the
rows of the key groups in its range (``graph.keygroups.key_group_range``); a file whose
range does not overlap is never opened (the storage's ``read_operator_rows``). Operator
(non-keyed) state is redistributed by the mode it was declared with (Flink's
``RoundRobinOperatorStateRepartitioner``; thesis 003, section 4.2.2):

- ``split``: the entries of all old subtasks, in subtask order, are cut into ``new_p``
  contiguous, even chunks; at an unchanged parallelism every subtask keeps its own list;
- ``union``: every new subtask gets all entries of all old subtasks;
- ``broadcast``: every new subtask gets old subtask 0's copy.

Source offsets are operator state too, kept per split: a new source subtask owns the
splits ``s`` with ``s % new_p == subtask`` and resumes each at its checkpointed offset.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..runtime.state import BROADCAST, SPLIT, UNION


def redistribute(mode: str, parts: Mapping[int, Any], old_parallelism: int, new_parallelism: int) -> list[Any]:
    """The value of each new subtask, indexed ``0 .. new_parallelism - 1``.

    ``parts`` maps an old subtask to its value (a list for split/union, a dict for
    broadcast); a subtask that held nothing may be missing. ``1 <= new_parallelism``.
    """
    if new_parallelism < 1:
        raise ValueError(f"new parallelism must be >= 1, got {new_parallelism}")
    if mode == BROADCAST:
        if not parts:
            return [{} for _ in range(new_parallelism)]
        base = parts[0] if 0 in parts else parts[min(parts)]
        return [dict(base) for _ in range(new_parallelism)]
    if mode == SPLIT and old_parallelism == new_parallelism:
        return [list(parts.get(i, ())) for i in range(new_parallelism)]
    entries = [x for i in sorted(parts) for x in parts[i]]
    if mode == UNION:
        return [list(entries) for _ in range(new_parallelism)]
    if mode == SPLIT:
        n = len(entries)
        return [entries[i * n // new_parallelism:(i + 1) * n // new_parallelism] for i in range(new_parallelism)]
    raise ValueError(f"unknown operator state mode {mode!r}")


def splits_of(num_splits: int, parallelism: int, subtask: int) -> list[int]:
    """The source splits subtask ``subtask`` reads at ``parallelism`` (``split % parallelism``)."""
    return [s for s in range(num_splits) if s % parallelism == subtask]

