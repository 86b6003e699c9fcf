"""Transactional sinks: output is staged per epoch (pre-commit) and made visible on commit.

A FileSink writes each subtask's output of epoch n to
``PATH/_staging/<uid>/e<n>-s<subtask>-a<attempt>.jsonl`` when the epoch's snapshot is taken,
and moves it to ``PATH/part-e<n>-<uid>-s<subtask>.jsonl`` when the epoch commits.
Readers (Spark, pandas, ``FileSink.read``) skip ``_``-prefixed folders, as Hadoop does, so
they only ever see committed output. ``PATH`` is a local folder or an S3 prefix
(``s3://bucket/prefix``): the sink works on the same ``ObjectStore`` as checkpoint storage.
A local move is a rename; on S3 it is a copy and then a delete, and a crash between the two
leaves the staged object, so moving again finishes the job with the same bytes under the
same name. Commit is therefore idempotent: re-issuing it after a failure adds nothing, and
recovery commits what the restored manifest names and deletes other staged files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any, Callable, Iterable

from .base import TransactionalSink
from .objects import safe_name as _safe

STAGING = "_staging"
_PART = re.compile(r"part-e(\d+)-(.*)-s(\d+)\.jsonl$")

log = logging.getLogger(__name__)


def _default_encoder(record: Any) -> str:
    """Standard JSON (RFC 8259), one line: NaN and infinities, which JSON cannot spell, become
    ``null`` (as Spark's ``to_json`` and pandas' ``to_json`` write them); values JSON has no
    type for are written as their ``repr``."""
    try:
        return json.dumps(record, default=repr, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere inside
        return json.dumps(_finite_or_null(record), default=repr, separators=(",", ":"), allow_nan=False)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


class FileSink(TransactionalSink):
    """Exactly-once JSON-lines (or custom line format) files, one per subtask per epoch.

    ``path`` is a local folder or ``s3://bucket/prefix`` (credentials and endpoint from the
    usual boto3 chain, e.g. ``AWS_ENDPOINT_URL``)."""

    def __init__(self, path: Any, encoder: Callable[[Any], str] | None = None,
                 decoder: Callable[[str], Any] | None = None) -> None:
        from . import open_objects

        self.store = open_objects(path)
        self.path = self.store.root
        self.encoder = encoder or _default_encoder
        self.decoder = decoder or json.loads

    def __repr__(self) -> str:
        return f"FileSink({str(self.path)!r})"

    def relocated(self, path: Any) -> "FileSink":
        """The same sink writing elsewhere (the oracle runs a job twice)."""
        return type(self)(path, self.encoder, self.decoder)

    def writer(self) -> "_LineWriter":
        """Per-subtask writer: encodes records as they arrive (strings, not tuples, wait for
        the epoch's end: less memory, and nothing for the garbage collector to scan)."""
        return _LineWriter(self.encoder)

    # ------------------------------------------------------------ 2PC verbs
    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: list[Any]) -> str | None:
        """Stage an epoch's output durably (encoded lines from ``writer``, or records);
        returns the staged path relative to the sink root (None if empty)."""
        if not records:
            return None
        lines = records.lines if isinstance(records, _Lines) else list(map(self.encoder, records))
        data = ("\n".join(lines) + "\n").encode("utf-8")
        rel = f"{STAGING}/{_safe(uid)}/e{epoch}-s{subtask}-a{attempt}.jsonl"
        self.store.put(self.path / rel, data)
        return rel

    def final_name(self, staged: str) -> str:
        m = re.search(r"/([^/]+)/e(\d+)-s(\d+)-a[^/]+\.jsonl$", staged)
        if not m:
            raise ValueError(f"not a staged file of this sink: {staged}")
        uid, epoch, subtask = m.group(1), int(m.group(2)), int(m.group(3))
        return f"part-e{epoch:08d}-{uid}-s{subtask}.jsonl"

    def commit(self, staged: Iterable[str]) -> int:
        """Make staged files visible; idempotent. Returns how many were moved now."""
        moved = 0
        for rel in staged:
            src = self.path / rel
            dst = self.path / self.final_name(rel)
            try:
                self.store.move(src, dst)  # no existence check first: one request less on S3
                moved += 1
            except FileNotFoundError:
                if not self.store.exists(dst):
                    raise FileNotFoundError(
                        f"sink {self.path}: staged output {rel} is gone and was never committed; the epoch's "
                        f"output is lost (was the staging folder deleted by hand?)"
                    ) from None
        return moved

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            self.store.delete(self.path / rel)

    def recover(self, uid: str, committed: Iterable[str]) -> None:
        """Re-issue the commit of the restored epoch and drop staged files of later epochs.

        A staged file that is neither here nor committed here means the sink's folder moved
        since the checkpoint: that output was committed (or is still staged) in the old
        folder. It cannot be recovered here, so it is reported, not treated as fatal.
        """
        keep = set(committed)
        for rel in sorted(keep):
            if not self.store.exists(self.path / rel) and not self.store.exists(self.path / self.final_name(rel)):
                log.warning("sink %s: output %s of the restored checkpoint is not in this folder (did the sink "
                            "move?); it stays wherever the earlier run wrote it", self.path, rel)
                continue
            self.commit([rel])
        folder = f"{STAGING}/{_safe(uid)}/"
        for key in list(self.store.keys(self.path, folder)):
            if key not in keep:
                self.store.delete(self.path / key)

    # ------------------------------------------------------------ reading committed output
    def committed_files(self) -> list[Any]:
        """Locations of committed files (``Path`` or ``S3Path``), in epoch, uid, subtask order."""
        def order(key: str):
            m = _PART.match(key)
            return (int(m.group(1)), m.group(2), int(m.group(3))) if m else (1 << 62, key, 0)

        keys = [k for k in self.store.keys(self.path, "part-") if "/" not in k and k.endswith(".jsonl")]
        return [self.path / k for k in sorted(keys, key=order)]

    def read_lines(self, loc: Any) -> list[str]:
        """The encoded lines of one committed file."""
        return [line for line in self.store.get(loc).decode("utf-8").split("\n") if line.strip()]

    def read(self) -> list[Any]:
        """All committed records (epoch order, then subtask)."""
        dec = self.decoder
        return [dec(line) for loc in self.committed_files() for line in self.read_lines(loc)]


class _Lines(list):
    """Encoded output lines of one epoch (a list, so emptiness and len work)."""

    @property
    def lines(self) -> list[str]:
        return self


class _LineWriter:
    __slots__ = ("encoder", "buf")

    def __init__(self, encoder: Callable[[Any], str]) -> None:
        self.encoder = encoder
        self.buf = _Lines()

    def write(self, records: list[Any]) -> None:
        self.buf.extend(map(self.encoder, records))

    def take(self) -> "_Lines":
        out, self.buf = self.buf, _Lines()
        return out


class _DropWriter:
    __slots__ = ()

    def write(self, records: list[Any]) -> None:
        return None

    def take(self) -> list[Any]:
        return []


class DiscardingSink(TransactionalSink):
    """Accepts records and drops them (Flink's DiscardingSink): for benchmarks and dry runs.

    It takes part in the two-phase commit like any sink, so a job with it measures the
    protocol's cost without the cost of writing output.
    """

    encoder = staticmethod(_default_encoder)

    def writer(self) -> _DropWriter:
        return _DropWriter()

    def pre_commit(self, uid: str, subtask: int, epoch: int, attempt: str, records: list[Any]) -> str | None:
        return None

    def commit(self, staged: Iterable[str]) -> int:
        return 0

    def abort(self, staged: Iterable[str]) -> None:
        return None

    def recover(self, uid: str, committed: Iterable[str]) -> None:
        return None

    def relocated(self, path: str | os.PathLike[str]) -> "DiscardingSink":
        return self
