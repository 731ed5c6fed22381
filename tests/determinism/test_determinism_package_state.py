"""The modules of the workflow packages (``workflows/job/`` and below) hold no state a run could
change either: the same check as ``test_determinism_module_state.py``, whose glob sees only the
modules directly under ``workflows/``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_determinism_module_state import mutable_globals

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
PACKAGE_MODULES = sorted(p for p in WORKFLOWS.rglob("*.py") if p.parent != WORKFLOWS)


def test_the_job_workflow_is_a_package() -> None:
    assert (WORKFLOWS / "job" / "__init__.py") in PACKAGE_MODULES
    assert not (WORKFLOWS / "job.py").exists()


@pytest.mark.parametrize("path", PACKAGE_MODULES, ids=lambda p: str(p.relative_to(WORKFLOWS)))
def test_package_modules_hold_no_mutable_state(path: Path) -> None:
    assert mutable_globals(path.read_text()) == []
