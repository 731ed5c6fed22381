"""The job as users, the SDK, the CLI and the job workflow see it (SPEC §3).

These models are Temporal payloads (pydantic converter) and the SDK's return types; they hold
no secrets: credentials stay with each cluster's own configuration.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from iris.bundle import BundleRef
from iris.contract import SA_BAND, SA_DEVICE_VARIANT, SA_STATE, SA_SUBMITTER
from iris.policy.models import Band, Constraint, DeviceRequest, JobShape


class JobState(StrEnum):
    CLASSIFYING = "CLASSIFYING"
    QUEUED_HANDOFF = "QUEUED_HANDOFF"
    PENDING_HANDOFF = "PENDING_HANDOFF"
    HANDED_OFF = "HANDED_OFF"
    PENDING = "PENDING"
    BUILDING = "BUILDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    KILLED = "KILLED"
    UNSCHEDULABLE = "UNSCHEDULABLE"
    REJECTED = "REJECTED"
    HANDOFF_REJECTED = "HANDOFF_REJECTED"
    HANDOFF_FAILED = "HANDOFF_FAILED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.KILLED,
        JobState.UNSCHEDULABLE,
        JobState.REJECTED,
        JobState.HANDOFF_REJECTED,
    }
)


class JobSpec(BaseModel):
    """A submitted job: what to run, where it may run, and who asked."""

    job_id: str
    name: str
    user: str
    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    device: DeviceRequest = DeviceRequest()
    constraints: tuple[Constraint, ...] = ()
    band: Band = Band.INTERACTIVE
    target_cluster: str | None = None
    artifacts: list[str] = Field(default_factory=list)
    scheduling_timeout_s: float | None = None
    submit_ms: int = 0
    # The submitter's workspace, kept in the home cluster's store; the job carries only its id.
    bundle: BundleRef | None = None

    def shape(self) -> JobShape:
        deadline = None
        if self.scheduling_timeout_s is not None:
            deadline = self.submit_ms + int(self.scheduling_timeout_s * 1000)
        return JobShape(
            job_id=self.job_id,
            constraints=self.constraints,
            device=self.device,
            band=self.band,
            target_cluster=self.target_cluster,
            submit_ms=self.submit_ms,
            deadline_ms=deadline,
        )

    @property
    def device_label(self) -> str:
        d = self.device
        if d.type == "cpu" or d.count == 0:
            return "cpu"
        variant = d.type if d.variant == "auto" else d.variant
        label = f"{variant}×{d.count}"
        return label if d.replicas == 1 else f"{label}, {d.replicas} replicas"

    def summary(self) -> str:
        """One line for the Web UI's static summary, e.g. ``train-llama · h100×8 · → cw-us-east-02a``."""
        parts = [self.name, self.device_label, self.band.label]
        if self.target_cluster:
            parts.append(f"→ {self.target_cluster}")
        return " · ".join(parts)


class JobEvent(BaseModel):
    """One line of a job's own story, shown by ``iris job describe``."""

    at_ms: int
    state: JobState
    message: str


class TaskView(BaseModel):
    """One replica of the job as the cluster running it last reported it."""

    index: int
    state: str
    exit_code: int | None = None
    slots: list[int] = Field(default_factory=list)


class JobStatus(BaseModel):
    """What the job workflow knows about its job; the answer to the ``status`` query."""

    job_id: str
    state: JobState
    reason: str = ""
    disposition: str | None = None
    classification_reason: str | None = None
    cluster: str | None = None
    backend_id: str | None = None
    exit_code: int | None = None
    error: str | None = None
    cancel_requested: bool = False
    submit_ms: int = 0
    updated_ms: int = 0
    events: list[JobEvent] = Field(default_factory=list)
    tasks: list[TaskView] = Field(default_factory=list)
    handoff_attempts: int = 0
    spec: JobSpec | None = None

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def ended_cancel_outcome(self) -> CancelOutcome:
        """What a cancel of this ended job answers: won when it was killed before any cluster
        received it (a cancel that arrives again, or late, still learns that)."""
        won = self.state is JobState.KILLED and self.handoff_attempts == 0
        never = "; never delivered" if won else ""
        return CancelOutcome(
            won=won, state=self.state, message=f"job already ended as {self.state.value}{never}"
        )


class Placement(BaseModel):
    """The placement signal: run the job on this cluster's backend."""

    cluster: str
    backend_id: str
    observation_epoch_ms: int | None = None


class CancelRequest(BaseModel):
    reason: str = "Cancelled by user"


class ReplayRequest(BaseModel):
    """An operator's replay of a parked handoff: same cluster, another one, or back to the queue."""

    peer: str | None = None
    requeue: bool = False
    reason: str = "operator replay"

    def describe(self) -> str:
        where = (
            "back to the queue" if self.requeue else f"to {self.peer}" if self.peer else "to the same cluster"
        )
        return f"{where} ({self.reason})"


class CancelOutcome(BaseModel):
    """Whether a cancel won the race against handoff (the job was never delivered), and what it did."""

    won: bool
    state: JobState
    message: str


def start_search_attributes(spec: JobSpec) -> TypedSearchAttributes:
    """Search attributes set when the workflow starts, so the UI can filter from the first moment."""
    variant = spec.device.variant if spec.device.count else "cpu"
    return TypedSearchAttributes(
        [
            SearchAttributePair(SA_STATE, JobState.CLASSIFYING.value),
            SearchAttributePair(SA_DEVICE_VARIANT, variant),
            SearchAttributePair(SA_BAND, spec.band.label),
            SearchAttributePair(SA_SUBMITTER, spec.user),
        ]
    )
