"""JobWorkflow: one durable workflow per job (SPEC §3, §4, §8).

classify → (run at home | queue → placement | reject) → hand off → mirror → terminal,
with cancellation honoured at every step. No I/O here: activities do it, the policy decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.peers import (
        HANDOFF_REJECTED,
        JOB_LOST,
        LaunchInput,
        MirrorInput,
        PeerActivities,
        TerminateInput,
    )
    from iris.controller.models import ControllerJobState, LaunchRequest
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import (
        SA_PEER,
        SA_STATE,
        CancelOutcome,
        CancelRequest,
        JobEvent,
        JobSpec,
        JobState,
        JobStatus,
        Placement,
    )
    from iris.policy import classify, pick_backend
    from iris.policy.models import Disposition
    from iris.reports import FederationView

_REPORTS_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
_HANDOFF_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=6,
    non_retryable_error_types=[HANDOFF_REJECTED],
)
_MIRROR_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
_TERMINATE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))

_MIRRORED: dict[ControllerJobState, JobState] = {
    ControllerJobState.PENDING: JobState.PENDING,
    ControllerJobState.RUNNING: JobState.RUNNING,
    ControllerJobState.SUCCEEDED: JobState.SUCCEEDED,
    ControllerJobState.FAILED: JobState.FAILED,
    ControllerJobState.KILLED: JobState.KILLED,
    ControllerJobState.WORKER_FAILED: JobState.FAILED,
}


@workflow.defn(name="JobWorkflow")
class JobWorkflow:
    def __init__(self) -> None:
        self._spec: JobSpec | None = None
        self._status: JobStatus | None = None
        self._placement: Placement | None = None
        self._cancel: CancelRequest | None = None
        # Set once the handoff is committed: from then on a cancel must go through the peer.
        self._committed = False

    # ---- messages -------------------------------------------------------------------------

    @workflow.query
    def status(self) -> JobStatus:
        assert self._status is not None
        return self._status

    @workflow.signal
    def place(self, placement: Placement) -> None:
        if self._placement is None:
            self._placement = placement

    @workflow.signal
    def cancel(self, request: CancelRequest) -> None:
        self._request_cancel(request)

    @workflow.update
    def cancel_job(self, request: CancelRequest) -> CancelOutcome:
        """Cancel and say whether the cancel won the race against the handoff."""
        st = self.status()
        if st.terminal:
            return CancelOutcome(won=False, state=st.state, message=f"job already ended as {st.state.value}")
        won = not self._committed
        self._request_cancel(request)
        if won:
            return CancelOutcome(won=True, state=st.state, message="cancelled before handoff")
        return CancelOutcome(
            won=False,
            state=st.state,
            message=f"job was already handed to {st.cluster}; termination requested there",
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

    def _set(self, state: JobState, reason: str, *, cluster: str | None = None) -> None:
        st = self._status
        assert st is not None
        changed = state != st.state or reason != st.reason
        st.state = state
        st.reason = reason
        updates = [SA_STATE.value_set(state.value)]
        if cluster is not None and cluster != st.cluster:
            st.cluster = cluster
            updates.append(SA_PEER.value_set(cluster))
            changed = True
        if changed:
            self._event(state, reason)
        workflow.upsert_search_attributes(updates)
        workflow.set_current_details(f"**{state.value}** — {reason}" if reason else state.value)

    def _finish(self, state: JobState, reason: str) -> JobStatus:
        self._set(state, reason)
        assert self._status is not None
        return self._status

    # ---- the lifecycle --------------------------------------------------------------------

    @workflow.run
    async def run(self, spec: JobSpec) -> JobStatus:
        self._spec = spec
        self._status = JobStatus(
            job_id=spec.job_id,
            state=JobState.CLASSIFYING,
            submit_ms=spec.submit_ms,
            updated_ms=self._now_ms(),
            spec=spec,
        )
        self._set(JobState.CLASSIFYING, "Classifying against the federation's capacity reports")
        try:
            return await self._lifecycle(spec)
        except asyncio.CancelledError:
            # Temporal's own cancel converges on the same path as the signal and the update.
            self._request_cancel(CancelRequest(reason="Cancelled through Temporal"))
            return await self._after_cancel(spec)

    async def _lifecycle(self, spec: JobSpec) -> JobStatus:
        view = await workflow.execute_activity_method(
            PeerActivities.fetch_reports,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=_REPORTS_RETRY,
        )
        shape = spec.shape()
        decision = classify(
            shape,
            home=view.home,
            reports=view.reports,
            now_ms=self._now_ms(),
            stale_after_ms=view.stale_after_ms,
        )
        st = self._status
        assert st is not None
        st.disposition = decision.disposition.value
        st.classification_reason = decision.reason
        self._event(JobState.CLASSIFYING, f"classified {decision.disposition.value}: {decision.reason}")

        if decision.disposition is Disposition.REJECT:
            return self._finish(JobState.REJECTED, decision.reason)
        if self._cancel is not None:
            return self._finish(JobState.KILLED, "Cancelled before handoff")

        if decision.disposition is Disposition.LOCAL:
            target = view.home
            backend = self._backend_for(view, target)
        elif decision.pinned_cluster is not None:
            target = decision.pinned_cluster
            backend = self._backend_for(view, target)
        else:
            placement = await self._wait_for_placement(shape.deadline_ms)
            if placement is None:
                if self._cancel is not None:
                    return self._finish(JobState.KILLED, "Cancelled before handoff")
                return self._finish(
                    JobState.UNSCHEDULABLE, "Scheduling timeout passed before any cluster had room"
                )
            target, backend = placement.cluster, placement.backend_id

        if self._cancel is not None:
            return self._finish(JobState.KILLED, "Cancelled before handoff")
        return await self._hand_off(spec, view.home, target, backend)

    def _backend_for(self, view: FederationView, cluster: str) -> str:
        report = view.report(cluster)
        assert self._spec is not None
        chosen = pick_backend(self._spec.shape(), report) if report is not None else None
        if chosen is None and report is not None and report.backends:
            # Force-route (SPEC §5): a pinned peer that advertises no matching shape still gets the
            # job; its controller accepts or refuses it.
            chosen = report.backends[0].backend_id
        return chosen or ""

    async def _wait_for_placement(self, deadline_ms: int | None) -> Placement | None:
        self._set(JobState.QUEUED_HANDOFF, "Queued for a federation peer to report free capacity")
        timeout = None
        if deadline_ms is not None:
            timeout = timedelta(milliseconds=max(0, deadline_ms - self._now_ms()))
        try:
            await workflow.wait_condition(
                lambda: self._placement is not None or self._cancel is not None, timeout=timeout
            )
        except TimeoutError:
            return None
        return None if self._cancel is not None else self._placement

    async def _hand_off(self, spec: JobSpec, home: str, cluster: str, backend: str) -> JobStatus:
        # The commit point: flipped in the same workflow task that schedules the launch, so a
        # cancel either lands before it (and wins) or after it (and is routed to the peer).
        self._committed = True
        assert self._status is not None
        self._status.backend_id = backend
        self._set(JobState.PENDING_HANDOFF, f"Awaiting acceptance by {cluster}", cluster=cluster)
        request = LaunchRequest(
            job_id=spec.job_id,
            command=spec.command,
            env=spec.env,
            device=spec.device,
            band=spec.band,
            user=spec.user,
            requester=home,
            nonce=f"{spec.job_id}@{spec.submit_ms}",
            backend_id=backend,
        )
        try:
            launched = await workflow.execute_activity_method(
                PeerActivities.launch_job,
                LaunchInput(cluster=cluster, request=request),
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=_HANDOFF_RETRY,
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == HANDOFF_REJECTED:
                return self._finish(JobState.HANDOFF_REJECTED, cause.message)
            return await self._park(f"Handoff to {cluster} failed after retries: {cause or exc}")
        if cluster != home:
            self._set(JobState.HANDED_OFF, f"Accepted by {cluster}")
        else:
            self._event(JobState.HANDED_OFF, f"Accepted by the home cluster {cluster}")
        return await self._mirror(cluster, launched)

    async def _park(self, reason: str) -> JobStatus:
        """HANDOFF_FAILED waits for an operator (SPEC §9) or a cancel; never dropped silently."""
        self._set(JobState.HANDOFF_FAILED, reason)
        await workflow.wait_condition(lambda: self._cancel is not None)
        return self._finish(JobState.KILLED, "Cancelled while parked after a failed handoff")

    def _apply(self, remote: ControllerJobStatus) -> None:
        assert self._status is not None
        state = _MIRRORED[remote.state]
        self._status.exit_code = remote.exit_code
        self._status.error = remote.error
        self._status.backend_id = remote.backend_id
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
                cause = exc.cause
                if isinstance(cause, ApplicationError) and cause.type == JOB_LOST:
                    if terminated:
                        return self._finish(JobState.KILLED, f"Killed; {cluster} no longer knows the job")
                    return self._finish(JobState.FAILED, cause.message)
                raise
            self._apply(remote)
        if self._cancel is not None and remote.state is ControllerJobState.KILLED:
            return self._finish(JobState.KILLED, f"Cancelled on {cluster}: {self._cancel.reason}")
        assert self._status is not None
        return self._status

    def _mirror_wakeup(self, handle: asyncio.Future[ControllerJobStatus], terminated: bool) -> bool:
        return handle.done() or (self._cancel is not None and not terminated)

    async def _terminate(self, cluster: str, job_id: str) -> None:
        self._event(self._status.state if self._status else JobState.KILLED, f"terminating on {cluster}")
        await workflow.execute_activity_method(
            PeerActivities.terminate_job,
            TerminateInput(cluster=cluster, job_id=job_id),
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=_TERMINATE_RETRY,
        )

    async def _after_cancel(self, spec: JobSpec) -> JobStatus:
        st = self._status
        assert st is not None
        if not self._committed or st.cluster is None:
            return self._finish(JobState.KILLED, "Cancelled before handoff")
        if st.state is JobState.HANDOFF_FAILED:
            return self._finish(JobState.KILLED, "Cancelled while parked after a failed handoff")
        await self._terminate(st.cluster, spec.job_id)
        return self._finish(JobState.KILLED, f"Cancelled on {st.cluster}: Cancelled through Temporal")
