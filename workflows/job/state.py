"""What one job's workflow knows, as one serialisable ``JobRun`` (docs/DESIGN.md, "Bounded
histories"): the spec, the status users see, where the job is (its ``Phase``), the attempt and its
budgets, and the ``Mailbox`` the message handlers write for the lifecycle to read. A run that
continues as new hands its JobRun to the next whole (``handover``); the next reads it back with
``read_inputs``, which also reads the ``Carry`` of a run begun before JobRun (same field names,
the mailbox's fields then at the top level)."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError
from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from activities.watch import Observation
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import (
        CLASSIFYING_REASON,
        CancelRequest,
        JobEvent,
        JobSpec,
        JobState,
        JobStatus,
        ReplayRequest,
        attempt_nonce,
    )
    from iris.payloadconverter import reason as unreadable_reason
    from iris.policy.models import Placement
    from iris.policy.reasons import ReasonCode
    from iris.reports import FederationView
    from iris.store.models import JobHandle

from workflows.versions import Features

# The job's own event list (the status query's) keeps its first and latest events across runs.
EVENTS_HEAD = 20
EVENTS_TAIL = 200


def now_ms() -> int:
    """Workflow time, in ms since the epoch."""
    return int(workflow.now().timestamp() * 1000)


class Phase(StrEnum):
    """Where the job is in its lifecycle: each phase is one step of workflows/job/steps/, which
    returns the next (workflows/job/transitions.py has the table; docs/DESIGN.md, "Job states").
    A run continues as new only in QUEUED, FOLLOWING or PARKED, the values a Carry could hold."""

    # Admission, the submitter's signature, classification: home now, the queue, or rejected.
    CLASSIFY = "classify"
    # Waiting in the federation queue for a placement and its promotion (first attempt or later).
    QUEUED = "queued"
    # Checks, staging, the launch to ``cluster`` and its reconciliation.
    HANDOFF = "handoff"
    # An attempt runs on ``cluster``: it is followed there until it ends.
    FOLLOWING = "following"
    # Parked in HANDOFF_FAILED, waiting for an operator's replay or a cancel.
    PARKED = "parked"
    # A cancel to carry out where the job is (a signal, the Update, or Temporal's own).
    CANCEL = "cancelling"
    # The job has reached its final state (recorded): ``run`` returns it.
    ENDED = "ended"


class Mailbox(BaseModel):
    """What the message handlers leave for the lifecycle: a placement, a cancel, an expiry, an
    operator's replay, the tick's latest reason, the cluster's latest observation and a reader's
    wish for the log. Handlers write here; the steps read and clear."""

    # The tick's placement, or an operator's verified replay target (``vouched``: promoted as it is).
    placement: Placement | None = None
    vouched: bool = False
    cancel: CancelRequest | None = None
    expire: bool = False
    replay: ReplayRequest | None = None
    # The tick's latest pending reason (it may arrive before the enqueue's answer), and its code.
    explanation: str | None = None
    explanation_code: ReasonCode | None = None
    # The watcher's latest observation of the attempt not yet acted on: the follower takes it only
    # for its own attempt's nonce (SIGNALS_PATCH), and the feed version of the newest status seen
    # (an older one arriving late is dropped).
    observed: Observation | None = None
    seen_version: tuple[str, int] | None = None
    # A reader of the log wants it relayed every second until then (ms since the epoch).
    logs_until_ms: int = 0

    @property
    def quiet(self) -> bool:
        """Nothing pending that the lifecycle must act on before it may continue as new."""
        return self.cancel is None and self.placement is None and self.replay is None and not self.expire


# The mailbox's fields that a Carry (before JobRun) held at its top level.
_CARRIED_MAIL = ("explanation", "explanation_code", "observed", "seen_version", "logs_until_ms")


class JobRun(BaseModel):
    """Everything one job's workflow knows, handed whole from a run to the next."""

    # Not in the JobRun's own payload: the spec is the continued run's first input, as at start.
    spec: Annotated[JobSpec, Field(exclude=True)]
    phase: Phase = Phase.CLASSIFY
    status: JobStatus
    # The capacity view the job was classified with (a later attempt picks a backend with it).
    view: FederationView | None = None
    # Where the current attempt goes or runs, and the cluster's latest status of it (FOLLOWING).
    # The status shows the cluster once the handoff begins (``status.cluster``).
    cluster: str = ""
    backend: str = ""
    remote: ControllerJobStatus | None = None
    # The resolved pin (the cluster's exact id), and every cluster the classification saw.
    pin: str | None = None
    clusters: tuple[str, ...] = ()
    # The job's handle is in the federation queue (store): its transitions must be recorded.
    queued: bool = False
    # Set in the workflow task that schedules the launch: from then on the job may be on a
    # cluster, and a cancel has to go through that cluster. Cleared when the job is queued again
    # for its next attempt (REQUEUE_PATCH).
    delivered: bool = False
    # Whether the run that began the job took LOCAL_STEPS_PATCH's path (later runs keep it).
    local_steps: bool = True
    # What the visibility store and the memo hold, so an unchanged value is not written again.
    sa_state: str | None = None
    sa_reason: str | None = None
    memo_reason: str | None = None
    # When the job last entered the federation queue (workflow time, ms): a won promotion records
    # the wait since (iris_queue_wait_seconds).
    queued_since_ms: int | None = None
    # The current attempt (docs/DESIGN.md, "Attempts"), and the retries used of each budget.
    attempt: int = 1
    failures_retried: int = 0
    preemptions_retried: int = 0
    # Attempts its clusters preempted for a higher band since REQUEUE_PATCH: requeued, spending no
    # budget (docs/DESIGN.md, "Preemption").
    band_preemptions: int = 0
    # A launch whose answer never came: (cluster, nonce) of an attempt that cluster may be running.
    maybe_on: tuple[str, str] | None = None
    # How long a cluster running an attempt may stay silent before the attempt is lost.
    lost_after_s: float = 600.0
    # How many runs came before this one (this one included).
    runs: int = 1
    # The submitter as its signed statement proved (AUTH_PATCH): the handoff's user.
    principal: str | None = None
    # The job's last won promotion, and whether its park released that reservation (PARK_PATCH).
    promoted: Placement | None = None
    released: bool = False
    mailbox: Annotated[Mailbox, Field(default_factory=Mailbox)]

    @property
    def incarnation(self) -> str:
        # Minted once per job incarnation; stable across retries and workflow resets.
        return f"{self.spec.job_id}@{self.spec.submit_ms}"

    @property
    def nonce(self) -> str:
        return attempt_nonce(self.incarnation, self.attempt)

    @property
    def waiting_in_queue(self) -> bool:
        # The tick may answer before this workflow has processed its own enqueue (a signal is
        # delivered ahead of the activity result in the same task), so CLASSIFYING counts too.
        return self.status.state in (JobState.CLASSIFYING, JobState.QUEUED_HANDOFF)


def new_run(spec: JobSpec | None, workflow_id: str) -> JobRun:
    """A job about to be classified; ``spec`` None: its input is refused (a stand-in spec)."""
    given = spec
    if spec is None:
        spec = JobSpec(job_id=workflow_id[:256], name="-", user="-", command=["-"])
    status = JobStatus(
        job_id=spec.job_id,
        state=JobState.CLASSIFYING,
        reason=CLASSIFYING_REASON,
        reason_code=ReasonCode.Pending,
        submit_ms=spec.submit_ms,
        updated_ms=spec.submit_ms,
        spec=given,
    )
    return JobRun(spec=spec, status=status, local_steps=False, mailbox=Mailbox())


def handover(run: JobRun) -> JobRun:
    """The JobRun a run continues as new with: itself, its events trimmed to the first
    EVENTS_HEAD and the latest EVENTS_TAIL (a marker says how many were left out)."""
    st = run.status.model_copy()
    if len(st.events) > EVENTS_HEAD + EVENTS_TAIL:
        dropped = len(st.events) - EVENTS_HEAD - EVENTS_TAIL
        marker = JobEvent(
            at_ms=st.events[EVENTS_HEAD].at_ms,
            state=st.events[EVENTS_HEAD].state,
            message=f"({dropped} events omitted)",
        )
        st.events = [*st.events[:EVENTS_HEAD], marker, *st.events[-EVENTS_TAIL:]]
    handed = run.model_copy()
    handed.status = st
    return handed


def read_inputs(inputs: tuple[Any, ...]) -> tuple[JobSpec | None, JobRun | None, str | None]:
    """The run's spec and JobRun from its untyped inputs, or why they are not a job's (a start
    holds one input, the signed spec; a continued run also its JobRun, or an older run's Carry)."""
    if not 1 <= len(inputs) <= 2:
        return None, None, f"a job's start holds one input, its signed spec, not {len(inputs)}"
    spec: JobSpec | None = None
    run: JobRun | None = None
    for index, value in enumerate(inputs):
        if isinstance(value, RawValue):
            return None, None, f"its input cannot be read ({unreadable_reason(value.payload)})"
        try:
            if index == 0:
                spec = JobSpec.model_validate(value)
            elif isinstance(value, dict) and "mailbox" not in value:
                run = _from_carry(value, spec)
            elif value is not None:
                run = JobRun.model_validate({**value, "spec": spec} if isinstance(value, dict) else value)
        except ValidationError as exc:
            return None, None, _not_a(exc, "spec" if index == 0 else "carry")
    return spec, run, None


def _from_carry(data: dict[str, Any], spec: JobSpec | None) -> JobRun:
    """A Carry (before JobRun) as a JobRun: the mailbox's fields were at its top level, and it had
    no ``delivered`` (a job was delivered if it was not in the queue, or had had a launch)."""
    data = dict(data)
    data["mailbox"] = {key: data.pop(key) for key in _CARRIED_MAIL if key in data}
    run = JobRun.model_validate({**data, "spec": spec})
    if "delivered" not in data:
        run.delivered = run.phase is not Phase.QUEUED or run.status.handoff_attempts > 0
    return run


def _not_a(exc: ValidationError, what: str) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the input"
    return f"its input is not a job {what}: {where[:80]}: {first['msg'][:120]}"


@dataclasses.dataclass(frozen=True)
class Parking:
    """A handoff that cannot complete now: the job parks in HANDOFF_FAILED with this reason and code."""

    reason: str
    code: ReasonCode = ReasonCode.HandoffFailed


@dataclasses.dataclass(frozen=True)
class Adopted:
    """A cluster answered that it has (or had) the attempt after all: it is followed there."""

    cluster: str
    remote: ControllerJobStatus


@dataclasses.dataclass
class Ctx:
    """One run's working context: its JobRun, the features this run has (versions.read), and what
    lives only as long as the run: the shielded writes a Temporal cancel must let land before it
    is recorded against them, the cancels whose signature is being checked (a handoff waits for
    their verdict), and whether Temporal itself cancelled the run."""

    run: JobRun
    features: Features = dataclasses.field(default_factory=Features)
    enqueue_op: workflow.ActivityHandle[JobHandle] | None = None
    launch_op: workflow.ActivityHandle[ControllerJobStatus] | None = None
    verifying: int = 0
    temporal_cancel: bool = False
    # Why this run's start input is refused (SUBMISSION_PATCH), and whether it is a start that
    # carries a JobRun without continuing a run.
    refused_input: str | None = None
    forged_carry: bool = False
    # The view the admission read with the signature check (Features.admits), for classification.
    admitted_view: FederationView | None = None
