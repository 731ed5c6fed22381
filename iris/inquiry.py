"""What a client asks of the queue (docs/DESIGN.md, "Queue position and dry-run"): the placement
manager's Update messages and their answers.

They live here rather than beside the activities that answer them (activities/inquiry.py, which
re-exports them) so the SDK sends them without loading any activity or workflow code: `iris job
list` reads positions with the Temporal client alone (tests/test_cli_imports.py).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from iris.policy.models import JobShape
from iris.policy.queue import QueuePosition

# At most this many job ids per question: one page of `iris job list` (its --limit's maximum).
MAX_POSITION_IDS = 1000


class PositionsRequest(BaseModel):
    # At most MAX_POSITION_IDS: the manager's validator refuses more (a payload that failed to
    # decode would fail the manager's workflow task instead).
    job_ids: list[str] = Field(default_factory=list)


class UserShare(BaseModel):
    """What one user's jobs hold now, as the tick's fair share counts it (docs/DESIGN.md, "Fair
    share and aging"): accelerator chips, and the dominant share of the devices in use (0 to 1)."""

    devices: int = 0
    share: float = 0.0


class PositionsAnswer(BaseModel):
    """The asked jobs that are queued, with their positions (a job not queued is left out), and
    each user holding devices with what it holds (``users``; empty from a manager before it)."""

    positions: dict[str, QueuePosition] = Field(default_factory=dict)
    queued: int = 0
    users: dict[str, UserShare] = Field(default_factory=dict)
    at_ms: int = 0


class DryRunRequest(BaseModel):
    job: JobShape
