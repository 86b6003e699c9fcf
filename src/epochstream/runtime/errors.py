"""Errors the runtime raises; each names what failed and where."""

from __future__ import annotations


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


class UserFunctionError(EpochStreamError):
    """A user function raised; wraps the original exception with the operator uid."""


class SchemaError(EpochStreamError):
    """Columnar data that does not fit: a ``key_by`` column a batch lacks, a source batch whose
    schema differs from the source's first batch, rows Arrow cannot turn into a batch. The
    message names the operator (or source, split and offset) and the column."""
