"""CLASSIFYING: the start's input admitted (SUBMISSION_PATCH), the submitter's signature verified
(AUTH_PATCH), then home now, the queue, or rejected (docs/DESIGN.md, "Classification", "User →
home")."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from iris import contract, metrics
    from iris.jobs import JobState, user_prefix
    from iris.policy import QUEUED_REASON, classify, queued_for_peer_reason
    from iris.policy.models import Classification, Disposition, Placement
    from iris.policy.reasons import ReasonCode
    from iris.userauth import Action

import workflows.job.effects as effects
import workflows.job.transitions as transitions
import workflows.versions as versions
from workflows.job.state import Ctx, Phase, now_ms
from workflows.job.steps import common, queue

_REFUSED = "submission refused"


async def step(ctx: Ctx) -> Phase:
    run = ctx.run
    if ctx.features.checked and (refused := await admit(ctx)) is not None:
        return refused
    if ctx.features.authenticating and (refused := await authenticate(ctx)) is not None:
        return refused
    decision = await classified(ctx)
    # The resolved pin (exact cluster id, whatever case the user typed), the home cluster
    # included: an operator's replay must keep to it too.
    run.pin = decision.pinned_cluster
    if decision.disposition is Disposition.REJECT:
        return await common.finish(ctx, JobState.REJECTED, decision.reason, decision.code)
    if run.mailbox.cancel is not None:
        return Phase.CANCEL
    if decision.disposition is Disposition.LOCAL:
        if decision.placement is not None and versions.home_ledger():
            return await reserve_home(ctx, decision.placement)
        assert run.view is not None
        run.cluster, run.backend = run.view.home, common.backend_for(ctx, run.view.home)
        return Phase.HANDOFF
    await queue.enqueue(ctx)
    transitions.move(
        ctx, JobState.QUEUED_HANDOFF, queued_for_peer_reason(run.pin) if run.pin else QUEUED_REASON
    )
    queue.explained(ctx)
    return Phase.QUEUED


async def admit(ctx: Ctx) -> Phase | None:
    """SUBMISSION_PATCH: a start whose input is not one JobSpec the SDK would submit, or that
    runs under another workflow id than its job id, ends REJECTED here, in its first task,
    before anything is verified, enqueued, reserved or launched (docs/DESIGN.md, "User →
    home")."""
    spec = ctx.run.spec
    why = ctx.refused_input
    if why is None and ctx.forged_carry:
        why = (
            "a new job's start holds one input, its signed spec (a carry comes only from the run "
            "it continues)"
        )
    if why is not None:
        return await common.finish(ctx, JobState.REJECTED, f"{_REFUSED}: {why}", ReasonCode.InvalidSubmission)
    try:
        spec.check()
    except ValueError as exc:
        reason = f"{_REFUSED}: invalid job spec: {exc}"
        return await common.finish(ctx, JobState.REJECTED, reason, ReasonCode.InvalidSubmission)
    workflow_id = workflow.info().workflow_id
    if workflow_id != contract.job_workflow_id(spec.job_id):
        # A captured signed spec started under another id: the tick and the watchers signal it
        # by its job id, so it would wait for ever; its statement binds that job id only.
        reason = (
            f"{_REFUSED}: the signed spec is job {spec.job_id[:80]!r}, started as "
            f"workflow {workflow_id[:80]!r}"
        )
        return await common.finish(ctx, JobState.REJECTED, reason, ReasonCode.SubmissionRefused)
    return None


async def authenticate(ctx: Ctx) -> Phase | None:
    """No unverified job reaches classification: a submission whose statement does not verify
    (or whose principal may not submit it) ends REJECTED, having started nothing."""
    run = ctx.run
    started = workflow.info().workflow_start_time
    # Expiry is judged when Temporal accepted the start, not when a worker got to it.
    received_ms = int(started.timestamp() * 1000)
    try:
        if ctx.features.admits:
            # One activity checks the signature and reads the reports classification needs.
            principal, ctx.admitted_view = await effects.admit(ctx, received_ms)
        else:
            principal = await effects.verify(ctx, Action.SUBMIT, run.spec.signature, run.spec, received_ms)
    except ApplicationError as exc:
        reason = f"{_REFUSED}: {exc.message}"
        return await common.finish(ctx, JobState.REJECTED, reason, ReasonCode.SubmissionRefused)
    prefix = user_prefix(principal.name)
    if ctx.features.checked and not run.spec.job_id.startswith(f"{prefix}/"):
        # Another user's name: the job would run, and hold the name, as theirs.
        reason = (
            f"{_REFUSED}: job id {run.spec.job_id[:80]!r} is not under {prefix}/, the "
            f"job ids of its signer {principal.name[:64]}"
        )
        return await common.finish(ctx, JobState.REJECTED, reason, ReasonCode.SubmissionRefused)
    run.principal = principal.name
    transitions.event(ctx, JobState.CLASSIFYING, f"submitted by {principal.name} (signature verified)")
    return None


async def classified(ctx: Ctx) -> Classification:
    """CLASSIFYING: home now, the queue, or rejected (docs/DESIGN.md, "Classification")."""
    run = ctx.run
    workflow.metric_meter().create_counter(
        metrics.JOBS_SUBMITTED, "Jobs whose workflow began classifying them"
    ).add(1, common.metric_labels(ctx))
    view, ctx.admitted_view = ctx.admitted_view, None
    if view is None:
        view = await effects.fetch_reports()
    decision = classify(
        run.spec.shape(),
        home=view.home,
        reports=view.reports,
        # Judged when the reports were read: a workflow task delayed by a worker crash must
        # not turn fresh reports stale and reject a job the federation can run.
        now_ms=view.fetched_ms if view.fetched_ms is not None else now_ms(),
        stale_after_ms=view.stale_after_ms,
        configured=view.configured,
        reservations=view.reservations,
        reject_too_large=ctx.features.sizing,
        # A view recorded before caps existed has none: the decision replays unchanged.
        held=view.held,
        quotas=view.quotas,
    )
    run.clusters = tuple(r.peer_id for r in view.reports)
    run.view = view
    run.lost_after_s = view.peer_lost_after_s
    run.status.disposition = decision.disposition.value
    run.status.classification_reason = decision.reason
    transitions.event(
        ctx, JobState.CLASSIFYING, f"classified {decision.disposition.value}: {decision.reason}"
    )
    return decision


async def reserve_home(ctx: Ctx, placement: Placement) -> Phase:
    """A LOCAL job takes home's capacity through the queue's CAS and ledger, as a promotion by
    the tick does (docs/DESIGN.md, "The ledger"): a burst of submits never runs more at home
    than home has room for. One the CAS refuses (home filled up since the reports were read)
    waits in the queue, home still a candidate."""
    run = ctx.run
    await queue.enqueue(ctx)
    promoted = await queue.promote(ctx, placement)
    if isinstance(promoted, Phase):
        return promoted
    if promoted is not None:
        run.mailbox.placement = None  # a tick's offer that raced the promotion is moot
        run.queued_since_ms = None  # run at home at once: it never waited in the queue
        return queue.to_handoff(ctx, promoted)
    run.status.disposition = Disposition.QUEUE.value
    transitions.move(
        ctx,
        JobState.QUEUED_HANDOFF,
        f"{QUEUED_REASON} (home filled up since the reports were read)",
        code=ReasonCode.NoCapacity,
    )
    queue.explained(ctx)
    return Phase.QUEUED
