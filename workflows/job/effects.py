"""Every activity the job workflow calls, with its timeouts and retry policies (docs/DESIGN.md,
"Data flow"). The steps decide; these only ask, and say how (a local or a regular activity, how
long one try may take, how it is retried). No I/O happens in the workflow: the activities do it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import CancelledError as TemporalCancelledError

with workflow.unsafe.imports_passed_through():
    from activities.admission import Admission, AdmissionActivities
    from activities.auth import AuthActivities, VerifyInput
    from activities.peers import (
        FindInput,
        FindResult,
        FollowInput,
        FollowResult,
        LaunchInput,
        MirrorInput,
        PeerActivities,
        TerminateInput,
    )
    from activities.store import FenceInput, HandleStateInput, StoreActivities
    from iris import contract
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.controller.models import LaunchRequest
    from iris.jobs import log_key
    from iris.policy.models import Band
    from iris.reports import FederationView
    from iris.store.models import HandleState
    from iris.userauth import Action, Principal, request_digest

import workflows.job.transitions as transitions
from workflows.job.state import Ctx

QUICK = timedelta(seconds=30)
STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
REPORTS_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
ARTIFACT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10), maximum_attempts=5
)
# The launch's and the bundle staging's retries in runs before TIMERS_PATCH; later runs take the
# view's initial and maximum intervals (``handoff_retry``).
HANDOFF_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=6,
    non_retryable_error_types=[contract.HANDOFF_REJECTED],
)
MIRROR_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
AUTH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
# Asking a cluster whether it has an attempt: an answer, or "unknown" after a few tries.
FIND_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# Staging a bundle: one try may take this long; retried as the launch (``handoff_retry``).
STAGE_TIMEOUT = timedelta(minutes=5)
# follow_job answers at the latest after this without a change: a running job's history grows by
# one activity every half hour (and continues as new).
FOLLOW_MAX_WAIT = timedelta(minutes=30)
# A parked job whose launch's outcome is unknown asks its cluster again after this, doubling to 10 min
# (runs before TIMERS_PATCH; later ones take the view's parked_probe_first_s and parked_probe_max_s).
PROBE_FIRST = timedelta(seconds=15)
PROBE_MAX = timedelta(minutes=10)

_In = TypeVar("_In")
_Out = TypeVar("_Out")
_Self = TypeVar("_Self")


@dataclasses.dataclass(frozen=True)
class Step:
    """How long one attempt of a handoff activity may take, and how it is retried."""

    timeout: timedelta
    retry: RetryPolicy


ARTIFACT_STEP = Step(QUICK, ARTIFACT_RETRY)


def is_cancellation(exc: BaseException) -> bool:
    """A Temporal cancel of this workflow, as opposed to an activity's own failure."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    return isinstance(exc, ActivityError) and isinstance(exc.cause, TemporalCancelledError)


def refusal(exc: ActivityError) -> bool:
    """The failure is a cluster's final answer (a refusal, a missing bundle), not a lost one."""
    cause = exc.cause
    return isinstance(cause, ApplicationError) and cause.type in (
        contract.HANDOFF_REJECTED,
        contract.BUNDLE_UNAVAILABLE,
    )


def bundle_missing(exc: ActivityError) -> bool:
    """The launch's cluster answered that it lacks the job's bundle: it did not take the job."""
    cause = exc.cause
    return isinstance(cause, ApplicationError) and cause.type == contract.BUNDLE_MISSING


async def fetch_reports() -> FederationView:
    """A regular activity, not a local one: the first workflow task must not hold local
    activities, since an Update (a cancel right after submit) accepted in that task can then be
    answered with a protocol message the server rejects for ever (BadUpdateWorkflowExecutionMessage,
    seen here about once in 250 instant cancels)."""
    return await workflow.execute_activity_method(
        PeerActivities.fetch_reports, start_to_close_timeout=QUICK, retry_policy=REPORTS_RETRY
    )


def _verify_input(
    ctx: Ctx, action: Action, statement: str, request: BaseModel, received_ms: int
) -> VerifyInput:
    spec = ctx.run.spec
    return VerifyInput(
        statement=statement,
        action=action,
        job_id=spec.job_id,
        digest=request_digest(request),
        owner=spec.user,
        production=action is Action.SUBMIT and spec.band is Band.PRODUCTION,
        received_ms=received_ms,
    )


async def admit(ctx: Ctx, received_ms: int) -> tuple[Principal, FederationView]:
    """ADMISSION (the 2027-01 baseline): the submission's signature checked and the capacity
    reports read, in one activity (activities/admission.py); ApplicationError with the one-line
    reason if the statement does not verify. Regular, as each of the two was: the first workflow
    task holds no local activity (``fetch_reports``)."""
    spec = ctx.run.spec
    inp = _verify_input(ctx, Action.SUBMIT, spec.signature, spec, received_ms)
    try:
        admission: Admission = await workflow.execute_activity_method(
            AdmissionActivities.admit_submission, inp, start_to_close_timeout=QUICK, retry_policy=AUTH_RETRY
        )
    except ActivityError as exc:
        if is_cancellation(exc):
            raise
        raise ApplicationError(f"the signature could not be checked: {exc.cause or exc}") from None
    if admission.refusal is not None or admission.principal is None or admission.view is None:
        refused = admission.refusal or "the admission answered nothing"
        raise ApplicationError(refused, type=contract.UNAUTHENTICATED)
    return admission.principal, admission.view


async def verify(ctx: Ctx, action: Action, statement: str, request: BaseModel, received_ms: int) -> Principal:
    """The verified principal; ApplicationError with the one-line reason otherwise."""
    inp = _verify_input(ctx, action, statement, request, received_ms)
    try:
        return await workflow.execute_activity_method(
            AuthActivities.verify_request, inp, start_to_close_timeout=QUICK, retry_policy=AUTH_RETRY
        )
    except ActivityError as exc:
        if is_cancellation(exc):
            raise
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == contract.UNAUTHENTICATED:
            raise ApplicationError(cause.message, type=contract.UNAUTHENTICATED) from None
        raise ApplicationError(f"the signature could not be checked: {cause or exc}") from None


def store_step(
    ctx: Ctx, method: Callable[[StoreActivities, _In], Awaitable[_Out]], arg: _In, *, local: bool = True
) -> workflow.ActivityHandle[_Out]:
    """A federation-store transaction: milliseconds on the worker's own store connection, so a
    local activity (no task-queue round trip) unless this run predates LOCAL_STEPS_PATCH or the
    step must be recorded in a workflow task of its own (``local=False``)."""
    if ctx.features.local_steps and local:
        return workflow.start_local_activity_method(
            method, arg, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY
        )
    return workflow.start_activity_method(method, arg, start_to_close_timeout=QUICK, retry_policy=STORE_RETRY)


async def set_handle_state(
    ctx: Ctx,
    state: HandleState,
    reason: str | None = None,
    *,
    counted_from_ms: int | None = None,
    release: bool = False,
) -> None:
    """The queue handle's state; a transition the store refuses is an event, and the job goes on."""
    run = ctx.run
    try:
        await store_step(
            ctx,
            StoreActivities.set_handle_state,
            HandleStateInput(
                job_id=run.spec.job_id,
                incarnation=run.incarnation,
                state=state,
                reason=reason,
                counted_from_ms=counted_from_ms,
                release=release,
            ),
        )
    except (ActivityError, ApplicationError) as exc:
        # A failed local activity surfaces as its own ApplicationError, a regular one as an
        # ActivityError around it.
        if is_cancellation(exc):
            raise
        cause = exc.cause if isinstance(exc, ActivityError) else exc
        transitions.event(ctx, run.status.state, f"federation store kept its state: {cause or exc}")


async def fence(ctx: Ctx, cluster: str, nonce: str) -> None:
    """An attempt that may still run on ``cluster``: the tick terminates it there when it answers."""
    await store_step(
        ctx,
        StoreActivities.record_fence,
        FenceInput(job_id=ctx.run.spec.job_id, nonce=nonce, cluster=cluster),
    )


async def handoff_step(method: Callable[[_Self, _In], Awaitable[_Out]], arg: _In, step: Step) -> _Out:
    """One activity of the handoff (the artifact check, the bundle staging); ActivityError if it
    fails for good."""
    return await workflow.execute_activity_method(
        method, arg, start_to_close_timeout=step.timeout, retry_policy=step.retry
    )


def handoff_retry(ctx: Ctx) -> RetryPolicy:
    """How the launch and the bundle staging are retried: the view's schedule (TIMERS_PATCH),
    else HANDOFF_RETRY."""
    view = ctx.run.view
    if not ctx.features.timers or view is None:
        return HANDOFF_RETRY
    return dataclasses.replace(
        HANDOFF_RETRY,
        initial_interval=timedelta(seconds=view.handoff_retry_initial_s),
        maximum_interval=timedelta(seconds=view.handoff_retry_max_s),
    )


def probe_schedule(ctx: Ctx) -> tuple[timedelta, timedelta]:
    """When a parked job first asks its cluster again, and the most it waits between two asks:
    the view's (TIMERS_PATCH), else PROBE_FIRST and PROBE_MAX."""
    view = ctx.run.view
    if not ctx.features.timers or view is None:
        return PROBE_FIRST, PROBE_MAX
    return timedelta(seconds=view.parked_probe_first_s), timedelta(seconds=view.parked_probe_max_s)


def start_launch(
    ctx: Ctx, cluster: str, request: LaunchRequest, *, stage_missing: bool = True
) -> workflow.ActivityHandle[ControllerJobStatus]:
    """launch_job; ``stage_missing`` False: a cluster without the bundle fails it BUNDLE_MISSING."""
    return workflow.start_activity_method(
        PeerActivities.launch_job,
        LaunchInput(cluster=cluster, request=request, stage_missing=stage_missing),
        start_to_close_timeout=QUICK,
        retry_policy=handoff_retry(ctx),
    )


async def find_attempt(ctx: Ctx, cluster: str, nonce: str) -> FindResult:
    return await workflow.execute_activity_method(
        PeerActivities.find_attempt,
        FindInput(cluster=cluster, job_id=ctx.run.spec.job_id, nonce=nonce),
        start_to_close_timeout=QUICK,
        retry_policy=FIND_RETRY,
    )


def start_follow(
    ctx: Ctx, cluster: str, remote: ControllerJobStatus, report_unreachable_s: float, max_wait_s: float
) -> workflow.ActivityHandle[FollowResult]:
    """follow_job: the attempt's next change, or its cluster's silence (report_unreachable_s)."""
    run = ctx.run
    return workflow.start_activity_method(
        PeerActivities.follow_job,
        FollowInput(
            cluster=cluster,
            job_id=run.spec.job_id,
            nonce=run.nonce,
            known_state=remote.state.value,
            log_key=log_key(run.spec.job_id, run.attempt),
            report_unreachable_s=report_unreachable_s,
            max_wait_s=max_wait_s,
        ),
        start_to_close_timeout=FOLLOW_MAX_WAIT + timedelta(minutes=5),
        heartbeat_timeout=timedelta(seconds=30),
        retry_policy=MIRROR_RETRY,
    )


async def confirm_end(ctx: Ctx, cluster: str) -> ControllerJobStatus:
    """The job as its cluster has it now (its output relayed home if it ended), to confirm an end
    a watcher reported; not longer than peer_lost_after (a silence is then follow_job's to judge).
    A local activity in runs with LOCAL_CONFIRM_PATCH: one read and a relay, milliseconds, in the
    task that took the observation (an end then costs one workflow task, not three)."""
    within = timedelta(seconds=min(ctx.run.lost_after_s, 120.0))
    return await _mirror_now(ctx, cluster, within, local=ctx.features.local_confirm)


async def read_remote(ctx: Ctx, cluster: str) -> ControllerJobStatus:
    """The job as its cluster has it now, with its output relayed home if it has ended. With
    attempts, a cluster silent for peer_lost_after fails it (an ActivityError that is not a
    cancellation): the caller decides what the silence means."""
    within = timedelta(seconds=ctx.run.lost_after_s) if ctx.features.numbered else None
    return await _mirror_now(ctx, cluster, within)


async def _mirror_now(
    ctx: Ctx, cluster: str, within: timedelta | None, *, local: bool = False
) -> ControllerJobStatus:
    """One mirror_job read of the run's attempt on ``cluster`` (no state known: the first answer
    returns), retried for at most ``within``; ``local``: as a local activity."""
    run = ctx.run
    read = MirrorInput(
        cluster=cluster,
        job_id=run.spec.job_id,
        known_state=None,
        log_key=log_key(run.spec.job_id, run.attempt),
    )
    execute = workflow.execute_local_activity_method if local else workflow.execute_activity_method
    return await execute(
        PeerActivities.mirror_job,
        read,
        start_to_close_timeout=QUICK,
        schedule_to_close_timeout=within,
        retry_policy=MIRROR_RETRY,
    )


def start_mirror(ctx: Ctx, cluster: str, job_id: str, known_state: str) -> workflow.ActivityHandle[Any]:
    """mirror_job as runs before attempts follow a job (workflows/job/legacy.py)."""
    return workflow.start_activity_method(
        PeerActivities.mirror_job,
        MirrorInput(cluster=cluster, job_id=job_id, known_state=known_state),
        start_to_close_timeout=timedelta(minutes=15),
        heartbeat_timeout=timedelta(seconds=30),
        retry_policy=MIRROR_RETRY,
    )


async def terminate(ctx: Ctx, cluster: str, nonce: str | None = None) -> bool:
    """Terminate the attempt on ``cluster`` and wait until the cluster confirms it ended (or
    never had it): re-driven until then. With a nonce (runs with attempts), a cluster silent
    past peer_lost_after gives up: False, the caller fences the attempt."""
    run = ctx.run
    transitions.event(ctx, run.status.state, f"terminating on {cluster}")
    if nonce is None:  # runs begun before attempts: one terminate, retried through outages
        await workflow.execute_activity_method(
            PeerActivities.terminate_job,
            TerminateInput(cluster=cluster, job_id=run.spec.job_id),
            start_to_close_timeout=QUICK,
            retry_policy=MIRROR_RETRY,
        )
        return True
    try:
        await workflow.execute_activity_method(
            PeerActivities.terminate_job,
            TerminateInput(cluster=cluster, job_id=run.spec.job_id, nonce=nonce, confirm=True),
            start_to_close_timeout=timedelta(minutes=15),
            schedule_to_close_timeout=timedelta(seconds=run.lost_after_s),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=MIRROR_RETRY,
        )
    except ActivityError as exc:
        if is_cancellation(exc):
            raise
        return False
    return True


async def done_before_cancel(handle: workflow.ActivityHandle[Any], unsent: Callable[[], bool]) -> bool:
    """Wait for a following activity; a cancel its cluster has not been told of yet (``unsent``)
    stops it first (False: the caller terminates the job, then follows again)."""
    await workflow.wait_condition(lambda: handle.done() or unsent())
    if handle.done():
        return True
    handle.cancel()
    with contextlib.suppress(ActivityError, asyncio.CancelledError):
        await handle
    return False
