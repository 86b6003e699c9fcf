"""Write constraints.txt: the exact versions of every package epochstream's extras pull in, as
installed in the current Python (the environment the tests passed in).

    python scripts/lock.py            # after `pip install -e .[dev]` and a green test run

scripts/setup.sh installs with ``-c constraints.txt``, so a fresh machine gets what CI tested.
Only the dependency closure of epochstream is written (not whatever else the Python holds);
an extra whose packages are not installed here (e.g. ``bench`` without Bytewax) is skipped
with a warning rather than guessed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev", "s3", "spark", "delta", "bench")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: metadata.Distribution, extras: set[str]) -> list[Requirement]:
    out = []
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None:
            out.append(req)
            continue
        env = default_environment()
        if any(req.marker.evaluate({**env, "extra": e}) for e in extras or {""}):
            out.append(req)
    return out


def closure() -> dict[str, str]:
    pinned: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [("epochstream", set(EXTRAS))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonical(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"lock: {name} is not installed here; left out", file=sys.stderr)
            continue
        if canonical(name) != "epochstream":
            pinned[canonical(dist.metadata["Name"])] = dist.version
        todo.extend((r.name, set(r.extras)) for r in requirements(dist, extras))
    return pinned


def main() -> None:
    pins = closure()
    lines = ["# Exact versions CI tested, written by scripts/lock.py; used by scripts/setup.sh (-c).",
             f"# Python {sys.version_info.major}.{sys.version_info.minor}; regenerate after changing pyproject.toml.",
             *(f"{name}=={version}" for name, version in sorted(pins.items()))]
    (ROOT / "constraints.txt").write_text("\n".join(lines) + "\n")
    print(f"lock: {len(pins)} packages in constraints.txt")


if __name__ == "__main__":
    main()
