"""Where a job may go, and the one writer of what users see of it (docs/DESIGN.md, "Job states").

``NEXT`` is the phase machine: the phases a step may hand the job to. ``SHOWS`` is the JobState
each phase shows. ``move`` is the only writer of the job's state and reason, its events (``event``
adds one without a move), its memo and its search attributes; it also keeps the run's view of the
visibility store, so an unchanged value is not written again. A move to a state that neither the
phase the job is in nor a phase it may go to next shows is reported (``illegal``): production only
logs it (a table out of date must not stop a job), the tests fail on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from iris import contract
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import TERMINAL_STATES, JobEvent, JobState, TaskView, end_code, state_code
    from iris.policy.reasons import ReasonCode

import workflows.job.ends as ends
from workflows.job.state import Ctx, Phase, now_ms

# The phase machine (docs/DESIGN.md, "Job states": "The phase machine" has the same table, a test
# holds them equal). Every phase but the end may be cancelled by Temporal itself.
NEXT: Mapping[Phase, frozenset[Phase]] = MappingProxyType(
    {
        Phase.CLASSIFY: frozenset({Phase.QUEUED, Phase.HANDOFF, Phase.CANCEL, Phase.ENDED}),
        Phase.QUEUED: frozenset({Phase.HANDOFF, Phase.CANCEL, Phase.ENDED}),
        Phase.HANDOFF: frozenset({Phase.FOLLOWING, Phase.PARKED, Phase.CANCEL, Phase.ENDED}),
        Phase.FOLLOWING: frozenset({Phase.QUEUED, Phase.CANCEL, Phase.ENDED}),
        Phase.PARKED: frozenset({Phase.HANDOFF, Phase.QUEUED, Phase.FOLLOWING, Phase.CANCEL, Phase.ENDED}),
        Phase.CANCEL: frozenset({Phase.CANCEL, Phase.ENDED}),
        Phase.ENDED: frozenset(),
    }
)
# The JobState each phase shows. CANCEL shows an attempt being terminated on its cluster as that
# cluster reports it, until it ends; before that, the state the job was cancelled in.
SHOWS: Mapping[Phase, frozenset[JobState]] = MappingProxyType(
    {
        Phase.CLASSIFY: frozenset({JobState.CLASSIFYING}),
        Phase.QUEUED: frozenset({JobState.QUEUED_HANDOFF}),
        Phase.HANDOFF: frozenset({JobState.PENDING_HANDOFF, JobState.BUILDING, JobState.HANDED_OFF}),
        Phase.FOLLOWING: frozenset({JobState.PENDING, JobState.RUNNING}),
        Phase.PARKED: frozenset({JobState.HANDOFF_FAILED}),
        Phase.CANCEL: frozenset({JobState.PENDING, JobState.RUNNING}),
        Phase.ENDED: TERMINAL_STATES,
    }
)


def illegal(message: str) -> None:
    """A move or a step the tables above do not allow. Logged (never during a replay); the tests
    replace this function with one that records it and fail."""
    workflow.logger.warning("job workflow: %s", message)


def check(phase: Phase, nxt: Phase) -> None:
    """The phase a step handed the job to, against ``NEXT``."""
    if nxt not in NEXT[phase]:
        illegal(f"step {phase.value} went to {nxt.value}, not one of {sorted(p.value for p in NEXT[phase])}")


def may_show(phase: Phase) -> frozenset[JobState]:
    """What a step in ``phase`` may move the job to: its own states, or those of a phase it may go
    to next (a step shows where it is taking the job before it returns)."""
    return SHOWS[phase].union(*(SHOWS[n] for n in NEXT[phase]))


def event(ctx: Ctx, state: JobState, message: str, code: ReasonCode | None = None) -> None:
    """One line of the job's story (``iris job describe``), without a move; ``code`` names the
    decision it records, if it has one (no command: only the query's answer shows it)."""
    st = ctx.run.status
    st.events.append(JobEvent(at_ms=now_ms(), state=state, message=message, code=code))
    st.updated_ms = now_ms()


def move(
    ctx: Ctx,
    state: JobState,
    reason: str,
    *,
    code: ReasonCode | None = None,
    cluster: str | None = None,
    record: bool = True,
) -> None:
    """Show the job in ``state`` for ``reason``, with ``code`` (by default the state's own,
    iris/jobs.py state_code) beside it, on ``cluster`` if given: its status, an event if anything
    changed (``record``), the search attributes and the memo that changed."""
    run = ctx.run
    if state not in may_show(run.phase):
        illegal(f"a move to {state.value} in phase {run.phase.value}: {reason[:200]}")
    st = run.status
    changed = state != st.state or reason != st.reason
    st.state = state
    st.reason = reason
    st.reason_code = code or state_code(state)
    st.updated_ms = now_ms()
    new_peer = cluster if cluster is not None and cluster != st.cluster else None
    if new_peer is not None:
        st.cluster = new_peer
        changed = True
    if changed and record:
        event(ctx, state, reason)
    _upsert_search_attributes(ctx, state, new_peer)
    if reason != run.memo_reason:
        # The reason rides in the memo so `iris job list` shows it without querying every job.
        run.memo_reason = reason
        workflow.upsert_memo({contract.MEMO_REASON: reason})
    workflow.set_current_details(f"**{state.value}** — {reason}" if reason else state.value)


def mirror(ctx: Ctx, remote: ControllerJobStatus) -> None:
    """Show the job as its cluster reports its attempt (docs/DESIGN.md, "Mirroring"): its exit code,
    error, backend and replicas, and the state and reason for them; an end with the attempt's own
    code (a timeout, a lost worker), a state under way with the state's."""
    st = ctx.run.status
    st.exit_code = remote.exit_code
    st.error = remote.error
    st.backend_id = remote.backend_id
    st.tasks = [
        TaskView(index=t.index, state=t.state.value, exit_code=t.exit_code, slots=t.slots)
        for t in remote.tasks
    ]
    state, reason = ends.shown(remote, st.cluster or "")
    code = (
        end_code(remote.state, remote.error, preemption=ctx.features.preemption) if remote.terminal else None
    )
    move(ctx, state, reason, code=code)


def _upsert_search_attributes(ctx: Ctx, state: JobState, new_peer: str | None) -> None:
    run, features = ctx.run, ctx.features
    updates = []
    # Runs recorded before LOCAL_STEPS_PATCH upserted the state on every change of state or reason.
    if state.value != run.sa_state or not features.local_steps:
        updates.append(contract.SA_STATE.value_set(state.value))
        run.sa_state = state.value
    if new_peer is not None:
        updates.append(contract.SA_PEER.value_set(new_peer))
    code = run.status.reason_code
    if features.reasons and code is not None and code.value != run.sa_reason:
        updates.append(contract.SA_REASON.value_set(code.value))
        run.sa_reason = code.value
    if updates:
        workflow.upsert_search_attributes(updates)
