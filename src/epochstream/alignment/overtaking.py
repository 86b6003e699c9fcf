"""Overtaking at the sender (unaligned mode): a marker passes the data queued ahead of it on a link.

Theory of operation. A driver's link between two workers queues data envelopes while it
waits for credit (``deploy.flow.SendWindow``). In unaligned mode an epoch's marker need not
wait behind them: it leaves ahead of the queue, and the messages of its channel it passed
are channel state of its epoch at the receiver (``alignment.unaligned``, ``Marker.overtook``).

``overtake`` is that step, as a pure function over the queue's contents:

- *what leaves ahead*: every unaligned marker of the new envelope that no other marker of its
  channel precedes in the queue (a marker never passes another of its channel, so epochs stay
  in order); it carries copies of the messages of its channel it passed (``Marker.carried``,
  as Flink's sender persists the output buffers its barrier overtook) and their number
  (``Marker.overtook``);
- *what stays*: every other message, in its order. Nothing is taken out of the queue: the
  passed messages still travel, and the receiver processes them (in the next epoch) when
  they arrive; only the marker leaves its place.

A savepoint's marker (``Marker.aligned``) never overtakes: a savepoint has no channel state.

Cost: one pass over the queue per marker that overtakes; an envelope without an unaligned
marker is returned as it is, after one pass over the envelope.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ..runtime.messages import Marker

#: a data envelope: (channel, message) pairs, in the order they were sent
Envelope = list[tuple[int, Any]]


def overtake(queued: Iterable[Envelope], envelope: Envelope) -> tuple[Envelope, list[tuple[int, Marker]]]:
    """Split ``envelope``, about to join the ``queued`` envelopes (oldest first), into what
    joins the queue and the (channel, marker) pairs that leave ahead of it, in order.

    >>> from epochstream.runtime.messages import Batch
    >>> rest, ahead = overtake([[(5, Batch(1, ["a"]))]], [(5, Batch(1, ["b"])), (5, Marker(1)), (6, Marker(1))])
    >>> [b.records for _c, b in rest]
    [['b']]
    >>> [(c, m.overtook, len(m.carried)) for c, m in ahead]
    [(5, 2, 2), (6, 0, 0)]
    """
    if not any(type(m) is Marker and not m.aligned for _c, m in envelope):
        return envelope, []
    queued = list(queued)
    rest: Envelope = []
    ahead: list[tuple[int, Marker]] = []
    for ch, msg in envelope:
        if type(msg) is Marker and not msg.aligned:
            before = [m for env in queued for c, m in env if c == ch] + [m for c, m in rest if c == ch]
            if not any(type(m) is Marker for m in before):
                ahead.append((ch, replace(msg, overtook=len(before), carried=tuple(before))))
                continue
        rest.append((ch, msg))
    return rest, ahead
