"""Acceptance 5 of issue 28: a watcher's observation is matched to its attempt by nonce, not by
arrival (docs/DESIGN.md, "Messages taken on trust").

A security review killed a peer controller while a pinned job ran there; in one trial of three the
watcher's WORKER_FAILED for attempt 1 arrived in the same workflow task as another answer, stayed
in the job's mailbox, and the follower applied it to attempt 2: the job ended FAILED at home while
attempt 2 ran on and succeeded. Two workflow tasks of that shape, made on purpose: the workflow
worker is stopped while an activity completes and the observation is signalled, so the next
worker gets both in one task.

- attempt 1's WORKER_FAILED arrives with attempt 2's launch result: the handler takes it under
  attempt 2's nonce, so it is dropped at once (``messages.observe``);
- it arrives with attempt 1's own last answer (the issue's trial): it is attempt 1's, so it is
  kept; attempt 2's follower takes it only under its own nonce, so it is dropped there
  (``steps/attempt.py``, ``for_attempt``).

Either way attempt 2 runs to its own end. Each test fails if its nonce check is removed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from job_doubles import (
    PEER,
    FakeFederation,
    Federation,
    env_now_ms,
    federation_view,
    gpu_spec,
    messages,
    wait_for,
    wait_for_state,
)
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.watch import Observation
from iris import contract
from iris.controller.models import ControllerJobState
from iris.controller.models import JobStatus as RemoteStatus
from iris.jobs import AttemptEnd, JobSpec, JobState, JobStatus
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

SAFETY_S = 600.0


class Split:
    """A federation whose workflows and activities run on separate workers of one task queue: the
    workflow worker can be stopped (no task is then processed) while activities complete, and a
    new one started, which gets everything that arrived meanwhile in one workflow task."""

    def __init__(self, env: WorkflowEnvironment, fake: FakeFederation, queue: str) -> None:
        self.env, self.fake, self.queue = env, fake, queue
        self.workflows: Worker | None = None

    def _worker(self) -> Worker:
        # Local activities run where the workflow runs; no cache, so no sticky queue to time out.
        return Worker(
            self.env.client,
            task_queue=self.queue,
            workflows=[JobWorkflow],
            activities=self.fake.activities(),
            no_remote_activities=True,
            max_cached_workflows=0,
            workflow_runner=workflow_runner(),
        )

    async def start_workflows(self) -> None:
        self.workflows = self._worker()
        await self.workflows.__aenter__()

    async def stop_workflows(self) -> None:
        assert self.workflows is not None
        await self.workflows.__aexit__(None, None, None)
        self.workflows = None


@asynccontextmanager
async def split_federation(env: WorkflowEnvironment) -> AsyncIterator[tuple[Federation, Split]]:
    now = await env_now_ms(env)
    # The watchers signal the job's changes; the job asks its cluster itself every SAFETY_S.
    fake = FakeFederation(view=federation_view(now).model_copy(update={"mirror_safety_poll_s": SAFETY_S}))
    fake.mirror = []
    queue = f"jobs-{uuid.uuid4().hex}"
    split = Split(env, fake, queue)
    async with Worker(env.client, task_queue=queue, activities=fake.activities()):
        await split.start_workflows()
        fed = Federation(env=env, fake=fake, task_queue=queue, now_ms=now)
        try:
            yield fed, split
        finally:
            if split.workflows is None:
                await split.start_workflows()
            await fed.end_leftovers()
            await split.stop_workflows()


def observed(remote: RemoteStatus, version: int, state: ControllerJobState) -> Observation:
    """The watcher's observation of ``remote`` (one attempt's run) in ``state``."""
    return Observation(
        cluster=PEER, status=remote.model_copy(update={"state": state, "epoch": "e1", "version": version})
    )


async def completed(handle: WorkflowHandle[Any, JobStatus], activity: str) -> int:
    """How many calls of ``activity`` the history shows completed."""
    scheduled: dict[int, str] = {}
    done = 0
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        if event.HasField("activity_task_completed_event_attributes"):
            attrs = event.activity_task_completed_event_attributes
            done += scheduled.get(attrs.scheduled_event_id) == activity
    return done


async def completes_while_no_workflow_worker_runs(
    fed: Federation, split: Split, handle: WorkflowHandle[Any, JobStatus], activity: str
) -> None:
    """Stop the workflow worker, then let the held ``activity`` complete (in the history)."""
    before = await completed(handle, activity)
    await split.stop_workflows()
    fed.fake.release(activity)
    for _ in range(200):
        if await completed(handle, activity) > before:
            return
        await fed.env.sleep(0.05)
    raise AssertionError(f"{activity} never completed")


async def in_one_task(handle: WorkflowHandle[Any, JobStatus], activity: str) -> bool:
    """Whether the last completion of ``activity`` and the first ``observe`` signal after it reached
    the workflow in the same workflow task (no task started between them)."""
    events = [e async for e in handle.fetch_history_events()]
    names = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    }
    done = max(
        i
        for i, e in enumerate(events)
        if e.HasField("activity_task_completed_event_attributes")
        and names.get(e.activity_task_completed_event_attributes.scheduled_event_id) == activity
    )
    signal = min(
        i
        for i, e in enumerate(events)
        if e.HasField("workflow_execution_signaled_event_attributes")
        and e.workflow_execution_signaled_event_attributes.signal_name == contract.OBSERVE
        and i > done
    )
    started = [i for i, e in enumerate(events) if e.HasField("workflow_task_started_event_attributes")]
    first_after = min(i for i in started if i > min(done, signal))
    return first_after > max(done, signal)


async def attempt_1_lost(
    fed: Federation, spec: JobSpec, handle: WorkflowHandle[Any, JobStatus]
) -> RemoteStatus:
    """Attempt 1 runs on the pinned peer; its worker dies there (the watcher says so, the cluster
    confirms it), and attempt 2 waits in the queue. Attempt 1's run as the cluster last had it."""
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.WORKER_FAILED)
    lost = fed.fake.remote[(PEER, spec.job_id)]
    await handle.signal(JobWorkflow.observe, observed(lost, 1, ControllerJobState.WORKER_FAILED))
    await wait_for(handle, lambda st: st.reason.startswith("Attempt 2 queued"), "queued attempt 2")
    return lost


async def attempt_2_ends(
    fed: Federation, spec: JobSpec, handle: WorkflowHandle[Any, JobStatus], version: int
) -> JobStatus:
    """Attempt 2 runs, then succeeds on its cluster, as its watcher says."""
    await wait_for_state(handle, JobState.RUNNING)
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    second = fed.fake.remote[(PEER, spec.job_id)]
    await handle.signal(JobWorkflow.observe, observed(second, version, ControllerJobState.SUCCEEDED))
    return await fed.result(handle)


def ignored_observations(st: JobStatus) -> list[str]:
    return [m for m in messages(st) if m.startswith("ignored an observation")]


async def test_attempt_1s_end_in_the_task_of_attempt_2s_launch_leaves_attempt_2_running(
    time_env: WorkflowEnvironment,
) -> None:
    async with split_federation(time_env) as (fed, split):
        spec = gpu_spec("nonce-launch", fed.now_ms, target_cluster=PEER)
        handle = await fed.queued(spec)
        lost = await attempt_1_lost(fed, spec, handle)

        fed.fake.hold(contract.LAUNCH_JOB)
        await fed.place(handle)
        await fed.fake.reached(contract.LAUNCH_JOB)
        await completes_while_no_workflow_worker_runs(fed, split, handle, contract.LAUNCH_JOB)
        # The watcher says it again (a resync after its cluster's restart), as attempt 2 starts.
        await handle.signal(JobWorkflow.observe, observed(lost, 2, ControllerJobState.WORKER_FAILED))
        await split.start_workflows()
        st = await attempt_2_ends(fed, spec, handle, 3)

        assert await in_one_task(handle, contract.LAUNCH_JOB)
        assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER), st.reason
        assert [a.end for a in st.attempts] == [AttemptEnd.PREEMPTED.value, AttemptEnd.SUCCEEDED.value]
        second = st.attempts[1].nonce
        assert fed.fake.deliveries == [(PEER, lost.nonce), (PEER, second)]
        # Dropped as it arrived: attempt 2's follower never saw it.
        assert ignored_observations(st) == []


async def test_attempt_1s_end_kept_from_its_last_task_never_reaches_attempt_2(
    time_env: WorkflowEnvironment,
) -> None:
    async with split_federation(time_env) as (fed, split):
        spec = gpu_spec("nonce-kept", fed.now_ms, target_cluster=PEER)
        handle = await fed.queued(spec)
        await fed.place(handle)
        await wait_for_state(handle, JobState.RUNNING)

        # Its controller is killed: the watcher reports the cluster silent, and the job asks the
        # cluster itself (follow_job). The controller restarts with attempt 1's worker lost: the
        # answer and the watcher's signal of it reach the job in one task.
        fed.fake.hold(contract.FOLLOW_JOB)
        now = await env_now_ms(fed.env)
        notice = Observation(cluster=PEER, silent_since_ms=now, error="connection refused")
        await handle.signal(JobWorkflow.observe, notice)
        await fed.fake.reached(contract.FOLLOW_JOB)
        fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.WORKER_FAILED)
        lost = fed.fake.remote[(PEER, spec.job_id)]
        await completes_while_no_workflow_worker_runs(fed, split, handle, contract.FOLLOW_JOB)
        await handle.signal(JobWorkflow.observe, observed(lost, 1, ControllerJobState.WORKER_FAILED))
        await split.start_workflows()
        await wait_for(handle, lambda st: st.reason.startswith("Attempt 2 queued"), "queued attempt 2")
        assert await in_one_task(handle, contract.FOLLOW_JOB)

        await fed.place(handle)
        st = await attempt_2_ends(fed, spec, handle, 2)

        assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER), st.reason
        assert [a.end for a in st.attempts] == [AttemptEnd.PREEMPTED.value, AttemptEnd.SUCCEEDED.value]
        second = st.attempts[1].nonce
        # Kept (it was attempt 1's when it arrived), then dropped by attempt 2's follower by its
        # nonce, before any read of the cluster to confirm it.
        assert ignored_observations(st) == [
            f"ignored an observation of {PEER} about {lost.nonce!r} (WORKER_FAILED): attempt 2 is "
            f"{second!r} on {PEER}"
        ]
        assert not [m for m in messages(st) if m.startswith("ignored: an observation says attempt 2")]
