"""What travels on data channels and what the core asks its driver to do.

Data channels carry three kinds of message (``Message``): a ``Batch`` of records that all
belong to one epoch, a ``Marker`` closing an epoch and a ``Watermark`` advancing event time
(both aligned modes only). Everything else is an *action* (``TaskAction``): a frozen value
a task returns from ``step`` for the driver to carry out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

#: the time label of "no more records ever" (a bounded source's last time promise)
END_OF_TIME = 1 << 62

TaskId = tuple[int, int]
"""(chain id, subtask index): one process of the physical plan."""


@dataclass(slots=True)
class Batch:
    """Records of one epoch on one channel, in FIFO order.

    ``keys`` is set on hash-partitioned channels so the receiver does not recompute them.
    """

    epoch: int
    records: list[Any]
    keys: list[Any] | None = None
    #: random 64-bit id the trAcker's SND/RCV reports XOR together (0 in aligned mode)
    id: int = 0
    #: coarse time label shared by every record of the batch (event time on; else 0)
    time: int = 0

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True, slots=True)
class Marker:
    """Epoch ``epoch`` ends here on this channel (Carbone's barrier, Algorithms 5-6).

    ``aligned``: the epoch is a savepoint, aligned even in unaligned mode (no channel state,
    so it can be restored at another parallelism, as in Flink). ``overtook``: unaligned mode,
    the marker overtook that many messages of its channel still queued at the sender (a
    driver's link waiting for credit); they arrive after it and are channel state. ``carried``:
    copies of those messages, so the receiver has its channel state at once (as Flink's sender
    persists the output buffers its barrier overtook); without copies the receiver records the
    messages as they arrive."""

    epoch: int
    aligned: bool = False
    overtook: int = 0
    carried: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Watermark:
    """Aligned modes with event time: no record with a time label <= ``label`` will follow
    on this channel (Flink's watermark, counted in coarse time labels). Punctuation: the
    baseline the trAcker's WindowEnd is compared with."""

    label: int


# ---------------------------------------------------------------- actions


Message = Batch | Marker | Watermark
"""What a data channel carries."""


@dataclass(frozen=True, slots=True)
class Send:
    """Put ``message`` on data channel ``channel`` (FIFO per channel)."""

    channel: int
    message: Message


class CapturedRows(Protocol):
    """A capture's rows: a list (heap; incremental RocksDB captures), or a sized iterable over
    a RocksDB snapshot that the writer streams (full RocksDB captures; iterable more than once)."""

    def __iter__(self) -> Iterator[tuple[int, bytes, str, bytes | None]]: ...

    def __len__(self) -> int: ...


class ColumnRows:
    """A capture's rows held as columns (the heap backend's captures): iterates as row tuples,
    and a writer that knows it (``backends.objects``) encodes the columns without a tuple per
    row. ``states`` is (state name, number of rows) per run of rows of one state, in order."""

    __slots__ = ("key_groups", "keys", "states", "values")

    def __init__(self, key_groups: list[int], keys: list[bytes], states: list[tuple[str, int]],
                 values: list[bytes | None]) -> None:
        self.key_groups, self.keys, self.states, self.values = key_groups, keys, states, values

    def state_names(self) -> Iterator[str]:
        for name, n in self.states:
            for _ in range(n):
                yield name

    def __iter__(self) -> Iterator[tuple[int, bytes, str, bytes | None]]:
        return zip(self.key_groups, self.keys, self.state_names(), self.values, strict=True)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[int, bytes, str, bytes | None]:
        return list(self)[i]

    def __eq__(self, other: object) -> bool:  # as the list of its rows (tests, simple callers)
        if isinstance(other, (ColumnRows, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ColumnRows({list(self)!r})"


@dataclass(frozen=True, slots=True)
class KeyedCapture:
    """Rows of one keyed operator at an epoch bound, already serialized.

    ``rows`` are ``(key_group, key_bytes, state_name, value_bytes | None)``; ``None`` is a
    tombstone in an incremental capture. ``chain`` lists the epochs whose files, applied
    in order, rebuild this operator's state (first entry is the last full capture).
    """

    operator_uid: str
    rows: CapturedRows
    full: bool
    chain: tuple[int, ...]
    key_group_range: tuple[int, int]
    kinds: tuple[tuple[str, str], ...] = ()  # (state name, value | list | map)
    #: newest time label whose timers this operator fired (None: no event time)
    event_time: int | None = None
    #: (state name, declared type as JSON) of the states that declare one (``runtime.types``)
    types: tuple[tuple[str, Any], ...] = ()
    #: the declared key type as JSON (None: undeclared)
    key_type: Any = None


@dataclass(frozen=True, slots=True)
class SinkCapture:
    """Output of one sink subtask for one epoch, to be staged (pre-committed)."""

    sink_uid: str
    epoch: int
    records: list[Any]


@dataclass(frozen=True, slots=True)
class TaskCapture:
    """Everything a task hands over at an epoch bound; written off the processing path."""

    task: TaskId
    epoch: int
    keyed: tuple[KeyedCapture, ...] = ()
    sinks: tuple[SinkCapture, ...] = ()
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    alignment_seconds: float = 0.0
    held_records: int = 0
    #: the task's clock when it reached the epoch's bound (notification latency)
    captured_at: float = 0.0
    #: operator (non-keyed) state: (operator uid, state name, mode, pickled value), captured whole
    operator_state: tuple[tuple[str, str, str, bytes], ...] = ()
    #: a loop head's log of in-transit records (records, pickled bytes); 0 elsewhere
    loop_log_records: int = 0
    loop_log_bytes: int = 0
    #: unaligned mode: the channel state (``alignment.channel_state.decode_channel_state``; b"": none),
    #: its records and bytes
    channel_state: bytes = b""
    channel_state_records: int = 0
    channel_state_bytes: int = 0
    #: source uid -> split -> newest timestamp read (bounded out-of-orderness; ``runtime.watermarks``)
    source_max_timestamps: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Persist ``capture``, then acknowledge epoch ``capture.epoch`` to the coordinator."""

    capture: TaskCapture


@dataclass(frozen=True, slots=True)
class SourceExhausted:
    """A bounded source task has emitted its last record."""

    task: TaskId


TaskAction = Send | Snapshot | SourceExhausted
"""What ``Task.step`` returns, in the order the driver must carry it out."""
