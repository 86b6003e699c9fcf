"""Incremental RocksDB checkpoints: upload only new SST files and share them between epochs.

Flink's RocksDB incremental checkpoints, on any ``ObjectStore`` (local folder, S3). At an
epoch bound a RocksDB keyed-state backend (``rocksdb_state``) takes a RocksDB checkpoint
(memtable flushed, SST files hard-linked into a folder of their own: ``SstCapture``); the
writer then calls ``upload`` with it:

* every SST file the backend has not uploaded yet goes to
  ``shared/<operator>/<subtask>/e<epoch>-a<attempt>-<db id>-<file>.sst``; files uploaded by
  earlier captures of the same DB are only referenced (SST files are immutable, so a file
  that is still live in the DB is the same bytes that were uploaded);
* the checkpoint's private files (``CURRENT``, ``MANIFEST-*``, ``OPTIONS-*``; a few KB) and
  the state-id -> state-name map go into a small handle, ``e<epoch>-a<attempt>.rocks.json``;
* the handle's ``StateFileRef`` (``format="rocksdb"``) lists every SST file the epoch needs
  in ``shared`` with its size and sha256. The manifest therefore names every shared file,
  so retention keeps a file exactly while some retained manifest refers to it (reference
  counting by the manifests themselves), and recovery's orphan sweep removes the rest.

Why reuse is safe without completion notices. A worker's writer persists captures of one
task in epoch order, and an SST file, once gone from the DB, never returns. So if a later
capture refers to a file uploaded at epoch ``u``, every completed epoch ``c >= u`` before it
had the file too and, being persisted after ``u``, referred to the same upload; garbage
collection after ``c`` spares files of epochs ``> c`` anyway. The map keeps the first upload
of a local file (first writer wins), and a failed write empties it (``force_full``).

Restore downloads the handle and the SST files into a scratch folder (each verified against
its size and sha256; a missing or damaged one is named), opens it read-only, and streams the
rows of the requested key-group range (a range scan from the range's first key group: the
key layout puts key groups first). The rows feed either keyed-state backend, so restoring
onto the heap, onto RocksDB, and rescaling (another key-group range) work alike, and a
savepoint is a self-contained full copy in the row format, like Flink's canonical savepoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Iterator

from ..snapshot.manifest import CheckpointError, SharedFile, StateFileRef

if TYPE_CHECKING:
    from .objects import ObjectStore

HANDLE_FORMAT = "epochstream-rocksdb-checkpoint"
#: the ``StateFileRef.format`` of an incremental RocksDB checkpoint
FORMAT = "rocksdb"


#: whether this process has opened a RocksDB (then it may read checkpoints itself; see
#: ``rocksdb_reader``: a process that forks must not have)
_USED_HERE = False


def mark_used() -> None:
    """This process opens RocksDB DBs (a keyed-state backend): it reads checkpoints in-process."""
    global _USED_HERE
    _USED_HERE = True


def used_here() -> bool:
    """Has this process opened a RocksDB DB? Then a process it forks cannot use RocksDB: the
    library's background threads do not survive ``fork``, and the child's DB waits for them."""
    return _USED_HERE


class UploadMap:
    """Local SST file name -> its upload, for one DB: shared by the backend (which empties it
    when the next capture must be full) and its captures' uploads (which fill it)."""

    def __init__(self) -> None:
        self.files: dict[str, SharedFile] = {}
        self.lock = threading.Lock()

    def get(self, name: str) -> SharedFile | None:
        with self.lock:
            return self.files.get(name)

    def add(self, name: str, ref: SharedFile) -> SharedFile:
        """Record an upload unless one is recorded already (first writer wins); the recorded one."""
        with self.lock:
            return self.files.setdefault(name, ref)

    def clear(self) -> None:
        with self.lock:
            self.files.clear()


class SstCapture:
    """A RocksDB checkpoint of one keyed operator subtask at an epoch bound, to be uploaded.

    Stands in a ``KeyedCapture`` where the rows would be (``native_format`` tells the storage);
    ``len`` is the number of keys written since the previous capture (the simulator's cost
    model). The folder is removed when the capture is dropped."""

    native_format = FORMAT

    def __init__(self, path: str, db_id: str, states: dict[str, str], uploads: UploadMap, changed: int,
                 keys: int) -> None:
        self.path = path
        self.db_id = db_id
        #: state id (hex of the 2-byte id in the DB keys) -> state name
        self.states = states
        self.uploads = uploads
        self.changed = changed
        #: RocksDB's estimate of the keys in the DB
        self.keys = keys
        self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)

    def __len__(self) -> int:
        return self.changed

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("an incremental RocksDB capture is uploaded as SST files, not read as rows")

    def release(self) -> None:
        self._finalizer()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: str) -> tuple[int, str]:
    """Size and sha256 of a local file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def upload(store: ObjectStore, root: Any, prefix: str, operator: str, subtask: int, epoch: int,
           capture: SstCapture, key_group_range: tuple[int, int]) -> StateFileRef:
    """Upload a capture's new SST files and its handle (``prefix`` is ``shared/<op>/<subtask>/e<epoch>-a<attempt>``)."""
    try:
        names = sorted(os.listdir(capture.path))
    except OSError as exc:
        raise CheckpointError(f"operator {operator!r} epoch {epoch}: the RocksDB checkpoint {capture.path} "
                              f"is gone ({exc})") from exc
    shared: list[SharedFile] = []
    local: dict[str, str] = {}
    private: dict[str, str] = {}
    new_bytes = 0
    for name in names:
        path = os.path.join(capture.path, name)
        if not name.endswith(".sst"):  # CURRENT, MANIFEST, OPTIONS: small, kept in the handle
            with open(path, "rb") as f:
                private[name] = base64.b64encode(f.read()).decode("ascii")
            continue
        ref = capture.uploads.get(name)
        if ref is None:
            rel = f"{prefix}-{capture.db_id}-{name}"
            size, sha = _file_sha(path)
            store.put_file(root / rel, path)  # streamed: an SST file is never held in memory whole
            new_bytes += size
            ref = capture.uploads.add(name, SharedFile(rel, size, sha))
        shared.append(ref)
        local[ref.path] = name
    handle = json.dumps({"format": HANDLE_FORMAT, "db": capture.db_id, "states": capture.states,
                         "private": private, "files": local}, sort_keys=True).encode()
    rel = f"{prefix}.rocks.json"
    store.put(root / rel, handle)
    capture.release()  # the hard links are no longer needed
    lo, hi = key_group_range
    full = new_bytes == sum(s.bytes for s in shared)
    return StateFileRef(operator, subtask, epoch, rel, (lo, hi), full, capture.keys, len(handle), _sha(handle),
                        format=FORMAT, shared=tuple(shared), new_bytes=new_bytes + len(handle))


def _download_verified(store: ObjectStore, root: Any, ref: StateFileRef, f: SharedFile, dest: str) -> None:
    """Download a shared SST file to ``dest`` (streamed) and check its size and sha256."""
    path = root / f.path
    what = f"shared SST file {path} of operator {ref.operator!r} (epoch {ref.epoch})"
    try:
        store.get_file(path, dest)
    except FileNotFoundError:
        raise CheckpointError(f"{what} is missing") from None
    size, sha = _file_sha(dest)
    if size != f.bytes:
        raise CheckpointError(f"{what} is damaged: expected {f.bytes} bytes, found {size} (truncated or "
                              f"overwritten)")
    if sha != f.sha256:
        raise CheckpointError(f"{what} is damaged: its sha256 differs from the one the manifest recorded "
                              f"({f.sha256[:12]}...)")


class Downloaded:
    """A RocksDB checkpoint's files in a local folder, checked: what a restore opens."""

    def __init__(self, folder: str, states: dict[bytes, str], files: dict[str, SharedFile]) -> None:
        self.folder = folder
        #: state id (the 2 bytes in the DB keys) -> state name
        self.states = states
        #: local SST file name -> its shared upload (a restore that reuses them seeds its UploadMap)
        self.files = files


def download(store: ObjectStore, root: Any, ref: StateFileRef, handle_bytes: bytes, folder: str) -> Downloaded:
    """Write one incremental RocksDB checkpoint's files into ``folder`` (which must exist): the
    handle's small files, and each shared SST file streamed and checked against its size and
    sha256. A damaged handle or file raises ``CheckpointError`` naming it."""
    try:
        handle = json.loads(handle_bytes)
        if handle.get("format") != HANDLE_FORMAT:
            raise ValueError(f"format is {handle.get('format')!r}")
        states = {bytes.fromhex(k): v for k, v in handle["states"].items()}
        private = {k: base64.b64decode(v) for k, v in handle["private"].items()}
        local = dict(handle["files"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"RocksDB checkpoint handle {root / ref.path} of operator {ref.operator!r} "
                              f"(epoch {ref.epoch}) is damaged: {exc}") from None
    for name, data in private.items():
        with open(os.path.join(folder, os.path.basename(name)), "wb") as f:
            f.write(data)
    files: dict[str, SharedFile] = {}
    for f_ref in ref.shared:
        name = local.get(f_ref.path)
        if name is None:
            raise CheckpointError(f"RocksDB checkpoint handle {root / ref.path} does not name the local file "
                                  f"of shared SST file {f_ref.path}")
        name = os.path.basename(name)
        _download_verified(store, root, ref, f_ref, os.path.join(folder, name))
        files[name] = f_ref
    return Downloaded(folder, states, files)


def read_rows(store: ObjectStore, root: Any, ref: StateFileRef, handle_bytes: bytes,
              key_groups: tuple[int, int] | None) -> Iterator[tuple[int, bytes, str, bytes | None]]:
    """Rows of one incremental RocksDB checkpoint (optionally one key-group range), in key-group
    order: its files downloaded into a scratch folder, verified, opened read-only."""
    lo, hi = ref.key_group_range
    if key_groups is not None:
        lo, hi = max(lo, key_groups[0]), min(hi, key_groups[1])
        if lo > hi:
            return
    folder = tempfile.mkdtemp(prefix=f"epochstream-restore-{uuid.uuid4().hex[:8]}-")
    try:
        states = download(store, root, ref, handle_bytes, folder).states
        what = f"RocksDB checkpoint {root / ref.path} of operator {ref.operator!r} (epoch {ref.epoch})"
        entries = _entries_here(folder, lo, hi, what) if _USED_HERE else _entries_apart(folder, lo, hi, what)
        for dbk, raw in entries:
            n = int.from_bytes(raw[:4], "big")
            yield int.from_bytes(dbk[:2], "big"), raw[4:4 + n], states[dbk[2:4]], raw[4 + n:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _entries_here(folder: str, lo: int, hi: int, what: str) -> Iterator[tuple[bytes, bytes]]:
    """(DB key, DB value) of key groups lo..hi, read in this process (which uses RocksDB anyway)."""
    import rocksdict as rd

    from .rocksdb_reader import open_read_only

    db: Any
    try:
        db = open_read_only(rd, folder)
    except Exception as exc:
        raise CheckpointError(f"{what} cannot be opened: {exc}") from exc
    try:
        for dbk, raw in db.items(from_key=lo.to_bytes(2, "big")):
            if int.from_bytes(dbk[:2], "big") > hi:
                break
            yield dbk, raw
    finally:
        db.close()


class _Reader:
    """A long-lived ``rocksdb_reader`` process; one request at a time (``lock``)."""

    def __init__(self) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rocksdb_reader.py")
        self.proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def entries(self, folder: str, lo: int, hi: int, what: str) -> Iterator[tuple[bytes, bytes]]:
        stdin, out = self.proc.stdin, self.proc.stdout
        assert stdin is not None and out is not None
        stdin.write(f"{folder}\t{lo.to_bytes(2, 'big').hex()}\t{hi}\n".encode())
        stdin.flush()
        done = False
        try:
            while True:
                head = out.read(4)
                if len(head) < 4:
                    raise CheckpointError(f"{what} cannot be read: the reader process ended")
                if head == _END:
                    err = out.read(int.from_bytes(out.read(4), "big")).decode(errors="replace")
                    done = True
                    if err:
                        raise CheckpointError(f"{what} cannot be read: {err}")
                    return
                key = out.read(int.from_bytes(head, "big"))
                value = out.read(int.from_bytes(out.read(4), "big"))
                yield key, value
        finally:
            while not done:  # the caller stopped early: drain the answer so the next request starts clean
                head = out.read(4)
                if len(head) < 4:
                    break
                if head == _END:
                    out.read(int.from_bytes(out.read(4), "big"))
                    break
                out.read(int.from_bytes(head, "big"))
                out.read(int.from_bytes(out.read(4), "big"))


_END = b"\xff\xff\xff\xff"
_reader: _Reader | None = None
_reader_guard = threading.Lock()


def _entries_apart(folder: str, lo: int, hi: int, what: str) -> Iterator[tuple[bytes, bytes]]:
    """The same, read by the ``rocksdb_reader`` process, so this process never starts RocksDB's
    background threads (it may fork workers later). A read while another is in progress (a
    second thread, nested iteration) gets a reader of its own."""
    global _reader
    with _reader_guard:
        if _reader is None or not _reader.alive():
            _reader = _Reader()
        reader = _reader
    own = not reader.lock.acquire(blocking=False)
    if own:
        reader = _Reader()
        reader.lock.acquire()
    try:
        yield from reader.entries(folder, lo, hi, what)
    finally:
        reader.lock.release()
        if own:
            if reader.proc.stdin is not None:
                reader.proc.stdin.close()
            reader.proc.wait()
