"""The workflow modules hold no state a run could change (they are passed through the sandbox).

``workflows/runner.py`` imports the ``workflows`` package once, outside the sandbox, instead of once
per run; a mutable module or class global there would be shared by every run on the worker, and
a run that changed it would change the others' replay. So every module-level and class-level
assignment must be a constant, an immutable container or one of a few immutable-by-use values,
and no function may rebind a global.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from workflows.runner import PASSED_THROUGH, workflow_runner

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "workflows").glob("*.py"))
# Calls whose results are immutable, or only ever read (RetryPolicy is handed to the SDK as is).
# A dataclass ``field(default_factory=...)`` gives each instance its own value and leaves no class
# attribute behind (and dataclasses refuse a mutable plain default).
IMMUTABLE_CALLS = {"timedelta", "RetryPolicy", "TypeVar", "MappingProxyType", "frozenset", "tuple", "field"}


def immutable(node: ast.expr | None, frozen: frozenset[str] = frozenset()) -> bool:
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Tuple):
        return all(immutable(e, frozen) for e in node.elts)
    if isinstance(node, ast.Attribute):  # an enum member or another module's constant
        return True
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        return name in IMMUTABLE_CALLS or name in frozen
    return False


def frozen_dataclasses(tree: ast.Module) -> frozenset[str]:
    """Classes of the module declared ``@dataclass(frozen=True)``: their instances are immutable."""
    names = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and any(
                k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in deco.keywords
            ):
                names.add(node.name)
    return frozenset(names)


def mutable_globals(source: str) -> list[str]:
    tree = ast.parse(source)
    frozen = frozen_dataclasses(tree)
    found = []
    scopes: list[tuple[str, list[ast.stmt]]] = [("module", tree.body)]
    scopes += [(f"class {n.name}", n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
    for scope, body in scopes:
        for stmt in body:
            targets: list[ast.expr] = []
            value: ast.expr | None = None
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign):
                targets, value = [stmt.target], stmt.value
            if targets and not immutable(value, frozen):
                found.append(f"{scope}: line {stmt.lineno}: {ast.unparse(stmt).splitlines()[0]}")
    found += [
        f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)
    ]
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_workflow_modules_hold_no_mutable_state(path: Path) -> None:
    assert mutable_globals(path.read_text()) == []


def test_the_check_catches_mutable_state() -> None:
    source = "CACHE = {}\nSEEN: list[str] = []\nclass W:\n    runs = []\ndef f():\n    global CACHE\n"
    assert len(mutable_globals(source)) == 4
    assert mutable_globals("A = 'x'\nB = timedelta(seconds=1)\nC = MappingProxyType({1: 2})\n") == []
    # An instance of a frozen dataclass of the module is immutable; of a plain one, it is not.
    frozen = "@dataclasses.dataclass(frozen=True)\nclass F:\n    x: int\nA = F(1)\n"
    plain = "@dataclasses.dataclass\nclass P:\n    x: int\nA = P(1)\n"
    assert mutable_globals(frozen) == []
    assert len(mutable_globals(plain)) == 1


def test_the_worker_passes_the_workflows_package_through() -> None:
    assert PASSED_THROUGH == ("workflows",)
    assert "workflows" in workflow_runner().restrictions.passthrough_modules
