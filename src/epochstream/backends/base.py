"""The backend interface: the epoch commit's verbs for state storage and for sinks.

Carbone's thesis (003 §4.1.4, Table 4.1) reduces every backend's part in the epoch commit
to four operations, Start, Pre-Commit, Commit and Abort, plus what recovery must redo.
Here they are, for both kinds of backend:

==============  ==========================================  ==========================================
verb            checkpoint storage (``CheckpointStorage``)   transactional sink (``TransactionalSink``)
==============  ==========================================  ==========================================
``begin``       an epoch was triggered (driver side)         same
``pre_commit``  write one operator subtask's state capture   stage one subtask's output of an epoch
``commit``      write the manifest: *the* commit point       make staged output visible (idempotent)
``abort``       an epoch will never complete                 drop staged output
``recover``     after a failure: clear what no retained      re-issue the restored epoch's commit,
                checkpoint names, set damaged ones aside     drop staged output of later epochs
==============  ==========================================  ==========================================

Who calls what: ``deploy.persist.persist`` (a worker, off the processing path) calls the
``pre_commit`` verbs; the job master calls ``begin``, ``commit`` (manifest, then every sink)
and ``abort``; ``deploy.restore.recover`` calls the ``recover`` verbs before every attempt.
An aborted epoch's sink output is *not* aborted: it was staged before the failure that
aborted the epoch and commits with the next completed epoch (the manifest carries it), so
``TransactionalSink.abort`` only serves recovery and tests.

The read side of checkpoint storage (``list_checkpoints``, ``load_manifest``, ``latest``,
``read_state``, ``read_operator_rows``, ``checkpoint_dir``) is what restore, savepoints,
state queries and the oracle use; its signatures are stable across backends. A *root*
(returned by ``load_manifest``, passed back to ``read_*``) is a location the backend
understands: a ``pathlib.Path`` for the local filesystem, an ``S3Path`` for S3. Both support
``/``, ``name``, ``parent`` and ``resolve()``, so code that joins and compares roots works
with either.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Iterable

from ..snapshot.manifest import StateFileRef

#: one state row: key group, pickled key, state name, pickled value (None = tombstone)
Row = tuple[int, bytes, str, "bytes | None"]


class CheckpointStorage(ABC):
    """Where epoch snapshots (state files) and manifests live."""

    #: URL scheme this backend serves (``file``, ``s3``, ...)
    scheme: str = ""
    #: the storage root (``Path`` or ``S3Path``)
    root: Any

    # ------------------------------------------------------------ the 2PC verbs
    def begin(self, epoch: int) -> None:
        """Epoch ``epoch`` was triggered. Object stores need nothing; a transactional backend
        opens the epoch's transaction here."""
        return None

    @abstractmethod
    def pre_commit(self, operator: str, subtask: int, epoch: int, attempt: str, rows: Iterable[Row],
                   key_group_range: tuple[int, int], full: bool) -> StateFileRef:
        """Durably write one keyed operator subtask's capture of ``epoch``; return its reference."""

    @abstractmethod
    def commit(self, manifest: dict[str, Any]) -> Any:
        """Write the manifest of ``manifest['epoch']``: after this returns, the checkpoint exists;
        if it raises, it does not (never half). Returns the checkpoint's location."""

    def abort(self, epoch: int) -> None:
        """Epoch ``epoch`` will not complete. Its state files may still be links of later
        incremental captures, so object stores keep them until garbage collection."""
        return None

    @abstractmethod
    def recover(self, restored_epoch: int | None) -> None:
        """Before an attempt starts from ``restored_epoch``: remove state files no retained
        checkpoint names, and set aside damaged checkpoints newer than it (their epoch
        numbers are about to be written again)."""

    # ------------------------------------------------------------ retention
    @abstractmethod
    def discard(self, epoch: int) -> None:
        """Delete a completed checkpoint's manifest (retention)."""

    @abstractmethod
    def collect_garbage(self, retained: list[dict[str, Any]], keep_after: int) -> int:
        """Delete state files no retained manifest names, except those of epochs > keep_after."""

    # ------------------------------------------------------------ reading (stable for restore)
    @abstractmethod
    def exists(self) -> bool:
        """Whether the storage root exists (a folder, a bucket)."""

    @abstractmethod
    def checkpoint_dir(self, epoch: int) -> Any:
        """Location of checkpoint ``epoch`` (``chk-<epoch>`` under the root)."""

    @abstractmethod
    def list_checkpoints(self) -> list[int]:
        """Epochs that have a manifest (not yet validated), oldest first."""

    @abstractmethod
    def load_manifest(self, location: str | os.PathLike[str] | int | Any) -> tuple[dict[str, Any], Any]:
        """A manifest by epoch, checkpoint location or manifest location: (manifest, root its
        relative paths resolve against). Raises ``CheckpointError`` naming the location."""

    @abstractmethod
    def read_state(self, ref: StateFileRef, root: Any = None) -> Any:
        """One verified state file as an Arrow table (missing or damaged: ``CheckpointError``)."""

    @abstractmethod
    def read_operator_rows(self, manifest: dict[str, Any], root: Any, operator: str,
                           key_groups: tuple[int, int] | None = None) -> Iterable[Row]:
        """Rows of one operator's file chains, in apply order, optionally only some key groups."""

    def latest(self) -> tuple[dict[str, Any], Any] | None:
        """Newest checkpoint whose manifest is readable (damaged newer ones are skipped)."""
        raise NotImplementedError

    # names the foundation used; kept so callers written against them keep working
    def write_state(self, *args: Any, **kwargs: Any) -> StateFileRef:
        return self.pre_commit(*args, **kwargs)

    def write_manifest(self, manifest: dict[str, Any]) -> Any:
        return self.commit(manifest)


def commits_in_subtasks(sink: object) -> bool:
    """Whether ``sink``'s subtasks commit their own output (``TransactionalSink.commits_in_subtasks``).
    A sink is any object with the verbs (docs/API.md, "Writing a sink"): one without the attribute is
    committed by the job master."""
    return getattr(sink, "commits_in_subtasks", False) is True


class TransactionalSink(ABC):
    """A sink whose output becomes visible only when its epoch commits.

    Who makes staged output visible: the job master (``commit``, ``commit_epoch``: renames,
    a Delta log entry; cheap, and never the records themselves), or, for a sink with
    ``commits_in_subtasks``, each sink subtask in the process that made the output
    (``commit_subtask``, once the master says the epoch's manifest exists: Kafka
    transactions, which only the producer that opened them can commit)."""

    #: each subtask commits its own output (``commit_subtask``); the master only tells it when
    commits_in_subtasks: bool = False

    def open_subtask(self, uid: str, subtask: int) -> None:
        """Before the subtask's first epoch, in the process that runs it (``commits_in_subtasks``
        sinks: a Kafka sink opens its producers here, fencing those of earlier attempts)."""
        return None

    def commit_subtask(self, uid: str, subtask: int, epoch: int) -> None:
        """The manifest of ``epoch`` exists: make this subtask's staged output of every epoch
        up to it visible (``commits_in_subtasks`` sinks; idempotent)."""
        raise NotImplementedError

    def writer(self) -> Any:
        """A per-subtask buffer with ``write(records)`` and ``take()`` (the epoch's content)."""
        raise NotImplementedError

    def begin(self, epoch: int) -> None:
        """Epoch ``epoch`` was triggered (driver side); nothing to do for staged-file sinks."""
        return None

    @abstractmethod
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: Any) -> str | None:
        """Stage one subtask's output of an epoch durably; the staged name (None if empty)."""

    @abstractmethod
    def commit(self, staged: Iterable[str]) -> int:
        """Make staged output visible. Idempotent: re-issuing a commit adds nothing."""

    @abstractmethod
    def abort(self, staged: Iterable[str]) -> None:
        """Drop staged output."""

    @abstractmethod
    def recover(self, uid: str, committed: Iterable[str]) -> None:
        """Re-issue the commit of the restored epoch's output; drop staged output of later epochs."""

    def relocated(self, path: Any) -> "TransactionalSink":
        """The same sink writing elsewhere (the oracle runs a job twice)."""
        raise NotImplementedError
