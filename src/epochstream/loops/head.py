"""Loop-head logging (thesis 003, Algorithm 7) as a state machine for one head subtask.

Theory of operation. Loop expansion (``graph.cycles``) cut each loop's back edge into a
tail and a head joined by a phantom channel. The coordinator triggers the head like a
source: on the trigger of epoch n the head sends marker n into the loop (its output
channels) and starts *recording*. Marker n comes back through the phantom channel after
it has gone round the loop, behind every record the loop produced from epoch <= n input.
Every record arriving through the phantom channel between the trigger and that marker was
sent before the loop's cut of epoch n and is forwarded after it: it is *in transit* at
the cut (a Chandy-Lamport channel state). The head forwards it as usual and also logs it;
when marker n returns, the log of n is complete and becomes the head's snapshot of n.
Restoring epoch n re-emits the log into the loop before anything else, which puts back
exactly the records the cut caught in flight.

Concurrent epochs: if trigger n+1 comes before marker n returns, a record arriving in
between is in transit for both cuts and belongs to both logs. Markers return in trigger
order (channels are FIFO), so one list with a start index per open epoch holds every log.

Transitions (anything else raises ``ProtocolError`` and leaves the state unchanged):

    on_trigger(n)   n > last triggered            open n (start recording at the log's end)
    on_records(rs)  always                        append rs if any epoch is open
    on_marker(n)    n == oldest open epoch        close n, return its log

Sans-IO: no time, no I/O; the task (``loops.task``) sends the markers and the snapshot.
"""

from __future__ import annotations

from typing import Any

from ..runtime.errors import ProtocolError

MACHINE = "LoopHead"


class LoopHead:
    """Which epochs are recording, and the records logged for them."""

    def __init__(self, last_triggered: int = 0) -> None:
        #: newest epoch triggered at this head; triggers only grow
        self.last_triggered = last_triggered
        #: open epoch -> index in ``log`` where its recording began; ascending epochs and indices
        self.open: dict[int, int] = {}
        #: records forwarded since the oldest open epoch was triggered; empty when nothing is open
        self.log: list[Any] = []

    @property
    def recording(self) -> bool:
        return bool(self.open)

    def on_trigger(self, epoch: int) -> None:
        """Epoch ``epoch`` ends here now: the caller sends marker ``epoch`` into the loop."""
        if epoch <= self.last_triggered:
            raise ProtocolError(MACHINE, f"triggered up to {self.last_triggered}", f"trigger({epoch})",
                                "triggers must increase")
        self.last_triggered = epoch
        self.open[epoch] = len(self.log)

    def on_records(self, records: list[Any]) -> None:
        """Records from the phantom channel, forwarded by the caller: log them while recording."""
        if self.open:
            self.log.extend(records)

    def on_marker(self, epoch: int) -> list[Any]:
        """Marker ``epoch`` came back through the phantom channel: return the log of ``epoch``."""
        if not self.open:
            raise ProtocolError(MACHINE, "not recording", f"Marker({epoch})",
                                "a marker came back that this head never sent")
        oldest = next(iter(self.open))
        if epoch != oldest:
            raise ProtocolError(MACHINE, f"recording {list(self.open)}", f"Marker({epoch})",
                                f"markers must come back in order; expected {oldest}")
        start = self.open.pop(epoch)
        logged = self.log[start:]
        keep = next(iter(self.open.values())) if self.open else len(self.log)
        if keep:
            self.log = self.log[keep:]
            self.open = {e: i - keep for e, i in self.open.items()}
        return logged

    def check_invariants(self) -> None:
        epochs, starts = list(self.open), list(self.open.values())
        assert epochs == sorted(epochs) and starts == sorted(starts), "open epochs out of order"
        assert not starts or starts[0] == 0, "log keeps records no open epoch needs"
        assert self.open or not self.log, "log not empty while nothing is recording"
