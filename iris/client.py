"""The Python SDK: submit, cancel, describe, list, wait and read logs of federated jobs.

``AsyncIrisClient`` is the asyncio API; ``IrisClient`` wraps it for plain scripts::

    from iris.client import IrisClient

    client = IrisClient()
    job_id = client.submit(["python", "train.py"], device_type="h100", gpu_count=8)
    print(client.wait(job_id).state)
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import contextlib
import gc
import getpass
import math
import os
import re
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import BaseModel
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.errordetails.v1 import WorkflowNotReadyFailure
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import FailureError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.workflow import UpdateMethodMultiParam

from iris import contract
from iris.bundle import Bundle, BundleError, BundleRef, contains, home_key, pack, store_at_home
from iris.config import ConfigError, FederationConfig, load_config
from iris.contract import (
    JOB_WORKFLOW,
    SA_BAND,
    SA_DEVICE_VARIANT,
    SA_PEER,
    SA_REASON,
    SA_STATE,
    SA_SUBMITTER,
    job_workflow_id,
    manager_workflow_id,
)
from iris.controller.models import MAX_COMMAND_ARGS, MAX_USER_CHARS, LogChunk, validate_job_id
from iris.inquiry import MAX_POSITION_IDS, DryRunRequest, PositionsAnswer, PositionsRequest
from iris.jobs import (
    ARTIFACT_RE,
    CONTROL_RE,
    ENV_KEY_RE,
    JOB_NAME_RE,
    MAX_ATTRIBUTE_CHARS,
    MAX_COMMAND_BYTES,
    MAX_ENV_BYTES,
    MAX_RETRIES,
    MAX_TIMEOUT_S,
    CancelOutcome,
    CancelRequest,
    JobSpec,
    JobState,
    JobStatus,
    ReplayRequest,
    log_key,
    start_memo,
    start_search_attributes,
    user_prefix,
)
from iris.logrelay import LogRelay, RelayedChunk
from iris.objectstore import StoreError, open_store
from iris.policy import classify, device_request
from iris.policy.models import Band, Constraint, Disposition, Op
from iris.policy.queue import DryRun, QueuePosition
from iris.policy.reasons import ReasonCode
from iris.temporal import connect
from iris.userauth import Action, AuthError, Signer, audience

# The workflows (and the activities they import) load only for the calls that message a job's
# workflow or list the peers: listing jobs and reading queue positions need the Temporal client
# alone, so `iris job list` starts without them (tests/test_cli_imports.py).
if TYPE_CHECKING:
    from iris.reports import FederationView
    from workflows.job import JobWorkflow

T = TypeVar("T")
_A = TypeVar("_A")

# A REJECTED job whose name its owner may take again: the workflow refused the submission itself.
_REFUSALS = frozenset({ReasonCode.SubmissionRefused, ReasonCode.InvalidSubmission})
# The submission's limits live with the spec (iris/jobs.py), which the workflow checks too.
_NAME_RE = JOB_NAME_RE
_ENV_KEY_RE = ENV_KEY_RE
# An Update whose workflow task the server failed (e.g. a signal landed while the task completed
# the run: UNHANDLED_COMMAND) was never accepted; it is sent again, with the same update id.
UPDATE_ATTEMPTS = 6
UPDATE_RETRY_FIRST_S = 0.1
UPDATE_RETRY_MAX_S = 2.0
_ARTIFACT_RE = ARTIFACT_RE
_CONTROL_RE = CONTROL_RE
# A reader following a running job's log asks its workflow to relay it this often (for twice as long).
_WANT_LOGS_EVERY_S = 60.0
# An inquiry that reached the manager as its run was closing (continued as new) is sent again to the
# next run this many times.
INQUIRY_ATTEMPTS = 4


class IrisError(Exception):
    """Base of every SDK error; ``str(err)`` is one line a user can act on."""

    exit_code = 1


class InvalidJob(IrisError):
    exit_code = 2


class JobRejected(IrisError):
    """No cluster in the federation can ever run this job (docs/DESIGN.md, "Classification": reject)."""

    exit_code = 2


class JobAlreadyExists(IrisError):
    exit_code = 2


class JobNotFound(IrisError):
    exit_code = 3


class Unavailable(IrisError):
    exit_code = 4


class JobSummary(BaseModel):
    """One row of ``list``: what the Temporal visibility store knows without asking the worker."""

    job_id: str
    state: str
    peer: str | None
    band: str | None
    device: str | None
    user: str | None
    started_at: datetime | None
    closed: bool
    reason: str = ""
    # The reason's stable code (the IrisReason search attribute, iris/policy/reasons.py).
    reason_code: str | None = None
    # A queued job's place among the jobs competing for its shape (``with_positions``).
    position: QueuePosition | None = None


def current_user() -> str:
    return os.environ.get("IRIS_USER") or getpass.getuser()


_user_prefix = user_prefix


def _default_name(command: Sequence[str]) -> str:
    base = Path(command[0]).name if command else "job"
    if base.startswith("python") and len(command) > 1 and not command[1].startswith("-"):
        base = Path(command[1]).stem
    base = re.sub(r"[^A-Za-z0-9._-]", "-", base).strip("-.") or "job"
    return f"{base[:40]}-{secrets.token_hex(3)}"


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def build_spec(
    command: Sequence[str],
    *,
    name: str | None = None,
    user: str | None = None,
    device_type: str | None = None,
    device_variant: str | None = None,
    gpu_count: int = 0,
    replicas: int = 1,
    priority: str | Band = Band.INTERACTIVE,
    target_cluster: str | None = None,
    region: str | None = None,
    zone: str | None = None,
    preemptible: bool | None = None,
    artifacts: Sequence[str] = (),
    env: dict[str, str] | None = None,
    scheduling_timeout_s: float | None = None,
    max_retries_failure: int = 0,
    max_retries_preemption: int = 1,
    timeout_s: float | None = None,
    bundle: BundleRef | None = None,
) -> JobSpec:
    """Validate user input into a JobSpec; raise InvalidJob with a one-line message.

    ``max_retries_failure``: how many more attempts after one that failed (a replica exited
    non-zero); ``max_retries_preemption``: after one its cluster lost (the task died with its
    worker, WORKER_FAILED, the cluster forgot it, or it was silent past peer_lost_after_s);
    ``timeout_s``: a wall-clock limit on each attempt's running, after which its cluster kills it
    and the job ends FAILED ("timeout"), never retried (docs/DESIGN.md, "Attempts").

    A command whose first argument is a Python file (``train.py``) runs as ``python train.py``: the
    ``python`` found first on the PATH of the cluster that runs the job (its controller's
    environment, e.g. its virtualenv). Name another interpreter to choose it (``python3.12
    train.py``).
    """
    from iris.controller.artifacts import MAX_ARTIFACTS, MAX_URI_CHARS

    if isinstance(command, str | bytes) or not all(isinstance(a, str) for a in command):
        raise InvalidJob("command must be a list of strings, e.g. ['python', 'train.py']")
    cmd = list(command)
    if not cmd or not cmd[0].strip():
        raise InvalidJob("no command given: put it after `--`, e.g. `iris job run -- python train.py`")
    if len(cmd) > MAX_COMMAND_ARGS:
        raise InvalidJob(f"command has more than {MAX_COMMAND_ARGS} arguments")
    if sum(len(a.encode("utf-8", "surrogatepass")) for a in cmd) > MAX_COMMAND_BYTES:
        raise InvalidJob(f"command is larger than {MAX_COMMAND_BYTES} bytes")
    for arg in cmd:
        if "\x00" in arg:
            raise InvalidJob("command contains a NUL byte")
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJob("command is not valid UTF-8") from None
    who = user or current_user()
    if len(who) > MAX_USER_CHARS or _CONTROL_RE.search(who) or not _is_utf8(who):
        raise InvalidJob(
            f"invalid user {who[:64]!r}: at most {MAX_USER_CHARS} UTF-8 characters, no control ones"
        )
    job_name = name or _default_name(cmd)
    if not _NAME_RE.fullmatch(job_name):
        raise InvalidJob(f"invalid job name {job_name[:64]!r}: use 1-63 letters, digits, '.', '_' or '-'")
    for flag, count in (("--gpu-count", gpu_count), ("--replicas", replicas)):
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidJob(f"{flag} must be a whole number, got {count!r:.40}")
    try:
        device = device_request(device_type, device_variant, gpu_count, replicas)
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None
    if not isinstance(priority, Band | str):
        raise InvalidJob(
            f"unknown priority band {priority!r:.40} (expected production, interactive or batch)"
        )
    try:
        band = priority if isinstance(priority, Band) else Band.parse(priority)
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None
    if target_cluster is not None and not target_cluster.strip():
        raise InvalidJob("--target-cluster must not be empty")
    constraints: list[Constraint] = []
    for key, value in (("region", region), ("zone", zone)):
        if value is not None:
            if not value.strip():
                raise InvalidJob(f"--{key} must not be empty")
            if len(value) > MAX_ATTRIBUTE_CHARS or _CONTROL_RE.search(value) or not _is_utf8(value):
                raise InvalidJob(
                    f"invalid --{key} {value[:64]!r}: at most {MAX_ATTRIBUTE_CHARS} printable characters"
                )
            constraints.append(Constraint(key=key, op=Op.EQ, values=(value.strip().lower(),)))
    if preemptible is not None:
        constraints.append(Constraint(key="preemptible", op=Op.EQ, values=(str(preemptible).lower(),)))
    if isinstance(artifacts, str) or len(artifacts) > MAX_ARTIFACTS:
        raise InvalidJob(f"artifacts must be a list of at most {MAX_ARTIFACTS} URIs")
    for uri in artifacts:
        if not isinstance(uri, str) or len(uri) > MAX_URI_CHARS or not _ARTIFACT_RE.fullmatch(uri):
            raise InvalidJob(
                f"invalid artifact URI {str(uri)[:80]!r}: expected gs://bucket/path or "
                f"s3://bucket/path, at most {MAX_URI_CHARS} characters"
            )
    job_env = dict(env or {})
    for key, value in job_env.items():
        if not isinstance(key, str) or not _ENV_KEY_RE.fullmatch(key):
            raise InvalidJob(f"invalid environment variable name {str(key)[:64]!r}")
        if not isinstance(value, str) or "\x00" in value or not _is_utf8(value):
            raise InvalidJob(f"environment variable {key} must be a UTF-8 string without NUL bytes")
    if sum(len(k) + len(v) for k, v in job_env.items()) > MAX_ENV_BYTES:
        raise InvalidJob(f"environment is larger than {MAX_ENV_BYTES} bytes")
    if scheduling_timeout_s is not None and (
        isinstance(scheduling_timeout_s, bool)
        or not isinstance(scheduling_timeout_s, int | float)
        or not (0 < scheduling_timeout_s <= 30 * 86400)
    ):
        raise InvalidJob("scheduling timeout must be between 1s and 30 days")
    for flag, retries in (
        ("--max-retries-failure", max_retries_failure),
        ("--max-retries-preemption", max_retries_preemption),
    ):
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise InvalidJob(f"{flag} must be a whole number from 0 to {MAX_RETRIES}, got {retries!r:.40}")
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not (0 < timeout_s <= MAX_TIMEOUT_S)
    ):
        finite = isinstance(timeout_s, int | float) and math.isfinite(timeout_s)
        got = f"{timeout_s:g}s" if finite else f"{timeout_s!r:.40}"
        days = f"{MAX_TIMEOUT_S / 86400:g} days"
        raise InvalidJob(f"--timeout must be more than 0s and at most {days}, got {got}")
    job_id = f"{_user_prefix(who)}/{job_name}"
    try:
        validate_job_id(job_id)
    except ValueError as exc:
        raise InvalidJob(f"invalid job id {job_id[:80]!r}: {exc}") from None
    if contract.is_internal_workflow_id(job_workflow_id(job_id)):
        raise InvalidJob(
            f"invalid job id {job_id[:80]!r}: it is reserved for the federation's own workflows; "
            "choose another --job-name"
        )
    spec = JobSpec(
        job_id=job_id,
        name=job_name,
        user=who,
        command=cmd,
        env=job_env,
        device=device,
        constraints=tuple(constraints),
        band=band,
        target_cluster=target_cluster.strip().lower() if target_cluster else None,
        artifacts=list(artifacts),
        scheduling_timeout_s=scheduling_timeout_s,
        submit_ms=int(time.time() * 1000),
        bundle=bundle,
        max_retries_failure=max_retries_failure,
        max_retries_preemption=max_retries_preemption,
        timeout_s=None if timeout_s is None else float(timeout_s),
    )
    try:
        # What the workflow checks in its first task (docs/DESIGN.md, "User → home"): refused here
        # rather than started and REJECTED.
        spec.check()
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None
    return spec


def python_command(command: Sequence[str]) -> list[str]:
    """``["train.py", ...]`` → ``["python", "train.py", ...]``; anything else unchanged."""
    cmd = list(command)
    if cmd and isinstance(cmd[0], str) and cmd[0].endswith(".py") and not cmd[0].startswith("-"):
        return ["python", *cmd]
    return cmd


def _script(command: Sequence[str]) -> str | None:
    """The Python file a command runs, if it names one (``python train.py`` or ``train.py``)."""
    if command and command[0].endswith(".py"):
        return command[0]
    if len(command) > 1 and Path(command[0]).name.startswith("python") and command[1].endswith(".py"):
        return command[1]
    return None


def pack_workspace(workdir: str | os.PathLike[str]) -> Bundle | None:
    """The workspace bundle of ``workdir`` (None if nothing in it is shipped); InvalidJob if it
    cannot be bundled, with the one line that says why (e.g. the largest entries over the limit)."""
    try:
        return pack(workdir)
    except BundleError as exc:
        raise InvalidJob(str(exc)) from None


def prepare_submission(
    command: Sequence[str], *, workdir: str | os.PathLike[str] | None = ".", **kw: Any
) -> tuple[JobSpec, Bundle | None]:
    """Validate a submission and bundle its workspace (``workdir``; None ships nothing).

    A relative Python file the command runs must be in the bundle: a job that cannot find its own
    script is refused here rather than failing on a peer minutes later.
    """
    bundle = pack_workspace(workdir) if workdir is not None else None
    cmd = python_command(command) if isinstance(command, list | tuple) else command
    spec = build_spec(cmd, bundle=bundle.ref if bundle is not None else None, **kw)
    script = _script(spec.command)
    if workdir is not None and script is not None and not Path(script).is_absolute():
        shipped = bundle is not None and contains(bundle, script)
        if not shipped:
            raise InvalidJob(
                f"{script} is not in the workspace {Path(workdir).resolve()} (missing, or left out by "
                ".gitignore/.irisignore): nothing was started"
            )
    return spec, bundle


def workflow_not_ready(exc: RPCError) -> bool:
    """The server dropped an Update because the workflow task carrying it failed (not durable)."""
    if exc.status != RPCStatusCode.FAILED_PRECONDITION:
        return False
    details = exc.grpc_status.details
    return any(d.Is(WorkflowNotReadyFailure.DESCRIPTOR) for d in details)


async def execute_update(
    handle: WorkflowHandle[Any, Any],
    update: UpdateMethodMultiParam[[Any, _A], Any] | str,
    arg: _A,
    result_type: type[T],
) -> T:
    """``handle.execute_update``, sent again while the server answers that the workflow task that
    carried it failed: such an Update was never accepted, and its handler runs only once accepted.

    ``update`` is the workflow's method, or its name (iris/contract.py), whose answer is then
    decoded as ``result_type``."""
    name = update if isinstance(update, str) else getattr(update, "__name__", "update")
    update_id = f"{name}/{uuid.uuid4()}"
    delay = UPDATE_RETRY_FIRST_S
    attempt = 1
    while True:
        try:
            if isinstance(update, str):
                answer = await handle.execute_update(update, arg, id=update_id, result_type=result_type)
            else:
                answer = await handle.execute_update(update, arg, id=update_id)
            return cast(T, answer)
        except RPCError as exc:
            if attempt == UPDATE_ATTEMPTS or not workflow_not_ready(exc):
                raise
        await asyncio.sleep(delay)
        attempt += 1
        delay = min(delay * 2, UPDATE_RETRY_MAX_S)


def update_refusal(exc: WorkflowUpdateFailedError) -> str:
    """The one line an Update's refusal (its validator's, or its handler's error) says: the
    workflow's own message, without the failure's error type (``ValueError: ...``)."""
    cause = exc.cause
    text = cause.message if isinstance(cause, FailureError) else str(cause or exc)
    return " ".join(text.split()) or "the workflow refused the update"


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class AsyncIrisClient:
    """Asyncio SDK over a Temporal client and the federation config.

    Every submission, cancel and replay is signed with the user's key (docs/DESIGN.md, "User →
    home"): ``signer(principal)`` gives the Signer of a principal, by default the key at
    ``iris.userauth.user_key_path`` (``iris keys user`` creates it). A submission is signed as its
    spec's user; a cancel or replay as ``principal`` (default: ``IRIS_USER``, else the OS user).
    """

    def __init__(
        self,
        temporal: Client,
        config: FederationConfig,
        *,
        principal: str | None = None,
        signer: Callable[[str], Signer] | None = None,
    ) -> None:
        self.temporal = temporal
        self.config = config
        self.principal = principal or current_user()
        self._signer = signer or Signer
        self._relay: LogRelay | None = None

    def as_user(self, principal: str) -> AsyncIrisClient:
        """The same client, cancelling and replaying as ``principal`` (with that principal's key)."""
        return type(self)(self.temporal, self.config, principal=principal, signer=self._signer)

    def sign(self, action: Action, principal: str, job_id: str, request: BaseModel) -> str:
        """A signed statement over ``request``; InvalidJob (one line) if the key is unusable."""
        try:
            return self._signer(principal).sign(action, job_id, request, audience(self.config.home))
        except AuthError as exc:
            raise InvalidJob(str(exc)) from None

    @classmethod
    async def connect(cls, config: FederationConfig | str | Path | None = None) -> AsyncIrisClient:
        cfg = config if isinstance(config, FederationConfig) else load_config(config)
        try:
            temporal = await connect(cfg)
        except ConfigError as exc:
            raise InvalidJob(str(exc)) from None
        except RuntimeError as exc:
            raise Unavailable(f"cannot reach Temporal at {cfg.temporal.address}: {exc}") from None
        return cls(temporal, cfg)

    def _handle(self, job_id: str) -> WorkflowHandle[JobWorkflow, JobStatus]:
        from workflows.job import JobWorkflow

        return self.temporal.get_workflow_handle_for(JobWorkflow.run, job_workflow_id(job_id))

    async def precheck(self, spec: JobSpec) -> str:
        """Classify against the configured shapes; raise JobRejected if no cluster could ever host it.

        Needs no controller credentials: capacity and reachability are the workflow's business.
        """
        from iris.reports import config_view

        now_ms = int(time.time() * 1000)
        view = config_view(self.config, now_ms=now_ms)
        decision = classify(
            spec.shape(),
            home=view.home,
            reports=view.reports,
            now_ms=now_ms,
            stale_after_ms=view.stale_after_ms,
        )
        if decision.disposition is Disposition.REJECT:
            raise JobRejected(f"job rejected: {decision.reason}")
        return decision.reason

    async def store_bundle(self, ref: BundleRef, bundle: Bundle | None = None) -> bool:
        """Keep a workspace bundle in the home cluster's store (once per content); True if this
        call wrote it. Without the bytes, the store must already hold it."""
        home = self.config.home_cluster.object_store
        if home is None:
            raise InvalidJob(
                f"the home cluster {self.config.home} has no object store for workspace bundles; "
                "submit with --no-workdir"
            )
        store = open_store(home)
        try:
            if bundle is None:
                if not await asyncio.to_thread(store.exists, home_key(ref.sha256)):
                    raise InvalidJob(f"workspace bundle {ref.short} is not in the home cluster's store")
                return False
            return await asyncio.to_thread(store_at_home, store, bundle)
        except StoreError as exc:
            raise Unavailable(
                f"cannot store the workspace bundle in the home cluster's store: {exc}"
            ) from None

    async def submit_spec(self, spec: JobSpec, bundle: Bundle | None = None) -> str:
        """Start the job's workflow; its bundle (``spec.bundle``) is stored at home first."""
        from workflows.job import JobWorkflow

        await self.precheck(spec)
        if not spec.signature:
            signature = self.sign(Action.SUBMIT, spec.user, spec.job_id, spec)
            spec = spec.model_copy(update={"signature": signature})
        if spec.bundle is not None:
            await self.store_bundle(spec.bundle, bundle)
        try:
            await self.temporal.start_workflow(
                JobWorkflow.run,
                spec,
                id=job_workflow_id(spec.job_id),
                task_queue=self.config.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=start_search_attributes(spec),
                memo=start_memo(),
                static_summary=spec.summary(),
                static_details=f"command: {' '.join(spec.command)[:500]}",
            )
        except WorkflowAlreadyStartedError:
            await self._start_over_refused(spec)
        except RPCError as exc:
            raise Unavailable(f"cannot start job {spec.job_id}: {exc.message}") from None
        return spec.job_id

    async def _start_over_refused(self, spec: JobSpec) -> None:
        """The job's id is taken. A name held by a submission the workflow refused (REJECTED as
        SubmissionRefused or InvalidSubmission: a forged, unsigned or malformed start, perhaps
        someone else's) is the name's owner's again: the job starts over it. Any other run of it,
        running or ended (SUCCEEDED, FAILED, KILLED, …), keeps the name: JobAlreadyExists
        (docs/DESIGN.md, "User → home")."""
        from workflows.job import JobWorkflow

        taken = JobAlreadyExists(f"job {spec.job_id} already exists; choose another --job-name")
        handle = self._handle(spec.job_id)
        try:
            if (await handle.describe()).status != WorkflowExecutionStatus.COMPLETED:
                raise taken
            ended = await self._ended(handle)
        except RPCError as exc:
            raise Unavailable(f"cannot start job {spec.job_id}: {exc.message}") from None
        if ended is None or ended.state is not JobState.REJECTED or ended.reason_code not in _REFUSALS:
            raise taken
        try:
            await self.temporal.start_workflow(
                JobWorkflow.run,
                spec,
                id=job_workflow_id(spec.job_id),
                task_queue=self.config.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                # Only over a closed run; the check above said it was a refused one.
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                search_attributes=start_search_attributes(spec),
                memo=start_memo(),
                static_summary=spec.summary(),
                static_details=f"command: {' '.join(spec.command)[:500]}",
            )
        except WorkflowAlreadyStartedError:
            raise taken from None
        except RPCError as exc:
            raise Unavailable(f"cannot start job {spec.job_id}: {exc.message}") from None

    async def submit(
        self,
        command: Sequence[str] | None = None,
        *,
        script: str | None = None,
        workdir: str | os.PathLike[str] | None = ".",
        **kw: Any,
    ) -> str:
        """Submit a job; returns its id. ``script`` is shorthand for ``[script]`` (run with
        ``python``). The job runs in a copy of ``workdir`` (default: the current directory; None
        ships nothing), bundled as ``iris job run`` does; ``kw`` are ``build_spec``'s options (e.g.
        ``gpu_count``, ``max_retries_failure``, ``max_retries_preemption``, ``timeout_s``)."""
        if command is None and script is not None:
            command = [script]
        spec, bundle = await asyncio.to_thread(prepare_submission, command or [], workdir=workdir, **kw)
        return await self.submit_spec(spec, bundle)

    def resolve(self, job_id: str) -> str:
        """The job id a name stands for: a bare name (no ``/``) is the current user's job,
        ``<user>/<name>``, as ``build_spec`` names it (kubectl resolves a name in the current
        namespace the same way); a full id is kept as given."""
        if "/" in job_id or not job_id:
            return job_id
        return f"{_user_prefix(self.principal)}/{job_id}"

    async def describe(self, job_id: str) -> JobStatus:
        """The job's status, from its workflow; ``job_id`` may be a bare name (see ``resolve``).

        A job whose workflow has closed is read from its result, which Temporal keeps: a query of a
        closed workflow would make a worker replay its whole history (docs/DESIGN.md, "Reading a
        job's status"). A running one answers the status query from its worker's cache."""
        from workflows.job import JobWorkflow

        job_id = self.resolve(job_id)
        handle = self._handle(job_id)
        try:
            desc = await handle.describe()
            if desc.status == WorkflowExecutionStatus.COMPLETED:
                ended = await self._ended(handle)
                if ended is not None:
                    return ended
            return await handle.query(JobWorkflow.status)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise JobNotFound(f"job {job_id} not found") from None
            raise Unavailable(f"cannot describe {job_id}: {exc.message}") from None

    @staticmethod
    async def _ended(handle: WorkflowHandle[JobWorkflow, JobStatus]) -> JobStatus | None:
        """The status a completed run returned (following continue-as-new to the last run); None
        if the chain did not end with a status (a run failed, was terminated or timed out)."""
        try:
            return await handle.result()
        except WorkflowFailureError:
            return None

    async def cancel(self, job_id: str, reason: str = "Cancelled by user") -> bool:
        """Fire-and-forget cancel (a signal): True if it was sent to the job, False if the job had
        already ended (nothing to cancel; ``describe`` says how it ended). JobNotFound only for a
        job that never existed. ``cancel_and_report`` says whether a cancel won the race."""
        from workflows.job import JobWorkflow

        job_id = self.resolve(job_id)
        request = self._signed_cancel(job_id, reason)
        try:
            await self._handle(job_id).signal(JobWorkflow.cancel, request)
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise Unavailable(f"cannot cancel {job_id}: {exc.message}") from None
            # A signal to a closed workflow is NOT_FOUND too: the job ended, or never was.
            await self.describe(job_id)  # JobNotFound if it never was
            return False
        return True

    async def cancel_and_report(self, job_id: str, reason: str = "Cancelled by user") -> CancelOutcome:
        """Cancel and learn whether the cancel won the race against the handoff (an Update)."""
        from workflows.job import JobWorkflow

        job_id = self.resolve(job_id)
        request = self._signed_cancel(job_id, reason)
        try:
            return await execute_update(self._handle(job_id), JobWorkflow.cancel_job, request, CancelOutcome)
        except WorkflowUpdateFailedError as exc:
            raise InvalidJob(f"cannot cancel {job_id}: {update_refusal(exc)}") from None
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return (await self.describe(job_id)).ended_cancel_outcome()
            raise Unavailable(f"cannot cancel {job_id}: {exc.message}") from None

    def _signed_cancel(self, job_id: str, reason: str) -> CancelRequest:
        request = CancelRequest(reason=reason)
        signature = self.sign(Action.CANCEL, self.principal, job_id, request)
        return request.model_copy(update={"signature": signature})

    async def peers(self) -> FederationView:
        """Every cluster's live report (reachability, backends, capacity), polled by a worker."""
        from workflows.peers import ListPeersWorkflow

        try:
            view: FederationView = await self.temporal.execute_workflow(
                ListPeersWorkflow.run,
                id=contract.list_peers_workflow_id(str(uuid.uuid4())),
                task_queue=self.config.temporal.task_queue,
                static_summary="iris peers",
                execution_timeout=timedelta(seconds=60),
                request_eager_start=True,
            )
        except RPCError as exc:
            raise Unavailable(f"cannot list peers: {exc.message}") from None
        except WorkflowFailureError as exc:
            raise Unavailable(f"cannot list peers: {exc.cause or exc}") from None
        return view

    async def replay_handoff(
        self,
        job_id: str,
        *,
        peer: str | None = None,
        requeue: bool = False,
        reason: str = "operator replay",
        force: bool = False,
    ) -> str:
        """Operator: re-run the artifact check and handoff of a job whose handoff failed
        (docs/DESIGN.md, "Replaying a failed handoff").

        A job parked in HANDOFF_FAILED is replayed in place (same cluster, ``peer``, or back to the
        queue). A closed HANDOFF_REJECTED run is reset to just before its handoff, which then runs
        again, recorded in the job's history. Anything else is refused with the reason.

        A replay elsewhere (``peer`` or ``requeue``) is refused while the cluster of the last launch
        may still run the job (its answer never came) unless ``force``: that attempt is then fenced,
        i.e. terminated there as soon as the cluster answers; until then the job may run twice.
        """
        from workflows.job import JobWorkflow

        if peer is not None and requeue:
            raise InvalidJob("choose --peer or --requeue, not both")
        job_id = self.resolve(job_id)
        handle = self._handle(job_id)
        try:
            desc = await handle.describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise JobNotFound(f"job {job_id} not found") from None
            raise Unavailable(f"cannot reach Temporal: {exc.message}") from None
        status = await self.describe(job_id)
        if desc.status == WorkflowExecutionStatus.RUNNING and status.terminal:
            # Ended a moment ago; its last bookkeeping step is finishing: let the run close first.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.result(), timeout=30)
            desc = await handle.describe()
        if desc.status == WorkflowExecutionStatus.RUNNING:
            if status.state is not JobState.HANDOFF_FAILED:
                raise InvalidJob(
                    f"job {job_id} is {status.state.value}: replay-handoff applies to jobs parked in "
                    "HANDOFF_FAILED or closed as HANDOFF_REJECTED"
                )
            request = ReplayRequest(peer=peer, requeue=requeue, reason=reason, force=force)
            signature = self.sign(Action.REPLAY, self.principal, job_id, request)
            try:
                message = await execute_update(
                    handle,
                    JobWorkflow.replay_handoff,
                    request.model_copy(update={"signature": signature}),
                    str,
                )
            except WorkflowUpdateFailedError as exc:
                raise InvalidJob(update_refusal(exc)) from None
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    raise InvalidJob(f"job {job_id} ended while the replay was being sent") from None
                raise Unavailable(f"cannot replay {job_id}: {exc.message}") from None
            return message
        if status.state is not JobState.HANDOFF_REJECTED:
            raise InvalidJob(
                f"job {job_id} ended as {status.state.value}: replay-handoff applies to jobs parked in "
                "HANDOFF_FAILED or closed as HANDOFF_REJECTED"
            )
        if peer is not None or requeue:
            where = status.cluster or "the cluster that refused it"
            raise InvalidJob(f"job {job_id} is closed: it can only be replayed to {where}, which refused it")
        reset_point = None
        async for event in handle.fetch_history_events():
            attrs = event.activity_task_scheduled_event_attributes
            if (
                event.HasField("activity_task_scheduled_event_attributes")
                and attrs.activity_type.name == contract.LAUNCH_JOB
            ):
                reset_point = attrs.workflow_task_completed_event_id
        if reset_point is None:
            raise InvalidJob(f"job {job_id} has no handoff in its history to replay")
        resp = await self.temporal.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=self.temporal.namespace,
                workflow_execution=WorkflowExecution(workflow_id=job_workflow_id(job_id), run_id=desc.run_id),
                reason=f"iris ops replay-handoff: {reason}",
                workflow_task_finish_event_id=reset_point,
                request_id=str(uuid.uuid4()),
            )
        )
        return f"reset to event {reset_point}, before the handoff to {status.cluster}; new run {resp.run_id}"

    async def list(
        self,
        *,
        state: str | None = None,
        peer: str | None = None,
        user: str | None = None,
        limit: int = 1000,
        since_s: float | None = None,
    ) -> list[JobSummary]:
        """Jobs, newest first, from the visibility store: at most ``limit``, only those started
        within the last ``since_s`` seconds if given."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidJob(f"--limit must be a whole number from 1, got {limit!r:.40}")
        query = [f"WorkflowType = {_quote(JOB_WORKFLOW)}"]
        if since_s is not None:
            if isinstance(since_s, bool) or not isinstance(since_s, int | float) or not since_s > 0:
                raise InvalidJob(f"--since must be a duration above 0s, got {since_s!r:.40}")
            since = datetime.now(UTC) - timedelta(seconds=min(since_s, 100 * 365 * 86400))
            query.append(f"StartTime > {_quote(since.isoformat().replace('+00:00', 'Z'))}")
        if state:
            query.append(f"{SA_STATE.name} = {_quote(state.upper())}")
        if peer:
            query.append(f"{SA_PEER.name} = {_quote(peer)}")
        if user:
            query.append(f"{SA_SUBMITTER.name} = {_quote(user)}")
        rows: list[JobSummary] = []
        try:
            async for wf in self.temporal.list_workflows(" AND ".join(query), limit=limit):
                sa = wf.typed_search_attributes
                variant = sa.get(SA_DEVICE_VARIANT)
                rows.append(
                    JobSummary(
                        job_id=wf.id,
                        state=sa.get(SA_STATE) or "UNKNOWN",
                        peer=sa.get(SA_PEER),
                        band=sa.get(SA_BAND),
                        device=variant,
                        user=sa.get(SA_SUBMITTER),
                        started_at=wf.start_time,
                        closed=wf.status is not None and wf.status != WorkflowExecutionStatus.RUNNING,
                        reason=str((await wf.memo()).get(contract.MEMO_REASON, "")),
                        reason_code=sa.get(SA_REASON),
                    )
                )
        except RPCError as exc:
            raise Unavailable(f"cannot list jobs: {exc.message}") from None
        return rows

    def _manager(self) -> WorkflowHandle[Any, Any]:
        return self.temporal.get_workflow_handle(manager_workflow_id(self.config.temporal.task_queue))

    async def _inquire(self, update: str, arg: _A, result_type: type[T]) -> T:
        """Ask the placement manager (docs/DESIGN.md, "Queue position and dry-run"); Unavailable
        with the reason if it cannot answer. Sent to its latest run: one that closed as the question
        arrived (it continued as new) is followed by the next.

        By the Update's name (iris/contract.py), not the PlacementManager's method: `iris job list`
        asks for positions without loading the workflows."""
        what = "read the queue" if result_type is PositionsAnswer else "dry-run the job"
        for attempt in range(1, INQUIRY_ATTEMPTS + 1):
            try:
                return await execute_update(self._manager(), update, arg, result_type)
            except WorkflowUpdateFailedError as exc:
                raise Unavailable(
                    f"cannot {what}: the placement manager refused: {update_refusal(exc)}"
                ) from None
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND or attempt == INQUIRY_ATTEMPTS:
                    raise Unavailable(
                        f"cannot {what}: the placement manager does not answer ({exc.message}); "
                        "is a worker running?"
                    ) from None
            await asyncio.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    async def queue_answer(self, job_ids: Sequence[str]) -> PositionsAnswer:
        """The queue positions of ``job_ids`` (see :meth:`queue_positions`) and what each user
        holding devices holds (``users``), in one question per page of ids (one if none)."""
        ids = sorted({self.resolve(j) for j in job_ids})
        merged = PositionsAnswer()
        for start in range(0, max(len(ids), 1), MAX_POSITION_IDS):
            request = PositionsRequest(job_ids=ids[start : start + MAX_POSITION_IDS])
            answer = await self._inquire(contract.QUEUE_POSITIONS, request, PositionsAnswer)
            merged.positions.update(answer.positions)
            merged.queued, merged.at_ms, merged.users = answer.queued, answer.at_ms, answer.users
        return merged

    async def queue_positions(self, job_ids: Sequence[str]) -> dict[str, QueuePosition]:
        """Each of ``job_ids`` still queued, with its position among the jobs competing for its
        shape as the planner orders them; a job not queued is left out. Bare names resolve."""
        if not job_ids:
            return {}
        return (await self.queue_answer(job_ids)).positions

    async def position(self, job_id: str) -> QueuePosition | None:
        """The job's queue position, None unless it is queued."""
        job_id = self.resolve(job_id)
        return (await self.queue_positions([job_id])).get(job_id)

    async def with_positions(self, rows: Sequence[JobSummary]) -> builtins.list[JobSummary]:
        """``rows`` with the queue position of each queued one filled in (one question)."""
        queued = [r.job_id for r in rows if not r.closed and r.state == JobState.QUEUED_HANDOFF.value]
        if not queued:
            return [*rows]
        positions = await self.queue_positions(queued)
        return [r.model_copy(update={"position": positions.get(r.job_id)}) for r in rows]

    async def dry_run(self, spec: JobSpec) -> DryRun:
        """What the job would do if submitted now, judged at home on the stored reports, ledger
        and queue (``iris job run --dry-run``): its classification, the queue position it would
        take and each peer's verdict. Nothing is started and nothing stored."""
        request = DryRunRequest(job=spec.shape())
        return await self._inquire(contract.DRY_RUN, request, DryRun)

    async def wait(
        self,
        job_id: str,
        *,
        on_change: Callable[[JobStatus], Awaitable[None] | None] | None = None,
        poll_interval_s: float = 0.25,
        timeout_s: float | None = None,
    ) -> JobStatus:
        """Wait until the job is terminal, calling ``on_change`` on each state or reason change
        (polled every ``poll_interval_s``). Without ``on_change`` it waits for the workflow's result
        by Temporal's long poll, which costs the workers nothing."""
        job_id = self.resolve(job_id)
        if on_change is None:
            return await self._wait_for_result(job_id, timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: tuple[JobState, str] | None = None
        while True:
            status = await self.describe(job_id)
            key = (status.state, status.reason)
            if key != last:
                last = key
                res = on_change(status)
                if asyncio.iscoroutine(res):
                    await res
            if status.terminal:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {status.state.value} after {timeout_s}s")
            await asyncio.sleep(poll_interval_s)

    async def _wait_for_result(self, job_id: str, timeout_s: float | None) -> JobStatus:
        """Wait for the workflow's result by Temporal's long poll of its history: no query, so no
        worker does any work for a waiter (docs/DESIGN.md, "Reading a job's status")."""
        handle = self._handle(job_id)
        try:
            return await asyncio.wait_for(handle.result(), timeout=timeout_s)
        except TimeoutError:
            status = await self.describe(job_id)
            if status.terminal:
                return status
            raise TimeoutError(f"job {job_id} still {status.state.value} after {timeout_s}s") from None
        except WorkflowFailureError:
            # The workflow itself failed or was terminated (an operator's act): its last status.
            return await self.describe(job_id)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise JobNotFound(f"job {job_id} not found") from None
            raise Unavailable(f"cannot wait for {job_id}: {exc.message}") from None

    async def _read_relay(self, job_id: str, attempt: int, offset: int) -> RelayedChunk:
        if self._relay is None:
            self._relay = LogRelay(self.config)
        try:
            return await asyncio.to_thread(self._relay.read, log_key(job_id, attempt), offset)
        except Exception as exc:  # the object store's own errors vary by client library
            raise Unavailable(f"cannot read logs of {job_id}: {exc}") from None

    async def logs(self, job_id: str, offset: int = 0, *, attempt: int | None = None) -> LogChunk:
        """The output of one attempt of the job (default: the latest) from ``offset`` on, from the
        home cluster's relayed copy (docs/DESIGN.md, "Logs"); offsets are per attempt.

        Works wherever the job ran, and after the peer has forgotten it; ``eof`` once the attempt
        (or the job) has ended and everything was read.
        """
        job_id = self.resolve(job_id)
        status = await self.describe(job_id)
        number = attempt_number(status, attempt)
        chunk = await self._read_relay(job_id, number, offset)
        return LogChunk(
            data=chunk.data,
            offset=offset,
            next_offset=chunk.next_offset,
            eof=attempt_ended(status, number) and not chunk.data,
        )

    async def _want_logs(self, job_id: str, seconds: float = 2 * _WANT_LOGS_EVERY_S) -> None:
        """Ask the job's workflow to relay its running attempt's log every second for ``seconds``
        (docs/DESIGN.md, "Logs"); a job that has ended, or cannot be reached now, is read as is."""
        from workflows.job import JobWorkflow

        until_ms = int((time.time() + seconds) * 1000)
        with contextlib.suppress(RPCError):
            await self._handle(job_id).signal(JobWorkflow.want_logs, until_ms)

    async def refresh_logs(self, job_id: str, *, settle_s: float = 2.0) -> None:
        """Have a running job's relayed log brought up to date before it is read: while it runs, the
        home copy is otherwise refreshed only every few minutes (docs/DESIGN.md, "Logs"). Waits
        ``settle_s`` for the copy."""
        job_id = self.resolve(job_id)
        await self._want_logs(job_id, seconds=settle_s + 5)
        await asyncio.sleep(settle_s)

    async def follow_logs(
        self,
        job_id: str,
        *,
        attempt: int | None = None,
        from_first: bool = False,
        poll_interval_s: float = 0.25,
    ) -> AsyncIterator[str]:
        """Yield the job's output as it is written, until the job ends and everything was read.

        Without ``attempt``: from the latest attempt on (``from_first``: from attempt 1, as for a
        job just submitted, whose first attempt may already have ended and been retried), then
        each later one as it starts (a retried job's output goes on in its next attempt). With
        ``attempt``: that attempt's output, until it ends.
        """
        job_id = self.resolve(job_id)
        number: int | None = 1 if from_first and attempt is None else None
        offset = 0
        asked = -math.inf
        while True:
            if time.monotonic() - asked >= _WANT_LOGS_EVERY_S:
                asked = time.monotonic()
                await self._want_logs(job_id)
            # The status is read before the log: an attempt seen ended has all its output relayed.
            status = await self.describe(job_id)
            if number is None:
                number = attempt_number(status, attempt)
            chunk = await self._read_relay(job_id, number, offset)
            if chunk.data:
                yield chunk.data
                offset = chunk.next_offset
                continue
            if attempt_ended(status, number):
                later = [a.number for a in status.attempts if a.number > number]
                if attempt is None and later:
                    number, offset = min(later), 0
                    continue
                if attempt is not None or status.terminal:
                    return
            await asyncio.sleep(poll_interval_s)


def latest_attempt(status: JobStatus) -> int:
    """The number of the job's latest attempt (1 before any delivery)."""
    return max((a.number for a in status.attempts), default=1)


def attempt_ended(status: JobStatus, number: int) -> bool:
    """Whether attempt ``number`` of the job has ended (its output is then all relayed home)."""
    if status.terminal:
        return True
    entries = [a for a in status.attempts if a.number == number]
    return bool(entries) and entries[-1].end is not None


def attempt_number(status: JobStatus, attempt: int | None) -> int:
    """``attempt`` checked against the job's attempts, or the latest one if None."""
    latest = latest_attempt(status)
    if attempt is None:
        return latest
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise InvalidJob(f"--attempt must be a whole number from 1, got {attempt!r:.40}")
    if attempt > latest:
        has = "1" if latest == 1 else f"1-{latest}"
        raise InvalidJob(f"job {status.job_id} has no attempt {attempt} (its attempts: {has})")
    return attempt


# Every IrisClient not yet closed, closed by an exit hook while the interpreter is still whole: a
# script that never calls close() (the seed's snippet) otherwise leaves its loop thread and the
# Temporal SDK's runtime threads live into interpreter teardown, where one of them touching Python
# crashes the process (``Fatal Python error: PyGILState_Release``, exit 134; docs/DESIGN.md, "The
# SDK at exit").
_OPEN_CLIENTS: weakref.WeakSet[IrisClient] = weakref.WeakSet()
_CLOSE_TIMEOUT_S = 5.0


@atexit.register
def _close_open_clients() -> None:
    for client in builtins.list(_OPEN_CLIENTS):
        client.close()
    gc.collect()  # the closed clients' Temporal connections are dropped here, not in teardown


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait for them to finish."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class IrisClient:
    """Synchronous facade over AsyncIrisClient, for scripts and notebooks.

    One private event loop runs in a daemon thread; every call blocks until its answer. ``close()``
    (or ``with IrisClient() as client:``) ends it; a client left open is closed at interpreter exit.
    """

    _async: AsyncIrisClient | None

    def __init__(
        self, cluster: str | None = None, *, config: FederationConfig | str | Path | None = None
    ) -> None:
        self._async = None
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="iris-client", daemon=True)
        self._thread.start()
        _OPEN_CLIENTS.add(self)
        try:
            cfg = config if isinstance(config, FederationConfig) else load_config(config)
            if cluster is not None:
                cfg.check_cluster(cluster)
        except ConfigError as exc:
            self.close()
            raise InvalidJob(str(exc)) from None
        self._async = self._run(AsyncIrisClient.connect(cfg))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise IrisError("this IrisClient is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def aio(self) -> AsyncIrisClient:
        if self._async is None:
            raise IrisError("this IrisClient is closed")
        return self._async

    def submit(
        self,
        command: Sequence[str] | None = None,
        *,
        script: str | None = None,
        workdir: str | os.PathLike[str] | None = ".",
        **kw: Any,
    ) -> str:
        return self._run(self.aio.submit(command, script=script, workdir=workdir, **kw))

    def describe(self, job_id: str) -> JobStatus:
        return self._run(self.aio.describe(job_id))

    def cancel(self, job_id: str, reason: str = "Cancelled by user") -> bool:
        return self._run(self.aio.cancel(job_id, reason))

    def cancel_and_report(self, job_id: str, reason: str = "Cancelled by user") -> CancelOutcome:
        return self._run(self.aio.cancel_and_report(job_id, reason))

    def list(self, **kw: Any) -> list[JobSummary]:
        return self._run(self.aio.list(**kw))

    def queue_positions(self, job_ids: Sequence[str]) -> dict[str, QueuePosition]:
        return self._run(self.aio.queue_positions(job_ids))

    def position(self, job_id: str) -> QueuePosition | None:
        return self._run(self.aio.position(job_id))

    def dry_run(self, spec: JobSpec) -> DryRun:
        return self._run(self.aio.dry_run(spec))

    def resolve(self, job_id: str) -> str:
        return self.aio.resolve(job_id)

    def wait(self, job_id: str, *, timeout_s: float | None = None) -> JobStatus:
        return self._run(self.aio.wait(job_id, timeout_s=timeout_s))

    def logs(self, job_id: str, offset: int = 0, *, attempt: int | None = None) -> LogChunk:
        return self._run(self.aio.logs(job_id, offset, attempt=attempt))

    def peers(self) -> FederationView:
        return self._run(self.aio.peers())

    def replay_handoff(
        self,
        job_id: str,
        *,
        peer: str | None = None,
        requeue: bool = False,
        reason: str = "operator replay",
        force: bool = False,
    ) -> str:
        return self._run(
            self.aio.replay_handoff(job_id, peer=peer, requeue=requeue, reason=reason, force=force)
        )

    def iter_logs(self, job_id: str, *, attempt: int | None = None) -> Iterator[str]:
        agen = self.aio.follow_logs(job_id, attempt=attempt)

        async def step() -> str | None:
            try:
                return await anext(agen)
            except StopAsyncIteration:
                return None

        while (data := self._run(step())) is not None:
            yield data

    def close(self) -> None:
        """End the client: its pending calls are cancelled, its loop stopped and closed, and its
        Temporal connection dropped. Idempotent; called at interpreter exit if not before."""
        if self._closed:
            return
        self._closed = True
        _OPEN_CLIENTS.discard(self)
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(_CLOSE_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_CLOSE_TIMEOUT_S)
        self._async = None  # the Temporal client and its connection go with the last reference
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> IrisClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
