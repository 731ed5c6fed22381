"""What the job's message handlers do (workflows/job/workflow.py declares them): each writes the
run's mailbox (workflows/job/state.py) for the steps to act on, after the checks a message gets
before it is taken (docs/DESIGN.md, "Messages taken on trust"). Two also show something at once,
through transitions: a queued job's new reason (the tick's explanation), and a message refused
(an event)."""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.watch import Observation
    from iris.jobs import CancelOutcome, CancelRequest, JobState, ReplayRequest
    from iris.policy.models import Hold, Placement
    from iris.policy.reasons import ReasonCode
    from iris.userauth import Action

import workflows.job.effects as effects
import workflows.job.transitions as transitions
import workflows.versions as versions
from workflows.job.state import Ctx, JobRun, now_ms


def place(ctx: Ctx, placement: Placement) -> None:
    """The tick's placement, kept while the job waits in the queue. An operator's replay target,
    already set, is not overridden by the tick."""
    run = ctx.run
    if run.waiting_in_queue and run.mailbox.placement is None:
        run.mailbox.placement = placement


def explained(ctx: Ctx, reason: str, code: ReasonCode | None, hold: Hold | None = None) -> None:
    """Why the job is still queued: kept, and shown at once if the job is shown queued (a
    ``code`` None, from a tick that predates reason codes, leaves the code as it was). The
    devices held for it (backfill) are kept for ``describe``: no command, only the query's
    answer changes."""
    run = ctx.run
    mail = run.mailbox
    mail.explanation = reason
    run.status.hold = hold
    if code is not None:
        mail.explanation_code = code
    if run.status.state is JobState.QUEUED_HANDOFF:
        transitions.move(ctx, JobState.QUEUED_HANDOFF, reason, code=mail.explanation_code, record=False)


def expire(ctx: Ctx) -> None:
    """The scheduling deadline passed, says the tick. Whoever sent it, it ends only a queued job
    whose own deadline has passed (SIGNALS_PATCH, steps/queue.py)."""
    run = ctx.run
    if ctx.features.wary and not run.waiting_in_queue:
        # Kept pending, it would also keep the run from continuing as new.
        state = run.status.state
        transitions.event(ctx, state, f"ignored expiry: the job is {state.value}, not queued")
        return
    run.mailbox.expire = True


def observe(ctx: Ctx, seen: Observation) -> None:
    """The watcher's news of the attempt being followed: kept if it is about that attempt's
    cluster and nonce and newer than any status seen; the follower takes it only for its own
    attempt's nonce (steps/attempt.py, ``for_attempt``)."""
    run = ctx.run
    mail = run.mailbox
    if seen.cluster != run.status.cluster:
        return
    status = seen.status
    if status is not None:
        if status.nonce != run.nonce:
            return
        last = mail.seen_version
        if last is not None and status.epoch == last[0] and status.version <= last[1]:
            return
        mail.seen_version = (status.epoch, status.version)
    mail.observed = seen


def want_logs(ctx: Ctx, until_ms: int) -> None:
    """A reader of the job's log wants it relayed every second until ``until_ms``, at most 10
    minutes ahead (docs/DESIGN.md, "Logs")."""
    mail = ctx.run.mailbox
    mail.logs_until_ms = max(mail.logs_until_ms, min(int(until_ms), now_ms() + 600_000))


def request_cancel(ctx: Ctx, request: CancelRequest) -> None:
    """A cancel, kept for the step that sees it (the first one only; none once the job ended)."""
    run = ctx.run
    if run.mailbox.cancel is None and not run.status.terminal:
        run.mailbox.cancel = request
        run.status.cancel_requested = True
        transitions.event(ctx, run.status.state, f"cancel requested: {request.reason}")


async def refused(ctx: Ctx, action: Action, statement: str, request: BaseModel) -> str | None:
    """Why a signed request is refused (recorded as an event), or None if it verifies or this
    run predates AUTH_PATCH. The check is an activity (activities/auth.py), never workflow code.
    While it runs, a handoff waits for its verdict (``Ctx.verifying``)."""
    if not versions.authenticates():
        return None
    ctx.verifying += 1
    try:
        await effects.verify(ctx, action, statement, request, now_ms())
    except ApplicationError as exc:
        refusal = f"{action.label} refused: {exc.message}"
        transitions.event(ctx, ctx.run.status.state, refusal)
        return refusal
    finally:
        ctx.verifying -= 1
    return None


async def cancel_outcome(run: JobRun) -> CancelOutcome:
    """Once the cancel is carried out or the job delivered: whether the cancel won (the job was
    never delivered to a cluster)."""
    await workflow.wait_condition(lambda: run.delivered or run.status.terminal)
    st = run.status
    if not run.delivered and run.attempt > 1:
        # Queued again after an attempt ended (REQUEUE_PATCH): no later attempt is ever delivered.
        message = f"cancelled before attempt {run.attempt}'s handoff; no attempt runs"
        return CancelOutcome(won=True, state=st.state, message=message)
    if not run.delivered:
        return CancelOutcome(won=True, state=st.state, message="cancelled before handoff; never delivered")
    return CancelOutcome(
        won=False,
        state=st.state,
        message=f"job was already handed to {st.cluster}; termination requested there",
    )


def check_replay(ctx: Ctx, request: ReplayRequest) -> None:
    """ValueError unless ``request`` is a replay the parked job can carry out."""
    run = ctx.run
    st = run.status
    if st.state is not JobState.HANDOFF_FAILED or run.mailbox.replay is not None:
        parked = JobState.HANDOFF_FAILED.value
        raise ValueError(
            f"job {st.job_id} is {st.state.value}: replay-handoff applies to jobs parked in {parked}"
        )
    if request.requeue and request.peer:
        raise ValueError("choose --peer or --requeue, not both")
    maybe_on = run.maybe_on
    elsewhere = request.requeue or request.peer not in (None, maybe_on and maybe_on[0])
    if maybe_on is not None and elsewhere and not request.force:
        raise ValueError(
            f"job {st.job_id} may be running on {maybe_on[0]}: its last launch went unanswered "
            "and that cluster has not said since; another cluster could run it twice. Wait until it "
            "answers (replay to it is safe), or replay with --force"
        )
    if request.peer is not None:
        if request.peer not in run.clusters:
            raise ValueError(f"unknown cluster {request.peer!r} (known: {', '.join(run.clusters)})")
        if run.pin is not None and request.peer != run.pin:
            raise ValueError(
                f"job {st.job_id} is pinned to {run.pin}; it cannot be replayed to {request.peer}"
            )
