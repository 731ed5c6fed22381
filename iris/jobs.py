"""The job as users, the SDK, the CLI and the job workflow see it (docs/DESIGN.md, "Job states").

These models are Temporal payloads (pydantic converter) and the SDK's return types; they hold
no secrets: credentials stay with each cluster's own configuration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from pydantic import BaseModel, Field, ValidationError
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from iris.bundle import BundleRef
from iris.contract import MEMO_REASON, SA_BAND, SA_DEVICE_VARIANT, SA_REASON, SA_STATE, SA_SUBMITTER
from iris.controller.artifacts import MAX_ARTIFACTS, MAX_URI_CHARS
from iris.controller.models import (
    MAX_COMMAND_ARGS,
    MAX_USER_CHARS,
    TIMED_OUT,
    ControllerJobState,
    LaunchRequest,
    validate_job_id,
)
from iris.defaults import MAX_RETRIES as MAX_RETRIES
from iris.defaults import MAX_TIMEOUT_S as MAX_TIMEOUT_S
from iris.policy.models import Band, Constraint, DeviceRequest, Hold, JobShape
from iris.policy.reasons import ReasonCode
from iris.policy.routing import MAX_COUNT
from iris.store.models import HandleState

# What a submission may hold (docs/DESIGN.md, "User → home"): ``build_spec`` refuses more with its
# own one-line messages, and ``JobSpec.check`` refuses whatever it would, in the workflow too.
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ARTIFACT_RE = re.compile(r"(gs|s3)://[a-z0-9][a-z0-9._-]{1,221}/[^\s\x00-\x1f\x7f]+")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_ENV_BYTES = 64 * 1024
MAX_COMMAND_BYTES = 64 * 1024
MAX_ATTRIBUTE_CHARS = 128
MAX_CONSTRAINTS = 32
MAX_SCHEDULING_TIMEOUT_S = 30 * 86400.0
# Submit times a workflow's timers can count from: up to the year 2286, in ms.
MAX_SUBMIT_MS = 10**13


def user_prefix(user: str) -> str:
    """The first segment of every job id ``user`` submits (``alice@example.com`` → ``alice``):
    the workflow refuses a job id whose first segment is not its verified signer's."""
    local = user.split("@", 1)[0]
    return re.sub(r"[^A-Za-z0-9._-]", "-", local) or "user"


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class JobState(StrEnum):
    """Where a job is, as its workflow, the CLI, the SDK and the Web UI (``IrisState``) say it. The
    transitions: docs/DESIGN.md, "Job states"."""

    # Reading the federation's capacity reports and deciding: home, queue or reject.
    CLASSIFYING = "CLASSIFYING"
    # In the federation queue, waiting for the placement tick to offer capacity.
    QUEUED_HANDOFF = "QUEUED_HANDOFF"
    # Promoted (or running at home): artifacts checked, handoff being prepared or sent.
    PENDING_HANDOFF = "PENDING_HANDOFF"
    # The chosen cluster accepted the job.
    HANDED_OFF = "HANDED_OFF"
    # Mirrored: on its cluster, waiting for devices.
    PENDING = "PENDING"
    # The job's workspace bundle is being staged on the cluster that will run it.
    BUILDING = "BUILDING"
    # Mirrored: running on its cluster.
    RUNNING = "RUNNING"
    # Ended: every replica exited 0.
    SUCCEEDED = "SUCCEEDED"
    # Ended: a replica failed, timed out, or its cluster lost it.
    FAILED = "FAILED"
    # Ended: cancelled (before handoff, or terminated on its cluster).
    KILLED = "KILLED"
    # Ended: its scheduling timeout passed before any cluster had room.
    UNSCHEDULABLE = "UNSCHEDULABLE"
    # Ended at submit: no backend anywhere in the federation has its shape.
    REJECTED = "REJECTED"
    # Ended: the chosen cluster refused the job (or its bundle) for good.
    HANDOFF_REJECTED = "HANDOFF_REJECTED"
    # Parked: the handoff cannot complete (outage past the retries, a missing artifact or bundle);
    # it waits for an operator's replay or a cancel.
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

# The one mapping between the three layers' vocabularies (docs/DESIGN.md, "The three vocabularies"):
# a cluster's job state as the job's, and a job's end as its queue handle's. Read-only: the workflow
# module that uses them is imported once for every run (workflows/runner.py).
_MIRRORED: Mapping[ControllerJobState, JobState] = MappingProxyType(
    {
        ControllerJobState.PENDING: JobState.PENDING,
        ControllerJobState.RUNNING: JobState.RUNNING,
        ControllerJobState.SUCCEEDED: JobState.SUCCEEDED,
        ControllerJobState.FAILED: JobState.FAILED,
        ControllerJobState.KILLED: JobState.KILLED,
        ControllerJobState.WORKER_FAILED: JobState.FAILED,
        # Shown only when no retry is left (a preempted attempt is otherwise queued again).
        ControllerJobState.PREEMPTED: JobState.FAILED,
    }
)
_HANDLE_END: Mapping[JobState, HandleState] = MappingProxyType(
    {
        JobState.SUCCEEDED: HandleState.SUCCEEDED,
        JobState.FAILED: HandleState.FAILED,
        JobState.KILLED: HandleState.KILLED,
        JobState.UNSCHEDULABLE: HandleState.UNSCHEDULABLE,
        JobState.HANDOFF_REJECTED: HandleState.HANDOFF_REJECTED,
    }
)


# The code each state shows when nothing more precise is known (docs/DESIGN.md, "Reason codes"): the
# workflow names a more precise one where it knows it (a FAILED job's Timeout or PeerLost, a parked
# job's ArtifactMissing or PeerUnreachable, a queued job's code from the tick, a refused submission).
_STATE_CODES: Mapping[JobState, ReasonCode] = MappingProxyType(
    {
        JobState.CLASSIFYING: ReasonCode.Pending,
        JobState.QUEUED_HANDOFF: ReasonCode.Pending,
        JobState.PENDING_HANDOFF: ReasonCode.Pending,
        JobState.BUILDING: ReasonCode.Pending,
        JobState.HANDED_OFF: ReasonCode.Running,
        JobState.PENDING: ReasonCode.Running,
        JobState.RUNNING: ReasonCode.Running,
        JobState.SUCCEEDED: ReasonCode.Succeeded,
        JobState.FAILED: ReasonCode.ExitNonZero,
        JobState.KILLED: ReasonCode.Cancelled,
        JobState.UNSCHEDULABLE: ReasonCode.DeadlinePassed,
        JobState.REJECTED: ReasonCode.ShapeMismatch,
        JobState.HANDOFF_REJECTED: ReasonCode.HandoffRefused,
        JobState.HANDOFF_FAILED: ReasonCode.HandoffFailed,
    }
)


def state_code(state: JobState) -> ReasonCode:
    """The reason code a job in ``state`` shows unless its workflow names a more precise one."""
    return _STATE_CODES[state]


def mirrored_state(remote: ControllerJobState) -> JobState:
    """A job's state as the cluster running it reports it (``WORKER_FAILED`` is a failure)."""
    return _MIRRORED[remote]


def handle_end(state: JobState) -> HandleState | None:
    """The queue handle's final state for a job that ended so; None if the handle is not ended."""
    return _HANDLE_END.get(state)


def attempt_nonce(incarnation: str, attempt: int) -> str:
    """The nonce of one delivery: the incarnation itself for the first (as before attempts were
    numbered), ``<incarnation>#<n>`` after it. A cluster runs one attempt per nonce, at most once."""
    return incarnation if attempt <= 1 else f"{incarnation}#{attempt}"


def log_key(job_id: str, attempt: int) -> str:
    """Where an attempt's output is relayed at home: the job id for the first, ``<job id>#<n>``
    after it (``#`` is never part of a job id)."""
    return job_id if attempt <= 1 else f"{job_id}#{attempt}"


class AttemptEnd(StrEnum):
    """How an attempt ended, as far as retries go (docs/DESIGN.md, "Attempts")."""

    # The job is done: every replica exited 0.
    SUCCEEDED = "SUCCEEDED"
    # A replica failed (non-zero exit): retried under --max-retries-failure.
    FAILED = "FAILED"
    # It ran out of its --timeout: never retried.
    TIMEOUT = "TIMEOUT"
    # Terminated (a cancel): never retried.
    KILLED = "KILLED"
    # Its cluster lost it (WORKER_FAILED, forgotten, or silent past peer_lost_after), or preempted it
    # for a higher band (PREEMPTED, docs/DESIGN.md, "Preemption"): retried under
    # --max-retries-preemption.
    PREEMPTED = "PREEMPTED"
    # Never sent: its launch was replaced, before it went out, by a later launch of the same nonce on
    # another cluster (an operator's replay elsewhere). It never ran, so it spends no budget, and it
    # never ends a job (the replacing launch goes on).
    NOT_DELIVERED = "NOT_DELIVERED"

    @property
    def retryable(self) -> bool:
        return self in (AttemptEnd.FAILED, AttemptEnd.PREEMPTED)

    @property
    def code(self) -> ReasonCode:
        """The job's reason code when it ends so (docs/DESIGN.md, "Reason codes")."""
        return _END_CODES[self]


_END_CODES: Mapping[AttemptEnd, ReasonCode] = MappingProxyType(
    {
        AttemptEnd.SUCCEEDED: ReasonCode.Succeeded,
        AttemptEnd.FAILED: ReasonCode.ExitNonZero,
        AttemptEnd.TIMEOUT: ReasonCode.Timeout,
        AttemptEnd.KILLED: ReasonCode.Cancelled,
        AttemptEnd.PREEMPTED: ReasonCode.PeerLost,
        AttemptEnd.NOT_DELIVERED: ReasonCode.HandoffFailed,
    }
)


def attempt_end(remote: ControllerJobState, error: str | None) -> AttemptEnd:
    """How an attempt whose cluster reports it ``remote`` (terminal) ended."""
    if remote is ControllerJobState.SUCCEEDED:
        return AttemptEnd.SUCCEEDED
    if remote in (ControllerJobState.WORKER_FAILED, ControllerJobState.PREEMPTED):
        return AttemptEnd.PREEMPTED
    if remote is ControllerJobState.KILLED:
        return AttemptEnd.KILLED
    return AttemptEnd.TIMEOUT if error == TIMED_OUT else AttemptEnd.FAILED


def end_code(remote: ControllerJobState, error: str | None, *, preemption: bool = True) -> ReasonCode:
    """The job's reason code when its attempt ends as its cluster reports it (``remote``, terminal):
    ``Preempted`` for an attempt its cluster preempted (unless ``preemption`` is off: a run that
    predates it shows that as its cluster losing the attempt), else its ``AttemptEnd``'s."""
    if preemption and remote is ControllerJobState.PREEMPTED:
        return ReasonCode.Preempted
    return attempt_end(remote, error).code


class AttemptView(BaseModel):
    """One delivery of the job to a cluster, as ``describe`` shows it."""

    number: int
    cluster: str
    backend_id: str
    nonce: str
    started_ms: int
    ended_ms: int | None = None
    # How it ended (None while it runs), with the cluster's exit code and reason.
    end: AttemptEnd | None = None
    exit_code: int | None = None
    reason: str | None = None
    # For an attempt its cluster preempted for a higher band: the cluster's word on it,
    # "preempted by <job id> at <time>" (docs/DESIGN.md, "Preemption").
    preempted: str | None = None


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
    # How many more attempts a job gets after one that failed (a non-zero exit), and after one whose
    # cluster lost it (its processes died with their worker, or the cluster stopped answering).
    max_retries_failure: int = Field(default=0, ge=0, le=MAX_RETRIES)
    max_retries_preemption: int = Field(default=1, ge=0, le=MAX_RETRIES)
    # Wall-clock limit on running (per attempt): the cluster kills the job and it fails, "timeout".
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    # The submitter's signed statement over this spec (iris/userauth.py); not a secret.
    signature: str = ""

    def check(self) -> None:
        """ValueError, one line that quotes no value of the env, unless this is a spec the SDK would
        submit (``iris.client.build_spec``'s limits) and every cluster's launch would take
        (``LaunchRequest``): the job workflow ends one that is not REJECTED in its first task,
        before anything is enqueued, reserved or launched (docs/DESIGN.md, "User → home")."""
        validate_job_id(self.job_id)
        if not JOB_NAME_RE.fullmatch(self.name):
            raise ValueError("the job name must be 1-63 letters, digits, '.', '_' or '-'")
        user = self.user
        if not user or len(user) > MAX_USER_CHARS or CONTROL_RE.search(user) or not _is_utf8(user):
            raise ValueError(f"the user must be 1-{MAX_USER_CHARS} UTF-8 characters, no control ones")
        cmd = self.command
        if not cmd[0].strip():
            raise ValueError("the command's program (its first argument) is empty")
        if len(cmd) > MAX_COMMAND_ARGS:
            raise ValueError(f"the command has more than {MAX_COMMAND_ARGS} arguments")
        if any("\x00" in a or not _is_utf8(a) for a in cmd):
            raise ValueError("the command holds a NUL byte or is not valid UTF-8")
        if sum(len(a.encode("utf-8")) for a in cmd) > MAX_COMMAND_BYTES:
            raise ValueError(f"the command is larger than {MAX_COMMAND_BYTES} bytes")
        for key, value in self.env.items():
            if not ENV_KEY_RE.fullmatch(key):
                raise ValueError(f"invalid environment variable name {key[:64]!r}")
            if "\x00" in value or not _is_utf8(value):
                raise ValueError(f"environment variable {key} is not a UTF-8 string without NUL bytes")
        if sum(len(k) + len(v) for k, v in self.env.items()) > MAX_ENV_BYTES:
            raise ValueError(f"the environment is larger than {MAX_ENV_BYTES} bytes")
        d = self.device
        # Its shape is classification's business (a device nothing offers is ShapeMismatch); only
        # what no cluster could count or name is refused here.
        if d.count > MAX_COUNT or d.replicas > MAX_COUNT:
            raise ValueError(f"the device request counts more than {MAX_COUNT} devices or replicas")
        for text in (d.type, d.variant):
            if not text.strip() or len(text) > MAX_ATTRIBUTE_CHARS or CONTROL_RE.search(text):
                raise ValueError(
                    f"the device type and variant must be 1-{MAX_ATTRIBUTE_CHARS} printable characters"
                )
        if len(self.constraints) > MAX_CONSTRAINTS:
            raise ValueError(f"more than {MAX_CONSTRAINTS} constraints")
        for c in self.constraints:
            for text in (c.key, *c.values):
                if not text.strip() or len(text) > MAX_ATTRIBUTE_CHARS or CONTROL_RE.search(text):
                    raise ValueError(
                        f"a constraint's key or value is empty, longer than {MAX_ATTRIBUTE_CHARS} "
                        "characters or holds a control character"
                    )
        pin = self.target_cluster
        if pin is not None and (not pin.strip() or len(pin) > MAX_ATTRIBUTE_CHARS or CONTROL_RE.search(pin)):
            raise ValueError(f"the target cluster must be 1-{MAX_ATTRIBUTE_CHARS} printable characters")
        if len(self.artifacts) > MAX_ARTIFACTS:
            raise ValueError(f"more than {MAX_ARTIFACTS} artifacts")
        for uri in self.artifacts:
            # The destination's check reports a URI it cannot address as missing (the job parks);
            # only what its check request would refuse is refused here.
            if not uri.strip() or len(uri) > MAX_URI_CHARS or CONTROL_RE.search(uri):
                raise ValueError(f"invalid artifact URI {uri[:80]!r}")
        timeout = self.scheduling_timeout_s
        if timeout is not None and not (math.isfinite(timeout) and 0 < timeout <= MAX_SCHEDULING_TIMEOUT_S):
            raise ValueError("the scheduling timeout must be between 1s and 30 days")
        if self.timeout_s is not None and not math.isfinite(self.timeout_s):
            raise ValueError("the timeout must be a finite number of seconds")
        if not 0 <= self.submit_ms <= MAX_SUBMIT_MS:
            raise ValueError("the submit time is out of range")
        try:
            LaunchRequest(
                job_id=self.job_id,
                command=cmd,
                env=self.env,
                device=d,
                band=self.band,
                user=user,
                requester="home",
                nonce=f"{self.job_id}@{self.submit_ms}",
                backend_id="backend",
                bundle=self.bundle,
                timeout_s=self.timeout_s,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"a cluster's launch would refuse it: {where}: {first['msg']}") from None

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
            # Verified against the signature before the job reaches the queue (authenticate).
            user=self.user,
            # Backfill plans with it (docs/DESIGN.md, "Backfill"); None: the band's default.
            time_limit_ms=math.ceil(self.timeout_s * 1000) if self.timeout_s is not None else None,
        )

    @property
    def device_label(self) -> str:
        d = self.device
        if d.type == "cpu" or d.count == 0:
            return "cpu"
        variant = d.type if d.variant == "auto" else d.variant
        label = f"{variant}×{d.count}"
        return label if d.replicas == 1 else f"{label}, {d.replicas} replicas"

    @property
    def metric_device(self) -> str:
        """The ``device`` label of the job's metrics (iris/metrics.py): ``cpu``, ``h100x8``, or
        ``h100x8x2`` for two replicas of eight."""
        d = self.device
        if d.type == "cpu" or d.count == 0:
            return "cpu"
        variant = d.type if d.variant == "auto" else d.variant
        label = f"{variant}x{d.count}"
        return label if d.replicas == 1 else f"{label}x{d.replicas}"

    def summary(self) -> str:
        """One line for the Web UI's static summary, e.g. ``train-llama · h100×8 · → cw-us-east-02a``."""
        parts = [self.name, self.device_label, self.band.label]
        if self.target_cluster:
            parts.append(f"→ {self.target_cluster}")
        return " · ".join(parts)


class WaitReason(BaseModel):
    """The tick's ``explain_reason`` signal: why a queued job still waits, and the stable code of
    that reason (docs/DESIGN.md, "Reason codes")."""

    reason: str
    code: ReasonCode
    # With ``Reserved``: the devices the tick holds for the job, where and from when.
    hold: Hold | None = None


class JobEvent(BaseModel):
    """One line of a job's own story, shown by ``iris job describe``."""

    at_ms: int
    state: JobState
    message: str
    # The stable code of a decision the line records, where it has one (a backfilled promotion:
    # ``Backfilled``); None for most lines.
    code: ReasonCode | None = None


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
    # The reason's stable code (iris/policy/reasons.py); None in a run that predates them.
    reason_code: ReasonCode | None = None
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
    # Every delivery of the job, in order; the last is the current one.
    attempts: list[AttemptView] = Field(default_factory=list)
    # What the last tick held for the job while it waits (code ``Reserved``, docs/DESIGN.md
    # "Backfill"); shown only while the job is queued with that code.
    hold: Hold | None = None

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
    # The canceller's signed statement (iris/userauth.py); a cancel without a valid one is ignored.
    signature: str = ""


class ReplayRequest(BaseModel):
    """An operator's replay of a parked handoff: same cluster, another one, or back to the queue."""

    peer: str | None = None
    requeue: bool = False
    reason: str = "operator replay"
    # Replay elsewhere although the last launch's cluster may still run the job (it is fenced).
    force: bool = False
    # The operator's signed statement (iris/userauth.py); a replay without a valid one is refused.
    signature: str = ""

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


# A new job's reason while it is classified: its status's first, and the memo it starts with.
CLASSIFYING_REASON = "Classifying against the federation's capacity reports"


def start_memo() -> dict[str, str]:
    """The memo a job's workflow starts with: its first reason, so `iris job list` shows it from the
    first moment and (a run begun with the 2027-01 baseline) the workflow need not write it."""
    return {MEMO_REASON: CLASSIFYING_REASON}


def start_search_attributes(spec: JobSpec) -> TypedSearchAttributes:
    """Search attributes set when the workflow starts, so the UI can filter from the first moment."""
    variant = spec.device.variant if spec.device.count else "cpu"
    return TypedSearchAttributes(
        [
            SearchAttributePair(SA_STATE, JobState.CLASSIFYING.value),
            SearchAttributePair(SA_REASON, ReasonCode.Pending.value),
            SearchAttributePair(SA_DEVICE_VARIANT, variant),
            SearchAttributePair(SA_BAND, spec.band.label),
            SearchAttributePair(SA_SUBMITTER, spec.user),
        ]
    )
