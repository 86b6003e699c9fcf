"""Storage backends and transactional sinks, chosen by URL.

A checkpoint dir or a sink path is a local path (``/data/chk``, ``file:///data/chk``) or an
S3 URL (``s3://bucket/prefix``); ``open_storage`` and ``open_objects`` pick the backend by
its scheme. Other backends add themselves with ``register_storage``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from .base import CheckpointStorage, TransactionalSink  # noqa: F401

if TYPE_CHECKING:
    from .objects import ObjectCheckpointStorage

#: scheme -> factory(url) of checkpoint storage
_STORAGES: dict[str, Callable[[str], CheckpointStorage]] = {}


def scheme_of(url: str | os.PathLike[str]) -> str:
    """``s3`` for ``s3://...``, ``file`` for a path or ``file://...``."""
    s = os.fspath(url) if isinstance(url, (str, os.PathLike)) else str(url)
    if isinstance(s, str) and "://" in s:
        return s.split("://", 1)[0].lower()
    return "file"


def register_storage(scheme: str, factory: Callable[[str], CheckpointStorage]) -> None:
    """Make ``open_storage`` build ``factory(url)`` for URLs of ``scheme``."""
    _STORAGES[scheme] = factory


def _local(url: str) -> CheckpointStorage:
    from .local import LocalCheckpointStorage

    return LocalCheckpointStorage(url)


def _s3(url: str) -> CheckpointStorage:
    from .s3 import S3CheckpointStorage

    return S3CheckpointStorage(url)


register_storage("file", _local)
register_storage("s3", _s3)
register_storage("s3a", _s3)


def open_storage(where: Any) -> CheckpointStorage:
    """Checkpoint storage for a path, a URL, or a storage object (returned as is)."""
    if isinstance(where, CheckpointStorage):
        return where
    scheme = scheme_of(where)
    factory = _STORAGES.get(scheme)
    if factory is None:
        raise ValueError(f"no checkpoint storage for {os.fspath(where)!r}: known schemes are {sorted(_STORAGES)}")
    return factory(where if scheme == "file" else str(where))


def open_object_storage(where: Any) -> ObjectCheckpointStorage:
    """``open_storage`` for callers that reach the files through its object store (savepoints,
    state queries): every built-in backend is one; a registered backend that is not is refused."""
    from .objects import ObjectCheckpointStorage

    storage = open_storage(where)
    if not isinstance(storage, ObjectCheckpointStorage):
        raise TypeError(f"{type(storage).__name__} for {os.fspath(where)!r} keeps no object store "
                        f"(savepoints and state queries need one)")
    return storage


def open_objects(where: Any):
    """The object store (local folder or S3 prefix) rooted at a path or URL."""
    from .objects import ObjectStore

    if isinstance(where, ObjectStore):
        return where
    if scheme_of(where) in ("s3", "s3a"):
        from .s3 import S3Objects

        return S3Objects(str(where))
    if scheme_of(where) != "file":
        raise ValueError(f"no object store for {os.fspath(where)!r}: use a local path or s3://bucket/prefix")
    from .local import LocalObjects

    return LocalObjects(where)


def location(where: Any):
    """A joinable location (``Path`` or ``S3Path``) for a path or URL (no connection made)."""
    if scheme_of(where) in ("s3", "s3a"):
        from .s3 import S3Path

        return S3Path.parse(str(where))
    from .local import local_path

    return local_path(where)
