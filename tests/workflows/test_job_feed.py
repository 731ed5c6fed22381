"""Following a running attempt by its cluster's watcher (FEED_PATCH; docs/DESIGN.md, "Mirroring"):
the job holds no activity while it runs, acts on the watcher's signals, drops stale or foreign ones,
recovers a missed signal by its safety poll, follows the cluster itself after a silence notice, and
relays its log every second while a reader wants it."""

from __future__ import annotations

from typing import Any

from job_doubles import PEER, Federation, gpu_spec, status, wait_for, wait_for_state
from temporalio.client import WorkflowHandle

from activities.watch import Observation
from iris import contract
from iris.controller.models import ControllerJobState, TaskStatus
from iris.jobs import JobSpec, JobState, JobStatus
from workflows.job import JobWorkflow

SAFETY_S = 180.0


async def running_with_a_watcher(
    fed: Federation, name: str
) -> tuple[JobSpec, WorkflowHandle[Any, JobStatus]]:
    fed.fake.view = fed.fake.view.model_copy(update={"mirror_safety_poll_s": SAFETY_S})
    fed.fake.mirror = []
    spec = gpu_spec(name, fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    return spec, handle


def seen(
    fed: Federation, spec: JobSpec, version: int, state: ControllerJobState, **update: Any
) -> Observation:
    """The watcher's observation of the job as the fake cluster has it, in state ``state``."""
    remote = fed.fake.remote[(PEER, spec.job_id)]
    code = {ControllerJobState.SUCCEEDED: 0, ControllerJobState.FAILED: 3}.get(state)
    changes: dict[str, Any] = {
        "state": state,
        "exit_code": code,
        "epoch": "e1",
        "version": version,
        "tasks": [TaskStatus(index=0, state=state, exit_code=code, slots=[0])],
    }
    return Observation(cluster=PEER, status=remote.model_copy(update=changes | update))


async def test_a_running_job_follows_its_watchers_signals_without_polling(fed: Federation) -> None:
    spec, handle = await running_with_a_watcher(fed, "feed-signals")
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 5, ControllerJobState.RUNNING))
    await wait_for(handle, lambda st: st.tasks and st.tasks[0].slots == [0], "showed its task")
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 7, ControllerJobState.SUCCEEDED))
    st = await fed.result(handle)
    assert (st.state, st.exit_code) == (JobState.SUCCEEDED, 0)
    # No activity polled the cluster while the job ran; one read at the end relayed its output.
    assert contract.FOLLOW_JOB not in fed.fake.calls
    assert fed.fake.calls.count(contract.MIRROR_JOB) == 1 and fed.fake.relayed == [spec.job_id]


async def test_stale_and_foreign_observations_are_dropped(fed: Federation) -> None:
    spec, handle = await running_with_a_watcher(fed, "feed-stale")
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 9, ControllerJobState.RUNNING))
    # Older than version 9 (a late signal), another attempt's, another cluster's: none is acted on.
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 8, ControllerJobState.FAILED))
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 10, ControllerJobState.FAILED, nonce="other"))
    other = seen(fed, spec, 11, ControllerJobState.FAILED).model_copy(update={"cluster": "cw-b"})
    await handle.signal(JobWorkflow.observe, other)
    st = await status(handle)
    assert st.state is JobState.RUNNING, st.reason
    # Another epoch (the controller restarted) counts, whatever its version.
    done = seen(fed, spec, 1, ControllerJobState.SUCCEEDED, epoch="e2")
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    await handle.signal(JobWorkflow.observe, done)
    assert (await fed.result(handle)).state is JobState.SUCCEEDED


async def test_a_missed_signal_is_recovered_by_the_safety_poll(fed: Federation) -> None:
    spec, handle = await running_with_a_watcher(fed, "feed-missed")
    # The job ends on its cluster, and the watcher's signal is lost.
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    await fed.env.sleep(SAFETY_S * 0.75)
    assert (await status(handle)).state is JobState.RUNNING
    assert contract.FOLLOW_JOB not in fed.fake.calls, "no poll before the safety interval"
    await fed.env.sleep(SAFETY_S * 0.5)
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED
    # One poll, asked for one answer (it relays the log as it reads).
    assert [f.max_wait_s for f in fed.fake.follows] == [0.0]


async def test_a_silence_notice_makes_the_job_follow_its_cluster_itself(fed: Federation) -> None:
    _spec, handle = await running_with_a_watcher(fed, "feed-silent")
    fed.fake.silent.add(PEER)
    now = await fed.env.get_current_time()
    notice = Observation(
        cluster=PEER, silent_since_ms=int(now.timestamp() * 1000), error="connection refused"
    )
    await handle.signal(JobWorkflow.observe, notice)
    # At once, not at the safety poll: the job asks the cluster itself and sees it silent.
    st = await wait_for(handle, lambda st: "has not answered" in st.reason, "saw its cluster silent")
    assert st.state is JobState.RUNNING and fed.fake.follows
    # The cluster answers again: the job goes back to waiting for the watcher.
    fed.fake.silent.discard(PEER)
    await fed.env.sleep(60)
    await wait_for(handle, lambda st: st.reason == f"Running on {PEER}", "followed it again")
    polls = len(fed.fake.follows)
    await fed.env.sleep(SAFETY_S * 0.5)
    assert len(fed.fake.follows) == polls, "once it answers, the job waits for the watcher again"


async def test_a_reader_of_the_log_gets_it_relayed_every_second(fed: Federation) -> None:
    spec, handle = await running_with_a_watcher(fed, "feed-logs")
    now = await fed.env.get_current_time()
    await handle.signal(JobWorkflow.want_logs, int(now.timestamp() * 1000) + 60_000)
    await wait_for(handle, lambda _: bool(fed.fake.follows), "relayed its log")
    follow = fed.fake.follows[0]
    # Relaying while the reader wants it (the activity relays every log_interval_s), not one answer.
    assert 0 < follow.max_wait_s <= 60 and follow.log_interval_s == 1.0
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    assert (await fed.result(handle)).state is JobState.SUCCEEDED


async def test_a_reported_end_is_confirmed_and_closed_in_one_workflow_task(fed: Federation) -> None:
    """LOCAL_CONFIRM_PATCH (issue 31, a burst of ends): the watcher's end is read back from its
    cluster by a local activity in the task that took the signal, which also closes the job; no
    activity goes through the task queue between the signal and the close."""
    spec, handle = await running_with_a_watcher(fed, "feed-one-task")
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    await handle.signal(JobWorkflow.observe, seen(fed, spec, 7, ControllerJobState.SUCCEEDED))
    assert (await fed.result(handle)).state is JobState.SUCCEEDED
    events = [e async for e in handle.fetch_history_events()]
    signals = [i for i, e in enumerate(events) if e.HasField("workflow_execution_signaled_event_attributes")]
    after = events[signals[-1] :]
    completed_tasks = [e for e in after if e.HasField("workflow_task_completed_event_attributes")]
    scheduled = [e for e in after if e.HasField("activity_task_scheduled_event_attributes")]
    markers = [
        e.marker_recorded_event_attributes
        for e in after
        if e.HasField("marker_recorded_event_attributes")
        and e.marker_recorded_event_attributes.marker_name == "core_local_activity"
    ]
    assert len(completed_tasks) == 1, [e.event_type for e in after]
    assert scheduled == [], [e.activity_task_scheduled_event_attributes.activity_type.name for e in scheduled]
    assert len(markers) >= 1
    assert events[-1].HasField("workflow_execution_completed_event_attributes")
    assert fed.fake.calls.count(contract.MIRROR_JOB) == 1 and fed.fake.relayed == [spec.job_id]
