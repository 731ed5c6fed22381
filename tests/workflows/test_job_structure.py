"""The shape of the job workflow's code (issue 28): where each kind of write may happen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "workflows" / "job"


def job_modules() -> list[Path]:
    return sorted(JOB.rglob("*.py"))


def calls_of(tree: ast.AST, attr: str) -> list[int]:
    """Lines of every call ``<something>.<attr>(...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
    ]


def test_only_the_versions_module_asks_a_patch() -> None:
    askers = {
        path.relative_to(JOB).as_posix()
        for path in job_modules()
        if calls_of(ast.parse(path.read_text()), "patched")
    }
    assert askers == {"versions.py"}
