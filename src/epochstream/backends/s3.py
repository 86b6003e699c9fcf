"""S3 checkpoint storage and sink objects (``s3://bucket/prefix``) through boto3.

The layout and the epoch commit are ``objects.ObjectCheckpointStorage``'s; this module only
maps its whole-object operations onto S3 requests:

* ``put`` is one ``PutObject``: S3 never shows part of an object.
* ``put_new``, the commit point of a manifest, is ``PutObject`` with ``If-None-Match: *``:
  S3 stores the object only if the key is free, atomically, so a completed checkpoint can
  neither be half-written nor overwritten. If a retried request finds the key taken, the
  object is read back: identical bytes mean the earlier attempt succeeded (its response was
  lost), anything else is ``ObjectExistsError``.
* ``move`` (sink commit) is ``CopyObject`` then ``DeleteObject``; a crash in between leaves
  the source, and moving again writes the same bytes under the same name.

Every request runs under a tenacity retry policy: exponential backoff with full jitter, a
bounded number of attempts, and only for what can pass (throttling such as ``SlowDown`` and
503, other 5xx, 409 ``ConditionalRequestConflict``, timeouts and broken connections). Refusals
(``AccessDenied``, ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, ``NoSuchBucket``) fail at
once with ``StorageAccessError`` naming bucket and key; retries that run out raise
``StorageError`` with the last error. botocore's own retries are switched off, so the
policy here is the only one.

Client settings come from boto3's usual chain (environment, profile, instance role),
including ``AWS_ENDPOINT_URL`` for S3-compatible servers; ``S3Options`` overrides the
endpoint, region and the retry policy. A client is created lazily, once per process (the
local driver forks workers; sockets must not be shared across a fork), and is never
pickled. Its user agent carries ``epochstream pid/<pid>``, which server logs (and the
fault-injecting proxy of the tests) use to tell processes apart.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..snapshot.manifest import CheckpointError
from .objects import (
    ObjectCheckpointStorage,
    ObjectExistsError,
    ObjectMissingError,
    ObjectStore,
    StorageAccessError,
    StorageError,
)

log = logging.getLogger(__name__)

#: error codes worth another attempt (throttling, server trouble, a racing conditional write)
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "RequestThrottled", "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ConditionalRequestConflict", "OperationAborted", "500", "502", "503", "504",
})
#: error codes that mean "not with these credentials / not this bucket"
REFUSED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "403",
})
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


@dataclass(frozen=True)
class S3Options:
    """Endpoint, region and retry policy (None: boto3's chain decides).

    Environment overrides for the retry policy, read when the options are not given:
    ``EPOCHSTREAM_S3_MAX_ATTEMPTS``, ``EPOCHSTREAM_S3_READ_TIMEOUT`` (seconds)."""

    endpoint_url: str | None = None
    region_name: str | None = None
    #: attempts per request, the first included
    max_attempts: int = 8
    #: backoff before attempt k+1 is uniform in [0, min(backoff_max, backoff_initial * 2**k)]
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    connect_timeout: float = 5.0
    #: a request whose response takes longer is abandoned and retried
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"S3Options.max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_initial < 0 or self.backoff_max < 0 or self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("S3Options: backoff must be >= 0 and timeouts > 0")

    @classmethod
    def from_env(cls) -> "S3Options":
        kw: dict[str, Any] = {}
        if os.environ.get("EPOCHSTREAM_S3_MAX_ATTEMPTS"):
            kw["max_attempts"] = int(os.environ["EPOCHSTREAM_S3_MAX_ATTEMPTS"])
        if os.environ.get("EPOCHSTREAM_S3_READ_TIMEOUT"):
            kw["read_timeout"] = float(os.environ["EPOCHSTREAM_S3_READ_TIMEOUT"])
        return cls(**kw)


@dataclass(frozen=True)
class S3Path:
    """``s3://bucket/key`` as a location: joins with ``/`` like ``pathlib.Path``."""

    bucket: str
    key: str = ""

    @staticmethod
    def parse(url: str) -> "S3Path":
        for scheme in ("s3://", "s3a://"):
            if url.startswith(scheme):
                bucket, _, key = url[len(scheme):].partition("/")
                if not bucket:
                    raise ValueError(f"{url!r}: an S3 location needs a bucket (s3://bucket/prefix)")
                return S3Path(bucket, key.strip("/"))
        raise ValueError(f"{url!r} is not an S3 URL (s3://bucket/prefix)")

    def __truediv__(self, part: str) -> "S3Path":
        part = str(part).strip("/")
        return S3Path(self.bucket, f"{self.key}/{part}" if self.key else part)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "S3Path":
        return S3Path(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def resolve(self) -> "S3Path":
        return self

    def as_posix(self) -> str:
        return str(self)

    def relative_to(self, other: "S3Path") -> str:
        if other.bucket != self.bucket or not (other.key == "" or self.key.startswith(other.key + "/")):
            raise ValueError(f"{self} is not under {other}")
        return self.key[len(other.key) + 1:] if other.key else self.key


class S3Objects(ObjectStore):
    """Objects under an S3 prefix."""

    scheme = "s3"

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        try:
            self.root = S3Path.parse(url)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        self.options = options or S3Options.from_env()
        self._client_obj: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.root, self.options = state["root"], state["options"]
        self._client_obj, self._pid, self._lock = None, -1, threading.Lock()

    # ------------------------------------------------------------ client and retries
    @property
    def client(self) -> Any:
        if self._pid != os.getpid():  # first use, or a forked child: never share the parent's sockets
            self._lock = threading.Lock()
            self._client_obj, self._pid = None, os.getpid()
        with self._lock:
            if self._client_obj is None:
                self._client_obj = self._make_client()
            return self._client_obj

    def _make_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is in the s3 and dev extras
            raise StorageAccessError(f"S3 storage needs boto3 (pip install 'epochstream[s3]'): {exc}") from None
        o = self.options
        custom_endpoint = o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries, not botocore
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            user_agent_extra=f"epochstream pid/{os.getpid()}",
            # S3-compatible servers (MinIO, moto, Ceph) differ on the newer default checksums
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if custom_endpoint else {},
        )
        session = boto3.session.Session()
        return session.client("s3", endpoint_url=o.endpoint_url, region_name=o.region_name, config=config)

    def _call(self, what: str, loc: Any, fn: Callable[[], Any]) -> Any:
        """Run one request under the retry policy; turn what is left into our errors."""
        import tenacity

        o = self.options
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(o.max_attempts),
            wait=tenacity.wait_random_exponential(multiplier=o.backoff_initial, max=o.backoff_max),
            retry=tenacity.retry_if_exception(_transient),
            reraise=True,
            before_sleep=lambda rs: log.info("S3 %s %s: attempt %d failed (%s), retrying", what, loc, rs.attempt_number,
                                             _describe(rs.outcome.exception() if rs.outcome else None)),
        )
        try:
            return retrying(fn)
        except Exception as exc:
            raise self._error(what, loc, exc) from exc

    def _error(self, what: str, loc: Any, exc: Exception) -> Exception:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StorageAccessError(
                f"S3 {what} {loc}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an instance role applies")
        if _transient(exc):
            return StorageError(
                f"S3 {what} {loc} failed after {self.options.max_attempts} attempts (throttling, server errors "
                f"or broken connections; backoff up to {self.options.backoff_max}s): {_describe(exc)}")
        if isinstance(exc, ClientError):
            code = _code(exc)
            if code in MISSING_CODES:
                return ObjectMissingError(f"{loc} does not exist")
            if code == "NoSuchBucket":
                return StorageAccessError(f"S3 {what} {loc}: bucket {loc.bucket!r} does not exist")
            if code in REFUSED_CODES:
                return StorageAccessError(
                    f"S3 refused {what} of bucket {loc.bucket!r} key {loc.key!r}: {_describe(exc)}; check the "
                    f"credentials (boto3 chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, role) and "
                    f"the bucket's policy")
            if code in ("PreconditionFailed", "412"):
                return ObjectExistsError(f"{loc} already exists")
            return StorageError(f"S3 {what} {loc} failed: {_describe(exc)}")
        if isinstance(exc, (StorageError, CheckpointError)):
            return exc
        return StorageError(f"S3 {what} {loc} failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ ObjectStore
    def parse(self, text: Any) -> S3Path:
        if isinstance(text, S3Path):
            return text
        try:
            return S3Path.parse(os.fspath(text) if isinstance(text, os.PathLike) else str(text))
        except ValueError as exc:
            raise CheckpointError(f"{exc}; this storage is {self.root}") from None

    def put(self, loc: S3Path, data: bytes) -> None:
        self._call("PUT", loc, lambda: self.client.put_object(Bucket=loc.bucket, Key=loc.key, Body=data))

    def put_file(self, loc: S3Path, path: str | os.PathLike[str]) -> None:
        def put() -> Any:
            with open(path, "rb") as f:  # reopened per attempt: a retry sends the file from its start
                return self.client.put_object(Bucket=loc.bucket, Key=loc.key, Body=f)

        self._call("PUT", loc, put)  # one PutObject, streamed from the file: all or nothing, as ``put``

    def get_file(self, loc: S3Path, path: str | os.PathLike[str]) -> None:
        def fetch() -> None:
            body = self.client.get_object(Bucket=loc.bucket, Key=loc.key)["Body"]
            try:
                with open(path, "wb") as f:  # a retry starts the file afresh
                    for chunk in body.iter_chunks(1 << 20):  # checks the length, as read() does
                        f.write(chunk)
            finally:
                body.close()

        self._call("GET", loc, fetch)

    def put_new(self, loc: S3Path, data: bytes) -> None:
        try:
            self._call("conditional PUT", loc, lambda: self.client.put_object(
                Bucket=loc.bucket, Key=loc.key, Body=data, IfNoneMatch="*"))
        except ObjectExistsError:
            # a lost response of a successful attempt looks like this too: compare
            if self.get(loc) != data:
                raise

    def put_if(self, loc: S3Path, data: bytes, etag: str | None) -> str:
        """Compare-and-swap: write only if the object's ETag is still ``etag`` (None: only if
        there is no object); ``ObjectExistsError`` if another writer got there first. Returns
        the new ETag. The lease's acquire, takeover and renewal are this one request."""
        def put() -> Any:
            kw: dict[str, Any] = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            return self.client.put_object(Bucket=loc.bucket, Key=loc.key, Body=data, **kw)

        try:
            resp = self._call("conditional PUT", loc, put)
        except ObjectMissingError:  # If-Match on a key that was deleted meanwhile
            raise ObjectExistsError(f"{loc} changed (deleted) since it was read") from None
        return str(resp.get("ETag", ""))

    def get_tagged(self, loc: S3Path) -> tuple[bytes, str]:
        """The object's bytes and ETag (for ``put_if``)."""
        def fetch() -> tuple[bytes, str]:
            resp = self.client.get_object(Bucket=loc.bucket, Key=loc.key)
            with resp["Body"] as body:
                return body.read(), str(resp.get("ETag", ""))

        return self._call("GET", loc, fetch)

    def get(self, loc: S3Path) -> bytes:
        def fetch() -> bytes:
            resp = self.client.get_object(Bucket=loc.bucket, Key=loc.key)
            with resp["Body"] as body:  # reading the body can fail mid-way: inside the retry
                return body.read()

        return self._call("GET", loc, fetch)

    def exists(self, loc: S3Path) -> bool:
        if not loc.key:
            return False
        try:
            self._call("HEAD", loc, lambda: self.client.head_object(Bucket=loc.bucket, Key=loc.key))
        except ObjectMissingError:
            return False
        return True

    def size(self, loc: S3Path) -> int:
        resp = self._call("HEAD", loc, lambda: self.client.head_object(Bucket=loc.bucket, Key=loc.key))
        return int(resp["ContentLength"])

    def is_dir(self, loc: S3Path) -> bool:
        prefix = f"{loc.key}/" if loc.key else ""
        resp = self._call("LIST", loc, lambda: self.client.list_objects_v2(
            Bucket=loc.bucket, Prefix=prefix, MaxKeys=1))
        return resp.get("KeyCount", 0) > 0

    def keys(self, loc: S3Path, prefix: str = "") -> Iterator[str]:
        base = f"{loc.key}/" if loc.key else ""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": loc.bucket, "Prefix": base + prefix}
            if token:
                kw["ContinuationToken"] = token

            def list_page(kw: dict[str, Any] = kw) -> Any:  # this page's kw; the client is got inside _call
                return self.client.list_objects_v2(**kw)

            resp = self._call("LIST", loc, list_page)
            for obj in resp.get("Contents", []):
                yield obj["Key"][len(base):]
            if not resp.get("IsTruncated"):
                return
            token = resp["NextContinuationToken"]

    def delete(self, loc: S3Path) -> None:
        self._call("DELETE", loc, lambda: self.client.delete_object(Bucket=loc.bucket, Key=loc.key))

    def delete_tree(self, loc: S3Path) -> None:
        keys = [f"{loc.key}/{k}" if loc.key else k for k in self.keys(loc)]
        for i in range(0, len(keys), 1000):
            batch: dict[str, Any] = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}

            def delete_batch(batch: dict[str, Any] = batch) -> Any:  # this batch; the client is got inside _call
                return self.client.delete_objects(Bucket=loc.bucket, Delete=batch)

            resp = self._call("DELETE", loc, delete_batch)
            errors = resp.get("Errors") or []
            if errors:
                raise StorageError(f"S3 DELETE under {loc}: {len(errors)} objects not deleted, e.g. {errors[0]}")

    def move(self, src: S3Path, dst: S3Path) -> None:
        self._call("COPY", dst, lambda: self.client.copy_object(
            Bucket=dst.bucket, Key=dst.key, CopySource={"Bucket": src.bucket, "Key": src.key}))
        self.delete(src)

    def root_exists(self) -> bool:
        try:
            self._call("HEAD bucket", self.root, lambda: self.client.head_bucket(Bucket=self.root.bucket))
        except (ObjectMissingError, StorageAccessError) as exc:
            if isinstance(exc, StorageAccessError) and "does not exist" not in str(exc):
                raise
            return False
        return True


class S3CheckpointStorage(ObjectCheckpointStorage):
    """Checkpoints under ``s3://bucket/prefix``: state files and manifests as S3 objects."""

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        super().__init__(S3Objects(url, options))

    def __repr__(self) -> str:
        return f"S3CheckpointStorage({str(self.root)!r})"


# ---------------------------------------------------------------- classifying errors


def _code(exc: Exception) -> str:
    resp = getattr(exc, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _status(exc: BaseException) -> int:
    resp = getattr(exc, "response", None) or {}
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed: throttling, 5xx, timeouts, broken connections."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        return _code(exc) in TRANSIENT_CODES or _status(exc) >= 500 or _status(exc) == 429
    return isinstance(exc, (ConnectionError, HTTPClientError))


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    resp = getattr(exc, "response", None)
    if resp:
        err = resp.get("Error", {})
        return f"{err.get('Code') or _status(exc)} (HTTP {_status(exc)}): {err.get('Message') or exc}"
    return f"{type(exc).__name__}: {exc}"
