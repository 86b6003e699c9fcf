"""Manifests: what a completed epoch consists of, and how one is assembled from acks.

A checkpoint is complete exactly when its manifest exists; everything it names (state
files, staged sink output, source offsets) was written before it. This module is pure:
it builds and checks the manifest's content; ``backends`` write and read the bytes.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Hashable

from ..runtime.errors import EpochStreamError

FORMAT = "epochstream-checkpoint"
#: version 2 added operator (non-keyed) state, the split count of sources, the job id and
#: savepoints (``kind: savepoint``, ``self_contained``); version 1 manifests read as version 2
#: without those (no operator state, splits = the splits that have offsets). Version 3 added
#: ``checksum``: the sha256 of the manifest's own content (``content_checksum``)
FORMAT_VERSION = 3
OLDEST_READABLE_VERSION = 1
#: manifests of this version and later must carry a checksum; older ones are read unverified
FIRST_CHECKSUMMED_VERSION = 3
CHECKSUM = "checksum"


class CheckpointError(EpochStreamError):
    """A checkpoint or savepoint that cannot be used, with the reason and the path."""


class IncompleteChainError(CheckpointError):
    """An incremental snapshot refers to a capture whose file was never written."""


@dataclass(frozen=True)
class SharedFile:
    """A file several checkpoints may refer to (an SST file of an incremental RocksDB
    checkpoint): path relative to the storage root, size and sha256 of its bytes."""

    path: str
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "SharedFile":
        return SharedFile(str(d["path"]), int(d["bytes"]), str(d["sha256"]))


@dataclass(frozen=True)
class StateFileRef:
    """One written state file: rows of one keyed operator subtask captured at ``epoch``.

    ``format`` is ``parquet`` (a file of rows) or ``rocksdb`` (``path`` is the handle of an
    incremental RocksDB checkpoint and ``shared`` the SST files it needs, some uploaded by
    earlier epochs; ``new_bytes`` is what this capture uploaded)."""

    operator: str
    subtask: int
    epoch: int
    path: str  # relative to the checkpoint storage root
    key_group_range: tuple[int, int]
    full: bool
    rows: int
    bytes: int
    sha256: str
    format: str = "parquet"
    shared: tuple[SharedFile, ...] = ()
    new_bytes: int | None = None

    @property
    def written(self) -> int:
        """Bytes this capture wrote (the whole file, or the new SST files and the handle)."""
        return self.bytes if self.new_bytes is None else self.new_bytes

    def paths(self) -> list[str]:
        """Every file this reference needs: the file itself and the shared files."""
        return [self.path, *(f.path for f in self.shared)]

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.format != "parquet":
            extra = {"format": self.format, "shared": [f.to_json() for f in self.shared],
                     "new_bytes": self.written}
        return {
            **extra,
            "operator": self.operator,
            "subtask": self.subtask,
            "epoch": self.epoch,
            "path": self.path,
            "key_group_range": list(self.key_group_range),
            "full": self.full,
            "rows": self.rows,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> "StateFileRef":
        return StateFileRef(
            d["operator"], int(d["subtask"]), int(d["epoch"]), d["path"], tuple(d["key_group_range"]),
            bool(d["full"]), int(d["rows"]), int(d["bytes"]), d["sha256"], str(d.get("format", "parquet")),
            tuple(SharedFile.from_json(f) for f in d.get("shared", ())),
            None if d.get("new_bytes") is None else int(d["new_bytes"]),
        )


@dataclass(frozen=True)
class AckInfo:
    """What a task reports once its capture of an epoch is pre-committed."""

    task: tuple[int, int]
    epoch: int
    files: tuple[StateFileRef, ...] = ()
    chains: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kinds: dict[str, dict[str, str]] = field(default_factory=dict)
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    staged: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bytes: int = 0
    alignment_seconds: float = 0.0
    write_seconds: float = 0.0
    held_records: int = 0
    #: when the task reached the bound (its clock; the local driver's is shared with the driver)
    captured_at: float = 0.0
    #: operator uid -> newest time label whose timers fired (event time only)
    event_time: dict[str, int] = field(default_factory=dict)
    #: (operator uid, state name, mode, pickled value) of this task's operator state
    operator_state: tuple[tuple[str, str, str, builtins.bytes], ...] = ()  # the field ``bytes`` hides the type
    #: a loop head's log of in-transit records: records and pickled bytes
    loop_log_records: int = 0
    loop_log_bytes: int = 0
    #: operator uid -> state name -> declared type (JSON, ``runtime.types``); "" for the key's
    types: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: unaligned mode: the task's channel state (pickled, ``alignment.channel_state.decode_channel_state``)
    channel_state: builtins.bytes = b""
    channel_state_records: int = 0
    channel_state_bytes: int = 0
    #: source uid -> split -> newest timestamp read (bounded out-of-orderness)
    source_max_timestamps: dict[str, dict[int, float]] = field(default_factory=dict)


class ManifestBuilder:
    """Collects acks (of every epoch, aborted ones included) and assembles manifests.

    Aborted epochs matter: an incremental capture at n+1 builds on the file of n, and the
    staged output of an aborted n commits with the next completed epoch.
    """

    def __init__(self, job: dict[str, Any], last_completed: int = 0, previous: dict[str, Any] | None = None) -> None:
        self.job = job
        self.last_completed = last_completed
        #: (task, epoch) -> ack; only epochs after ``last_completed``, plus chain links still in use
        self.acks: dict[tuple[Hashable, int], AckInfo] = {}
        self.declined: set[tuple[Hashable, int]] = set()

    def record(self, info: AckInfo) -> None:
        self.acks[(info.task, info.epoch)] = info

    def record_decline(self, task: Hashable, epoch: int) -> None:
        self.declined.add((task, epoch))

    def build(self, epoch: int, kind: str, acks: dict[Hashable, AckInfo], extra: dict[str, Any]) -> dict[str, Any]:
        operators: dict[str, dict[str, Any]] = {}
        sources: dict[str, dict[str, Any]] = {}
        sinks: dict[str, dict[str, Any]] = {}
        metrics = {"bytes": 0, "files": 0, "alignment_seconds_max": 0.0, "write_seconds_max": 0.0, "held_records": 0,
                   "loop_log_records": 0, "loop_log_bytes": 0, "channel_state_records": 0,
                   "channel_state_bytes": 0}
        channel_state: dict[str, dict[str, Any]] = {}
        for task, info in sorted(acks.items()):
            for op, chain in info.chains.items():
                entry = operators.setdefault(op, {"kind": "process", "states": {}, "files": []})
                entry["states"].update(info.kinds.get(op, {}))
                declared = dict(info.types.get(op, {}))
                if "" in declared:  # the key's declared type
                    entry["key_type"] = declared.pop("")
                if declared:  # typed columns (Delta): state name -> declared type
                    entry.setdefault("types", {}).update(declared)
                if op in info.event_time:  # how far event time got in this epoch (the oracle replays it)
                    entry["event_time"] = min(entry.get("event_time", info.event_time[op]), info.event_time[op])
                    # per subtask too: unaligned snapshots of one operator see different event times
                    entry.setdefault("event_time_subtasks", {})[str(info.task[1])] = info.event_time[op]
                for link in chain:
                    link_ack = info if link == epoch else self.acks.get((task, link))
                    ref = None if link_ack is None else next((f for f in link_ack.files if f.operator == op), None)
                    if ref is None:
                        raise IncompleteChainError(
                            f"epoch {epoch}: the incremental snapshot of operator {op!r} subtask {info.task[1]} "
                            f"builds on epoch {link}, whose state file was not written"
                        )
                    entry["files"].append(ref.to_json())
            for op, name, mode, data in info.operator_state:
                entry = operators.setdefault(op, {"kind": "process", "states": {}, "files": []})
                st = entry.setdefault("operator_state", {}).setdefault(name, {"mode": mode, "parts": {}})
                st["parts"][str(info.task[1])] = base64.b64encode(data).decode("ascii")
            for src, offs in info.offsets.items():
                sources.setdefault(src, {"offsets": {}})["offsets"].update({str(k): v for k, v in offs.items()})
            for src, stamps in info.source_max_timestamps.items():  # where the split watermarks resume
                sources.setdefault(src, {"offsets": {}}).setdefault("max_timestamps", {}).update(
                    {str(k): v for k, v in stamps.items()})
            metrics["bytes"] += info.bytes
            metrics["files"] += len(info.files)
            metrics["alignment_seconds_max"] = max(metrics["alignment_seconds_max"], info.alignment_seconds)
            metrics["write_seconds_max"] = max(metrics["write_seconds_max"], info.write_seconds)
            metrics["held_records"] += info.held_records
            metrics["loop_log_records"] += info.loop_log_records
            metrics["loop_log_bytes"] += info.loop_log_bytes
            if info.channel_state:
                metrics["channel_state_records"] += info.channel_state_records
                metrics["channel_state_bytes"] += info.channel_state_bytes
                channel_state[task_key(info.task)] = {
                    "records": info.channel_state_records, "bytes": info.channel_state_bytes,
                    "data": base64.b64encode(info.channel_state).decode("ascii")}
        # staged output of every epoch since the last completed one, aborted epochs included
        # (only acks that staged something are sorted: with an epoch per record, hundreds of epochs of
        # every task can be pending, and sorting all of their acks for every manifest was quadratic)
        last = self.last_completed
        staging = [(k, info) for k, info in self.acks.items() if info.staged and last < k[1] <= epoch]
        for _key, info in sorted(staging, key=lambda kv: (kv[0][1], kv[0][0])):
            for sink, paths in info.staged.items():
                sinks.setdefault(sink, {"staged": []})["staged"].extend(paths)
        for info in acks.values():  # sinks with no output still appear
            for sink in info.staged:
                sinks.setdefault(sink, {"staged": []})
        for source in sources.values():  # every split has an offset (every split has a reader)
            source["splits"] = len(source["offsets"])
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            **self.job,
            "epoch": epoch,
            "kind": kind,
            "operators": operators,
            "sources": sources,
            "sinks": sinks,
            "metrics": metrics,
            **({"channel_state": channel_state} if channel_state else {}),
            **extra,
        }

    def completed(self, epoch: int, manifest: dict[str, Any]) -> None:
        """Forget acks that no future manifest can need."""
        self.last_completed = epoch
        live = {f["path"] for op in manifest["operators"].values() for f in op["files"]}
        self.acks = {k: v for k, v in self.acks.items() if k[1] > epoch or any(f.path in live for f in v.files)}
        self.declined = {k for k in self.declined if k[1] > epoch}


def task_key(task: tuple[int, int]) -> str:
    """How a manifest names a task (its channel state): ``"chain.subtask"``."""
    return f"{task[0]}.{task[1]}"


def channel_state_of(m: dict[str, Any], task: tuple[int, int]) -> bytes:
    """A task's channel state in a (validated) manifest (unaligned mode); b"" if none."""
    entry = m.get("channel_state", {}).get(task_key(task))
    return base64.b64decode(entry["data"]) if entry else b""


def content_checksum(m: dict[str, Any]) -> str:
    """``sha256:<hex>`` of a manifest's content without its checksum, as canonical JSON
    (sorted keys, no spaces): independent of how the file was indented."""
    body = {k: v for k, v in m.items() if k != CHECKSUM}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_manifest(m: dict[str, Any]) -> bytes:
    """The bytes of a manifest as written: its content plus ``checksum`` of that content."""
    sealed = {**{k: v for k, v in m.items() if k != CHECKSUM}, CHECKSUM: content_checksum(m)}
    return json.dumps(sealed, indent=1, sort_keys=True).encode()


def verified(m: dict[str, Any]) -> bool:
    """Whether a (validated) manifest carried a checksum; False: an old, unverified manifest."""
    return CHECKSUM in m


def validate_manifest(m: Any, where: str) -> dict[str, Any]:
    """Check a parsed manifest's checksum and shape; raise CheckpointError naming ``where``.

    A manifest of version 3 or later whose checksum is missing or differs from its content
    is damaged (one digit of an offset changed, a key dropped or emptied), exactly like one
    that does not parse; older manifests have no checksum and are read unverified."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an epochstream checkpoint manifest")
    version = m.get("format_version")
    if not isinstance(version, int) or not OLDEST_READABLE_VERSION <= version <= FORMAT_VERSION:
        if CHECKSUM in m and m[CHECKSUM] != content_checksum(m):
            why = "its checksum does not match its content, so the file is damaged"
        elif isinstance(version, int) and version > FORMAT_VERSION:
            why = "it was written by a newer epochstream"
        elif isinstance(version, int):
            why = "it is older than the oldest format this epochstream can migrate"
        elif version is None:
            why = "the file lacks format_version, so it is damaged"
        else:
            why = "the version is not an integer, so the file is damaged"
        raise CheckpointError(
            f"{where}: manifest format version {version!r} is not supported ({why}; this epochstream reads "
            f"versions {OLDEST_READABLE_VERSION} to {FORMAT_VERSION}); nothing was restored or changed"
        )
    for key in ("job", "epoch", "parallelism", "max_parallelism", "operators", "sources", "sinks"):
        if key not in m:
            raise CheckpointError(f"{where}: manifest lacks {key!r}; the file is damaged")
    if CHECKSUM in m or version >= FIRST_CHECKSUMMED_VERSION:
        if CHECKSUM not in m:
            raise CheckpointError(f"{where}: manifest (format version {version}) lacks its checksum; the file is "
                                  f"damaged and nothing is restored from it")
        if m[CHECKSUM] != content_checksum(m):
            raise CheckpointError(
                f"{where}: manifest checksum does not match its content (the file was changed or damaged after it "
                f"was written: an edited offset, a dropped or emptied key); nothing is restored from it")
    try:
        _check_shape(m)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where}: manifest is damaged inside ({type(exc).__name__}: {exc})") from None
    return m


def _check_shape(m: dict[str, Any]) -> None:
    """Every field restore and listing read, with the right type (raises on the first gap)."""
    int(m["epoch"]), int(m["parallelism"]), int(m["max_parallelism"])
    for uid, op in m["operators"].items():
        if not isinstance(op["files"], list) or not isinstance(op.get("states", {}), dict):
            raise TypeError(f"operator {uid!r}: files must be a list and states a mapping")
        for f in op["files"]:
            StateFileRef.from_json(f)
        for name, st in op.get("operator_state", {}).items():
            if st["mode"] not in ("split", "union", "broadcast"):
                raise ValueError(f"operator {uid!r}: operator state {name!r} has unknown mode {st['mode']!r}")
            for subtask, data in st["parts"].items():
                int(subtask), base64.b64decode(data, validate=True)
    for uid, src in m["sources"].items():
        for split, offset in src["offsets"].items():
            int(split), int(offset)
        for split, ts in src.get("max_timestamps", {}).items():
            int(split), float(ts)
        if int(src.get("splits", len(src["offsets"]))) < len(src["offsets"]):
            raise ValueError(f"source {uid!r}: more offsets than splits")
    for task, entry in m.get("channel_state", {}).items():
        chain, subtask = task.split(".")
        int(chain), int(subtask), int(entry["records"]), int(entry["bytes"])
        base64.b64decode(entry["data"], validate=True)
    for uid, sink in m["sinks"].items():
        if not isinstance(sink["staged"], list) or not all(isinstance(p, str) for p in sink["staged"]):
            raise TypeError(f"sink {uid!r}: staged must be a list of paths")


def operator_state_parts(m: dict[str, Any], uid: str) -> dict[str, tuple[str, dict[int, bytes]]]:
    """Operator state of ``uid`` in a manifest: name -> (mode, old subtask -> pickled value)."""
    out = {}
    for name, st in m["operators"].get(uid, {}).get("operator_state", {}).items():
        out[name] = (st["mode"], {int(s): base64.b64decode(d) for s, d in st["parts"].items()})
    return out
