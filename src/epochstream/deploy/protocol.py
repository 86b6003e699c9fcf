"""Control messages of a cluster (driver <-> worker, and worker <-> worker on the data links):
one frozen value per message.

Every worker has one control connection to the driver (a pipe for the local driver, a TCP
connection for spark); it carries only the driver's messages below, pickled whole.

The data link between two workers carries *envelopes*: a data envelope is a list of
(channel, message) pairs (``deploy.worker``), and a control envelope is one of the link
messages at the end (``Credit``, ``Backpressure``, ``PriorityMarker``; ``deploy.flow``). A
sender queues control envelopes ahead of the data waiting for credit, so flow control can
never be stuck behind the data it controls; on the wire both keep their order.

Worker -> driver, in the order a healthy attempt sends them::

    Hello (spark only, first)  Ready  {Exhausted | TrackerReport | Ack | Decline | Heartbeat}*  Stopped

and, instead of the rest, ``WorkerError`` (the job fails over) or ``Fatal`` (a damaged
checkpoint: restarting cannot help). Driver -> worker: ``Trigger``, ``Neoss`` and
``Committed`` while the job runs, ``Die`` (chaos) at any time, ``Stop`` once the job master
has finished. A worker carries out everything it was sent before ``Stop`` (a ``Committed``
of the final epoch included) before it reports ``Stopped``.

Both ends dispatch on the message's type (``type(msg)`` in a dict of handlers on the control
connection, a ``match`` on the links' three), so a new message is a new class plus one
handler on the receiving side. ``__reduce__`` rebuilds a message from its fields in order,
which pickles about twice as fast as the slot-by-slot state frozen dataclasses use by
default (the tracker's reports cross this channel often).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..chaos.kills import KillMoment
from ..runtime.messages import Marker, TaskId
from ..runtime.meters import WorkerSample
from ..snapshot.manifest import AckInfo

#: protocol moments a ``Die`` may wait for in the worker (``chaos.kills.KillMoment``; "commit" is the
#: driver's own): "sink_commit" is after a ``Committed`` arrived and before the worker's sinks commit it
MOMENTS = tuple(m.value for m in KillMoment if m.in_worker)


class _Message:
    __slots__ = ()

    def __reduce__(self):
        return type(self), tuple(getattr(self, name) for name in self.__match_args__)


# ---------------------------------------------------------------- worker -> driver


@dataclass(frozen=True, slots=True)
class Hello(_Message):
    """Spark: the first message on a new connection; ``executor_pid`` is None if unknown."""

    worker: int
    pid: int
    executor_pid: int | None


@dataclass(frozen=True, slots=True)
class Ready(_Message):
    """Worker ``worker`` has built its tasks (state restored) and starts its loop."""

    worker: int


@dataclass(frozen=True, slots=True)
class Ack(_Message):
    """A task's capture is persisted (pre-committed) for ``info.epoch``."""

    info: AckInfo


@dataclass(frozen=True, slots=True)
class Decline(_Message):
    """Writing ``task``'s state for ``epoch`` failed; ``staged`` is the sink output it had
    already pre-committed, which still commits with the next completed epoch."""

    task: TaskId
    epoch: int
    reason: str
    staged: dict[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Exhausted(_Message):
    """Source task ``task`` has read all its (bounded) input."""

    task: TaskId


@dataclass(frozen=True, slots=True)
class TrackerReport(_Message):
    """One flush of the worker's local tracker, for the tracking agent (trAcker mode)."""

    message: Any


@dataclass(frozen=True, slots=True)
class Stopped(_Message):
    """Worker ``worker`` left its loop after ``Stop``: the records its sources read, the
    markers and watermarks it sent (service traffic) and its tasks' final counters."""

    worker: int
    records: int
    markers: int
    watermarks: int
    meters: WorkerSample | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat(_Message):
    """Worker ``worker`` is alive and its loop turns (sent every heartbeat interval; ``liveness.py``).
    It carries the worker's task counters (``runtime.meters``): a periodic message that does
    not wait for epochs, so rates and backpressure stay live while an epoch is stuck.
    ``busy_for``: sent by the worker's pulse thread while one task step runs longer than the
    interval (no counters then): the seconds the loop has been inside that step."""

    worker: int
    meters: WorkerSample | None = None
    busy_for: float | None = None


@dataclass(frozen=True, slots=True)
class LinkLost(_Message):
    """Worker ``worker``'s connection to worker ``peer`` ended before ``Stop`` (``reason``): the
    peer died, or the network between them failed while both are alive; the job fails over."""

    worker: int
    peer: int
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerError(_Message):
    """The worker failed (``text``: what and where); the job fails over."""

    text: str


@dataclass(frozen=True, slots=True)
class Fatal(_Message):
    """The worker met a damaged checkpoint; the run ends (restarting cannot help)."""

    text: str


# ---------------------------------------------------------------- driver -> worker


@dataclass(frozen=True, slots=True)
class Trigger(_Message):
    """Start epoch ``epoch`` at every task that takes triggers (sources; loop heads when aligned).
    ``aligned``: a savepoint, aligned in unaligned mode too."""

    epoch: int
    aligned: bool = False


@dataclass(frozen=True, slots=True)
class Neoss(_Message):
    """The tracking agent's notes for this step: (chain ids, epoch or ``WindowEnd``) pairs;
    each worker hands every note to its own task of each chain."""

    notes: list[tuple[tuple[int, ...], Any]]


@dataclass(frozen=True, slots=True)
class Committed(_Message):
    """The manifest of epoch ``epoch`` exists: sinks whose subtasks commit their own output
    (``TransactionalSink.commits_in_subtasks``) commit every epoch up to it."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Die(_Message):
    """Chaos: SIGKILL ``pid`` at protocol moment ``moment`` (one of ``MOMENTS``)."""

    moment: str
    pid: int

    def __post_init__(self) -> None:
        if self.moment not in MOMENTS:
            raise ValueError(f"Die: unknown moment {self.moment!r} (one of {', '.join(MOMENTS)})")


@dataclass(frozen=True, slots=True)
class Stop(_Message):
    """The job master has finished: leave the loop and report ``Stopped``."""


# ---------------------------------------------------------------- worker -> worker (link control envelopes)


@dataclass(frozen=True, slots=True)
class Credit(_Message):
    """The receiver delivered ``envelopes`` data envelopes of this link into its mailboxes: the
    sender may have that many more outstanding (``deploy.flow.ReceiveWindow``)."""

    envelopes: int


@dataclass(frozen=True, slots=True)
class Backpressure(_Message):
    """The sending worker's backlog went over its bound (``on``) or back under it: sources stop
    reading while any worker is over (``deploy.flow.Pressure``)."""

    on: bool


@dataclass(frozen=True, slots=True)
class PriorityMarker(_Message):
    """Unaligned mode: ``marker`` of ``channel`` left ahead of the data the link queued for
    credit (``alignment.overtaking``); what it passed follows it."""

    channel: int
    marker: Marker


#: control envelopes on the data links between workers
ON_LINKS = (Credit, Backpressure, PriorityMarker)
#: messages a worker sends, for a driver's dispatch table
FROM_WORKER = (Hello, Ready, Ack, Decline, Exhausted, TrackerReport, Stopped, Heartbeat, LinkLost, WorkerError,
               Fatal)
#: messages a driver sends
TO_WORKER = (Trigger, Neoss, Committed, Die, Stop)
