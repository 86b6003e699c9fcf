"""Print size counts of the classes and functions that tend to grow, so a change can be compared.

    python3 scripts/house_counts.py

Reads src/epochstream with ``ast`` (nothing is imported). What it counts:

- fields: attributes a class assigns to ``self`` in ``__init__`` plus annotated class-body fields
  (dataclasses); "any method" also counts the ones first assigned elsewhere;
- methods: functions defined in the class body; "with bases" adds those inherited from the
  other classes of the table;
- long functions: ``def`` to last line, decorators excluded, nested functions listed on their own;
- ``getattr(`` / ``hasattr(`` calls, and comparisons of a value with a mode name
  (``== "aligned"``, ``!= "tracker"``, ``in ("aligned", "unaligned")``, ``case "tracker":``).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "epochstream"
#: (module under src/epochstream, class name, its base in this table or None)
CLASSES = (
    ("runtime/task.py", "Task", None),
    ("runtime/task.py", "SourceTask", "Task"),
    ("runtime/task.py", "ConsumingTask", "Task"),
    ("alignment/channel_state.py", "ChannelStateRecorder", None),
    ("deploy/worker.py", "WorkerLoop", None),
    ("deploy/worker.py", "PeerLink", None),
    ("deploy/driver.py", "Driver", None),
    ("deploy/cluster.py", "ClusterDriver", "Driver"),
    ("deploy/local.py", "LocalDriver", "ClusterDriver"),
    ("deploy/spark.py", "SparkDriver", "ClusterDriver"),
    ("deploy/sim.py", "SimDriver", "Driver"),
)
MODES = frozenset({"aligned", "unaligned", "tracker"})
#: counted on its own line: the Kafka sink's ``guarantee`` takes the same word
AT_LEAST_ONCE = frozenset({"at-least-once"})
REFLECT = ("getattr", "hasattr")
COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
LONG = 60
TOP = 15


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _self_targets(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def class_counts(cls: ast.ClassDef) -> tuple[set[str], set[str], set[str]]:
    """(fields of ``__init__`` and the class body, attributes assigned in any method, method names)."""
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    body_fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    init = set().union(*(_self_targets(m) for m in methods if m.name == "__init__"))
    anywhere = set().union(*(_self_targets(m) for m in methods))
    return body_fields | init, body_fields | anywhere, {m.name for m in methods}


def _functions(node: ast.AST, where: str, out: list[tuple[int, str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{where}{child.name}"
            out.append(((child.end_lineno or child.lineno) - child.lineno + 1, name))
            _functions(child, name + ".", out)
        elif isinstance(child, ast.ClassDef):
            _functions(child, f"{where}{child.name}.", out)
        else:
            _functions(child, where, out)


def functions(root: Path) -> list[tuple[int, str]]:
    """(lines, "module:Qualified.name") of every function under ``root``, longest first."""
    out: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        _functions(_tree(path), path.relative_to(SRC).as_posix() + ":", out)
    return sorted(out, reverse=True)


def _names(node: ast.expr, names: frozenset[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in names for e in node.elts)
    return False


def calls_and_modes(root: Path, names: frozenset[str] = MODES) -> tuple[Counter[str], Counter[str]]:
    """Per module: ``getattr``/``hasattr`` calls (key "getattr module"), and comparisons with ``names``."""
    reflect: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECT:
                reflect[f"{node.func.id} {rel}"] += 1
            elif isinstance(node, ast.Compare) and any(isinstance(op, COMPARE) for op in node.ops):
                if any(_names(e, names) for e in [node.left, *node.comparators]):
                    modes[rel] += 1
            elif isinstance(node, ast.MatchValue) and _names(node.value, names):
                modes[rel] += 1
    return reflect, modes


def main() -> int:
    trees = {mod: _tree(SRC / mod) for mod, _c, _b in CLASSES}
    counted = {name: class_counts(_class(trees[mod], name)) for mod, name, _b in CLASSES}
    print("| class | module | fields (__init__) | attributes (any method) | methods | methods with bases |")
    print("|---|---|---|---|---|---|")
    for mod, name, base in CLASSES:
        fields, anywhere, methods = counted[name]
        inherited = set(methods)
        while base is not None:
            inherited |= counted[base][2]
            base = next(b for _m, n, b in CLASSES if n == base)
        print(f"| {name} | {mod} | {len(fields)} | {len(anywhere)} | {len(methods)} | {len(inherited)} |")

    for label, root in (("src/epochstream", SRC), ("src/epochstream/deploy", SRC / "deploy")):
        funcs = functions(root)
        long = [f for f in funcs if f[0] > LONG]
        print(f"\nfunctions over {LONG} lines in {label}: {len(long)} (of {len(funcs)})")
        for lines, name in long[:TOP]:
            print(f"  {lines:4d}  {name}")

    reflect, modes = calls_and_modes(SRC)
    for fn in REFLECT:
        print(f"\n{fn}( calls in src/epochstream: {sum(v for k, v in reflect.items() if k.startswith(fn + ' '))}")
    by_module: Counter[str] = Counter()
    for key, n in reflect.items():
        by_module[key.split(" ", 1)[1]] += n
    print("  by module (both): " + ", ".join(f"{m} {v}" for m, v in by_module.most_common(TOP)))
    print(f"\nmode-name comparisons ({', '.join(sorted(MODES))}) in src/epochstream: {sum(modes.values())}")
    print("  by module: " + ", ".join(f"{m} {v}" for m, v in modes.most_common()))
    other = calls_and_modes(SRC, AT_LEAST_ONCE)[1]
    print(f"comparisons with \"at-least-once\" (a mode, and a Kafka sink guarantee): {sum(other.values())}")
    print("  by module: " + ", ".join(f"{m} {v}" for m, v in other.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
