"""Bounded histories (docs/DESIGN.md, "Bounded histories"): a job that waits in the queue for a
month while its pending reason keeps changing, one that runs for a month, and one parked
for days with a silent cluster each continue as new long before Temporal's event limit, and
end as they would have without it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from job_doubles import PEER, Federation, LoseReply, gpu_spec, wait_for, wait_for_state
from temporalio.client import WorkflowHandle

from iris.controller.models import ControllerJobState
from iris.jobs import AttemptEnd, CancelRequest, JobState, JobStatus
from workflows.job import JobWorkflow

# Temporal terminates a run at 51,200 events and warns from 10,240; the acceptance bound is 10,000.
EVENT_BOUND = 10_000
DAY_S = 86_400


async def run_lengths(fed: Federation, job_id: str) -> list[int]:
    """The number of events of each run of the job's workflow, first to last."""
    client = fed.env.client
    run_id: str | None = None
    lengths: list[int] = []
    # Walk the chain from the first run (the latest run's first event names it).
    latest = client.get_workflow_handle(job_id)
    async for event in latest.fetch_history_events():
        run_id = event.workflow_execution_started_event_attributes.first_execution_run_id
        break
    assert run_id
    while run_id:
        events = [e async for e in client.get_workflow_handle(job_id, run_id=run_id).fetch_history_events()]
        lengths.append(len(events))
        last = events[-1]
        run_id = (
            last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
            if last.HasField("workflow_execution_continued_as_new_event_attributes")
            else None
        )
    return lengths


def latest(fed: Federation, job_id: str) -> WorkflowHandle[Any, JobStatus]:
    """The job's workflow, whichever run is current (a handle bound to a run would stay on it)."""
    return fed.env.client.get_workflow_handle_for(JobWorkflow.run, job_id)


async def until(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 300.0) -> None:
    """Poll ``predicate`` (real time) until it holds."""
    for _ in range(int(timeout / 0.2)):
        if await predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"never {what}")


@pytest.mark.long
async def test_a_month_in_the_queue_with_changing_reasons_stays_bounded(fed: Federation) -> None:
    """One reason change every half hour for 30 days: 1,440 signals, several runs' worth."""
    spec = gpu_spec("month-queued", fed.now_ms)
    await fed.queued(spec)
    changes = 30 * 48
    for i in range(changes):
        await latest(fed, spec.job_id).signal(JobWorkflow.explain, f"cw-a full: {i} jobs ahead")
        if i % 500 == 0:
            await fed.env.sleep(changes and 30 * DAY_S * 500 / changes)
    st = await wait_for(
        latest(fed, spec.job_id),
        lambda s: s.reason == f"cw-a full: {changes - 1} jobs ahead",
        "took the last reason",
        timeout=30,
    )
    assert st.state is JobState.QUEUED_HANDOFF
    await fed.place(latest(fed, spec.job_id))
    st = await fed.result(latest(fed, spec.job_id), timeout=30)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    lengths = await run_lengths(fed, spec.job_id)
    assert len(lengths) >= 2, lengths
    assert max(lengths) < EVENT_BOUND, lengths
    assert fed.fake.delivered == 1 and len(fed.fake.promotions) == 1
    # The status carried across runs: the submit and the classification are still there.
    assert st.events[0].state is JobState.CLASSIFYING
    assert any("omitted" in e.message for e in st.events) or len(st.events) < 300


@pytest.mark.long
async def test_a_month_running_stays_bounded_and_ends_as_the_cluster_says(fed: Federation) -> None:
    """A follow answer every half hour of a 30-day run: 1,440 answers. The real follow_job answers
    after half an hour without a change; the double answers at once, so each answer stands for
    that half hour (the test server cannot skip its clock while activities run back to
    back)."""
    fake = fed.fake
    fake.mirror = []
    fake.follow_unchanged = True
    spec = gpu_spec("quarter-run", fed.now_ms, max_retries_failure=1)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    answers = 30 * 48

    async def answered() -> bool:
        return len(fake.mirror_calls) >= answers

    await until(answered, f"answered {answers} follows")
    fake.follow_unchanged = False
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    st = await fed.result(latest(fed, spec.job_id), timeout=60)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert [a.end for a in st.attempts] == [AttemptEnd.SUCCEEDED.value]
    assert fake.delivered == 1
    lengths = await run_lengths(fed, spec.job_id)
    assert len(lengths) >= 3, lengths
    assert max(lengths) < EVENT_BOUND, lengths


async def test_a_cancel_after_the_run_continued_as_new_still_terminates_on_the_cluster(
    fed: Federation,
) -> None:
    fake = fed.fake
    fake.mirror = []
    fake.follow_unchanged = True
    spec = gpu_spec("cancel-later", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)

    async def continued() -> bool:
        return len(await run_lengths(fed, spec.job_id)) >= 2

    await until(continued, "continued as new", timeout=60)
    fake.follow_unchanged = False
    outcome = await latest(fed, spec.job_id).execute_update(JobWorkflow.cancel_job, CancelRequest(reason="x"))
    st = await fed.result(latest(fed, spec.job_id), timeout=30)

    assert outcome.won is False
    assert st.state is JobState.KILLED
    assert fake.terminations == [PEER]


@pytest.mark.long
async def test_a_job_parked_for_days_with_a_silent_cluster_stays_bounded(fed: Federation) -> None:
    """The park probes the silent cluster every ten minutes at most: days of probes."""
    fake = fed.fake
    fake.launch = [LoseReply(ControllerJobState.RUNNING, then_silent=True)]
    spec = gpu_spec("parked-days", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    probes = 600  # at 10 min: four days and more
    for _ in range(probes // 50):
        await fed.env.sleep(50 * 600)
    await wait_for(latest(fed, spec.job_id), lambda s: len(fake.finds) >= probes // 2, "probed", timeout=60)
    fake.silent.clear()
    st = await fed.skip_to_end(latest(fed, spec.job_id))

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert fake.delivered == 1
    lengths = await run_lengths(fed, spec.job_id)
    assert len(lengths) >= 2, lengths
    assert max(lengths) < EVENT_BOUND, lengths
    assert [a.end for a in st.attempts] == [AttemptEnd.SUCCEEDED.value]
