"""Transactional sinks: output is staged per epoch (pre-commit) and made visible on commit.

A FileSink writes each subtask's output of epoch n to
``PATH/_staging/<uid>/e<n>-s<subtask>-a<attempt>.jsonl`` when the epoch's snapshot is taken,
and renames it to ``PATH/part-e<n>-<uid>-s<subtask>.jsonl`` when the epoch commits.
Readers (Spark, pandas, ``FileSink.read``) skip ``_``-prefixed folders, as Hadoop does, so
they only ever see committed output. Commit is a rename, so re-issuing it after a failure
is a no-op; recovery commits what the restored manifest names and deletes other staged
files.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from .local import _safe, atomic_write

STAGING = "_staging"

log = logging.getLogger(__name__)


def _default_encoder(record: Any) -> str:
    return json.dumps(record, default=repr, separators=(",", ":"))


class FileSink:
    """Exactly-once JSON-lines (or custom line format) files, one per subtask per epoch."""

    def __init__(self, path: str | os.PathLike[str], encoder: Callable[[Any], str] | None = None,
                 decoder: Callable[[str], Any] | None = None) -> None:
        self.path = Path(path).expanduser().resolve()
        self.encoder = encoder or _default_encoder
        self.decoder = decoder or json.loads

    def __repr__(self) -> str:
        return f"FileSink({str(self.path)!r})"

    def relocated(self, path: str | os.PathLike[str]) -> "FileSink":
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
        atomic_write(self.path / rel, data)
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
            if src.exists():
                os.replace(src, dst)
                moved += 1
            elif not dst.exists():
                raise FileNotFoundError(
                    f"sink {self.path}: staged output {rel} is gone and was never committed; the epoch's output "
                    f"is lost (was the staging folder deleted by hand?)"
                )
        return moved

    def abort(self, staged: Iterable[str]) -> None:
        for rel in staged:
            (self.path / rel).unlink(missing_ok=True)

    def recover(self, uid: str, committed: Iterable[str]) -> None:
        """Re-issue the commit of the restored epoch and drop staged files of later epochs.

        A staged file that is neither here nor committed here means the sink's folder moved
        since the checkpoint: that output was committed (or is still staged) in the old
        folder. It cannot be recovered here, so it is reported, not treated as fatal.
        """
        keep = set(committed)
        for rel in sorted(keep):
            if not (self.path / rel).exists() and not (self.path / self.final_name(rel)).exists():
                log.warning("sink %s: output %s of the restored checkpoint is not in this folder (did the sink "
                            "move?); it stays wherever the earlier run wrote it", self.path, rel)
                continue
            self.commit([rel])
        folder = self.path / STAGING / _safe(uid)
        if folder.is_dir():
            for p in folder.iterdir():
                if f"{STAGING}/{_safe(uid)}/{p.name}" not in keep:
                    p.unlink(missing_ok=True)

    # ------------------------------------------------------------ reading committed output
    def committed_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        def order(p: Path):
            m = re.match(r"part-e(\d+)-(.*)-s(\d+)\.jsonl$", p.name)
            return (int(m.group(1)), m.group(2), int(m.group(3))) if m else (1 << 62, p.name, 0)

        return sorted(self.path.glob("part-*.jsonl"), key=order)

    def read(self) -> list[Any]:
        """All committed records (epoch order, then subtask)."""
        out: list[Any] = []
        dec = self.decoder
        for p in self.committed_files():
            with open(p, encoding="utf-8") as f:
                out.extend(dec(line) for line in f if line.strip())
        return out


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


class DiscardingSink:
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
