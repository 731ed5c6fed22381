"""How an attempt ends, and what the job then shows (docs/DESIGN.md, "Attempts"): the one place
the workflow maps its cluster's word on an attempt (a ``ControllerJobState``) to the attempt's end
(``AttemptEnd``), to the job's state and reason, to the retry budget the end draws on and to the
job's final state; iris/jobs.py holds the mappings between the three vocabularies it builds on.

An attempt's end is recorded as an ``AttemptEnd``: ``NOT_DELIVERED`` for an attempt whose launch
was replaced before it was sent (``attempt_started``). A run's history holds the value's string, as
before the enum had that member, so every recorded history reads back alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from iris.controller.models import ControllerJobState
    from iris.controller.models import JobStatus as ControllerJobStatus
    from iris.jobs import AttemptEnd, AttemptView, JobSpec, JobState, attempt_end, mirrored_state

from workflows.job.state import JobRun, now_ms

# The job's state when its attempt ends so with no retry (every other end is FAILED).
_FINAL: Mapping[AttemptEnd, JobState] = MappingProxyType(
    {AttemptEnd.SUCCEEDED: JobState.SUCCEEDED, AttemptEnd.KILLED: JobState.KILLED}
)
# The flag of each retry budget, by the end that draws on it.
_FLAGS: Mapping[AttemptEnd, str] = MappingProxyType(
    {AttemptEnd.FAILED: "--max-retries-failure", AttemptEnd.PREEMPTED: "--max-retries-preemption"}
)


def ending(view: AttemptView) -> AttemptEnd | None:
    """How a recorded attempt ended, or None while it runs."""
    return view.end


def end_of(remote: ControllerJobStatus) -> AttemptEnd:
    """How an attempt whose cluster reports it ``remote`` (terminal) ended."""
    return attempt_end(remote.state, remote.error)


def shown(remote: ControllerJobStatus, cluster: str) -> tuple[JobState, str]:
    """The state and reason the job shows for its cluster's status ``remote``."""
    state = mirrored_state(remote.state)
    reasons = {
        JobState.PENDING: f"Waiting for devices on {cluster}",
        JobState.RUNNING: f"Running on {cluster}",
        JobState.SUCCEEDED: f"Succeeded on {cluster}",
        JobState.FAILED: f"Failed on {cluster}"
        + ("" if remote.exit_code is None else f" (exit code {remote.exit_code})"),
        JobState.KILLED: f"Killed on {cluster}",
    }
    reason = reasons.get(state, state.value)
    if remote.state is ControllerJobState.PREEMPTED:
        reason = f"Preempted on {cluster}"
    if remote.error:
        reason = f"{reason}: {remote.error}"
    return state, reason


def ended_reason(spec: JobSpec, remote: ControllerJobStatus, cluster: str, cancelled: str | None) -> str:
    """Why an attempt its cluster reports ended (``cancelled``: the reason of a cancel on its way)."""
    _, reason = shown(remote, cluster)
    if cancelled is not None and remote.state is ControllerJobState.KILLED:
        reason = f"Cancelled on {cluster}: {cancelled}"
    if end_of(remote) is AttemptEnd.TIMEOUT:
        reason = f"Failed on {cluster}: timeout ({spec.timeout_s:g}s)"
    return reason


def budget(run: JobRun, end: AttemptEnd) -> tuple[int, int, str] | None:
    """The retries used and allowed of the budget an attempt that ended so draws on, and its flag;
    None for an end that is never retried."""
    flag = _FLAGS.get(end)
    if flag is None:
        return None
    if end is AttemptEnd.FAILED:
        return run.failures_retried, run.spec.max_retries_failure, flag
    return run.preemptions_retried, run.spec.max_retries_preemption, flag


def final_state(end: AttemptEnd) -> JobState:
    """The job's state when its attempt ended so and is not retried."""
    return _FINAL.get(end, JobState.FAILED)


def attempt_started(run: JobRun, cluster: str, backend: str) -> None:
    """The attempt being delivered, as ``describe`` lists it (one entry per cluster and nonce)."""
    attempts = run.status.attempts
    if attempts and attempts[-1].nonce == run.nonce and attempts[-1].cluster == cluster:
        return
    if attempts and attempts[-1].end is None and attempts[-1].nonce == run.nonce:
        attempts[-1].end, attempts[-1].ended_ms = AttemptEnd.NOT_DELIVERED, now_ms()
    attempts.append(
        AttemptView(
            number=run.attempt, cluster=cluster, backend_id=backend, nonce=run.nonce, started_ms=now_ms()
        )
    )


def reopened(view: AttemptView) -> None:
    """An earlier attempt adopted as the job's again (steps/launch.py): its end is undone."""
    view.end = view.ended_ms = view.reason = None


def attempt_ended(
    run: JobRun, end: AttemptEnd, reason: str, exit_code: int | None, preempted: str | None = None
) -> None:
    """The current attempt's end: the latest, unless an earlier one was adopted (steps/launch.py)."""
    attempts = run.status.attempts
    if not attempts:
        return
    nonce = run.nonce
    current = next((a for a in reversed(attempts) if a.nonce == nonce), attempts[-1])
    current.end, current.reason, current.exit_code = end, reason, exit_code
    current.ended_ms = now_ms()
    if preempted is not None:
        current.preempted = preempted
