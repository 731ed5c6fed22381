"""The chaos suite under pytest (``IRIS_CHAOS=1 uv run pytest tests/chaos -m chaos``).

Same engine as ``uv run python -m scripts.chaos``: its own Temporal (SQLite file), emulators,
controllers and a worker process, ~200 jobs while the worker is SIGKILLed every few seconds,
Temporal is restarted once on its database file and a peer controller is stopped and started.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.chaos import Options, run_chaos

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(1200)
async def test_chaos_loses_nothing_duplicates_nothing_and_delivers_nothing_cancelled(tmp_path: Path) -> None:
    options = Options(jobs=int(os.environ.get("IRIS_CHAOS_JOBS", "200")))
    report = await run_chaos(options, tmp_path / "chaos")
    print("\n" + report.table())
    assert report.faults.worker_kills >= 5 and report.faults.temporal_restarts == 1
    assert report.faults.peer_restarts == 1
    assert sum(report.verdict.states.values()) == options.jobs
    assert report.ok, report.invariants
