"""Keyed state on RocksDB (``rocksdict``): Flink's ``state.backend.type: rocksdb``.

Each keyed operator subtask keeps its state in its own local RocksDB, so a job's state may be
larger than its workers' memory: memory is bounded by ``CheckpointConfig.rocksdb_memory_mb``
(the block cache, with the memtables charged to it through a write-buffer manager, as Flink's
``state.backend.rocksdb.memory.fixed-per-slot`` does), and the rest lives on local disk.

Layout. A DB key is ``key group (2 bytes, big-endian) | state id (2 bytes) | key_bytes(key)``,
so one key-group range is one contiguous key range and a full iteration comes out in key-group
order; ``keygroups.key_bytes`` makes equal keys (1, 1.0, True) one DB key, as they are one dict
slot on the heap. A DB value is ``len(pickled key) (4 bytes) | pickled key | pickled value``: a
capture slices the rows the checkpoint storage writes out of it without unpickling anything.

Checkpoints produce exactly the rows ``HeapKeyedState`` produces (the same ``KeyedCapture``), so
every checkpoint storage, restore, rescaling and the state queries work unchanged: an
incremental capture reads the keys written since the last capture (only those keys are held in
memory, not their values), a full one iterates the DB. Values are read and written through
pickle on every access, as Flink's RocksDB backend serializes on every access: a value
fetched and mutated in place is only stored when written back (``update``, ``add``, ``put``).

The local DB is scratch space: it is created empty in a directory of its own and removed on
close (or when the backend is garbage collected); a restore always fills a fresh DB from the
checkpoint (rows, or the checkpoint's downloaded and verified files opened as the DB), so a
damaged or stale directory is never read. Directories left by killed
processes are removed by the next backend that starts under the same local directory. The
write-ahead log is off: the checkpoint, not the DB, is what survives a failure.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import shutil
import tempfile
import uuid
import weakref
from typing import Any, Callable, Iterable, Iterator, overload

from ..graph.keygroups import canonical_key, key_bytes
from ..runtime.errors import ConfigurationError, StateSerializationError
from ..runtime.messages import KeyedCapture
from ..runtime.state import (
    _IMMUTABLE,
    KeyedStateFactory,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    StateDescriptor,
    ValueState,
    ValueStateDescriptor,
    _KeyContext,
)
from ..runtime.types import TypeInformation, column_type, typed_column_name
from .rocksdb_checkpoint import SstCapture, UploadMap, mark_used

_PICKLE = pickle.HIGHEST_PROTOCOL
#: keyed-state backends a job can choose (Flink's ``state.backend.type``)
STATE_BACKEND_TYPES = ("hashmap", "rocksdb")
#: default memory bound of one keyed operator subtask's RocksDB, in MiB
DEFAULT_MEMORY_MB = 64
#: rows written to RocksDB per write batch on restore
RESTORE_BATCH = 10_000
_ROOT_NAME = "epochstream-rocksdb"


class RocksDBStateError(ConfigurationError):
    """The RocksDB keyed-state backend cannot run here (rocksdict missing, local dir unusable)."""


def keyed_state_factory(checkpoint: Any) -> KeyedStateFactory | None:
    """The keyed-state factory a job's ``CheckpointConfig`` asks for (None: the heap)."""
    kind = getattr(checkpoint, "state_backend_type", "hashmap")
    if kind == "hashmap":
        return None
    if kind != "rocksdb":
        raise ConfigurationError(f"state_backend_type must be one of {STATE_BACKEND_TYPES}, got {kind!r}")
    local_dir = getattr(checkpoint, "rocksdb_dir", None)
    memory_mb = int(getattr(checkpoint, "rocksdb_memory_mb", DEFAULT_MEMORY_MB))
    # incremental SST checkpoints need an object store for the files; the Delta state backend
    # commits rows (its tables are changelogs), so with it RocksDB captures rows as the heap does
    sst = bool(getattr(checkpoint, "incremental", True)) and getattr(checkpoint, "state_backend", "files") == "files"

    def make(uid: str, key_group_of: Callable[[Any], int], key_group_range: tuple[int, int],
             key_type: TypeInformation | None = None) -> RocksDBKeyedState:
        return RocksDBKeyedState(uid, key_group_of, key_group_range, key_type, local_dir=local_dir,
                                 memory_mb=memory_mb, sst_incremental=sst)

    return make


def _rocksdict() -> Any:
    try:
        import rocksdict
    except ImportError as exc:
        raise RocksDBStateError(
            "state_backend_type='rocksdb' needs the rocksdict package: pip install 'epochstream[rocksdb]'"
        ) from exc
    return rocksdict


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(root: str) -> None:
    """Remove DB directories of processes that are gone (killed workers never closed theirs)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _close_db(db: Any, path: str) -> None:
    try:
        db.close()
    except Exception:
        pass
    shutil.rmtree(path, ignore_errors=True)


class _Table:
    """One declared state: its id in the DB keys, kind and declared column type."""

    __slots__ = ("name", "kind", "sid", "type")

    def __init__(self, name: str, kind: str, sid: int) -> None:
        self.name = name
        self.kind = kind
        self.sid = sid.to_bytes(2, "big")
        self.type: TypeInformation | None = None


_MISSING = object()


class RocksDBKeyedState:
    """All keyed state of one operator subtask, in a local RocksDB (see the module doc)."""

    def __init__(self, operator_uid: str, key_group_of: Callable[[Any], int], key_group_range: tuple[int, int],
                 key_type: TypeInformation | None = None, *, local_dir: str | None = None,
                 memory_mb: int = DEFAULT_MEMORY_MB, sst_incremental: bool = False) -> None:
        if memory_mb < 8:
            raise RocksDBStateError(f"operator {operator_uid!r}: rocksdb_memory_mb must be >= 8, got {memory_mb}")
        self.operator_uid = operator_uid
        self.key_type = key_type
        self.keys = _KeyContext()
        self.tables: dict[str, _Table] = {}
        self._by_sid: dict[bytes, _Table] = {}
        self._key_group_of = key_group_of
        self.key_group_range = key_group_range
        self.chain: list[int] = []
        self.force_full = True
        self.event_time: int | None = None
        self.memory_bytes = memory_mb << 20
        #: incremental captures are RocksDB checkpoints whose new SST files alone are uploaded
        #: (``rocksdb_checkpoint``), instead of rows of the keys written since the last capture
        self.sst_incremental = sst_incremental
        #: this DB's uploaded SST files (emptied when a capture must be full: nothing is reused)
        self.uploads = UploadMap()
        self.db_id = uuid.uuid4().hex[:12]
        #: DB key -> (table, key) written since the last capture (keys only: values stay in the DB)
        self.dirty: dict[bytes, tuple[_Table, Any]] = {}
        self._ck: Any = _MISSING  # the current key whose encoding is cached
        self._cprefix = b""
        self._ckb = b""
        self._kpickled: bytes | None = None
        self._kread: tuple[bytes, bytes] | None = None  # (DB key, its stored pickled key) last read
        #: the batch scope (``begin_batch`` .. ``end_batch``): the batch's keys -> (key-group
        #: prefix, key bytes); DB key -> value (None: absent) of every entry read or written in
        #: it; the writes not yet in the DB; the state ids already read for the whole batch
        self._scope: dict[Any, tuple[bytes, bytes]] | None = None
        self._cache: dict[bytes, bytes | None] = {}
        self._pending: Any = None  # a rocksdict WriteBatch
        self._fetched: set[bytes] = set()
        root = os.path.join(local_dir or tempfile.gettempdir(), _ROOT_NAME)
        safe = re.sub(r"[^A-Za-z0-9_.]", "_", operator_uid)[:60]
        self.path = os.path.join(root, f"{os.getpid()}-{uuid.uuid4().hex[:12]}-{safe}-{key_group_range[0]}")
        rd = _rocksdict()
        mark_used()
        try:
            os.makedirs(root, exist_ok=True)
            _sweep(root)
            self._db = rd.Rdict(self.path, self._options(rd))
        except RocksDBStateError:
            raise
        except Exception as exc:
            raise RocksDBStateError(
                f"operator {operator_uid!r}: cannot open a RocksDB under {root!r}: {exc}") from exc
        wo = rd.WriteOptions()
        wo.disable_wal = True  # the checkpoint is what survives a failure, never this DB
        self._db.set_write_options(wo)
        self._rd = rd
        self._finalizer = weakref.finalize(self, _close_db, self._db, self.path)

    def _options(self, rd: Any) -> Any:
        """Memory bound: one LRU block cache of ``memory_bytes``; memtables are charged to it
        (write-buffer manager, half of it at most), index and filter blocks live in it too."""
        budget = self.memory_bytes
        opts = rd.Options(raw_mode=True)
        opts.create_if_missing(True)
        cache = rd.Cache(budget)
        table = rd.BlockBasedOptions()
        table.set_block_cache(cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        table.set_bloom_filter(10, False)  # whole-key, ~1% false positives: a new key's get reads no data block
        # partitioned filters and indexes (Flink's ``memory.partitioned-index-filters``): a file's
        # filter is many small blocks, not one of ~1.2 bytes per key that the memtables' share of
        # the cache evicts and the next lookup reads back whole (3M keys in one DB: 43K -> 55K rows/s)
        table.set_partition_filters(True)
        table.set_index_type(rd.BlockBasedIndexType.two_level_index_search())
        table.set_pin_top_level_index_and_filter(True)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_manager(rd.WriteBufferManager.new_write_buffer_manager_with_cache(
            budget // 2, False, cache))
        opts.set_write_buffer_size(max(1 << 20, budget // 8))
        opts.set_max_write_buffer_number(2)
        opts.set_max_open_files(256)
        return opts

    # ------------------------------------------------------------ keys
    def _key(self) -> None:
        """Encode the current key once per key (several state calls per record share it)."""
        k = self.keys.key
        if k is self._ck:
            return
        enc = None
        if self._scope is not None:
            try:
                enc = self._scope.get(k)
            except TypeError:  # unhashable: encoded below, as outside a scope
                pass
        if enc is None:
            self._cprefix = self._key_group_of(k).to_bytes(2, "big")
            self._ckb = key_bytes(k)
        else:
            self._cprefix, self._ckb = enc
        self._kpickled = None
        self._kread = None
        self._ck = k

    def _db_key(self, table: _Table) -> bytes:
        self._key()
        return self._cprefix + table.sid + self._ckb

    def _raw(self, table: _Table, dbk: bytes) -> bytes | None:
        """The stored value of ``dbk``; in a batch scope from the scope's cache, which the
        first read of a state fills for every key of the batch at once."""
        if self._scope is None:
            raw: bytes | None = self._db.get(dbk)
            return raw
        cached = self._cache.get(dbk, _MISSING)
        if cached is not _MISSING:
            return cached  # type: ignore[return-value]
        if table.sid not in self._fetched:
            self._prefetch(table)
            cached = self._cache.get(dbk, _MISSING)
            if cached is not _MISSING:
                return cached  # type: ignore[return-value]
        raw = self._db.get(dbk)  # a key outside the batch (the function set another key)
        self._cache[dbk] = raw
        return raw

    def _read(self, table: _Table) -> Any:
        dbk = self._db_key(table)
        raw = self._raw(table, dbk)
        if raw is None:
            return _MISSING
        n = int.from_bytes(raw[:4], "big")
        self._kread = (dbk, raw[4:4 + n])  # writing this entry back reuses its stored key
        return pickle.loads(raw[4 + n:])

    def _write(self, table: _Table, value: Any) -> None:
        dbk = self._db_key(table)
        kr = self._kread
        kp: bytes | None = kr[1] if kr is not None and kr[0] == dbk else self._kpickled
        if kp is None:
            kp = self._kpickled = self._dumps(table, self._ck, self._ck)
        raw = len(kp).to_bytes(4, "big") + kp + self._dumps(table, self._ck, value)
        if self._scope is None:
            self._db.put(dbk, raw)
        else:
            self._cache[dbk] = raw
            pending = self._pending
            if pending is None:
                pending = self._pending = self._rd.WriteBatch(raw_mode=True)
            pending.put(dbk, raw)
        self.dirty[dbk] = (table, self._ck)

    def _delete(self, table: _Table) -> bool:
        dbk = self._db_key(table)
        if self._raw(table, dbk) is None:
            return False
        if self._scope is None:
            self._db.delete(dbk)
        else:
            self._cache[dbk] = None
            pending = self._pending
            if pending is None:
                pending = self._pending = self._rd.WriteBatch(raw_mode=True)
            pending.delete(dbk)
        self._kread = None
        self.dirty[dbk] = (table, self._ck)
        return True

    # ------------------------------------------------------------ batch scope
    #: ``begin_batch`` reads a batch's keys in one multi-get and ``end_batch`` writes them in
    #: one write batch (the task calls both around a batch)
    prefetches = True

    def begin_batch(self, keys: list[Any]) -> None:
        """Open a batch scope over ``keys`` (canonical, distinct): the first read of a state in
        it fetches that state's entries of all of them in one sorted multi-get, reads and
        writes then go through a dict, and ``end_batch`` writes the batch's changes in one
        RocksDB write batch. Why: per key, a point ``get`` (mostly of an absent key) and a
        ``put`` each cost a Python -> Rust call and a key encoding; here the key groups are
        hashed vectorised and RocksDB sees one call per batch each way. Anything that reads the
        DB past the scope (scans, captures) writes the pending changes first."""
        if self._scope is not None:
            self.end_batch()
        try:
            many = getattr(self._key_group_of, "many", None)
            groups = many(keys) if many is not None else [self._key_group_of(k) for k in keys]
            # one encoder for single accesses and scopes: a second copy of its int branch here
            # would silently split a key into two DB keys the day the two drift apart
            self._scope = {k: (g.to_bytes(2, "big"), key_bytes(k)) for k, g in zip(keys, groups, strict=True)}
        except Exception:  # a key that cannot be hashed or encoded fails where it is used, as before
            self._scope = {}
        self._ck = _MISSING

    def end_batch(self) -> None:
        """Close the batch scope: its writes go to the DB in one write batch."""
        if self._scope is None:
            return
        try:
            self._flush()
        finally:
            self._scope = None
            self._cache = {}
            self._fetched = set()
            self._ck = _MISSING

    def _prefetch(self, table: _Table) -> None:
        assert self._scope is not None
        sid = table.sid
        self._fetched.add(sid)
        cache = self._cache
        dbks = sorted(p + sid + kb for p, kb in self._scope.values())
        todo = [k for k in dbks if k not in cache]
        if todo:
            for dbk, raw in zip(todo, self._db.get(todo), strict=True):
                cache[dbk] = raw

    def _flush(self) -> None:
        """Write the scope's pending changes to the DB (one write batch)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        self._db.write(pending)  # in write order: a later write of a key wins, as a put would

    def _dumps(self, table: _Table, key: Any, value: Any) -> bytes:
        try:
            return pickle.dumps(value, _PICKLE)
        except Exception as exc:  # pickling user values: report what and where
            raise StateSerializationError(
                f"operator {self.operator_uid!r}, state {table.name!r}, key {key!r}: value of type "
                f"{type(value).__name__} cannot be pickled ({exc}); keyed state values must be picklable"
            ) from exc

    # ------------------------------------------------------------ handles
    def _table(self, name: str, kind: str) -> _Table:
        table = self.tables.get(name)
        if table is None:
            if len(self.tables) >= 1 << 16:
                raise RocksDBStateError(f"operator {self.operator_uid!r}: more than 65536 declared states")
            sid = max((int.from_bytes(t.sid, "big") for t in self.tables.values()), default=-1) + 1
            table = self.tables[name] = _Table(name, kind, sid)
            self._by_sid[table.sid] = table
        return table

    @overload
    def handle(self, descriptor: ValueStateDescriptor) -> ValueState: ...

    @overload
    def handle(self, descriptor: ListStateDescriptor) -> ListState: ...

    @overload
    def handle(self, descriptor: MapStateDescriptor) -> MapState: ...

    @overload
    def handle(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState: ...

    def handle(self, descriptor: StateDescriptor) -> ValueState | ListState | MapState:
        kind = descriptor.kind
        table = self.tables.get(descriptor.name)
        if table is None:
            table = self._table(descriptor.name, kind)
        elif table.kind != kind:
            raise ValueError(
                f"operator {self.operator_uid!r}: state {descriptor.name!r} is declared as {table.kind} "
                f"state and again as {kind} state"
            )
        typ = column_type(kind, descriptor.type_info)
        if typ is not None:
            typed_column_name(descriptor.name)
            if table.type is not None and table.type != typ:
                raise ValueError(
                    f"operator {self.operator_uid!r}: state {descriptor.name!r} is declared with type "
                    f"{table.type.sql} and again with {typ.sql}"
                )
            table.type = typ
        if isinstance(descriptor, ValueStateDescriptor) or kind == "value":
            return RocksValueState(self, table, getattr(descriptor, "default", None))
        if isinstance(descriptor, ListStateDescriptor) or kind == "list":
            return RocksListState(self, table)
        if isinstance(descriptor, MapStateDescriptor) or kind == "map":
            return RocksMapState(self, table)
        raise ValueError(f"unknown state kind {kind!r}")

    # ------------------------------------------------------------ scans
    def _scan(self, table: _Table | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(DB key, DB value) of every entry (of one state), in key-group order."""
        self._flush()
        for dbk, raw in self._db.items():
            if table is None or dbk[2:4] == table.sid:
                yield dbk, raw

    def keys_of(self, name: str) -> list[Any]:
        table = self.tables.get(name)
        if table is None:
            return []
        loads = pickle.loads
        return [loads(raw[4:4 + int.from_bytes(raw[:4], "big")]) for _k, raw in self._scan(table)]

    def entries(self, name: str) -> list[tuple[Any, Any]]:
        table = self.tables.get(name)
        if table is None:
            return []
        loads = pickle.loads
        out = []
        for _k, raw in self._scan(table):
            n = int.from_bytes(raw[:4], "big")
            out.append((loads(raw[4:4 + n]), loads(raw[4 + n:])))
        return out

    def drop_key(self, key: Any) -> None:
        saved = self.keys.key
        self.keys.key = key
        try:
            for table in self.tables.values():
                self._delete(table)
        finally:
            self.keys.key = saved

    def as_dict(self) -> dict[str, dict[Any, Any]]:
        out: dict[str, dict[Any, Any]] = {}
        for name in self.tables:
            entries = self.entries(name)
            if entries:
                out[name] = dict(entries)
        return out

    # ------------------------------------------------------------ checkpoints
    def capture(self, epoch: int, incremental: bool = True, full_every: int = 10) -> KeyedCapture:
        """The heap backend's rows: the keys written since the last capture, or every entry of
        the DB when a full capture is due (same rule as ``HeapKeyedState.capture``)."""
        self._flush()
        checked = self.key_type is not None or any(t.type is not None for t in self.tables.values())
        if incremental and self.sst_incremental:
            return self._capture_sst(epoch, checked)
        full = not incremental or self.force_full or not self.chain or len(self.chain) >= full_every
        rows: list[tuple[int, bytes, str, bytes | None]] = []
        add = rows.append
        captured: Any = rows
        if full and not checked:
            # streamed by the writer from a RocksDB checkpoint of this moment (later writes do not leak in)
            captured = SnapshotRows(self, epoch)
        elif full:  # declared types are checked here, in the task, so a bad value fails the epoch
            by_sid = self._by_sid
            for dbk, raw in self._db.items():
                table = by_sid[dbk[2:4]]
                n = int.from_bytes(raw[:4], "big")
                self._check_types(table, raw, n)
                add((int.from_bytes(dbk[:2], "big"), raw[4:4 + n], table.name, raw[4 + n:]))
        else:
            get = self._db.get
            for dbk, (table, key) in self.dirty.items():
                raw = get(dbk)
                if raw is None:
                    add((int.from_bytes(dbk[:2], "big"), self._dumps(table, key, key), table.name, None))
                    continue
                n = int.from_bytes(raw[:4], "big")
                if checked:
                    self._check_types(table, raw, n)
                add((int.from_bytes(dbk[:2], "big"), raw[4:4 + n], table.name, raw[4 + n:]))
        self.dirty = {}
        if full:
            self.chain = [epoch]
            self.force_full = False
        else:
            self.chain.append(epoch)
        kinds = tuple((t.name, t.kind) for t in self.tables.values())
        types = tuple((t.name, t.type.to_json()) for t in self.tables.values() if t.type is not None)
        key_type = self.key_type
        return KeyedCapture(self.operator_uid, captured, full, tuple(self.chain), self.key_group_range, kinds,
                            self.event_time, types, None if key_type is None else key_type.to_json())

    def _capture_sst(self, epoch: int, checked: bool) -> KeyedCapture:
        """An incremental RocksDB checkpoint: the DB's SST files at this bound, hard-linked;
        the writer uploads those no earlier capture uploaded (``rocksdb_checkpoint.upload``).
        Every capture is complete on its own (its chain is itself): the sharing is in the files."""
        if checked:  # declared types are checked here, in the task, on what was written since
            get = self._db.get
            for dbk, (table, _key) in self.dirty.items():
                raw = get(dbk)
                if raw is not None:
                    self._check_types(table, raw, int.from_bytes(raw[:4], "big"))
        if self.force_full:  # a write failed or the DB is new: upload everything again
            self.uploads.clear()
            self.force_full = False
        path = f"{self.path}-chk{epoch}-{uuid.uuid4().hex[:8]}"
        try:
            self._rd.Checkpoint(self._db).create_checkpoint(path)
        except Exception as exc:
            shutil.rmtree(path, ignore_errors=True)
            raise RocksDBStateError(f"operator {self.operator_uid!r}: cannot take a RocksDB checkpoint at epoch "
                                    f"{epoch} under {path!r}: {exc}") from exc
        try:
            keys = int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)
        except Exception:
            keys = 0
        changed = len(self.dirty)
        self.dirty = {}
        self.chain = [epoch]
        states = {sid.hex(): t.name for sid, t in self._by_sid.items()}
        captured = SstCapture(path, self.db_id, states, self.uploads, changed, keys)
        kinds = tuple((t.name, t.kind) for t in self.tables.values())
        types = tuple((t.name, t.type.to_json()) for t in self.tables.values() if t.type is not None)
        key_type = self.key_type
        return KeyedCapture(self.operator_uid, captured, False, (epoch,), self.key_group_range, kinds,
                            self.event_time, types, None if key_type is None else key_type.to_json())

    def _check_types(self, table: _Table, raw: bytes, n: int) -> None:
        key = pickle.loads(raw[4:4 + n])
        kt = self.key_type
        why = None if kt is None else kt.check(key)
        if why and kt is not None:
            raise StateSerializationError(
                f"operator {self.operator_uid!r}: key {key!r} does not fit the declared key type {kt.sql}: {why}")
        if table.type is not None:
            why = table.type.check(pickle.loads(raw[4 + n:]))
            if why:
                raise StateSerializationError(
                    f"operator {self.operator_uid!r}, state {table.name!r}, key {key!r}: the value does not fit "
                    f"the declared type {table.type.sql}: {why}")

    def restore_rows(self, rows: Iterable[tuple[int, bytes, str, bytes | None]], kinds: dict[str, str]) -> None:
        """Apply rows of a file chain in order (later rows win; ``None`` deletes), streamed into
        the DB in write batches: values are stored as they come, never unpickled."""
        self.end_batch()
        loads = pickle.loads
        batch = self._rd.WriteBatch(raw_mode=True)
        pending = 0
        for kg, kbytes, name, vbytes in rows:
            table = self.tables.get(name)
            if table is None:
                table = self._table(name, kinds.get(name, "value"))
            key = canonical_key(loads(kbytes))
            dbk = kg.to_bytes(2, "big") + table.sid + key_bytes(key)
            if vbytes is None:
                batch.delete(dbk)
            else:
                batch.put(dbk, len(kbytes).to_bytes(4, "big") + kbytes + vbytes)
            pending += 1
            if pending >= RESTORE_BATCH:
                self._db.write(batch)
                batch = self._rd.WriteBatch(raw_mode=True)
                pending = 0
        if pending:
            self._db.write(batch)
        self._ck = _MISSING

    def restore_checkpoint(self, store: Any, root: Any, ref: Any, handle: bytes, kinds: dict[str, str],
                           reuse_files: bool) -> None:
        """Restore from one incremental RocksDB checkpoint by opening its files as this DB, as
        Flink's RocksDB backend restores (download, open), instead of re-inserting its rows; key
        groups of the checkpoint outside this subtask's range are deleted (a range tombstone each
        side). With ``reuse_files`` (the checkpoint lives in this job's own storage) the next
        capture uploads only SST files made after the restore, as a running job's would."""
        self.end_batch()
        if self.dirty or next(iter(self._db.keys()), None) is not None:
            raise RocksDBStateError(f"operator {self.operator_uid!r}: a RocksDB checkpoint can only be restored "
                                    f"into an empty backend")
        from .rocksdb_checkpoint import download

        rd = self._rd
        self._finalizer()  # the empty DB this backend started with, and its directory
        os.makedirs(self.path)
        try:
            got = download(store, root, ref, handle, self.path)
            self._db = rd.Rdict(self.path, self._options(rd))
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        wo = rd.WriteOptions()
        wo.disable_wal = True
        self._db.set_write_options(wo)
        self._finalizer = weakref.finalize(self, _close_db, self._db, self.path)
        self._adopt_state_ids(got.states, kinds)
        lo, hi = self.key_group_range
        first, last = ref.key_group_range
        if first < lo:
            self._db.delete_range(first.to_bytes(2, "big"), lo.to_bytes(2, "big"))
        if hi < last:
            self._db.delete_range((hi + 1).to_bytes(2, "big"), (last + 1).to_bytes(2, "big"))  # last < 2**15
        self._ck = _MISSING
        if reuse_files and self.sst_incremental:
            for name, shared in got.files.items():
                self.uploads.add(name, shared)
            self.force_full = False

    def _adopt_state_ids(self, states: dict[bytes, str], kinds: dict[str, str]) -> None:
        """Take the restored DB's state ids: a state declared already (an operator's ``open``
        runs before the restore, and its handles hold the ``_Table``) keeps its object with the
        DB's id; a state the DB does not know gets an id above the DB's."""
        restored = {name: sid for sid, name in states.items()}
        for name, sid in restored.items():
            table = self.tables.get(name)
            if table is None:
                self.tables[name] = _Table(name, kinds.get(name, "value"), int.from_bytes(sid, "big"))
            else:
                table.sid = sid
        free = max((int.from_bytes(s, "big") for s in states), default=-1) + 1
        for name, table in self.tables.items():
            if name not in restored:
                table.sid = free.to_bytes(2, "big")
                free += 1
        self._by_sid = {t.sid: t for t in self.tables.values()}

    def close(self) -> None:
        """Close the DB and remove its directory (idempotent)."""
        self._finalizer()

    def approximate_memory(self) -> int:
        """RocksDB's own estimate of its memtables and block cache in bytes (metrics, benchmarks)."""
        total = 0
        for prop in ("rocksdb.cur-size-all-mem-tables", "rocksdb.block-cache-usage"):
            try:
                total += int(self._db.property_int_value(prop) or 0)
            except Exception:
                pass
        return total


class SnapshotRows:
    """The rows of a full capture, read from a RocksDB checkpoint taken at the epoch bound (the
    memtable flushed, the SST files hard-linked into a directory of their own: Flink's native
    RocksDB snapshot). The writer streams them into the state file
    (``objects.encode_state_counted``), so a full capture is never a list of the whole state
    in memory, and later writes to the live DB cannot reach it. The directory is removed when
    the rows are dropped. Iterable more than once."""

    __slots__ = ("_path", "_names", "_len", "_rd", "_uid", "_finalizer", "__weakref__")

    def __init__(self, backend: RocksDBKeyedState, epoch: int) -> None:
        self._rd = backend._rd
        self._uid = backend.operator_uid
        self._path = f"{backend.path}-chk{epoch}-{uuid.uuid4().hex[:8]}"
        try:
            self._rd.Checkpoint(backend._db).create_checkpoint(self._path)
        except Exception as exc:
            shutil.rmtree(self._path, ignore_errors=True)
            raise RocksDBStateError(f"operator {self._uid!r}: cannot take a RocksDB checkpoint at epoch {epoch} "
                                    f"under {self._path!r}: {exc}") from exc
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, True)
        self._names = {sid: t.name for sid, t in backend._by_sid.items()}
        self._len: int | None = None

    def _open(self) -> Any:
        rd = self._rd
        opts = rd.Options(raw_mode=True)
        table = rd.BlockBasedOptions()
        table.set_block_cache(rd.Cache(8 << 20))
        opts.set_block_based_table_factory(table)
        try:
            return rd.Rdict(self._path, opts, access_type=rd.AccessType.read_only())
        except Exception as exc:
            raise RocksDBStateError(f"operator {self._uid!r}: the RocksDB checkpoint {self._path!r} of a full "
                                    f"capture cannot be read: {exc}") from exc

    def __iter__(self) -> Iterator[tuple[int, bytes, str, bytes | None]]:
        db = self._open()
        try:
            names = self._names
            for dbk, raw in db.items():
                n = int.from_bytes(raw[:4], "big")
                yield int.from_bytes(dbk[:2], "big"), raw[4:4 + n], names[dbk[2:4]], raw[4 + n:]
        finally:
            db.close()

    def __len__(self) -> int:
        if self._len is None:
            db = self._open()
            try:
                self._len = sum(1 for _ in db.keys())
            finally:
                db.close()
        return self._len

    def __eq__(self, other: object) -> bool:
        return list(self) == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------- handles


class RocksValueState(ValueState):
    """One value per key; ``value()`` returns a fresh copy (a mutation is stored by ``update``).
    The RocksDB handles subclass the heap's, so code that checks a handle's kind sees the same."""

    __slots__ = ("_s",)
    _t: Any

    def __init__(self, backend: RocksDBKeyedState, table: _Table, default: Any) -> None:
        self._s, self._t, self._default = backend, table, default

    def value(self) -> Any:
        v = self._s._read(self._t)
        if v is _MISSING:
            d = self._default
            return d if type(d) in _IMMUTABLE else copy.deepcopy(d)
        return v

    def update(self, value: Any) -> None:
        self._s._write(self._t, value)

    def clear(self) -> None:
        self._s._delete(self._t)


class RocksListState(ListState):
    __slots__ = ("_s",)
    _t: Any

    def __init__(self, backend: RocksDBKeyedState, table: _Table) -> None:
        self._s, self._t = backend, table

    def get(self) -> list[Any]:
        v = self._s._read(self._t)
        return [] if v is _MISSING else list(v)

    def add(self, value: Any) -> None:
        v = self._s._read(self._t)
        self._s._write(self._t, [value] if v is _MISSING else [*v, value])

    def add_all(self, values: Iterable[Any]) -> None:
        new = list(values)
        if not new:
            return
        v = self._s._read(self._t)
        self._s._write(self._t, new if v is _MISSING else [*v, *new])

    def update(self, values: Iterable[Any]) -> None:
        self._s._write(self._t, list(values))

    def clear(self) -> None:
        self._s._delete(self._t)


class RocksMapState(MapState):
    """A dict per key, stored whole under the key (one checkpoint row per key, as on the heap)."""

    __slots__ = ("_s",)
    _t: Any

    def __init__(self, backend: RocksDBKeyedState, table: _Table) -> None:
        self._s, self._t = backend, table

    def _map(self) -> dict[Any, Any]:
        v = self._s._read(self._t)
        return {} if v is _MISSING else dict(v)

    def get(self, key: Any) -> Any:
        return self._map().get(key)

    def put(self, key: Any, value: Any) -> None:
        m = self._map()
        m[key] = value
        self._s._write(self._t, m)

    def put_all(self, entries: dict[Any, Any]) -> None:
        m = self._map()
        m.update(entries)
        self._s._write(self._t, m)

    def contains(self, key: Any) -> bool:
        return key in self._map()

    def remove(self, key: Any) -> None:
        m = self._map()
        if key in m:
            del m[key]
            if m:
                self._s._write(self._t, m)
            else:
                self._s._delete(self._t)

    def keys(self) -> Iterator[Any]:
        return iter(list(self._map().keys()))

    def values(self) -> Iterator[Any]:
        return iter(list(self._map().values()))

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list(self._map().items()))

    def is_empty(self) -> bool:
        return not self._map()

    def clear(self) -> None:
        self._s._delete(self._t)
