"""What an operator's function can do, resolved once per node.

A keyed function is a plain object: ``process(value, ctx)`` at least, and optionally the
hooks below. Each optional capability is a ``Protocol`` (its methods' signatures), or a
flag the function sets to True; ``OperatorTraits.of`` reads them all once, when the chain
(or the oracle's reference) compiles the node, and the compiled closures read the traits
instead of probing the object again.

``of`` tests a protocol's methods with ``hasattr``, not ``isinstance``: from Python 3.12 a
runtime-checkable protocol looks attributes up statically and misses the ones a wrapper
forwards through ``__getattr__`` (``recorded_order.Recording`` forwards ``on_epoch_end``).

Capabilities:

- ``EndsEpochs``: ``on_epoch_end(epoch, ctx)`` runs at the bound of an epoch, before its
  snapshot, and its output goes downstream in that epoch.
- ``AppliesBatches``: ``apply_batch(records, keys, ctx)`` takes a whole batch with its keys
  and sets the current key itself (the PySpark wrappers); with ``takes_record_batches`` it
  gets a RecordBatch as it came (keys None).
- ``DrainsInput``: ``drain_input(ctx)`` runs what it kept for one call per key before event
  time moves (the PySpark wrappers' epoch micro-batch).
- ``ColumnarKeyed`` (the flag ``columnar_keyed``): ``apply(records, keyslot, ctx, label,
  state)`` groups a batch by its key columns itself (``runtime.columns``).
- ``uses_event_time`` (a flag): the function registers event-time timers (``on_timer``).
- ``takes_any_records`` (a flag, ``map_batches`` nodes): the runtime's own operators that take
  a list of rows or a RecordBatch as it comes (``from_json``, side-output splitters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EndsEpochs(Protocol):
    """Runs once per epoch at its bound (the PySpark wrappers run their epoch micro-batch)."""

    def on_epoch_end(self, epoch: int, ctx: Any) -> Any: ...


@runtime_checkable
class AppliesBatches(Protocol):
    """Takes a whole batch with its keys (``process_batch`` is the user's per-key hook, not this)."""

    def apply_batch(self, records: Any, keys: list[Any] | None, ctx: Any) -> Any: ...


@runtime_checkable
class DrainsInput(Protocol):
    """Keeps input for one call per key; ``drain_input`` makes those calls now."""

    def drain_input(self, ctx: Any) -> Any: ...


@runtime_checkable
class ColumnarKeyed(Protocol):
    """Groups a RecordBatch by its key columns itself (``runtime.columns.KeyedBatches``)."""

    columnar_keyed: bool

    def apply(self, records: Any, keyslot: Any, ctx: Any, label: str, state: Any = None) -> Any: ...


def _provides(fn: Any, *names: str) -> bool:
    """``fn`` has every attribute of a protocol (forwarded ones too: see the module docstring)."""
    return all(hasattr(fn, name) for name in names)


def _flag(fn: Any, name: str) -> bool:
    """A capability declared by a class attribute set to a true value (absent: False)."""
    return bool(getattr(fn, name, False))


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorTraits:
    """The capabilities of one node's function (see the module docstring)."""

    uses_event_time: bool = False
    ends_epochs: bool = False
    columnar_keyed: bool = False
    applies_batches: bool = False
    takes_record_batches: bool = False
    drains_input: bool = False
    takes_any_records: bool = False

    @staticmethod
    def of(fn: Any) -> "OperatorTraits":
        """The traits of ``fn``, read once."""
        return OperatorTraits(
            uses_event_time=_flag(fn, "uses_event_time"),
            ends_epochs=_provides(fn, "on_epoch_end"),
            columnar_keyed=_flag(fn, "columnar_keyed"),
            applies_batches=_provides(fn, "apply_batch"),
            takes_record_batches=_flag(fn, "takes_record_batches"),
            drains_input=_provides(fn, "drain_input"),
            takes_any_records=_flag(fn, "takes_any_records"),
        )
