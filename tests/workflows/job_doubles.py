"""A small fake federation for JobWorkflow: every activity the workflow calls, as a test double.

Each double is registered under the real activity's name (``iris.contract``) with the real input and
output models, so the workflow under test is the production ``JobWorkflow`` and only the I/O is
replaced. A test configures what the federation answers (the capacity view, the CAS, the artifact
check, staging, the launch, the remote job's states) and then reads back what the workflow asked
of it (deliveries, terminations, store writes).

The placement tick is not run: a test sends the ``place`` / ``explain`` / ``expire`` signals itself,
as the tick would. ``hold(name)`` makes one activity wait until ``release(name)``, so a test can
query the workflow while it is inside that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import SearchAttributeKey
from temporalio.converter import decode_typed_search_attributes
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.admission import AdmissionActivities
from activities.artifacts import ArtifactInput, ArtifactReport
from activities.auth import AuthActivities, VerifyInput
from activities.peers import (
    AttemptFound,
    FindInput,
    FindResult,
    FollowInput,
    FollowResult,
    LaunchInput,
    MirrorInput,
    StageInput,
    StageResult,
    TerminateInput,
)
from activities.store import (
    CancelIntentInput,
    EnqueueInput,
    ExpireInput,
    FenceInput,
    HandleStateInput,
    PromoteInput,
)
from iris import contract
from iris.bundle import BundleRef
from iris.controller.models import ControllerJobState, TaskStatus
from iris.controller.models import JobStatus as RemoteStatus
from iris.jobs import JobSpec, JobState, JobStatus, start_memo, start_search_attributes
from iris.policy.models import Availability, BackendReport, DeviceRequest, PeerReport, Placement
from iris.reports import FederationView
from iris.store.models import CancelResult, HandleState, JobHandle, PromoteOutcome, PromoteResult
from iris.userauth import Principal
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

HOME = "marin"
PEER = "cw-a"
OTHER_PEER = "cw-b"
HOME_BACKEND = "cpu-1"
PEER_BACKEND = "h100-a"
OTHER_BACKEND = "h100-b"
STALE_AFTER_MS = 30_000
GPU_ATTRS = {"device-type": ["gpu"], "device-variant": ["h100"]}
BUNDLE = BundleRef(sha256="ab" * 32, size=2048, files=4, workspace_bytes=1843)


def federation_view(now_ms: int) -> FederationView:
    """marin (home: CPU only), cw-a (16 free H100), cw-b (8 free H100): all reporting now."""

    def gpu(backend_id: str, free: int) -> BackendReport:
        block = Availability(
            observation_epoch_ms=now_ms, amounts={"h100": free}, total_amounts={"h100": free}
        )
        return BackendReport(backend_id=backend_id, advertised_attributes=GPU_ATTRS, availability=block)

    cpu = BackendReport(backend_id=HOME_BACKEND, advertised_attributes={"device-type": ["cpu"]})
    return FederationView(
        home=HOME,
        stale_after_ms=STALE_AFTER_MS,
        fetched_ms=now_ms,
        reports=[
            PeerReport(peer_id=HOME, last_contact_ms=now_ms, backends=[cpu]),
            PeerReport(peer_id=PEER, last_contact_ms=now_ms, backends=[gpu(PEER_BACKEND, 16)]),
            PeerReport(peer_id=OTHER_PEER, last_contact_ms=now_ms, backends=[gpu(OTHER_BACKEND, 8)]),
        ],
    )


def new_job_id(name: str) -> str:
    return f"alice/{name}-{uuid.uuid4().hex[:8]}"


def cpu_spec(name: str, now_ms: int, **kw: Any) -> JobSpec:
    """A CPU job: the home cluster can run it now (prefer-local)."""
    return JobSpec(job_id=new_job_id(name), name=name, user="alice", command=["true"], submit_ms=now_ms, **kw)


def gpu_spec(name: str, now_ms: int, **kw: Any) -> JobSpec:
    """8 × H100: no GPU at home, so it queues for a peer."""
    device = kw.pop("device", DeviceRequest(type="gpu", variant="h100", count=8))
    return JobSpec(
        job_id=new_job_id(name),
        name=name,
        user="alice",
        command=["python", "train.py"],
        device=device,
        submit_ms=now_ms,
        **kw,
    )


def placement(job_id: str, peer: str = PEER, backend: str = PEER_BACKEND) -> Placement:
    """What the placement tick would signal."""
    return Placement(job_id=job_id, peer_id=peer, backend_id=backend, reason=f"free capacity on {peer}")


# ---- what a step of the fake federation does ----------------------------------------------------


@dataclass(frozen=True)
class Accept:
    """The cluster accepts the launch; the job starts in ``state``."""

    state: ControllerJobState = ControllerJobState.RUNNING


@dataclass(frozen=True)
class Refuse:
    """A final refusal (permission, invalid argument…): ``HANDOFF_REJECTED``, never retried."""

    message: str = "cw-a refused the job: submitter not allowed"


@dataclass(frozen=True)
class Outage:
    """A transient error: the activity fails retryably, nothing reached the cluster."""

    message: str = "connection refused"


@dataclass(frozen=True)
class LoseReply:
    """The cluster accepts the launch (the job now runs there, in ``state``) but the reply is lost:
    the activity fails retryably, and a repeated launch with the same nonce finds the job as is.
    ``then_silent``: right after, the cluster stops answering anyone (a partition), so the workflow
    cannot learn whether the launch landed."""

    state: ControllerJobState = ControllerJobState.RUNNING
    then_silent: bool = False


@dataclass(frozen=True)
class AlreadyHeld:
    """Staging: the cluster already holds the bundle; nothing is sent."""


@dataclass(frozen=True)
class Unavailable:
    """Staging: the bundle is missing from (or damaged in) the home store."""

    message: str = f"workspace bundle {BUNDLE.short} is missing from the home object store"


@dataclass(frozen=True)
class Remote:
    """A mirror step with the cluster's own exit code and error (a bare state gets the usual ones)."""

    state: ControllerJobState
    exit_code: int | None = None
    error: str | None = None


LaunchStep = Accept | Refuse | Outage | LoseReply
StageStep = Accept | AlreadyHeld | Refuse | Outage | Unavailable
# A mirror step: the remote job's next state, or an error the mirror activity raises.
MirrorStep = ControllerJobState | Remote | Exception


def job_lost(cluster: str, job_id: str) -> ApplicationError:
    return ApplicationError(
        f"{cluster} no longer knows job {job_id}", type=contract.JOB_LOST, non_retryable=True
    )


def _next(script: list[Any]) -> Any:
    """The next scripted answer; the last one repeats."""
    return script.pop(0) if len(script) > 1 else script[0]


@dataclass
class FakeFederation:
    """The federation as JobWorkflow's activities see it: configurable answers, recorded calls."""

    view: FederationView
    # promote_job: the CAS outcome of each call (the last repeats).
    promote: list[PromoteOutcome] = field(default_factory=lambda: [PromoteOutcome.PROMOTED])
    # record_cancel: whether the cancel intent committed before any promotion.
    cancel_wins: bool = True
    # check_artifacts: the URIs each cluster cannot read, by cluster.
    missing: dict[str, set[str]] = field(default_factory=dict)
    # stage_bundle / launch_job: what each attempt does (the last repeats).
    stage: list[StageStep] = field(default_factory=lambda: [Accept()])
    launch: list[LaunchStep] = field(default_factory=lambda: [Accept()])
    # The workspace bundles each cluster holds, (cluster, sha256): a staging that uploads adds one.
    # A launch of a bundle its cluster lacks fails BUNDLE_MISSING unless it may stage it itself.
    bundles: set[tuple[str, str]] = field(default_factory=set)
    # mirror_job: the remote job's next states (or errors); when exhausted, the mirror waits for a
    # change (a termination) like the real one, heartbeating.
    mirror: list[MirrorStep] = field(default_factory=lambda: [ControllerJobState.SUCCEEDED])
    # set_handle_state: transitions the store refuses (StoreConflict).
    refused_handle_states: set[HandleState] = field(default_factory=set)
    # Clusters that do not answer at all (a partition, or a cluster lost for good): every call to
    # them fails as an outage; follow_job reports them silent.
    silent: set[str] = field(default_factory=set)
    # follow_job answers at once with the unchanged status, as the real one does after max_wait_s
    # (ten minutes) without a change: one answer stands for ten minutes of a long run.
    follow_unchanged: bool = False

    # ---- recorded ----
    enqueued: list[EnqueueInput] = field(default_factory=list)
    promotions: list[Placement] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    handle_states: list[tuple[HandleState, str | None]] = field(default_factory=list)
    # The reasons of the handle states written with ``release`` (a park that frees the job's
    # reservation), and the placements promoted with ``retake`` (a replay in place taking it again).
    releases: list[str | None] = field(default_factory=list)
    retakes: list[Placement] = field(default_factory=list)
    artifact_checks: list[tuple[str, list[str]]] = field(default_factory=list)
    stagings: list[str] = field(default_factory=list)
    launch_attempts: list[str] = field(default_factory=list)
    launch_requests: list[LaunchInput] = field(default_factory=list)
    # (cluster, nonce) of every launch a cluster accepted: a second run would be a second entry.
    deliveries: list[tuple[str, str]] = field(default_factory=list)
    mirror_calls: list[tuple[str, str | None]] = field(default_factory=list)
    # Every follow_job call's input (how long it was allowed to wait, for whom).
    follows: list[FollowInput] = field(default_factory=list)
    terminations: list[str] = field(default_factory=list)
    # (cluster, nonce) of every attempt the workflow asked the store to fence.
    fences: list[tuple[str, str]] = field(default_factory=list)
    finds: list[tuple[str, str]] = field(default_factory=list)
    # Jobs whose output the mirror relayed home when it reported their end.
    relayed: list[str] = field(default_factory=list)
    # The log key each relay by mirror_job wrote (an attempt's output goes under its own number).
    relayed_keys: list[str] = field(default_factory=list)
    # The job as each cluster has it (cluster, job id) → status.
    remote: dict[tuple[str, str], RemoteStatus] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    # The signed requests the workflow asked to verify. ``auth`` None: every request verifies as
    # its job's owner (tests not about authentication); else the real activity decides
    # (tests/workflows/test_job_auth.py gives it a users table).
    verifications: list[VerifyInput] = field(default_factory=list)
    auth: AuthActivities | None = None
    # verify_request: how many of the next calls fail as an outage (retryable) before it answers.
    verify_outages: int = 0

    _holds: dict[str, asyncio.Event] = field(default_factory=dict)
    _reached: dict[str, asyncio.Event] = field(default_factory=dict)
    # Set (and replaced) at every change of a remote job: a waiting mirror wakes at once.
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    # ---- steering a test ----

    def hold(self, name: str) -> None:
        """The next calls of activity ``name`` wait (before doing anything) until ``release(name)``."""
        self._holds[name] = asyncio.Event()
        self._reached[name] = asyncio.Event()

    def release(self, name: str) -> None:
        self._holds.pop(name).set()

    def release_and_hold(self, name: str) -> None:
        """Let the calls of ``name`` waiting now go on; the next ones wait again."""
        waiting = self._holds[name]
        self.hold(name)
        waiting.set()

    def release_all(self) -> None:
        for name in list(self._holds):
            self.release(name)

    async def reached(self, name: str, timeout: float = 10.0) -> None:
        """Wait until a call of the held activity ``name`` has started."""
        await asyncio.wait_for(self._reached[name].wait(), timeout)

    async def _enter(self, name: str) -> None:
        self.calls.append(name)
        hold = self._holds.get(name)
        if hold is not None:
            self._reached[name].set()
            while not hold.is_set():
                # Heartbeat so the server can deliver a cancel to a held activity.
                if not activity.info().is_local:
                    activity.heartbeat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hold.wait(), 1.0)

    def set_remote_state(self, cluster: str, job_id: str, state: ControllerJobState) -> None:
        """The job changes state on its cluster (a mirror waiting for a change returns it)."""
        self._set_remote((cluster, job_id), state)

    def forget(self, cluster: str, job_id: str) -> None:
        """The cluster no longer knows the job (a mirror then reports it lost)."""
        del self.remote[(cluster, job_id)]
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def remote_state(self, cluster: str, job_id: str) -> ControllerJobState | None:
        known = self.remote.get((cluster, job_id))
        return None if known is None else known.state

    @property
    def handle_ends(self) -> list[HandleState]:
        """The states the workflow recorded for its queue handle, in order, a repeated write of the
        same state counted once (a terminal state is sometimes written twice; the store keeps the
        first, so that is not a behaviour these tests pin)."""
        out: list[HandleState] = []
        for state, _ in self.handle_states:
            if not out or out[-1] is not state:
                out.append(state)
        return out

    @property
    def delivered(self) -> int:
        return len(self.deliveries)

    def activities(self) -> list[Callable[..., Awaitable[Any]]]:
        return [
            self.verify_request,
            # The worker's own admission over the two doubles below: their calls are recorded
            # (and held) under their own names.
            AdmissionActivities(self, self).admit_submission,
            self.fetch_reports,
            self.enqueue_job,
            self.promote_job,
            self.record_cancel,
            self.expire_job,
            self.requeue_job,
            self.set_handle_state,
            self.check_artifacts,
            self.stage_bundle,
            self.launch_job,
            self.mirror_job,
            self.follow_job,
            self.find_attempt,
            self.terminate_job,
            self.record_fence,
        ]

    # ---- users ----

    @activity.defn(name=contract.VERIFY_REQUEST)
    async def verify_request(self, inp: VerifyInput) -> Principal:
        await self._enter(contract.VERIFY_REQUEST)
        self.verifications.append(inp)
        if self.verify_outages > 0:
            self.verify_outages -= 1
            raise ApplicationError("the worker could not read its user table")  # retryable
        if self.auth is not None:
            return await self.auth.verify_request(inp)
        return Principal(name=inp.owner, roles=("user",))

    # ---- peers ----

    @activity.defn(name=contract.FETCH_REPORTS)
    async def fetch_reports(self) -> FederationView:
        await self._enter(contract.FETCH_REPORTS)
        return self.view

    @activity.defn(name=contract.CHECK_ARTIFACTS)
    async def check_artifacts(self, inp: ArtifactInput) -> ArtifactReport:
        await self._enter(contract.CHECK_ARTIFACTS)
        self.artifact_checks.append((inp.cluster, list(inp.uris)))
        missing = [u for u in inp.uris if u in self.missing.get(inp.cluster, set())]
        return ArtifactReport(
            missing=missing,
            reasons=[f"Artifact {u} missing in {inp.cluster}'s object store" for u in missing],
        )

    @activity.defn(name=contract.STAGE_BUNDLE)
    async def stage_bundle(self, inp: StageInput) -> StageResult:
        await self._enter(contract.STAGE_BUNDLE)
        self.stagings.append(inp.cluster)
        step = _next(self.stage)
        if isinstance(step, Refuse):
            raise ApplicationError(step.message, type=contract.HANDOFF_REJECTED, non_retryable=True)
        if isinstance(step, Unavailable):
            raise ApplicationError(step.message, type=contract.BUNDLE_UNAVAILABLE, non_retryable=True)
        if isinstance(step, Outage):
            raise ApplicationError(step.message)
        self.bundles.add((inp.cluster, inp.bundle.sha256))
        return StageResult(uploaded=not isinstance(step, AlreadyHeld))

    @activity.defn(name=contract.LAUNCH_JOB)
    async def launch_job(self, inp: LaunchInput) -> RemoteStatus:
        await self._enter(contract.LAUNCH_JOB)
        request = inp.request
        self.launch_attempts.append(inp.cluster)
        self.launch_requests.append(inp)
        step = _next(self.launch)
        if inp.cluster in self.silent:
            raise ApplicationError(f"{inp.cluster}: connection refused")
        if isinstance(step, Refuse):
            raise ApplicationError(step.message, type=contract.HANDOFF_REJECTED, non_retryable=True)
        if isinstance(step, Outage):
            raise ApplicationError(step.message)
        key = (inp.cluster, request.job_id)
        known = self.remote.get(key)
        new_run = known is None or known.nonce != request.nonce
        bundle = request.bundle
        if new_run and bundle is not None and (inp.cluster, bundle.sha256) not in self.bundles:
            if not inp.stage_missing:
                if len(self.launch) > 0 and self.launch[0] is not step:
                    self.launch.insert(0, step)  # not received: the scripted answer is the next launch's
                raise ApplicationError(
                    f"{inp.cluster} does not hold workspace bundle {bundle.short}",
                    type=contract.BUNDLE_MISSING,
                    non_retryable=True,
                )
            self.bundles.add((inp.cluster, bundle.sha256))  # the activity stages it itself
        if new_run:
            known = RemoteStatus(
                job_id=request.job_id,
                state=step.state,
                backend_id=request.backend_id,
                created_ms=int(time.time() * 1000),
                band=request.band,
                user=request.user,
                requester=request.requester,
                nonce=request.nonce,
                tasks=[TaskStatus(index=0, state=step.state)],
            )
            self.remote[key] = known
            self.deliveries.append((inp.cluster, request.nonce))
        # else: the same requester and nonce again, an idempotent replay (no second run).
        if isinstance(step, LoseReply):
            if step.then_silent:
                self.silent.add(inp.cluster)
            raise ApplicationError("the reply was lost: connection reset")
        return known

    def _set_remote(self, key: tuple[str, str], step: ControllerJobState | Remote) -> RemoteStatus:
        if isinstance(step, ControllerJobState):
            codes = {
                ControllerJobState.SUCCEEDED: 0,
                ControllerJobState.FAILED: 3,
                ControllerJobState.KILLED: -15,
            }
            step = Remote(step, codes.get(step))
        status = self.remote[key].model_copy(
            update={
                "state": step.state,
                "exit_code": step.exit_code,
                "error": step.error,
                "tasks": [TaskStatus(index=0, state=step.state, exit_code=step.exit_code, slots=[0, 1])],
            }
        )
        self.remote[key] = status
        self._notify()
        return status

    def _reported(
        self, key: tuple[str, str], status: RemoteStatus, log_key: str | None = None
    ) -> RemoteStatus:
        if status.terminal:
            self.relayed.append(key[1])
            if log_key is not None:
                self.relayed_keys.append(log_key)
        return status

    @activity.defn(name=contract.MIRROR_JOB)
    async def mirror_job(self, inp: MirrorInput) -> RemoteStatus:
        await self._enter(contract.MIRROR_JOB)
        self.mirror_calls.append((inp.cluster, inp.known_state))
        if inp.cluster in self.silent:
            raise ApplicationError(f"{inp.cluster}: connection refused")
        key = (inp.cluster, inp.job_id)
        current = self.remote.get(key)
        if current is None:
            raise job_lost(inp.cluster, inp.job_id)
        if inp.known_state is None or current.terminal:
            return self._reported(key, current, inp.log_key)
        if self.mirror:
            step = self.mirror.pop(0)
            if isinstance(step, Exception):
                raise step
            return self._reported(key, self._set_remote(key, step))
        # Nothing scripted: the job stays as it is until something (a termination) changes it.
        # Woken at once by the change, so that a mirror the workflow cancelled (it learns of that
        # only through a throttled heartbeat) still ends before the workflow does: the Java test
        # server never skips time again after an activity completes on a closed workflow.
        while (current := self.remote.get(key)) is not None and current.state.value == inp.known_state:
            activity.heartbeat(inp.known_state)
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)
        if current is None:
            raise job_lost(inp.cluster, inp.job_id)
        return self._reported(key, current)

    @activity.defn(name=contract.FOLLOW_JOB)
    async def follow_job(self, inp: FollowInput) -> FollowResult:
        """The mirror_job double's answers, in follow_job's shape: a job its cluster forgot is
        ``gone``, a silent cluster is reported silent (for report_unreachable_s, simulated)."""
        await self._enter(contract.FOLLOW_JOB)
        self.mirror_calls.append((inp.cluster, inp.known_state))
        self.follows.append(inp)
        if inp.cluster in self.silent:
            return FollowResult(unreachable_s=inp.report_unreachable_s, error="connection refused")
        key = (inp.cluster, inp.job_id)
        current = self.remote.get(key)
        if current is None or (inp.nonce is not None and current.nonce != inp.nonce):
            return FollowResult(gone=True, error=f"{inp.cluster} no longer knows job {inp.job_id}")
        if inp.known_state is None or current.terminal or self.follow_unchanged:
            return FollowResult(status=self._reported(key, current))
        if self.mirror:
            step = self.mirror.pop(0)
            if isinstance(step, ApplicationError) and step.type == contract.JOB_LOST:
                return FollowResult(gone=True, error=step.message)
            if isinstance(step, Exception):
                raise step
            return FollowResult(status=self._reported(key, self._set_remote(key, step)))
        if inp.max_wait_s <= 0:
            # Asked for one answer (a safety poll): the status as it is now.
            return FollowResult(status=self._reported(key, current))
        while (
            (current := self.remote.get(key)) is not None
            and current.state.value == inp.known_state
            and inp.cluster not in self.silent
        ):
            activity.heartbeat(inp.known_state)
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)
        if inp.cluster in self.silent:
            return FollowResult(unreachable_s=inp.report_unreachable_s, error="connection refused")
        if current is None:
            return FollowResult(gone=True, error=f"{inp.cluster} no longer knows job {inp.job_id}")
        return FollowResult(status=self._reported(key, current))

    @activity.defn(name=contract.FIND_ATTEMPT)
    async def find_attempt(self, inp: FindInput) -> FindResult:
        await self._enter(contract.FIND_ATTEMPT)
        self.finds.append((inp.cluster, inp.nonce))
        if inp.cluster in self.silent:
            return FindResult(found=AttemptFound.UNKNOWN, error="connection refused")
        current = self.remote.get((inp.cluster, inp.job_id))
        if current is None or current.nonce != inp.nonce:
            return FindResult(found=AttemptFound.ABSENT, status=current)
        return FindResult(found=AttemptFound.HERE, status=current)

    @activity.defn(name=contract.TERMINATE_JOB)
    async def terminate_job(self, inp: TerminateInput) -> RemoteStatus | None:
        await self._enter(contract.TERMINATE_JOB)
        if inp.cluster in self.silent:
            raise ApplicationError(f"{inp.cluster}: connection refused")
        self.terminations.append(inp.cluster)
        key = (inp.cluster, inp.job_id)
        if key not in self.remote:
            return None
        if inp.nonce is not None and self.remote[key].nonce != inp.nonce:
            return self.remote[key]  # another attempt's run: never touched
        if self.remote[key].terminal:
            return self.remote[key]
        return self._set_remote(key, ControllerJobState.KILLED)

    @activity.defn(name=contract.RECORD_FENCE)
    async def record_fence(self, inp: FenceInput) -> None:
        await self._enter(contract.RECORD_FENCE)
        self.fences.append((inp.cluster, inp.nonce))

    # ---- the federation store ----

    @activity.defn(name=contract.ENQUEUE_JOB)
    async def enqueue_job(self, inp: EnqueueInput) -> JobHandle:
        await self._enter(contract.ENQUEUE_JOB)
        self.enqueued.append(inp)
        return JobHandle(job_id=inp.shape.job_id, incarnation=inp.incarnation, shape=inp.shape)

    @activity.defn(name=contract.PROMOTE_JOB)
    async def promote_job(self, inp: PromoteInput) -> PromoteResult:
        await self._enter(contract.PROMOTE_JOB)
        self.promotions.append(inp.placement)
        if inp.retake:
            self.retakes.append(inp.placement)
        outcome = _next(self.promote)
        handle = None
        if outcome.promoted:
            shape = self.enqueued[-1].shape
            handle = JobHandle(
                job_id=inp.job_id,
                incarnation=inp.incarnation,
                state=HandleState.PENDING_HANDOFF,
                shape=shape,
                assigned_peer=inp.placement.peer_id,
                assigned_backend=inp.placement.backend_id or None,
            )
        return PromoteResult(outcome=outcome, message=f"CAS answered {outcome.value}", handle=handle)

    @activity.defn(name=contract.RECORD_CANCEL)
    async def record_cancel(self, inp: CancelIntentInput) -> CancelResult:
        await self._enter(contract.RECORD_CANCEL)
        self.cancels.append(inp.reason)
        state = HandleState.KILLED if self.cancel_wins else HandleState.PENDING_HANDOFF
        return CancelResult(won=self.cancel_wins, state=state)

    @activity.defn(name=contract.EXPIRE_JOB)
    async def expire_job(self, inp: ExpireInput) -> bool:
        await self._enter(contract.EXPIRE_JOB)
        self.expired.append(inp.job_id)
        return True

    @activity.defn(name=contract.REQUEUE_JOB)
    async def requeue_job(self, inp: ExpireInput) -> bool:
        await self._enter(contract.REQUEUE_JOB)
        self.requeued.append(inp.job_id)
        return True

    @activity.defn(name=contract.SET_HANDLE_STATE)
    async def set_handle_state(self, inp: HandleStateInput) -> None:
        await self._enter(contract.SET_HANDLE_STATE)
        if inp.state in self.refused_handle_states:
            raise ApplicationError(
                f"handle {inp.job_id} cannot move to {inp.state.value}",
                type=contract.STORE_CONFLICT,
                non_retryable=True,
            )
        self.handle_states.append((inp.state, inp.reason))
        if inp.release:
            self.releases.append(inp.reason)


# ---- driving a job ------------------------------------------------------------------------------


@dataclass
class Federation:
    """One test's world: the environment, the doubles, and a worker on a task queue of its own."""

    env: WorkflowEnvironment
    fake: FakeFederation
    task_queue: str
    now_ms: int
    handles: list[WorkflowHandle[Any, JobStatus]] = field(default_factory=list)

    async def start(self, spec: JobSpec) -> WorkflowHandle[Any, JobStatus]:
        handle = await start_job(self.env, spec, self.task_queue)
        self.handles.append(handle)
        return handle

    async def queued(self, spec: JobSpec) -> WorkflowHandle[Any, JobStatus]:
        """Start a job the federation queues, and wait until it waits in QUEUED_HANDOFF."""
        handle = await self.start(spec)
        await wait_for_state(handle, JobState.QUEUED_HANDOFF)
        return handle

    async def place(
        self, handle: WorkflowHandle[Any, JobStatus], peer: str = PEER, backend: str = PEER_BACKEND
    ) -> None:
        """Send the placement signal, as the tick would."""
        await handle.signal(JobWorkflow.place, placement(handle.id, peer, backend))

    async def result(self, handle: WorkflowHandle[Any, JobStatus], timeout: float = 10.0) -> JobStatus:
        """The job's end, without the test server's automatic time skipping: while a client waits
        for a result it jumps to the next timer whenever no workflow task runs, even with an
        activity in flight (to an activity's timeout, or ten years on, the run's timeout). Tests
        that need time to pass say how much (``env.sleep``, ``skip_to_end``)."""
        with self.env.auto_time_skipping_disabled():
            try:
                return await asyncio.wait_for(handle.result(), timeout)
            except TimeoutError:
                st = await status(handle)
                raise AssertionError(f"job never ended; it is {st.state.value}: {st.reason}") from None

    async def skip_to_end(self, handle: WorkflowHandle[Any, JobStatus]) -> JobStatus:
        """The job's end, skipping time in 5 s steps meanwhile (retries with backoff go by)."""
        await wait_for(handle, lambda st: st.terminal, "ended", env=self.env, skip_s=5.0)
        return await self.result(handle)

    async def end_leftovers(self) -> None:
        """Jobs a test leaves running are cancelled and run to their end. Not terminated: the Java
        test server never again skips time after a workflow is terminated with an activity in
        flight, which would slow every later test of the session to real time."""
        self.fake.release_all()
        for handle in self.handles:
            if (await handle.describe()).status is not WorkflowExecutionStatus.RUNNING:
                continue
            await handle.cancel()
            try:
                await self.result(handle)
            except Exception:
                with contextlib.suppress(Exception):
                    await handle.terminate("the test is over")


# The simulated time a federation's teardown sleeps to check that the server still skips time.
SKIP_CHECK_S = 60.0


async def running_federation(env: WorkflowEnvironment) -> AsyncIterator[Federation]:
    """A ``Federation`` whose worker runs until the test is over."""
    now = await env_now_ms(env)
    fake = FakeFederation(view=federation_view(now))
    queue = f"jobs-{uuid.uuid4().hex}"
    worker = Worker(
        env.client,
        task_queue=queue,
        workflows=[JobWorkflow],
        activities=fake.activities(),
        workflow_runner=workflow_runner(),
    )
    async with worker:
        fed = Federation(env=env, fake=fake, task_queue=queue, now_ms=now)
        try:
            yield fed
        finally:
            await fed.end_leftovers()
        if env.supports_time_skipping:
            # The test left time skipping working for the next one (see end_leftovers): a skipping
            # server answers a minute's sleep at once; one that went back to real time needs the
            # whole minute. The guard sits below that minute, so it always catches real time, and
            # far above any answer a loaded machine gives (two suites on two cores took over 5 s).
            try:
                await asyncio.wait_for(env.sleep(SKIP_CHECK_S), SKIP_CHECK_S * 0.75)
            except TimeoutError:
                raise AssertionError(
                    f"the test server did not skip {SKIP_CHECK_S:.0f} s of its time within "
                    f"{SKIP_CHECK_S * 0.75:.0f} s of real time: it stopped skipping (it does after an "
                    "activity of a closed workflow completes), and every later test would run in real time"
                ) from None


async def env_now_ms(env: WorkflowEnvironment) -> int:
    """The environment's clock (the time-skipping server's own time), in ms."""
    return int((await env.get_current_time()).timestamp() * 1000)


async def start_job(
    env: WorkflowEnvironment, spec: JobSpec, task_queue: str, *, memo: bool = True
) -> WorkflowHandle[Any, JobStatus]:
    """Start the job's workflow as the SDK does: its id is the job id, with its search attributes
    and its memo (``memo=False``: as a client before the start memo)."""
    return await env.client.start_workflow(
        JobWorkflow.run,
        spec,
        id=spec.job_id,
        task_queue=task_queue,
        search_attributes=start_search_attributes(spec),
        memo=start_memo() if memo else None,
    )


async def status(handle: WorkflowHandle[Any, JobStatus]) -> JobStatus:
    return await handle.query(JobWorkflow.status)


async def listed(client: Client, query: str, *, timeout: float = 10.0) -> list[str]:
    """The workflow ids a visibility query finds: polled until it finds any (visibility lags the
    upsert), or an empty list after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        ids = [w.id async for w in client.list_workflows(query)]
        if ids or time.monotonic() > deadline:
            return ids
        await asyncio.sleep(0.1)


async def wait_for(
    handle: WorkflowHandle[Any, JobStatus],
    predicate: Callable[[JobStatus], bool],
    what: str,
    *,
    timeout: float = 10.0,
    env: WorkflowEnvironment | None = None,
    skip_s: float = 0.0,
) -> JobStatus:
    """Poll the ``status`` query until ``predicate`` holds. With ``env`` and ``skip_s``, each poll
    also skips that much time on the time-skipping server (retries with backoff go by at once)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await status(handle)
        if predicate(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"job never {what}; it is {st.state.value}: {st.reason}")
        if env is not None and skip_s:
            await env.sleep(skip_s)
        else:
            await asyncio.sleep(0.02)


async def wait_for_state(
    handle: WorkflowHandle[Any, JobStatus],
    state: JobState,
    *,
    timeout: float = 10.0,
    env: WorkflowEnvironment | None = None,
    skip_s: float = 0.0,
) -> JobStatus:
    """Poll the ``status`` query until the job is in ``state``."""
    return await wait_for(
        handle,
        lambda st: st.state is state,
        f"reached {state.value}",
        timeout=timeout,
        env=env,
        skip_s=skip_s,
    )


async def upserted(handle: WorkflowHandle[Any, JobStatus], key: SearchAttributeKey[str]) -> list[str]:
    """The values of search attribute ``key`` the workflow upserted, in order (from its history)."""
    values: list[str] = []
    async for event in handle.fetch_history_events():
        if not event.HasField("upsert_workflow_search_attributes_event_attributes"):
            continue
        attrs = event.upsert_workflow_search_attributes_event_attributes.search_attributes
        value = decode_typed_search_attributes(attrs).get(key)
        if value is not None:
            values.append(value)
    return values


def states(st: JobStatus) -> list[JobState]:
    """The states of the job's events, consecutive repeats collapsed."""
    out: list[JobState] = []
    for event in st.events:
        if not out or out[-1] is not event.state:
            out.append(event.state)
    return out


def messages(st: JobStatus) -> list[str]:
    return [e.message for e in st.events]
