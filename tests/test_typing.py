"""The sans-IO core type-checks under mypy's strict flags (pyproject.toml ``[tool.mypy]``).

The protocol packages are typed all the way down (no untyped defs, no implicit Any
returns), so a change that breaks a signature fails here, in the fast suite, and not first
in a driver. The whole package (basic mode elsewhere) is checked by ``mypy src/epochstream``,
which ``scripts/test.sh`` runs before the tests.
"""

from __future__ import annotations

from pathlib import Path

import mypy.api  # the dev extra installs it: a missing mypy fails here rather than skipping

ROOT = Path(__file__).resolve().parents[1]
STRICT = ("runtime", "alignment", "tracker", "loops", "snapshot", "graph")


def test_the_protocol_packages_pass_mypy_strict(monkeypatch):
    monkeypatch.chdir(ROOT)  # pyproject.toml's [tool.mypy] applies
    out, err, status = mypy.api.run([f"src/epochstream/{p}" for p in STRICT])
    assert status == 0, out + err
