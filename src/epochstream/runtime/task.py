"""A task: mailbox controller + business logic handler for one subtask of one chain.

Theory of operation. The driver hands messages to ``receive`` (buffer only), epoch
triggers to ``trigger`` (sources) and notifications to ``on_neoss`` (trAcker mode), then
calls ``step(now, budget)``, which does the work and returns ``TaskAction``s (``Send``,
``Snapshot``, ``SourceExhausted``). A task plays one of two roles, fixed by the plan, and
each role is a type:

* a ``SourceTask`` *reads* (a source chain): its ``SplitReader`` reads splits from their
  offsets; on a trigger for epoch n the task flushes its output, captures its offsets and
  ends epoch n (Algorithm 5);
* a ``ConsumingTask`` *consumes* its input channels: the mailbox is one FIFO of (channel,
  message) in arrival order, and its ``Gate`` (``runtime.gate``) decides what waits and when
  an epoch ends: the barrier aligner blocks channels whose marker arrived and ends epoch n
  at the last marker n (Algorithm 6), the trAcker's firm-bound gate holds records of epochs
  after the open one and ends epochs on NEOSS. Messages the gate refuses are set aside and
  put back at the head of the mailbox, in arrival order, when an epoch ends.

Either way an epoch ends the same way, in the base ``Task`` (``_end_epoch``): epoch-bound
hooks run, the output is flushed (so a batch never spans two epochs), the chain's state is
captured into a ``Snapshot`` (the driver persists and pre-commits it, then acknowledges),
and ``Progress`` (``runtime.progress``) announces the end: marker n on every output channel
in the aligned modes, a promise to the tracker from a trAcker-mode source.

Event time (``runtime.eventtime``). Sources cut their reads into runs of one time label;
the task flushes whenever the label of its output changes. In trAcker mode the label rides
on every batch and a consuming task flushes when its input's label changes; a
``WindowEnd`` (it comes with the NEOSS notes) fires the timers it passes. In the aligned
modes a grown time promise travels as ``Watermark`` punctuation: a consuming task's
watermark is the minimum over its channels, and when it grows the task fires its timers
and forwards it. A watermark behind a marker on a blocked channel waits with the channel.

Why composition. The mode (gate and progress) and the role vary independently, and a loop
head (``loops.task``) varies both again; subclassing each combination would copy the flush
rules into many classes. So the role is the type, and a task holds small objects for what
varies with the mode: a ``Gate``, a ``Progress``, an ``EventClock``, and in unaligned mode a
channel-state recorder (``runtime.recording``; None in the other modes), which decides which
markers are taken early and records their channel state. Each is tested alone; the task
calls them per batch or per epoch, never per record, and the consuming loop has no mode
test: the gate, the progress object and the recorder decide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..graph.plan import PhysicalPlan
from .batching import BatchPolicy
from .chain import ChainRuntime
from .errors import ProtocolError, UserFunctionError
from .eventtime import EventClock
from .gate import Gate
from .messages import Batch, Marker, Message, Snapshot, SourceExhausted, TaskAction, TaskCapture, TaskId, Watermark
from .progress import InBand, Progress
from .reader import SplitReader
from .recording import AtHead, Recorder
from .sources import Source
from .tracking import TaskTracking, TimeNote, Tracked

Push = Callable[[list[Any], "list[Any] | None"], None]


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """How one task is set up for an attempt: fixed for its life, shared by its roles."""

    #: the epoch of the first records it processes (the restored epoch + 1)
    start_epoch: int = 1
    #: keyed state is captured incrementally, in full every ``full_every`` epochs
    incremental: bool = True
    full_every: int = 10
    #: None (aligned modes) or the task's ``TaskTracking`` (trAcker mode; it carries the event-time slack)
    tracking: TaskTracking | None = None
    #: the aligned modes' event-time slack (watermarks); None: no event time
    event_time_slack: float | None = None
    #: when output leaves (``runtime.batching``); None: every step sends all
    batching: BatchPolicy | None = None
    #: sources: restored next offset per source uid and split
    source_offsets: dict[str, dict[int, int]] | None = None
    #: sources: restored newest timestamp per source uid and split (bounded out-of-orderness:
    #: the split watermarks resume there)
    source_max_timestamps: dict[str, dict[int, float]] | None = None

    @property
    def slack(self) -> float | None:
        """The event-time slack of either mode (None: the pipeline has no event time)."""
        return self.tracking.slack if self.tracking is not None else self.event_time_slack


class Task(ABC):
    """What both roles share: the driver's interface and the epoch-ending part (flush,
    capture, announce). Built as a ``SourceTask`` or a ``ConsumingTask``."""

    #: the role: reads splits (``SourceTask``) or consumes input channels
    is_source: ClassVar[bool] = False
    #: a source task's split reader (None: the task consumes)
    reader: SplitReader | None = None

    def __init__(self, plan: PhysicalPlan, task_id: TaskId, chain: ChainRuntime, config: TaskConfig) -> None:
        self.plan = plan
        self.id = task_id
        self.chain = chain
        self.config = config
        #: epoch of the records this task processes now; only grows
        self.epoch = config.start_epoch
        #: trAcker pass-through (``ConsumingTask.pass_through``): the epoch of the output being
        #: buffered, that of the input that caused it; None: output takes ``epoch``
        self.out_epoch: int | None = None
        self.out_channels = [c for chans in plan.outputs[task_id] for c in chans]
        tracking = config.tracking
        self.progress: Progress = InBand(chain.out, self.out_channels) if tracking is None else Tracked(chain.out,
                                                                                                          tracking)
        self.clock = EventClock(config.slack, plan.inputs[task_id])
        #: epoch triggers delivered and not yet applied (sources; aligned loop heads)
        self.triggers: deque[int] = deque()
        #: the driver delivers the coordinator's epoch triggers to this task (sources; loop heads)
        self.takes_triggers = False
        #: batches processed since the last flush: ``progress.flush`` accounts for them after
        #: the output they caused (the chain rule), then empties the list
        self._received: list[Batch] = []
        self.records_in = 0
        #: markers taken from the mailbox (the simulator charges each a step: ``SimConfig.marker_cost``)
        self.markers_in = 0
        #: epochs whose markers are aligned (savepoints): triggered so, or an aligned marker arrived
        self.aligned_epochs: set[int] = set()
        #: the batching policy: a channel holding ``rows`` rows is sent at the end of a step,
        #: the rest once its oldest row waited ``linger`` seconds (0: every step sends all)
        self.batching = config.batching or BatchPolicy()
        #: when the output buffered now began to wait (None: nothing is buffered)
        self._pending_since: float | None = None

    # ------------------------------------------------------------ events in
    @abstractmethod
    def receive(self, channel: int, message: Message) -> None:
        """A message on input ``channel``: buffered until ``step``."""

    @abstractmethod
    def restore_channel_state(self, entries: list[tuple[int, Any, Any, int | None]]) -> None:
        """Replay a restored snapshot's channel state before any new input: (channel, records,
        keys, watermark label) in the order it was recorded."""

    def trigger(self, epoch: int, aligned: bool = False) -> None:
        """Epoch ``epoch`` ends at this source now (coordinator's trigger); ``aligned``: a
        savepoint, whose markers are aligned in unaligned mode too."""
        self.triggers.append(epoch)
        if aligned:
            self.aligned_epochs.add(epoch)

    @abstractmethod
    def on_neoss(self, epoch: int | TimeNote) -> None:
        """The tracking agent's NEOSS(epoch) or ``WindowEnd`` for this task's segment (trAcker mode)."""

    # ------------------------------------------------------------ queries
    def has_input(self) -> bool:
        return bool(self.triggers)

    def flush_deadline(self) -> float | None:
        """When buffered output must leave (a step at or after it sends it), or None if
        nothing waits. Drivers step a task without input once this passes."""
        since = self._pending_since
        return None if since is None else since + self.batching.linger

    @property
    def overtakes(self) -> bool:
        """Markers are taken ahead of the records queued before them (unaligned mode)."""
        return False

    def source_has_more(self) -> bool:
        return False

    @property
    def offsets(self) -> dict[int, int]:
        """Next offset per split this task reads (empty unless it reads)."""
        return {}

    @property
    def late_records(self) -> int:
        """Records dropped as late: by its source (bounded out-of-orderness;
        ``runtime.watermarks``) and by its window functions (behind their watermark)."""
        return self.chain.late_records

    @property
    def dead_letters(self) -> int:
        """Records this task's ``from_json`` operators sent to their dead-letter outputs."""
        return self.chain.dead_letters

    @property
    def records_out(self) -> int:
        """Rows this task put out so far (channels and sinks; ``runtime.meters``)."""
        return self.chain.records_out

    @property
    def time_log(self) -> deque[tuple[int, float]]:
        return self.clock.time_log

    # ------------------------------------------------------------ work
    def step(self, now: float, budget: int = 1024, read_source: bool = True) -> list[TaskAction]:
        """Process up to ``budget`` records (or one message); return actions. ``read_source``:
        a source task reads (False: it only applies its triggers and sends what is due)."""
        actions: list[TaskAction] = []
        self.chain.set_now(now)
        try:
            self._step(now, budget, read_source, actions)
        except UserFunctionError as exc:  # say which subtask
            exc.locate(subtask=self.id[1])
            raise
        return actions

    @abstractmethod
    def _step(self, now: float, budget: int, read_source: bool, actions: list[TaskAction]) -> None:
        """The role's work of one step."""

    # ------------------------------------------------------------ the end of an epoch
    def _flush(self, actions: list[TaskAction]) -> None:
        """Send all buffered output and account for the input that caused it."""
        self._pending_since = None
        epoch = self.epoch if self.out_epoch is None else self.out_epoch
        self.progress.flush(epoch, self.clock.out_time, self._received, actions)

    def _flush_due(self, now: float, actions: list[TaskAction]) -> None:
        """The end of a step: send what the batching policy says is due. Without a linger that
        is everything; with one, every channel holding ``rows`` rows, and everything once the
        oldest buffered row waited ``linger`` seconds."""
        linger = self.batching.linger
        if linger <= 0:
            self._flush(actions)
            return
        fill = self.chain.out.fill()
        if not fill:
            if self._received:  # the input caused no output: account for it now
                self._flush(actions)
            self._pending_since = None
            return
        if self._pending_since is None:
            self._pending_since = now
        rows = self.batching.rows
        ready = [ch for ch, n in fill.items() if n >= rows]
        if len(ready) == len(fill) or now - self._pending_since >= linger:
            self._flush(actions)
        elif ready:
            epoch = self.epoch if self.out_epoch is None else self.out_epoch
            self.progress.flush(epoch, self.clock.out_time, self._received, actions, only=ready)

    def _end_epoch(self, epoch: int, waited: float, now: float, actions: list[TaskAction]) -> None:
        """Epoch ``epoch`` ends here: snapshot, announce, and go on in ``epoch + 1``."""
        self._capture_epoch(epoch, waited, now, actions, emit=True)

    def _capture_epoch(self, epoch: int, waited: float, now: float, actions: list[TaskAction],
                       emit: bool) -> TaskCapture:
        """Capture the chain at the end of ``epoch`` (``emit``: hand it over now, before the
        end is announced), announce the end, and go on in ``epoch + 1``."""
        self.chain.end_epoch(epoch)  # epoch-bound hooks emit into this epoch, before the flush
        self._flush(actions)
        config = self.config
        keyed, sinks, operator_state = self.chain.capture(epoch, config.incremental, config.full_every)
        offsets, max_ts = self._source_state()
        capture = TaskCapture(self.id, epoch, keyed, sinks, offsets, waited, self._held_records(), now,
                              operator_state, source_max_timestamps=max_ts)
        if emit:
            actions.append(Snapshot(capture))
        aligned = epoch in self.aligned_epochs
        self.aligned_epochs.discard(epoch)
        self.progress.epoch_ended(epoch, now, self.id if self.is_source else None, actions, aligned)
        self.epoch = epoch + 1
        if self.out_epoch is not None:  # nothing is buffered (flushed above): the next input sets it
            self.out_epoch = max(self.out_epoch, self.epoch)
        self.chain.set_epoch(self.epoch if self.out_epoch is None else self.out_epoch)
        return capture

    def _source_state(self) -> tuple[dict[str, dict[int, int]], dict[str, dict[int, float]]]:
        """A capture's source part: offsets and newest timestamps per split (none unless it reads)."""
        return {}, {}

    def _held_records(self) -> int:
        """Records held by the gate at a capture (none unless it consumes)."""
        return 0

    def check_invariants(self) -> None:
        """Called by the simulator after every step."""
        self._check_buffers()

    def _check_buffers(self) -> None:
        if self._pending_since is not None:  # lingering: nothing full, nothing older than the linger
            assert self.batching.linger > 0, f"task {self.id}: output waits without a linger"
            fill = self.chain.out.fill()
            assert fill and max(fill.values()) < self.batching.rows, f"task {self.id}: a full buffer waits: {fill}"
            return
        assert self.chain.out.pending() == 0, f"task {self.id}: unflushed output after step"
        assert not self._received, f"task {self.id}: received batches not accounted for after step"


class SourceTask(Task):
    """A source chain's task: its ``SplitReader`` reads the splits it owns; a trigger for
    epoch n flushes its output, captures its offsets and ends epoch n (Algorithm 5)."""

    is_source = True
    reader: SplitReader

    def __init__(self, plan: PhysicalPlan, task_id: TaskId, chain: ChainRuntime,
                 config: TaskConfig = TaskConfig()) -> None:
        super().__init__(plan, task_id, chain, config)
        spec = plan.chains[task_id[0]]
        if not spec.is_source:
            raise ValueError(f"task {task_id}: chain {spec.id} reads no source (build a ConsumingTask)")
        self.takes_triggers = True
        node = plan.nodes[spec.heads[0]]
        source: Source = node.payload
        assert node.uid is not None, f"source node {node.name!r} has no uid"
        splits = [s for s in source.split_ids() if source.owner(s, plan.parallelism) == task_id[1]]
        self.reader = SplitReader(source, node.uid, splits, (config.source_offsets or {}).get(node.uid, {}),
                                  config.slack, (config.source_max_timestamps or {}).get(node.uid),
                                  (task_id[1], plan.parallelism))
        self._source_push = chain.entry[node.id]
        self.exhausted_reported = False

    def receive(self, channel: int, message: Message) -> None:
        raise ProtocolError("Task", f"{self.id} reading", f"{type(message).__name__} on channel {channel}",
                            "a source task has no input channels")

    def restore_channel_state(self, entries: list[tuple[int, Any, Any, int | None]]) -> None:
        for channel, _records, _keys, _label in entries:
            raise ProtocolError("Task", f"{self.id} restoring", f"channel state of channel {channel}",
                                "not an input channel of this task")

    def on_neoss(self, epoch: int | TimeNote) -> None:
        """Nothing: a source's epochs end on triggers."""

    def source_has_more(self) -> bool:
        return self.reader.has_more()

    @property
    def offsets(self) -> dict[int, int]:
        return self.reader.offsets

    @property
    def late_records(self) -> int:
        return self.reader.late_records + self.chain.late_records

    def _source_state(self) -> tuple[dict[str, dict[int, int]], dict[str, dict[int, float]]]:
        reader = self.reader
        return {reader.uid: dict(reader.offsets)}, ({reader.uid: reader.watermarks.state()} if reader.watermarks
                                                   else {})

    def _step(self, now: float, budget: int, read_source: bool, actions: list[TaskAction]) -> None:
        reader = self.reader
        while self.triggers:
            self._end_epoch(self.triggers.popleft(), 0.0, now, actions)
        if read_source:
            self._read(reader, now, budget, actions)
        elif self._pending_since is not None:
            self._flush_due(now, actions)
        if not self.exhausted_reported and not reader.has_more():
            self.exhausted_reported = True
            actions.append(SourceExhausted(self.id))

    def _read(self, reader: SplitReader, now: float, budget: int, actions: list[TaskAction]) -> None:
        clock, push = self.clock, self._source_push
        runs = reader.read(budget, now)
        split = reader.last_read[0]
        for label, records, offset in runs:
            if label is not None and label != clock.out_time:
                self._flush(actions)  # a batch never spans two time labels
                clock.out_time = label
            try:
                push(records, None)
            except UserFunctionError as exc:  # name the split and offset the record was read from
                exc.locate(subtask=self.id[1], source=reader.uid, split=split, offset=offset, batch=records)
                raise
            self.records_in += len(records)
        if reader.has_more():
            self._flush_due(now, actions)
        else:  # nothing more will fill the buffers
            self._flush(actions)
        if reader.timestamp is not None:
            bound = reader.next_time_promise(now)
            if bound is not None:  # after the batches it covers
                self._flush(actions)
                clock.time_log.append((bound, now))
                self.progress.time_passed(bound, now, self.id, actions)


class ConsumingTask(Task):
    """A task of a chain with input channels: one mailbox in arrival order, a ``Gate`` that
    decides what waits and when an epoch ends, and in unaligned mode a channel-state
    ``Recorder`` (``recorder``; None in the other modes)."""

    def __init__(self, plan: PhysicalPlan, task_id: TaskId, chain: ChainRuntime, gate: Gate,
                 config: TaskConfig = TaskConfig(), recorder: Recorder | None = None) -> None:
        super().__init__(plan, task_id, chain, config)
        if plan.chains[task_id[0]].is_source:
            raise ValueError(f"task {task_id}: chain {task_id[0]} reads a source (build a SourceTask)")
        if gate.overtakes != (recorder is not None):
            raise ValueError(f"task {task_id}: a gate that overtakes needs a channel-state recorder, "
                             f"and only such a gate takes one")
        self.gate = gate
        self.exactly_once = gate.exactly_once
        #: unaligned mode (``alignment.channel_state``): markers taken early, channel state recorded
        self.recorder = recorder
        #: the input channels, in the plan's order
        self.inputs = plan.inputs[task_id]
        # -- events in, buffered until ``step``
        self.mailbox: deque[tuple[int, Message]] = deque()
        #: messages the gate refused, in arrival order; empty unless ``gate.holding``
        self.held: list[tuple[int, Message]] = []
        #: NEOSS epochs and ``WindowEnd`` notes delivered and not yet applied (trAcker mode)
        self.neoss: deque[int | TimeNote] = deque()
        self._entry_of_channel: dict[int, Push] = {c: chain.entry[plan.channels[c].dst_node] for c in self.inputs}
        #: channel -> watermarks of restored channel state still queued (``_on_watermark``)
        self._replays: dict[int, int] = {}

    # ------------------------------------------------------------ events in
    def receive(self, channel: int, message: Message) -> None:
        self.mailbox.append((channel, message))
        if type(message) is Marker and self.recorder is not None:
            self.recorder.scan = True

    def restore_channel_state(self, entries: list[tuple[int, Any, Any, int | None]]) -> None:
        """Replay a restored snapshot's channel state before any new input: (channel, records,
        keys, watermark label) in the order it was recorded, as messages of the current epoch."""
        for channel, records, keys, label in entries:
            if channel not in self._entry_of_channel:
                raise ProtocolError("Task", f"{self.id} restoring", f"channel state of channel {channel}",
                                    "not an input channel of this task")
            msg: Message = Watermark(label) if records is None and label is not None else \
                Batch(self.epoch, records, keys)
            if type(msg) is Watermark:  # its sender may announce it again (``EventClock.replayed``)
                self._replays[channel] = self._replays.get(channel, 0) + 1
            self.mailbox.append((channel, msg))

    def pass_through(self) -> None:
        """trAcker mode, a stateless chain (``TrackerConfig.pass_through``): process every record at
        once, whatever its epoch, and give its output the record's epoch. Only its sinks' output
        is in a snapshot, and each sink keeps one writer per epoch (``ChainRuntime.bucket_sinks``),
        so the order of epochs does not matter to it; the batches keep their epochs (the agent's
        assumption A1), so the NEOSS downstream stay what they were. The gate must be soft
        (``FirmBoundGate(firm=False)``): it still closes each epoch on NEOSS, and the capture of
        epoch n takes the sinks' epoch-n writers, complete because NEOSS(n) comes after the RCV
        of every record of epoch <= n."""
        if self.exactly_once:
            raise ValueError(f"task {self.id}: pass-through needs a soft gate and no source")
        self.out_epoch = self.epoch
        self.chain.bucket_sinks()
        self.chain.set_epoch(self.epoch)

    def on_neoss(self, epoch: int | TimeNote) -> None:
        self.neoss.append(epoch)

    # ------------------------------------------------------------ queries
    def has_input(self) -> bool:
        rec = self.recorder
        return bool(self.mailbox) or bool(self.triggers) or bool(self.neoss) or \
            (rec is not None and rec.cursor is not None)

    def flush_deadline(self) -> float | None:
        """Also when an alignment switches to unaligned (``aligned_timeout``)."""
        due = super().flush_deadline()
        rec = self.recorder
        switch = rec.switch_deadline() if rec is not None else None
        if switch is not None:  # aligned with a timeout: step at the switch even without input
            due = switch if due is None else min(due, switch)
        return due

    @property
    def overtakes(self) -> bool:
        return self.recorder is not None

    # ------------------------------------------------------------ work
    def _step(self, now: float, budget: int, read_source: bool, actions: list[TaskAction]) -> None:
        self._consume(now, budget, actions)

    def _consume(self, now: float, budget: int, actions: list[TaskAction]) -> None:
        """Apply the notifications, then take messages in arrival order until ``budget``
        records: the gate says what waits, a marker may end an epoch (and the step)."""
        if self.neoss:
            self._apply_neoss(now, actions)
        processed = self._resume(now, budget, actions)
        gate, mailbox, held = self.gate, self.mailbox, self.held
        while mailbox and processed < budget:
            channel, msg = mailbox.popleft()
            if not gate.admits(channel, msg, now):
                held.append((channel, msg))
            elif type(msg) is Marker:  # everything before it on this channel is processed
                if self._on_marker(channel, msg, now, actions):
                    break
            else:
                self._record_processed(channel, msg, actions)
                if type(msg) is Batch:
                    processed += self._on_batch(channel, msg, budget - processed, actions)
                elif type(msg) is Watermark:
                    self._on_watermark(channel, msg.label, now, actions)
        self._flush_due(now, actions)

    def _on_batch(self, channel: int, msg: Batch, room: int, actions: list[TaskAction]) -> int:
        """Process ``msg``, or (unaligned) its first ``room`` rows if it does not fit; the rows
        processed."""
        if self.out_epoch is not None and msg.epoch != self.out_epoch:
            self._flush(actions)  # a batch never spans two epochs
            self.out_epoch = msg.epoch
            self.chain.set_epoch(msg.epoch)
        clock = self.clock
        if self.progress.labels_batches and msg.time != clock.out_time:
            self._flush(actions)  # a batch never spans two time labels
            clock.out_time = msg.time
        rec = self.recorder
        # unaligned: a batch queued behind overtaking markers is of an older epoch (it is
        # channel state of every snapshot taken since it was queued)
        if self.exactly_once and msg.epoch != self.epoch and not (rec is not None and msg.epoch < self.epoch):
            raise ProtocolError(
                "Task", f"{self.id} in epoch {self.epoch}", f"Batch(epoch={msg.epoch})", f"on channel {channel}"
            )
        n = len(msg.records)
        self._received.append(msg)
        if rec is not None and n > room:
            # unaligned: cut the message at the budget, so a marker that arrives meanwhile
            # overtakes its rest (channel state) after this step
            rec.cut(channel, msg)
            return self._continue(rec, room)
        self._entry_of_channel[channel](msg.records, msg.keys)
        self.records_in += n
        return n

    def _on_marker(self, channel: int, marker: Marker, now: float, actions: list[TaskAction]) -> bool:
        """A marker at the head of the mailbox; True: the step ends (an epoch ended, or the
        marker waits for the pending epoch's channel state)."""
        self.markers_in += 1
        if marker.aligned:
            self.aligned_epochs.add(marker.epoch)
        rec = self.recorder
        if rec is None:
            ended = self.gate.on_marker(channel, marker.epoch, now)
        else:
            at = rec.at_head(channel, marker)
            if at is AtHead.OVERTAKE:
                self._take_marker(rec, channel, marker, [], now, actions)
                return False
            if at is AtHead.WAIT:
                self.mailbox.appendleft((channel, marker))
                return True
            ended = rec.on_aligned_marker(channel, marker, now)
        if ended is None:
            return False
        self._end_epoch(ended[0], ended[1], now, actions)
        self._release_held()
        return True

    # ------------------------------------------------------------ unaligned mode
    def _resume(self, now: float, budget: int, actions: list[TaskAction]) -> int:
        """Before the mailbox (unaligned mode): an alignment that timed out goes unaligned,
        queued markers overtake, and a message cut by the last step's budget goes on; the rows
        processed (``budget`` if the cut message still fills the step)."""
        rec = self.recorder
        if rec is None:
            return 0
        switched = rec.switch(now)
        if switched is not None:
            rec.begin(self._capture_epoch(switched[0], switched[1], now, actions, emit=False))
            self._release_held()
        if rec.scan:
            self._overtake(rec, now, actions)
        return self._continue(rec, budget) if rec.cursor is not None else 0

    def _overtake(self, rec: Recorder, now: float, actions: list[TaskAction]) -> None:
        """Take every marker the gate allows out of the mailbox, ahead of what is queued before
        it (Flink's priority events). The first marker n snapshots the task at once and
        forwards marker n; the messages queued ahead of a taken marker on its channel are
        channel state of n (copied now, still processed later, in epoch n + 1). When the last
        channel's marker n is taken the capture, with its channel state, is handed over.

        Output: the buffered output is flushed and then marker n follows it, rather than the
        marker overtaking the output buffers. That is equivalent here: what the buffers hold is
        at most one step's output, and on the receiver it is queued ahead of marker n, so it
        becomes the receiver's channel state exactly as Flink's overtaken output buffers become
        the sender's."""
        items = rec.scan_mailbox(self.mailbox, now)
        while (found := rec.next_overtaking(items)) is not None:
            channel, marker, ahead = found
            self._take_marker(rec, channel, marker, ahead, now, actions)
        self.mailbox = deque(items)

    def _take_marker(self, rec: Recorder, channel: int, marker: Marker, ahead: list[Message], now: float,
                     actions: list[TaskAction]) -> None:
        """``marker`` taken on ``channel`` ahead of ``ahead`` (its channel state); the first
        marker of an epoch snapshots now and goes on in the next epoch, its capture waiting
        for its channel state."""
        started = rec.take(channel, marker, now)
        if started is not None:
            rec.begin(self._capture_epoch(started, 0.0, now, actions, emit=False))
        done = rec.taken(channel, marker, ahead)
        if done is not None:
            actions.append(done)

    def _record_processed(self, channel: int, msg: Message, actions: list[TaskAction]) -> None:
        rec = self.recorder
        if rec is not None:
            done = rec.processed(channel, msg)
            if done is not None:
                actions.append(done)

    def _continue(self, rec: Recorder, budget: int) -> int:
        """Process up to ``budget`` more rows of the cut message; the rows processed."""
        channel, records, keys = rec.next_rows(budget)
        self._entry_of_channel[channel](records, keys)
        self.records_in += len(records)
        return len(records)

    # ------------------------------------------------------------ event time and NEOSS
    def _on_watermark(self, channel: int, label: int, now: float, actions: list[TaskAction]) -> None:
        """Aligned modes: fire the timers and forward when the input's watermark grows."""
        clock = self.clock
        replays = self._replays.get(channel)
        if replays:  # the first watermarks of this channel come from restored channel state
            if replays == 1:
                del self._replays[channel]
            else:
                self._replays[channel] = replays - 1
            low = clock.replayed(channel, label)
        else:
            low = clock.on_watermark(channel, label)
        if low is None:
            return
        self._flush(actions)
        clock.out_time = low
        self._fire_timers(low)
        if self.chain.timed:
            clock.time_log.append((low, now))
        self._flush(actions)
        self.progress.time_passed(low, now, None, actions)

    def _apply_neoss(self, now: float, actions: list[TaskAction]) -> None:
        """Close the epochs NEOSS ends: snapshot each (no markers), then release held records."""
        self._flush(actions)
        gate = self.gate
        while self.neoss:
            note = self.neoss.popleft()
            if isinstance(note, int):
                for epoch in gate.on_neoss(note, now):
                    self._end_epoch(epoch, gate.last_hold_seconds, now, actions)
            else:
                self._window_end(note, actions)
                self.clock.time_log.append((note.label, now))
        self._release_held()

    def _window_end(self, note: TimeNote, actions: list[TaskAction]) -> None:
        """Fire the timers event time passed; acknowledge after reporting their output."""
        if note.epoch != self.epoch:
            raise ProtocolError(
                "Task", f"{self.id} in epoch {self.epoch}", f"WindowEnd(label={note.label}, epoch={note.epoch})",
                "a WindowEnd must follow the NEOSS of the epoch before it (FIFO agent link)",
            )
        self._flush(actions)
        self.clock.out_time = note.label
        self._fire_timers(note.label)
        self._flush(actions)  # SNDs of the timer output first, then the acknowledgements
        self.progress.window_ended(note, self.id)

    def _fire_timers(self, label: int) -> None:
        slack = self.clock.slack
        if slack is None:
            raise ProtocolError("Task", f"{self.id} without event time", f"time label {label}",
                                "event time reached a task of a pipeline without event time")
        self.chain.fire_timers(label, slack)

    def _release_held(self) -> None:
        if self.held:
            self.mailbox.extendleft(reversed(self.held))
            self.held.clear()

    def _held_records(self) -> int:
        return sum(len(m) for _c, m in self.held if type(m) is Batch)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self.epoch == self.gate.open_epoch, f"task {self.id}: epoch {self.epoch} != open epoch"
        if self.recorder is not None:
            self.recorder.check_invariants()

    def _check_buffers(self) -> None:
        super()._check_buffers()
        if self._pending_since is None and not self.gate.holding:
            assert not self.held, f"task {self.id}: held messages but the gate holds nothing"
