"""JobWorkflow: one durable workflow per job (docs/DESIGN.md, "Data flow" and "Job states").

The shell: the inputs read into one JobRun (workflows/job/state.py), the patches read once
(workflows/versions.py), the message handlers, which only write the run's mailbox
(workflows/job/messages.py), and ``run``: one loop over the phases, each a step of
workflows/job/steps/ that returns the next (the table: workflows/job/transitions.py), until the
job has ended. A run that continued as new enters the same loop at its phase. A Temporal cancel of
the run, wherever it interrupts a step, goes to the cancel step like the signal and the Update."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.watch import Observation
    from iris import contract
    from iris.jobs import CancelOutcome, CancelRequest, JobState, JobStatus, ReplayRequest, WaitReason
    from iris.payloadconverter import still_encrypted
    from iris.policy.models import Placement
    from iris.userauth import Action

import workflows.job.effects as effects
import workflows.job.messages as messages
import workflows.job.transitions as transitions
import workflows.versions as versions
from workflows.job.state import Ctx, Phase, new_run, read_inputs
from workflows.job.steps import cancel, classify, follow, handoff, parked, queue

# The step of each phase: it carries the job through the phase and returns the next.
STEPS: Mapping[Phase, Callable[[Ctx], Awaitable[Phase]]] = MappingProxyType(
    {
        Phase.CLASSIFY: classify.step,
        Phase.QUEUED: queue.step,
        Phase.HANDOFF: handoff.step,
        Phase.FOLLOWING: follow.step,
        Phase.PARKED: parked.step,
        Phase.CANCEL: cancel.step,
    }
)


@workflow.defn(name=contract.JOB_WORKFLOW)
class JobWorkflow:
    @workflow.init
    def __init__(self, *inputs: Any) -> None:
        # A start carries one payload (the spec), a continued run two (the spec and its JobRun).
        # Both are taken untyped (the SDK decodes a start untyped anyway: one payload for two
        # parameters) and validated here; an input that is not a spec, or that cannot be read
        # (iris/payloadconverter.py), is refused in run()'s first task (SUBMISSION_PATCH), never
        # a task failed for ever.
        spec, carried, refused_input = read_inputs(inputs)
        self._sealed_input = any(isinstance(v, RawValue) and still_encrypted(v.payload) for v in inputs)
        # Built here, not in run(): a query, signal or Update can arrive in the very first task,
        # before run() starts (e.g. a cancel right after submit).
        self._fresh = new_run(spec, workflow.info().workflow_id)
        self._carried = carried
        self._ctx = Ctx(run=self._fresh, refused_input=refused_input)
        if carried is not None:
            # A JobRun comes only from the run this one continues; a raw start with one is refused.
            self._ctx.forged_carry = workflow.info().continued_run_id is None
            carried.runs += 1
            self._ctx.run = carried

    # ---- messages: each writes the mailbox (workflows/job/messages.py) -----------------------

    @workflow.query(name=contract.STATUS)
    def status(self) -> JobStatus:
        return self._ctx.run.status

    @workflow.signal(name=contract.PLACE)
    def place(self, placement: Placement) -> None:
        """From the placement tick: promote the job to this (peer, backend)."""
        messages.place(self._ctx, placement)

    @workflow.signal(name=contract.EXPLAIN)
    def explain(self, reason: str) -> None:
        """From a placement tick that predates reason codes: why the job is still queued. Kept for
        the runs whose history holds one (they replay through it); the code stays as it was."""
        messages.explained(self._ctx, reason, None)

    @workflow.signal(name=contract.EXPLAIN_REASON)
    def explain_reason(self, why: WaitReason) -> None:
        """From the placement tick: why the job is still queued (the pending reason) and its code."""
        messages.explained(self._ctx, why.reason, why.code, why.hold)

    @workflow.signal(name=contract.EXPIRE)
    def expire(self) -> None:
        """From the placement tick: the scheduling deadline passed."""
        messages.expire(self._ctx)

    @workflow.signal(name=contract.OBSERVE)
    def observe(self, seen: Observation) -> None:
        """From the watcher of a cluster (docs/DESIGN.md, "Mirroring"): the attempt's status there
        now, or that the cluster has gone silent."""
        messages.observe(self._ctx, seen)

    @workflow.signal(name=contract.WANT_LOGS)
    def want_logs(self, until_ms: int) -> None:
        """From a reader of the job's log (``iris job logs -f``)."""
        messages.want_logs(self._ctx, until_ms)

    @workflow.signal(name=contract.CANCEL)
    async def cancel(self, request: CancelRequest) -> None:
        # A cancel whose signature does not verify is recorded and ignored (AUTH_PATCH).
        if await messages.refused(self._ctx, Action.CANCEL, request.signature, request) is None:
            messages.request_cancel(self._ctx, request)

    @workflow.update(name=contract.CANCEL_JOB)
    async def cancel_job(self, request: CancelRequest) -> CancelOutcome:
        """Cancel, and say whether the cancel won: won = the job was never delivered to a cluster."""
        run = self._ctx.run
        if run.status.terminal:
            return run.status.ended_cancel_outcome()
        refusal = await messages.refused(self._ctx, Action.CANCEL, request.signature, request)
        if refusal is not None:
            raise ApplicationError(refusal, type=contract.UNAUTHENTICATED, non_retryable=True)
        messages.request_cancel(self._ctx, request)
        return await messages.cancel_outcome(run)

    @workflow.update(name=contract.REPLAY_HANDOFF)
    async def replay_handoff(self, request: ReplayRequest) -> str:
        """Operator: re-run the artifact check and handoff of a parked job (docs/DESIGN.md,
        "Replaying a failed handoff"); the job's owner or an admin, signed (AUTH_PATCH)."""
        refusal = await messages.refused(self._ctx, Action.REPLAY, request.signature, request)
        if refusal is not None:
            raise ApplicationError(refusal, type=contract.UNAUTHENTICATED, non_retryable=True)
        if versions.authenticates():
            # The job may have moved on while the signature was checked.
            try:
                messages.check_replay(self._ctx, request)
            except ValueError as exc:
                raise ApplicationError(str(exc), non_retryable=True) from None
        self._ctx.run.mailbox.replay = request
        return f"replay accepted: {request.describe()}"

    @replay_handoff.validator
    def _check_replay(self, request: ReplayRequest) -> None:
        messages.check_replay(self._ctx, request)

    # ---- the lifecycle ---------------------------------------------------------------------

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
        if self._sealed_input and workflow.unsafe.is_replaying():
            # Read before (the run went on), unreadable now: this process lacks a key of the ring.
            # The task (or a replay) fails with that, as the codec itself used to fail it; only a
            # new start that no key here opens is refused (steps/classify.py, ``admit``).
            raise RuntimeError(self._ctx.refused_input)
        ctx = self._ctx
        ctx.features = versions.read(
            first_run=self._first_run, classifying=self._classifying, carried_local_steps=ctx.run.local_steps
        )
        if ctx.run is not self._fresh and ctx.features.reasons:
            # The visibility store holds what the run that continued as new last upserted.
            ctx.run.sa_reason = workflow.info().typed_search_attributes.get(contract.SA_REASON)
        await self._loop(ctx)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return ctx.run.status

    def _first_run(self, checked: bool) -> bool:
        """Whether this run begins the job (versions.read asks, once SUBMISSION_PATCH is known)."""
        ctx = self._ctx
        if not checked and ctx.refused_input is not None:
            raise ValueError(ctx.refused_input)  # before the patch: the task failed (for ever)
        if checked and ctx.forged_carry:
            # A raw start with a JobRun: a new job, refused in its first task (classify, ``admit``).
            ctx.run = self._fresh
        return ctx.run is self._fresh

    def _classifying(self, reasons: bool, local_steps: bool) -> None:
        """A new job shows CLASSIFYING (versions.read calls this where every first run did it)."""
        ctx = self._ctx
        run = ctx.run
        # The move below writes as these two features say (the rest are read after it).
        ctx.features = versions.Features(reasons=reasons, local_steps=local_steps)
        run.local_steps = local_steps
        if reasons:
            # The visibility store holds what the client set at start.
            run.sa_reason = workflow.info().typed_search_attributes.get(contract.SA_REASON)
        if local_steps:
            run.sa_state = JobState.CLASSIFYING.value  # set by the client at start
        if versions.current_baseline():
            # The memo the client started the run with (iris/jobs.py, start_memo), if it did:
            # what it holds need not be written again. Asked only by a run begun with the 2027-01
            # baseline (memoized by read, which asked it first): an older run wrote its memo here.
            run.memo_reason = workflow.memo_value(contract.MEMO_REASON, None, type_hint=str)
        transitions.event(ctx, JobState.CLASSIFYING, run.status.reason)
        transitions.move(ctx, JobState.CLASSIFYING, run.status.reason)

    async def _loop(self, ctx: Ctx) -> None:
        """Each phase's step until the job has ended. Temporal's own cancel, wherever it surfaces
        (a CancelledError, or an ActivityError around one from the activity that was running),
        hands the job to the cancel step; a second one, or any other error, ends the run."""
        run = ctx.run
        while run.phase is not Phase.ENDED:
            phase = run.phase
            try:
                nxt = await STEPS[phase](ctx)
            except (asyncio.CancelledError, ActivityError) as exc:
                if ctx.temporal_cancel or not effects.is_cancellation(exc):
                    raise
                ctx.temporal_cancel = True
                messages.request_cancel(ctx, CancelRequest(reason="Cancelled through Temporal"))
                nxt = Phase.CANCEL
            transitions.check(phase, nxt)
            run.phase = nxt


__all__ = ("JobWorkflow",)
