"""A task: mailbox controller + business logic handler for one subtask of one chain.

Theory of operation. The driver hands messages to ``receive`` (buffer only) and epoch
triggers to ``trigger`` (sources only), then calls ``step(now, budget)``, which does the
work and returns actions (``Send``, ``Snapshot``, ``SourceExhausted``). The mailbox is one
FIFO of (channel, message) in arrival order; the epoch gate decides what waits: barrier
alignment blocks channels whose marker arrived, the trAcker's firm-bound gate holds records
of epochs after the open one until a NEOSS closes it. Messages of a blocked channel are
set aside and put back at the head of the mailbox, in arrival order, when the gate opens.

Event time (trAcker mode with timestamped sources): every batch also carries one coarse
time label ``floor(ts / slack)``. Sources cut their reads into runs of one label and
promise labels as they read; a task flushes its output whenever the label of its input
changes, so a batch never spans two labels either (the label then bounds every record in
it from below, which window completeness needs, and equals the label of its cause, which
the chain rule needs). A ``WindowEnd`` fires the timers it passes; their output is
labelled with the WindowEnd's label and acknowledged as agent.py describes.

In the aligned modes event time travels as punctuation instead, as in Flink: a source
sends ``Watermark(t)`` on every output channel when its time promise grows (after the
batches it covers, so FIFO channels keep it behind them); a task's watermark is the
minimum over its input channels, and when it grows the task fires its timers and forwards
it. A watermark behind a marker on a blocked channel waits with the channel.

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
from .errors import EpochStreamError, ProtocolError, UserFunctionError
from .messages import END_OF_TIME, Batch, Marker, Send, Snapshot, SourceExhausted, TaskCapture, TaskId, Watermark
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
        event_time_slack: float | None = None,
    ) -> None:
        """``tracking``: None (aligned modes) or a ``TaskTracking`` (trAcker mode, which
        carries the event-time slack); ``event_time_slack``: the aligned modes' (watermarks)."""
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
        #: (batch id, epoch, time label) of inputs processed since the last flush: their RCVs follow the SNDs
        self._received: list[tuple[int, int, int]] = []
        #: event time: seconds per time label (None: off); the label of the output being buffered
        self.slack: float | None = getattr(tracking, "slack", None) if tracking is not None else event_time_slack
        self._out_time = 0
        #: aligned modes with event time: newest watermark per input channel, and their minimum
        self._channel_wm: dict[int, int] = {c: -1 for c in self.inputs}
        self._wm = -1
        #: event time, newest entries: (label, now) when a source promised a label or this task
        #: fired timers up to it (window latency = fire time - promise time; benchmarks/window_latency.py)
        self.time_log: deque[tuple[int, float]] = deque(maxlen=4096)
        # -- source side
        spec = plan.chains[task_id[0]]
        self.is_source = spec.is_source
        #: the driver delivers the coordinator's epoch triggers to this task (sources; loop heads)
        self.takes_triggers = spec.is_source
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
            self._timestamp = getattr(self.source, "timestamp", None) if self.slack is not None else None
            #: event time: per split, the label of the last record read (or of the next one)
            self._split_label: dict[int, int] = {}
            self._time_promised = -1
            if self._timestamp is not None:
                for s in self._splits:
                    first = self.source.read(s, self.offsets[s], 1)
                    if first:
                        self._split_label[s] = self._label(s, self.offsets[s], first[0])

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
        self.chain.set_now(now)
        if self.is_source:
            while self.triggers:
                self._snapshot_and_forward(self.triggers.popleft(), 0.0, actions, now)
            if read_source:
                self._read(budget, actions)
                self._flush(actions)
                if self._timestamp is not None:
                    self._promise_time(now, actions)
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
                if tracking is not None and self.slack is not None and msg.time != self._out_time:
                    self._flush(actions)  # a batch never spans two time labels
                    self._out_time = msg.time
                if self.exactly_once and msg.epoch != self.epoch:
                    raise ProtocolError(
                        "Task", f"{self.id} in epoch {self.epoch}", f"Batch(epoch={msg.epoch})", f"on channel {channel}"
                    )
                self._entry_of_channel[channel](msg.records, msg.keys)
                n = len(msg.records)
                processed += n
                self.records_in += n
                if tracking is not None:
                    self._received.append((msg.id, msg.epoch, msg.time))
                continue
            if type(msg) is Watermark:
                self._on_watermark(channel, msg.label, actions, now)
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

    def _read(self, budget: int, actions: list[Any]) -> None:
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
                if self._timestamp is None:
                    self._source_push(records, None)
                else:
                    self._push_labelled(split, offset, records, actions)
                return

    def _label(self, split: int, offset: int, record: Any) -> int:
        try:
            ts = self._timestamp(record)
        except Exception as exc:
            raise UserFunctionError(f"timestamp function of source {self.source_uid!r} failed: {exc!r}") from exc
        if not isinstance(ts, (int, float)) or ts < 0:
            raise EpochStreamError(
                f"source {self.source_uid!r} split {split} offset {offset}: the timestamp function returned {ts!r}; "
                f"event timestamps must be numbers >= 0"
            )
        return int(ts // self.slack)

    def _push_labelled(self, split: int, offset: int, records: list[Any], actions: list[Any]) -> None:
        """Push ``records`` in runs of one time label, flushing between runs."""
        last = self._split_label.get(split, 0)
        start = 0
        for i, r in enumerate(records):
            label = self._label(split, offset + i, r)
            if label < last:
                raise EpochStreamError(
                    f"source {self.source_uid!r} split {split} offset {offset + i}: timestamp {self._timestamp(r)!r} "
                    f"(time label {label}) is before label {last} of an earlier record; event timestamps must not "
                    f"decrease within a split (sort each split by time, or use more splits)"
                )
            if label != self._out_time:
                if i > start:
                    self._source_push(records[start:i], None)
                self._flush(actions)
                self._out_time = label
                start = i
            last = label
        self._source_push(records[start:], None)
        self._split_label[split] = last

    def _promise_time(self, now: float, actions: list[Any]) -> None:
        """Promise the labels no split can send any more (after the SNDs just flushed)."""
        bound = END_OF_TIME
        for s in self._splits:
            length = self._lengths[s]
            if length is None or self.offsets[s] < length:
                bound = min(bound, self._split_label.get(s, 0) - 1)
        if bound > self._time_promised:
            self._time_promised = bound
            self.time_log.append((bound, now))
            if self.tracking is not None:
                self.tracking.tracker.promise(self.tracking.segment, bound, now, source=self.id, dim=1)
            else:  # punctuation: behind the batches it covers, on every output channel
                self._forward_watermark(bound, actions)

    def _on_watermark(self, channel: int, label: int, actions: list[Any], now: float) -> None:
        """Aligned modes: the input's watermark is the minimum over channels; fire on growth."""
        if label <= self._channel_wm[channel]:
            raise ProtocolError("Task", f"{self.id} watermark {self._channel_wm[channel]} on channel {channel}",
                                f"Watermark({label})", "watermarks must increase per channel")
        self._channel_wm[channel] = label
        low = min(self._channel_wm.values())
        if low <= self._wm:
            return
        self._wm = low
        self._flush(actions)
        self._out_time = low
        self.chain.fire_timers(low, self.slack)
        if self.chain.timed:
            self.time_log.append((low, now))
        self._flush(actions)
        self._forward_watermark(low, actions)

    def _forward_watermark(self, label: int, actions: list[Any]) -> None:
        for ch in self.out_channels:
            actions.append(Send(ch, Watermark(label)))

    def _flush(self, actions: list[Any]) -> None:
        tracking = self.tracking
        if tracking is None:
            for ch, batch in self.chain.out.drain(self.epoch):
                actions.append(Send(ch, batch))
            return
        # chain rule: SND of every output before the RCV of the inputs that caused it
        tracker, ids, seg_of = tracking.tracker, tracking.ids, tracking.out_segment
        timed = self.slack is not None
        for ch, batch in self.chain.out.drain(self.epoch, self._out_time):
            batch.id = next(ids)
            tracker.snd(batch.id, batch.epoch, seg_of[ch])
            if timed:
                tracker.snd(batch.id, batch.time, seg_of[ch], 1)
            actions.append(Send(ch, batch))
        if self._received:
            seg = tracking.segment
            for bid, epoch, label in self._received:
                tracker.rcv(bid, epoch, seg)
                if timed:
                    tracker.rcv(bid, label, seg, 1)
            self._received = []

    def _apply_neoss(self, now: float, actions: list[Any]) -> None:
        """Close the epochs NEOSS ends: snapshot each (no markers), then release held records."""
        self._flush(actions)
        while self.neoss:
            note = self.neoss.popleft()
            if type(note) is not int:
                self._window_end(note, actions)
                self.time_log.append((note.label, now))
                continue
            for epoch in self.gate.on_neoss(note, now):
                self._snapshot_and_forward(epoch, self.gate.last_hold_seconds, actions, now)
        if self.held:
            self.mailbox.extendleft(reversed(self.held))
            self.held = []

    def _window_end(self, note: Any, actions: list[Any]) -> None:
        """Fire the timers event time passed; acknowledge after reporting their output."""
        if note.epoch != self.epoch:
            raise ProtocolError(
                "Task", f"{self.id} in epoch {self.epoch}", f"WindowEnd(label={note.label}, epoch={note.epoch})",
                "a WindowEnd must follow the NEOSS of the epoch before it (FIFO agent link)",
            )
        self._flush(actions)
        self._out_time = note.label
        self.chain.fire_timers(note.label, self.slack)
        self._flush(actions)  # SNDs of the timer output first, then the acknowledgements
        tracker, seg = self.tracking.tracker, self.tracking.segment
        tracker.confirm(seg, note.label, self.id)
        tracker.rcv(note.token_of(self.id), note.epoch, seg)

    def _snapshot_and_forward(self, epoch: int, waited: float, actions: list[Any], now: float) -> None:
        self.chain.end_epoch(epoch)  # epoch-bound hooks emit into this epoch, before the flush
        self._flush(actions)
        keyed, sinks, operator_state = self.chain.capture(epoch, self.incremental, self.full_every)
        offsets = {self.source_uid: dict(self.offsets)} if self.is_source else {}
        held = sum(len(m) for _c, m in self.held if type(m) is Batch)
        actions.append(Snapshot(TaskCapture(self.id, epoch, keyed, sinks, offsets, waited, held, now,
                                            operator_state)))
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
