"""Every reason a job shows has a stable code beside it (docs/DESIGN.md, "Reason codes"): in the
``status`` query (``JobStatus.reason_code``, what ``describe`` and ``list --json`` show) and in the
``IrisReason`` search attribute, upserted once per change of code. The job's own metrics
(iris_jobs_submitted, iris_queue_wait_seconds) come from workflow code, never twice for one job."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from job_doubles import (
    PEER,
    FakeFederation,
    Federation,
    LoseReply,
    Outage,
    Refuse,
    Remote,
    env_now_ms,
    federation_view,
    gpu_spec,
    listed,
    status,
    upserted,
    wait_for,
    wait_for_state,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.runtime import BufferedMetricUpdate, MetricBuffer, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from iris import metrics
from iris.contract import SA_REASON
from iris.controller.models import TIMED_OUT, ControllerJobState
from iris.jobs import CancelRequest, JobState, JobStatus, WaitReason, state_code
from iris.policy.models import Band, DeviceRequest
from iris.policy.reasons import ReasonCode
from iris.temporal import data_converter
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

Handle = WorkflowHandle[Any, JobStatus]


async def explain(handle: Handle, reason: str, code: ReasonCode) -> JobStatus:
    """The tick's explain_reason signal, and the job once it shows it."""
    await handle.signal(JobWorkflow.explain_reason, WaitReason(reason=reason, code=code))
    return await wait_for(handle, lambda st: (st.reason, st.reason_code) == (reason, code), f"showed {code}")


async def test_a_queued_job_shows_the_ticks_code_and_upserts_each_change_once(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("coded", fed.now_ms))
    st = await status(handle)
    assert st.reason_code is ReasonCode.Pending  # queued, no tick has looked at it yet

    full = "Queued for a federation peer to report free capacity: full on cw-a, cw-b (needs 8 h100)"
    await explain(handle, full, ReasonCode.NoCapacity)
    await explain(handle, full, ReasonCode.Priority)  # same text, new code: jobs ahead took it
    await explain(handle, full + "; cw-c unreachable", ReasonCode.Priority)  # new text, same code
    # A tick that predates the codes sends the text alone: the code stays as it was.
    await handle.signal(JobWorkflow.explain, "older tick's text")
    st = await wait_for(handle, lambda st: st.reason == "older tick's text", "took the text")
    assert st.reason_code is ReasonCode.Priority

    await fed.place(handle)
    st = await fed.result(handle)
    assert (st.state, st.reason_code) == (JobState.SUCCEEDED, ReasonCode.Succeeded)
    # Pending was set by the client at start; after that, one upsert per change of code.
    assert await upserted(handle, SA_REASON) == ["NoCapacity", "Priority", "Pending", "Running", "Succeeded"]
    assert (await handle.describe()).typed_search_attributes.get(SA_REASON) == "Succeeded"


async def test_an_explanation_that_arrives_before_the_enqueue_keeps_its_code(fed: Federation) -> None:
    fed.fake.hold("enqueue_job")
    handle = await fed.start(gpu_spec("early", fed.now_ms))
    await fed.fake.reached("enqueue_job")
    await handle.signal(
        JobWorkflow.explain_reason, WaitReason(reason="down", code=ReasonCode.PeerUnreachable)
    )
    fed.fake.release("enqueue_job")
    st = await wait_for(handle, lambda st: st.reason == "down", "took the early explanation")
    assert (st.state, st.reason_code) == (JobState.QUEUED_HANDOFF, ReasonCode.PeerUnreachable)


# ---- how a job ends, or parks: one code each -------------------------------------------------------


async def _succeeds(fed: Federation) -> Handle:
    handle = await fed.queued(gpu_spec("ok", fed.now_ms))
    await fed.place(handle)
    return handle


async def _exits_3(fed: Federation) -> Handle:
    fed.fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    return await _succeeds(fed)


async def _times_out(fed: Federation) -> Handle:
    fed.fake.mirror = [Remote(ControllerJobState.FAILED, -15, TIMED_OUT)]
    handle = await fed.queued(gpu_spec("slow", fed.now_ms, timeout_s=30.0))
    await fed.place(handle)
    return handle


async def _worker_lost(fed: Federation) -> Handle:
    fed.fake.mirror = [
        ControllerJobState.RUNNING,
        Remote(ControllerJobState.WORKER_FAILED, None, "node lost"),
    ]
    handle = await fed.queued(gpu_spec("lost", fed.now_ms, max_retries_preemption=0))
    await fed.place(handle)
    return handle


async def _refused(fed: Federation) -> Handle:
    fed.fake.launch = [Refuse()]
    return await _succeeds(fed)


async def _cancelled(fed: Federation) -> Handle:
    handle = await fed.queued(gpu_spec("cancelled", fed.now_ms))
    await handle.signal(JobWorkflow.cancel, CancelRequest())
    return handle


async def _deadline(fed: Federation) -> Handle:
    handle = await fed.queued(gpu_spec("late", fed.now_ms, scheduling_timeout_s=600))
    await fed.env.sleep(601)
    return handle


async def _no_shape(fed: Federation) -> Handle:
    return await fed.start(
        gpu_spec("tpu", fed.now_ms, device=DeviceRequest(type="tpu", variant="v5e", count=4))
    )


async def _unknown_pin(fed: Federation) -> Handle:
    return await fed.start(gpu_spec("ghost", fed.now_ms, target_cluster="ghost"))


ENDS: dict[str, tuple[Callable[[Federation], Awaitable[Handle]], JobState, ReasonCode]] = {
    "succeeded": (_succeeds, JobState.SUCCEEDED, ReasonCode.Succeeded),
    "exit non-zero": (_exits_3, JobState.FAILED, ReasonCode.ExitNonZero),
    "timeout": (_times_out, JobState.FAILED, ReasonCode.Timeout),
    "worker lost, no retry left": (_worker_lost, JobState.FAILED, ReasonCode.PeerLost),
    "launch refused": (_refused, JobState.HANDOFF_REJECTED, ReasonCode.HandoffRefused),
    "cancelled while queued": (_cancelled, JobState.KILLED, ReasonCode.Cancelled),
    "deadline": (_deadline, JobState.UNSCHEDULABLE, ReasonCode.DeadlinePassed),
    "no backend has the shape": (_no_shape, JobState.REJECTED, ReasonCode.ShapeMismatch),
    "pinned to an unknown cluster": (_unknown_pin, JobState.REJECTED, ReasonCode.ShapeMismatch),
}


@pytest.mark.parametrize("case", list(ENDS))
async def test_each_end_has_its_code_in_the_status_and_the_search_attribute(
    fed: Federation, case: str
) -> None:
    start, state, code = ENDS[case]
    handle = await start(fed)
    st = await fed.result(handle)
    assert (st.state, st.reason_code) == (state, code), st.reason
    assert (await upserted(handle, SA_REASON))[-1] == code.value


async def test_a_missing_artifact_parks_the_job_as_artifact_missing(fed: Federation) -> None:
    fed.fake.missing = {PEER: {"s3://ckpt/x"}}
    handle = await fed.queued(gpu_spec("parked", fed.now_ms, artifacts=["s3://ckpt/x"]))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert st.reason_code is ReasonCode.ArtifactMissing
    assert (await upserted(handle, SA_REASON))[-1] == "ArtifactMissing"


async def test_an_outage_the_cluster_confirms_parks_as_handoff_failed(fed: Federation) -> None:
    fed.fake.launch = [Outage("cw-a: 503")]
    handle = await fed.queued(gpu_spec("outage", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    assert "confirms it never received" in st.reason
    assert st.reason_code is ReasonCode.HandoffFailed


async def test_a_launch_whose_cluster_falls_silent_parks_as_peer_unreachable(fed: Federation) -> None:
    fed.fake.launch = [LoseReply(ControllerJobState.RUNNING, then_silent=True)]
    fed.fake.mirror = []
    handle = await fed.queued(gpu_spec("unknown", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    assert "does not answer" in st.reason
    assert st.reason_code is ReasonCode.PeerUnreachable
    # The cluster answers again, and has the job: followed there, running.
    fed.fake.silent.clear()
    st = await wait_for(
        handle, lambda st: st.state is JobState.RUNNING, "was adopted", env=fed.env, skip_s=15.0
    )
    assert st.reason_code is ReasonCode.Running


async def test_a_running_job_whose_cluster_is_silent_shows_peer_unreachable(fed: Federation) -> None:
    fed.fake.mirror = []
    handle = await fed.queued(gpu_spec("silent", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.RUNNING)
    assert st.reason_code is ReasonCode.Running
    fed.fake.silent.add(PEER)
    st = await wait_for(
        handle, lambda st: "has not answered" in st.reason, "went silent", env=fed.env, skip_s=5.0
    )
    assert (st.state, st.reason_code) == (JobState.RUNNING, ReasonCode.PeerUnreachable)
    fed.fake.silent.clear()
    fed.fake.set_remote_state(PEER, handle.id, ControllerJobState.SUCCEEDED)
    st = await fed.skip_to_end(handle)
    assert st.reason_code is ReasonCode.Succeeded
    # Pending from the start (the client's) through the handoff: not upserted again.
    assert await upserted(handle, SA_REASON) == ["Running", "PeerUnreachable", "Succeeded"]


def test_every_state_has_a_default_code() -> None:
    under_way = {ReasonCode.Pending, ReasonCode.Running}
    for state in JobState:
        code = state_code(state)
        # An end never reads as under way; a state under way is Pending or Running.
        assert (code in under_way) is (not state.terminal and state is not JobState.HANDOFF_FAILED), state


# ---- the visibility query ---------------------------------------------------------------------------


async def test_a_filter_on_iris_reason_finds_the_job(dev_fed: Federation) -> None:
    """Visibility queries need the dev server (the Java test server has no ListWorkflowExecutions)."""
    fed = dev_fed
    client = fed.env.client

    handle = await fed.queued(gpu_spec("findable", fed.now_ms))
    assert await listed(client, f"WorkflowId = '{handle.id}' AND IrisReason = 'Pending'") == [handle.id]
    await explain(handle, "stale report from cw-a", ReasonCode.PeerStale)
    assert await listed(client, f"WorkflowId = '{handle.id}' AND IrisReason = 'PeerStale'") == [handle.id]
    assert await listed(client, f"WorkflowId = '{handle.id}' AND IrisReason = 'Pending'") == []


# ---- metrics from workflow code --------------------------------------------------------------------


def iris_updates(buffer: MetricBuffer) -> list[tuple[str, float, dict[str, Any]]]:
    updates: list[BufferedMetricUpdate] = list(buffer.retrieve_updates())
    return [
        (u.metric.name, u.value, dict(u.attributes)) for u in updates if u.metric.name.startswith("iris_")
    ]


async def test_submissions_and_queue_waits_are_counted_once_per_job(time_env: WorkflowEnvironment) -> None:
    env = time_env
    buffer = MetricBuffer(10_000)
    runtime = Runtime(telemetry=TelemetryConfig(metrics=buffer))
    client = await Client.connect(
        env.client.service_client.config.target_host,
        namespace=env.client.namespace,
        runtime=runtime,
        data_converter=data_converter(),
    )
    now = await env_now_ms(env)
    fake = FakeFederation(view=federation_view(now))
    queue = f"jobs-metrics-{uuid.uuid4().hex}"
    async with Worker(
        client,
        task_queue=queue,
        workflows=[JobWorkflow],
        activities=fake.activities(),
        workflow_runner=workflow_runner(),
    ):
        fed = Federation(env=env, fake=fake, task_queue=queue, now_ms=now)
        try:
            handle = await fed.start(gpu_spec("measured", now, band=Band.BATCH))
            await wait_for_state(handle, JobState.QUEUED_HANDOFF)
            await env.sleep(90)  # 90 s in the queue, skipped
            await fed.place(handle)
            await fed.result(handle)
            fake.mirror = [ControllerJobState.SUCCEEDED]
            local = await fed.start(gpu_spec("at-home", now, device=DeviceRequest()))
            await fed.result(local)
        finally:
            await fed.end_leftovers()
    got = iris_updates(buffer)

    labels = {"band": "batch", "device": "h100x8"}
    submitted = [(v, a) for n, v, a in got if n == metrics.JOBS_SUBMITTED]
    assert [v for v, _ in submitted] == [1, 1]
    assert {k: submitted[0][1][k] for k in labels} == labels
    assert {k: submitted[1][1][k] for k in labels} == {"band": "interactive", "device": "cpu"}
    assert submitted[0][1]["workflow_type"] == "JobWorkflow"
    # One wait, the queued job's (the job run at home at once never waited in the queue).
    waits = [(v, a) for n, v, a in got if n == metrics.QUEUE_WAIT]
    assert len(waits) == 1
    value, attributes = waits[0]
    assert 90 <= value < 120 and {k: attributes[k] for k in labels} == labels

    # Replaying the history (as a worker does after an eviction) emits nothing.
    replay_buffer = MetricBuffer(10_000)
    history = await handle.fetch_history()
    await Replayer(
        workflows=[JobWorkflow],
        workflow_runner=workflow_runner(),
        data_converter=data_converter(),
        runtime=Runtime(telemetry=TelemetryConfig(metrics=replay_buffer)),
    ).replay_workflow(history)
    assert iris_updates(replay_buffer) == []
