"""The chaos suite under pytest (``IRIS_CHAOS=1 uv run pytest tests/chaos -m chaos``).

Same engine as ``uv run python -m scripts.chaos``: its own Temporal (SQLite file), emulators,
controllers (the peers behind fault proxies) and a worker process, ~200 jobs while the worker is
SIGKILLed every few seconds, Temporal is restarted once on its database file, cw-rno2a is restarted
and later lost for good (past peer_lost_after, then brought back), cw-us-east-02a loses its launch
replies and is partitioned for longer than the launch retry budget, and running jobs' processes
are SIGKILLed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iris import slurmdev
from scripts.chaos import Options, run_chaos

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(1200)
async def test_chaos_loses_nothing_runs_nothing_twice_and_delivers_nothing_cancelled(tmp_path: Path) -> None:
    await _chaos(Options(jobs=int(os.environ.get("IRIS_CHAOS_JOBS", "200"))), tmp_path)


@pytest.mark.timeout(1200)
async def test_chaos_with_a_peer_on_slurm(tmp_path: Path) -> None:
    """The same run with cw-us-east-02a's H100 backend on a real single-node Slurm (issue 30):
    restarted, losing launch replies, partitioned, its jobs' processes SIGKILLed."""
    why = slurmdev.unavailable()
    if why is not None:
        pytest.skip(why)
    await _chaos(Options(jobs=int(os.environ.get("IRIS_CHAOS_JOBS", "200")), slurm=True), tmp_path)


async def _chaos(options: Options, tmp_path: Path) -> None:
    report = await run_chaos(options, tmp_path / "chaos")
    print("\n" + report.table())
    faults = report.faults
    assert faults.worker_kills >= 5 and faults.temporal_restarts == 1
    assert faults.peer_restarts == 1 and faults.peers_lost == 1 and faults.partitions == 1
    assert faults.lost_replies >= 6, "the lost-reply window saw too few launches"
    assert faults.partition_s > 30 and faults.partition_s < options.peer_lost_after_s
    assert faults.peer_lost_s > options.peer_lost_after_s
    assert faults.sigkilled, "no job process was SIGKILLed"
    assert sum(report.verdict.states.values()) == options.jobs
    assert report.ok, {name: n for name, n in report.invariants.items() if n}
