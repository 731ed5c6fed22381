"""Every committed history replays within the job workflow's phase table (workflows/job/
transitions.py, docs/DESIGN.md "The phase machine"): no move to a state, and no step to a phase,
that the table does not allow. Production only logs such a move; here it fails the replay's test."""

from __future__ import annotations

from pathlib import Path

import history_files
import pytest
from temporalio.worker import Replayer

from iris.payloadcodec import Keyring
from iris.temporal import data_converter
from workflows.job import JobWorkflow, transitions
from workflows.placement import PlacementManager
from workflows.runner import workflow_runner
from workflows.watch import PeerWatch

HERE = Path(__file__).parent
HISTORIES = sorted((HERE / "histories").glob("*.json")) + sorted((HERE / "continued").glob("*.json"))


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: f"{p.parent.name}/{p.stem}")
async def test_a_committed_history_keeps_to_the_phase_table(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found: list[str] = []
    monkeypatch.setattr(transitions, "illegal", found.append)
    replayer = Replayer(
        workflows=[JobWorkflow, PlacementManager, PeerWatch],
        data_converter=data_converter(Keyring.generate()),
        workflow_runner=workflow_runner(),
    )
    result = await replayer.replay_workflow(history_files.load(path), raise_on_replay_failure=False)
    assert result.replay_failure is None
    assert found == []


def test_the_check_sees_an_illegal_move(monkeypatch: pytest.MonkeyPatch) -> None:
    found: list[str] = []
    monkeypatch.setattr(transitions, "illegal", found.append)
    transitions.check(transitions.Phase.QUEUED, transitions.Phase.PARKED)
    assert len(found) == 1 and "queued went to parked" in found[0]
