"""FOLLOWING: an attempt runs on its cluster, followed to its end (steps/attempt.py); then the
job ends as it did, or, an attempt that failed or that its cluster lost, with a retry left of its
budget, goes back to the queue as the next attempt (docs/DESIGN.md, "Attempts"). Runs begun
before attempts were numbered follow their job as workflows/job/legacy.py does."""

from __future__ import annotations

import dataclasses

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from iris.controller.models import ControllerJobState
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import AttemptEnd, JobState
    from iris.policy.reasons import ReasonCode

import workflows.job.ends as ends
import workflows.job.legacy as legacy
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, Phase
from workflows.job.steps import attempt, common, queue


@dataclasses.dataclass(frozen=True)
class Retry:
    """An attempt ended in a way the job may retry (a failure, or its cluster lost it)."""

    end: AttemptEnd
    reason: str
    # The cluster's "preempted by <job id> at <time>" when it preempted the attempt (PREEMPT_PATCH).
    preempted: str | None = None


async def step(ctx: Ctx) -> Phase:
    run = ctx.run
    assert run.remote is not None
    if not ctx.features.numbered:  # runs begun before attempts were numbered
        return await legacy.mirror_to_end(ctx, run.cluster, run.remote)
    end, reason, last = await attempt.follow(ctx)
    retry = await concluded(ctx, end, reason, last)
    if retry is None:
        return Phase.ENDED
    return await next_attempt(ctx, retry)


async def follow_to_end(ctx: Ctx, cluster: str, remote: ControllerJobStatus) -> Phase:
    """The attempt on ``cluster`` followed from ``remote`` to its end (a cancel carried out on its
    cluster: steps/cancel.py)."""
    ctx.run.cluster, ctx.run.remote = cluster, remote
    return await step(ctx)


async def concluded(ctx: Ctx, end: AttemptEnd, reason: str, last: ControllerJobStatus | None) -> Retry | None:
    """The attempt's end, recorded. None: the job ended (its handle too); a ``Retry``: the attempt
    failed, or its cluster lost it, and the job has a retry left for that, or its cluster preempted
    it for a higher band (REQUEUE_PATCH: always retried, unless a cancel is on its way)."""
    run = ctx.run
    cancel = run.mailbox.cancel
    preempted = None
    if ctx.features.preemption and last is not None and last.state is ControllerJobState.PREEMPTED:
        preempted = last.error or f"preempted on {run.cluster}"
    ends.attempt_ended(run, end, reason, last.exit_code if last is not None else None, preempted)
    if preempted is not None and cancel is None and ctx.features.requeues:
        # The scheduler's decision, not the job's fault: queued again, whatever its budgets.
        return Retry(end, reason, preempted)
    retries = ends.budget(run, end)
    if retries is not None and cancel is None:
        used, budget, flag = retries
        if used < budget:
            return Retry(end, reason, preempted)
        if budget:
            reason = f"{reason}; no retries left ({flag} {budget})"
    final = ends.final_state(end)
    code = ReasonCode.Preempted if preempted is not None else end.code
    if end is AttemptEnd.PREEMPTED and cancel is not None:
        # Lost while a cancel was on its way (its cluster restarted, say): the job was cancelled.
        final, reason = JobState.KILLED, f"Cancelled: {cancel.reason}; the attempt was lost: {reason}"
        code = ReasonCode.Cancelled
    # Shown only now: an attempt that is retried never shows the job as ended.
    if last is not None:
        transitions.mirror(ctx, last)
    transitions.move(ctx, final, reason, code=code)
    await common.record_end(ctx, None)
    return None


async def next_attempt(ctx: Ctx, retry: Retry) -> Phase:
    """The next attempt goes through the queue again (same pin, else any eligible cluster)."""
    run = ctx.run
    if retry.end is AttemptEnd.FAILED:
        run.failures_retried += 1
    elif retry.preempted is not None and ctx.features.requeues:
        run.band_preemptions += 1
    else:
        run.preemptions_retried += 1
    run.attempt += 1
    transitions.event(
        ctx, run.status.state, f"attempt {run.attempt - 1} ended ({retry.end.value}): {retry.reason}"
    )
    await queue.requeue(ctx)
    if ctx.features.requeues:
        # No attempt is on a cluster until the next launch: a cancel now is one before handoff.
        run.delivered = False
    queued = f"Attempt {run.attempt} queued: attempt {run.attempt - 1} on {run.cluster}"
    if retry.preempted is not None:
        transitions.move(
            ctx, JobState.QUEUED_HANDOFF, f"{queued} was {retry.preempted}", code=ReasonCode.Preempted
        )
    else:
        transitions.move(ctx, JobState.QUEUED_HANDOFF, f"{queued} {retry.end.value.lower()}")
    return Phase.QUEUED
