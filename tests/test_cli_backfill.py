"""Backfill at the CLI, with no service (docs/DESIGN.md, "Backfill"): `iris job describe` of a job
devices are held for says `Reserved`, where and from when; of a backfilled job, its promotion's
event line ends with `[Backfilled]` and says which job it went ahead of. The status comes from a
stand-in for the SDK client, as the workflow's query would give it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from cli_main import iris
from test_cli_attempts import connected as connected

from iris.client import IrisError
from iris.jobs import JobEvent, JobState, JobStatus
from iris.logrelay import RelayedChunk
from iris.policy.models import Hold
from iris.policy.reasons import ReasonCode

GANG = "alice/gang"
SHORT = "bob/short"


class Client:
    def __init__(self, status: JobStatus) -> None:
        self.status = status

    def resolve(self, job_id: str) -> str:
        return job_id

    async def describe(self, job_id: str) -> JobStatus:
        return self.status

    async def position(self, job_id: str) -> Any:
        raise IrisError("no queue positions in this test")

    async def logs(self, job_id: str, offset: int = 0, *, attempt: int | None = None) -> RelayedChunk:
        return RelayedChunk(data="", next_offset=0)


def test_describe_of_a_held_job_says_reserved_where_and_from_when(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    start_ms = int(time.time() * 1000) + 12 * 60_000 + 30_000
    hold = Hold(
        job_id=GANG,
        peer_id="cw-rno2a",
        backend_id="h100",
        token="h100",
        amount=16,
        start_ms=start_ms,
        spare=0,
    )
    reason = "Queued for a federation peer to report free capacity: full on cw-rno2a (needs 16 h100)"
    status = JobStatus(
        job_id=GANG,
        state=JobState.QUEUED_HANDOFF,
        reason=f"{reason}; 16 h100 held for it on cw-rno2a",
        reason_code=ReasonCode.Reserved,
        hold=hold,
    )
    connected(Client(status))
    code, out, err = iris(monkeypatch, capsys, "job", "describe", GANG)
    assert code == 0, err
    lines = out.splitlines()
    assert f"Reason:         Reserved: {reason}; 16 h100 held for it on cw-rno2a" in lines
    reserved = next(line for line in lines if line.startswith("Reserved:"))
    assert "16 h100 on cw-rno2a/h100 from " in reserved and "(in 12m" in reserved, reserved
    # The JSON carries the hold whole.
    code, out, _ = iris(monkeypatch, capsys, "job", "describe", "--json", GANG)
    assert json.loads(out)["hold"] == hold.model_dump(mode="json")
    # Once it is no longer held (another code), the line is gone, whatever the status kept.
    connected(Client(status.model_copy(update={"reason_code": ReasonCode.NoCapacity})))
    _, out, _ = iris(monkeypatch, capsys, "job", "describe", GANG)
    assert not any(line.startswith("Reserved:") for line in out.splitlines())


def test_describe_of_a_backfilled_job_ends_its_promotion_line_with_the_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], connected: Callable[[Any], list[int]]
) -> None:
    message = (
        "promoted to cw-rno2a/h100: Placed on peer cw-rno2a backend h100 with free capacity, ahead of "
        f"{GANG} (backfill: its time limit ends before that job's reserved start)"
    )
    status = JobStatus(
        job_id=SHORT,
        state=JobState.RUNNING,
        reason="Running on cw-rno2a",
        reason_code=ReasonCode.Running,
        cluster="cw-rno2a",
        events=[
            JobEvent(
                at_ms=1_796_000_000_000,
                state=JobState.QUEUED_HANDOFF,
                message=message,
                code=ReasonCode.Backfilled,
            )
        ],
    )
    connected(Client(status))
    code, out, err = iris(monkeypatch, capsys, "job", "describe", SHORT)
    assert code == 0, err
    line = next(line for line in out.splitlines() if "promoted to" in line)
    assert line.endswith(
        f"ahead of {GANG} (backfill: its time limit ends before that job's reserved start) [Backfilled]"
    )
