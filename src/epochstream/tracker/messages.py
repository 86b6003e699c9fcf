"""What local trackers send to the tracking agent, and what the agent sends back.

Terms (paper 000, sections 3-4), defined once here for the whole package:

- *segment*: a node of the condensed dataflow graph (one logical operator, or one strongly
  connected component of operators); ``int``, numbered in topological order
  (``segments.build_segments``).
- *SND / RCV*: the two events of one batch crossing a channel: its sender records
  SND(id, epoch, destination segment) when it emits the batch, its receiver records
  RCV(id, epoch, own segment) when it processes it. Both carry the same random 64-bit id,
  so a segment whose events all pair up XORs to zero.
- ``Report``: the XOR fold of SND/RCV events of one (segment, epoch) at one local tracker.
- ``Promise``: a source's end of epoch n: it will send no more batches of epoch <= n.
- ``TrackerMessage``: one flush of one local tracker = one service message on the wire.
- ``NEOSS``: the agent's notification that segment s holds, and will receive, no more
  records of epochs <= n (its *bound* is n).
- *dimension*: what a label counts. Dimension ``EPOCHS`` (0) is the epoch; dimension
  ``TIME`` (1) is the coarse event-time label ``t(x) = floor(ts(x) / slack)`` of paper 000
  §4.2. Reports and promises name their dimension; the agent keeps one table per dimension.
- ``Confirm``: a process of a *firing* segment (one whose operators fire event-time timers)
  has handled the time notification for label t and reported the SNDs of what it emitted.
- ``WindowEnd``: the time dimension's NEOSS, delivered to the processes of a firing segment
  together with the epoch token each must acknowledge (agent.py explains why).

Wire sizes. Traffic accounting (``traffic.py``) counts the bytes of a compact fixed-width
encoding, described by the ``struct`` layouts below. The objects are not encoded here; a
driver that ships them with pickle pays more, but every mode is measured on one scale.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Hashable

# re-exported: the TIME label an exhausted source promises
from ..runtime.messages import END_OF_TIME as END_OF_TIME

#: dimensions of the tracked labels
EPOCHS = 0
TIME = 1

#: batch ids are 64-bit; 0 is not allowed, because XOR-ing it changes nothing
MAX_ID = (1 << 64) - 1

#: sender (u32), sequence number (u64), number of reports (u16), number of promises (u16)
HEADER_WIRE = struct.Struct("<IQHH")
#: segment (u32), epoch (u64), xor (u64), snd count (u32), rcv count (u32)
REPORT_WIRE = struct.Struct("<IQQII")
#: segment (u32), epoch (u64), source (u32)
PROMISE_WIRE = struct.Struct("<IQI")
#: segment (u32), label (u64), process (u32)
CONFIRM_WIRE = struct.Struct("<IQI")
#: segment (u32), label (u64), epoch (u64), token (u64): one process's window-end entry
WINDOW_END_WIRE = struct.Struct("<IQQQ")
#: segment (u32), epoch (u64)
NEOSS_WIRE = struct.Struct("<IQ")
#: channel (u32), epoch (u64): a barrier on a data channel, for aligned-mode accounting
MARKER_WIRE = struct.Struct("<IQ")


@dataclass(frozen=True, slots=True)
class Report:
    """SND/RCV events of one (segment, epoch), XOR-folded at one local tracker.

    ``xor`` is the XOR of the ids of the events; ``snd`` and ``rcv`` count them. The agent
    keeps both the XOR and the balance ``snd - rcv``: a slot is clear only when both are 0.
    The balance costs 8 bytes and catches what the XOR alone cannot see (an id reused
    for two batches cancels in the XOR, but not in the balance).
    """

    segment: int
    epoch: int
    xor: int
    snd: int
    rcv: int
    #: ``EPOCHS`` or ``TIME``: what ``epoch`` counts
    dim: int = EPOCHS

    @property
    def count(self) -> int:
        """Number of SND/RCV events folded into this report."""
        return self.snd + self.rcv


@dataclass(frozen=True, slots=True)
class Promise:
    """Source ``source`` of segment ``segment`` sends no more batches of epoch <= ``epoch``."""

    segment: int
    epoch: int
    source: Hashable
    dim: int = EPOCHS


@dataclass(frozen=True, slots=True)
class Confirm:
    """Process ``process`` of firing segment ``segment`` handled WindowEnd(``label``)."""

    segment: int
    label: int
    process: Hashable


@dataclass(frozen=True, slots=True)
class TrackerMessage:
    """One flush of local tracker ``sender``: its ``seq``-th message (0, 1, 2, ...).

    The agent applies a message atomically, reports first, then promises, and requires the
    messages of one sender in ``seq`` order (the link must be FIFO and lossless).
    """

    sender: Hashable
    seq: int
    reports: tuple[Report, ...] = ()
    promises: tuple[Promise, ...] = ()
    confirms: tuple[Confirm, ...] = ()

    @property
    def nbytes(self) -> int:
        return (HEADER_WIRE.size + len(self.reports) * REPORT_WIRE.size + len(self.promises) * PROMISE_WIRE.size
                + len(self.confirms) * CONFIRM_WIRE.size)

    @property
    def min_epoch(self) -> int | None:
        """The oldest epoch the message carries (traffic is attributed to it; time labels are not epochs)."""
        epochs = [r.epoch for r in self.reports if r.dim == EPOCHS]
        epochs += [p.epoch for p in self.promises if p.dim == EPOCHS]
        return min(epochs) if epochs else None


@dataclass(frozen=True, slots=True)
class NEOSS:
    """Notification of end of substream: segment ``segment`` is bounded at ``epoch``.

    Cumulative: it closes every epoch up to ``epoch`` that an earlier NEOSS did not. The
    driver delivers it to every process of the segment.
    """

    segment: int
    epoch: int


@dataclass(frozen=True, slots=True)
class WindowEnd:
    """Time-dimension NEOSS: segment ``segment`` holds, and will receive, no record whose
    time label is <= ``label`` (every event timestamp below ``(label + 1) * slack`` is in).

    Sent only to firing segments. ``epoch`` is the epoch the receiving processes are in
    when they handle it (the segment's epoch bound + 1); ``tokens`` gives each process the
    id it acknowledges with RCV(token, epoch) after reporting the SNDs of its timer output,
    which keeps the epoch from closing before that output is accounted for.
    """

    segment: int
    label: int
    epoch: int
    tokens: tuple[tuple[Hashable, int], ...]

    def token_of(self, process: Hashable) -> int:
        for p, token in self.tokens:
            if p == process:
                return token
        raise KeyError(process)


AgentNote = NEOSS | WindowEnd
"""What ``TrackingAgent.receive`` returns: notifications for the driver to deliver (FIFO per worker)."""
