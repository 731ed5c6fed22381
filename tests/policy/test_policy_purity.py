"""The policy package stays pure: no temporalio, no network or storage libraries, no clock."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import iris.policy

POLICY_DIR = Path(iris.policy.__file__).parent
ALLOWED_ROOTS = {
    "__future__",
    "pydantic",
    "iris",
    "bisect",
    "collections",
    "dataclasses",
    "enum",
    "gc",
    "heapq",
    "itertools",
    "operator",
    "re",
    "typing",
}
FORBIDDEN = (
    "temporalio",
    "httpx",
    "boto3",
    "botocore",
    "google",
    "sqlalchemy",
    "psycopg",
    "fastapi",
    "requests",
)


def _imports(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module)
    return roots


def test_policy_sources_import_only_pure_modules() -> None:
    for path in sorted(POLICY_DIR.glob("*.py")):
        for module in _imports(path):
            root = module.split(".")[0]
            assert root in ALLOWED_ROOTS, f"{path.name} imports {module}"
            if root == "iris":
                assert module.startswith("iris.policy"), f"{path.name} imports {module}"


def test_policy_sources_never_read_the_clock() -> None:
    for path in sorted(POLICY_DIR.glob("*.py")):
        text = path.read_text()
        for call in ("time.time(", "time.monotonic(", "datetime.now(", "random."):
            assert call not in text, f"{path.name} uses {call}"


def test_importing_policy_loads_no_io_library() -> None:
    code = (
        "import sys, iris.policy, iris.policy.planner\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
