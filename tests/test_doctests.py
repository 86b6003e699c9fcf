"""The ``>>>`` examples in the package's docstrings run, so none can go stale.

Every module with an example is listed here; a module that gains one and is not listed
fails ``test_every_module_with_examples_is_listed``.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "epochstream"
#: modules of epochstream whose docstrings hold ``>>>`` examples
MODULES = (
    "epochstream.alignment.overtaking",
    "epochstream.chaos.plan",
    "epochstream.chaos.verdict",
    "epochstream.deploy.restart",
    "epochstream.deploy.spark",
    "epochstream.graph.cycles",
    "epochstream.graph.keygroups",
    "epochstream.runtime.eventtime",
    "epochstream.runtime.watermarks",
    "epochstream.state",
    "epochstream.tracker.local",
    "epochstream.tracker.segments",
)
PROMPT = re.compile(r"^\s*>>> ", re.MULTILINE)


def _modules_with_examples() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        if PROMPT.search(path.read_text()):
            parts = path.relative_to(SRC.parent).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_every_module_with_examples_is_listed():
    assert _modules_with_examples() == set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), raise_on_error=False)
    assert result.attempted > 0, f"{name}: no example found (its >>> lines are outside docstrings?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"
