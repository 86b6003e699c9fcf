"""The context a KeyedProcessFunction sees (PyFlink's names)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..graph.keygroups import canonical_key

if TYPE_CHECKING:
    from .state import (
        BroadcastState,
        KeyedStateBackend,
        ListState,
        MapState,
        OperatorListState,
        OperatorStateBackend,
        StateDescriptor,
        ValueState,
    )
    from .timers import TimerService


class Context:
    """Current key, epoch and subtask, and the way to declare keyed state."""

    __slots__ = ("_state", "_keys", "_operator", "subtask_index", "parallelism", "operator_uid", "epoch", "timers",
                 "now")

    def __init__(self, state: KeyedStateBackend, subtask_index: int, parallelism: int, operator_uid: str,
                 timers: TimerService | None = None, operator_state: OperatorStateBackend | None = None) -> None:
        self._state = state
        self._operator = operator_state
        #: the operator's ``TimerService`` (None: it declared no event-time use)
        self.timers = timers
        self._keys = state.keys
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.operator_uid = operator_uid
        self.epoch = 0
        #: the driver's time of the current step in seconds (virtual in the simulator)
        self.now = 0.0

    @property
    def key(self) -> Any:
        return self._keys.key

    def get_current_key(self) -> Any:
        return self._keys.key

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` current (Flink's ``setCurrentKey``): for work that is not driven by a
        record of that key, such as timers that fire at an epoch bound."""
        self._keys.key = canonical_key(key)

    def keys(self, name: str) -> list[Any]:
        """The keys of this subtask that hold a value in state ``name`` (a snapshot list)."""
        return self._state.keys_of(name)

    def state(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState:
        """The handle of ``descriptor``'s state for the current key (declare it in ``open``)."""
        return self._state.handle(descriptor)

    def timer_service(self) -> TimerService:
        """Event-time timers (PyFlink's ``ctx.timer_service()``)."""
        if self.timers is None:
            raise RuntimeError(
                f"operator {self.operator_uid!r} has no timer service: define on_timer() (or set "
                "uses_event_time = True) on its function, give a source timestamps=..., and run in mode='tracker'"
            )
        return self.timers

    def operator_state(self, descriptor: StateDescriptor, mode: str = "split") -> OperatorListState | BroadcastState:
        """A list of this subtask, not scoped to a key (Flink's operator list state).

        ``mode`` says where the entries go when the job restores at another parallelism:
        ``"split"`` deals all subtasks' entries out evenly, ``"union"`` gives every subtask
        all of them. Declare it in ``open``; keep it small (it is captured whole each epoch)."""
        if self._operator is None:
            raise TypeError(f"operator {self.operator_uid!r} has no operator state backend")
        return self._operator.handle(descriptor, mode)

    def broadcast_state(self, descriptor: StateDescriptor) -> OperatorListState | BroadcastState:
        """A dict every subtask holds the same copy of; only subtask 0's copy is checkpointed
        and every subtask gets it back on restore, at any parallelism."""
        if self._operator is None:
            raise TypeError(f"operator {self.operator_uid!r} has no operator state backend")
        return self._operator.handle(descriptor, "broadcast")

    # PyFlink's RuntimeContext names
    get_state = get_list_state = get_map_state = state
