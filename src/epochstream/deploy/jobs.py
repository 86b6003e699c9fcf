"""Where the CLI finds running jobs: one small JSON file per job under ``$EPOCHSTREAM_HOME/jobs``.

A running job (local driver) serves its REST API on 127.0.0.1 and writes
``<home>/jobs/<job id>.json`` with its id, name, endpoint, pid and directories; the file is
removed when the job ends. A file whose process is gone is stale and ignored. The file holds
the job's HTTP token (every POST needs it), so it is written mode 0600 in a 0700 folder:
only the user who started the job can stop it.
``EPOCHSTREAM_HOME`` defaults to ``~/.epochstream``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .lease import process_alive as _alive


class JobNotFoundError(LookupError):
    """No running job matches what the user named."""


def home() -> Path:
    return Path(os.environ.get("EPOCHSTREAM_HOME") or Path.home() / ".epochstream").expanduser()


def _jobs_dir() -> Path:
    return home() / "jobs"


def register(info: dict[str, Any]) -> Path:
    path = _jobs_dir() / f"{info['id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info, indent=1))
    os.replace(tmp, path)
    return path


def token_for(endpoint: str) -> str | None:
    """The token of the running job serving ``endpoint`` (None: no registry entry of ours)."""
    endpoint = endpoint.rstrip("/")
    for info in running():
        if str(info.get("endpoint", "")).rstrip("/") == endpoint:
            return info.get("token")
    return None


def unregister(job_id: str) -> None:
    (_jobs_dir() / f"{job_id}.json").unlink(missing_ok=True)




def listed() -> list[dict[str, Any]]:
    """Every registered job, oldest first, with ``status``: ``running`` (its process is alive
    and, where it names a checkpoint dir, holds the lease there), ``dead`` (its process is
    gone, e.g. killed: the file was never removed) or ``orphaned`` (a live process that no
    longer holds its checkpoint dir's lease), and ``file``: the registry file."""
    out = []
    for info in _registered(unreadable=True):
        info["status"] = _status(info)
        out.append(info)
    return out


def _registered(unreadable: bool) -> list[dict[str, Any]]:
    """Every registry file's content with its ``file``, oldest first; an unreadable file is
    listed as a dead stub when ``unreadable``, else left out."""
    out: list[dict[str, Any]] = []
    folder = _jobs_dir()
    if not folder.is_dir():
        return out
    for path in folder.glob("*.json"):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            if not unreadable:
                continue
            info = {"id": path.stem, "name": "?", "pid": -1}
        info["file"] = str(path)
        out.append(info)
    return sorted(out, key=lambda i: i.get("started_at", 0))


def _status(info: dict[str, Any]) -> str:
    if not _alive(int(info.get("pid", -1))):
        return "dead"
    chk = info.get("checkpoint_dir")
    if chk:
        try:
            from ..backends import open_storage
            from .lease import read_lease

            lease = read_lease(open_storage(chk))
        except Exception:  # storage unreachable: the pid says alive, trust it
            return "running"
        if lease is None or lease.job_id != info.get("id"):
            return "orphaned"
    return "running"


def prune() -> list[dict[str, Any]]:
    """Remove the registry files of dead jobs; returns them."""
    gone = [j for j in listed() if j["status"] == "dead"]
    for j in gone:
        Path(j["file"]).unlink(missing_ok=True)
    return gone


def running() -> list[dict[str, Any]]:
    """Jobs whose driver process is alive, oldest first."""
    return [info for info in _registered(unreadable=False) if _alive(int(info.get("pid", -1)))]


def resolve(job_or_endpoint: str) -> tuple[str, str | None]:
    """``(endpoint, job id or None)`` of a job id, a unique id prefix, a job name or an endpoint URL."""
    if job_or_endpoint.startswith(("http://", "https://")):
        return job_or_endpoint.rstrip("/"), None
    jobs = running()
    hits = [j for j in jobs if j["id"] == job_or_endpoint] or \
        [j for j in jobs if j["id"].startswith(job_or_endpoint)] or \
        [j for j in jobs if j["name"] == job_or_endpoint]
    if not hits:
        listed = ", ".join(f"{j['name']} ({j['id']})" for j in jobs) or "none"
        raise JobNotFoundError(f"no running job {job_or_endpoint!r} (running jobs: {listed}; looked in {_jobs_dir()})")
    if len(hits) > 1:
        raise JobNotFoundError(f"{job_or_endpoint!r} names {len(hits)} running jobs: "
                               f"{', '.join(j['id'] for j in hits)}; give the job id")
    return hits[0]["endpoint"], hits[0]["id"]
