"""CANCEL: one resolver for every cancel (docs/DESIGN.md, "Cancellation"): the ``cancel`` signal
and the ``cancel_job`` Update leave a request in the mailbox, which a step hands here where it
sees it; Temporal's own cancel of the run comes here from whatever step it interrupted. A job
never delivered is never delivered (its handle records the cancel); a parked one is stopped
where its launch may have landed; one on a cluster is terminated there and followed to its end.
(A cancel while an attempt is followed is carried out by the follower: steps/attempt.py.)"""

from __future__ import annotations

import contextlib

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.store import CancelIntentInput, StoreActivities
    from iris import contract
    from iris.jobs import AttemptEnd, JobState
    from iris.policy import CANCELLED_BEFORE_HANDOFF

import workflows.job.effects as effects
import workflows.job.ends as ends
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, Phase
from workflows.job.steps import common, follow

CANCELLED_WHILE_PARKED = "Cancelled while parked after a failed handoff"


async def step(ctx: Ctx) -> Phase:
    run = ctx.run
    st = run.status
    if ctx.temporal_cancel:
        # Let shielded writes land first, so the cancel is recorded against what they wrote.
        for op in (ctx.enqueue_op, ctx.launch_op):
            if op is not None and not op.done():
                with contextlib.suppress(ActivityError):
                    await op
        if st.terminal:
            return Phase.ENDED
        if not run.delivered or st.cluster is None:
            return await before_handoff(ctx)
    if st.state is JobState.HANDOFF_FAILED:
        return await common.finish(ctx, JobState.KILLED, await stop_maybe_running(ctx))
    if ctx.temporal_cancel:
        return await on_cluster(ctx)
    return await before_handoff(ctx)


async def before_handoff(ctx: Ctx) -> Phase:
    """A cancel seen before the launch was sent: the job is never delivered; a queued job's
    handle records the cancel intent (either way the job is never delivered)."""
    run = ctx.run
    if run.queued:
        assert run.mailbox.cancel is not None
        outcome = await effects.store_step(
            ctx,
            StoreActivities.record_cancel,
            CancelIntentInput(job_id=run.spec.job_id, reason=run.mailbox.cancel.reason),
        )
        if not outcome.won:
            transitions.event(
                ctx, JobState.PENDING_HANDOFF, "cancel arrived after promotion; the job is not handed off"
            )
    return await common.finish(ctx, JobState.KILLED, CANCELLED_BEFORE_HANDOFF)


async def stop_maybe_running(ctx: Ctx) -> str:
    """A cancel of a parked job: if its last launch may have landed, terminate it there and wait
    for the cluster to confirm (or to say it never had it); a cluster silent past
    peer_lost_after gets a fence, which terminates the attempt when it answers again. Returns
    the job's final reason."""
    run = ctx.run
    if run.maybe_on is None:
        return CANCELLED_WHILE_PARKED
    cluster, nonce = run.maybe_on
    run.maybe_on = None
    if await effects.terminate(ctx, cluster, nonce):
        return f"{CANCELLED_WHILE_PARKED}; {cluster} confirms the job is not running there"
    await effects.fence(ctx, cluster, nonce)
    return (
        f"{CANCELLED_WHILE_PARKED}; {cluster} did not answer for {run.lost_after_s:.0f}s: the "
        "attempt is fenced there (terminated as soon as it answers)"
    )


async def on_cluster(ctx: Ctx) -> Phase:
    """Temporal's cancel of a job delivered to its cluster: read the job there, then follow it to
    its end (the follower terminates it). A cluster that forgot it leaves nothing to terminate;
    one silent for peer_lost_after gets a fence."""
    run = ctx.run
    cluster = run.status.cluster
    assert cluster is not None
    try:
        remote = await effects.read_remote(ctx, cluster)
    except ActivityError as exc:
        if effects.is_cancellation(exc) or not ctx.features.numbered:
            raise
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == contract.JOB_LOST:
            # The cluster has forgotten the job: nothing is left to terminate there.
            reason = f"Killed; {cluster} no longer knows the job"
        else:
            # Silent for peer_lost_after: the attempt is terminated there when it answers.
            await effects.fence(ctx, cluster, run.nonce)
            reason = f"Cancelled; {cluster} is silent: the job is fenced there"
        ends.attempt_ended(run, AttemptEnd.KILLED, reason, None)
        return await common.finish(ctx, JobState.KILLED, reason)
    return await follow.follow_to_end(ctx, cluster, remote)
