"""The Temporal worker: every workflow and activity of the federation on one task queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import PollerBehaviorAutoscaling, Worker

from activities.admission import AdmissionActivities
from activities.artifacts import ArtifactActivities
from activities.auth import AuthActivities
from activities.inquiry import InquiryActivities
from activities.peers import PeerActivities
from activities.placement import PlacementActivities
from activities.store import StoreActivities
from activities.watch import WatchActivities
from iris import tracing
from iris.config import DEFAULT_DATA_DIR, FederationConfig, store_url
from iris.contract import PLACEMENT_MANAGER, manager_workflow_id, peer_watch_workflow_id, placement_task_queue
from iris.logrelay import LogRelay
from iris.payloadcodec import PAYLOAD_KEYS_ENV
from iris.store import FederationStore
from iris.temporal import connect, payload_encryption
from workflows.job import JobWorkflow
from workflows.peers import ListPeersWorkflow
from workflows.placement import ManagerInput, PlacementManager
from workflows.runner import workflow_runner
from workflows.watch import PeerWatch, WatcherInput

log = logging.getLogger("iris.worker")

# Every workflow this worker runs; the determinism check replays histories against the same list.
WORKFLOWS = (JobWorkflow, PlacementManager, ListPeersWorkflow, PeerWatch)


class FederationWorker:
    """The jobs' worker and the placement manager's, on their two task queues, as one unit.

    The manager has a queue of its own so that its ticks never wait behind a backlog of job
    tasks; the jobs' queue still serves a manager started there by an older version until that
    run moves over at its next continue-as-new.
    """

    def __init__(
        self, jobs: Worker, placement: Worker, closers: Sequence[Callable[[], Awaitable[None]]] = ()
    ) -> None:
        self.jobs = jobs
        self.placement = placement
        self._workers = (jobs, placement)
        # Run after both have stopped (the controller clients' open connections, say).
        self._closers = tuple(closers)

    async def run(self) -> None:
        """Run both until shutdown; if one fails, the other is shut down and the error raised."""
        tasks = [asyncio.create_task(w.run()) for w in self._workers]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            if not all(t.done() for t in tasks):
                await self.shutdown()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.shutdown() for w in self._workers if w.is_running))

    async def __aenter__(self) -> FederationWorker:
        self._run_task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
        await asyncio.gather(self._run_task, return_exceptions=True)
        for close in self._closers:
            await close()


def job_activities(
    config: FederationConfig, store: FederationStore, peers: PeerActivities | None = None
) -> list[Callable[..., Any]]:
    """Every activity of the jobs' task queue (the names are the contract's, iris/contract.py)."""
    peers = peers or PeerActivities(config, LogRelay(config), store=store)
    queue = StoreActivities(store, config.temporal.task_queue)
    placement = PlacementActivities(config, store)
    artifacts = ArtifactActivities(config)
    auth = AuthActivities(config)
    watch = WatchActivities(config)
    # The manager's inquiries run as local activities on its worker; a manager still on this queue
    # (started by an older version) runs them here.
    inquiry = InquiryActivities(config, store)
    return [
        auth.verify_request,
        AdmissionActivities(auth, peers).admit_submission,
        peers.fetch_reports,
        peers.launch_job,
        peers.stage_bundle,
        peers.mirror_job,
        peers.follow_job,
        peers.find_attempt,
        peers.terminate_job,
        queue.enqueue_job,
        queue.promote_job,
        queue.record_cancel,
        queue.expire_job,
        queue.set_handle_state,
        queue.requeue_job,
        queue.record_fence,
        placement.placement_tick,
        artifacts.check_artifacts,
        watch.watch_peer,
        inquiry.read_queue_positions,
        inquiry.plan_dry_run,
    ]


def workflow_task_polls(config: FederationConfig) -> dict[str, Any]:
    """The jobs' worker's workflow task poll settings: none (the SDK's default) unless
    ``[worker] max_workflow_task_polls`` is set."""
    most = config.worker.max_workflow_task_polls
    return {} if most is None else {"workflow_task_poller_behavior": PollerBehaviorAutoscaling(maximum=most)}


def build_worker(client: Client, config: FederationConfig, store: FederationStore) -> FederationWorker:
    peers = PeerActivities(config, LogRelay(config), store=store)
    jobs = Worker(
        client,
        task_queue=config.temporal.task_queue,
        workflows=list(WORKFLOWS),
        activities=job_activities(config, store, peers),
        max_concurrent_activities=200,
        # Every running job is a workflow a signal may wake at any time: one evicted from the cache
        # is replayed from its history first. The cache bounds the worker's memory
        # (`[worker] max_cached_workflows`; docs/DESIGN.md, "Worker memory").
        max_cached_workflows=config.worker.max_cached_workflows,
        # Autoscaling polls where the config asks for them, else the SDK's fixed five
        # (`[worker] max_workflow_task_polls`; docs/DESIGN.md, "Worker memory").
        **workflow_task_polls(config),
        workflow_runner=workflow_runner(),
        # Temporal's tracing interceptor when tracing is on and the client has none (docs/DESIGN.md,
        # "Tracing").
        interceptors=tracing.worker_interceptors(client),
    )
    inquiry = InquiryActivities(config, store)
    ticks = Worker(
        client,
        task_queue=placement_task_queue(config.temporal.task_queue),
        workflows=[PlacementManager],
        activities=[
            PlacementActivities(config, store).placement_tick,
            inquiry.read_queue_positions,
            inquiry.plan_dry_run,
        ],
        max_concurrent_activities=4,
        workflow_runner=workflow_runner(),
        interceptors=tracing.worker_interceptors(client),
    )
    return FederationWorker(jobs, ticks, [peers.aclose])


async def ensure_manager(client: Client, config: FederationConfig) -> None:
    """Start the placement manager unless it already runs (one per namespace), and each cluster's
    watcher (``ensure_watchers``).

    Another workflow type holding the manager's id (a raw Temporal start past the SDK's job-name
    check) is terminated and the manager started in its place: USE_EXISTING alone would take the
    impostor for the manager, and no job would ever be placed.
    """
    for _ in range(2):
        # Untraced: a trace of the manager would never end (docs/DESIGN.md, "Tracing").
        with tracing.untraced():
            handle = await client.start_workflow(
                PlacementManager.run,
                ManagerInput(interval_s=config.tick_interval_s),
                id=manager_workflow_id(config.temporal.task_queue),
                task_queue=placement_task_queue(config.temporal.task_queue),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary="Placement tick: queued jobs × peer capacity",
            )
        desc = await handle.describe()
        if desc.workflow_type == PLACEMENT_MANAGER:
            await ensure_watchers(client, config)
            return
        log.warning(
            "workflow %s (%s) holds the placement manager's id: terminating it", handle.id, desc.workflow_type
        )
        await handle.terminate(reason="this workflow id is reserved for the placement manager")
    raise RuntimeError(
        f"workflow id {manager_workflow_id(config.temporal.task_queue)} is held by another workflow"
    )


async def ensure_watchers(client: Client, config: FederationConfig) -> None:
    """Start one watcher per cluster unless it runs (docs/DESIGN.md, "Mirroring"); none when
    ``mirror_safety_poll_s`` is 0 (every running job then polls its cluster itself)."""
    if config.mirror_safety_poll_s <= 0:
        return
    queue = config.temporal.task_queue
    for cluster in config.clusters:
        # Untraced, like the manager: a watcher runs for ever (docs/DESIGN.md, "Tracing").
        with tracing.untraced():
            await client.start_workflow(
                PeerWatch.run,
                WatcherInput(cluster=cluster.name),
                id=peer_watch_workflow_id(queue, cluster.name),
                task_queue=queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"Watcher of {cluster.name}: its change feed → the jobs' workflows",
            )


async def run_worker(
    config: FederationConfig, data_dir: Path = DEFAULT_DATA_DIR, *, metrics_address: str | None = None
) -> None:
    """Serve the federation until cancelled; with ``metrics_address`` (``HOST:PORT``, else
    ``$IRIS_TEMPORAL_METRICS``) the SDK's and Iris's worker metrics are served there for Prometheus
    (docs/DESIGN.md, "Metrics")."""
    client = await connect(config, metrics=metrics_address, service=tracing.WORKER_SERVICE)
    encryption = payload_encryption(client)
    if encryption is None:
        log.warning(
            "no payload key ring ($%s): job payloads (command, env) are stored in Temporal's histories "
            'in plain text (docs/SECURITY.md, "Payload encryption")',
            PAYLOAD_KEYS_ENV,
        )
    else:
        log.info("%s", encryption)
    data_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, at start
    store = FederationStore(store_url(config, data_dir))
    try:
        async with build_worker(client, config, store):
            await ensure_manager(client, config)
            await asyncio.Event().wait()
    finally:
        store.close()
