"""Continued runs of the code before JobRun replay against the current code (issue 28).

``continued/`` holds three runs that began with a ``Carry``, the state a run handed the next
before ``JobRun`` replaced it: one resumed following its attempt (then cancelled), one resumed in
the queue (then placed, SUCCEEDED), one resumed parked with its launch's outcome unknown (then
adopted, SUCCEEDED). They were recorded from tests/workflows/test_job_history.py on the Java test
server with the code of commit 850b109, the last before JobRun. The current code must read each
Carry back (same field names; the mailbox's fields then at the top level) and replay the run.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import history_files
import pytest
from temporalio.worker import Replayer

from iris.jobs import JobState
from iris.payloadcodec import Keyring
from iris.temporal import data_converter
from workflows.job import JobWorkflow
from workflows.job.state import Phase, read_inputs
from workflows.runner import workflow_runner

CONTINUED = Path(__file__).parent / "continued"
PHASES = {
    "following_then_cancelled": (Phase.FOLLOWING, JobState.KILLED),
    "queued_then_placed": (Phase.QUEUED, JobState.SUCCEEDED),
    "parked_then_adopted": (Phase.PARKED, JobState.SUCCEEDED),
}


def start_inputs(path: Path) -> list[object]:
    events = json.loads(path.read_text())["events"]
    payloads = events[0]["workflowExecutionStartedEventAttributes"]["input"]["payloads"]
    return [json.loads(base64.b64decode(p["data"])) for p in payloads]


def result_state(path: Path) -> str:
    last = json.loads(path.read_text())["events"][-1]
    payload = last["workflowExecutionCompletedEventAttributes"]["result"]["payloads"][0]
    return str(json.loads(base64.b64decode(payload["data"]))["state"])


def test_every_resumable_phase_has_a_continued_history() -> None:
    assert {p.stem for p in CONTINUED.glob("*.json")} == set(PHASES)


@pytest.mark.parametrize("name", sorted(PHASES))
def test_an_old_carry_reads_back_as_a_job_run(name: str) -> None:
    path = CONTINUED / f"{name}.json"
    inputs = start_inputs(path)
    assert len(inputs) == 2 and isinstance(inputs[1], dict) and "mailbox" not in inputs[1]
    carry = inputs[1]
    spec, run, refused = read_inputs(tuple(inputs))
    assert refused is None and spec is not None and run is not None
    phase, end = PHASES[name]
    assert run.phase is phase and result_state(path) == end.value
    assert run.spec == spec and run.status.job_id == spec.job_id
    # Same names: every field of the Carry is the JobRun's, the mailbox's under ``mailbox``.
    for key, value in carry.items():
        if key in ("explanation", "explanation_code", "observed", "seen_version", "logs_until_ms"):
            assert getattr(run.mailbox, key) == value or value is None, key
        elif key not in ("status", "view", "remote", "promoted", "maybe_on", "clusters", "phase"):
            assert getattr(run, key) == value, key
    # A Carry had no ``delivered``: a job not in the queue, or launched before, was delivered.
    assert run.delivered is (phase is not Phase.QUEUED or run.status.handoff_attempts > 0)


@pytest.mark.parametrize("name", sorted(PHASES))
async def test_a_continued_run_of_the_old_code_replays(name: str) -> None:
    history = history_files.load(CONTINUED / f"{name}.json")
    replayer = Replayer(
        workflows=[JobWorkflow],
        data_converter=data_converter(Keyring.generate()),
        workflow_runner=workflow_runner(),
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{name} no longer replays: {result.replay_failure}"
