"""The embedded checkpoint storage: a local (or mounted) filesystem directory.

Layout (Flink's, roughly)::

    ROOT/shared/<operator uid>/<subtask>/e<epoch>-a<attempt>.parquet   state files (pre-commit)
    ROOT/chk-<epoch>/_metadata.json                                 manifest (commit point)

A state file is Parquet with columns ``key_group int32, key binary, state string,
value binary`` (null value = tombstone in an incremental file), written to a temporary
name, fsynced and renamed. Its size and sha256 go into the manifest, so a damaged file
is reported by name instead of restoring wrong state. A manifest is written the same
way; a checkpoint exists exactly when its ``_metadata.json`` does and parses.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from ..snapshot.manifest import CheckpointError, StateFileRef, validate_manifest

log = logging.getLogger(__name__)

METADATA = "_metadata.json"
_CHK = re.compile(r"^chk-(\d+)$")

STATE_SCHEMA = pa.schema(
    [
        ("key_group", pa.int32()),
        ("key", pa.binary()),
        ("state", pa.string()),
        ("value", pa.binary()),
    ]
)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either nothing, the old bytes, or all new bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class LocalCheckpointStorage:
    """Checkpoint storage under one directory: begin/pre-commit/commit/abort/recover."""

    scheme = "file"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"checkpoint dir {self.root} exists and is not a directory")

    def __repr__(self) -> str:
        return f"LocalCheckpointStorage({str(self.root)!r})"

    # ------------------------------------------------------------ pre-commit: state files
    def state_path(self, operator: str, subtask: int, epoch: int, attempt: str) -> str:
        return f"shared/{_safe(operator)}/{subtask}/e{epoch}-a{attempt}.parquet"

    def write_state(
        self,
        operator: str,
        subtask: int,
        epoch: int,
        attempt: str,
        rows: list[tuple[int, bytes, str, bytes | None]],
        key_group_range: tuple[int, int],
        full: bool,
    ) -> StateFileRef:
        """Pre-commit one keyed operator subtask's capture; returns its reference."""
        if rows:
            kgs, keys, names, values = zip(*rows)
        else:
            kgs, keys, names, values = (), (), (), ()
        table = pa.Table.from_arrays(
            [pa.array(kgs, pa.int32()), pa.array(keys, pa.binary()), pa.array(names, pa.string()),
             pa.array(values, pa.binary())],
            schema=STATE_SCHEMA,
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue()
        rel = self.state_path(operator, subtask, epoch, attempt)
        atomic_write(self.root / rel, data)
        return StateFileRef(operator, subtask, epoch, rel, tuple(key_group_range), full, len(rows), len(data),
                            hashlib.sha256(data).hexdigest())

    def read_state(self, ref: StateFileRef, root: Path | None = None) -> pa.Table:
        """Read and verify a state file; a missing or damaged file raises CheckpointError."""
        path = (root or self.root) / ref.path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"state file {path} of operator {ref.operator!r} (epoch {ref.epoch}) is missing") from None
        if len(data) != ref.bytes:
            raise CheckpointError(
                f"state file {path} of operator {ref.operator!r} (epoch {ref.epoch}) is damaged: expected "
                f"{ref.bytes} bytes, found {len(data)} (truncated or overwritten)"
            )
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise CheckpointError(
                f"state file {path} of operator {ref.operator!r} (epoch {ref.epoch}) is damaged: its sha256 "
                f"differs from the one the manifest recorded ({ref.sha256[:12]}...)"
            )
        try:
            return pq.read_table(pa.BufferReader(data))
        except Exception as exc:  # verified bytes that still do not parse: say so
            raise CheckpointError(f"state file {path} cannot be parsed: {exc}") from exc

    # ------------------------------------------------------------ commit: manifests
    def checkpoint_dir(self, epoch: int) -> Path:
        return self.root / f"chk-{epoch}"

    def write_manifest(self, manifest: dict[str, Any]) -> Path:
        """The commit point of an epoch: after this returns, the checkpoint exists."""
        path = self.checkpoint_dir(manifest["epoch"]) / METADATA
        atomic_write(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return path.parent

    def list_checkpoints(self) -> list[int]:
        """Epochs that have a manifest file (not yet validated), oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _CHK.match(p.name)
            if m and (p / METADATA).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def load_manifest(self, location: str | os.PathLike[str] | int) -> tuple[dict[str, Any], Path]:
        """Read a manifest by epoch, checkpoint folder or ``_metadata.json`` path.

        Returns the manifest and the storage root its relative paths resolve against
        (a savepoint folder copied elsewhere carries its own root).
        """
        if isinstance(location, int):
            path = self.checkpoint_dir(location) / METADATA
        else:
            path = Path(location).expanduser().resolve()
            if path.is_dir():
                if (path / METADATA).is_file():
                    path = path / METADATA
                else:
                    raise CheckpointError(
                        f"{path} is not a checkpoint: it has no {METADATA} (a checkpoint dir holds chk-N folders; "
                        f"restore a chk-N folder or use restore='latest' with checkpoint_dir)"
                    )
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint manifest {path} does not exist") from None
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"checkpoint manifest {path} is corrupt: not UTF-8 text ({exc.reason})") from None
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint manifest {path} is corrupt or truncated: {exc}") from None
        validate_manifest(manifest, str(path))
        # checkpoints name files relative to the storage root; a savepoint relative to itself
        root = path.parent if manifest.get("self_contained") else path.parent.parent
        return manifest, root

    def latest(self) -> tuple[dict[str, Any], Path] | None:
        """Newest checkpoint whose manifest is readable; damaged newer ones are skipped with a warning."""
        for epoch in reversed(self.list_checkpoints()):
            try:
                return self.load_manifest(epoch)
            except CheckpointError as exc:
                log.warning("skipping checkpoint %d: %s", epoch, exc)
        return None

    def read_operator_rows(self, manifest: dict[str, Any], root: Path, operator: str,
                           key_groups: tuple[int, int] | None = None) -> Iterable[tuple[int, bytes, str, bytes | None]]:
        """Rows of one operator's file chains, in apply order, optionally only some key groups."""
        entry = manifest["operators"].get(operator)
        if entry is None:
            return
        for f in entry["files"]:
            ref = StateFileRef.from_json(f)
            lo, hi = ref.key_group_range
            if key_groups is not None and (hi < key_groups[0] or lo > key_groups[1]):
                continue
            table = self.read_state(ref, root)
            cols = [table.column(n).to_pylist() for n in ("key_group", "key", "state", "value")]
            for row in zip(*cols):
                if key_groups is None or key_groups[0] <= row[0] <= key_groups[1]:
                    yield row

    # ------------------------------------------------------------ abort / retention / recovery
    def discard(self, epoch: int) -> None:
        shutil.rmtree(self.checkpoint_dir(epoch), ignore_errors=True)

    def collect_garbage(self, retained: list[dict[str, Any]], keep_after: int) -> int:
        """Delete state files no retained manifest names, except those of epochs > keep_after
        (which future manifests may still name). Returns the number of files removed."""
        live = {f["path"] for m in retained for op in m["operators"].values() for f in op["files"]}
        shared = self.root / "shared"
        removed = 0
        if not shared.is_dir():
            return 0
        for path in shared.rglob("*.parquet"):
            rel = path.relative_to(self.root).as_posix()
            m = re.match(r"e(\d+)-a.+\.parquet$", path.name)
            if rel in live or (m and int(m.group(1)) > keep_after):
                continue
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def remove_orphans(self, retained: list[dict[str, Any]]) -> int:
        """At recovery: every state file not named by a retained manifest is garbage
        (captures of epochs that never completed before the failure)."""
        live = {f["path"] for m in retained for op in m["operators"].values() for f in op["files"]}
        shared = self.root / "shared"
        removed = 0
        if shared.is_dir():
            for path in shared.rglob("*"):
                if path.is_file() and path.relative_to(self.root).as_posix() not in live:
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed


def _safe(name: str) -> str:
    """A file-name form of a uid that is distinct for distinct uids (percent-encoding)."""
    return quote(name, safe="") if name not in (".", "..") else quote(name.replace(".", "%2E"), safe="%")
