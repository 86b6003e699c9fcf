"""Pre-commit: turning a task's capture into staged sink output and state files.

``persist`` runs off the processing path (the simulator's virtual writer, a worker's writer
thread) and returns the ``AckInfo`` the job master's manifest is built from. It stages sink
output first, because that output cannot be produced again without a rollback, then writes
the state files. Channel state (unaligned mode) rides in the ack and is written with the
manifest, like operator state. Its two errors say what the failure costs: ``SinkStagingError`` fails the
job over; ``StateWriteError`` only declines the epoch (the task's next capture is full).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..runtime.messages import TaskCapture
from ..snapshot.manifest import AckInfo
from .lease import check_fence


class SinkStagingError(Exception):
    """Staging sink output failed: the epoch's output would be lost, so the job fails over."""


class StateWriteError(Exception):
    """Writing a state file failed: the task declines the epoch (a tolerable failure).

    ``staged`` is the sink output already pre-committed for the epoch: it must still
    commit with the next completed epoch, so the decline carries it to the job master.
    """

    def __init__(self, message: str, staged: dict[str, tuple[str, ...]]) -> None:
        super().__init__(message)
        self.staged = staged


def writes_files(capture: TaskCapture) -> bool:
    """Whether ``persist`` writes any file for ``capture``: a state file per keyed state (an
    increment with no changed row included, since it extends the chain), a staged file per sink
    with output. A capture of a stateless task (its source offsets, operator and channel state
    ride in the ack) writes nothing, so the simulator charges it no write time."""
    return bool(capture.keyed) or any(sc.records is not None and len(sc.records) for sc in capture.sinks)


def persist(storage, sinks: dict[str, Any], capture: TaskCapture, attempt: str,
            fail_state_write: Callable[[], None] | None = None) -> AckInfo:
    """Pre-commit a task's capture: stage sink output first, then write state files.

    Sink output goes first because it cannot be produced again without a rollback; a
    failed state write only costs this epoch (the task's next capture is full).
    """
    t0 = time.perf_counter()
    check_fence(storage, attempt)  # a zombie of an older attempt stages and writes nothing
    staged: dict[str, tuple[str, ...]] = {}
    for sc in capture.sinks:
        try:
            rel = sinks[sc.sink_uid].pre_commit(sc.sink_uid, capture.task[1], sc.epoch, attempt, sc.records)
        except Exception as exc:
            raise SinkStagingError(f"sink {sc.sink_uid!r} could not stage epoch {sc.epoch}: {exc}") from exc
        staged[sc.sink_uid] = (rel,) if rel else ()
    files = []
    chains: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, dict[str, str]] = {}
    types: dict[str, dict[str, Any]] = {}
    size = 0
    for kc in capture.keyed:
        try:
            if fail_state_write is not None:
                fail_state_write()
            ref = storage.pre_commit(kc.operator_uid, capture.task[1], capture.epoch, attempt, kc.rows,
                                      kc.key_group_range, kc.full)
        except Exception as exc:
            raise StateWriteError(
                f"state of {kc.operator_uid!r} subtask {capture.task[1]} for epoch {capture.epoch}: "
                f"{type(exc).__name__}: {exc}",
                staged,
            ) from exc
        files.append(ref)
        chains[kc.operator_uid] = kc.chain
        kinds[kc.operator_uid] = dict(kc.kinds)
        if kc.types or kc.key_type is not None:
            types[kc.operator_uid] = dict(kc.types, **({"": kc.key_type} if kc.key_type is not None else {}))
        size += ref.written
    return AckInfo(
        capture.task, capture.epoch, tuple(files), chains, kinds, capture.offsets, staged, size,
        capture.alignment_seconds, time.perf_counter() - t0, capture.held_records,
        event_time={kc.operator_uid: kc.event_time for kc in capture.keyed if kc.event_time is not None},
        captured_at=capture.captured_at, operator_state=capture.operator_state,
        loop_log_records=capture.loop_log_records, loop_log_bytes=capture.loop_log_bytes, types=types,
        channel_state=capture.channel_state, channel_state_records=capture.channel_state_records,
        channel_state_bytes=capture.channel_state_bytes, source_max_timestamps=capture.source_max_timestamps,
    )
