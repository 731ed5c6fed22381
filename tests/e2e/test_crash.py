"""A worker SIGKILLed mid-lifecycle and restarted: the job completes, handed off once
(docs/DESIGN.md, "1. A job is handed off at most once per incarnation",
"5. No submitted job is lost").

Runs on both backends of the GPU peers, like the lifecycle suite: ``[process]`` and ``[ray]``.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from stack import Stack, wait_until
from temporalio.api.enums.v1 import PendingActivityState, TimeoutType
from temporalio.service import RPCError

from iris import devstack
from iris.client import AsyncIrisClient
from iris.config import FederationConfig
from iris.contract import manager_workflow_id
from iris.controller.client import ControllerClient
from iris.jobs import JobState
from workflows.placement import PlacementManager


class WorkerProcess:
    """`iris worker` as its own process, on its own task queue and federation store."""

    def __init__(self, config_file: Path, data_dir: Path) -> None:
        self.config_file = config_file
        self.data_dir = data_dir
        self.proc: devstack.ManagedProcess | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.proc = devstack.ManagedProcess(
            name="worker",
            argv=[
                str(Path(sys.executable).parent / "iris"),
                "--config",
                str(self.config_file),
                "worker",
                "--data-dir",
                str(self.data_dir),
            ],
            log_path=self.data_dir / f"worker-{self.starts}.log",
            ready=lambda: True,
            address="",
        )
        self.proc.start()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture(scope="module")
def stack(stack_per_backend: Stack) -> Stack:
    return stack_per_backend


@pytest.fixture
async def own_worker(stack: Stack, tmp_path: Path) -> AsyncIterator[tuple[WorkerProcess, AsyncIrisClient]]:
    cfg: FederationConfig = stack.config.model_copy(deep=True)
    cfg.temporal.task_queue = f"iris-crash-{tmp_path.name}"
    cfg.store_url = f"sqlite:///{tmp_path / 'federation.db'}"
    config_file = tmp_path / "crash.json"
    config_file.write_text(cfg.model_dump_json())
    worker = WorkerProcess(config_file, tmp_path)
    worker.start()
    try:
        yield worker, AsyncIrisClient(stack.client, cfg)
    finally:
        worker.stop()


async def _handoffs(stack: Stack, cluster: str, job_id: str) -> int:
    async with ControllerClient.for_cluster(stack.config, cluster) as ctl:
        return (await ctl.status(job_id)).attempts


@pytest.mark.timeout(240)
async def test_worker_killed_while_mirroring_and_while_queued_loses_nothing(
    stack: Stack, own_worker: tuple[WorkerProcess, AsyncIrisClient]
) -> None:
    worker, iris = own_worker
    running = await iris.submit(
        ["sh", "-c", "sleep 4; echo survived"], name="crash-run", target_cluster="cw-rno2a"
    )

    async def is_running() -> bool:
        return (await iris.describe(running)).state is JobState.RUNNING

    await wait_until(is_running, timeout=60, what="the job to run before the kill")
    worker.kill()
    # With no worker at all, a new job is accepted and waits durably.
    queued = await iris.submit(
        ["echo", "queued while down"], name="crash-queued", device_type="h100", gpu_count=8
    )
    worker.start()
    final = await iris.wait(running, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert await _handoffs(stack, "cw-rno2a", running) == 1
    assert [e.state for e in final.events].count(JobState.HANDED_OFF) == 1
    later = await iris.wait(queued, timeout_s=120)
    assert later.state is JobState.SUCCEEDED, later.reason
    assert later.cluster is not None
    assert await _handoffs(stack, later.cluster, queued) == 1


@pytest.mark.timeout(240)
async def test_a_tick_lost_with_its_worker_is_retried_on_its_heartbeat_timeout(
    stack: Stack, own_worker: tuple[WorkerProcess, AsyncIrisClient], tmp_path: Path
) -> None:
    """Not after the tick's whole start-to-close timeout: the next tick is seconds away, not 30."""
    worker, iris = own_worker
    manager = stack.client.get_workflow_handle(manager_workflow_id(iris.config.temporal.task_queue))

    async def tick_in_flight() -> str | None:
        desc = await manager.describe()
        pending = desc.raw_description.pending_activities
        started = PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        return desc.run_id if any(a.state == started for a in pending) else None

    async def ticked() -> bool:
        try:
            return await manager.query(PlacementManager.last_tick) is not None
        except RPCError:  # the worker has not started its manager yet
            return False

    await wait_until(ticked, timeout=60, what="the worker's first placement tick")
    # The tick's first step writes the reports: a writer holding the worker's store stalls it there.
    lock = sqlite3.connect(tmp_path / "federation.db", timeout=30, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")
        run_id: str | None = None

        async def stalled() -> bool:
            nonlocal run_id
            run_id = await tick_in_flight()
            return run_id is not None

        await wait_until(stalled, timeout=60, what="a placement tick stalled on the store")
        worker.kill()
        worker.start()
    finally:
        lock.rollback()
        lock.close()
    job_id = await iris.submit(["echo", "placed"], name="crash-tick", device_type="h100", gpu_count=8)
    final = await iris.wait(job_id, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    # The retried attempt records why the first one ended: its heartbeat stopped.
    history = await stack.client.get_workflow_handle(manager.id, run_id=run_id).fetch_history()
    retried = [
        e.activity_task_started_event_attributes
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.attempt > 1
    ]
    assert retried, "the stalled tick was not retried in that run"
    timeout = retried[0].last_failure.timeout_failure_info
    assert timeout.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT, retried[0].last_failure
