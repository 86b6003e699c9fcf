"""Checkpoint storage over an object store: one implementation, any store with whole-object writes.

The local filesystem and S3 hold checkpoints the same way, so the epoch commit is written
once, here, against ``ObjectStore``, a handful of whole-object operations:

* ``put`` writes an object so that readers see either nothing (or the old bytes) or all
  new bytes: temporary file + fsync + rename locally, a single PUT on S3;
* ``put_new`` is the commit point: it writes an object only if none exists under that name
  (``os.link`` of a complete temporary file locally, ``If-None-Match: *`` on S3), so a
  manifest can neither be half-written nor overwrite a completed checkpoint;
* ``get``, ``exists``, ``is_dir``, ``keys`` (listing), ``delete``, ``delete_tree``, ``move``.

Layout (Flink's, roughly)::

    ROOT/shared/<operator uid>/<subtask>/e<epoch>-a<attempt>.parquet   state files (pre-commit)
    ROOT/chk-<epoch>/_metadata.json                                 manifest (commit point)

A state file is Parquet with columns ``key_group int32, key binary, state string, value
binary`` (null value = tombstone in an incremental file). Its size and sha256 go into the
manifest, so a damaged or missing file is reported by name instead of restoring wrong state.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import re
import secrets
from abc import ABC, abstractmethod
from typing import Any, Iterable, Iterator
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from ..runtime.errors import ConfigurationError, EpochStreamError
from ..runtime.messages import ColumnRows
from ..snapshot.manifest import CheckpointError, StateFileRef, encode_manifest, validate_manifest, verified
from .base import CheckpointStorage, Row

log = logging.getLogger(__name__)

METADATA = "_metadata.json"
_CHK = re.compile(r"^chk-(\d+)$")
_STATE_FILE = re.compile(r"(?:^|/)e(\d+)-a[^/]+\.(?:parquet|sst|rocks\.json)$")
#: files under ``shared/`` that retention manages (state files, shared SST files, RocksDB handles)
_MANAGED = (".parquet", ".sst", ".rocks.json")
_TMP_FILE = re.compile(r"(^|/)\.[^/]+\.tmp-\d+$")

STATE_SCHEMA = pa.schema(
    [
        ("key_group", pa.int32()),
        ("key", pa.binary()),
        ("state", pa.string()),
        ("value", pa.binary()),
    ]
)


# ---------------------------------------------------------------- errors


class StorageError(EpochStreamError, OSError):
    """A storage operation failed (after its retries, where it has any).

    An ``OSError``, so the job master treats a failed manifest write like a failed disk
    write: the epoch aborts and the job goes on or fails over."""


class StorageAccessError(StorageError, ConfigurationError):
    """The storage refuses us (wrong credentials, no permission, no such bucket): retrying
    or restarting cannot help, so the job fails at once with this message."""


class StorageFullError(StorageError):
    """The device or quota under the storage is full (ENOSPC, EDQUOT). Nothing that was
    completed is touched (objects are written to a temporary name first, which is removed);
    the write fails like any storage write, so the job fails over and retries from the latest
    completed checkpoint until space is free or its restart strategy gives up."""


class ObjectMissingError(StorageError, FileNotFoundError):
    """No object under that name."""


class ObjectExistsError(StorageError, FileExistsError):
    """``put_new`` found an object under that name already."""


# ---------------------------------------------------------------- the store


class ObjectStore(ABC):
    """Whole-object operations on locations under ``root`` (locations support ``/``)."""

    scheme: str = ""
    root: Any

    @abstractmethod
    def parse(self, text: str | os.PathLike[str]) -> Any:
        """A location of this store from user input (a path, a URL)."""

    @abstractmethod
    def put(self, loc: Any, data: bytes) -> None:
        """Write ``data`` whole: readers never see part of it."""

    @abstractmethod
    def put_new(self, loc: Any, data: bytes) -> None:
        """Write ``data`` whole only if ``loc`` does not exist, else raise ``ObjectExistsError``.
        Re-writing identical bytes (a retried request that had succeeded) is not an error."""

    @abstractmethod
    def get(self, loc: Any) -> bytes:
        """The object's bytes; ``ObjectMissingError`` if there is none."""

    def put_file(self, loc: Any, path: str | os.PathLike[str]) -> None:
        """``put`` of a local file's bytes. Stores override it to stream, so that a large file
        (a RocksDB SST file of 64 MB) is never held in memory whole."""
        with open(path, "rb") as f:
            self.put(loc, f.read())

    def get_file(self, loc: Any, path: str | os.PathLike[str]) -> None:
        """Copy the object into the local file ``path`` (streamed where the store can);
        ``ObjectMissingError`` if there is none."""
        data = self.get(loc)
        with open(path, "wb") as f:
            f.write(data)

    @abstractmethod
    def exists(self, loc: Any) -> bool:
        """Whether an object is stored under exactly ``loc``."""

    @abstractmethod
    def size(self, loc: Any) -> int:
        """The object's size in bytes (a stat, no read); ``ObjectMissingError`` if there is none."""

    @abstractmethod
    def is_dir(self, loc: Any) -> bool:
        """Whether objects are stored under ``loc/`` (a folder, a key prefix)."""

    @abstractmethod
    def keys(self, loc: Any, prefix: str = "") -> Iterator[str]:
        """Keys (relative to ``loc``, ``/``-separated) of every object under ``loc`` whose
        relative key starts with ``prefix``."""

    @abstractmethod
    def delete(self, loc: Any) -> None:
        """Delete one object (missing is fine)."""

    def delete_tree(self, loc: Any) -> None:
        """Delete every object under ``loc``."""
        for key in list(self.keys(loc)):
            self.delete(loc / key)

    @abstractmethod
    def move(self, src: Any, dst: Any) -> None:
        """Move an object (``dst`` holds ``src``'s bytes afterwards, ``src`` is gone). A crash
        in the middle leaves ``src`` (and maybe ``dst``), so moving again finishes it."""

    def move_tree(self, src: Any, dst: Any) -> None:
        for key in list(self.keys(src)):
            self.move(src / key, dst / key)

    @abstractmethod
    def root_exists(self) -> bool:
        """Whether the root container exists (folder, bucket)."""


# ---------------------------------------------------------------- checkpoint storage


class ObjectCheckpointStorage(CheckpointStorage):
    """The epoch commit on an ``ObjectStore``: state files, manifests, retention, recovery."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.root = store.root
        self.scheme = store.scheme
        #: temporary files removed by the first recovery of this process (None: not yet looked)
        self.removed_temporary: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # ------------------------------------------------------------ pre-commit: state files
    def state_path(self, operator: str, subtask: int, epoch: int, attempt: str) -> str:
        return f"shared/{safe_name(operator)}/{subtask}/e{epoch}-a{attempt}.parquet"

    def pre_commit(self, operator: str, subtask: int, epoch: int, attempt: str, rows: Iterable[Row],
                   key_group_range: tuple[int, int], full: bool) -> StateFileRef:
        if getattr(rows, "native_format", None) == "rocksdb":  # an incremental RocksDB checkpoint
            from . import rocksdb_checkpoint

            prefix = self.state_path(operator, subtask, epoch, attempt)[:-len(".parquet")]
            return rocksdb_checkpoint.upload(self.store, self.root, prefix, operator, subtask, epoch,
                                             rows, key_group_range)  # type: ignore[arg-type]
        data, count = encode_state_counted(rows)
        rel = self.state_path(operator, subtask, epoch, attempt)
        self.store.put(self.root / rel, data)
        lo, hi = key_group_range  # callers may pass a list (from JSON): the ref holds a tuple
        return StateFileRef(operator, subtask, epoch, rel, (lo, hi), full, count, len(data),
                            hashlib.sha256(data).hexdigest())

    def read_state(self, ref: StateFileRef, root: Any = None) -> pa.Table:
        path = (self.root if root is None else root) / ref.path
        data = self._verified_bytes(ref, path)
        try:
            return parquet_table(data)
        except Exception as exc:  # verified bytes that still do not parse: say so
            raise CheckpointError(f"state file {path} cannot be parsed: {exc}") from exc

    def _verified_bytes(self, ref: StateFileRef, path: Any) -> bytes:
        try:
            data = self.store.get(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"state file {path} of operator {ref.operator!r} (epoch {ref.epoch}) is missing") from None
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
        return data

    # ------------------------------------------------------------ commit: manifests
    def checkpoint_dir(self, epoch: int) -> Any:
        return self.root / f"chk-{epoch}"

    def commit(self, manifest: dict[str, Any]) -> Any:
        folder = self.checkpoint_dir(manifest["epoch"])
        data = encode_manifest(manifest)
        try:
            self.store.put_new(folder / METADATA, data)
        except ObjectExistsError:
            raise ObjectExistsError(
                f"checkpoint {folder} already exists with other content; a completed checkpoint is never "
                f"overwritten (is another job writing to {self.root}?)"
            ) from None
        return folder

    def exists(self) -> bool:
        return self.store.root_exists()

    def list_checkpoints(self) -> list[int]:
        out = set()
        for key in self.store.keys(self.root, "chk-"):
            folder, _, name = key.partition("/")
            m = _CHK.match(folder)
            if m and name == METADATA:
                out.add(int(m.group(1)))
        return sorted(out)

    def _manifest_location(self, location: Any) -> Any:
        if isinstance(location, int):
            return self.checkpoint_dir(location) / METADATA
        loc = self.store.parse(location)
        if self.store.is_dir(loc):
            if self.store.exists(loc / METADATA):
                return loc / METADATA
            raise CheckpointError(
                f"{loc} is not a checkpoint: it has no {METADATA} (a checkpoint dir holds chk-N folders; "
                f"restore a chk-N folder or use restore='latest' with checkpoint_dir)"
            )
        return loc

    def load_manifest(self, location: Any) -> tuple[dict[str, Any], Any]:
        path = self._manifest_location(location)
        try:
            text = self.store.get(path).decode("utf-8")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint manifest {path} does not exist") from None
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"checkpoint manifest {path} is corrupt: not UTF-8 text ({exc.reason})") from None
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"checkpoint manifest {path} is corrupt or truncated: {exc}") from None
        validate_manifest(manifest, str(path))
        folder = _CHK.match(path.parent.name)
        if folder and not manifest.get("self_contained") and int(folder.group(1)) != manifest["epoch"]:
            raise CheckpointError(
                f"checkpoint manifest {path} is the manifest of epoch {manifest['epoch']}, not of epoch "
                f"{folder.group(1)} (moved, copied or swapped between checkpoints); nothing is restored from it")
        if not verified(manifest):
            log.warning("checkpoint manifest %s (format version %s) predates manifest checksums: read unverified",
                        path, manifest.get("format_version"))
        # checkpoints name files relative to the storage root; a savepoint relative to itself
        root = path.parent if manifest.get("self_contained") else path.parent.parent
        return manifest, root

    def latest(self) -> tuple[dict[str, Any], Any] | None:
        for epoch in reversed(self.list_checkpoints()):
            try:
                return self.load_manifest(epoch)
            except CheckpointError as exc:
                log.warning("skipping checkpoint %d: %s", epoch, exc)
        return None

    def read_operator_rows(self, manifest: dict[str, Any], root: Any, operator: str,
                           key_groups: tuple[int, int] | None = None) -> Iterable[Row]:
        entry = manifest["operators"].get(operator)
        if entry is None:
            return
        for f in entry["files"]:
            ref = StateFileRef.from_json(f)
            lo, hi = ref.key_group_range
            if key_groups is not None and (hi < key_groups[0] or lo > key_groups[1]):
                continue
            if ref.format == "rocksdb":
                from . import rocksdb_checkpoint

                base = self.root if root is None else root
                handle = self._verified_bytes(ref, base / ref.path)
                yield from rocksdb_checkpoint.read_rows(self.store, base, ref, handle, key_groups)
                continue
            table = self.read_state(ref, root)
            cols = [table.column(n).to_pylist() for n in ("key_group", "key", "state", "value")]
            for row in zip(*cols, strict=True):
                if key_groups is None or key_groups[0] <= row[0] <= key_groups[1]:
                    yield row

    def native_checkpoint(self, manifest: dict[str, Any], root: Any, operator: str,
                          key_groups: tuple[int, int]) -> tuple[StateFileRef, bytes, Any] | None:
        """The one incremental RocksDB checkpoint that holds all of ``operator``'s state in
        ``key_groups``, if that is how the state was written: (its ref, its checked handle, the
        root its files are under). A RocksDB backend restoring that range opens it as its DB
        rather than re-inserting its rows. None if the range spans several files, or rows."""
        entry = manifest["operators"].get(operator)
        if entry is None:
            return None
        refs = [StateFileRef.from_json(f) for f in entry["files"]]
        touching = [r for r in refs if not (r.key_group_range[1] < key_groups[0]
                                            or r.key_group_range[0] > key_groups[1])]
        if len(touching) != 1 or touching[0].format != "rocksdb":
            return None
        ref = touching[0]
        if not ref.key_group_range[0] <= key_groups[0] <= key_groups[1] <= ref.key_group_range[1]:
            return None
        base = self.root if root is None else root
        return ref, self._verified_bytes(ref, base / ref.path), base

    # ------------------------------------------------------------ abort / retention / recovery
    def discard(self, epoch: int) -> None:
        self.store.delete_tree(self.checkpoint_dir(epoch))

    def retained_manifests(self) -> tuple[list[dict[str, Any]], list[int]]:
        """Manifests that load, and the epochs of those that do not."""
        good, damaged = [], []
        for epoch in self.list_checkpoints():
            try:
                good.append(self.load_manifest(epoch)[0])
            except CheckpointError:
                damaged.append(epoch)
        return good, damaged

    def _shared_files(self) -> Iterator[str]:
        return (k for k in self.store.keys(self.root, "shared/"))

    def collect_garbage(self, retained: list[dict[str, Any]], keep_after: int) -> int:
        live = _live_files(retained)
        removed = 0
        for rel in list(self._shared_files()):
            m = _STATE_FILE.search(rel)
            if not rel.endswith(_MANAGED) or rel in live or (m and int(m.group(1)) > keep_after):
                continue
            self.store.delete(self.root / rel)
            removed += 1
        return removed

    def remove_orphans(self, retained: list[dict[str, Any]]) -> int:
        """Every state file (and leftover temporary file) no retained manifest names is garbage:
        captures of epochs that never completed before the failure."""
        live = _live_files(retained)
        removed = 0
        for rel in list(self._shared_files()):
            if rel not in live:
                self.store.delete(self.root / rel)
                removed += 1
        return removed

    def remove_temporary(self) -> int:
        """Delete temporary files (``.<name>.tmp-<pid>``) a killed or failed writer left anywhere
        under the root; only the lease holder recovers, so none of them is being written."""
        removed = 0
        if self.scheme != "file":  # object stores write whole objects: no temporary files
            return removed
        for rel in list(self.store.keys(self.root)):
            if _TMP_FILE.search(rel):
                self.store.delete(self.root / rel)
                removed += 1
        return removed

    def recover(self, restored_epoch: int | None) -> None:
        if self.removed_temporary is None:  # once per run: before its first attempt
            self.removed_temporary = self.remove_temporary()
            if self.removed_temporary:
                log.warning("removed %d temporary files left in %s by an earlier writer", self.removed_temporary,
                            self.root)
        retained, damaged = self.retained_manifests()
        for epoch in damaged:
            if epoch > (restored_epoch or 0):
                aside = self.root / f"chk-{epoch}.damaged-{secrets.token_hex(3)}"
                log.warning("checkpoint %s is damaged and newer than the restored epoch %s; moving it to %s so "
                            "the epoch can be written again", self.checkpoint_dir(epoch), restored_epoch, aside)
                self.store.move_tree(self.checkpoint_dir(epoch), aside)
        self.remove_orphans(retained)


def _live_files(retained: list[dict[str, Any]]) -> set[str]:
    return {p for m in retained for op in m["operators"].values() for f in op["files"]
            for p in StateFileRef.from_json(f).paths()}


#: rows per Parquet row group when a capture is encoded as it streams in
ENCODE_CHUNK_ROWS = 65_536


def _state_table(rows: list[Row]) -> pa.Table:
    if rows:
        kgs, keys, names, values = zip(*rows, strict=True)
    else:
        kgs, keys, names, values = (), (), (), ()
    return pa.Table.from_arrays(
        [pa.array(kgs, pa.int32()), pa.array(keys, pa.binary()), pa.array(names, pa.string()),
         pa.array(values, pa.binary())],
        schema=STATE_SCHEMA,
    )


def _column_table(rows: ColumnRows, lo: int, hi: int) -> pa.Table:
    """Rows ``lo:hi`` of a columnar capture as a table of ``STATE_SCHEMA``."""
    names: list[str] = []
    at = 0
    for name, n in rows.states:  # runs of one state name
        a, b = max(at, lo), min(at + n, hi)
        if a < b:
            names += [name] * (b - a)
        at += n
    return pa.Table.from_arrays(
        [pa.array(rows.key_groups[lo:hi], pa.int32()), binary_array(rows.keys[lo:hi]), pa.array(names, pa.string()),
         binary_array(rows.values[lo:hi])],
        schema=STATE_SCHEMA,
    )


def binary_array(values: list[bytes] | list[bytes | None]) -> pa.Array:
    """A binary array of Python bytes (None: null) from one join and the lengths: ``pa.array``
    converts bytes objects one by one, about 8x slower (0.8 s against 0.1 s for 500K pickles)."""
    import numpy as np

    n = len(values)
    valid = None
    if None in values:
        mask = np.fromiter((v is not None for v in values), dtype=bool, count=n)
        valid = pa.py_buffer(np.packbits(mask, bitorder="little"))
        values = [b"" if v is None else v for v in values]
    lens = np.fromiter(map(len, values), dtype=np.int64, count=n)  # type: ignore[arg-type]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if offsets[-1] >= 2**31:  # more than int32 offsets hold: the slow way
        return pa.array(values, pa.binary())
    data = b"".join(values)  # type: ignore[arg-type]
    return pa.Array.from_buffers(pa.binary(), n, [valid, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)],
                                 null_count=-1 if valid is not None else 0)


def encode_state(rows: Iterable[Row]) -> bytes:
    """One capture as Parquet (zstd) bytes."""
    return encode_state_counted(rows)[0]


def encode_state_counted(rows: Iterable[Row]) -> tuple[bytes, int]:
    """One capture as Parquet (zstd) bytes, and its row count. Rows are taken in chunks of
    ``ENCODE_CHUNK_ROWS`` (one row group each), so a capture that streams its rows (a full
    RocksDB capture iterating a DB snapshot) is never held whole in memory, only its
    compressed bytes."""
    sink = io.BytesIO()
    if isinstance(rows, ColumnRows):  # the heap's captures: columns in, no tuple per row
        count = len(rows)
        with pq.ParquetWriter(sink, STATE_SCHEMA, compression="zstd") as writer:
            for lo in range(0, count, ENCODE_CHUNK_ROWS) if count else (0,):
                writer.write_table(_column_table(rows, lo, lo + ENCODE_CHUNK_ROWS))
        return sink.getvalue(), count
    it = iter(rows)
    chunk = list(itertools.islice(it, ENCODE_CHUNK_ROWS))
    count = len(chunk)
    if count < ENCODE_CHUNK_ROWS:  # the common case: one table, one row group
        pq.write_table(_state_table(chunk), sink, compression="zstd")
        return sink.getvalue(), count
    with pq.ParquetWriter(sink, STATE_SCHEMA, compression="zstd") as writer:
        while chunk:
            writer.write_table(_state_table(chunk))
            chunk = list(itertools.islice(it, ENCODE_CHUNK_ROWS))
            count += len(chunk)
    return sink.getvalue(), count


def parquet_table(data: bytes) -> pa.Table:
    """Parquet bytes as an Arrow table, read in the calling thread from a buffer Arrow owns.

    ``pq.read_table(pa.BufferReader(data))`` scans through Arrow's dataset API, whose pool
    threads may drop the last reference to the wrapped Python ``bytes`` after the read returns.
    At interpreter exit that release needs the GIL, the thread is ended inside C++, and the
    process aborts ("terminate called without an active exception", apache/arrow#34314). A
    copy into an Arrow buffer and the single-file reader leave nothing for those threads."""
    copy = pa.BufferOutputStream()
    copy.write(data)
    return pq.ParquetFile(pa.BufferReader(copy.getvalue())).read()


def safe_name(name: str) -> str:
    """A file-name form of a uid that is distinct for distinct uids (percent-encoding)."""
    return quote(name, safe="") if name not in (".", "..") else quote(name.replace(".", "%2E"), safe="%")
