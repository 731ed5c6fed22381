"""The launch of an attempt (docs/DESIGN.md, "Launch", "Attempts", "Workspace bundles"): a signed
launch under the job's id and the attempt's nonce; an earlier attempt its cluster lost asked after
(or stopped) first; the workspace bundle staged (BUILDING) when the cluster answers that it lacks
it; a launch whose answer never came reconciled with its cluster before the job parks."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pydantic import ValidationError
from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.peers import AttemptFound, PeerActivities, StageInput
    from iris.bundle import BundleRef
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.controller.models import LaunchRequest
    from iris.jobs import AttemptEnd, JobState
    from iris.policy.reasons import ReasonCode

import workflows.job.effects as effects
import workflows.job.ends as ends
import workflows.job.transitions as transitions
import workflows.versions as versions
from workflows.job.state import Adopted, Ctx, Parking, Phase
from workflows.job.steps import common

if TYPE_CHECKING:
    # What a launch comes to: the cluster's answer, a park, an earlier attempt adopted, or a phase
    # (a cancel seen first, a refusal that ended the job).
    Launched = ControllerJobStatus | Parking | Adopted | Phase


async def launch(ctx: Ctx, bundle: BundleRef | None, *, stage_first: bool = True) -> Launched:
    """The handoff: from the workflow task that schedules it on, the job counts as delivered.
    ``stage_first`` False (LAUNCH_FIRST_PATCH): ``bundle`` was not staged; a cluster that lacks
    it says so, and it is staged before the launch is sent again."""
    run = ctx.run
    if ctx.verifying and not run.delivered:
        await common.verdicts(ctx)
        if run.mailbox.cancel is not None:
            return Phase.CANCEL
    cluster = run.cluster
    transitions.move(ctx, JobState.PENDING_HANDOFF, f"Awaiting acceptance by {cluster}")
    run.delivered = True
    run.status.handoff_attempts += 1
    adopted = await clear_stale(ctx, cluster)
    if adopted is not None:
        return adopted
    ends.attempt_started(run, cluster, run.backend)
    request = launch_request(ctx, bundle)
    if isinstance(request, Parking):
        return request
    try:
        return await send(ctx, request, stage_missing=stage_first)
    except ActivityError as exc:
        if bundle is not None and effects.bundle_missing(exc):
            return await stage_and_resend(ctx, bundle, request)
        return await unanswered(ctx, exc)


async def send(ctx: Ctx, request: LaunchRequest, *, stage_missing: bool = True) -> ControllerJobStatus:
    """launch_job, shielded like the enqueue: a Temporal cancel lets the launch finish, then
    terminates on the peer (a swallowed cancel would let the job run on)."""
    ctx.launch_op = effects.start_launch(ctx, ctx.run.cluster, request, stage_missing=stage_missing)
    return await asyncio.shield(ctx.launch_op)


async def stage_and_resend(ctx: Ctx, bundle: BundleRef, request: LaunchRequest) -> Launched:
    """The cluster answered that it lacks the bundle, so it did not take the job: not delivered
    until the launch is sent again. The bundle is staged (BUILDING), then the same request (same
    nonce) is sent; a cluster that lost the bundle again meanwhile gets it from the launch itself."""
    run = ctx.run
    run.delivered = False
    run.status.handoff_attempts -= 1  # counted again when it is sent again
    if run.mailbox.cancel is not None:
        return Phase.CANCEL
    stopped = await stage_bundle(ctx, bundle)
    if stopped is not None:
        return stopped
    # A cancel being verified is honoured before the job is sent (as before the first send).
    await common.verdicts(ctx)
    if run.mailbox.cancel is not None:
        return Phase.CANCEL
    transitions.move(ctx, JobState.PENDING_HANDOFF, f"Awaiting acceptance by {run.cluster}")
    run.delivered = True
    run.status.handoff_attempts += 1
    try:
        return await send(ctx, request)
    except ActivityError as exc:
        return await unanswered(ctx, exc)


async def stage_bundle(ctx: Ctx, bundle: BundleRef) -> Parking | Phase | None:
    """BUILDING: the workspace bundle goes to the attempt's cluster before the launch
    (docs/DESIGN.md, "Workspace bundles"). None: staged, the handoff goes on."""
    run = ctx.run
    cluster = run.cluster
    transitions.move(ctx, JobState.BUILDING, f"Staging workspace bundle {bundle.describe()} on {cluster}")
    stage = StageInput(cluster=cluster, bundle=bundle)
    step = effects.Step(effects.STAGE_TIMEOUT, effects.handoff_retry(ctx))
    try:
        staged = await effects.handoff_step(PeerActivities.stage_bundle, stage, step)
    except ActivityError as exc:
        return await common.refused_or_parked(ctx, exc, f"Cannot stage the workspace bundle on {cluster}")
    done = "uploaded to" if staged.uploaded else "already on"
    transitions.event(ctx, JobState.BUILDING, f"workspace bundle {bundle.short} {done} {cluster}")
    return Phase.CANCEL if run.mailbox.cancel is not None else None


def launch_request(ctx: Ctx, bundle: BundleRef | None) -> LaunchRequest | Parking:
    """What the cluster is sent; a request it would refuse parks the job (SUBMISSION_PATCH),
    nothing sent, rather than failing the workflow task for ever."""
    run = ctx.run
    spec = run.spec
    assert run.view is not None
    try:
        return LaunchRequest(
            job_id=spec.job_id,
            command=spec.command,
            env=spec.env,
            device=spec.device,
            band=spec.band,
            # The verified principal: a peer's allowed_submitters judges who signed, not a claim.
            user=run.principal or spec.user,
            requester=run.view.home,
            nonce=run.nonce,
            backend_id=run.backend,
            bundle=bundle,
            timeout_s=spec.timeout_s,
            # Earlier attempts preempted or lost: the cluster's victim choice and exemption use it.
            preemptions=run.preemptions_retried + run.band_preemptions,
        )
    except ValidationError as exc:
        if not ctx.features.checked:
            raise
        # No backend known on the cluster, say: parked, not a task failed for ever.
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return Parking(f"Cannot hand off to {run.cluster}: {where}: {first['msg'][:120]}")


async def unanswered(ctx: Ctx, exc: ActivityError) -> Launched:
    """The launch failed for good. A refusal ends the job; with attempts, a launch with no answer
    may have landed: the cluster says whether it has the attempt (followed there), confirms it
    never received it (parked), or stays silent (parked, the outcome unknown: ``maybe_on``)."""
    run = ctx.run
    cluster = run.cluster
    why = f"Handoff to {cluster} failed after retries"
    if effects.is_cancellation(exc) or effects.refusal(exc) or not ctx.features.numbered:
        return await common.refused_or_parked(ctx, exc, why)
    found = await effects.find_attempt(ctx, cluster, run.nonce)
    if found.found is AttemptFound.HERE and found.status is not None:
        transitions.event(
            ctx, JobState.PENDING_HANDOFF, f"{cluster} has the job although its answer was lost"
        )
        return found.status
    if found.found is AttemptFound.ABSENT:
        return Parking(f"{why}: {exc.cause or exc}; {cluster} confirms it never received the job")
    run.maybe_on = (cluster, run.nonce)
    return Parking(
        f"{why}: {exc.cause or exc}; the outcome is unknown: {cluster} does not answer, and "
        f"the job may be running there",
        code=ReasonCode.PeerUnreachable,
    )


async def clear_stale(ctx: Ctx, cluster: str) -> Adopted | None:
    """Before a later attempt on ``cluster``: an earlier attempt there that its cluster lost
    (silent) may be running again; it is stopped first (a cluster runs one attempt at a time).
    One that ended SUCCEEDED while its cluster was silent is the job's result: adopted, and no
    new run starts (docs/DESIGN.md, "Attempts")."""
    run = ctx.run
    for earlier in list(run.status.attempts):
        if earlier.cluster != cluster or ends.ending(earlier) is not AttemptEnd.PREEMPTED:
            continue
        if earlier.preempted is not None:
            continue  # the cluster preempted it: ended there for good, nothing to ask
        if not (ctx.features.numbered and versions.asks_earlier_attempt()):
            await effects.terminate(ctx, cluster, earlier.nonce)
            continue
        found = await effects.find_attempt(ctx, cluster, earlier.nonce)
        if found.found is AttemptFound.ABSENT:
            continue  # the cluster holds nothing of that attempt any more
        status = found.status
        if found.found is not AttemptFound.HERE or status is None or not status.terminal:
            await effects.terminate(ctx, cluster, earlier.nonce)
            continue
        end = ends.end_of(status)
        if end is AttemptEnd.SUCCEEDED:
            transitions.event(
                ctx,
                run.status.state,
                f"attempt {earlier.number} succeeded on {cluster} while {cluster} was silent: "
                "its result stands, and no new run starts",
            )
            # The earlier attempt is the job's again: its output is relayed under its number.
            run.attempt = earlier.number
            ends.reopened(earlier)
            return Adopted(cluster, status)
        transitions.event(
            ctx,
            run.status.state,
            f"attempt {earlier.number} had ended on {cluster} while {cluster} was silent "
            f"({end.value.lower()})",
        )
    return None
