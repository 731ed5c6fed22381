"""The tick's settings are the ticking worker's config, read at every tick (docs/DESIGN.md,
"Handoff pacing"): a placement manager outlives worker restarts and upgrades, and one started with
an older input (a cap of one placement per tick, an hour between ticks) must not keep them. Fails
on the code before, where the manager's input set the cap and the interval for as long as it ran."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from placement_harness import PEER, Controller, Jobs, eventually, new_job_id
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.placement import PlacementActivities, TickOutcome
from iris import contract
from iris.config import FederationConfig
from iris.policy.models import DeviceRequest, JobShape
from iris.store import FederationStore, HandleState, JobHandle
from workflows.placement import PlacementManager
from workflows.runner import workflow_runner


async def outcomes(client: Client, handle: WorkflowHandle[object, object]) -> list[TickOutcome]:
    """Every tick the manager's history recorded, in order."""
    found: list[TickOutcome] = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            payloads = event.activity_task_completed_event_attributes.result.payloads
            (outcome,) = await client.data_converter.decode(payloads, [TickOutcome])
            found.append(outcome)
    return found


@pytest.fixture
async def upgraded(
    temporal: WorkflowEnvironment, config: FederationConfig, store: FederationStore
) -> AsyncIterator[tuple[FederationConfig, Callable[[], Awaitable[WorkflowHandle[object, object]]]]]:
    """A worker whose config says no cap and a tick every 0.2 s, and how to start a manager for it
    with an input from before (one placement per tick, an hour between ticks)."""
    cfg = config.model_copy(deep=True)
    cfg.temporal.task_queue = f"settings-{uuid.uuid4().hex[:8]}"
    cfg.max_per_peer_per_tick = None
    cfg.handoffs_per_s = None
    cfg.tick_interval_s = 0.2
    queue = contract.placement_task_queue(cfg.temporal.task_queue)
    worker = Worker(
        temporal.client,
        task_queue=queue,
        workflows=[PlacementManager],
        activities=[PlacementActivities(cfg, store).placement_tick],
        workflow_runner=workflow_runner(),
    )
    started: list[WorkflowHandle[object, object]] = []

    async def start() -> WorkflowHandle[object, object]:
        handle: WorkflowHandle[object, object] = await temporal.client.start_workflow(
            contract.PLACEMENT_MANAGER,
            # The input a manager was started with before (the model no longer names the cap).
            {"interval_s": 3600, "max_per_peer": 1},
            id=contract.manager_workflow_id(cfg.temporal.task_queue),
            task_queue=queue,
        )
        started.append(handle)
        return handle

    async with worker:
        try:
            yield cfg, start
        finally:
            for handle in started:
                await handle.terminate()


async def test_a_running_manager_ticks_with_the_workers_config_not_its_input(
    temporal: WorkflowEnvironment,
    controller: Controller,
    jobs: Jobs,
    store: FederationStore,
    upgraded: tuple[FederationConfig, Callable[[], Awaitable[WorkflowHandle[object, object]]]],
) -> None:
    cfg, start_manager = upgraded
    # Three one-CPU jobs pinned to cw-a (4 CPU slots), each with a workflow to take the signal.
    ids = [new_job_id(f"settings-{i}") for i in range(3)]
    for job_id in ids:
        await jobs.start(job_id)
        shape = JobShape(job_id=job_id, device=DeviceRequest(type="cpu", count=1), target_cluster=PEER)
        queued = JobHandle(job_id=job_id, incarnation="inc-1", state=HandleState.QUEUED_HANDOFF, shape=shape)
        store.enqueue(queued)
    manager = await start_manager()
    # No wake is sent: only the interval the ticks carry brings the next tick.
    ticks = await eventually(
        lambda: outcomes(temporal.client, manager),
        lambda found: sum(len(t.placed) for t in found) >= 3 and len(found) >= 4,
        timeout=30,
        what="ticks at the config's interval placing the three jobs",
    )
    placing = [t for t in ticks if t.placed]
    # One tick placed all three: the input's cap of one per tick no longer applies.
    assert sorted(placing[0].placed) == sorted(ids), placing
    assert all(t.interval_s == cfg.tick_interval_s for t in ticks)
