"""Following one attempt on its cluster until it ends (docs/DESIGN.md, "Mirroring", "The change
feed", "Attempts"): by its cluster's watcher's signals (FEED_PATCH), asking the cluster itself
(follow_job) at the safety poll, after a silence notice and while a reader wants the log; a
cancel terminates it there; a cluster silent past peer_lost_after loses it. An observation is
taken only for the attempt whose nonce it carries, and an end only once its cluster confirms it
(SIGNALS_PATCH)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.peers import FollowResult
    from activities.watch import Observation
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import AttemptEnd
    from iris.policy.reasons import ReasonCode

import workflows.job.effects as effects
import workflows.job.ends as ends
import workflows.job.transitions as transitions
from workflows.job.state import Ctx, now_ms
from workflows.job.steps import common

if TYPE_CHECKING:
    # How the attempt ended, why, and its cluster's last word on it (None if the cluster lost it).
    Outcome = tuple[AttemptEnd, str, ControllerJobStatus | None]


class _Go(Enum):
    """What the follower does after one turn: go round again, stop (the attempt's status says it
    ended), or, from the watcher's news, go on to ask the cluster."""

    AGAIN = "again"
    STOP = "stop"
    ASK = "ask"


async def follow(ctx: Ctx) -> Outcome:
    """Follow the attempt on ``run.cluster`` from ``run.remote`` until it ends; its end is left for
    the caller to show."""
    run = ctx.run
    assert run.remote is not None and run.view is not None
    follower = _Follower(
        ctx,
        run.cluster,
        run.nonce,
        report_s=min(30.0, run.lost_after_s / 4),
        feed=ctx.features.feed and run.view.mirror_safety_poll_s > 0,
    )
    if not run.remote.terminal:
        transitions.mirror(ctx, run.remote)
    while not run.remote.terminal:
        turn = await follower.turn()
        if isinstance(turn, tuple):
            return turn
        if turn is _Go.STOP:
            break
    remote = run.remote
    cancel = run.mailbox.cancel
    reason = ends.ended_reason(run.spec, remote, run.cluster, cancel.reason if cancel is not None else None)
    return ends.end_of(remote), reason, remote


@dataclasses.dataclass
class _Follower:
    ctx: Ctx
    cluster: str
    nonce: str
    report_s: float
    feed: bool
    terminated: bool = False
    # When the cluster was first found silent (workflow time, ms), while it is.
    silent_since: int | None = None
    # Ask the cluster at once rather than wait for the watcher (an end it could not confirm).
    ask_now: bool = False

    def unsent(self) -> bool:
        return common.cancel_unsent(self.ctx, self.terminated)

    async def turn(self) -> _Go | Outcome:
        ctx, run = self.ctx, self.ctx.run
        if self.unsent():
            self.terminated = True
            if not await effects.terminate(ctx, self.cluster, self.nonce):
                await effects.fence(ctx, self.cluster, self.nonce)
                return (
                    AttemptEnd.KILLED,
                    f"Cancelled; {self.cluster} is silent: the job is fenced there",
                    None,
                )
            return _Go.AGAIN
        max_wait_s = effects.FOLLOW_MAX_WAIT.total_seconds()
        if self.feed and not self.terminated:
            if self.silent_since is None and not self.ask_now:
                news = await self.news()
                if news is not _Go.ASK:
                    return news
            self.ask_now = False
            # A silence notice, the safety poll, or a reader of the log: ask the cluster, at
            # once (one answer), or relaying the log every second while a reader wants it.
            max_wait_s = max(0.0, min(max_wait_s, (run.mailbox.logs_until_ms - now_ms()) / 1000))
        return await self.ask(max_wait_s)

    async def news(self) -> _Go:
        """The watcher's next observation of the attempt (FEED_PATCH), applied."""
        ctx, run = self.ctx, self.ctx.run
        wary = ctx.features.wary
        seen = await await_news(ctx)
        if self.unsent():
            return _Go.AGAIN
        if seen is not None and wary:
            seen = for_attempt(ctx, seen, self.cluster, self.nonce)
        status = seen.status if seen is not None else None
        if status is not None and status.terminal and wary:
            # An end is believed only as its cluster reports it (SIGNALS_PATCH).
            return await self.confirm(status)
        if status is not None:
            run.remote = status
            if status.terminal:
                # Its output is relayed home before the end is shown.
                run.remote = await common.relay_end(ctx, self.cluster, status)
                return _Go.STOP
            transitions.mirror(ctx, status)
            await common.continue_if_due(ctx)
            return _Go.AGAIN
        if seen is not None and seen.silent_since_ms is not None and not wary:
            # Its silence counts from when the watcher first saw it, not from now.
            # (SIGNALS_PATCH: from what follow_job measures; a notice is not proof.)
            self.silent_since = min(seen.silent_since_ms, now_ms())
        return _Go.ASK

    async def confirm(self, claimed: ControllerJobStatus) -> _Go:
        confirmed = await confirmed_end(self.ctx, self.cluster, self.nonce, claimed)
        if confirmed is None:
            self.ask_now = True  # follow_job, by the nonce, says what became of it
            return _Go.AGAIN
        self.ctx.run.remote = confirmed
        if confirmed.terminal:
            return _Go.STOP
        transitions.mirror(self.ctx, confirmed)
        return _Go.AGAIN

    async def ask(self, max_wait_s: float) -> _Go | Outcome:
        """follow_job: the attempt's next change, or its cluster's silence."""
        ctx, run = self.ctx, self.ctx.run
        assert run.remote is not None
        # Silent already: report again when peer_lost_after is reached, not later.
        report_s = self.report_after()
        handle = effects.start_follow(ctx, self.cluster, run.remote, report_s, max_wait_s)
        if not await effects.done_before_cancel(
            handle, functools.partial(common.cancel_unsent, ctx, self.terminated)
        ):
            return _Go.AGAIN
        followed = await handle
        if followed.gone:
            if self.terminated:
                return AttemptEnd.KILLED, f"Killed; {self.cluster} no longer knows the job", None
            return AttemptEnd.PREEMPTED, followed.error or f"{self.cluster} lost the job", None
        if followed.status is None:
            return await self.silent(followed)
        self.silent_since = None
        run.remote = followed.status
        if ctx.features.wary:
            seen_status(ctx, run.remote)
        if run.remote.terminal:
            return _Go.STOP
        transitions.mirror(ctx, run.remote)
        if not self.terminated:
            await common.continue_if_due(ctx)
        return _Go.AGAIN

    async def silent(self, followed: FollowResult) -> _Go | Outcome:
        """Its cluster has not answered: shown so; past peer_lost_after the attempt is lost (and
        fenced there); else the cluster is asked again after a pause."""
        ctx, run = self.ctx, self.ctx.run
        now = now_ms()
        self.silent_since = self.silent_since or now - int(followed.unreachable_s * 1000)
        silent_s = (now - self.silent_since) / 1000
        reason = f"{self.cluster} has not answered for {silent_s:.0f}s: {followed.error}"
        transitions.move(ctx, run.status.state, reason, code=ReasonCode.PeerUnreachable)
        if silent_s >= run.lost_after_s:
            await effects.fence(ctx, self.cluster, self.nonce)
            return AttemptEnd.PREEMPTED, f"{self.cluster} did not answer for {silent_s:.0f}s", None
        # Asked again after a pause: a cluster that refuses at once costs a timer, not a loop.
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                functools.partial(common.cancel_unsent, ctx, self.terminated),
                timeout=timedelta(seconds=min(self.report_s, run.lost_after_s - silent_s)),
            )
        return _Go.AGAIN

    def report_after(self) -> float:
        if self.silent_since is None:
            return self.report_s
        left = self.ctx.run.lost_after_s - (now_ms() - self.silent_since) / 1000
        return max(0.0, min(self.report_s, left))


async def await_news(ctx: Ctx) -> Observation | None:
    """Wait for the watcher's next observation of the attempt (FEED_PATCH), a cancel, or a
    reader of the log; None when the safety poll is due (every mirror_safety_poll_s, ±20% so
    the jobs of a burst do not ask at once) or the wait ended for a cancel or a reader."""
    run = ctx.run
    assert run.view is not None
    mail = run.mailbox
    due_s = run.view.mirror_safety_poll_s * (0.8 + 0.4 * workflow.random().random())

    def news() -> bool:
        return mail.observed is not None or common.cancel_unsent(ctx, False) or mail.logs_until_ms > now_ms()

    with contextlib.suppress(TimeoutError):
        await workflow.wait_condition(news, timeout=timedelta(seconds=due_s))
    seen, mail.observed = mail.observed, None
    return seen


def for_attempt(ctx: Ctx, seen: Observation, cluster: str, nonce: str) -> Observation | None:
    """``seen`` if it is about the attempt being followed, by its cluster and nonce
    (SIGNALS_PATCH); one kept from an earlier attempt (it arrived before that attempt's end was
    acted on) or about another cluster is recorded and dropped: it never moves this attempt."""
    run = ctx.run
    status = seen.status
    if seen.cluster != cluster or (status is not None and status.nonce != nonce):
        about = f"{status.nonce[:120]!r} ({status.state.value})" if status is not None else "its silence"
        transitions.event(
            ctx,
            run.status.state,
            f"ignored an observation of {seen.cluster[:80]} about {about}: attempt {run.attempt} "
            f"is {nonce!r} on {cluster}",
        )
        return None
    return seen


async def confirmed_end(
    ctx: Ctx, cluster: str, nonce: str, claimed: ControllerJobStatus
) -> ControllerJobStatus | None:
    """An observation says the attempt ended: read the job from its cluster (its output relayed
    home if it did). The cluster's status of this attempt, terminal or not, with the claim
    recorded and ignored if the cluster says otherwise; None if the cluster does not say (it
    is silent, has forgotten the job or runs another attempt of it)."""
    run = ctx.run
    said = f"an observation says attempt {run.attempt} on {cluster} is {claimed.state.value}"
    try:
        actual = await effects.confirm_end(ctx, cluster)
    except ActivityError as exc:
        if effects.is_cancellation(exc):
            raise
        why = f"ignored: {said}, and {cluster} does not confirm it ({exc.cause or exc})"
        transitions.event(ctx, run.status.state, why)
        return None
    seen_status(ctx, actual)
    if actual.nonce != nonce:
        transitions.event(
            ctx, run.status.state, f"ignored: {said}, and {cluster} runs another attempt of the job"
        )
        return None
    if not actual.terminal or actual.state is not claimed.state:
        transitions.event(ctx, run.status.state, f"ignored: {said}; {cluster} reports {actual.state.value}")
    return actual


def seen_status(ctx: Ctx, status: ControllerJobStatus) -> None:
    """The cluster's own word on the attempt: its feed version, not an observation's claim, is
    the newest seen (a forged version cannot keep the watcher's next ones out)."""
    if status.epoch:
        ctx.run.mailbox.seen_version = (status.epoch, status.version)
