"""The embedded checkpoint storage: a local (or mounted) filesystem directory.

``LocalObjects`` is the ``ObjectStore`` of a folder: an object is a file, ``put`` writes a
temporary file, fsyncs it and renames it over the target (then fsyncs the folder), and
``put_new``, the commit point of a manifest, hard-links the complete temporary file to the
target name, which fails if the name exists: a manifest is never half-written and never
replaces a completed checkpoint. Everything else (layout, state files, manifests,
retention, recovery) is ``objects.ObjectCheckpointStorage``, shared with S3.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from ..snapshot.manifest import CheckpointError, StateFileRef
from .base import Row
from .objects import (  # noqa: F401  (METADATA, STATE_SCHEMA: imported from here by callers)
    METADATA,
    STATE_SCHEMA,
    ObjectCheckpointStorage,
    ObjectExistsError,
    ObjectMissingError,
    ObjectStore,
    StorageFullError,
    safe_name,
)

_safe = safe_name  # the foundation's name
#: temporary files are ``.<name>.tmp-<pid>``; one a killed writer left is removed by the next recovery
TMP_MARK = ".tmp-"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: bytes per read when a file is copied into the store (large files are never held whole)
COPY_CHUNK = 1 << 20

#: errors that mean the device or the quota is full
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _write_tmp(path: Path, data: bytes | BinaryIO) -> Path:
    """``data`` (bytes, or a file read in chunks) in a temporary file beside ``path``; a failed
    write (a full disk) removes it."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            if hasattr(data, "read"):  # a file: copied in chunks, never held whole
                shutil.copyfileobj(data, f, COPY_CHUNK)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # a partial temporary file holds space and is garbage
        if exc.errno not in _FULL:
            raise
        raise StorageFullError(
            exc.errno, f"no space left writing {path} ({_size(data)} bytes): {exc.strerror or exc}; free space on "
                       f"its device (or raise the quota): completed checkpoints are intact, and the job resumes "
                       f"from the latest one once writes succeed") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _size(data: bytes | BinaryIO) -> int:
    return os.fstat(data.fileno()).st_size if hasattr(data, "fileno") else len(data)


def atomic_write(path: Path, data: bytes | BinaryIO) -> None:
    """Write ``data`` so that ``path`` holds either nothing, the old bytes, or all new bytes."""
    tmp = _write_tmp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def local_path(text: str | os.PathLike[str]) -> Path:
    """An absolute path from a path or ``file://`` URL; other URLs are refused by name."""
    s = os.fspath(text)
    if isinstance(s, str) and "://" in s:
        if not s.startswith("file://"):
            raise CheckpointError(f"{s} is not a local path, and this storage is a local folder")
        s = s[len("file://"):]
    return Path(s).expanduser().resolve()


class LocalObjects(ObjectStore):
    """Objects as files under a folder; locations are ``pathlib.Path``."""

    scheme = "file"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = self.parse(root)

    def parse(self, text: str | os.PathLike[str]) -> Path:
        return local_path(text)

    def put(self, loc: Path, data: bytes) -> None:
        atomic_write(loc, data)

    def put_file(self, loc: Path, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            atomic_write(loc, f)

    def get_file(self, loc: Path, path: str | os.PathLike[str]) -> None:
        try:
            shutil.copyfile(loc, path)
        except FileNotFoundError:
            if not loc.exists():
                raise ObjectMissingError(f"{loc} does not exist") from None
            raise

    def put_new(self, loc: Path, data: bytes) -> None:
        tmp = _write_tmp(loc, data)
        try:
            os.link(tmp, loc)
        except FileExistsError:
            if loc.read_bytes() != data:
                raise ObjectExistsError(f"{loc} already exists") from None
        finally:
            os.unlink(tmp)
        _fsync_dir(loc.parent)

    def get(self, loc: Path) -> bytes:
        try:
            return loc.read_bytes()
        except FileNotFoundError:
            raise ObjectMissingError(f"{loc} does not exist") from None
        except IsADirectoryError:
            raise CheckpointError(f"{loc} is a folder, not a file") from None

    def exists(self, loc: Path) -> bool:
        return loc.is_file()

    def size(self, loc: Path) -> int:
        try:
            return loc.stat().st_size
        except FileNotFoundError:
            raise ObjectMissingError(f"{loc} does not exist") from None

    def is_dir(self, loc: Path) -> bool:
        return loc.is_dir()

    def keys(self, loc: Path, prefix: str = "") -> Iterator[str]:
        if not loc.is_dir():
            return
        # walk only the top-level entries the prefix allows, then everything below them
        head = prefix.split("/", 1)[0]
        for top in loc.iterdir():
            if not top.name.startswith(head):
                continue
            paths = [top] if top.is_file() else (p for p in top.rglob("*") if p.is_file())
            for p in paths:
                rel = p.relative_to(loc).as_posix()
                if rel.startswith(prefix):
                    yield rel

    def delete(self, loc: Path) -> None:
        loc.unlink(missing_ok=True)

    def delete_tree(self, loc: Path) -> None:
        shutil.rmtree(loc, ignore_errors=True)

    def move(self, src: Path, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)

    def move_tree(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def root_exists(self) -> bool:
        return self.root.is_dir()


class LocalCheckpointStorage(ObjectCheckpointStorage):
    """Checkpoint storage under one directory: begin/pre-commit/commit/abort/recover.

    ``save_delay`` (seconds, default 0) makes every persistent save of a task's state (its
    pre-commit) take that much longer, as a slower store would: the benchmark of paper 000's
    Figure 12 varies it. The delay is a sleep in the thread that writes, so it costs the
    writer time, not CPU.
    """

    def __init__(self, root: str | os.PathLike[str], save_delay: float = 0.0) -> None:
        store = LocalObjects(root)
        if store.root.exists() and not store.root.is_dir():
            raise CheckpointError(f"checkpoint dir {store.root} exists and is not a directory")
        if not save_delay >= 0:
            raise ValueError(f"LocalCheckpointStorage: save_delay must be >= 0 seconds, got {save_delay!r}")
        super().__init__(store)
        self.save_delay = float(save_delay)

    def pre_commit(self, operator: str, subtask: int, epoch: int, attempt: str, rows: Iterable[Row],
                   key_group_range: tuple[int, int], full: bool) -> StateFileRef:
        if self.save_delay:
            time.sleep(self.save_delay)
        return super().pre_commit(operator, subtask, epoch, attempt, rows, key_group_range, full)

    def __repr__(self) -> str:
        return f"LocalCheckpointStorage({str(self.root)!r})"
