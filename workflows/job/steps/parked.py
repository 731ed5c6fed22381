"""HANDOFF_FAILED: a parked job waits for an operator's replay or a cancel, never dropped silently
(docs/DESIGN.md, "Errors, retries and parking", "Replaying a failed handoff"). While its last
launch's outcome is unknown, its cluster is asked again and again: the cluster, not a guess, says
whether the job started there (then it is followed there)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.peers import AttemptFound
    from iris.jobs import JobState, ReplayRequest
    from iris.policy import QUEUED_REASON
    from iris.policy.models import Placement
    from iris.store.models import HandleState

import workflows.job.effects as effects
import workflows.job.transitions as transitions
from workflows.job.state import Adopted, Ctx, Parking, Phase
from workflows.job.steps import common, queue


async def enter(ctx: Ctx, parking: Parking) -> Phase:
    """Park: HANDOFF_FAILED, and the queue handle too; its reservation freed if the job is known
    not to run on its cluster (PARK_PATCH)."""
    run = ctx.run
    transitions.move(ctx, JobState.HANDOFF_FAILED, parking.reason, code=parking.code)
    if run.queued:
        release = frees_capacity(ctx)
        await effects.set_handle_state(ctx, HandleState.HANDOFF_FAILED, parking.reason, release=release)
        run.released = release
    return Phase.PARKED


async def step(ctx: Ctx) -> Phase:
    run = ctx.run
    mail = run.mailbox
    probe_in, probe_max = effects.probe_schedule(ctx)
    while True:
        try:
            await workflow.wait_condition(
                lambda: mail.cancel is not None or mail.replay is not None,
                timeout=probe_in if run.maybe_on is not None else None,
            )
        except TimeoutError:
            adopted = await probe(ctx)
            if adopted is not None:
                return await adopt(ctx, adopted)
            probe_in = min(probe_in * 2, probe_max)
            await common.continue_if_due(ctx)
            continue
        break
    if mail.cancel is not None:
        return Phase.CANCEL
    replay, mail.replay = mail.replay, None
    assert replay is not None
    return await replayed(ctx, replay)


async def probe(ctx: Ctx) -> Adopted | None:
    """Ask the cluster whose launch went unanswered whether it has the attempt."""
    run = ctx.run
    assert run.maybe_on is not None
    cluster, nonce = run.maybe_on
    found = await effects.find_attempt(ctx, cluster, nonce)
    if found.found is AttemptFound.HERE and found.status is not None:
        run.maybe_on = None
        transitions.event(
            ctx, JobState.HANDOFF_FAILED, f"{cluster} answers: it has the job; following it there"
        )
        return Adopted(cluster, found.status)
    if found.found is AttemptFound.ABSENT:
        run.maybe_on = None
        reason = f"Handoff to {cluster} failed after retries; {cluster} confirms it never received the job"
        transitions.move(ctx, JobState.HANDOFF_FAILED, reason)
        if run.queued and not run.released and frees_capacity(ctx):
            # Known not to run there now: its capacity is freed (PARK_PATCH).
            await effects.set_handle_state(ctx, HandleState.HANDOFF_FAILED, reason, release=True)
            run.released = True
    return None


async def adopt(ctx: Ctx, adopted: Adopted) -> Phase:
    """Its cluster has the attempt: followed there; one that ended before the answer came has its
    output relayed home first."""
    run = ctx.run
    run.cluster, run.remote = adopted.cluster, adopted.remote
    if adopted.remote.terminal:
        run.remote = await common.relay_end(ctx, adopted.cluster, adopted.remote)
    return Phase.FOLLOWING


def frees_capacity(ctx: Ctx) -> bool:
    """Whether a park releases the job's reservation now (PARK_PATCH): only when the job is
    known not to run on its cluster (no launch of the attempt whose outcome is unknown), and
    its won promotion is known, to be taken again by a replay in place."""
    run = ctx.run
    return ctx.features.frees and ctx.features.numbered and run.maybe_on is None and run.promoted is not None


async def replayed(ctx: Ctx, replay: ReplayRequest) -> Phase:
    """Where an operator's replay goes: the same cluster, another one, or back through the queue."""
    run = ctx.run
    cluster = run.cluster
    transitions.event(ctx, JobState.HANDOFF_FAILED, f"operator replay: {replay.describe()}")
    if not replay.requeue and (replay.peer is None or replay.peer == cluster):
        return await retake(ctx) if run.released else Phase.HANDOFF
    if run.maybe_on is not None:
        # Forced past an unknown outcome (the validator refuses it otherwise): whatever that
        # cluster may run of this attempt is terminated there as soon as it answers.
        transitions.event(ctx, JobState.HANDOFF_FAILED, f"forced: the attempt {cluster} may run is fenced")
        await effects.fence(ctx, *run.maybe_on)
        run.maybe_on = None
    await queue.requeue(ctx)
    if replay.requeue:
        transitions.move(ctx, JobState.QUEUED_HANDOFF, QUEUED_REASON)
        return Phase.QUEUED
    assert replay.peer is not None
    transitions.move(ctx, JobState.QUEUED_HANDOFF, f"Operator replay to {replay.peer}")
    run.mailbox.placement = Placement(
        job_id=run.spec.job_id, peer_id=replay.peer, backend_id="", forced=True, reason="operator replay"
    )
    run.mailbox.vouched = True
    return Phase.QUEUED


async def retake(ctx: Ctx) -> Phase:
    """A replay in place of a job whose park released its capacity (PARK_PATCH): the same
    promotion again, through the CAS, so the backend is never over-committed. Refused (another
    job took the capacity meanwhile), the job waits in the queue for the tick."""
    run = ctx.run
    assert run.promoted is not None
    run.released = False
    again = run.promoted.model_copy(update={"reason": "operator replay in place: capacity taken again"})
    promoted = await queue.promote(ctx, again, retake=True)
    if isinstance(promoted, Phase):
        return promoted
    return Phase.HANDOFF if promoted is not None else Phase.QUEUED
