"""What the federation store holds and answers (docs/DESIGN.md, "Job states",
"Promotion (the CAS)"): job handles and CAS outcomes."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, model_validator

from iris.policy.models import Band, JobShape, Reservation
from iris.policy.reasons import ReasonCode


class HandleState(StrEnum):
    """Where a queued job's handle is in the federation store: what the tick, the CAS and the
    ledger act on. Only jobs that went through the queue have one (docs/DESIGN.md, "The three
    vocabularies"; ``iris.jobs.handle_end`` maps a job's end to its handle's)."""

    # Waiting: the tick may offer it capacity, the CAS may promote it, a cancel may record intent.
    QUEUED_HANDOFF = "QUEUED_HANDOFF"
    # Promoted by the CAS to (peer, backend): charged to the ledger against that observation.
    PENDING_HANDOFF = "PENDING_HANDOFF"
    # The chosen cluster accepted the job.
    HANDED_OFF = "HANDED_OFF"
    # The handoff is parked for an operator (the job's HANDOFF_FAILED).
    HANDOFF_FAILED = "HANDOFF_FAILED"
    # Ended as the job did.
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    KILLED = "KILLED"
    # Expired before promotion: never promoted afterwards.
    UNSCHEDULABLE = "UNSCHEDULABLE"
    HANDOFF_REJECTED = "HANDOFF_REJECTED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL: frozenset[HandleState] = frozenset(
    {
        HandleState.SUCCEEDED,
        HandleState.FAILED,
        HandleState.KILLED,
        HandleState.UNSCHEDULABLE,
        HandleState.HANDOFF_REJECTED,
    }
)


class JobHandle(BaseModel):
    """One job's row in the federation queue.

    ``band``, ``submit_ms`` and ``deadline_ms`` are copies of the shape's fields (filled from it
    when omitted) kept as columns so the store can order and expire without parsing shapes.
    """

    job_id: str
    incarnation: str
    state: HandleState = HandleState.QUEUED_HANDOFF
    shape: JobShape
    band: Band = Band.INTERACTIVE
    submit_ms: int = 0
    deadline_ms: int | None = None
    assigned_peer: str | None = None
    assigned_backend: str | None = None
    observation_epoch_ms: int | None = None
    cancel_requested: bool = False
    cancel_reason: str | None = None
    reason: str | None = None
    # While queued: the stable code of ``reason`` the tick gave (iris/policy/reasons.py).
    reason_code: ReasonCode | None = None
    updated_ms: int = 0

    @model_validator(mode="before")
    @classmethod
    def _copy_from_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        shape = data.get("shape")
        if isinstance(shape, dict):
            shape = JobShape.model_validate(shape)
        if isinstance(shape, JobShape):
            data = dict(data)
            data.setdefault("band", shape.band)
            data.setdefault("submit_ms", shape.submit_ms)
            data.setdefault("deadline_ms", shape.deadline_ms)
        return data

    @model_validator(mode="after")
    def _agrees_with_shape(self) -> JobHandle:
        s = self.shape
        if s.job_id != self.job_id:
            raise ValueError(f"shape is for job {s.job_id!r}, not {self.job_id!r}")
        if (self.band, self.submit_ms, self.deadline_ms) != (s.band, s.submit_ms, s.deadline_ms):
            raise ValueError("band, submit_ms and deadline_ms must match the job's shape")
        return self

    @property
    def target_cluster(self) -> str | None:
        return self.shape.target_cluster


class PromoteOutcome(StrEnum):
    PROMOTED = "PROMOTED"
    ALREADY_PROMOTED = "ALREADY_PROMOTED"
    NOT_FOUND = "NOT_FOUND"
    NOT_QUEUED = "NOT_QUEUED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"
    NO_CAPACITY = "NO_CAPACITY"
    UNKNOWN_BACKEND = "UNKNOWN_BACKEND"

    @property
    def promoted(self) -> bool:
        return self in (PromoteOutcome.PROMOTED, PromoteOutcome.ALREADY_PROMOTED)


class PromoteResult(BaseModel):
    """The CAS's answer. A refusal other than CANCELLED/EXPIRED leaves the job queued."""

    outcome: PromoteOutcome
    promoted: bool = False
    message: str = ""
    handle: JobHandle | None = None
    reservation: Reservation | None = None

    @model_validator(mode="after")
    def _promoted_from_outcome(self) -> PromoteResult:
        # Derived, never trusted from input: a caller cannot build a "promoted" refusal.
        self.promoted = self.outcome.promoted
        return self


class CancelResult(BaseModel):
    """``won``: the cancel committed before any promotion, so the job can never be delivered."""

    won: bool
    state: HandleState
    message: str = Field(default="")


class Fence(BaseModel):
    """An attempt a cluster may still run although the job has moved on: terminated there, by its
    nonce, once that cluster answers (docs/DESIGN.md, "Attempts")."""

    job_id: str
    nonce: str
    cluster: str
    created_ms: int
