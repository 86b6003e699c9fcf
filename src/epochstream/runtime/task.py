"""A task: mailbox controller + business logic handler for one subtask of one chain.

Theory of operation. The driver hands messages to ``receive`` (buffer only), epoch
triggers to ``trigger`` (sources) and notifications to ``on_neoss`` (trAcker mode), then
calls ``step(now, budget)``, which does the work and returns ``TaskAction``s (``Send``,
``Snapshot``, ``SourceExhausted``). A task plays one of two roles, fixed by the plan:

* it *reads* (a source chain): its ``SplitReader`` reads splits from their offsets; on a
  trigger for epoch n the task flushes its output, captures its offsets and ends epoch n
  (Algorithm 5);
* it *consumes* its input channels: the mailbox is one FIFO of (channel, message) in
  arrival order, and its ``Gate`` (``runtime.gate``) decides what waits and when an epoch
  ends: the barrier aligner blocks channels whose marker arrived and ends epoch n at the
  last marker n (Algorithm 6), the trAcker's firm-bound gate holds records of epochs after
  the open one and ends epochs on NEOSS. Messages the gate refuses are set aside and put
  back at the head of the mailbox, in arrival order, when an epoch ends.

Either way an epoch ends the same way (``_end_epoch``): epoch-bound hooks run, the output
is flushed (so a batch never spans two epochs), the chain's state is captured into a
``Snapshot``, and ``Progress`` (``runtime.progress``) announces the end: marker n on
every output channel in the aligned modes, a promise to the tracker from a trAcker-mode
source.

Event time (``runtime.eventtime``). Sources cut their reads into runs of one time label;
the task flushes whenever the label of its output changes. In trAcker mode the label rides
on every batch and a consuming task flushes when its input's label changes; a
``WindowEnd`` (it comes with the NEOSS notes) fires the timers it passes. In the aligned
modes a grown time promise travels as ``Watermark`` punctuation: a consuming task's
watermark is the minimum over its channels, and when it grows the task fires its timers
and forwards it. A watermark behind a marker on a blocked channel waits with the channel.

Why composition. The mode (gate and progress) and the role (reading or consuming) vary
independently, and a loop head (``loops.task``) varies both again; subclassing each
combination would copy ``_end_epoch`` and the flush rules into four classes. So a task is
the mailbox and the epoch bookkeeping, and holds small objects for what varies: a
``SplitReader`` (or None), a ``Gate``, a ``Progress`` and an ``EventClock``. Each is tested
alone; the task calls them per batch or per epoch, never per record, and the consuming
path has no mode test: the gate and the progress object decide.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import replace
from typing import Any, Callable, cast

from ..graph.plan import PhysicalPlan
from .batching import BatchPolicy
from .chain import ChainRuntime
from .errors import ProtocolError, StateSerializationError, UserFunctionError
from .eventtime import EventClock
from .gate import Gate, Overtaking
from .messages import Batch, Marker, Message, Snapshot, SourceExhausted, TaskAction, TaskCapture, TaskId, Watermark
from .progress import InBand, Progress
from .reader import SplitReader
from .sources import Source
from .tracking import TaskTracking, TimeNote, Tracked

Push = Callable[[list[Any], "list[Any] | None"], None]


class Task:
    def __init__(
        self,
        plan: PhysicalPlan,
        task_id: TaskId,
        chain: ChainRuntime,
        gate: Gate,
        start_epoch: int = 1,
        incremental: bool = True,
        full_every: int = 10,
        source_offsets: dict[str, dict[int, int]] | None = None,
        tracking: TaskTracking | None = None,
        event_time_slack: float | None = None,
        batching: BatchPolicy | None = None,
        source_max_timestamps: dict[str, dict[int, float]] | None = None,
    ) -> None:
        """``tracking``: None (aligned modes) or a ``TaskTracking`` (trAcker mode, which
        carries the event-time slack); ``event_time_slack``: the aligned modes' (watermarks);
        ``batching``: when output leaves (``runtime.batching``; default: every step);
        ``source_max_timestamps``: restored newest timestamp per source uid and split
        (bounded out-of-orderness: the split watermarks resume there)."""
        self.plan = plan
        self.id = task_id
        self.chain = chain
        self.gate = gate
        self.exactly_once = gate.exactly_once
        #: epoch of the records this task processes now; only grows
        self.epoch = start_epoch
        #: trAcker pass-through (``pass_through``): the epoch of the output being buffered, that of the
        #: input that caused it; None: output takes ``epoch``
        self.out_epoch: int | None = None
        self.incremental = incremental
        self.full_every = full_every
        self.inputs = plan.inputs[task_id]
        self.out_channels = [c for chans in plan.outputs[task_id] for c in chans]
        self.progress: Progress = InBand(chain.out, self.out_channels) if tracking is None else Tracked(chain.out,
                                                                                                          tracking)
        slack = tracking.slack if tracking is not None else event_time_slack
        self.clock = EventClock(slack, self.inputs)
        # -- events in, buffered until ``step``
        self.mailbox: deque[tuple[int, Message]] = deque()
        #: messages the gate refused, in arrival order; empty unless ``gate.holding``
        self.held: list[tuple[int, Message]] = []
        self.triggers: deque[int] = deque()
        #: NEOSS epochs and ``WindowEnd`` notes delivered and not yet applied (trAcker mode)
        self.neoss: deque[int | TimeNote] = deque()
        #: batches processed since the last flush: ``progress.flush`` accounts for them after
        #: the output they caused (the chain rule), then empties the list
        self._received: list[Batch] = []
        self._entry_of_channel: dict[int, Push] = {c: chain.entry[plan.channels[c].dst_node] for c in self.inputs}
        self.records_in = 0
        #: markers taken from the mailbox (the simulator charges each a step: ``SimConfig.marker_cost``)
        self.markers_in = 0
        self.exhausted_reported = False
        #: epochs whose markers are aligned (savepoints): triggered so, or an aligned marker arrived
        self.aligned_epochs: set[int] = set()
        # -- unaligned mode (``alignment.unaligned``): markers overtake, channel state is recorded
        self.overtakes = gate.overtakes
        self._overtaking = cast(Overtaking, gate) if gate.overtakes else None
        #: a marker arrived since the last scan of the mailbox (or an epoch's capture completed)
        self._scan = False
        #: the capture of the epoch whose channel state is still being recorded
        self._unaligned: TaskCapture | None = None
        #: its channel state so far: each entry one pickled (channel, records, keys, watermark)
        self._channel_state: list[bytes] = []
        self._channel_records = 0
        #: channel -> messages still queued ahead of its taken marker (copied when it was taken);
        #: only kept while the marker also owes messages it overtook at the sender
        self._skip: dict[int, int] = {}
        #: unaligned mode: a message cut by the step budget, (channel, batch, rows done); its
        #: rest is conceptually at the head of its channel, so a marker can overtake it
        #: between two steps instead of waiting for the whole message (``_consume``)
        self._cursor: tuple[int, Batch, int] | None = None
        #: whether the cursor's unprocessed rows are already channel state of the pending epoch
        self._cursor_recorded = False
        #: channel -> watermarks of restored channel state still queued (``_on_watermark``)
        self._replays: dict[int, int] = {}
        policy = batching or BatchPolicy()
        #: the batching policy: a channel holding ``batch_rows`` rows is sent at the end of a
        #: step, the rest once its oldest row waited ``linger`` seconds (0: every step sends all)
        self.batch_rows = policy.rows
        self.linger = policy.linger
        #: when the output buffered now began to wait (None: nothing is buffered)
        self._pending_since: float | None = None
        # -- the source role
        spec = plan.chains[task_id[0]]
        self.is_source = spec.is_source
        #: the driver delivers the coordinator's epoch triggers to this task (sources; loop heads)
        self.takes_triggers = spec.is_source
        self.reader: SplitReader | None = None
        if self.is_source:
            node = plan.nodes[spec.heads[0]]
            source: Source = node.payload
            assert node.uid is not None, f"source node {node.name!r} has no uid"
            splits = [s for s in source.split_ids() if source.owner(s, plan.parallelism) == task_id[1]]
            self.reader = SplitReader(source, node.uid, splits, (source_offsets or {}).get(node.uid, {}), slack,
                                      (source_max_timestamps or {}).get(node.uid), (task_id[1], plan.parallelism))
            self._source_push = chain.entry[node.id]

    # ------------------------------------------------------------ events in
    def receive(self, channel: int, message: Message) -> None:
        self.mailbox.append((channel, message))
        if self.overtakes and type(message) is Marker:
            self._scan = True

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

    def trigger(self, epoch: int, aligned: bool = False) -> None:
        """Epoch ``epoch`` ends at this source now (coordinator's trigger); ``aligned``: a
        savepoint, whose markers are aligned in unaligned mode too."""
        self.triggers.append(epoch)
        if aligned:
            self.aligned_epochs.add(epoch)

    def pass_through(self) -> None:
        """trAcker mode, a stateless chain (``TrackerConfig.pass_through``): process every record at
        once, whatever its epoch, and give its output the record's epoch. Only its sinks' output
        is in a snapshot, and each sink keeps one writer per epoch (``ChainRuntime.bucket_sinks``),
        so the order of epochs does not matter to it; the batches keep their epochs (the agent's
        assumption A1), so the NEOSS downstream stay what they were. The gate must be soft
        (``FirmBoundGate(firm=False)``): it still closes each epoch on NEOSS, and the capture of
        epoch n takes the sinks' epoch-n writers, complete because NEOSS(n) comes after the RCV
        of every record of epoch <= n."""
        if self.exactly_once or self.reader is not None:
            raise ValueError(f"task {self.id}: pass-through needs a soft gate and no source")
        self.out_epoch = self.epoch
        self.chain.bucket_sinks()
        self.chain.set_epoch(self.epoch)

    def on_neoss(self, epoch: int | TimeNote) -> None:
        """The tracking agent's NEOSS(epoch) or ``WindowEnd`` for this task's segment (trAcker mode)."""
        if not self.is_source:
            self.neoss.append(epoch)

    # ------------------------------------------------------------ queries
    def has_input(self) -> bool:
        return bool(self.mailbox) or bool(self.triggers) or bool(self.neoss) or self._cursor is not None

    def flush_deadline(self) -> float | None:
        """When buffered output must leave (a step at or after it sends it) or an alignment
        switches to unaligned (``aligned_timeout``), or None if nothing waits. Drivers step a
        task without input once this passes."""
        since = self._pending_since
        due = None if since is None else since + self.linger
        og = self._overtaking
        switch = og.switch_deadline() if og is not None else None
        if switch is not None:  # aligned with a timeout: step at the switch even without input
            due = switch if due is None else min(due, switch)
        return due

    def source_has_more(self) -> bool:
        return self.reader is not None and self.reader.has_more()

    @property
    def offsets(self) -> dict[int, int]:
        """Next offset per split this task reads (empty unless it reads)."""
        return self.reader.offsets if self.reader is not None else {}

    @property
    def late_records(self) -> int:
        """Records dropped as late: by its source (bounded out-of-orderness;
        ``runtime.watermarks``) and by its window functions (behind their watermark)."""
        return (self.reader.late_records if self.reader is not None else 0) + self.chain.late_records

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
        """Process up to ``budget`` records (or one message); return actions."""
        actions: list[TaskAction] = []
        self.chain.set_now(now)
        try:
            if self.reader is not None:
                self._read(self.reader, now, budget, read_source, actions)
            else:
                self._consume(now, budget, actions)
        except UserFunctionError as exc:  # say which subtask
            exc.locate(subtask=self.id[1])
            raise
        return actions

    def _read(self, reader: SplitReader, now: float, budget: int, read_source: bool,
              actions: list[TaskAction]) -> None:
        while self.triggers:
            self._end_epoch(self.triggers.popleft(), 0.0, now, actions)
        if read_source:
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
        elif self._pending_since is not None:
            self._flush_due(now, actions)
        if not self.exhausted_reported and not reader.has_more():
            self.exhausted_reported = True
            actions.append(SourceExhausted(self.id))

    def _consume(self, now: float, budget: int, actions: list[TaskAction]) -> None:
        if self.neoss:
            self._apply_neoss(now, actions)
        og = self._overtaking
        if og is not None:  # aligned with a timeout: an alignment that took too long goes unaligned
            switched = og.switch(now)
            if switched is not None:
                self._begin_unaligned(switched[0], now, actions, switched[1])
                self._release_held()
                self._scan = True
        if self._scan:
            self._overtake(now, actions)
        processed = 0
        if self._cursor is not None:  # the rest of a message cut by the last step's budget
            processed = self._continue(budget)
            if self._cursor is not None:
                self._flush_due(now, actions)
                return
        gate, mailbox, held, received, clock = self.gate, self.mailbox, self.held, self._received, self.clock
        labelled = self.progress.labels_batches
        overtakes = self.overtakes
        while mailbox and processed < budget:
            channel, msg = mailbox.popleft()
            if not gate.admits(channel, msg, now):
                held.append((channel, msg))
                continue
            if overtakes and type(msg) is not Marker and self._unaligned is not None and \
                    cast(Overtaking, gate).recording(channel):
                self._record_processed(channel, msg, actions)
            if type(msg) is Batch:
                if self.out_epoch is not None and msg.epoch != self.out_epoch:
                    self._flush(actions)  # a batch never spans two epochs
                    self.out_epoch = msg.epoch
                    self.chain.set_epoch(msg.epoch)
                if labelled and msg.time != clock.out_time:
                    self._flush(actions)  # a batch never spans two time labels
                    clock.out_time = msg.time
                # unaligned: a batch queued behind overtaking markers is of an older epoch (it
                # is channel state of every snapshot taken since it was queued)
                if self.exactly_once and msg.epoch != self.epoch and not (overtakes and msg.epoch < self.epoch):
                    raise ProtocolError(
                        "Task", f"{self.id} in epoch {self.epoch}", f"Batch(epoch={msg.epoch})", f"on channel {channel}"
                    )
                n = len(msg.records)
                received.append(msg)
                if overtakes and n > budget - processed:
                    # unaligned: cut the message at the budget, so a marker that arrives
                    # meanwhile overtakes its rest (channel state) after this step
                    og = cast(Overtaking, gate)
                    self._cursor = (channel, msg, 0)
                    self._cursor_recorded = self._unaligned is not None and og.recording(channel)
                    processed += self._continue(budget - processed)
                    if self._cursor is not None:
                        break
                    continue
                self._entry_of_channel[channel](msg.records, msg.keys)
                processed += n
                self.records_in += n
            elif type(msg) is Watermark:
                self._on_watermark(channel, msg.label, now, actions)
            elif type(msg) is Marker:  # everything before it on this channel is processed
                self.markers_in += 1
                if msg.aligned:
                    self.aligned_epochs.add(msg.epoch)
                if overtakes:
                    og = cast(Overtaking, gate)
                    if not msg.aligned and og.may_overtake(channel, msg.epoch):
                        self._take_marker(channel, msg, [], now, actions)
                        continue
                    if not (msg.aligned or og.aligns(msg.epoch)):
                        mailbox.appendleft((channel, msg))  # it waits at the head for the pending epoch
                        break
                    aligned = og.on_aligned_marker(channel, msg.epoch, now, msg.aligned)
                else:
                    aligned = gate.on_marker(channel, msg.epoch, now)
                if aligned is not None:
                    self._end_epoch(aligned[0], aligned[1], now, actions)
                    self._release_held()
                    self._scan = overtakes  # markers held behind the aligned one may be taken now
                    break
        self._flush_due(now, actions)

    def _continue(self, budget: int) -> int:
        """Process up to ``budget`` more rows of the cut message; the rows processed."""
        assert self._cursor is not None
        channel, msg, done = self._cursor
        stop = min(len(msg.records), done + max(budget, 1))
        records, keys = _rows(msg, done, stop)
        self._entry_of_channel[channel](records, keys)
        self.records_in += stop - done
        if stop == len(msg.records):
            self._cursor, self._cursor_recorded = None, False
        else:
            self._cursor = (channel, msg, stop)
        return stop - done

    def _record_cursor(self) -> None:
        """The cut message's unprocessed rows become channel state of the pending epoch."""
        assert self._cursor is not None
        channel, msg, done = self._cursor
        records, keys = _rows(msg, done, len(msg.records))
        self._record(channel, Batch(msg.epoch, records, keys, msg.id, msg.time))
        self._cursor_recorded = True

    def _overtake(self, now: float, actions: list[TaskAction]) -> None:
        """Unaligned mode: take every marker the gate allows out of the mailbox, ahead of what
        is queued before it (Flink's priority events). The first marker n snapshots the task at
        once and forwards marker n; the messages queued ahead of a taken marker on its channel
        are channel state of n (copied now, still processed later, in epoch n + 1). When the
        last channel's marker n is taken the capture, with its channel state, is handed over.

        Output: the buffered output is flushed and then marker n follows it, rather than the
        marker overtaking the output buffers. That is equivalent here: what the buffers hold is
        at most one step's output, and on the receiver it is queued ahead of marker n, so it
        becomes the receiver's channel state exactly as Flink's overtaken output buffers become
        the sender's."""
        self._scan = False
        gate = self._overtaking
        assert gate is not None, f"task {self.id}: scanning for markers without an overtaking gate"
        items = list(self.mailbox)
        if gate.aligned_timeout is not None:  # the timeout runs from the first queued marker seen
            for _channel, msg in items:
                if type(msg) is Marker and not msg.aligned:
                    gate.announce(msg.epoch, now)
        taken = True
        while taken:
            taken = False
            for i, (channel, msg) in enumerate(items):
                if type(msg) is not Marker or msg.aligned or not gate.may_overtake(channel, msg.epoch):
                    continue  # an aligned (savepoint) marker is taken in FIFO order
                ahead = [m for c, m in items[:i] if c == channel and type(m) is not Marker]
                del items[i]
                self._take_marker(channel, msg, ahead, now, actions)
                taken = True
                break
        self.mailbox = deque(items)

    def _take_marker(self, channel: int, marker: Marker, ahead: list[Message], now: float,
                     actions: list[TaskAction]) -> None:
        """``marker`` taken on ``channel`` ahead of ``ahead`` (its channel state)."""
        gate = self._overtaking
        assert gate is not None
        owed = marker.overtook - len(marker.carried)  # overtaken at the sender and not carried
        started = gate.on_marker(channel, marker.epoch, now, owed)
        if started is not None:
            self._begin_unaligned(started[0], now, actions)
        cursor = self._cursor
        if cursor is not None and cursor[0] == channel and not self._cursor_recorded:
            self._record_cursor()  # the rest of the cut message is the head of this channel
        for m in ahead:
            self._record(channel, m)
        for m in marker.carried:  # queued at the sender: they follow the marker, already recorded
            self._record(channel, m)
        if owed and ahead:  # processed later: already recorded, before what it overtook
            self._skip[channel] = len(ahead)
        if gate.take_completed() is not None:
            self._complete_unaligned(actions)

    def _record_processed(self, channel: int, msg: Message, actions: list[TaskAction]) -> None:
        """A message processed from a channel that is recording: channel state, unless it was
        copied when its marker was taken; one the marker overtook at the sender counts down."""
        gate = self._overtaking
        assert gate is not None
        skip = self._skip.get(channel)
        if skip:
            if skip == 1:
                del self._skip[channel]
            else:
                self._skip[channel] = skip - 1
            return
        self._record(channel, msg)  # before the chain may mutate it
        if channel in gate.owed:
            gate.on_overtaken(channel)
            if gate.take_completed() is not None:
                self._complete_unaligned(actions)

    def _begin_unaligned(self, epoch: int, now: float, actions: list[TaskAction], waited: float = 0.0) -> None:
        """The first marker ``epoch`` was taken (or its alignment timed out after ``waited``
        seconds): snapshot now, forward the marker, go on in ``epoch + 1``; the capture waits
        for its channel state."""
        self._unaligned = self._capture_epoch(epoch, waited, now, actions, emit=False)
        self._channel_state = []
        self._channel_records = 0
        og = self._overtaking
        assert og is not None
        if self._cursor is not None and og.recording(self._cursor[0]):
            # the rest of a cut message is processed after this snapshot and before its
            # channel's marker (a marker taken on that channel records it with what it passed)
            self._record_cursor()

    def _record(self, channel: int, msg: Message) -> None:
        try:
            self._channel_state.append(_encode(channel, msg))
        except Exception as exc:  # a record that cannot be pickled cannot be channel state
            raise StateSerializationError(
                f"task {self.id}: a record on input channel {channel} cannot be stored as channel state of an "
                f"unaligned snapshot ({type(exc).__name__}: {exc}); records must pickle in mode 'unaligned' "
                f"(or use mode 'aligned')") from exc
        if type(msg) is Batch:
            self._channel_records += len(msg)

    def _complete_unaligned(self, actions: list[TaskAction]) -> None:
        capture, entries = self._unaligned, self._channel_state
        assert capture is not None, f"task {self.id}: channel state complete without a capture"
        self._unaligned, self._channel_state = None, []
        self._skip.clear()
        self._cursor_recorded = False  # the rest of a cut message is channel state of the next epoch too
        self._scan = True  # a marker of the next epoch may be waiting deeper in the mailbox
        blob = pickle.dumps(entries, pickle.HIGHEST_PROTOCOL) if entries else b""
        actions.append(Snapshot(replace(capture, channel_state=blob, channel_state_records=self._channel_records,
                                        channel_state_bytes=len(blob))))

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

    def _flush(self, actions: list[TaskAction]) -> None:
        """Send all buffered output and account for the input that caused it."""
        self._pending_since = None
        epoch = self.epoch if self.out_epoch is None else self.out_epoch
        self.progress.flush(epoch, self.clock.out_time, self._received, actions)

    def _flush_due(self, now: float, actions: list[TaskAction]) -> None:
        """The end of a step: send what the batching policy says is due. Without a linger that
        is everything; with one, every channel holding ``batch_rows`` rows, and everything once
        the oldest buffered row waited ``linger`` seconds."""
        if self.linger <= 0:
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
        rows = self.batch_rows
        ready = [ch for ch, n in fill.items() if n >= rows]
        if len(ready) == len(fill) or now - self._pending_since >= self.linger:
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
        keyed, sinks, operator_state = self.chain.capture(epoch, self.incremental, self.full_every)
        reader = self.reader
        offsets = {reader.uid: dict(reader.offsets)} if reader is not None else {}
        max_ts = {reader.uid: reader.watermarks.state()} if reader is not None and reader.watermarks else {}
        held = sum(len(m) for _c, m in self.held if type(m) is Batch)
        capture = TaskCapture(self.id, epoch, keyed, sinks, offsets, waited, held, now, operator_state,
                              source_max_timestamps=max_ts)
        if emit:
            actions.append(Snapshot(capture))
        aligned = epoch in self.aligned_epochs
        self.aligned_epochs.discard(epoch)
        self.progress.epoch_ended(epoch, now, self.id if reader is not None else None, actions, aligned)
        self.epoch = epoch + 1
        if self.out_epoch is not None:  # nothing is buffered (flushed above): the next input sets it
            self.out_epoch = max(self.out_epoch, self.epoch)
        self.chain.set_epoch(self.epoch if self.out_epoch is None else self.out_epoch)
        return capture

    def check_invariants(self) -> None:
        """Called by the simulator after every step."""
        self._check_buffers()
        if self.reader is None:
            assert self.epoch == self.gate.open_epoch, f"task {self.id}: epoch {self.epoch} != open epoch"
        if self.overtakes:
            assert (self._unaligned is None) == (getattr(self.gate, "pending", None) is None), \
                f"task {self.id}: a pending capture without a pending epoch (or the reverse)"

    def _check_buffers(self) -> None:
        if self._pending_since is not None:  # lingering: nothing full, nothing older than the linger
            assert self.linger > 0, f"task {self.id}: output waits without a linger"
            fill = self.chain.out.fill()
            assert fill and max(fill.values()) < self.batch_rows, f"task {self.id}: a full buffer waits: {fill}"
            return
        assert self.chain.out.pending() == 0, f"task {self.id}: unflushed output after step"
        assert not self._received, f"task {self.id}: received batches not accounted for after step"
        if not self.gate.holding:
            assert not self.held, f"task {self.id}: held messages but the gate holds nothing"


def _rows(msg: Batch, start: int, stop: int) -> tuple[Any, Any]:
    """Rows ``start:stop`` of a batch (a list or an Arrow ``RecordBatch``) and their keys."""
    records: Any = msg.records
    keys = msg.keys
    if start == 0 and stop == len(records):
        return records, keys
    part = records[start:stop] if type(records) is list else records.slice(start, stop - start)
    return part, (keys[start:stop] if keys is not None else None)


def _encode(channel: int, msg: Message) -> bytes:
    """One entry of channel state, pickled when it is recorded (the chain may mutate records)."""
    if type(msg) is Batch:
        return pickle.dumps((channel, msg.records, msg.keys, None), pickle.HIGHEST_PROTOCOL)
    assert type(msg) is Watermark, f"channel state holds batches and watermarks, not {msg!r}"
    return pickle.dumps((channel, None, None, msg.label), pickle.HIGHEST_PROTOCOL)


def decode_channel_state(blob: bytes) -> list[tuple[int, Any, Any, int | None]]:
    """Channel state as stored (``TaskCapture.channel_state``): (channel, records, keys,
    watermark label) in the order recorded."""
    return [pickle.loads(e) for e in pickle.loads(blob)] if blob else []
