"""Errors the runtime raises; each names what failed and where."""

from __future__ import annotations

from typing import Any

from .watermarks import LateRecord


class EpochStreamError(Exception):
    """Base class of every epochstream error."""


class ProtocolError(EpochStreamError):
    """An illegal transition of a protocol state machine (a bug or a misbehaving peer)."""

    def __init__(self, machine: str, state: str, event: str, detail: str = "") -> None:
        self.machine, self.state, self.event = machine, state, event
        super().__init__(f"{machine}: event {event} is illegal in state {state}" + (f": {detail}" if detail else ""))


class StateSerializationError(EpochStreamError):
    """A keyed state value could not be pickled at an epoch bound."""


class ConfigurationError(EpochStreamError):
    """The job cannot run as configured on this machine (restarting cannot help)."""


#: how much of a record's repr an error message shows
RECORD_REPR_LIMIT = 160
_UNSET: Any = object()


def short_repr(value: Any, limit: int = RECORD_REPR_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` and the full length when cut)."""
    try:
        text = repr(value)
    except Exception as exc:  # a record whose __repr__ raises still gets named
        text = f"<{type(value).__name__} whose repr failed: {exc!r}>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class UserFunctionError(EpochStreamError):
    """A user function raised; wraps the original exception and says where.

    The message names the operator (kind and uid or name), and as far as they are known
    the subtask, the key, a truncated repr of the record, and the source split and offset
    the record was read from (``locate``): the same text reaches the logs, the failover
    reasons of ``JobResult`` and ``JobFailedError``, and the REST status."""

    def __init__(self, what: str, cause: BaseException | None = None, *, subtask: int | None = None,
                 key: Any = _UNSET, record: Any = _UNSET) -> None:
        self.what, self.cause, self.subtask = what, cause, subtask
        self.key_repr = None if key is _UNSET else short_repr(key, 80)
        self.record = None if record is _UNSET else record
        self.record_repr = None if record is _UNSET else short_repr(record)
        #: (source uid, split, offset, exact): where the record came from, once the reading task knows
        self.origin: tuple[str, int, int, bool] | None = None
        super().__init__(self._text())

    def locate(self, *, subtask: int | None = None, source: str | None = None, split: int | None = None,
               offset: int | None = None, batch: Any = None) -> "UserFunctionError":
        """Add what the task knows: its subtask, and the source split and offset of the batch it
        was pushing (the record's own offset when the failing record is one of that batch's)."""
        if subtask is not None and self.subtask is None:
            self.subtask = subtask
        if source is not None and split is not None and offset is not None and self.origin is None:
            exact = False
            if self.record is not None and type(batch) is list:
                for i, r in enumerate(batch):
                    if r is self.record or (type(r) is LateRecord and r.record is self.record):
                        offset, exact = offset + i, True
                        break
            self.origin = (source, split, offset, exact)
        self.record = None  # only needed to find the offset; the error may be pickled
        self.args = (self._text(),)
        return self

    def _text(self) -> str:
        where = []
        if self.subtask is not None:
            where.append(f"subtask {self.subtask}")
        if self.key_repr is not None:
            where.append(f"key {self.key_repr}")
        if self.record_repr is not None:
            where.append(f"record {self.record_repr}")
        if self.origin is not None:
            uid, split, offset, exact = self.origin
            where.append(f"read from source {uid!r} split {split} "
                         f"{'offset' if exact else 'in the batch starting at offset'} {offset}")
        cause = "" if self.cause is None else f": {self.cause!r}"
        return f"{self.what}{' (' + ', '.join(where) + ')' if where else ''}{cause}"


class SourceError(EpochStreamError):
    """A source failed to read: names the source uid, the split and the offset."""


class SchemaError(EpochStreamError):
    """Columnar data that does not fit: a ``key_by`` column a batch lacks, a source batch whose
    schema differs from the source's first batch, rows Arrow cannot turn into a batch. The
    message names the operator (or source, split and offset) and the column."""
