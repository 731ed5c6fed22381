"""JobWorkflow: one durable workflow per job (SPEC §3–§8).

classify → run at home now | queue → placement signal → promotion CAS → artifact check → handoff
→ mirror → terminal, with cancellation honoured at every step. No I/O here: activities do it and
the policy decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import CancelledError as TemporalCancelledError

with workflow.unsafe.imports_passed_through():
    from activities.artifacts import ArtifactActivities, ArtifactInput
    from activities.peers import LaunchInput, MirrorInput, PeerActivities, StageInput, TerminateInput
    from activities.store import (
        CancelIntentInput,
        EnqueueInput,
        ExpireInput,
        HandleStateInput,
        PromoteInput,
        StoreActivities,
    )
    from iris import contract
    from iris.controller.models import ControllerJobState, LaunchRequest
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import (
        CancelOutcome,
        CancelRequest,
        JobEvent,
        JobSpec,
        JobState,
        JobStatus,
        ReplayRequest,
        TaskView,
    )
    from iris.policy import QUEUED_REASON, classify, pick_backend, queued_for_peer_reason
    from iris.policy.models import Disposition, JobShape, Placement
    from iris.reports import FederationView
    from iris.store.models import HandleState, JobHandle, PromoteOutcome

_QUICK = timedelta(seconds=30)
_STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
_REPORTS_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
_ARTIFACT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10), maximum_attempts=5
)
_HANDOFF_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=6,
    non_retryable_error_types=[contract.HANDOFF_REJECTED],
)
_MIRROR_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))

# Read-only: this module is imported once, not per run (workflows/runner.py).
_MIRRORED: Mapping[ControllerJobState, JobState] = MappingProxyType(
    {
        ControllerJobState.PENDING: JobState.PENDING,
        ControllerJobState.RUNNING: JobState.RUNNING,
        ControllerJobState.SUCCEEDED: JobState.SUCCEEDED,
        ControllerJobState.FAILED: JobState.FAILED,
        ControllerJobState.KILLED: JobState.KILLED,
        ControllerJobState.WORKER_FAILED: JobState.FAILED,
    }
)
_HANDLE_TERMINAL: Mapping[JobState, HandleState] = MappingProxyType(
    {
        JobState.SUCCEEDED: HandleState.SUCCEEDED,
        JobState.FAILED: HandleState.FAILED,
        JobState.KILLED: HandleState.KILLED,
        JobState.UNSCHEDULABLE: HandleState.UNSCHEDULABLE,
        JobState.HANDOFF_REJECTED: HandleState.HANDOFF_REJECTED,
    }
)
CANCELLED_BEFORE_HANDOFF = "Cancelled before handoff"
DEADLINE_PASSED = "Scheduling timeout passed before any cluster had room"
# Runs started with this patch do the federation-store writes (all but the promotion CAS) as
# local activities, and upsert a search attribute only when its value changes (issue 9). Runs
# recorded before it replay on the old path.
LOCAL_STEPS_PATCH = "local-store-steps-v1"
# Runs that reach a handoff with this patch stage the job's workspace bundle on the destination
# first (BUILDING). A run that an older worker began without staging replays without it.
BUNDLE_PATCH = "workspace-bundle-v1"
_STAGE_TIMEOUT = timedelta(minutes=5)
# Runs with this patch relay the output of a job whose (repeated) launch found it already ended.
TERMINAL_LAUNCH_PATCH = "relay-after-terminal-launch-v1"

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def _is_cancellation(exc: BaseException) -> bool:
    """A Temporal cancel of this workflow, as opposed to an activity's own failure."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    return isinstance(exc, ActivityError) and isinstance(exc.cause, TemporalCancelledError)


@dataclasses.dataclass(frozen=True)
class _Parked:
    """A handoff that cannot complete now: the job parks in HANDOFF_FAILED with this reason."""

    reason: str


@workflow.defn(name=contract.JOB_WORKFLOW)
class JobWorkflow:
    @workflow.init
    def __init__(self, spec: JobSpec) -> None:
        # Built here, not in run(): a query, signal or Update can arrive in the very first task,
        # before run() starts (e.g. a cancel right after submit).
        self._spec: JobSpec | None = spec
        self._status: JobStatus | None = JobStatus(
            job_id=spec.job_id,
            state=JobState.CLASSIFYING,
            reason="Classifying against the federation's capacity reports",
            submit_ms=spec.submit_ms,
            updated_ms=spec.submit_ms,
            spec=spec,
        )
        self._placement: Placement | None = None
        self._cancel: CancelRequest | None = None
        self._expire = False
        # The job's handle is in the federation queue (store); its transitions must be recorded.
        self._queued = False
        # Set in the workflow task that schedules the launch: from then on the job may be on a
        # cluster, and a cancel has to go through that cluster.
        self._delivered = False
        self._replay: ReplayRequest | None = None
        self._explanation: str | None = None
        self._memo_reason: str | None = None
        self._pin: str | None = None
        self._clusters: list[str] = []
        self._local_steps = False
        # What the visibility store holds, so an unchanged value is not upserted again.
        self._sa_state: str | None = None
        self._enqueue_op: workflow.ActivityHandle[JobHandle] | None = None
        self._launch_op: workflow.ActivityHandle[ControllerJobStatus] | None = None

    # ---- messages -------------------------------------------------------------------------

    @workflow.query(name=contract.STATUS)
    def status(self) -> JobStatus:
        assert self._status is not None
        return self._status

    def _waiting_in_queue(self) -> bool:
        # The tick may answer before this workflow has processed its own enqueue (a signal is
        # delivered ahead of the activity result in the same task), so CLASSIFYING counts too.
        st = self._status
        return st is not None and st.state in (JobState.CLASSIFYING, JobState.QUEUED_HANDOFF)

    @workflow.signal(name=contract.PLACE)
    def place(self, placement: Placement) -> None:
        """From the placement tick: promote the job to this (peer, backend)."""
        # An operator's replay target, already set, is not overridden by the tick.
        if self._waiting_in_queue() and self._placement is None:
            self._placement = placement

    @workflow.signal(name=contract.EXPLAIN)
    def explain(self, reason: str) -> None:
        """From the placement tick: why the job is still queued (the pending reason)."""
        self._explanation = reason
        if self._status is not None and self._status.state is JobState.QUEUED_HANDOFF:
            self._set(JobState.QUEUED_HANDOFF, reason, record=False)

    @workflow.signal(name=contract.EXPIRE)
    def expire(self) -> None:
        """From the placement tick: the scheduling deadline passed."""
        self._expire = True

    @workflow.signal(name=contract.CANCEL)
    def cancel(self, request: CancelRequest) -> None:
        self._request_cancel(request)

    @workflow.update(name=contract.CANCEL_JOB)
    async def cancel_job(self, request: CancelRequest) -> CancelOutcome:
        """Cancel, and say whether the cancel won: won = the job was never delivered to a cluster."""
        st = self.status()
        if st.terminal:
            return st.ended_cancel_outcome()
        self._request_cancel(request)
        await workflow.wait_condition(lambda: self._delivered or self.status().terminal)
        st = self.status()
        if not self._delivered:
            return CancelOutcome(
                won=True, state=st.state, message="cancelled before handoff; never delivered"
            )
        return CancelOutcome(
            won=False,
            state=st.state,
            message=f"job was already handed to {st.cluster}; termination requested there",
        )

    @workflow.update(name=contract.REPLAY_HANDOFF)
    def replay_handoff(self, request: ReplayRequest) -> str:
        """Operator: re-run the artifact check and handoff of a parked job (SPEC §9)."""
        self._replay = request
        return f"replay accepted: {request.describe()}"

    @replay_handoff.validator
    def _check_replay(self, request: ReplayRequest) -> None:
        st = self.status()
        if st.state is not JobState.HANDOFF_FAILED or self._replay is not None:
            parked = JobState.HANDOFF_FAILED.value
            raise ValueError(
                f"job {st.job_id} is {st.state.value}: replay-handoff applies to jobs parked in {parked}"
            )
        if request.requeue and request.peer:
            raise ValueError("choose --peer or --requeue, not both")
        if request.peer is not None:
            if request.peer not in self._clusters:
                raise ValueError(f"unknown cluster {request.peer!r} (known: {', '.join(self._clusters)})")
            if self._pin is not None and request.peer != self._pin:
                raise ValueError(
                    f"job {st.job_id} is pinned to {self._pin}; it cannot be replayed to {request.peer}"
                )

    def _request_cancel(self, request: CancelRequest) -> None:
        if self._cancel is None and self._status is not None and not self._status.terminal:
            self._cancel = request
            self._status.cancel_requested = True
            self._event(self._status.state, f"cancel requested: {request.reason}")

    # ---- state bookkeeping ----------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(workflow.now().timestamp() * 1000)

    def _event(self, state: JobState, message: str) -> None:
        assert self._status is not None
        self._status.events.append(JobEvent(at_ms=self._now_ms(), state=state, message=message))
        self._status.updated_ms = self._now_ms()

    def _set(self, state: JobState, reason: str, *, cluster: str | None = None, record: bool = True) -> None:
        st = self._status
        assert st is not None
        changed = state != st.state or reason != st.reason
        st.state = state
        st.reason = reason
        st.updated_ms = self._now_ms()
        new_peer = cluster if cluster is not None and cluster != st.cluster else None
        if new_peer is not None:
            st.cluster = new_peer
            changed = True
        if changed and record:
            self._event(state, reason)
        self._upsert_search_attributes(state, new_peer)
        if reason != self._memo_reason:
            # The reason rides in the memo so `iris job list` shows it without querying every job.
            self._memo_reason = reason
            workflow.upsert_memo({contract.MEMO_REASON: reason})
        workflow.set_current_details(f"**{state.value}** — {reason}" if reason else state.value)

    def _upsert_search_attributes(self, state: JobState, new_peer: str | None) -> None:
        updates = []
        # Runs recorded before the patch upserted the state on every change of state or reason.
        if state.value != self._sa_state or not self._local_steps:
            updates.append(contract.SA_STATE.value_set(state.value))
            self._sa_state = state.value
        if new_peer is not None:
            updates.append(contract.SA_PEER.value_set(new_peer))
        if updates:
            workflow.upsert_search_attributes(updates)

    def _store_step(
        self, method: Callable[[StoreActivities, _In], Awaitable[_Out]], arg: _In, *, local: bool = True
    ) -> workflow.ActivityHandle[_Out]:
        """A federation-store transaction: milliseconds on the worker's own store connection, so a
        local activity (no task-queue round trip) unless this run predates the patch or the step
        must be recorded in a workflow task of its own (``local=False``)."""
        if self._local_steps and local:
            return workflow.start_local_activity_method(
                method, arg, start_to_close_timeout=_QUICK, retry_policy=_STORE_RETRY
            )
        return workflow.start_activity_method(
            method, arg, start_to_close_timeout=_QUICK, retry_policy=_STORE_RETRY
        )

    async def _finish(self, state: JobState, reason: str) -> JobStatus:
        self._set(state, reason)
        if self._queued and state in _HANDLE_TERMINAL:
            await self._handle_state(_HANDLE_TERMINAL[state], reason)
        assert self._status is not None
        return self._status

    @property
    def _incarnation(self) -> str:
        # Minted once per job incarnation; stable across retries and workflow resets.
        assert self._spec is not None
        return f"{self._spec.job_id}@{self._spec.submit_ms}"

    async def _handle_state(self, state: HandleState, reason: str | None = None) -> None:
        assert self._spec is not None
        try:
            await self._store_step(
                StoreActivities.set_handle_state,
                HandleStateInput(
                    job_id=self._spec.job_id, incarnation=self._incarnation, state=state, reason=reason
                ),
            )
        except ActivityError as exc:
            if _is_cancellation(exc):
                raise
            # The queue's bookkeeping refused a transition; the job itself goes on, and says so.
            assert self._status is not None
            self._event(self._status.state, f"federation store kept its state: {exc.cause or exc}")

    # ---- the lifecycle --------------------------------------------------------------------

    @workflow.run
    async def run(self, spec: JobSpec) -> JobStatus:
        assert self._status is not None
        self._local_steps = workflow.patched(LOCAL_STEPS_PATCH)
        if self._local_steps:
            self._sa_state = JobState.CLASSIFYING.value  # set by the client at start
        self._event(JobState.CLASSIFYING, self._status.reason)
        self._set(JobState.CLASSIFYING, self._status.reason)
        try:
            result = await self._lifecycle(spec)
        except (asyncio.CancelledError, ActivityError) as exc:
            # Temporal's own cancel converges on the same path as the signal and the update. It
            # surfaces as CancelledError, or as ActivityError(CancelledError) from the activity
            # that was running when it arrived.
            if not _is_cancellation(exc):
                raise
            self._request_cancel(CancelRequest(reason="Cancelled through Temporal"))
            result = await self._after_temporal_cancel(spec)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return result

    async def _lifecycle(self, spec: JobSpec) -> JobStatus:
        # A regular activity, not a local one: the first workflow task must not hold local
        # activities, since an Update (a cancel right after submit) accepted in that task can then
        # be answered with a protocol message the server rejects for ever
        # (BadUpdateWorkflowExecutionMessage, seen here about once in 250 instant cancels).
        view = await workflow.execute_activity_method(
            PeerActivities.fetch_reports, start_to_close_timeout=_QUICK, retry_policy=_REPORTS_RETRY
        )
        shape = spec.shape()
        decision = classify(
            shape,
            home=view.home,
            reports=view.reports,
            # Judged when the reports were read: a workflow task delayed by a worker crash must
            # not turn fresh reports stale and reject a job the federation can run.
            now_ms=view.fetched_ms if view.fetched_ms is not None else self._now_ms(),
            stale_after_ms=view.stale_after_ms,
            configured=view.configured,
        )
        self._clusters = [r.peer_id for r in view.reports]
        st = self._status
        assert st is not None
        st.disposition = decision.disposition.value
        st.classification_reason = decision.reason
        self._event(JobState.CLASSIFYING, f"classified {decision.disposition.value}: {decision.reason}")

        if decision.disposition is Disposition.REJECT:
            return await self._finish(JobState.REJECTED, decision.reason)
        if self._cancel is not None:
            return await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
        if decision.disposition is Disposition.LOCAL:
            return await self._deliver(spec, view, view.home, self._backend_for(view, view.home))

        # The queue holds the resolved pin (exact cluster id), whatever case the user typed.
        self._pin = decision.pinned_cluster
        await self._enqueue(shape)
        pin = decision.pinned_cluster
        self._set(JobState.QUEUED_HANDOFF, queued_for_peer_reason(pin) if pin else QUEUED_REASON)
        if self._explanation is not None:
            self._set(JobState.QUEUED_HANDOFF, self._explanation, record=False)
        placement = await self._await_promotion(spec)
        if isinstance(placement, JobStatus):
            return placement
        # A force-routed placement names no backend (SPEC §5): the peer gets its best guess.
        backend = placement.backend_id or self._backend_for(view, placement.peer_id)
        return await self._deliver(spec, view, placement.peer_id, backend)

    async def _enqueue(self, shape: JobShape) -> None:
        # Set first: if a Temporal cancel interrupts this await after the insert committed, the
        # cancel path must still record the handle's end, or the queue keeps a zombie.
        self._queued = True
        # Shielded: a Temporal cancel must not abandon the insert half-way; the cancel path waits
        # for it and then records the cancel against the handle it wrote.
        op = self._store_step(
            StoreActivities.enqueue_job,
            EnqueueInput(
                shape=shape.model_copy(update={"target_cluster": self._pin}), incarnation=self._incarnation
            ),
        )
        self._enqueue_op = op
        await asyncio.shield(op)

    def _backend_for(self, view: FederationView, cluster: str) -> str:
        report = view.report(cluster)
        assert self._spec is not None
        chosen = pick_backend(self._spec.shape(), report) if report is not None else None
        if chosen is None and report is not None and report.backends:
            chosen = report.backends[0].backend_id
        return chosen or ""

    async def _await_promotion(self, spec: JobSpec) -> Placement | JobStatus:
        """Wait in QUEUED_HANDOFF for a placement, then promote by CAS; a failed CAS waits again."""
        deadline_ms = spec.shape().deadline_ms
        while True:
            timeout = None
            if deadline_ms is not None:
                timeout = timedelta(milliseconds=max(1, deadline_ms - self._now_ms()))
            try:
                await workflow.wait_condition(
                    lambda: self._placement is not None or self._cancel is not None or self._expire,
                    timeout=timeout,
                )
            except TimeoutError:
                self._expire = True
            if self._cancel is not None:
                return await self._cancel_queued()
            if self._expire:
                await self._store_step(
                    StoreActivities.expire_job, ExpireInput(job_id=spec.job_id, incarnation=self._incarnation)
                )
                return await self._finish(JobState.UNSCHEDULABLE, DEADLINE_PASSED)
            placement = self._placement
            assert placement is not None
            self._placement = None
            # The CAS runs only while this workflow's cancellation state is clear; shielded so a
            # Temporal cancel never abandons it half-way (the store then decides who won). Not a
            # local activity: its answer must be in the history before the workflow task that
            # schedules the launch, which an operator's reset of a refused handoff goes back to;
            # a reset that re-ran the CAS against the ended handle would wait forever.
            result = await asyncio.shield(
                self._store_step(
                    StoreActivities.promote_job,
                    PromoteInput(job_id=spec.job_id, incarnation=self._incarnation, placement=placement),
                    local=False,
                )
            )
            target = f"{placement.peer_id}/{placement.backend_id or '-'}"
            if result.promoted:
                backend = (result.handle.assigned_backend if result.handle else None) or placement.backend_id
                self._event(JobState.QUEUED_HANDOFF, f"promoted to {target}: {placement.reason or 'placed'}")
                return placement.model_copy(update={"backend_id": backend})
            handle = result.handle
            if result.outcome is PromoteOutcome.CANCELLED or (handle is not None and handle.cancel_requested):
                return await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
            if result.outcome is PromoteOutcome.EXPIRED or (
                handle is not None and handle.state is HandleState.UNSCHEDULABLE
            ):
                return await self._finish(JobState.UNSCHEDULABLE, DEADLINE_PASSED)
            self._event(JobState.QUEUED_HANDOFF, f"promotion to {target} refused: {result.message}")
            self._set(JobState.QUEUED_HANDOFF, f"Waiting for the next tick: {result.message}", record=False)

    async def _cancel_before_handoff(self) -> JobStatus:
        """A cancel seen while preparing a handoff that was never sent: the job is never delivered."""
        if self._queued:
            return await self._cancel_queued()
        return await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)

    async def _cancel_queued(self) -> JobStatus:
        """Record the cancel intent in the store; either way the job is never delivered."""
        assert self._spec is not None and self._cancel is not None
        outcome = await self._store_step(
            StoreActivities.record_cancel,
            CancelIntentInput(job_id=self._spec.job_id, reason=self._cancel.reason),
        )
        if not outcome.won:
            self._event(JobState.PENDING_HANDOFF, "cancel arrived after promotion; the job is not handed off")
        return await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)

    async def _deliver(self, spec: JobSpec, view: FederationView, cluster: str, backend: str) -> JobStatus:
        """Hand off to ``cluster``; a parked handoff waits for an operator's replay or a cancel (SPEC §9)."""
        while True:
            outcome = await self._deliver_once(spec, view, cluster, backend)
            if not isinstance(outcome, _Parked):
                return outcome
            action = await self._park(outcome.reason)
            if isinstance(action, JobStatus):
                return action
            target = await self._replay_target(spec, view, cluster, backend, action)
            if isinstance(target, JobStatus):
                return target
            if isinstance(target, _Parked):
                continue
            cluster, backend = target

    async def _replay_target(
        self, spec: JobSpec, view: FederationView, cluster: str, backend: str, action: ReplayRequest
    ) -> tuple[str, str] | JobStatus | _Parked:
        """Where an operator's replay goes: the same cluster, another one, or back through the queue."""
        self._event(JobState.HANDOFF_FAILED, f"operator replay: {action.describe()}")
        if not action.requeue and (action.peer is None or action.peer == cluster):
            return cluster, backend
        if self._queued:
            await self._store_step(
                StoreActivities.requeue_job, ExpireInput(job_id=spec.job_id, incarnation=self._incarnation)
            )
        else:
            await self._enqueue(spec.shape())
        if action.requeue:
            self._set(JobState.QUEUED_HANDOFF, QUEUED_REASON)
            placement = await self._await_promotion(spec)
        else:
            assert action.peer is not None
            self._set(JobState.QUEUED_HANDOFF, f"Operator replay to {action.peer}")
            self._placement = Placement(
                job_id=spec.job_id, peer_id=action.peer, backend_id="", forced=True, reason="operator replay"
            )
            placement = await self._await_promotion(spec)
        if isinstance(placement, JobStatus):
            return placement
        return placement.peer_id, placement.backend_id or self._backend_for(view, placement.peer_id)

    async def _deliver_once(
        self, spec: JobSpec, view: FederationView, cluster: str, backend: str
    ) -> JobStatus | _Parked:
        """Artifact check, handoff and mirror on ``cluster`` (the home cluster included)."""
        assert self._status is not None
        self._status.backend_id = backend
        prepare = f"Promoted to {cluster}" if self._queued else f"Runs at home on {cluster}"
        self._set(JobState.PENDING_HANDOFF, f"{prepare}; preparing the handoff", cluster=cluster)
        if self._cancel is not None:
            return await self._cancel_before_handoff()
        if spec.artifacts:
            checked = await self._check_artifacts(spec, cluster)
            if checked is not None:
                return checked
        bundle = spec.bundle if spec.bundle is not None and workflow.patched(BUNDLE_PATCH) else None
        if bundle is not None:
            staged = await self._stage_bundle(spec, cluster)
            if staged is not None:
                return staged
        self._set(JobState.PENDING_HANDOFF, f"Awaiting acceptance by {cluster}")
        # The delivery commit point: set in the same workflow task that schedules the launch.
        self._delivered = True
        self._status.handoff_attempts += 1
        request = LaunchRequest(
            job_id=spec.job_id,
            command=spec.command,
            env=spec.env,
            device=spec.device,
            band=spec.band,
            user=spec.user,
            requester=view.home,
            nonce=self._incarnation,
            backend_id=backend,
            bundle=bundle,
        )
        try:
            # Shielded like the enqueue: a Temporal cancel lets the launch finish, then
            # terminates on the peer (a swallowed cancel would let the job run on).
            self._launch_op = workflow.start_activity_method(
                PeerActivities.launch_job,
                LaunchInput(cluster=cluster, request=request),
                start_to_close_timeout=_QUICK,
                retry_policy=_HANDOFF_RETRY,
            )
            launched = await asyncio.shield(self._launch_op)
        except ActivityError as exc:
            return await self._refused_or_parked(exc, f"Handoff to {cluster} failed after retries")
        if cluster != view.home:
            self._set(JobState.HANDED_OFF, f"Accepted by {cluster}")
        else:
            self._event(JobState.HANDED_OFF, f"Accepted by the home cluster {cluster}")
        if self._queued:
            await self._handle_state(HandleState.HANDED_OFF)
        if launched.terminal and workflow.patched(TERMINAL_LAUNCH_PATCH):
            # A launch repeated after a lost reply can find the job already ended: its output
            # still has to be relayed home, which the mirror does before it reports an end.
            launched = await self._read_remote(cluster, spec.job_id)
        status = await self._mirror(cluster, launched)
        if self._queued and status.state in _HANDLE_TERMINAL:
            await self._handle_state(_HANDLE_TERMINAL[status.state])
        return status

    async def _check_artifacts(self, spec: JobSpec, cluster: str) -> JobStatus | _Parked | None:
        self._set(
            JobState.PENDING_HANDOFF,
            f"Checking {len(spec.artifacts)} artifact(s) in {cluster}'s object store",
        )
        try:
            report = await workflow.execute_activity_method(
                ArtifactActivities.check_artifacts,
                ArtifactInput(cluster=cluster, uris=spec.artifacts),
                start_to_close_timeout=_QUICK,
                retry_policy=_ARTIFACT_RETRY,
            )
        except ActivityError as exc:
            if _is_cancellation(exc):
                raise
            return _Parked(f"Cannot check artifacts in {cluster}'s object store: {exc.cause or exc}")
        if report.missing:
            more = f" (+{len(report.missing) - 1} more)" if len(report.missing) > 1 else ""
            return _Parked(report.reasons[0] + more)
        if self._cancel is not None:
            return await self._cancel_before_handoff()
        return None

    async def _stage_bundle(self, spec: JobSpec, cluster: str) -> JobStatus | _Parked | None:
        """BUILDING: the workspace bundle goes to ``cluster`` before the launch (SPEC §12)."""
        bundle = spec.bundle
        assert bundle is not None
        self._set(JobState.BUILDING, f"Staging workspace bundle {bundle.describe()} on {cluster}")
        try:
            staged = await workflow.execute_activity_method(
                PeerActivities.stage_bundle,
                StageInput(cluster=cluster, bundle=bundle),
                start_to_close_timeout=_STAGE_TIMEOUT,
                retry_policy=_HANDOFF_RETRY,
            )
        except ActivityError as exc:
            return await self._refused_or_parked(exc, f"Cannot stage the workspace bundle on {cluster}")
        done = "uploaded to" if staged.uploaded else "already on"
        self._event(JobState.BUILDING, f"workspace bundle {bundle.short} {done} {cluster}")
        if self._cancel is not None:
            return await self._cancel_before_handoff()
        return None

    async def _refused_or_parked(self, exc: ActivityError, parked: str) -> JobStatus | _Parked:
        """A handoff step failed for good: the cluster's refusal ends the job (contract.HANDOFF_REJECTED), a
        missing bundle or an outage past the retries parks it for an operator (``parked``: why)."""
        if _is_cancellation(exc):
            raise exc
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == contract.HANDOFF_REJECTED:
            return await self._finish(JobState.HANDOFF_REJECTED, cause.message)
        if isinstance(cause, ApplicationError) and cause.type == contract.BUNDLE_UNAVAILABLE:
            return _Parked(cause.message)
        return _Parked(f"{parked}: {cause or exc}")

    async def _park(self, reason: str) -> JobStatus | ReplayRequest:
        """HANDOFF_FAILED waits for an operator (SPEC §9) or a cancel; never dropped silently."""
        self._set(JobState.HANDOFF_FAILED, reason)
        if self._queued:
            await self._handle_state(HandleState.HANDOFF_FAILED, reason)
        await workflow.wait_condition(lambda: self._cancel is not None or self._replay is not None)
        if self._cancel is not None:
            return await self._finish(JobState.KILLED, "Cancelled while parked after a failed handoff")
        action, self._replay = self._replay, None
        assert action is not None
        return action

    def _apply(self, remote: ControllerJobStatus) -> None:
        assert self._status is not None
        state = _MIRRORED[remote.state]
        self._status.exit_code = remote.exit_code
        self._status.error = remote.error
        self._status.backend_id = remote.backend_id
        self._status.tasks = [
            TaskView(index=t.index, state=t.state.value, exit_code=t.exit_code, slots=t.slots)
            for t in remote.tasks
        ]
        cluster = self._status.cluster or ""
        reasons = {
            JobState.PENDING: f"Waiting for devices on {cluster}",
            JobState.RUNNING: f"Running on {cluster}",
            JobState.SUCCEEDED: f"Succeeded on {cluster}",
            JobState.FAILED: f"Failed on {cluster} (exit code {remote.exit_code})",
            JobState.KILLED: f"Killed on {cluster}",
        }
        reason = reasons.get(state, state.value)
        if remote.error:
            reason = f"{reason}: {remote.error}"
        self._set(state, reason)

    async def _mirror(self, cluster: str, remote: ControllerJobStatus) -> JobStatus:
        job_id = remote.job_id
        terminated = False
        self._apply(remote)
        while not remote.terminal:
            if self._cancel is not None and not terminated:
                await self._terminate(cluster, job_id)
                terminated = True
                continue
            handle = workflow.start_activity_method(
                PeerActivities.mirror_job,
                MirrorInput(cluster=cluster, job_id=job_id, known_state=remote.state.value),
                start_to_close_timeout=timedelta(minutes=15),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=_MIRROR_RETRY,
            )
            await workflow.wait_condition(functools.partial(self._mirror_wakeup, handle, terminated))
            if not handle.done():
                handle.cancel()
                with contextlib.suppress(ActivityError, asyncio.CancelledError):
                    await handle
                continue
            try:
                remote = await handle
            except ActivityError as exc:
                if _is_cancellation(exc):
                    raise
                cause = exc.cause
                if isinstance(cause, ApplicationError) and cause.type == contract.JOB_LOST:
                    if terminated:
                        return await self._finish(
                            JobState.KILLED, f"Killed; {cluster} no longer knows the job"
                        )
                    return await self._finish(JobState.FAILED, cause.message)
                raise
            self._apply(remote)
        if self._cancel is not None and remote.state is ControllerJobState.KILLED:
            self._set(JobState.KILLED, f"Cancelled on {cluster}: {self._cancel.reason}")
        assert self._status is not None
        return self._status

    def _mirror_wakeup(self, handle: asyncio.Future[ControllerJobStatus], terminated: bool) -> bool:
        return handle.done() or (self._cancel is not None and not terminated)

    async def _terminate(self, cluster: str, job_id: str) -> None:
        assert self._status is not None
        self._event(self._status.state, f"terminating on {cluster}")
        await workflow.execute_activity_method(
            PeerActivities.terminate_job,
            TerminateInput(cluster=cluster, job_id=job_id),
            start_to_close_timeout=_QUICK,
            retry_policy=_MIRROR_RETRY,
        )

    async def _read_remote(self, cluster: str, job_id: str) -> ControllerJobStatus:
        """The job as its cluster has it now, with its output relayed home if it has ended."""
        return await workflow.execute_activity_method(
            PeerActivities.mirror_job,
            MirrorInput(cluster=cluster, job_id=job_id, known_state=None),
            start_to_close_timeout=_QUICK,
            retry_policy=_MIRROR_RETRY,
        )

    async def _after_temporal_cancel(self, spec: JobSpec) -> JobStatus:
        st = self._status
        assert st is not None
        # Let shielded writes land first, so the cancel is recorded against what they wrote.
        for op in (self._enqueue_op, self._launch_op):
            if op is not None and not op.done():
                with contextlib.suppress(ActivityError):
                    await op
        if st.terminal:
            return st
        if not self._delivered or st.cluster is None:
            if self._queued:
                return await self._cancel_queued()
            return await self._finish(JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
        if st.state is JobState.HANDOFF_FAILED:
            return await self._finish(JobState.KILLED, "Cancelled while parked after a failed handoff")
        current = await self._read_remote(st.cluster, spec.job_id)
        status = await self._mirror(st.cluster, current)
        if self._queued and status.state in _HANDLE_TERMINAL:
            await self._handle_state(_HANDLE_TERMINAL[status.state])
        return status


__all__ = ("JobWorkflow",)
