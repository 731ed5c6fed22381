"""What several steps share: ending the job, continuing as new at a quiet point, waiting for the
verdicts on signed requests, relaying an ended attempt's output, naming a backend, and a handoff
step that failed for good."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from iris import contract
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import JobState, handle_end
    from iris.policy import pick_backend
    from iris.policy.reasons import ReasonCode

import workflows.job.effects as effects
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, Parking, Phase, handover

# Runs with CONTINUE_PATCH continue as new past this many history events (or when the server
# suggests it), at a quiet point of a long wait.
CONTINUE_AFTER_EVENTS = 2_000


async def record_end(ctx: Ctx, reason: str | None) -> None:
    """A queued job's handle ends as the job did."""
    end = handle_end(ctx.run.status.state)
    if ctx.run.queued and end is not None:
        await effects.set_handle_state(ctx, end, reason)


async def end(ctx: Ctx, state: JobState, reason: str, code: ReasonCode | None = None) -> None:
    """Show the job's end and record it on its handle (``finish`` without the phase)."""
    transitions.move(ctx, state, reason, code=code)
    await record_end(ctx, reason)


async def finish(ctx: Ctx, state: JobState, reason: str, code: ReasonCode | None = None) -> Phase:
    """The job ends here: ``run`` returns its status."""
    await end(ctx, state, reason, code)
    return Phase.ENDED


async def verdicts(ctx: Ctx) -> None:
    """Wait for the requests being verified (none in a run that predates AUTH_PATCH): a cancel that
    arrived before the handoff is honoured as if recorded at once."""
    if ctx.verifying:
        await workflow.wait_condition(lambda: ctx.verifying == 0)


def cancel_unsent(ctx: Ctx, terminated: bool) -> bool:
    """A cancel the attempt's cluster has not been told of yet."""
    return ctx.run.mailbox.cancel is not None and not terminated


def continue_due(ctx: Ctx) -> bool:
    """Whether this run's history is long enough to continue as new (at a quiet point)."""
    if not ctx.features.can_continue:
        return False
    info = workflow.info()
    long = info.get_current_history_length() >= CONTINUE_AFTER_EVENTS
    return long or info.is_continue_as_new_suggested()


async def continue_if_due(ctx: Ctx) -> None:
    """At a quiet point of a long wait (queued, following an attempt, parked): continue as new
    with the whole JobRun if due and nothing is pending (docs/DESIGN.md, "Bounded histories");
    returns, doing nothing, otherwise."""
    if not continue_due(ctx):
        return
    await workflow.wait_condition(workflow.all_handlers_finished)
    if not ctx.run.mailbox.quiet:
        return
    run = ctx.run
    assert run.view is not None
    workflow.continue_as_new(args=[run.spec, handover(run)])


async def relay_end(ctx: Ctx, cluster: str, ended: ControllerJobStatus) -> ControllerJobStatus:
    """An attempt ``cluster`` reported ended, with its output relayed home. If the cluster
    then stays silent for peer_lost_after, its end stands and the output stays there."""
    try:
        return await effects.read_remote(ctx, cluster)
    except ActivityError as exc:
        if effects.is_cancellation(exc) or not ctx.features.numbered:
            raise
        run = ctx.run
        transitions.event(
            ctx,
            run.status.state,
            f"{cluster} reported attempt {run.attempt} {ended.state.value} but has not "
            f"answered since ({exc.cause or exc}); its output was not relayed home",
        )
        return ended


def backend_for(ctx: Ctx, cluster: str) -> str:
    """The backend to name when nothing chose one: the best of the cluster's reported backends,
    else of its configured ones (a cluster unreachable when the view was read reports none)."""
    view = ctx.run.view
    assert view is not None
    report = view.report(cluster)
    if report is not None and not report.backends and view.configured.get(cluster):
        report = report.model_copy(update={"backends": view.configured[cluster]})
    chosen = pick_backend(ctx.run.spec.shape(), report) if report is not None else None
    if chosen is None and report is not None and report.backends:
        chosen = report.backends[0].backend_id
    return chosen or ""


def metric_labels(ctx: Ctx) -> dict[str, str]:
    spec = ctx.run.spec
    return {"band": spec.band.label, "device": spec.metric_device}


async def refused_or_parked(ctx: Ctx, exc: ActivityError, parked: str) -> Parking | Phase:
    """A handoff step failed for good: the cluster's refusal ends the job (HANDOFF_REJECTED); a
    missing bundle or an outage past the retries parks it for an operator (``parked``: why). A
    Temporal cancel is raised on, to ``run``."""
    if effects.is_cancellation(exc):
        raise exc
    cause = exc.cause
    if isinstance(cause, ApplicationError) and cause.type == contract.HANDOFF_REJECTED:
        return await finish(ctx, JobState.HANDOFF_REJECTED, cause.message)
    if isinstance(cause, ApplicationError) and cause.type == contract.BUNDLE_UNAVAILABLE:
        return Parking(cause.message)
    return Parking(f"{parked}: {cause or exc}")
