"""The context a KeyedProcessFunction sees (PyFlink's names)."""

from __future__ import annotations

from typing import Any


class Context:
    """Current key, epoch and subtask, and the way to declare keyed state."""

    __slots__ = ("_state", "_keys", "subtask_index", "parallelism", "operator_uid", "epoch")

    def __init__(self, state, subtask_index: int, parallelism: int, operator_uid: str) -> None:
        self._state = state
        self._keys = state.keys
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.operator_uid = operator_uid
        self.epoch = 0

    @property
    def key(self) -> Any:
        return self._keys.key

    def get_current_key(self) -> Any:
        return self._keys.key

    def state(self, descriptor):
        """The handle of ``descriptor``'s state for the current key (declare it in ``open``)."""
        return self._state.handle(descriptor)

    # PyFlink's RuntimeContext names
    get_state = get_list_state = get_map_state = state
