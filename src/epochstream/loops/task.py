"""The loop head's task: a ``runtime.task.ConsumingTask`` whose input is the phantom channel.

In the aligned modes (exactly-once and at-least-once) the head is not aligned: its only
input is the phantom channel, and waiting there for a marker it sent itself would close
the cycle again. Instead the head runs Algorithm 7 (``loops.head.LoopHead``): a trigger
from the coordinator flushes what it forwarded so far, sends the marker into the loop and
opens a log; records from the phantom channel are forwarded and, while an epoch is open,
logged; the marker coming back closes the epoch and the log becomes the head's snapshot.
Records from the phantom channel are re-stamped with the head's epoch (they were sent in
an earlier one): that re-stamping is the cut, and the log is what it cut through.

The log is written as the keyed state of the head's uid (one value per subtask, under the
subtask's first key group), so it goes through ``ChainRuntime.capture`` and the driver's
``persist`` like any operator's state: every backend stores it, incremental captures skip
it while it stays empty, and rescaling moves it by key group. On restore the head first
re-emits the restored log into the loop, then forwards as usual (thesis §4.1.3.1).

In tracker mode there are no markers and nothing to log: the loop is one segment whose
epoch ends when the tracking agent sees it drained, so the head is an ordinary task; it
still re-emits a restored log (a checkpoint taken in aligned mode).
"""

from __future__ import annotations

from typing import Any

from ..runtime.messages import Batch, Marker, Send, Snapshot, TaskAction, TaskCapture
from ..runtime.state import ValueState, ValueStateDescriptor
from ..runtime.task import ConsumingTask
from .head import LoopHead

#: the state (of the head's uid) holding the log of in-transit records
LOG_STATE = "in_transit"


class LoopHeadTask(ConsumingTask):
    """A ``ConsumingTask`` that, in the aligned modes, runs Algorithm 7 instead of consuming through its gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = self.plan.chains[self.id[0]]
        node = self.plan.nodes[spec.heads[0]]
        assert node.uid is not None, f"loop head {node.name!r} has no uid"
        self.uid = node.uid
        self.head = LoopHead(last_triggered=self.epoch - 1)
        #: markers travel in band: the head is triggered like a source and logs (Algorithm 7)
        self.logging = self.progress.in_band
        self.takes_triggers = self.logging
        self._state = self.chain.states[self.uid]
        log = self._state.handle(ValueStateDescriptor(LOG_STATE))
        assert isinstance(log, ValueState)
        self._log = log
        self._own_key = self._state.key_group_range[0]
        self._push = self.chain.entry[node.id]
        #: records of the restored log, re-emitted by the first step before anything else
        self.replay: list[Any] = [r for _k, rs in self._state.entries(LOG_STATE) for r in rs]
        self.replayed = len(self.replay)

    def has_input(self) -> bool:
        return bool(self.replay) or super().has_input()

    def step(self, now: float, budget: int = 1024, read_source: bool = True) -> list[TaskAction]:
        actions: list[TaskAction] = []
        if self.replay:
            records, self.replay = self.replay, []
            self._push(records, None)  # flushed below, stamped with the restored epoch + 1
            self.records_in += len(records)
            self._clear_log()  # replayed: the next capture must not carry it again
        if not self.logging:
            return actions + super().step(now, budget, read_source)
        head = self.head
        while self.triggers:
            epoch = self.triggers.popleft()
            self._flush(actions)  # what was forwarded before the trigger belongs to the epoch
            head.on_trigger(epoch)
            marker = Marker(epoch, epoch in self.aligned_epochs)
            self.aligned_epochs.discard(epoch)
            for ch in self.out_channels:
                actions.append(Send(ch, marker))
            self.epoch = epoch + 1
            self.chain.set_epoch(self.epoch)
        processed = 0
        mailbox = self.mailbox
        while mailbox and processed < budget:
            _channel, msg = mailbox.popleft()
            if type(msg) is Batch:
                head.on_records(msg.records)
                self._push(msg.records, msg.keys)
                processed += len(msg.records)
                self.records_in += len(msg.records)
            elif type(msg) is Marker:
                self._snapshot(msg.epoch, head.on_marker(msg.epoch), actions, now)
        self._flush(actions)
        return actions

    def _snapshot(self, epoch: int, logged: list[Any], actions: list[TaskAction], now: float) -> None:
        """The marker of ``epoch`` is back: its log is the head's state for ``epoch``."""
        self._clear_log()
        if logged:
            self._state.keys.key = self._own_key
            self._log.update(logged)
        keyed, sinks, ops = self.chain.capture(epoch, self.config.incremental, self.config.full_every)
        nbytes = sum(len(v) for kc in keyed if kc.operator_uid == self.uid for _kg, _k, _n, v in kc.rows if v)
        actions.append(Snapshot(TaskCapture(self.id, epoch, keyed, sinks, captured_at=now, operator_state=ops,
                                            loop_log_records=len(logged), loop_log_bytes=nbytes)))

    def _clear_log(self) -> None:
        keys = self._state.keys
        for key in self._state.keys_of(LOG_STATE):
            keys.key = key
            self._log.clear()

    def check_invariants(self) -> None:
        if self.logging:  # the gate is not consulted: the epoch follows the triggers
            self._check_buffers()
        else:
            super().check_invariants()
        self.head.check_invariants()
