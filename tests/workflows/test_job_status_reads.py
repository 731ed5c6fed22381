"""Reading a job's status costs the workers nothing once the job has ended, and waiting costs them
nothing at all (docs/DESIGN.md, "Reading a job's status"): the SDK reads a closed workflow's result
instead of querying it, and waits by Temporal's long poll of the history."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

import pytest
from job_doubles import FakeFederation, cpu_spec, env_now_ms, federation_view, gpu_spec, placement, start_job
from temporalio.client import (
    Client,
    FetchWorkflowHistoryEventsInput,
    OutboundInterceptor,
    WorkflowHistoryEventAsyncIterator,
)
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import (
    ExecuteWorkflowInput,
    HandleQueryInput,
    Interceptor,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from iris.client import AsyncIrisClient
from iris.config import load_config
from iris.controller.models import ControllerJobState
from iris.jobs import JobState
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

QUERIES: list[str] = []


class _CountQueries(WorkflowInboundInterceptor):
    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        return await super().execute_workflow(input)

    async def handle_query(self, input: HandleQueryInput) -> Any:
        QUERIES.append(input.query)
        return await super().handle_query(input)


class CountQueries(Interceptor):
    """Records every query a worker answers (in replay too, where a closed workflow's is answered)."""

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        return _CountQueries


def _worker(env: WorkflowEnvironment, fake: FakeFederation, queue: str) -> Worker:
    return Worker(
        env.client,
        task_queue=queue,
        workflows=[JobWorkflow],
        activities=fake.activities(),
        workflow_runner=workflow_runner(),
        interceptors=[CountQueries()],
    )


@pytest.fixture
def queries() -> list[str]:
    QUERIES.clear()
    return QUERIES


def _client(env: WorkflowEnvironment, *interceptors: ClientInterceptor) -> AsyncIrisClient:
    client = cast(Client, env.client)
    if interceptors:
        client = Client(
            **{**client.config(), "interceptors": [*client.config()["interceptors"], *interceptors]}
        )
    return AsyncIrisClient(client, load_config())


class SeesLongPolls(ClientInterceptor):
    """Sets ``asked`` when the client asks for a workflow's history by long poll (``wait_new_event``),
    as ``handle.result()`` does; every call goes on to the server unchanged."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _SeesLongPolls(next, self.asked)


class _SeesLongPolls(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, asked: asyncio.Event) -> None:
        super().__init__(next)
        self.asked = asked

    def fetch_workflow_history_events(
        self, input: FetchWorkflowHistoryEventsInput
    ) -> WorkflowHistoryEventAsyncIterator:
        if input.wait_new_event:
            self.asked.set()
        return super().fetch_workflow_history_events(input)


async def test_an_ended_job_is_described_and_waited_for_with_no_worker_running(
    time_env: WorkflowEnvironment, queries: list[str]
) -> None:
    client = _client(time_env)
    now = await env_now_ms(time_env)
    fake = FakeFederation(view=federation_view(now))
    queue = f"jobs-{uuid.uuid4().hex}"
    async with _worker(time_env, fake, queue):
        handle = await start_job(time_env, cpu_spec("ended", now), queue)
        with time_env.auto_time_skipping_disabled():
            ended = await asyncio.wait_for(handle.result(), 10)
    assert ended.state is JobState.SUCCEEDED

    # No worker polls the job's task queue now: a query would wait for one until it timed out.
    described = await asyncio.wait_for(client.describe(handle.id), 10)
    waited = await asyncio.wait_for(client.wait(handle.id, timeout_s=5), 10)

    assert described == waited == ended
    assert queries == []


async def test_waiting_for_a_job_sends_its_worker_no_query(
    dev_env: WorkflowEnvironment, queries: list[str]
) -> None:
    """On the dev server: the Java test server answers a history long poll with an empty page."""
    long_polls = SeesLongPolls()
    client = _client(dev_env, long_polls)
    now = await env_now_ms(dev_env)
    fake = FakeFederation(view=federation_view(now))
    fake.mirror = [ControllerJobState.RUNNING, ControllerJobState.SUCCEEDED]
    queue = f"jobs-{uuid.uuid4().hex}"
    async with _worker(dev_env, fake, queue):
        handle = await start_job(dev_env, gpu_spec("waited", now), queue)
        waiter = asyncio.create_task(client.wait(handle.id, timeout_s=30))
        # The waiter waits on the running job by the history's long poll, having queried nothing.
        await asyncio.wait_for(long_polls.asked.wait(), 30)
        assert not waiter.done() and queries == []
        await handle.signal(JobWorkflow.place, placement(handle.id))
        st = await asyncio.wait_for(waiter, 20)

    assert st.state is JobState.SUCCEEDED
    assert queries == []
