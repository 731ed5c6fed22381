"""The Temporal worker: every workflow and activity of the federation on one task queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.artifacts import ArtifactActivities
from activities.peers import PeerActivities
from activities.placement import PlacementActivities
from activities.store import StoreActivities, manager_workflow_id
from iris.config import DEFAULT_DATA_DIR, FederationConfig, store_url
from iris.logrelay import LogRelay
from iris.store import FederationStore
from iris.temporal import connect
from workflows.job import JobWorkflow
from workflows.peers import ListPeersWorkflow
from workflows.placement import ManagerInput, PlacementManager


def build_worker(client: Client, config: FederationConfig, store: FederationStore) -> Worker:
    peers = PeerActivities(config, LogRelay(config))
    queue = StoreActivities(store, config.temporal.task_queue)
    placement = PlacementActivities(config, store)
    artifacts = ArtifactActivities(config)
    return Worker(
        client,
        task_queue=config.temporal.task_queue,
        workflows=[JobWorkflow, PlacementManager, ListPeersWorkflow],
        activities=[
            peers.fetch_reports,
            peers.launch_job,
            peers.mirror_job,
            peers.terminate_job,
            queue.enqueue_job,
            queue.promote_job,
            queue.record_cancel,
            queue.expire_job,
            queue.set_handle_state,
            queue.requeue_job,
            placement.placement_tick,
            artifacts.check_artifacts,
        ],
        max_concurrent_activities=200,
    )


async def ensure_manager(client: Client, config: FederationConfig) -> None:
    """Start the placement manager unless it already runs (one per namespace)."""
    await client.start_workflow(
        PlacementManager.run,
        ManagerInput(interval_s=config.tick_interval_s, max_per_peer=config.max_per_peer_per_tick),
        id=manager_workflow_id(config.temporal.task_queue),
        task_queue=config.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary="Placement tick: queued jobs × peer capacity",
    )


async def run_worker(config: FederationConfig, data_dir: Path = DEFAULT_DATA_DIR) -> None:
    client = await connect(config)
    data_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, at start
    store = FederationStore(store_url(config, data_dir))
    try:
        async with build_worker(client, config, store):
            await ensure_manager(client, config)
            await asyncio.Event().wait()
    finally:
        store.close()
