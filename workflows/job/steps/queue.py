"""QUEUED: the job waits in the federation queue for a placement, then the promotion CAS
(docs/DESIGN.md, "Placement", "Promotion (the CAS)", "Messages taken on trust"). Also how a job
enters the queue (``enqueue``, ``requeue``) and the CAS itself (``promote``), which classification
and a replay in place use too."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.store import EnqueueInput, ExpireInput, PromoteInput, StoreActivities
    from iris import metrics
    from iris.jobs import JobState
    from iris.policy import CANCELLED_BEFORE_HANDOFF, DEADLINE_PASSED, Vetting, vet_placement
    from iris.policy.models import Placement
    from iris.policy.reasons import ReasonCode
    from iris.reports import FederationView
    from iris.store.models import HandleState, PromoteOutcome

import workflows.job.effects as effects
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, Phase, now_ms
from workflows.job.steps import common


async def step(ctx: Ctx) -> Phase:
    """Wait for a placement, then promote by CAS; a CAS that loses to nothing final waits again.
    A placement the tick signalled is vetted first (SIGNALS_PATCH), an operator's replay not.
    Won: the handoff to its cluster and backend."""
    run = ctx.run
    while True:
        placement = await wait_for_placement(ctx)
        if isinstance(placement, Phase):
            return placement
        vouched, run.mailbox.vouched = run.mailbox.vouched, False
        if ctx.features.wary and not vouched:
            vetted = await vet(ctx, placement)
            if vetted is None:
                continue
            placement = vetted
        promoted = await promote(ctx, placement)
        if isinstance(promoted, Phase):
            return promoted
        if promoted is not None:
            waited(ctx)
            return to_handoff(ctx, promoted)


def to_handoff(ctx: Ctx, promoted: Placement) -> Phase:
    """The attempt goes where the won promotion says. A force-routed placement names no backend
    (docs/DESIGN.md, "Pins and force-routing"): the cluster gets the view's best guess."""
    ctx.run.cluster = promoted.peer_id
    ctx.run.backend = promoted.backend_id or common.backend_for(ctx, promoted.peer_id)
    return Phase.HANDOFF


async def wait_for_placement(ctx: Ctx) -> Placement | Phase:
    """The tick's (or an operator's) placement; a cancel or the deadline ends the wait instead.
    With SIGNALS_PATCH an ``expire`` signal before the job's own deadline is ignored."""
    run = ctx.run
    mail = run.mailbox
    deadline_ms = run.spec.shape().deadline_ms
    while True:
        own_timer = False
        while True:
            timeout = None
            if deadline_ms is not None:
                timeout = timedelta(milliseconds=max(1, deadline_ms - now_ms()))
            try:
                await workflow.wait_condition(
                    lambda: not mail.quiet or common.continue_due(ctx), timeout=timeout
                )
            except TimeoutError:
                mail.expire = own_timer = True
            if not mail.quiet:
                break
            await common.continue_if_due(ctx)
        if mail.cancel is not None:
            return Phase.CANCEL
        if mail.expire and ctx.features.wary and not own_timer and not _passed(deadline_ms):
            _ignore_expiry(ctx, deadline_ms)
            if mail.placement is None:
                continue
        if mail.expire:
            await effects.store_step(
                ctx,
                StoreActivities.expire_job,
                ExpireInput(job_id=run.spec.job_id, incarnation=run.incarnation),
            )
            return await common.finish(ctx, JobState.UNSCHEDULABLE, DEADLINE_PASSED)
        placement, mail.placement = mail.placement, None
        assert placement is not None
        return placement


def _passed(deadline_ms: int | None) -> bool:
    return deadline_ms is not None and now_ms() >= deadline_ms


def _ignore_expiry(ctx: Ctx, deadline_ms: int | None) -> None:
    """An expiry before the job's own deadline (SIGNALS_PATCH): recorded, and the job waits on."""
    ctx.run.mailbox.expire = False
    due = "the job has no scheduling deadline"
    if deadline_ms is not None:
        due = f"the job's deadline is {(deadline_ms - now_ms()) / 1000:.0f}s away"
    transitions.event(ctx, ctx.run.status.state, f"ignored expiry: {due}")


async def vet(ctx: Ctx, offer: Placement) -> Placement | None:
    """The placement to promote for the ``place`` signal ``offer``: its cluster and backend
    re-checked against the job's pin and constraints, with the job's own reservation
    (iris/policy/vetting.py), on the view the job was classified with, read again when that
    view cannot vouch for it. None: refused, recorded as an event; the job waits on."""
    run = ctx.run
    assert run.view is not None
    verdict = _vet(ctx, offer, run.view)
    if not verdict.vouched:
        try:
            run.view = await effects.fetch_reports()
        except ActivityError as exc:
            if effects.is_cancellation(exc):
                raise
        else:
            verdict = _vet(ctx, offer, run.view)
    if verdict.placement is None:
        target = f"{offer.peer_id[:80]}/{offer.backend_id[:80] or '-'}"
        transitions.event(ctx, run.status.state, f"ignored placement {target}: {verdict.refusal}")
        return None
    return verdict.placement


def _vet(ctx: Ctx, offer: Placement, view: FederationView) -> Vetting:
    report = view.report(offer.peer_id)
    backends = list(report.backends) if report is not None else []
    if not backends:
        backends = list(view.configured.get(offer.peer_id, ()))
    return vet_placement(ctx.run.spec.shape(), offer, pin=ctx.run.pin, backends=backends)


def waited(ctx: Ctx) -> None:
    """A won promotion: the time since the job entered the queue, to iris_queue_wait_seconds.
    Metrics add no command, and none is recorded while a history replays."""
    run = ctx.run
    if run.queued_since_ms is None:
        return
    waited_s = max(0, now_ms() - run.queued_since_ms) / 1000
    run.queued_since_ms = None
    workflow.metric_meter().create_histogram_float(
        metrics.QUEUE_WAIT, "From entering the federation queue to a won promotion", "s"
    ).record(waited_s, common.metric_labels(ctx))


async def promote(ctx: Ctx, placement: Placement, *, retake: bool = False) -> Placement | Phase | None:
    """The promotion CAS (docs/DESIGN.md, "Promotion (the CAS)"): the placement with its backend
    if it won, None if the job waits for another tick, ENDED if a cancel or expiry won.
    ``retake``: a parked job's replay in place takes its released capacity again (PARK_PATCH);
    refused, the job goes back to the queue to wait for another tick."""
    run = ctx.run
    # The CAS runs only while this workflow's cancellation state is clear; shielded so a
    # Temporal cancel never abandons it half-way (the store then decides who won). A local
    # activity in runs begun with BASELINE_2027_02_PATCH, in the task that took the placement and
    # schedules the launch: an operator's reset of a refused handoff goes back to that task and
    # runs the CAS again, which the store answers ALREADY_PROMOTED for the refused handle's own
    # target. Before it, a regular activity, whose answer the reset kept.
    cas = PromoteInput(
        job_id=run.spec.job_id, incarnation=run.incarnation, placement=placement, retake=retake
    )
    local = ctx.features.promotes_locally
    result = await asyncio.shield(effects.store_step(ctx, StoreActivities.promote_job, cas, local=local))
    target = f"{placement.peer_id}/{placement.backend_id or '-'}"
    if result.promoted:
        backend = (result.handle.assigned_backend if result.handle else None) or placement.backend_id
        # A backfilled placement (docs/DESIGN.md, "Backfill") says so by its code.
        code = ReasonCode.Backfilled if placement.ahead_of else None
        transitions.event(
            ctx, run.status.state, f"promoted to {target}: {placement.reason or 'placed'}", code
        )
        run.promoted = placement.model_copy(update={"backend_id": backend})
        return run.promoted
    handle = result.handle
    if result.outcome is PromoteOutcome.CANCELLED or (handle is not None and handle.cancel_requested):
        return await common.finish(ctx, JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    if result.outcome is PromoteOutcome.EXPIRED or (
        handle is not None and handle.state is HandleState.UNSCHEDULABLE
    ):
        return await common.finish(ctx, JobState.UNSCHEDULABLE, DEADLINE_PASSED)
    transitions.event(ctx, run.status.state, f"promotion to {target} refused: {result.message}")
    if retake:
        # Still parked in the store: back to the queue, where the tick finds it room.
        await requeue(ctx)
    # Capacity another promotion took first: the job waits for room, as the tick would say.
    code = ReasonCode.NoCapacity if result.outcome is PromoteOutcome.NO_CAPACITY else ReasonCode.Pending
    reason = f"Waiting for the next tick: {result.message}"
    transitions.move(ctx, JobState.QUEUED_HANDOFF, reason, code=code, record=False)
    return None


async def enqueue(ctx: Ctx) -> None:
    """Into the federation queue: the job's handle, with its resolved pin."""
    run = ctx.run
    # Set first: if a Temporal cancel interrupts this await after the insert committed, the
    # cancel path must still record the handle's end, or the queue keeps a zombie.
    run.queued = True
    run.queued_since_ms = now_ms()
    # Shielded: a Temporal cancel must not abandon the insert half-way; the cancel path waits
    # for it and then records the cancel against the handle it wrote.
    shape = run.spec.shape().model_copy(update={"target_cluster": run.pin})
    ctx.enqueue_op = effects.store_step(
        ctx, StoreActivities.enqueue_job, EnqueueInput(shape=shape, incarnation=run.incarnation)
    )
    await asyncio.shield(ctx.enqueue_op)


async def requeue(ctx: Ctx) -> None:
    """Back into the federation queue: a queued job's handle is requeued, another is enqueued."""
    run = ctx.run
    if run.queued:
        await effects.store_step(
            ctx, StoreActivities.requeue_job, ExpireInput(job_id=run.spec.job_id, incarnation=run.incarnation)
        )
        run.queued_since_ms = now_ms()
    else:
        await enqueue(ctx)


def explained(ctx: Ctx) -> None:
    """A reason the tick gave before the job was shown queued: shown now, with its code."""
    mail = ctx.run.mailbox
    if mail.explanation is not None:
        transitions.move(
            ctx, JobState.QUEUED_HANDOFF, mail.explanation, code=mail.explanation_code, record=False
        )
