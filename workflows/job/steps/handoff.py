"""PENDING_HANDOFF → artifact check → BUILDING → launch → HANDED_OFF (docs/DESIGN.md, "Handoff
and admission", "Artifact check", "Workspace bundles"). A handoff that cannot complete parks the
job (steps/parked.py), a refusal ends it, a cancel seen before the launch is carried out as one;
an accepted launch, or an attempt found on its cluster, is followed there."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.artifacts import ArtifactActivities, ArtifactInput
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import JobState
    from iris.policy.reasons import ReasonCode
    from iris.store.models import HandleState

import workflows.job.effects as effects
import workflows.job.transitions as transitions
import workflows.versions as versions
from workflows.job.state import Adopted, Ctx, Parking, Phase
from workflows.job.steps import common, launch, parked


async def step(ctx: Ctx) -> Phase:
    run = ctx.run
    begin(ctx)
    await common.verdicts(ctx)
    if run.mailbox.cancel is not None:
        return Phase.CANCEL
    if run.spec.artifacts and (stopped := await check_artifacts(ctx)) is not None:
        return await settle(ctx, stopped)
    bundle = run.spec.bundle if run.spec.bundle is not None and versions.stages_bundle() else None
    # LAUNCH_FIRST_PATCH: the launch finds out whether the cluster holds the bundle, and the
    # bundle is staged only if not (steps/launch.py); before it, every handoff staged first.
    first = bundle is not None and versions.launches_first()
    if bundle is not None and not first and (stopped := await launch.stage_bundle(ctx, bundle)) is not None:
        return await settle(ctx, stopped)
    return await settle(ctx, await launch.launch(ctx, bundle, stage_first=not first))


def begin(ctx: Ctx) -> None:
    """PENDING_HANDOFF on the attempt's cluster."""
    run = ctx.run
    cluster = run.cluster
    run.status.backend_id = run.backend
    home = run.view is not None and cluster == run.view.home
    prepare = f"Runs at home on {cluster}" if home or not run.queued else f"Promoted to {cluster}"
    transitions.move(ctx, JobState.PENDING_HANDOFF, f"{prepare}; preparing the handoff", cluster=cluster)


async def settle(ctx: Ctx, outcome: launch.Launched) -> Phase:
    """Where the handoff leaves the job."""
    run = ctx.run
    if isinstance(outcome, Phase):
        return outcome
    if isinstance(outcome, Parking):
        return await parked.enter(ctx, outcome)
    if isinstance(outcome, Adopted):
        # An earlier attempt succeeded on the cluster this one was about to go to.
        run.cluster = outcome.cluster
        run.remote = await common.relay_end(ctx, outcome.cluster, outcome.remote)
        return Phase.FOLLOWING
    return await accepted(ctx, outcome)


async def accepted(ctx: Ctx, launched: ControllerJobStatus) -> Phase:
    """HANDED_OFF (a peer; an event at home): the job is followed on its cluster from the launch's
    answer."""
    run = ctx.run
    cluster = run.cluster
    assert run.view is not None
    if cluster != run.view.home:
        transitions.move(ctx, JobState.HANDED_OFF, f"Accepted by {cluster}")
    else:
        transitions.event(ctx, JobState.HANDED_OFF, f"Accepted by the home cluster {cluster}")
    if run.queued:
        # The cluster's own clock at acceptance: its capacity reports count the job from then.
        await effects.set_handle_state(ctx, HandleState.HANDED_OFF, counted_from_ms=launched.created_ms)
    if launched.terminal and versions.relays_terminal_launch():
        # A launch repeated after a lost reply can find the job already ended: its output
        # still has to be relayed home, which the mirror does before it reports an end.
        launched = await common.relay_end(ctx, cluster, launched)
    run.remote = launched
    return Phase.FOLLOWING


async def check_artifacts(ctx: Ctx) -> Parking | Phase | None:
    """The destination checks the job's artifacts in its own store (docs/DESIGN.md, "Artifact
    check"); one it cannot read parks the job. None: checked, the handoff goes on."""
    run = ctx.run
    cluster, artifacts = run.cluster, run.spec.artifacts
    transitions.move(
        ctx, JobState.PENDING_HANDOFF, f"Checking {len(artifacts)} artifact(s) in {cluster}'s object store"
    )
    check = ArtifactInput(cluster=cluster, uris=artifacts)
    try:
        report = await effects.handoff_step(ArtifactActivities.check_artifacts, check, effects.ARTIFACT_STEP)
    except ActivityError as exc:
        return await common.refused_or_parked(ctx, exc, f"Cannot check artifacts in {cluster}'s object store")
    if report.missing:
        more = f" (+{len(report.missing) - 1} more)" if len(report.missing) > 1 else ""
        return Parking(report.reasons[0] + more, code=ReasonCode.ArtifactMissing)
    return Phase.CANCEL if run.mailbox.cancel is not None else None
