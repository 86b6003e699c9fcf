"""A task: mailbox controller + business logic handler for one subtask of one chain.

Theory of operation. The driver hands messages to ``receive`` (buffer only) and epoch
triggers to ``trigger`` (sources only), then calls ``step(now, budget)``, which does the
work and returns actions (``Send``, ``Snapshot``, ``SourceExhausted``). The mailbox is one
FIFO of (channel, message) in arrival order; the epoch gate decides what waits: barrier
alignment blocks channels whose marker arrived, the trAcker's firm-bound gate holds records
of epochs after the open one until a NEOSS closes it. Messages of a blocked channel are
set aside and put back at the head of the mailbox, in arrival order, when the gate opens.

A source task has no inputs: it reads its splits from their offsets and, on a trigger for
epoch n, flushes its output, captures its offsets and emits marker n on every output
channel (Algorithm 5). A task with inputs snapshots and forwards marker n when the gate
says the epoch is aligned (Algorithm 6). Outputs are always flushed before a marker, so
a batch never spans two epochs.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..graph.plan import PhysicalPlan
from .chain import ChainRuntime
from .errors import ProtocolError
from .messages import Batch, Marker, Send, Snapshot, SourceExhausted, TaskCapture, TaskId
from .sources import Source


class Task:
    def __init__(
        self,
        plan: PhysicalPlan,
        task_id: TaskId,
        chain: ChainRuntime,
        gate: Any,
        start_epoch: int = 1,
        incremental: bool = True,
        full_every: int = 10,
        source_offsets: dict[str, dict[int, int]] | None = None,
        tracking: Any = None,
    ) -> None:
        """``tracking``: None (aligned modes) or a ``TaskTracking`` (trAcker mode)."""
        self.plan = plan
        self.id = task_id
        self.chain = chain
        self.gate = gate
        self.exactly_once = getattr(gate, "exactly_once", False)
        #: epoch of the records this task processes now; only grows
        self.epoch = start_epoch
        self.incremental = incremental
        self.full_every = full_every
        self.inputs = plan.inputs[task_id]
        self.mailbox: deque[tuple[int, Batch | Marker]] = deque()
        #: messages of blocked channels, in arrival order; empty whenever no channel is blocked
        self.held: list[tuple[int, Batch | Marker]] = []
        self.triggers: deque[int] = deque()
        self._entry_of_channel = {c: chain.entry[plan.channels[c].dst_node] for c in self.inputs}
        self.out_channels = [c for chans in plan.outputs[task_id] for c in chans]
        self.records_in = 0
        self.exhausted_reported = False
        # -- trAcker mode
        self.tracking = tracking
        #: NEOSS epochs delivered and not yet applied (buffered like messages)
        self.neoss: deque[int] = deque()
        #: (batch id, epoch) of inputs processed since the last flush: their RCVs follow the SNDs
        self._received: list[tuple[int, int]] = []
        # -- source side
        spec = plan.chains[task_id[0]]
        self.is_source = spec.is_source
        self.source: Source | None = None
        self.source_uid: str | None = None
        self.offsets: dict[int, int] = {}
        self._splits: list[int] = []
        self._next_split = 0
        if self.is_source:
            node = plan.nodes[spec.heads[0]]
            self.source, self.source_uid = node.payload, node.uid
            p = plan.parallelism
            self._splits = [s for s in range(self.source.num_splits) if s % p == task_id[1]]
            restored = (source_offsets or {}).get(node.uid, {})
            self.offsets = {s: int(restored.get(s, 0)) for s in self._splits}
            self._lengths = {s: self.source.split_length(s) for s in self._splits}
            self._source_push = chain.entry[node.id]

    # ------------------------------------------------------------ events in
    def receive(self, channel: int, message: Batch | Marker) -> None:
        self.mailbox.append((channel, message))

    def trigger(self, epoch: int) -> None:
        """Epoch ``epoch`` ends at this source now (coordinator's trigger)."""
        self.triggers.append(epoch)

    def on_neoss(self, epoch: int) -> None:
        """The tracking agent's NEOSS(epoch) for this task's segment (trAcker mode)."""
        if not self.is_source:
            self.neoss.append(epoch)

    # ------------------------------------------------------------ queries
    def has_input(self) -> bool:
        return bool(self.mailbox) or bool(self.triggers) or bool(self.neoss)

    def source_has_more(self) -> bool:
        if not self.is_source:
            return False
        return any(ln is None or self.offsets[s] < ln for s, ln in self._lengths.items())

    # ------------------------------------------------------------ work
    def step(self, now: float, budget: int = 1024, read_source: bool = True) -> list[Any]:
        """Process up to ``budget`` records (or one message); return actions."""
        actions: list[Any] = []
        if self.is_source:
            while self.triggers:
                self._snapshot_and_forward(self.triggers.popleft(), 0.0, actions, now)
            if read_source:
                self._read(budget)
                self._flush(actions)
            if not self.exhausted_reported and not self.source_has_more():
                self.exhausted_reported = True
                actions.append(SourceExhausted(self.id))
            return actions
        processed = 0
        gate = self.gate
        mailbox = self.mailbox
        tracking = self.tracking
        if tracking is not None and self.neoss:
            self._apply_neoss(now, actions)
        while mailbox and processed < budget:
            channel, msg = mailbox.popleft()
            if tracking is not None:
                if type(msg) is Batch and not gate.admit(msg.epoch, now):
                    self.held.append((channel, msg))  # firm bound: a later epoch waits for NEOSS
                    continue
            elif gate.is_blocked(channel):
                self.held.append((channel, msg))
                continue
            if type(msg) is Batch:
                if self.exactly_once and msg.epoch != self.epoch:
                    raise ProtocolError(
                        "Task", f"{self.id} in epoch {self.epoch}", f"Batch(epoch={msg.epoch})", f"on channel {channel}"
                    )
                self._entry_of_channel[channel](msg.records, msg.keys)
                n = len(msg.records)
                processed += n
                self.records_in += n
                if tracking is not None:
                    self._received.append((msg.id, msg.epoch))
                continue
            # a marker: everything before it on this channel is processed
            aligned = gate.on_marker(channel, msg.epoch, now)
            if aligned is not None:
                epoch, waited = aligned
                self._snapshot_and_forward(epoch, waited, actions, now)
                if self.held:
                    mailbox.extendleft(reversed(self.held))
                    self.held = []
                break
        self._flush(actions)
        return actions

    def _read(self, budget: int) -> None:
        splits = self._splits
        if not splits:
            return
        for _ in range(len(splits)):
            split = splits[self._next_split % len(splits)]
            self._next_split += 1
            offset = self.offsets[split]
            length = self._lengths[split]
            if length is not None and offset >= length:
                continue
            records = self.source.read(split, offset, budget)
            if records:
                self.offsets[split] = offset + len(records)
                self.records_in += len(records)
                self._source_push(records, None)
                return

    def _flush(self, actions: list[Any]) -> None:
        tracking = self.tracking
        if tracking is None:
            for ch, batch in self.chain.out.drain(self.epoch):
                actions.append(Send(ch, batch))
            return
        # chain rule: SND of every output before the RCV of the inputs that caused it
        tracker, ids, seg_of = tracking.tracker, tracking.ids, tracking.out_segment
        for ch, batch in self.chain.out.drain(self.epoch):
            batch.id = next(ids)
            tracker.snd(batch.id, batch.epoch, seg_of[ch])
            actions.append(Send(ch, batch))
        if self._received:
            seg = tracking.segment
            for bid, epoch in self._received:
                tracker.rcv(bid, epoch, seg)
            self._received = []

    def _apply_neoss(self, now: float, actions: list[Any]) -> None:
        """Close the epochs NEOSS ends: snapshot each (no markers), then release held records."""
        self._flush(actions)
        while self.neoss:
            for epoch in self.gate.on_neoss(self.neoss.popleft(), now):
                self._snapshot_and_forward(epoch, self.gate.last_hold_seconds, actions, now)
        if self.held:
            self.mailbox.extendleft(reversed(self.held))
            self.held = []

    def _snapshot_and_forward(self, epoch: int, waited: float, actions: list[Any], now: float) -> None:
        self._flush(actions)
        keyed, sinks = self.chain.capture(epoch, self.incremental, self.full_every)
        offsets = {self.source_uid: dict(self.offsets)} if self.is_source else {}
        held = sum(len(m) for _c, m in self.held if type(m) is Batch)
        actions.append(Snapshot(TaskCapture(self.id, epoch, keyed, sinks, offsets, waited, held)))
        if self.tracking is not None:
            if self.is_source:  # the promise follows the SNDs of every batch of epoch <= n (just flushed)
                self.tracking.tracker.promise(self.tracking.segment, epoch, now, source=self.id)
        else:
            marker = Marker(epoch)
            for ch in self.out_channels:
                actions.append(Send(ch, marker))
        self.epoch = epoch + 1
        self.chain.set_epoch(self.epoch)

    def check_invariants(self) -> None:
        """Called by the simulator after every step."""
        assert self.chain.out.pending() == 0, f"task {self.id}: unflushed output after step"
        assert not self._received, f"task {self.id}: RCV reports not handed to the tracker after step"
        if not getattr(self.gate, "blocked", None):
            assert not self.held, f"task {self.id}: held messages but no blocked channel"
        if self.tracking is not None and not self.is_source:
            assert self.epoch == self.gate.open_epoch, f"task {self.id}: epoch {self.epoch} != open epoch"
