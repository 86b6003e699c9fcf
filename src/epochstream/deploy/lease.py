"""One job per checkpoint folder: the lease a run holds on its checkpoint dir, and fencing.

Two runs on one checkpoint folder destroy each other: each one's recovery deletes the
other's state files and staged output. So a run holds a *lease* on the folder from before
its restore until it ends (Spark refuses a second query on a checkpoint location in use;
Flink keeps one leader per job). The lease is the object ``_lease.json`` at the folder's
root, naming the holder (host, pid, job name and id, the current attempt) and a heartbeat
time, renewed every ``ttl / 3`` seconds by a ``LeaseKeeper`` thread:

* **local filesystem**: ``fcntl.flock`` on ``.lock`` in the folder, held by the driver
  process for the whole run (the OS drops it when the process dies), plus the lease file
  (written under the lock) that names the holder for the error message and for hosts that
  share the folder over a network filesystem, where ``flock`` may not reach;
* **S3**: the lease object is created with a conditional put (``If-None-Match: *``), and
  renewed or taken over with ``If-Match: <ETag>`` of the version read, so of two hosts racing
  for it exactly one wins.

A lease whose heartbeat is older than ``ttl`` has expired and is taken over (its ETag or
lock decides who wins); locally, a holder on this host whose process is gone (the lock is
free) has also let go. Anything else is refused with ``LeaseHeldError`` naming the holder
and the way out, before anything is read or changed.

**Fencing.** Every attempt of a run has an id (``<run id>.<restart>``), and the lease
records the current one. ``check_fence`` (before a worker stages sink output or writes
state, and before the job master commits a manifest or sinks) reads the lease and raises
``FencedError`` if the attempt is no longer the holder's current one: a zombie of an older
attempt (a SIGSTOPped worker woken after the failover, a cancelled Spark task still
running) or of a run whose lease was taken over writes nothing that the new attempt could
commit. The check is a read, then the write, so a zombie stopped between the two can still
leave a file; such files carry the old attempt in their names, no manifest of the new
attempt names them, and the next recovery deletes them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..runtime.errors import EpochStreamError
from ..snapshot.manifest import CheckpointError

log = logging.getLogger("epochstream")

LEASE = "_lease.json"
LOCK = ".lock"
#: seconds without a heartbeat after which a lease has expired (renewed every ttl / 3)
DEFAULT_TTL = 30.0
#: tokens of the leases this process holds now; a lease file naming this pid with another token
#: was left by a run of this process that ended without deleting it (its store was down)
_HELD_HERE: set[str] = set()


class LeaseHeldError(CheckpointError):
    """Another run holds the checkpoint folder; nothing was read or changed."""


class FencedError(EpochStreamError):
    """A write of an attempt that no longer holds the checkpoint folder (a zombie) was refused."""


@dataclass(frozen=True)
class LeaseInfo:
    """What the lease object holds."""

    host: str
    pid: int
    job: str
    job_id: str
    attempt: str
    acquired_at: float
    heartbeat_at: float
    ttl: float
    #: random per acquisition: tells our own write from another's after a lost response
    token: str

    def expired(self, now: float) -> bool:
        return now - self.heartbeat_at > self.ttl

    def describe(self, now: float) -> str:
        return (f"job {self.job!r} (id {self.job_id}, attempt {self.attempt or '-'}) on host {self.host}, "
                f"pid {self.pid}, last heartbeat {max(0.0, now - self.heartbeat_at):.1f}s ago")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @staticmethod
    def parse(data: bytes) -> "LeaseInfo | None":
        try:
            d = json.loads(data)
            return LeaseInfo(str(d["host"]), int(d["pid"]), str(d["job"]), str(d["job_id"]), str(d["attempt"]),
                             float(d["acquired_at"]), float(d["heartbeat_at"]), float(d["ttl"]), str(d["token"]))
        except (ValueError, KeyError, TypeError):
            return None  # a half-written or foreign file: treated as no lease


def process_alive(pid: int) -> bool:
    """Whether a process of this host with ``pid`` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _store(storage: Any) -> Any:
    store = getattr(storage, "store", None)
    if store is None:
        raise CheckpointError(f"{storage!r} keeps no object store: it cannot hold a lease")
    return store


def _is_local(store: Any) -> bool:
    return getattr(store, "scheme", "") == "file"


def read_lease(storage: Any) -> LeaseInfo | None:
    """The lease on a checkpoint folder as stored (None: no lease, or unreadable)."""
    store = _store(storage)
    loc = store.root / LEASE
    try:
        return LeaseInfo.parse(store.get(loc))
    except FileNotFoundError:
        return None


def lease_status(storage: Any, now: float | None = None) -> tuple[str, LeaseInfo | None]:
    """``("free" | "held" | "expired" | "dead", lease)``: dead = a holder on this host whose
    process is gone."""
    now = time.time() if now is None else now
    info = read_lease(storage)
    if info is None:
        return "free", None
    if info.host == socket.gethostname() and not process_alive(info.pid):
        return "dead", info
    return ("expired" if info.expired(now) else "held"), info


def _held_error(storage: Any, info: LeaseInfo | None, what: str, now: float) -> LeaseHeldError:
    holder = info.describe(now) if info is not None else "another process (its lease file is not readable yet)"
    ttl = info.ttl if info is not None else DEFAULT_TTL
    return LeaseHeldError(
        f"checkpoint dir {storage.root} is in use by {holder}; refusing to {what}, nothing was changed. "
        f"Wait for that job to end, stop it (epochstream stop JOB), or use another --checkpoint-dir; "
        f"a lease whose holder died is taken over {ttl:.0f}s after its last heartbeat"
    )


def check_not_held(storage: Any, what: str, job_id: str | None = None) -> None:
    """Refuse ``what`` if another run holds the folder (for writers that do not take the lease)."""
    now = time.time()
    status, info = lease_status(storage, now)
    if status == "held" and info is not None and info.job_id != job_id:
        raise _held_error(storage, info, what, now)


class Lease:
    """The lease of one run on one checkpoint folder: ``acquire``, ``begin_attempt``,
    ``renew`` (the keeper thread), ``release``."""

    def __init__(self, storage: Any, job: str, job_id: str, ttl: float = DEFAULT_TTL) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        self.storage = storage
        self.store = _store(storage)
        self.loc = self.store.root / LEASE
        self.job, self.job_id, self.ttl = job, job_id, ttl
        self.info: LeaseInfo | None = None
        self._etag: str | None = None
        self._fd: int | None = None
        self._created = False
        self._lock = threading.Lock()
        #: set when a renewal found the lease taken over: this run's writes are fenced from then on
        self.lost: str | None = None

    # ------------------------------------------------------------ acquire
    def acquire(self, what: str = "run") -> "Lease":
        now = time.time()
        info = LeaseInfo(socket.gethostname(), os.getpid(), self.job, self.job_id, "", now, now, self.ttl,
                         secrets.token_hex(8))
        if _is_local(self.store):
            self._acquire_local(info, what, now)
        else:
            self._acquire_conditional(info, what, now)
        self.info = info
        _HELD_HERE.add(info.token)
        return self

    def _acquire_local(self, info: LeaseInfo, what: str, now: float) -> None:
        import fcntl

        root = self.store.root
        self._created = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _held_error(self.storage, read_lease(self.storage), what, now) from None
            try:  # the releaser unlinks the lock file while holding it: locked a removed file? again
                if os.fstat(fd).st_ino == os.stat(root / LOCK).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        # the lock is ours; a lease file can still be live if its holder is on another host
        old = read_lease(self.storage)
        if old is not None and old.host != info.host and not old.expired(now):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise _held_error(self.storage, old, what, now)
        if old is not None:
            log.warning("taking over the lease on %s from %s", root, old.describe(now))
        self._fd = fd
        self.store.put(self.loc, info.to_bytes())

    def _acquire_conditional(self, info: LeaseInfo, what: str, now: float) -> None:
        from ..backends.objects import ObjectExistsError

        try:
            self._etag = self.store.put_if(self.loc, info.to_bytes(), None)
            return
        except ObjectExistsError:
            pass
        try:
            data, etag = self.store.get_tagged(self.loc)
        except FileNotFoundError:  # released between our put and our read: try once more
            self._etag = self.store.put_if(self.loc, info.to_bytes(), None)
            return
        old = LeaseInfo.parse(data)
        # a holder on this host whose process is gone is dead: no need to wait out its ttl; so is one
        # of this process that ended (it could not delete its lease: e.g. S3 was down when it failed)
        dead = old is not None and old.host == info.host and (
            not process_alive(old.pid) or (old.pid == info.pid and old.token not in _HELD_HERE))
        if old is not None and not old.expired(now) and not dead:
            raise _held_error(self.storage, old, what, now)
        log.warning("taking over the %s lease on %s from %s", "dead holder's" if dead else "expired",
                    self.store.root, old.describe(now) if old else "an unreadable lease")
        try:
            self._etag = self.store.put_if(self.loc, info.to_bytes(), etag)
        except ObjectExistsError:  # another run took it over first
            raise _held_error(self.storage, read_lease(self.storage), what, time.time()) from None

    # ------------------------------------------------------------ attempts and heartbeats
    def begin_attempt(self, attempt: str) -> None:
        """Record ``attempt`` as the holder's current one: older attempts are fenced from now."""
        self._write(attempt=attempt)

    def renew(self) -> None:
        self._write()

    def _write(self, attempt: str | None = None) -> None:
        from ..backends.objects import ObjectExistsError

        with self._lock:
            if self.info is None:
                raise CheckpointError(f"the lease on {self.store.root} is not held")
            if self.lost:
                raise FencedError(self.lost)
            new = LeaseInfo(**{**asdict(self.info), "heartbeat_at": time.time(),
                               **({"attempt": attempt} if attempt is not None else {})})
            if _is_local(self.store):
                self.store.put(self.loc, new.to_bytes())
            else:
                try:
                    self._etag = self.store.put_if(self.loc, new.to_bytes(), self._etag)
                except ObjectExistsError:
                    now = time.time()
                    other = read_lease(self.storage)
                    if other is not None and other.token == new.token:  # our write; its response was lost
                        self._etag = self.store.get_tagged(self.loc)[1]
                    else:
                        self.lost = (f"the lease on {self.store.root} was taken over by "
                                     f"{other.describe(now) if other else 'another run'}")
                        raise FencedError(self.lost) from None
            self.info = new

    def release(self) -> None:
        """Give the folder up (the run ended); only our own lease is deleted."""
        with self._lock:
            if self.info is None:
                return
            _HELD_HERE.discard(self.info.token)
            try:
                current = read_lease(self.storage)
                if current is not None and current.token == self.info.token:
                    self.store.delete(self.loc)
            except OSError as exc:  # the lease expires on its own
                log.warning("could not delete the lease %s: %s", self.loc, exc)
            if self._fd is not None:
                import fcntl

                (self.store.root / LOCK).unlink(missing_ok=True)  # under the lock: see _acquire_local
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None
                if self._created:  # a run refused before it wrote anything leaves no folder behind
                    try:
                        self.store.root.rmdir()
                    except OSError:
                        pass
            self.info = None


class LeaseKeeper:
    """Renews a lease every ``ttl / 3`` seconds on a daemon thread until stopped."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="epochstream-lease", daemon=True)

    def start(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.lease.ttl / 3):
            try:
                self.lease.renew()
            except FencedError as exc:
                log.error("%s; this run's writes are refused from now on", exc)
                return
            except Exception as exc:  # a storage hiccup: the next renewal may pass
                log.warning("renewing the lease on %s failed: %s", self.lease.store.root, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def check_fence(storage: Any, attempt: str) -> None:
    """Refuse a write of ``attempt`` unless it is the current attempt of the lease holder.

    A folder with no lease (a driver used directly, without ``run``) fences nothing."""
    store = getattr(storage, "store", None)
    if store is None:
        return
    try:
        info = LeaseInfo.parse(store.get(store.root / LEASE))
    except FileNotFoundError:
        return
    if info is not None and info.attempt and info.attempt != attempt:
        raise FencedError(
            f"attempt {attempt} is fenced: checkpoint dir {store.root} is now held by attempt {info.attempt} "
            f"of job {info.job!r} (id {info.job_id}); a write of an older attempt is refused"
        )
