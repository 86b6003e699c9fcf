"""What the job's HTTP API accepts: complete, bounded, typed request bodies and an owner's token.

The server (``deploy.rest``) stays on the standard library's ``http.server``; what it acts on
is checked here first, and a request that fails any check is answered with an error and
changes nothing:

- **length** (``body_length``): ``Content-Length`` must be a plain decimal number, at most
  ``MAX_BODY`` (413 before a byte is read, so a huge body never reaches memory); chunked
  bodies are refused (411): every client we know sends a length for a small JSON body;
- **completeness** (``read_body``): exactly that many bytes, or 400 when the peer stops early
  (the socket has a timeout: a body that never arrives is not waited for forever);
- **shape** (``parse``): JSON, an object, and fields of the right type through pydantic's
  strict mode (``"savepoint": "no"`` is not a boolean, ``42`` is not a path); an unknown field
  is an error too, so a typo never silently means "default";
- **owner** (``authorized``): every POST carries ``Authorization: Bearer <token>``, the job's
  token from its registry file (``deploy.jobs``, mode 0600): only the user who started the
  job can stop it or trigger its savepoints.

pydantic was chosen over hand-written checks because the dashboard and metrics grow this
server's surface: one declared model per body, its errors naming the field.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

#: the largest request body the API reads (its bodies are a path and a flag)
MAX_BODY = 64 * 1024


class BadRequest(Exception):
    """A request the API refuses; ``status`` is the HTTP code, the message names what is wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class SavepointBody(BaseModel):
    """``POST /jobs/<id>/savepoints`` (Flink's ``target-directory``; ``targetDirectory`` also read)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False, strict=True)
    target_directory: StrictStr | None = Field(default=None, alias="target-directory", min_length=1)
    targetDirectory: StrictStr | None = Field(default=None, min_length=1)  # noqa: N815 - Flink's camelCase

    @property
    def target(self) -> str | None:
        return self.target_directory or self.targetDirectory


class StopBody(SavepointBody):
    """``POST /jobs/<id>/stop``: ``savepoint`` (default true) with an optional ``target-directory``."""

    savepoint: StrictBool = True


def body_length(headers: Any) -> int:
    """The declared body length, checked before anything is read."""
    if headers.get("Transfer-Encoding"):
        raise BadRequest(411, "chunked bodies are not accepted: send a Content-Length")
    values = headers.get_all("Content-Length") if hasattr(headers, "get_all") else [headers.get("Content-Length")]
    values = [v for v in (values or []) if v is not None]
    if not values:
        return 0
    if len(set(values)) > 1:
        raise BadRequest(400, f"conflicting Content-Length headers {values}")
    raw = values[0].strip()
    if not raw.isascii() or not raw.isdigit():  # no sign, no spaces, no "abc", no "١٢"
        raise BadRequest(400, f"Content-Length {values[0]!r} is not a non-negative decimal number")
    n = int(raw)
    if n > MAX_BODY:
        raise BadRequest(413, f"request body of {n} bytes is larger than the {MAX_BODY} bytes this API accepts")
    return n


def read_body(read: Callable[[int], bytes], length: int) -> bytes:
    """Exactly ``length`` bytes from ``read`` (a socket file's read), or ``BadRequest(400)``."""
    chunks: list[bytes] = []
    got = 0
    while got < length:
        try:
            chunk = read(length - got)
        except (TimeoutError, OSError) as exc:
            raise BadRequest(400, f"request body incomplete: {got} of {length} bytes arrived "
                                  f"({type(exc).__name__}); nothing was done") from None
        if not chunk:
            raise BadRequest(400, f"request body incomplete: {got} of {length} bytes arrived; nothing was done")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def parse(model: type[BaseModel], data: bytes) -> BaseModel:
    """``data`` as ``model``: a JSON object with fields of the declared types (empty = all defaults)."""
    if not data.strip():
        return model()
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"malformed JSON body: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, f"the body must be a JSON object, not {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise BadRequest(400, "; ".join(_describe(e) for e in exc.errors())) from None


def _describe(error: Any) -> str:
    field = ".".join(str(p) for p in error.get("loc", ())) or "(body)"
    if error.get("type") == "extra_forbidden":
        return f"field {field!r} is not accepted here"
    return f"field {field!r}: {error.get('msg')} (got {error.get('input')!r:.80})"


def authorized(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    if not header or not token:
        return False
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
