"""Wire models of the cluster controller API (docs/DESIGN.md, "Capacity reports",
"Handoff and admission", "Mirroring, logs and cancellation").

These are the request and response bodies of the HTTP API; the client library parses the same
models, so both sides agree on one definition.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from iris.bundle import BundleRef
from iris.policy.models import BackendReport, Band, DeviceRequest

# One job id segment: conservative characters so ids survive URLs, file names and logs unchanged.
_SEGMENT = r"[A-Za-z0-9_@+=:,~-][A-Za-z0-9._@+=:,~-]*"
JOB_ID_PATTERN = rf"^{_SEGMENT}(/{_SEGMENT})*$"
_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
MAX_JOB_ID_LEN = 256
# Limits of a handoff (LaunchRequest); the SDK refuses a submission beyond them at submit.
MAX_COMMAND_ARGS = 4096
MAX_USER_CHARS = 256
# A trailing segment with these names would be routed as a sub-resource of the job, not the job.
_RESERVED_LAST_SEGMENTS = frozenset({"logs", "terminate"})


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid job id, else raise ValueError with the reason."""
    if not job_id or len(job_id) > MAX_JOB_ID_LEN:
        raise ValueError(f"job id must be 1..{MAX_JOB_ID_LEN} characters")
    if not _JOB_ID_RE.fullmatch(job_id):
        raise ValueError(
            "job id must be '/'-separated segments of letters, digits and ._@+=:,~- "
            "(no empty segments, no segment starting with '.')"
        )
    if job_id.rsplit("/", 1)[-1] in _RESERVED_LAST_SEGMENTS:
        raise ValueError("job id must not end with a 'logs' or 'terminate' segment")
    return job_id


class ErrorCode(StrEnum):
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.UNAVAILABLE: 503,
}


class ErrorBody(BaseModel):
    """Every error response of the API: a stable code and a human message."""

    code: ErrorCode
    message: str


class LaunchRequest(BaseModel):
    """The handoff: run ``command`` under ``job_id`` on ``backend_id`` (docs/DESIGN.md, "Launch")."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(max_length=MAX_JOB_ID_LEN, examples=["alice/train-llama"])
    command: list[str] = Field(min_length=1, max_length=MAX_COMMAND_ARGS)
    env: dict[str, str] = Field(default_factory=dict)
    device: DeviceRequest = DeviceRequest()
    band: Band = Band.INTERACTIVE
    user: str = Field(min_length=1, max_length=MAX_USER_CHARS)
    # Cluster id handing the job in; must equal the signed token's issuer.
    requester: str = Field(min_length=1, max_length=128)
    # Minted once per job incarnation: the same nonce again is a replay, a new one a new run.
    nonce: str = Field(min_length=1, max_length=256)
    backend_id: str = Field(min_length=1, max_length=256)
    timeout_s: float | None = Field(default=None, gt=0, le=365 * 24 * 3600)
    # The job's workspace, uploaded beforehand (PUT /v1/bundles/{sha256}); the command runs in it.
    bundle: BundleRef | None = None
    # How many earlier attempts of this job were preempted or lost (home's count against
    # --max-retries-preemption): a backend preempts such a job after the others of its band
    # (docs/DESIGN.md, "Preemption"). Left out of the body when 0, so a controller that predates
    # the field still takes a first attempt.
    preemptions: int = Field(default=0, ge=0, le=1000)

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, value: str) -> str:
        return validate_job_id(value)

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value[0]:
            raise ValueError("command[0] (the program) must not be empty")
        if any("\x00" in arg for arg in value):
            raise ValueError("command arguments must not contain NUL characters")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not key or "=" in key or "\x00" in key or "\x00" in val:
                raise ValueError(f"invalid environment variable name or value for {key!r}")
        return value


class ControllerJobState(StrEnum):
    """A job as the cluster running it reports it (the home side mirrors it with
    ``iris.jobs.mirrored_state``; docs/DESIGN.md, "The three vocabularies")."""

    # Accepted, waiting for its backend's devices (FIFO by band, then arrival).
    PENDING = "PENDING"
    # Its processes (or Ray job) are running.
    RUNNING = "RUNNING"
    # Every replica exited 0.
    SUCCEEDED = "SUCCEEDED"
    # A replica exited non-zero (the first failure's code), timed out, or Ray failed it.
    FAILED = "FAILED"
    # Terminated on request (or stopped in Ray).
    KILLED = "KILLED"
    # The controller lost track of the job's processes (e.g. they died with the controller): its
    # outcome is unknown.
    WORKER_FAILED = "WORKER_FAILED"
    # Stopped by its backend to make room for a job of a higher band (docs/DESIGN.md, "Preemption"):
    # SIGTERM, a grace period, SIGKILL. Its error says "preempted by <job id> at <time>".
    PREEMPTED = "PREEMPTED"

    @property
    def terminal(self) -> bool:
        return self not in (ControllerJobState.PENDING, ControllerJobState.RUNNING)


# The error of a job its --timeout ended (FAILED): the home side never retries it.
TIMED_OUT = "timed out"


def preempted_note(by_job_id: str, at_ms: int) -> str:
    """The error of a PREEMPTED job: who preempted it and when (UTC)."""
    at = datetime.fromtimestamp(at_ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"preempted by {by_job_id} at {at[:-4]}Z"


class TaskStatus(BaseModel):
    """One replica process of a job."""

    index: int
    state: ControllerJobState
    exit_code: int | None = None
    # Device slot indices this replica holds (empty for CPU jobs).
    slots: list[int] = Field(default_factory=list)


class JobStatus(BaseModel):
    job_id: str
    state: ControllerJobState
    backend_id: str
    exit_code: int | None = None
    error: str | None = None
    created_ms: int
    started_ms: int | None = None
    finished_ms: int | None = None
    band: Band
    user: str
    requester: str
    nonce: str
    # How many times this job id has been launched (a new nonce after a finished run counts again).
    attempts: int = 1
    tasks: list[TaskStatus] = Field(default_factory=list)
    # The record's place in the controller's change feed (docs/DESIGN.md, "The change feed"): the
    # feed's epoch (one per controller start) and the version of the record's latest change. Within
    # one epoch a higher version is newer; "" and 0 from a controller without a feed.
    epoch: str = ""
    version: int = 0

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class JobList(BaseModel):
    """One page of the controller's jobs, in the order they were launched."""

    jobs: list[JobStatus]
    # The ``after`` of the next page; None on the last page.
    next_after: int | None = None
    # The change feed's cursor when the listing began: a reader that resyncs by listing every page
    # continues the feed from here and misses no change made meanwhile.
    cursor: str | None = None


class ChangeList(BaseModel):
    """The answer of ``GET /v1/changes`` (docs/DESIGN.md, "The change feed")."""

    # Continue from here (the next request's ``since``).
    cursor: str
    # The ``since`` cursor cannot be answered exactly (another controller start, or too old): list
    # every job (``GET /v1/jobs``, paginated) and continue from the listing's ``cursor``.
    resync: bool = False
    # More changes are waiting: ask again at once.
    more: bool = False
    # Each job that changed after ``since``, once, as it is now (oldest change first).
    jobs: list[JobStatus] = Field(default_factory=list)
    # Jobs removed since (retention): the reader forgets them.
    removed: list[str] = Field(default_factory=list)


class LogChunk(BaseModel):
    """Bytes ``[offset, next_offset)`` of the job's log, decoded as UTF-8.

    ``eof`` is true when the job is terminal and everything was read: a reader stops there.
    """

    data: str
    offset: int
    next_offset: int
    eof: bool


class BackendsResponse(BaseModel):
    cluster: str
    backends: list[BackendReport]


class HealthResponse(BaseModel):
    status: str = "ok"
    cluster: str
