"""Internal workflow ids are not job ids (issue 16, "Refuse job names that collide with internal
workflow ids"): the SDK refuses them (tests/test_submission.py); here, a raw Temporal start that
bypasses the SDK. A JobWorkflow started under one fails at once, and the worker's start-up
replaces a workflow of another type holding the placement manager's id.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from job_doubles import Federation, cpu_spec
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from iris.config import ClusterConfig, FederationConfig, TemporalConfig
from iris.contract import PLACEMENT_MANAGER, list_peers_workflow_id, manager_workflow_id
from worker.main import ensure_manager
from workflows.job import JobWorkflow


@pytest.mark.parametrize("kind", ["manager", "rpc"])
async def test_a_raw_started_job_under_an_internal_id_fails_at_once(dev_fed: Federation, kind: str) -> None:
    workflow_id = (
        manager_workflow_id(dev_fed.task_queue) if kind == "manager" else list_peers_workflow_id("x")
    )
    spec = cpu_spec("impostor", dev_fed.now_ms)
    handle = await dev_fed.env.client.start_workflow(
        JobWorkflow.run, spec, id=workflow_id, task_queue=dev_fed.task_queue
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), 15)
    assert isinstance(failed.value.cause, ApplicationError)
    assert "reserved for the federation's own workflows" in failed.value.cause.message
    # Before any activity: nothing was verified, enqueued or launched.
    assert dev_fed.fake.calls == [] and dev_fed.fake.launch_attempts == []


async def test_the_worker_replaces_an_impostor_holding_the_managers_id(dev_fed: Federation) -> None:
    queue = f"reserved-{uuid.uuid4().hex[:8]}"
    config = FederationConfig(
        home="h",
        clusters=[ClusterConfig(name="h", port=1, backends=[])],
        temporal=TemporalConfig(task_queue=queue),
    )
    client = dev_fed.env.client
    # On a queue no worker serves, so it stays running, as before a worker's first start.
    impostor = await client.start_workflow(
        JobWorkflow.run, cpu_spec("impostor", dev_fed.now_ms), id=manager_workflow_id(queue), task_queue=queue
    )
    first_run = (await impostor.describe()).run_id
    await ensure_manager(client, config)
    manager = client.get_workflow_handle(manager_workflow_id(queue))
    try:
        desc = await manager.describe()
        assert desc.workflow_type == PLACEMENT_MANAGER
        assert desc.status == WorkflowExecutionStatus.RUNNING
        old = await client.get_workflow_handle(manager_workflow_id(queue), run_id=first_run).describe()
        assert old.status == WorkflowExecutionStatus.TERMINATED
    finally:
        await manager.terminate()
