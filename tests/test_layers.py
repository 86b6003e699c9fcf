"""The protocol core stays sans-IO and imports flow one way (STYLE.md, DESIGN.md "Layout").

Protocol packages take time as an argument and return actions; clocks, randomness, threads,
sockets and the filesystem belong to ``deploy/`` and ``backends/``. This test reads every
module's imports with ``ast`` (nothing is executed), so a violation names file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "epochstream"
PROTOCOL = ("runtime", "alignment", "tracker", "loops", "snapshot", "chaos")
IO_MODULES = {"time", "random", "threading", "socket", "multiprocessing", "asyncio", "subprocess", "os",
              "shutil", "tempfile", "datetime", "secrets", "io", "pathlib", "boto3", "pyspark"}
#: package -> packages of epochstream it may import (besides itself), bottom layer first; the
#: table in docs/ARCHITECTURE.md is generated from it (``python3 tests/test_layers.py --write``)
ALLOWED = {
    "graph": set(),
    "runtime": {"graph"},
    "alignment": {"runtime"},
    "snapshot": {"runtime"},
    "tracker": {"runtime", "graph"},
    "loops": {"runtime", "graph"},
    # which kills a chaos run injects and when (a plan the drivers carry out)
    "chaos": set(),
    # graph: key groups and canonical keys (a keyed-state backend lays its keys out by key group)
    "backends": {"snapshot", "runtime", "graph"},
    # the dashboard, /metrics and the status line: documents from status dicts and manifests (the
    # servers that carry them are deploy's and the CLI's)
    "ui": {"graph", "tracker", "snapshot", "backends", "runtime"},
    "deploy": {"graph", "runtime", "alignment", "tracker", "loops", "snapshot", "chaos", "backends", "ui"},
    # PySpark's stateful operators: imports pyspark and pandas, so nothing below api/ imports it
    "pyspark": {"runtime", "graph"},
    "api": {"graph", "runtime", "deploy", "backends", "pyspark"},
}
#: what the doc's table says beside a package, and beside one of its imports
PACKAGE_NOTES = {
    "ui": "the dashboard, `/metrics`, the status line",
    "pyspark": "PySpark's stateful operators; [PYSPARK.md](PYSPARK.md)",
}
IMPORT_NOTES = {("api", "pyspark"): "inside methods only"}
DOC = SRC.parents[1] / "docs" / "ARCHITECTURE.md"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"
#: third-party packages only epochstream.pyspark may import (the base install has none of them)
OPTIONAL = {"pyspark", "pandas", "numpy"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    pkg_parts = path.relative_to(SRC).parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg_parts[: len(pkg_parts) - (node.level - 1)])
                mod = ".".join(["epochstream", *base, *([node.module] if node.module else [])])
                if node.module is None:  # from . import x
                    for alias in node.names:
                        yield node.lineno, f"{mod}.{alias.name}"
                    continue
                yield node.lineno, mod
            else:
                yield node.lineno, node.module


def _modules(package: str):
    return sorted((SRC / package).rglob("*.py"))


@pytest.mark.parametrize("package", PROTOCOL)
def test_protocol_packages_do_no_io(package):
    bad = []
    for path in _modules(package):
        for line, name in _imports(path):
            if name.split(".")[0] in IO_MODULES:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not bad, "sans-IO core imports I/O, clocks or threads:\n" + "\n".join(bad)


#: sans-IO modules inside deploy/ (a driver package): the attempt policy, the control messages, liveness,
#: flow control
SANS_IO_DEPLOY = ("attempt.py", "protocol.py", "liveness.py", "slots.py", "flow.py", "restart.py")


@pytest.mark.parametrize("module", SANS_IO_DEPLOY)
def test_the_attempt_controller_does_no_io(module):
    """Both drivers drive one ``AttemptController`` with their own clock: it must import none."""
    path = SRC / "deploy" / module
    bad = [f"deploy/{module}:{line} imports {name}" for line, name in _imports(path)
           if name.split(".")[0] in IO_MODULES]
    assert not bad, "sans-IO deploy module imports I/O, clocks or threads:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    bad = []
    for path in _modules(package):
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] != "epochstream" or len(parts) < 2:
                continue
            target = parts[1]
            if target != package and target in ALLOWED and target not in ALLOWED[package]:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not bad, f"{package}/ imports upward:\n" + "\n".join(bad)


def test_the_checker_sees_imports():
    """The walker must find the relative imports it is meant to police (a checker that sees
    nothing would pass everything)."""
    found = {name for _line, name in _imports(SRC / "runtime" / "task.py")}
    assert "epochstream.runtime.chain" in found and "epochstream.graph.plan" in found


def test_only_the_pyspark_wrappers_import_pyspark_or_pandas_at_module_level():
    """The base install (no pyspark, no pandas) must import epochstream: outside
    ``epochstream/pyspark/`` those packages may only be imported inside functions, and
    api/'s methods import ``epochstream.pyspark`` only when called."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "pyspark":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pyspark":
                names = ["epochstream.pyspark"]
            for name in names:
                if name.split(".")[0] in OPTIONAL or name == "epochstream.pyspark":
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} imports {name} at module level")
    assert not bad, "\n".join(bad)


def test_epochstream_imports_without_pyspark_and_pandas():
    """Run the import in a fresh interpreter where pyspark, pandas and numpy cannot be found."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pyspark', 'pandas', 'numpy'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import epochstream, epochstream.oracle, epochstream.cli\n"
        "p = epochstream.Pipeline('x')\n"
        "s = p.from_collection([1])\n"
        "try:\n"
        "    s.transform_with_state(object(), 'a long', key='a')\n"
        "except ImportError as e:\n"
        "    print('lazy', e)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(SRC.parent)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "lazy blocked: pyspark" in res.stdout, res.stdout


def markdown_table() -> str:
    """``ALLOWED`` as the doc's table: a row per package, bottom first; packages with the same
    imports share a row unless one has a note."""
    order = list(ALLOWED)
    alone = set(PACKAGE_NOTES) | {pkg for pkg, _target in IMPORT_NOTES}
    rows: list[tuple[list[str], set[str]]] = []
    for pkg in order:
        same = next((r for r in rows if r[1] == ALLOWED[pkg] and not alone & {pkg, *r[0]}), None)
        if same is not None:
            same[0].append(pkg)
        else:
            rows.append(([pkg], ALLOWED[pkg]))
    lines = ["| package | may import |", "|---|---|"]
    for pkgs, allowed in rows:
        left = ", ".join(f"`{p}/`" for p in pkgs)
        if pkgs[0] in PACKAGE_NOTES:
            left += f" ({PACKAGE_NOTES[pkgs[0]]})"
        targets = [f"`{t}/`" + (f" ({IMPORT_NOTES[pkgs[0], t]})" if (pkgs[0], t) in IMPORT_NOTES else "")
                   for t in order if t in allowed]
        lines.append(f"| {left} | {', '.join(targets) or 'nothing in the package'} |")
    return "\n".join(lines) + "\n"


def _doc_parts() -> tuple[str, str, str]:
    text = DOC.read_text()
    head, sep, rest = text.partition(BEGIN + "\n")
    table, sep2, tail = rest.partition(END)
    assert sep and sep2, f"{DOC.name} has no {BEGIN} ... {END} block"
    return head + sep, table, sep2 + tail


def test_every_package_is_in_the_table():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)
    assert all(targets <= set(ALLOWED) for targets in ALLOWED.values())


def test_the_architecture_doc_shows_this_table():
    assert _doc_parts()[1] == markdown_table(), "run: python3 tests/test_layers.py --write"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--markdown"]:
        print(markdown_table(), end="")
    elif sys.argv[1:] == ["--write"]:
        head, _table, tail = _doc_parts()
        DOC.write_text(head + markdown_table() + tail)
    else:
        sys.exit("usage: python3 tests/test_layers.py --markdown | --write")


def test_every_module_of_the_protocol_table_exists_and_does_no_io():
    """docs/ARCHITECTURE.md "Where each protocol lives" names only sans-IO modules that exist."""
    text = DOC.read_text()
    part = text.split("## Where each protocol lives", 1)[1].split("\n## ", 1)[0]
    named = sorted({m for line in part.splitlines() if line.startswith("|")
                    for m in re.findall(r"`([a-z_]+/[a-z_]+\.py)`", line)})
    assert len(named) >= 10, named
    for module in named:
        path = SRC / module
        assert path.exists(), f"{module} is in the protocol table but not in src/epochstream"
        package, name = module.split("/")
        assert package in PROTOCOL or package == "graph" or name in SANS_IO_DEPLOY, \
            f"{module} is in the protocol table but is neither in a protocol package nor a sans-IO deploy module"
