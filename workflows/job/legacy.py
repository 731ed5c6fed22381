"""How runs begun before attempts were numbered (before ``attempts-v1``) follow their job: one
mirror_job after another until the job ends, a cancel terminating it there first (docs/DESIGN.md,
"Mirroring"). Kept only so that such runs, in flight or recorded (tests/determinism/histories/
v1-*), replay; docs/DESIGN.md, "Determinism check", says when it can go."""

from __future__ import annotations

import functools

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from iris import contract
    from iris.controller.models import ControllerJobState
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import JobState
    from iris.policy.reasons import ReasonCode

import workflows.job.effects as effects
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, Phase
from workflows.job.steps import common


async def mirror_to_end(ctx: Ctx, cluster: str, remote: ControllerJobStatus) -> Phase:
    """Follow the job on ``cluster`` until it ends, then end its queue handle as it ended."""
    await mirror(ctx, cluster, remote)
    # (A job its cluster lost has had its handle ended by ``mirror`` already; this second
    # write is kept so that runs recorded with it replay.)
    await common.record_end(ctx, None)
    return Phase.ENDED


async def mirror(ctx: Ctx, cluster: str, remote: ControllerJobStatus) -> None:
    """Mirror the job's state; a cancel terminates it there."""
    run = ctx.run
    job_id = remote.job_id
    terminated = False
    transitions.mirror(ctx, remote)
    while not remote.terminal:
        if run.mailbox.cancel is not None and not terminated:
            await effects.terminate(ctx, cluster)
            terminated = True
            continue
        handle = effects.start_mirror(ctx, cluster, job_id, remote.state.value)
        if not await effects.done_before_cancel(
            handle, functools.partial(common.cancel_unsent, ctx, terminated)
        ):
            continue
        try:
            remote = await handle
        except ActivityError as exc:
            if effects.is_cancellation(exc):
                raise
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == contract.JOB_LOST:
                if terminated:
                    await common.end(ctx, JobState.KILLED, f"Killed; {cluster} no longer knows the job")
                else:
                    await common.end(ctx, JobState.FAILED, cause.message, ReasonCode.PeerLost)
                return
            raise
        transitions.mirror(ctx, remote)
    cancel = run.mailbox.cancel
    if cancel is not None and remote.state is ControllerJobState.KILLED:
        transitions.move(ctx, JobState.KILLED, f"Cancelled on {cluster}: {cancel.reason}")
