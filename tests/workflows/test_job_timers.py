"""The handoff's timers come from the federation's configuration (issue 25; docs/DESIGN.md, "Errors,
retries and parking"): the launch and the bundle staging retry on the view's
``handoff_retry_initial_s`` / ``handoff_retry_max_s``, and a park whose launch went unanswered
probes its cluster after ``parked_probe_first_s``, doubling up to ``parked_probe_max_s``. The
view is the one the job was classified with (an activity's result), so the values are in the
run's history. The values here differ from the defaults (1 s / 10 s, 15 s / 10 min), and each
check fails with those.

Times are the test server's (time skipping), read from the job's events and its history: no
wall clock."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from job_doubles import (
    BUNDLE,
    PEER,
    Accept,
    Federation,
    LoseReply,
    Outage,
    gpu_spec,
    messages,
    wait_for,
    wait_for_state,
)
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

from iris import contract
from iris.controller.models import ControllerJobState
from iris.jobs import AttemptEnd, JobState, JobStatus

INITIAL_S = 3.0
MAX_S = 7.0
PROBE_FIRST_S = 40.0
PROBE_MAX_S = 50.0


async def history(handle: WorkflowHandle[Any, JobStatus]) -> list[HistoryEvent]:
    return [event async for event in handle.fetch_history_events()]


def scheduled_retries(events: list[HistoryEvent], activity: str) -> list[tuple[float, float, float, int]]:
    """(initial s, max s, backoff, attempts) of each scheduling of ``activity`` in the history."""
    found = []
    for event in events:
        if not event.HasField("activity_task_scheduled_event_attributes"):
            continue
        attrs = event.activity_task_scheduled_event_attributes
        if attrs.activity_type.name != activity:
            continue
        policy = attrs.retry_policy
        found.append(
            (
                policy.initial_interval.ToTimedelta().total_seconds(),
                policy.maximum_interval.ToTimedelta().total_seconds(),
                policy.backoff_coefficient,
                policy.maximum_attempts,
            )
        )
    return found


def timers(events: list[HistoryEvent]) -> list[timedelta]:
    return [
        e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
        for e in events
        if e.HasField("timer_started_event_attributes")
    ]


def at_ms(st: JobStatus, message: str) -> int:
    """Workflow time (ms) of the job's first event that starts with ``message``."""
    return next(e.at_ms for e in st.events if e.message.startswith(message))


async def test_the_staging_and_the_launch_retry_on_the_configured_schedule(fed: Federation) -> None:
    """Staging and launch each fail twice, then succeed: their retries wait 3 s, then 6 s (the
    configured initial interval, doubled), where the defaults would wait 1 s, then 2 s."""
    fake = fed.fake
    fake.view = fake.view.model_copy(
        update={"handoff_retry_initial_s": INITIAL_S, "handoff_retry_max_s": MAX_S}
    )
    fake.stage = [Outage("cw-a: connection refused"), Outage("cw-a: connection refused"), Accept()]
    fake.launch = [Outage("cw-a: connection refused"), Outage("cw-a: connection refused"), Accept()]
    handle = await fed.queued(gpu_spec("retry-schedule", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)
    st = await wait_for(
        handle, lambda s: s.state is JobState.SUCCEEDED, "succeeded", env=fed.env, skip_s=1.0, timeout=30
    )

    # The launch: two outages, then "no such bundle"; staged; sent again and accepted.
    assert fake.stagings == [PEER] * 3 and fake.launch_attempts == [PEER] * 4 and fake.delivered == 1
    events = await history(handle)
    configured = (INITIAL_S, MAX_S, 2.0, 6)
    assert scheduled_retries(events, contract.STAGE_BUNDLE) == [configured]
    assert scheduled_retries(events, contract.LAUNCH_JOB) == [configured, configured]
    # In the job's own (workflow) time: two retries, 3 s + 6 s, each step.
    staged_after = at_ms(st, f"workspace bundle {BUNDLE.short}") - at_ms(st, "Staging workspace bundle")
    launched_after = at_ms(st, "Staging workspace bundle") - at_ms(st, f"Awaiting acceptance by {PEER}")
    assert staged_after >= (INITIAL_S + 2 * INITIAL_S) * 1000, staged_after
    assert launched_after >= (INITIAL_S + 2 * INITIAL_S) * 1000, launched_after


async def test_a_launch_outage_parks_after_the_configured_retries(fed: Federation) -> None:
    """Six tries over 3 + 6 + 7 + 7 + 7 = 30 s of the job's time (the defaults: 25 s), then the
    cluster confirms it never got the job."""
    fake = fed.fake
    fake.view = fake.view.model_copy(
        update={"handoff_retry_initial_s": INITIAL_S, "handoff_retry_max_s": MAX_S}
    )
    fake.launch = [Outage("cw-a: connection refused")]
    handle = await fed.queued(gpu_spec("retry-budget", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=2.0, timeout=30)

    assert st.reason.endswith(f"{PEER} confirms it never received the job"), st.reason
    assert fake.launch_attempts == [PEER] * 6 and fake.delivered == 0
    parked_after = at_ms(st, st.reason) - at_ms(st, f"Awaiting acceptance by {PEER}")
    assert parked_after >= (3 + 6 + 7 + 7 + 7) * 1000, parked_after


async def test_a_parked_job_probes_its_silent_cluster_on_the_configured_schedule(fed: Federation) -> None:
    """The launch landed but its every answer was lost: parked with the outcome unknown. The park
    asks the cluster after 40 s (not 15 s), then every 50 s (the configured cap, not 80 s); when the
    cluster answers, the attempt is adopted."""
    fake = fed.fake
    fake.view = fake.view.model_copy(
        update={"parked_probe_first_s": PROBE_FIRST_S, "parked_probe_max_s": PROBE_MAX_S}
    )
    fake.launch = [LoseReply(ControllerJobState.RUNNING, then_silent=True)]
    handle = await fed.queued(gpu_spec("probe-schedule", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0, timeout=30)
    assert "the outcome is unknown" in st.reason, st.reason
    assert len(fake.finds) == 1  # the reconciliation after the launch's retries

    await fed.env.sleep(PROBE_FIRST_S + 1)
    await wait_for(handle, lambda _: len(fake.finds) == 2, "probed once")
    await fed.env.sleep(PROBE_MAX_S + 1)
    await wait_for(handle, lambda _: len(fake.finds) == 3, "probed twice")
    assert timers(await history(handle))[:3] == [timedelta(seconds=s) for s in (40, 50, 50)]

    fake.silent.clear()  # the cluster answers again: the next probe finds the attempt there
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert f"{PEER} answers: it has the job; following it there" in messages(st)
    assert [a.end for a in st.attempts] == [AttemptEnd.SUCCEEDED.value] and fake.delivered == 1
