"""JobWorkflow: one durable workflow per job (docs/DESIGN.md, "Data flow" and "Job states").

classify → run at home now | queue → placement signal → promotion CAS → artifact check → bundle
staging → handoff → mirror → terminal, with cancellation honoured at every step. No I/O here:
activities do it and the policy decides.

What the workflow knows lives in one JobRun (workflows/job/state.py), handed whole to the next run
when it continues as new. The lifecycle reads top to bottom; a
step that ends the job raises ``_Ended`` (``run`` returns the final status), one that cannot hand
off raises ``_Parked`` (the job waits in HANDOFF_FAILED for an operator or a cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import CancelledError as TemporalCancelledError

with workflow.unsafe.imports_passed_through():
    from activities.artifacts import ArtifactActivities, ArtifactInput
    from activities.auth import AuthActivities, VerifyInput
    from activities.peers import (
        AttemptFound,
        FindInput,
        FindResult,
        FollowInput,
        LaunchInput,
        MirrorInput,
        PeerActivities,
        StageInput,
        TerminateInput,
    )
    from activities.store import (
        CancelIntentInput,
        EnqueueInput,
        ExpireInput,
        FenceInput,
        HandleStateInput,
        PromoteInput,
        StoreActivities,
    )
    from activities.watch import Observation
    from iris import contract, metrics
    from iris.bundle import BundleRef
    from iris.controller.models import ControllerJobState, LaunchRequest
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import (
        AttemptEnd,
        AttemptView,
        CancelOutcome,
        CancelRequest,
        JobState,
        JobStatus,
        ReplayRequest,
        TaskView,
        WaitReason,
        attempt_end,
        end_code,
        handle_end,
        log_key,
        mirrored_state,
        user_prefix,
    )
    from iris.payloadconverter import still_encrypted
    from iris.policy import (
        CANCELLED_BEFORE_HANDOFF,
        DEADLINE_PASSED,
        QUEUED_REASON,
        Vetting,
        classify,
        pick_backend,
        queued_for_peer_reason,
        vet_placement,
    )
    from iris.policy.models import Band, Classification, Disposition, Placement
    from iris.policy.reasons import ReasonCode
    from iris.reports import FederationView
    from iris.store.models import HandleState, PromoteOutcome
    from iris.userauth import Action, Principal, request_digest

from workflows.job import transitions, versions
from workflows.job.state import Ctx, JobRun, Phase, handover, new_run, read_inputs
from workflows.job.versions import (
    ATTEMPTS_PATCH,
    AUTH_PATCH,
    BUNDLE_PATCH,
    CONTINUE_PATCH,
    EARLIER_ATTEMPT_PATCH,
    FEED_PATCH,
    HOME_LEDGER_PATCH,
    LOCAL_STEPS_PATCH,
    PARK_PATCH,
    PREEMPT_PATCH,
    REASON_PATCH,
    SIGNALS_PATCH,
    SIZE_PATCH,
    SUBMISSION_PATCH,
    TERMINAL_LAUNCH_PATCH,
    TIMERS_PATCH,
    Features,
)

_QUICK = timedelta(seconds=30)
_STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
_REPORTS_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
_ARTIFACT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10), maximum_attempts=5
)
# The launch's and the bundle staging's retries in runs before TIMERS_PATCH; later runs take the
# view's initial and maximum intervals (``_handoff_retry``).
_HANDOFF_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=6,
    non_retryable_error_types=[contract.HANDOFF_REJECTED],
)
_MIRROR_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))


@dataclasses.dataclass(frozen=True)
class _Step:
    """How long one attempt of a handoff activity may take, and how it is retried."""

    timeout: timedelta
    retry: RetryPolicy


_ARTIFACT_STEP = _Step(_QUICK, _ARTIFACT_RETRY)
# Staging a bundle: one try may take this long; retried as the launch (``_handoff_retry``).
_STAGE_TIMEOUT = timedelta(minutes=5)
# Asking a cluster whether it has an attempt: an answer, or "unknown" after a few tries.
_FIND_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
CANCELLED_WHILE_PARKED = "Cancelled while parked after a failed handoff"
_AUTH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
_CONTINUE_AFTER_EVENTS = 2_000
# follow_job answers at the latest after this without a change: a running job's history grows by
# one activity every half hour (and continues as new, see above).
_FOLLOW_MAX_WAIT = timedelta(minutes=30)
# A parked job whose launch's outcome is unknown asks its cluster again after this, doubling to 10 min
# (runs before TIMERS_PATCH; later ones take the view's parked_probe_first_s and parked_probe_max_s).
_PROBE_FIRST = timedelta(seconds=15)
_PROBE_MAX = timedelta(minutes=10)

_In = TypeVar("_In")
_Out = TypeVar("_Out")
_Self = TypeVar("_Self")


def _is_cancellation(exc: BaseException) -> bool:
    """A Temporal cancel of this workflow, as opposed to an activity's own failure."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    return isinstance(exc, ActivityError) and isinstance(exc.cause, TemporalCancelledError)


def _refusal(exc: ActivityError) -> bool:
    """The failure is a cluster's final answer (a refusal, a missing bundle), not a lost one."""
    cause = exc.cause
    return isinstance(cause, ApplicationError) and cause.type in (
        contract.HANDOFF_REJECTED,
        contract.BUNDLE_UNAVAILABLE,
    )


class _Ended(Exception):
    """The job has reached its final state (already recorded): ``run`` returns it."""


class _Parked(Exception):
    """A handoff that cannot complete now: the job parks in HANDOFF_FAILED with this reason and code
    (``resumed``: it was parked already, in the run that continued as new)."""

    def __init__(
        self, reason: str, *, code: ReasonCode = ReasonCode.HandoffFailed, resumed: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.resumed = resumed


class _Adopted(Exception):
    """A parked job's cluster answered that it had the attempt after all: it is followed there."""

    def __init__(self, cluster: str, remote: ControllerJobStatus) -> None:
        super().__init__(cluster)
        self.cluster = cluster
        self.remote = remote


@dataclasses.dataclass(frozen=True)
class _Retry:
    """An attempt ended in a way the job may retry (a failure, or its cluster lost it)."""

    end: AttemptEnd
    reason: str
    # The cluster's "preempted by <job id> at <time>" when it preempted the attempt (PREEMPT_PATCH).
    preempted: str | None = None


@workflow.defn(name=contract.JOB_WORKFLOW)
class JobWorkflow:
    @workflow.init
    def __init__(self, *inputs: Any) -> None:
        # A start carries one payload (the spec), a continued run two (the spec and its JobRun).
        # Both are taken untyped (the SDK decodes a start untyped anyway: one payload for two
        # parameters) and validated here; an input that is not a spec, or that cannot be read
        # (iris/payloadconverter.py), is refused in run()'s first task (SUBMISSION_PATCH), never
        # a task failed for ever.
        spec, carried, self._refused_input = read_inputs(inputs)
        self._sealed_input = any(isinstance(v, RawValue) and still_encrypted(v.payload) for v in inputs)
        # A JobRun comes only from the run this one continues; a raw start with one is refused.
        self._forged_carry = carried is not None and workflow.info().continued_run_id is None
        # Built here, not in run(): a query, signal or Update can arrive in the very first task,
        # before run() starts (e.g. a cancel right after submit).
        self._fresh = new_run(spec, workflow.info().workflow_id)
        self._carried = carried
        self._ctx = Ctx(run=self._fresh)
        if carried is not None:
            carried.runs += 1
            self._ctx = Ctx(run=carried)

    @property
    def _job(self) -> JobRun:
        return self._ctx.run

    # ---- messages -------------------------------------------------------------------------

    @workflow.query(name=contract.STATUS)
    def status(self) -> JobStatus:
        return self._job.status

    @workflow.signal(name=contract.PLACE)
    def place(self, placement: Placement) -> None:
        """From the placement tick: promote the job to this (peer, backend)."""
        # An operator's replay target, already set, is not overridden by the tick.
        if self._job.waiting_in_queue and self._job.mailbox.placement is None:
            self._job.mailbox.placement = placement

    @workflow.signal(name=contract.EXPLAIN)
    def explain(self, reason: str) -> None:
        """From a placement tick that predates reason codes: why the job is still queued. Kept for
        the runs whose history holds one (they replay through it); the code stays as it was."""
        self._explained(reason, None)

    @workflow.signal(name=contract.EXPLAIN_REASON)
    def explain_reason(self, why: WaitReason) -> None:
        """From the placement tick: why the job is still queued (the pending reason) and its code."""
        self._explained(why.reason, why.code)

    def _explained(self, reason: str, code: ReasonCode | None) -> None:
        job = self._job
        job.mailbox.explanation = reason
        if code is not None:
            job.mailbox.explanation_code = code
        if job.status.state is JobState.QUEUED_HANDOFF:
            transitions.move(
                self._ctx, JobState.QUEUED_HANDOFF, reason, code=job.mailbox.explanation_code, record=False
            )

    @workflow.signal(name=contract.EXPIRE)
    def expire(self) -> None:
        """From the placement tick: the scheduling deadline passed. Whoever sent it, it ends only a
        queued job whose own deadline has passed (SIGNALS_PATCH, ``_wait_for_placement``)."""
        job = self._job
        if self._ctx.features.wary and not job.waiting_in_queue:
            # Kept pending, it would also keep the run from continuing as new.
            transitions.event(
                self._ctx,
                job.status.state,
                f"ignored expiry: the job is {job.status.state.value}, not queued",
            )
            return
        job.mailbox.expire = True

    @workflow.signal(name=contract.OBSERVE)
    def observe(self, seen: Observation) -> None:
        """From the watcher of a cluster (docs/DESIGN.md, "Mirroring"): the attempt's status there
        now, or that the cluster has gone silent. Kept for the attempt being followed; one about
        another cluster or attempt, or older than a status already seen, is dropped."""
        job = self._job
        if seen.cluster != job.status.cluster:
            return
        status = seen.status
        if status is not None:
            if status.nonce != job.nonce:
                return
            last = job.mailbox.seen_version
            if last is not None and status.epoch == last[0] and status.version <= last[1]:
                return
            job.mailbox.seen_version = (status.epoch, status.version)
        job.mailbox.observed = seen

    @workflow.signal(name=contract.WANT_LOGS)
    def want_logs(self, until_ms: int) -> None:
        """From a reader of the job's log (``iris job logs -f``): relay it every second until
        ``until_ms``, at most 10 minutes ahead (docs/DESIGN.md, "Logs")."""
        job = self._job
        job.mailbox.logs_until_ms = max(
            job.mailbox.logs_until_ms, min(int(until_ms), transitions.now_ms() + 600_000)
        )

    @workflow.signal(name=contract.CANCEL)
    async def cancel(self, request: CancelRequest) -> None:
        # A cancel whose signature does not verify is recorded and ignored (AUTH_PATCH).
        if await self._refused(Action.CANCEL, request.signature, request) is None:
            self._request_cancel(request)

    @workflow.update(name=contract.CANCEL_JOB)
    async def cancel_job(self, request: CancelRequest) -> CancelOutcome:
        """Cancel, and say whether the cancel won: won = the job was never delivered to a cluster."""
        job = self._job
        if job.status.terminal:
            return job.status.ended_cancel_outcome()
        refusal = await self._refused(Action.CANCEL, request.signature, request)
        if refusal is not None:
            raise ApplicationError(refusal, type=contract.UNAUTHENTICATED, non_retryable=True)
        self._request_cancel(request)
        await workflow.wait_condition(lambda: job.delivered or job.status.terminal)
        st = job.status
        if not job.delivered:
            return CancelOutcome(
                won=True, state=st.state, message="cancelled before handoff; never delivered"
            )
        return CancelOutcome(
            won=False,
            state=st.state,
            message=f"job was already handed to {st.cluster}; termination requested there",
        )

    @workflow.update(name=contract.REPLAY_HANDOFF)
    async def replay_handoff(self, request: ReplayRequest) -> str:
        """Operator: re-run the artifact check and handoff of a parked job (docs/DESIGN.md,
        "Replaying a failed handoff"); the job's owner or an admin, signed (AUTH_PATCH)."""
        refusal = await self._refused(Action.REPLAY, request.signature, request)
        if refusal is not None:
            raise ApplicationError(refusal, type=contract.UNAUTHENTICATED, non_retryable=True)
        if self._authenticating():
            # The job may have moved on while the signature was checked.
            try:
                self._check_replay(request)
            except ValueError as exc:
                raise ApplicationError(str(exc), non_retryable=True) from None
        self._job.mailbox.replay = request
        return f"replay accepted: {request.describe()}"

    @replay_handoff.validator
    def _check_replay(self, request: ReplayRequest) -> None:
        job = self._job
        st = job.status
        if st.state is not JobState.HANDOFF_FAILED or job.mailbox.replay is not None:
            parked = JobState.HANDOFF_FAILED.value
            raise ValueError(
                f"job {st.job_id} is {st.state.value}: replay-handoff applies to jobs parked in {parked}"
            )
        if request.requeue and request.peer:
            raise ValueError("choose --peer or --requeue, not both")
        elsewhere = request.requeue or request.peer not in (None, job.maybe_on and job.maybe_on[0])
        if job.maybe_on is not None and elsewhere and not request.force:
            raise ValueError(
                f"job {st.job_id} may be running on {job.maybe_on[0]}: its last launch went unanswered "
                "and that cluster has not said since; another cluster could run it twice. Wait until it "
                "answers (replay to it is safe), or replay with --force"
            )
        if request.peer is not None:
            if request.peer not in job.clusters:
                raise ValueError(f"unknown cluster {request.peer!r} (known: {', '.join(job.clusters)})")
            if job.pin is not None and request.peer != job.pin:
                raise ValueError(
                    f"job {st.job_id} is pinned to {job.pin}; it cannot be replayed to {request.peer}"
                )

    def _authenticating(self) -> bool:
        """Whether this run verifies signed requests (AUTH_PATCH; memoized by the SDK)."""
        return versions.authenticates()

    async def _refused(self, action: Action, statement: str, request: BaseModel) -> str | None:
        """Why a signed request is refused (recorded as an event), or None if it verifies or this
        run predates AUTH_PATCH. The check is an activity (activities/auth.py), never workflow code."""
        if not self._authenticating():
            return None
        job = self._job
        self._ctx.verifying += 1
        try:
            await self._verify(action, statement, request, transitions.now_ms())
        except ApplicationError as exc:
            refusal = f"{action.label} refused: {exc.message}"
            transitions.event(self._ctx, job.status.state, refusal)
            return refusal
        finally:
            self._ctx.verifying -= 1
        return None

    async def _verdicts(self) -> None:
        """Wait for the requests being verified (none in a run that predates AUTH_PATCH)."""
        if self._ctx.verifying:
            await workflow.wait_condition(lambda: self._ctx.verifying == 0)

    async def _verify(
        self, action: Action, statement: str, request: BaseModel, received_ms: int
    ) -> Principal:
        """The verified principal; ApplicationError with the one-line reason otherwise."""
        spec = self._job.spec
        inp = VerifyInput(
            statement=statement,
            action=action,
            job_id=spec.job_id,
            digest=request_digest(request),
            owner=spec.user,
            production=action is Action.SUBMIT and spec.band is Band.PRODUCTION,
            received_ms=received_ms,
        )
        try:
            return await workflow.execute_activity_method(
                AuthActivities.verify_request, inp, start_to_close_timeout=_QUICK, retry_policy=_AUTH_RETRY
            )
        except ActivityError as exc:
            if _is_cancellation(exc):
                raise
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == contract.UNAUTHENTICATED:
                raise ApplicationError(cause.message, type=contract.UNAUTHENTICATED) from None
            raise ApplicationError(f"the signature could not be checked: {cause or exc}") from None

    def _request_cancel(self, request: CancelRequest) -> None:
        job = self._job
        if job.mailbox.cancel is None and not job.status.terminal:
            job.mailbox.cancel = request
            job.status.cancel_requested = True
            transitions.event(self._ctx, job.status.state, f"cancel requested: {request.reason}")

    # ---- state bookkeeping ----------------------------------------------------------------

    def _store_step(
        self, method: Callable[[StoreActivities, _In], Awaitable[_Out]], arg: _In, *, local: bool = True
    ) -> workflow.ActivityHandle[_Out]:
        """A federation-store transaction: milliseconds on the worker's own store connection, so a
        local activity (no task-queue round trip) unless this run predates the patch or the step
        must be recorded in a workflow task of its own (``local=False``)."""
        if self._ctx.features.local_steps and local:
            return workflow.start_local_activity_method(
                method, arg, start_to_close_timeout=_QUICK, retry_policy=_STORE_RETRY
            )
        return workflow.start_activity_method(
            method, arg, start_to_close_timeout=_QUICK, retry_policy=_STORE_RETRY
        )

    async def _handle_state(
        self,
        state: HandleState,
        reason: str | None = None,
        *,
        counted_from_ms: int | None = None,
        release: bool = False,
    ) -> None:
        job = self._job
        try:
            await self._store_step(
                StoreActivities.set_handle_state,
                HandleStateInput(
                    job_id=job.spec.job_id,
                    incarnation=job.incarnation,
                    state=state,
                    reason=reason,
                    counted_from_ms=counted_from_ms,
                    release=release,
                ),
            )
        except (ActivityError, ApplicationError) as exc:
            # A failed local activity surfaces as its own ApplicationError, a regular one as an
            # ActivityError around it.
            if _is_cancellation(exc):
                raise
            cause = exc.cause if isinstance(exc, ActivityError) else exc
            # The queue's bookkeeping refused a transition; the job itself goes on, and says so.
            transitions.event(self._ctx, job.status.state, f"federation store kept its state: {cause or exc}")

    async def _record_end(self, reason: str | None) -> None:
        """A queued job's handle ends as the job did."""
        end = handle_end(self._job.status.state)
        if self._job.queued and end is not None:
            await self._handle_state(end, reason)

    async def _end(self, state: JobState, reason: str, code: ReasonCode | None = None) -> None:
        transitions.move(self._ctx, state, reason, code=code)
        await self._record_end(reason)

    async def _finish(self, state: JobState, reason: str, code: ReasonCode | None = None) -> NoReturn:
        """The job ends here: ``run`` returns its status."""
        await self._end(state, reason, code)
        raise _Ended

    # ---- the lifecycle --------------------------------------------------------------------

    @workflow.run
    async def run(self, *inputs: Any) -> JobStatus:
        if contract.is_internal_workflow_id(workflow.info().workflow_id):
            # A raw Temporal start past the SDK's check (docs/DESIGN.md, "The Temporal contract"):
            # fail at once, before any command, so the id is free for the workflow it belongs to.
            raise ApplicationError(
                f"workflow id {workflow.info().workflow_id[:80]!r} is reserved for the federation's "
                "own workflows: not a job id",
                non_retryable=True,
            )
        carry = self._carried
        if self._sealed_input and workflow.unsafe.is_replaying():
            # Read before (the run went on), unreadable now: this process lacks a key of the ring.
            # The task (or a replay) fails with that, as the codec itself used to fail it; only a
            # new start that no key here opens is refused (``_admit``).
            raise RuntimeError(self._refused_input)

        def first_run(checked: bool) -> bool:
            nonlocal carry
            if not checked and self._refused_input is not None:
                raise ValueError(self._refused_input)  # before the patch: the task failed (for ever)
            if checked and self._forged_carry:
                # A raw start with a JobRun: a new job, refused in its first task (``_admit``).
                self._ctx, carry = Ctx(run=self._fresh), None
            return carry is None

        def classifying(reasons: bool, local_steps: bool) -> None:
            job = self._job
            # The CLASSIFYING move below writes as these two features say.
            self._ctx.features = Features(reasons=reasons, local_steps=local_steps)
            job.local_steps = local_steps
            if reasons:
                job.sa_reason = workflow.info().typed_search_attributes.get(contract.SA_REASON)
            if local_steps:
                job.sa_state = JobState.CLASSIFYING.value  # set by the client at start
            transitions.event(self._ctx, JobState.CLASSIFYING, job.status.reason)
            transitions.move(self._ctx, JobState.CLASSIFYING, job.status.reason)

        # First of all: whether this run's input is checked decides which job it is.
        features = versions.read(
            first_run=first_run, classifying=classifying, carried_local_steps=self._job.local_steps
        )
        self._ctx.features = features
        job = self._job
        if carry is not None and features.reasons:
            # The visibility store holds what the run that continued as new last upserted.
            job.sa_reason = workflow.info().typed_search_attributes.get(contract.SA_REASON)
        authenticating = features.authenticating
        try:
            try:
                await (self._lifecycle(authenticating) if carry is None else self._resume(carry))
            except (asyncio.CancelledError, ActivityError) as exc:
                # Temporal's own cancel converges on the same path as the signal and the update.
                # It surfaces as CancelledError, or as ActivityError(CancelledError) from the
                # activity that was running when it arrived.
                if not _is_cancellation(exc):
                    raise
                self._request_cancel(CancelRequest(reason="Cancelled through Temporal"))
                await self._after_temporal_cancel()
        except _Ended:
            pass
        await workflow.wait_condition(workflow.all_handlers_finished)
        return job.status

    async def _lifecycle(self, authenticating: bool = False) -> None:
        if self._ctx.features.checked:
            await self._admit()
        if authenticating:
            await self._authenticate()
        view, decision = await self._classify()
        # The resolved pin (exact cluster id, whatever case the user typed), the home cluster
        # included: an operator's replay must keep to it too.
        self._job.pin = decision.pinned_cluster
        if decision.disposition is Disposition.REJECT:
            await self._finish(JobState.REJECTED, decision.reason, decision.code)
        if self._job.mailbox.cancel is not None:
            await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
        if decision.disposition is Disposition.LOCAL:
            if decision.placement is not None and versions.home_ledger():
                placement = await self._reserve_home(decision.placement)
                backend = placement.backend_id or self._backend_for(view, placement.peer_id)
                await self._deliver(view, placement.peer_id, backend)
                return
            await self._deliver(view, view.home, self._backend_for(view, view.home))
            return
        placement = await self._queue()
        # A force-routed placement names no backend (docs/DESIGN.md, "Pins and force-routing"):
        # the peer gets its best guess.
        backend = placement.backend_id or self._backend_for(view, placement.peer_id)
        await self._deliver(view, placement.peer_id, backend)

    async def _authenticate(self) -> None:
        """No unverified job reaches classification: a submission whose statement does not verify
        (or whose principal may not submit it) ends REJECTED, having started nothing."""
        job = self._job
        started = workflow.info().workflow_start_time
        try:
            # Expiry is judged when Temporal accepted the start, not when a worker got to it.
            principal = await self._verify(
                Action.SUBMIT, job.spec.signature, job.spec, int(started.timestamp() * 1000)
            )
        except ApplicationError as exc:
            await self._finish(
                JobState.REJECTED, f"submission refused: {exc.message}", ReasonCode.SubmissionRefused
            )
        prefix = user_prefix(principal.name)
        if self._ctx.features.checked and not job.spec.job_id.startswith(f"{prefix}/"):
            # Another user's name: the job would run, and hold the name, as theirs.
            await self._finish(
                JobState.REJECTED,
                f"submission refused: job id {job.spec.job_id[:80]!r} is not under {prefix}/, the "
                f"job ids of its signer {principal.name[:64]}",
                ReasonCode.SubmissionRefused,
            )
        job.principal = principal.name
        transitions.event(
            self._ctx, JobState.CLASSIFYING, f"submitted by {principal.name} (signature verified)"
        )

    async def _admit(self) -> None:
        """SUBMISSION_PATCH: a start whose input is not one JobSpec the SDK would submit, or that
        runs under another workflow id than its job id, ends REJECTED here, in its first task,
        before anything is verified, enqueued, reserved or launched (docs/DESIGN.md, "User →
        home")."""
        job = self._job
        why = self._refused_input
        if why is None and self._forged_carry:
            why = (
                "a new job's start holds one input, its signed spec (a carry comes only from the run "
                "it continues)"
            )
        if why is not None:
            await self._finish(JobState.REJECTED, f"submission refused: {why}", ReasonCode.InvalidSubmission)
        try:
            job.spec.check()
        except ValueError as exc:
            await self._finish(
                JobState.REJECTED,
                f"submission refused: invalid job spec: {exc}",
                ReasonCode.InvalidSubmission,
            )
        workflow_id = workflow.info().workflow_id
        if workflow_id != contract.job_workflow_id(job.spec.job_id):
            # A captured signed spec started under another id: the tick and the watchers signal it
            # by its job id, so it would wait for ever; its statement binds that job id only.
            await self._finish(
                JobState.REJECTED,
                f"submission refused: the signed spec is job {job.spec.job_id[:80]!r}, started as "
                f"workflow {workflow_id[:80]!r}",
                ReasonCode.SubmissionRefused,
            )

    async def _resume(self, carry: JobRun) -> None:
        """Pick the job up where the run that continued as new left it."""
        view = carry.view
        assert view is not None
        if carry.phase is Phase.QUEUED:
            placement = await self._await_promotion()
            backend = placement.backend_id or self._backend_for(view, placement.peer_id)
            await self._deliver(view, placement.peer_id, backend)
        elif carry.phase is Phase.FOLLOWING:
            assert carry.remote is not None
            await self._deliver(view, carry.cluster, carry.backend, following=carry.remote)
        else:
            await self._deliver(view, carry.cluster, carry.backend, parked=carry.status.reason)

    def _continue_due(self) -> bool:
        """Whether this run's history is long enough to continue as new (at a quiet point)."""
        if not self._ctx.features.can_continue:
            return False
        info = workflow.info()
        long = info.get_current_history_length() >= _CONTINUE_AFTER_EVENTS
        return long or info.is_continue_as_new_suggested()

    def _quiet(self) -> bool:
        return self._job.mailbox.quiet

    async def _continue_as_new(
        self,
        phase: Phase,
        *,
        cluster: str = "",
        backend: str = "",
        remote: ControllerJobStatus | None = None,
    ) -> None:
        """Continue as new if due and nothing is pending; returns (doing nothing) otherwise."""
        if not self._continue_due():
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        if not self._quiet():
            return
        job = self._job
        assert job.view is not None
        job.phase, job.cluster, job.backend, job.remote = phase, cluster, backend, remote
        workflow.continue_as_new(args=[job.spec, handover(job)])

    async def _classify(self) -> tuple[FederationView, Classification]:
        """CLASSIFYING: home now, the queue, or rejected (docs/DESIGN.md, "Classification")."""
        job = self._job
        workflow.metric_meter().create_counter(
            metrics.JOBS_SUBMITTED, "Jobs whose workflow began classifying them"
        ).add(1, self._metric_labels())
        # A regular activity, not a local one: the first workflow task must not hold local
        # activities, since an Update (a cancel right after submit) accepted in that task can then
        # be answered with a protocol message the server rejects for ever
        # (BadUpdateWorkflowExecutionMessage, seen here about once in 250 instant cancels).
        view = await workflow.execute_activity_method(
            PeerActivities.fetch_reports, start_to_close_timeout=_QUICK, retry_policy=_REPORTS_RETRY
        )
        decision = classify(
            job.spec.shape(),
            home=view.home,
            reports=view.reports,
            # Judged when the reports were read: a workflow task delayed by a worker crash must
            # not turn fresh reports stale and reject a job the federation can run.
            now_ms=view.fetched_ms if view.fetched_ms is not None else transitions.now_ms(),
            stale_after_ms=view.stale_after_ms,
            configured=view.configured,
            reservations=view.reservations,
            reject_too_large=self._ctx.features.sizing,
        )
        job.clusters = tuple(r.peer_id for r in view.reports)
        job.view = view
        job.lost_after_s = view.peer_lost_after_s
        job.status.disposition = decision.disposition.value
        job.status.classification_reason = decision.reason
        transitions.event(
            self._ctx, JobState.CLASSIFYING, f"classified {decision.disposition.value}: {decision.reason}"
        )
        return view, decision

    async def _queue(self) -> Placement:
        """QUEUED_HANDOFF until the tick places the job and the CAS promotes it."""
        job = self._job
        await self._enqueue()
        transitions.move(
            self._ctx, JobState.QUEUED_HANDOFF, queued_for_peer_reason(job.pin) if job.pin else QUEUED_REASON
        )
        if job.mailbox.explanation is not None:
            transitions.move(
                self._ctx,
                JobState.QUEUED_HANDOFF,
                job.mailbox.explanation,
                code=job.mailbox.explanation_code,
                record=False,
            )
        return await self._await_promotion()

    async def _reserve_home(self, placement: Placement) -> Placement:
        """A LOCAL job takes home's capacity through the queue's CAS and ledger, as a promotion by
        the tick does (docs/DESIGN.md, "The ledger"): a burst of submits never runs more at home
        than home has room for. One the CAS refuses (home filled up since the reports were read)
        waits in the queue, home still a candidate."""
        job = self._job
        await self._enqueue()
        promoted = await self._promote(placement)
        if promoted is not None:
            job.mailbox.placement = None  # a tick's offer that raced the promotion is moot
            job.queued_since_ms = None  # run at home at once: it never waited in the queue
            return promoted
        job.status.disposition = Disposition.QUEUE.value
        transitions.move(
            self._ctx,
            JobState.QUEUED_HANDOFF,
            f"{QUEUED_REASON} (home filled up since the reports were read)",
            code=ReasonCode.NoCapacity,
        )
        if job.mailbox.explanation is not None:
            transitions.move(
                self._ctx,
                JobState.QUEUED_HANDOFF,
                job.mailbox.explanation,
                code=job.mailbox.explanation_code,
                record=False,
            )
        return await self._await_promotion()

    async def _enqueue(self) -> None:
        job = self._job
        # Set first: if a Temporal cancel interrupts this await after the insert committed, the
        # cancel path must still record the handle's end, or the queue keeps a zombie.
        job.queued = True
        job.queued_since_ms = transitions.now_ms()
        # Shielded: a Temporal cancel must not abandon the insert half-way; the cancel path waits
        # for it and then records the cancel against the handle it wrote.
        shape = job.spec.shape().model_copy(update={"target_cluster": job.pin})
        self._ctx.enqueue_op = self._store_step(
            StoreActivities.enqueue_job, EnqueueInput(shape=shape, incarnation=job.incarnation)
        )
        await asyncio.shield(self._ctx.enqueue_op)

    def _backend_for(self, view: FederationView, cluster: str) -> str:
        """The backend to name when nothing chose one: the best of the cluster's reported backends,
        else of its configured ones (a cluster unreachable when the view was read reports none)."""
        report = view.report(cluster)
        if report is not None and not report.backends and view.configured.get(cluster):
            report = report.model_copy(update={"backends": view.configured[cluster]})
        chosen = pick_backend(self._job.spec.shape(), report) if report is not None else None
        if chosen is None and report is not None and report.backends:
            chosen = report.backends[0].backend_id
        return chosen or ""

    async def _await_promotion(self) -> Placement:
        """Wait for a placement, then promote by CAS; a CAS that loses to nothing final waits again.
        A placement the tick signalled is vetted first (SIGNALS_PATCH), an operator's replay not."""
        job = self._job
        while True:
            placement = await self._wait_for_placement()
            vouched, job.mailbox.vouched = job.mailbox.vouched, False
            if self._ctx.features.wary and not vouched:
                vetted = await self._vetted(placement)
                if vetted is None:
                    continue
                placement = vetted
            promoted = await self._promote(placement)
            if promoted is not None:
                self._queue_waited()
                return promoted

    async def _wait_for_placement(self) -> Placement:
        """The tick's (or an operator's) placement; a cancel or the deadline ends the job instead.
        With SIGNALS_PATCH an ``expire`` signal before the job's own deadline is ignored."""
        job = self._job
        deadline_ms = job.spec.shape().deadline_ms
        while True:
            own_timer = False
            while True:
                timeout = None
                if deadline_ms is not None:
                    timeout = timedelta(milliseconds=max(1, deadline_ms - transitions.now_ms()))
                try:
                    await workflow.wait_condition(
                        lambda: not self._quiet() or self._continue_due(), timeout=timeout
                    )
                except TimeoutError:
                    job.mailbox.expire = own_timer = True
                if not self._quiet():
                    break
                await self._continue_as_new(Phase.QUEUED)
            if job.mailbox.cancel is not None:
                await self._cancel_queued()
            if (
                job.mailbox.expire
                and self._ctx.features.wary
                and not own_timer
                and not self._deadline_passed(deadline_ms)
            ):
                job.mailbox.expire = False
                due = "the job has no scheduling deadline"
                if deadline_ms is not None:
                    due = f"the job's deadline is {(deadline_ms - transitions.now_ms()) / 1000:.0f}s away"
                transitions.event(self._ctx, job.status.state, f"ignored expiry: {due}")
                if job.mailbox.placement is None:
                    continue
            if job.mailbox.expire:
                await self._store_step(
                    StoreActivities.expire_job,
                    ExpireInput(job_id=job.spec.job_id, incarnation=job.incarnation),
                )
                await self._finish(JobState.UNSCHEDULABLE, DEADLINE_PASSED)
            placement, job.mailbox.placement = job.mailbox.placement, None
            assert placement is not None
            return placement

    def _deadline_passed(self, deadline_ms: int | None) -> bool:
        return deadline_ms is not None and transitions.now_ms() >= deadline_ms

    async def _vetted(self, offer: Placement) -> Placement | None:
        """The placement to promote for the ``place`` signal ``offer``: its cluster and backend
        re-checked against the job's pin and constraints, with the job's own reservation
        (iris/policy/vetting.py), on the view the job was classified with, read again when that
        view cannot vouch for it. None: refused, recorded as an event; the job waits on."""
        job = self._job
        assert job.view is not None
        verdict = self._vet(offer, job.view)
        if not verdict.vouched:
            try:
                job.view = await workflow.execute_activity_method(
                    PeerActivities.fetch_reports, start_to_close_timeout=_QUICK, retry_policy=_REPORTS_RETRY
                )
            except ActivityError as exc:
                if _is_cancellation(exc):
                    raise
            else:
                verdict = self._vet(offer, job.view)
        if verdict.placement is None:
            target = f"{offer.peer_id[:80]}/{offer.backend_id[:80] or '-'}"
            transitions.event(self._ctx, job.status.state, f"ignored placement {target}: {verdict.refusal}")
            return None
        return verdict.placement

    def _vet(self, offer: Placement, view: FederationView) -> Vetting:
        report = view.report(offer.peer_id)
        backends = list(report.backends) if report is not None else []
        if not backends:
            backends = list(view.configured.get(offer.peer_id, ()))
        return vet_placement(self._job.spec.shape(), offer, pin=self._job.pin, backends=backends)

    def _metric_labels(self) -> dict[str, str]:
        spec = self._job.spec
        return {"band": spec.band.label, "device": spec.metric_device}

    def _queue_waited(self) -> None:
        """A won promotion: the time since the job entered the queue, to iris_queue_wait_seconds.
        Metrics add no command, and none is recorded while a history replays."""
        job = self._job
        if job.queued_since_ms is None:
            return
        waited_s = max(0, transitions.now_ms() - job.queued_since_ms) / 1000
        job.queued_since_ms = None
        workflow.metric_meter().create_histogram_float(
            metrics.QUEUE_WAIT, "From entering the federation queue to a won promotion", "s"
        ).record(waited_s, self._metric_labels())

    async def _promote(self, placement: Placement, *, retake: bool = False) -> Placement | None:
        """The promotion CAS (docs/DESIGN.md, "Promotion (the CAS)"): the placement with its backend
        if it won, None if the job waits for another tick; a cancel or expiry that won ends it.
        ``retake``: a parked job's replay in place takes its released capacity again (PARK_PATCH);
        refused, the job goes back to the queue to wait for another tick."""
        job = self._job
        # The CAS runs only while this workflow's cancellation state is clear; shielded so a
        # Temporal cancel never abandons it half-way (the store then decides who won). Not a
        # local activity: its answer must be in the history before the workflow task that
        # schedules the launch, which an operator's reset of a refused handoff goes back to;
        # a reset that re-ran the CAS against the ended handle would wait forever.
        result = await asyncio.shield(
            self._store_step(
                StoreActivities.promote_job,
                PromoteInput(
                    job_id=job.spec.job_id, incarnation=job.incarnation, placement=placement, retake=retake
                ),
                local=False,
            )
        )
        target = f"{placement.peer_id}/{placement.backend_id or '-'}"
        if result.promoted:
            backend = (result.handle.assigned_backend if result.handle else None) or placement.backend_id
            transitions.event(
                self._ctx, job.status.state, f"promoted to {target}: {placement.reason or 'placed'}"
            )
            job.promoted = placement.model_copy(update={"backend_id": backend})
            return job.promoted
        handle = result.handle
        if result.outcome is PromoteOutcome.CANCELLED or (handle is not None and handle.cancel_requested):
            await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
        if result.outcome is PromoteOutcome.EXPIRED or (
            handle is not None and handle.state is HandleState.UNSCHEDULABLE
        ):
            await self._finish(JobState.UNSCHEDULABLE, DEADLINE_PASSED)
        transitions.event(self._ctx, job.status.state, f"promotion to {target} refused: {result.message}")
        if retake:
            # Still parked in the store: back to the queue, where the tick finds it room.
            await self._requeue()
        # Capacity another promotion took first: the job waits for room, as the tick would say.
        code = ReasonCode.NoCapacity if result.outcome is PromoteOutcome.NO_CAPACITY else ReasonCode.Pending
        transitions.move(
            self._ctx,
            JobState.QUEUED_HANDOFF,
            f"Waiting for the next tick: {result.message}",
            code=code,
            record=False,
        )
        return None

    async def _cancel_before_handoff(self) -> NoReturn:
        """A cancel seen while preparing a handoff that was never sent: the job is never delivered."""
        if self._job.queued:
            await self._cancel_queued()
        await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)

    async def _cancel_queued(self) -> NoReturn:
        """Record the cancel intent in the store; either way the job is never delivered."""
        job = self._job
        assert job.mailbox.cancel is not None
        outcome = await self._store_step(
            StoreActivities.record_cancel,
            CancelIntentInput(job_id=job.spec.job_id, reason=job.mailbox.cancel.reason),
        )
        if not outcome.won:
            transitions.event(
                self._ctx,
                JobState.PENDING_HANDOFF,
                "cancel arrived after promotion; the job is not handed off",
            )
        await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)

    # ---- the handoff ----------------------------------------------------------------------

    async def _deliver(
        self,
        view: FederationView,
        cluster: str,
        backend: str,
        *,
        following: ControllerJobStatus | None = None,
        parked: str | None = None,
    ) -> None:
        """Attempts until the job ends: hand off to ``cluster`` and follow it there; a parked
        handoff waits for an operator's replay or a cancel (docs/DESIGN.md, "Errors, retries and
        parking"); an attempt that failed or that its cluster lost is followed by another while the
        job has retries left (docs/DESIGN.md, "Attempts")."""
        while True:
            try:
                if following is not None:
                    remote, following = following, None
                elif parked is not None:
                    reason, parked = parked, None
                    raise _Parked(reason, resumed=True)  # its code is in the carried status
                else:
                    remote = await self._hand_off(view, cluster, backend)
            except _Adopted as earlier:
                # An earlier attempt succeeded on the cluster this one was about to go to.
                cluster, remote = earlier.cluster, await self._relay_end(earlier.cluster, earlier.remote)
            except _Parked as stopped:
                try:
                    replay = await self._park(stopped, cluster, backend)
                except _Adopted as adopted:
                    cluster, remote = adopted.cluster, adopted.remote
                    if remote.terminal:
                        # Ended before the answer came: its output still has to be relayed home.
                        remote = await self._relay_end(cluster, remote)
                else:
                    cluster, backend = await self._replay_target(view, cluster, backend, replay)
                    continue
            retry = await self._follow(cluster, remote)
            if retry is None:
                return
            cluster, backend = await self._next_attempt(view, cluster, retry)

    async def _hand_off(self, view: FederationView, cluster: str, backend: str) -> ControllerJobStatus:
        """PENDING_HANDOFF → artifact check → BUILDING → launch → HANDED_OFF: the job's status on
        ``cluster`` as the launch answered it."""
        job = self._job
        job.status.backend_id = backend
        home = job.view is not None and cluster == job.view.home
        prepare = f"Runs at home on {cluster}" if home or not job.queued else f"Promoted to {cluster}"
        transitions.move(
            self._ctx, JobState.PENDING_HANDOFF, f"{prepare}; preparing the handoff", cluster=cluster
        )
        await self._verdicts()
        if job.mailbox.cancel is not None:
            await self._cancel_before_handoff()
        if job.spec.artifacts:
            await self._check_artifacts(cluster)
        bundle = job.spec.bundle if job.spec.bundle is not None and versions.stages_bundle() else None
        if bundle is not None:
            await self._stage_bundle(cluster, bundle)
        launched = await self._launch(view, cluster, backend, bundle)
        if cluster != view.home:
            transitions.move(self._ctx, JobState.HANDED_OFF, f"Accepted by {cluster}")
        else:
            transitions.event(self._ctx, JobState.HANDED_OFF, f"Accepted by the home cluster {cluster}")
        if job.queued:
            # The cluster's own clock at acceptance: its capacity reports count the job from then.
            await self._handle_state(HandleState.HANDED_OFF, counted_from_ms=launched.created_ms)
        if launched.terminal and versions.relays_terminal_launch():
            # A launch repeated after a lost reply can find the job already ended: its output
            # still has to be relayed home, which the mirror does before it reports an end.
            launched = await self._relay_end(cluster, launched)
        return launched

    async def _check_artifacts(self, cluster: str) -> None:
        """The destination checks the job's artifacts in its own store (docs/DESIGN.md,
        "Artifact check"); one it cannot read parks the job."""
        artifacts = self._job.spec.artifacts
        transitions.move(
            self._ctx,
            JobState.PENDING_HANDOFF,
            f"Checking {len(artifacts)} artifact(s) in {cluster}'s object store",
        )
        why = f"Cannot check artifacts in {cluster}'s object store"
        check = ArtifactInput(cluster=cluster, uris=artifacts)
        report = await self._handoff_step(ArtifactActivities.check_artifacts, check, _ARTIFACT_STEP, why)
        if report.missing:
            more = f" (+{len(report.missing) - 1} more)" if len(report.missing) > 1 else ""
            raise _Parked(report.reasons[0] + more, code=ReasonCode.ArtifactMissing)
        if self._job.mailbox.cancel is not None:
            await self._cancel_before_handoff()

    async def _stage_bundle(self, cluster: str, bundle: BundleRef) -> None:
        """BUILDING: the workspace bundle goes to ``cluster`` before the launch (docs/DESIGN.md,
        "Workspace bundles")."""
        transitions.move(
            self._ctx, JobState.BUILDING, f"Staging workspace bundle {bundle.describe()} on {cluster}"
        )
        why = f"Cannot stage the workspace bundle on {cluster}"
        stage = StageInput(cluster=cluster, bundle=bundle)
        step = _Step(_STAGE_TIMEOUT, self._handoff_retry())
        staged = await self._handoff_step(PeerActivities.stage_bundle, stage, step, why)
        done = "uploaded to" if staged.uploaded else "already on"
        transitions.event(self._ctx, JobState.BUILDING, f"workspace bundle {bundle.short} {done} {cluster}")
        if self._job.mailbox.cancel is not None:
            await self._cancel_before_handoff()

    async def _launch(
        self, view: FederationView, cluster: str, backend: str, bundle: BundleRef | None
    ) -> ControllerJobStatus:
        """The handoff: a signed launch under the job's id and the attempt's nonce (docs/DESIGN.md,
        "Launch"). From the workflow task that schedules it on, the job counts as delivered."""
        job = self._job
        if self._ctx.verifying and not job.delivered:
            await self._verdicts()
            if job.mailbox.cancel is not None:
                await self._cancel_before_handoff()
        transitions.move(self._ctx, JobState.PENDING_HANDOFF, f"Awaiting acceptance by {cluster}")
        job.delivered = True
        job.status.handoff_attempts += 1
        await self._clear_stale(cluster)
        self._attempt_started(cluster, backend)
        spec = job.spec
        try:
            request = LaunchRequest(
                job_id=spec.job_id,
                command=spec.command,
                env=spec.env,
                device=spec.device,
                band=spec.band,
                # The verified principal: a peer's allowed_submitters judges who signed, not a claim.
                user=job.principal or spec.user,
                requester=view.home,
                nonce=job.nonce,
                backend_id=backend,
                bundle=bundle,
                timeout_s=spec.timeout_s,
                preemptions=job.preemptions_retried,
            )
        except ValidationError as exc:
            if not self._ctx.features.checked:
                raise
            # No backend known on the cluster, say (SUBMISSION_PATCH): parked, not a task failed
            # for ever. Nothing was sent.
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise _Parked(f"Cannot hand off to {cluster}: {where}: {first['msg'][:120]}") from None
        try:
            # Shielded like the enqueue: a Temporal cancel lets the launch finish, then
            # terminates on the peer (a swallowed cancel would let the job run on).
            self._ctx.launch_op = workflow.start_activity_method(
                PeerActivities.launch_job,
                LaunchInput(cluster=cluster, request=request),
                start_to_close_timeout=_QUICK,
                retry_policy=self._handoff_retry(),
            )
            return await asyncio.shield(self._ctx.launch_op)
        except ActivityError as exc:
            why = f"Handoff to {cluster} failed after retries"
            if _is_cancellation(exc) or _refusal(exc) or not self._ctx.features.numbered:
                await self._refused_or_parked(exc, why)
            # No answer, but the launch may have landed: the cluster says whether it has the job.
            found = await self._find_attempt(cluster, job.nonce)
            if found.found is AttemptFound.HERE and found.status is not None:
                transitions.event(
                    self._ctx, JobState.PENDING_HANDOFF, f"{cluster} has the job although its answer was lost"
                )
                return found.status
            if found.found is AttemptFound.ABSENT:
                raise _Parked(
                    f"{why}: {exc.cause or exc}; {cluster} confirms it never received the job"
                ) from None
            job.maybe_on = (cluster, job.nonce)
            raise _Parked(
                f"{why}: {exc.cause or exc}; the outcome is unknown: {cluster} does not answer, and "
                f"the job may be running there",
                code=ReasonCode.PeerUnreachable,
            ) from None

    def _handoff_retry(self) -> RetryPolicy:
        """How the launch and the bundle staging are retried: the view's schedule (TIMERS_PATCH),
        else _HANDOFF_RETRY."""
        view = self._job.view
        if not self._ctx.features.timers or view is None:
            return _HANDOFF_RETRY
        return dataclasses.replace(
            _HANDOFF_RETRY,
            initial_interval=timedelta(seconds=view.handoff_retry_initial_s),
            maximum_interval=timedelta(seconds=view.handoff_retry_max_s),
        )

    def _probe_schedule(self) -> tuple[timedelta, timedelta]:
        """When a parked job first asks its cluster again, and the most it waits between two asks:
        the view's (TIMERS_PATCH), else _PROBE_FIRST and _PROBE_MAX."""
        view = self._job.view
        if not self._ctx.features.timers or view is None:
            return _PROBE_FIRST, _PROBE_MAX
        return timedelta(seconds=view.parked_probe_first_s), timedelta(seconds=view.parked_probe_max_s)

    async def _clear_stale(self, cluster: str) -> None:
        """Before a later attempt on ``cluster``: an earlier attempt there that its cluster lost
        (silent) may be running again; it is stopped first (a cluster runs one attempt at a time).
        One that ended SUCCEEDED while its cluster was silent is the job's result: ``_Adopted``,
        and no new run starts (docs/DESIGN.md, "Attempts")."""
        job = self._job
        for earlier in list(job.status.attempts):
            if earlier.cluster != cluster or earlier.end != AttemptEnd.PREEMPTED.value:
                continue
            if earlier.preempted is not None:
                continue  # the cluster preempted it: ended there for good, nothing to ask
            if not (self._ctx.features.numbered and versions.asks_earlier_attempt()):
                await self._terminate(cluster, earlier.nonce)
                continue
            found = await self._find_attempt(cluster, earlier.nonce)
            if found.found is AttemptFound.ABSENT:
                continue  # the cluster holds nothing of that attempt any more
            status = found.status
            if found.found is not AttemptFound.HERE or status is None or not status.terminal:
                await self._terminate(cluster, earlier.nonce)
                continue
            end = attempt_end(status.state, status.error)
            if end is AttemptEnd.SUCCEEDED:
                transitions.event(
                    self._ctx,
                    job.status.state,
                    f"attempt {earlier.number} succeeded on {cluster} while {cluster} was silent: "
                    "its result stands, and no new run starts",
                )
                # The earlier attempt is the job's again: its output is relayed under its number.
                job.attempt = earlier.number
                earlier.end = earlier.ended_ms = earlier.reason = None
                raise _Adopted(cluster, status)
            transitions.event(
                self._ctx,
                job.status.state,
                f"attempt {earlier.number} had ended on {cluster} while {cluster} was silent "
                f"({end.value.lower()})",
            )

    def _attempt_started(self, cluster: str, backend: str) -> None:
        """The attempt being delivered, as ``describe`` lists it (one entry per cluster and nonce)."""
        job = self._job
        attempts = job.status.attempts
        if attempts and attempts[-1].nonce == job.nonce and attempts[-1].cluster == cluster:
            return
        if attempts and attempts[-1].end is None and attempts[-1].nonce == job.nonce:
            attempts[-1].end, attempts[-1].ended_ms = "NOT_DELIVERED", transitions.now_ms()
        attempts.append(
            AttemptView(
                number=job.attempt,
                cluster=cluster,
                backend_id=backend,
                nonce=job.nonce,
                started_ms=transitions.now_ms(),
            )
        )

    def _attempt_ended(
        self, end: AttemptEnd, reason: str, exit_code: int | None, preempted: str | None = None
    ) -> None:
        attempts = self._job.status.attempts
        if not attempts:
            return
        # The current attempt: the latest, unless an earlier one was adopted (``_clear_stale``).
        nonce = self._job.nonce
        current = next((a for a in reversed(attempts) if a.nonce == nonce), attempts[-1])
        current.end, current.reason, current.exit_code = end.value, reason, exit_code
        current.ended_ms = transitions.now_ms()
        if preempted is not None:
            current.preempted = preempted

    async def _find_attempt(self, cluster: str, nonce: str) -> FindResult:
        return await workflow.execute_activity_method(
            PeerActivities.find_attempt,
            FindInput(cluster=cluster, job_id=self._job.spec.job_id, nonce=nonce),
            start_to_close_timeout=_QUICK,
            retry_policy=_FIND_RETRY,
        )

    async def _handoff_step(
        self, method: Callable[[_Self, _In], Awaitable[_Out]], arg: _In, step: _Step, parked: str
    ) -> _Out:
        """One activity of the handoff; failing for good, it ends or parks the job (``parked``: why)."""
        try:
            return await workflow.execute_activity_method(
                method, arg, start_to_close_timeout=step.timeout, retry_policy=step.retry
            )
        except ActivityError as exc:
            await self._refused_or_parked(exc, parked)

    async def _refused_or_parked(self, exc: ActivityError, parked: str) -> NoReturn:
        """A handoff step failed for good: the cluster's refusal ends the job (HANDOFF_REJECTED); a
        missing bundle or an outage past the retries parks it for an operator (``parked``: why)."""
        if _is_cancellation(exc):
            raise exc
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == contract.HANDOFF_REJECTED:
            await self._finish(JobState.HANDOFF_REJECTED, cause.message)
        if isinstance(cause, ApplicationError) and cause.type == contract.BUNDLE_UNAVAILABLE:
            raise _Parked(cause.message)
        raise _Parked(f"{parked}: {cause or exc}")

    async def _park(self, parked: _Parked, cluster: str, backend: str) -> ReplayRequest:
        """HANDOFF_FAILED waits for an operator's replay or a cancel; never dropped silently. While
        the last launch's outcome is unknown, its cluster is asked again and again: the cluster,
        not a guess, says whether the job started there (``_Adopted`` if it did)."""
        job = self._job
        if not parked.resumed:
            transitions.move(self._ctx, JobState.HANDOFF_FAILED, parked.reason, code=parked.code)
            if job.queued:
                release = self._frees_capacity()
                await self._handle_state(HandleState.HANDOFF_FAILED, parked.reason, release=release)
                job.released = release
        probe_in, probe_max = self._probe_schedule()
        while True:
            try:
                await workflow.wait_condition(
                    lambda: job.mailbox.cancel is not None or job.mailbox.replay is not None,
                    timeout=probe_in if job.maybe_on is not None else None,
                )
            except TimeoutError:
                await self._probe_parked()
                probe_in = min(probe_in * 2, probe_max)
                await self._continue_as_new(Phase.PARKED, cluster=cluster, backend=backend)
                continue
            break
        if job.mailbox.cancel is not None:
            await self._finish(JobState.KILLED, await self._stop_maybe_running())
        replay, job.mailbox.replay = job.mailbox.replay, None
        assert replay is not None
        return replay

    async def _probe_parked(self) -> None:
        """Ask the cluster whose launch went unanswered whether it has the attempt."""
        job = self._job
        assert job.maybe_on is not None
        cluster, nonce = job.maybe_on
        found = await self._find_attempt(cluster, nonce)
        if found.found is AttemptFound.HERE and found.status is not None:
            job.maybe_on = None
            transitions.event(
                self._ctx, JobState.HANDOFF_FAILED, f"{cluster} answers: it has the job; following it there"
            )
            raise _Adopted(cluster, found.status)
        if found.found is AttemptFound.ABSENT:
            job.maybe_on = None
            reason = (
                f"Handoff to {cluster} failed after retries; {cluster} confirms it never received the job"
            )
            transitions.move(self._ctx, JobState.HANDOFF_FAILED, reason)
            if job.queued and not job.released and self._frees_capacity():
                # Known not to run there now: its capacity is freed (PARK_PATCH).
                await self._handle_state(HandleState.HANDOFF_FAILED, reason, release=True)
                job.released = True

    def _frees_capacity(self) -> bool:
        """Whether a park releases the job's reservation now (PARK_PATCH): only when the job is
        known not to run on its cluster (no launch of the attempt whose outcome is unknown), and
        its won promotion is known, to be taken again by a replay in place."""
        job = self._job
        return (
            self._ctx.features.frees
            and self._ctx.features.numbered
            and job.maybe_on is None
            and job.promoted is not None
        )

    async def _stop_maybe_running(self) -> str:
        """A cancel of a parked job: if its last launch may have landed, terminate it there and wait
        for the cluster to confirm (or to say it never had it); a cluster silent past
        peer_lost_after gets a fence, which terminates the attempt when it answers again. Returns
        the job's final reason."""
        job = self._job
        if job.maybe_on is None:
            return CANCELLED_WHILE_PARKED
        cluster, nonce = job.maybe_on
        job.maybe_on = None
        if await self._terminate(cluster, nonce):
            return f"{CANCELLED_WHILE_PARKED}; {cluster} confirms the job is not running there"
        await self._fence(cluster, nonce)
        return (
            f"{CANCELLED_WHILE_PARKED}; {cluster} did not answer for {job.lost_after_s:.0f}s: the "
            "attempt is fenced there (terminated as soon as it answers)"
        )

    async def _replay_target(
        self, view: FederationView, cluster: str, backend: str, replay: ReplayRequest
    ) -> tuple[str, str]:
        """Where an operator's replay goes: the same cluster, another one, or back through the queue."""
        job = self._job
        transitions.event(self._ctx, JobState.HANDOFF_FAILED, f"operator replay: {replay.describe()}")
        if not replay.requeue and (replay.peer is None or replay.peer == cluster):
            if job.released:
                return await self._retake(view, cluster, backend)
            return cluster, backend
        if job.maybe_on is not None:
            # Forced past an unknown outcome (the validator refuses it otherwise): whatever that
            # cluster may run of this attempt is terminated there as soon as it answers.
            transitions.event(
                self._ctx, JobState.HANDOFF_FAILED, f"forced: the attempt {cluster} may run is fenced"
            )
            await self._fence(*job.maybe_on)
            job.maybe_on = None
        await self._requeue()
        if replay.requeue:
            transitions.move(self._ctx, JobState.QUEUED_HANDOFF, QUEUED_REASON)
        else:
            assert replay.peer is not None
            transitions.move(self._ctx, JobState.QUEUED_HANDOFF, f"Operator replay to {replay.peer}")
            job.mailbox.placement = Placement(
                job_id=job.spec.job_id,
                peer_id=replay.peer,
                backend_id="",
                forced=True,
                reason="operator replay",
            )
            job.mailbox.vouched = True
        placement = await self._await_promotion()
        return placement.peer_id, placement.backend_id or self._backend_for(view, placement.peer_id)

    async def _retake(self, view: FederationView, cluster: str, backend: str) -> tuple[str, str]:
        """A replay in place of a job whose park released its capacity (PARK_PATCH): the same
        promotion again, through the CAS, so the backend is never over-committed. Refused (another
        job took the capacity meanwhile), the job waits in the queue for the tick."""
        job = self._job
        assert job.promoted is not None
        job.released = False
        again = job.promoted.model_copy(update={"reason": "operator replay in place: capacity taken again"})
        if await self._promote(again, retake=True) is not None:
            return cluster, backend
        placement = await self._await_promotion()
        return placement.peer_id, placement.backend_id or self._backend_for(view, placement.peer_id)

    async def _requeue(self) -> None:
        """Back into the federation queue: a queued job's handle is requeued, another is enqueued."""
        job = self._job
        if job.queued:
            await self._store_step(
                StoreActivities.requeue_job, ExpireInput(job_id=job.spec.job_id, incarnation=job.incarnation)
            )
            job.queued_since_ms = transitions.now_ms()
        else:
            await self._enqueue()

    async def _fence(self, cluster: str, nonce: str) -> None:
        await self._store_step(
            StoreActivities.record_fence,
            FenceInput(job_id=self._job.spec.job_id, nonce=nonce, cluster=cluster),
        )

    # ---- attempts -------------------------------------------------------------------------

    async def _follow(self, cluster: str, remote: ControllerJobStatus) -> _Retry | None:
        """Follow the attempt to its end. None: the job ended (its handle too); a ``_Retry``: the
        attempt failed, or its cluster lost it, and the job has a retry left for that."""
        if not self._ctx.features.numbered:  # runs begun before attempts were numbered
            await self._mirror_to_end(cluster, remote)
            return None
        job = self._job
        end, reason, last = await self._follow_attempt(cluster, remote)
        preempted = None
        if self._ctx.features.preemption and last is not None and last.state is ControllerJobState.PREEMPTED:
            preempted = last.error or f"preempted on {cluster}"
        self._attempt_ended(end, reason, last.exit_code if last is not None else None, preempted)
        retries = {
            AttemptEnd.FAILED: (job.failures_retried, job.spec.max_retries_failure, "--max-retries-failure"),
            AttemptEnd.PREEMPTED: (
                job.preemptions_retried,
                job.spec.max_retries_preemption,
                "--max-retries-preemption",
            ),
        }.get(end)
        if retries is not None and job.mailbox.cancel is None:
            used, budget, flag = retries
            if used < budget:
                return _Retry(end, reason, preempted)
            if budget:
                reason = f"{reason}; no retries left ({flag} {budget})"
        final = {
            AttemptEnd.SUCCEEDED: JobState.SUCCEEDED,
            AttemptEnd.KILLED: JobState.KILLED,
        }.get(end, JobState.FAILED)
        code = ReasonCode.Preempted if preempted is not None else end.code
        if end is AttemptEnd.PREEMPTED and job.mailbox.cancel is not None:
            # Lost while a cancel was on its way (its cluster restarted, say): the job was cancelled.
            final, reason = (
                JobState.KILLED,
                f"Cancelled: {job.mailbox.cancel.reason}; the attempt was lost: {reason}",
            )
            code = ReasonCode.Cancelled
        # Shown only now: an attempt that is retried never shows the job as ended.
        if last is not None:
            self._apply(last)
        transitions.move(self._ctx, final, reason, code=code)
        await self._record_end(None)
        return None

    async def _follow_attempt(
        self, cluster: str, remote: ControllerJobStatus
    ) -> tuple[AttemptEnd, str, ControllerJobStatus | None]:
        """Mirror the attempt on ``cluster`` until it ends (docs/DESIGN.md, "Mirroring"); a cancel
        terminates it there. Ends with how it ended, why, and the cluster's last word on it (None
        if the cluster lost it); its end is left for the caller to show."""
        job = self._job
        nonce = job.nonce
        terminated = False
        silent_since: int | None = None
        report_s = min(30.0, job.lost_after_s / 4)
        if not remote.terminal:
            self._apply(remote)
        feed = self._ctx.features.feed and job.view is not None and job.view.mirror_safety_poll_s > 0
        # Ask the cluster at once rather than wait for the watcher (an end it could not confirm).
        ask_now = False
        while not remote.terminal:
            if job.mailbox.cancel is not None and not terminated:
                terminated = True
                if not await self._terminate(cluster, nonce):
                    await self._fence(cluster, nonce)
                    return AttemptEnd.KILLED, f"Cancelled; {cluster} is silent: the job is fenced there", None
                continue
            max_wait_s = _FOLLOW_MAX_WAIT.total_seconds()
            if feed and not terminated:
                if silent_since is None and not ask_now:
                    seen = await self._await_news()
                    if self._cancel_unsent(terminated):
                        continue
                    if seen is not None and self._ctx.features.wary:
                        seen = self._for_attempt(seen, cluster, nonce)
                    if (
                        seen is not None
                        and seen.status is not None
                        and seen.status.terminal
                        and self._ctx.features.wary
                    ):
                        # An end is believed only as its cluster reports it (SIGNALS_PATCH).
                        confirmed = await self._confirmed_end(cluster, nonce, seen.status)
                        if confirmed is None:
                            ask_now = True  # follow_job, by the nonce, says what became of it
                            continue
                        remote = confirmed
                        if remote.terminal:
                            break
                        self._apply(remote)
                        continue
                    if seen is not None and seen.status is not None:
                        remote = seen.status
                        if remote.terminal:
                            # Its output is relayed home before the end is shown.
                            remote = await self._relay_end(cluster, remote)
                            break
                        self._apply(remote)
                        await self._continue_as_new(
                            Phase.FOLLOWING,
                            cluster=cluster,
                            backend=job.status.backend_id or "",
                            remote=remote,
                        )
                        continue
                    if seen is not None and seen.silent_since_ms is not None and not self._ctx.features.wary:
                        # Its silence counts from when the watcher first saw it, not from now.
                        # (SIGNALS_PATCH: from what follow_job measures; a notice is not proof.)
                        silent_since = min(seen.silent_since_ms, transitions.now_ms())
                ask_now = False
                # A silence notice, the safety poll, or a reader of the log: ask the cluster, at
                # once (one answer), or relaying the log every second while a reader wants it.
                max_wait_s = max(
                    0.0, min(max_wait_s, (job.mailbox.logs_until_ms - transitions.now_ms()) / 1000)
                )
            handle = workflow.start_activity_method(
                PeerActivities.follow_job,
                FollowInput(
                    cluster=cluster,
                    job_id=job.spec.job_id,
                    nonce=nonce,
                    known_state=remote.state.value,
                    log_key=log_key(job.spec.job_id, job.attempt),
                    # Silent already: report again when peer_lost_after is reached, not later.
                    report_unreachable_s=self._report_after(report_s, silent_since),
                    max_wait_s=max_wait_s,
                ),
                start_to_close_timeout=_FOLLOW_MAX_WAIT + timedelta(minutes=5),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=_MIRROR_RETRY,
            )
            if not await self._done_before_cancel(handle, terminated):
                continue
            followed = await handle
            if followed.gone:
                if terminated:
                    return AttemptEnd.KILLED, f"Killed; {cluster} no longer knows the job", None
                return AttemptEnd.PREEMPTED, followed.error or f"{cluster} lost the job", None
            if followed.status is None:
                now = transitions.now_ms()
                silent_since = silent_since or now - int(followed.unreachable_s * 1000)
                silent_s = (now - silent_since) / 1000
                transitions.move(
                    self._ctx,
                    job.status.state,
                    f"{cluster} has not answered for {silent_s:.0f}s: {followed.error}",
                    code=ReasonCode.PeerUnreachable,
                )
                if silent_s >= job.lost_after_s:
                    await self._fence(cluster, nonce)
                    return AttemptEnd.PREEMPTED, f"{cluster} did not answer for {silent_s:.0f}s", None
                # Asked again after a pause: a cluster that refuses at once costs a timer, not a loop.
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        functools.partial(self._cancel_unsent, terminated),
                        timeout=timedelta(seconds=min(report_s, job.lost_after_s - silent_s)),
                    )
                continue
            silent_since = None
            remote = followed.status
            if self._ctx.features.wary:
                self._seen(remote)
            if remote.terminal:
                break
            self._apply(remote)
            if not terminated:
                backend = job.status.backend_id or ""
                await self._continue_as_new(Phase.FOLLOWING, cluster=cluster, backend=backend, remote=remote)
        end = attempt_end(remote.state, remote.error)
        _, reason = self._shown(remote, cluster)
        if job.mailbox.cancel is not None and remote.state is ControllerJobState.KILLED:
            reason = f"Cancelled on {cluster}: {job.mailbox.cancel.reason}"
        if end is AttemptEnd.TIMEOUT:
            reason = f"Failed on {cluster}: timeout ({job.spec.timeout_s:g}s)"
        return end, reason, remote

    async def _next_attempt(self, view: FederationView, cluster: str, retry: _Retry) -> tuple[str, str]:
        """The next attempt goes through the queue again (same pin, else any eligible cluster)."""
        job = self._job
        if retry.end is AttemptEnd.FAILED:
            job.failures_retried += 1
        else:
            job.preemptions_retried += 1
        job.attempt += 1
        transitions.event(
            self._ctx,
            job.status.state,
            f"attempt {job.attempt - 1} ended ({retry.end.value}): {retry.reason}",
        )
        await self._requeue()
        queued = f"Attempt {job.attempt} queued: attempt {job.attempt - 1} on {cluster}"
        if retry.preempted is not None:
            transitions.move(
                self._ctx,
                JobState.QUEUED_HANDOFF,
                f"{queued} was {retry.preempted}",
                code=ReasonCode.Preempted,
            )
        else:
            transitions.move(self._ctx, JobState.QUEUED_HANDOFF, f"{queued} {retry.end.value.lower()}")
        placement = await self._await_promotion()
        return placement.peer_id, placement.backend_id or self._backend_for(view, placement.peer_id)

    # ---- mirroring ------------------------------------------------------------------------

    def _apply(self, remote: ControllerJobStatus) -> None:
        st = self._job.status
        st.exit_code = remote.exit_code
        st.error = remote.error
        st.backend_id = remote.backend_id
        st.tasks = [
            TaskView(index=t.index, state=t.state.value, exit_code=t.exit_code, slots=t.slots)
            for t in remote.tasks
        ]
        state, reason = self._shown(remote, st.cluster or "")
        # An end as the attempt's own (a timeout, a lost worker); a state under way, the state's.
        code = (
            end_code(remote.state, remote.error, preemption=self._ctx.features.preemption)
            if remote.terminal
            else None
        )
        transitions.move(self._ctx, state, reason, code=code)

    @staticmethod
    def _shown(remote: ControllerJobStatus, cluster: str) -> tuple[JobState, str]:
        """The state and reason the job shows for its cluster's status ``remote``."""
        state = mirrored_state(remote.state)
        reasons = {
            JobState.PENDING: f"Waiting for devices on {cluster}",
            JobState.RUNNING: f"Running on {cluster}",
            JobState.SUCCEEDED: f"Succeeded on {cluster}",
            JobState.FAILED: f"Failed on {cluster}"
            + ("" if remote.exit_code is None else f" (exit code {remote.exit_code})"),
            JobState.KILLED: f"Killed on {cluster}",
        }
        reason = reasons.get(state, state.value)
        if remote.state is ControllerJobState.PREEMPTED:
            reason = f"Preempted on {cluster}"
        if remote.error:
            reason = f"{reason}: {remote.error}"
        return state, reason

    async def _mirror_to_end(self, cluster: str, remote: ControllerJobStatus) -> None:
        """Follow the job on ``cluster`` until it ends, then end its queue handle as it ended."""
        await self._mirror(cluster, remote)
        # (A job its cluster lost has had its handle ended by ``_mirror`` already; this second
        # write is kept so that runs recorded with it replay.)
        await self._record_end(None)

    async def _mirror(self, cluster: str, remote: ControllerJobStatus) -> None:
        """Mirror the job's state (docs/DESIGN.md, "Mirroring"); a cancel terminates it there."""
        job = self._job
        job_id = remote.job_id
        terminated = False
        self._apply(remote)
        while not remote.terminal:
            if job.mailbox.cancel is not None and not terminated:
                await self._terminate(cluster)
                terminated = True
                continue
            handle = workflow.start_activity_method(
                PeerActivities.mirror_job,
                MirrorInput(cluster=cluster, job_id=job_id, known_state=remote.state.value),
                start_to_close_timeout=timedelta(minutes=15),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=_MIRROR_RETRY,
            )
            if not await self._done_before_cancel(handle, terminated):
                continue
            try:
                remote = await handle
            except ActivityError as exc:
                if _is_cancellation(exc):
                    raise
                cause = exc.cause
                if isinstance(cause, ApplicationError) and cause.type == contract.JOB_LOST:
                    if terminated:
                        await self._end(JobState.KILLED, f"Killed; {cluster} no longer knows the job")
                    else:
                        await self._end(JobState.FAILED, cause.message, ReasonCode.PeerLost)
                    return
                raise
            self._apply(remote)
        if job.mailbox.cancel is not None and remote.state is ControllerJobState.KILLED:
            transitions.move(
                self._ctx, JobState.KILLED, f"Cancelled on {cluster}: {job.mailbox.cancel.reason}"
            )

    async def _done_before_cancel(self, handle: workflow.ActivityHandle[Any], terminated: bool) -> bool:
        """Wait for the mirroring activity; a cancel the cluster has not been told of yet stops it
        first (False: the caller terminates the job, then mirrors again)."""
        await workflow.wait_condition(functools.partial(self._mirror_wakeup, handle, terminated))
        if handle.done():
            return True
        handle.cancel()
        with contextlib.suppress(ActivityError, asyncio.CancelledError):
            await handle
        return False

    async def _await_news(self) -> Observation | None:
        """Wait for the watcher's next observation of the attempt (FEED_PATCH), a cancel, or a
        reader of the log; None when the safety poll is due (every mirror_safety_poll_s, ±20% so
        the jobs of a burst do not ask at once) or the wait ended for a cancel or a reader."""
        job = self._job
        assert job.view is not None
        due_s = job.view.mirror_safety_poll_s * (0.8 + 0.4 * workflow.random().random())
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(self._news, timeout=timedelta(seconds=due_s))
        seen, job.mailbox.observed = job.mailbox.observed, None
        return seen

    def _for_attempt(self, seen: Observation, cluster: str, nonce: str) -> Observation | None:
        """``seen`` if it is about the attempt being followed (SIGNALS_PATCH); one kept from an
        earlier attempt (it arrived before that attempt's end was acted on) or about another
        cluster is recorded and dropped: it never moves this attempt."""
        job = self._job
        status = seen.status
        if seen.cluster != cluster or (status is not None and status.nonce != nonce):
            about = f"{status.nonce[:120]!r} ({status.state.value})" if status is not None else "its silence"
            transitions.event(
                self._ctx,
                job.status.state,
                f"ignored an observation of {seen.cluster[:80]} about {about}: attempt {job.attempt} "
                f"is {nonce!r} on {cluster}",
            )
            return None
        return seen

    async def _confirmed_end(
        self, cluster: str, nonce: str, claimed: ControllerJobStatus
    ) -> ControllerJobStatus | None:
        """An observation says the attempt ended: read the job from its cluster (its output relayed
        home if it did). The cluster's status of this attempt, terminal or not, with the claim
        recorded and ignored if the cluster says otherwise; None if the cluster does not say (it
        is silent, has forgotten the job or runs another attempt of it)."""
        job = self._job
        said = f"an observation says attempt {job.attempt} on {cluster} is {claimed.state.value}"
        try:
            actual = await workflow.execute_activity_method(
                PeerActivities.mirror_job,
                MirrorInput(
                    cluster=cluster,
                    job_id=job.spec.job_id,
                    known_state=None,
                    log_key=log_key(job.spec.job_id, job.attempt),
                ),
                start_to_close_timeout=_QUICK,
                # Not longer: a silent cluster's silence is then judged by follow_job.
                schedule_to_close_timeout=timedelta(seconds=min(job.lost_after_s, 120.0)),
                retry_policy=_MIRROR_RETRY,
            )
        except ActivityError as exc:
            if _is_cancellation(exc):
                raise
            transitions.event(
                self._ctx,
                job.status.state,
                f"ignored: {said}, and {cluster} does not confirm it ({exc.cause or exc})",
            )
            return None
        self._seen(actual)
        if actual.nonce != nonce:
            transitions.event(
                self._ctx, job.status.state, f"ignored: {said}, and {cluster} runs another attempt of the job"
            )
            return None
        if not actual.terminal or actual.state is not claimed.state:
            transitions.event(
                self._ctx, job.status.state, f"ignored: {said}; {cluster} reports {actual.state.value}"
            )
        return actual

    def _seen(self, status: ControllerJobStatus) -> None:
        """The cluster's own word on the attempt: its feed version, not an observation's claim, is
        the newest seen (a forged version cannot keep the watcher's next ones out)."""
        if status.epoch:
            self._job.mailbox.seen_version = (status.epoch, status.version)

    def _news(self) -> bool:
        job = self._job
        return (
            job.mailbox.observed is not None
            or self._cancel_unsent(False)
            or job.mailbox.logs_until_ms > transitions.now_ms()
        )

    def _mirror_wakeup(self, handle: asyncio.Future[Any], terminated: bool) -> bool:
        return handle.done() or self._cancel_unsent(terminated)

    def _report_after(self, report_s: float, silent_since: int | None) -> float:
        if silent_since is None:
            return report_s
        left = self._job.lost_after_s - (transitions.now_ms() - silent_since) / 1000
        return max(0.0, min(report_s, left))

    def _cancel_unsent(self, terminated: bool) -> bool:
        """A cancel the attempt's cluster has not been told of yet."""
        return self._job.mailbox.cancel is not None and not terminated

    async def _terminate(self, cluster: str, nonce: str | None = None) -> bool:
        """Terminate the attempt on ``cluster`` and wait until the cluster confirms it ended (or
        never had it): re-driven until then. With a nonce (runs with attempts), a cluster silent
        past peer_lost_after gives up: False, the caller fences the attempt."""
        job = self._job
        transitions.event(self._ctx, job.status.state, f"terminating on {cluster}")
        if nonce is None:  # runs begun before attempts: one terminate, retried through outages
            await workflow.execute_activity_method(
                PeerActivities.terminate_job,
                TerminateInput(cluster=cluster, job_id=job.spec.job_id),
                start_to_close_timeout=_QUICK,
                retry_policy=_MIRROR_RETRY,
            )
            return True
        try:
            await workflow.execute_activity_method(
                PeerActivities.terminate_job,
                TerminateInput(cluster=cluster, job_id=job.spec.job_id, nonce=nonce, confirm=True),
                start_to_close_timeout=timedelta(minutes=15),
                schedule_to_close_timeout=timedelta(seconds=job.lost_after_s),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=_MIRROR_RETRY,
            )
        except ActivityError as exc:
            if _is_cancellation(exc):
                raise
            return False
        return True

    async def _read_remote(self, cluster: str) -> ControllerJobStatus:
        """The job as its cluster has it now, with its output relayed home if it has ended. With
        attempts, a cluster silent for peer_lost_after fails it (an ActivityError that is not a
        cancellation): the caller decides what the silence means."""
        job = self._job
        return await workflow.execute_activity_method(
            PeerActivities.mirror_job,
            MirrorInput(
                cluster=cluster,
                job_id=job.spec.job_id,
                known_state=None,
                log_key=log_key(job.spec.job_id, job.attempt),
            ),
            start_to_close_timeout=_QUICK,
            schedule_to_close_timeout=timedelta(seconds=job.lost_after_s)
            if self._ctx.features.numbered
            else None,
            retry_policy=_MIRROR_RETRY,
        )

    async def _relay_end(self, cluster: str, ended: ControllerJobStatus) -> ControllerJobStatus:
        """An attempt ``cluster`` reported ended, with its output relayed home. If the cluster
        then stays silent for peer_lost_after, its end stands and the output stays there."""
        try:
            return await self._read_remote(cluster)
        except ActivityError as exc:
            if _is_cancellation(exc) or not self._ctx.features.numbered:
                raise
            transitions.event(
                self._ctx,
                self._job.status.state,
                f"{cluster} reported attempt {self._job.attempt} {ended.state.value} but has not "
                f"answered since ({exc.cause or exc}); its output was not relayed home",
            )
            return ended

    async def _after_temporal_cancel(self) -> None:
        job = self._job
        st = job.status
        # Let shielded writes land first, so the cancel is recorded against what they wrote.
        for op in (self._ctx.enqueue_op, self._ctx.launch_op):
            if op is not None and not op.done():
                with contextlib.suppress(ActivityError):
                    await op
        if st.terminal:
            return
        if not job.delivered or st.cluster is None:
            await self._cancel_before_handoff()
        if st.state is JobState.HANDOFF_FAILED:
            await self._finish(JobState.KILLED, await self._stop_maybe_running())
        cluster = st.cluster
        try:
            remote = await self._read_remote(cluster)
        except ActivityError as exc:
            if _is_cancellation(exc) or not self._ctx.features.numbered:
                raise
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == contract.JOB_LOST:
                # The cluster has forgotten the job: nothing is left to terminate there.
                reason = f"Killed; {cluster} no longer knows the job"
            else:
                # Silent for peer_lost_after: the attempt is terminated there when it answers.
                await self._fence(cluster, job.nonce)
                reason = f"Cancelled; {cluster} is silent: the job is fenced there"
            self._attempt_ended(AttemptEnd.KILLED, reason, None)
            await self._finish(JobState.KILLED, reason)
        await self._follow(cluster, remote)


__all__ = (
    "ATTEMPTS_PATCH",
    "AUTH_PATCH",
    "BUNDLE_PATCH",
    "CANCELLED_WHILE_PARKED",
    "CONTINUE_PATCH",
    "EARLIER_ATTEMPT_PATCH",
    "FEED_PATCH",
    "HOME_LEDGER_PATCH",
    "LOCAL_STEPS_PATCH",
    "PARK_PATCH",
    "PREEMPT_PATCH",
    "REASON_PATCH",
    "SIGNALS_PATCH",
    "SIZE_PATCH",
    "SUBMISSION_PATCH",
    "TERMINAL_LAUNCH_PATCH",
    "TIMERS_PATCH",
    "JobWorkflow",
)
