"""A typed, read-only view of a validated manifest.

The manifest on disk is a JSON document (``snapshot.manifest``) and stays one: backends,
sinks and savepoints read and write its dict. Restore, listings and the CLI want its fields
with their types (``int`` epochs and parallelisms, split numbers, state file references), so
a ``ManifestView`` of it is made once, after ``validate_manifest`` checked every field it
reads, and callers read attributes instead of string keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping

from .coordinator import SAVEPOINT
from .manifest import StateFileRef


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """What a manifest holds of one source."""

    #: split -> offset (records read) at the epoch's cut
    offsets: Mapping[int, int]
    #: how many splits the source had (>= the splits with offsets)
    splits: int
    #: split -> newest timestamp read (bounded out-of-orderness sources; empty for others)
    max_timestamps: Mapping[int, float]


@dataclass(frozen=True, slots=True)
class OperatorEntry:
    """What a manifest holds of one stateful operator."""

    #: its keyed state files, every subtask's
    files: tuple[StateFileRef, ...]
    #: names of its keyed states, sorted
    states: tuple[str, ...]
    #: names of its operator (non-keyed) states, sorted
    operator_states: tuple[str, ...]


@dataclass(frozen=True)
class ManifestView:
    """The fields of one validated manifest, typed; ``raw`` is the document itself.

    Each field is read from ``raw`` when asked for (the nested ones once, then kept), so a
    view of a partial document, as tests build, answers what that document holds."""

    raw: Mapping[str, Any]

    @property
    def job(self) -> str:
        return str(self.raw["job"])

    @property
    def job_id(self) -> str | None:
        """The id of the run that wrote it (None: older manifests)."""
        return self.raw.get("job_id")

    @property
    def epoch(self) -> int:
        return int(self.raw["epoch"])

    @property
    def kind(self) -> str | None:
        """The epoch's kind (``coordinator.CHECKPOINT``, ``SAVEPOINT``, ``FINAL``; None: older manifests)."""
        return self.raw.get("kind")

    @property
    def is_savepoint(self) -> bool:
        return self.kind == SAVEPOINT

    @property
    def created_at(self) -> Any:
        return self.raw.get("created_at")

    @property
    def mode(self) -> str | None:
        """The mode the job ran in (None: older manifests)."""
        return self.raw.get("mode")

    @property
    def parallelism(self) -> int:
        return int(self.raw["parallelism"])

    @property
    def max_parallelism(self) -> int:
        return int(self.raw["max_parallelism"])

    @property
    def self_contained(self) -> bool:
        """A savepoint that holds its own files (its folder is its root)."""
        return bool(self.raw.get("self_contained"))

    @property
    def has_channel_state(self) -> bool:
        """Whether it holds channel state (an unaligned snapshot's records in flight)."""
        return bool(self.raw.get("channel_state"))

    @property
    def metrics(self) -> Mapping[str, Any]:
        return MappingProxyType(self.raw.get("metrics", {}))

    @cached_property
    def operators(self) -> Mapping[str, OperatorEntry]:
        """Stateful operator uid -> what the manifest holds of it."""
        return MappingProxyType({uid: _operator(op) for uid, op in self.raw["operators"].items()})

    @cached_property
    def sources(self) -> Mapping[str, SourceEntry]:
        """Source uid -> its offsets, split count and newest timestamps."""
        return MappingProxyType({uid: _source(src) for uid, src in self.raw["sources"].items()})

    @cached_property
    def staged(self) -> Mapping[str, tuple[str, ...]]:
        """Sink uid -> the staged output paths the epoch commits."""
        return MappingProxyType({uid: tuple(s["staged"]) for uid, s in self.raw["sinks"].items()})

    @property
    def state_files(self) -> tuple[StateFileRef, ...]:
        """Every keyed state file of every operator, in the manifest's order."""
        return tuple(f for op in self.operators.values() for f in op.files)

    def source_splits(self, uid: str) -> int | None:
        """How many splits source ``uid`` had; None if the manifest has no entry for it."""
        src = self.sources.get(uid)
        return None if src is None else src.splits

    @staticmethod
    def of(m: Mapping[str, Any]) -> "ManifestView":
        """The view of ``m``, a manifest ``validate_manifest`` accepted."""
        return ManifestView(m)


def _operator(op: Mapping[str, Any]) -> OperatorEntry:
    return OperatorEntry(tuple(StateFileRef.from_json(f) for f in op["files"]), tuple(sorted(op.get("states", {}))),
                         tuple(sorted(op.get("operator_state", {}))))


def _source(src: Mapping[str, Any]) -> SourceEntry:
    offsets = src["offsets"]
    return SourceEntry(
        MappingProxyType({int(k): int(v) for k, v in offsets.items()}),
        int(src.get("splits", len(offsets))),
        MappingProxyType({int(k): float(v) for k, v in src.get("max_timestamps", {}).items()}))
