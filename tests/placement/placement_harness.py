"""What the placement tests share: a stand-in job workflow, the federation as the tick sees it.

The job workflows the tick signals are a stand-in registered under the JobWorkflow type name
(``StandInJob``): it waits, records the reasons (and their codes) the tick's ``explain_reason``
signals bring and ends when told to, so a test decides when a job's workflow closes and how
(terminated, reset, completed). The tick's activity methods run inside ``ActivityEnvironment`` with
the dev server's client, as the worker would run them.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import ActivityEnvironment

from activities.placement import PlacementActivities
from iris import contract, devstack
from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.jobs import WaitReason
from iris.policy.models import (
    Availability,
    BackendReport,
    Band,
    DeviceRequest,
    HeldByBand,
    JobShape,
    PeerReport,
    Placement,
)
from iris.reports import FederationView
from iris.store import FederationStore, HandleState, JobHandle

T = TypeVar("T")
HOME = "marin"
PEER = "cw-a"
OTHER = "cw-b"
DOWN = "cw-down"
GPU_BACKEND = "h100-a"
GPU_ATTRS = {"device-type": ["gpu"], "device-variant": ["h100"]}
STALE_AFTER_MS = 30_000


@workflow.defn(name=contract.JOB_WORKFLOW, sandboxed=False)
class StandInJob:
    """Answers to the JobWorkflow type name: takes the tick's signals and waits until ``finish``."""

    def __init__(self) -> None:
        self._explained: list[str] = []
        self._codes: list[str] = []
        self._placed: list[str] = []
        self._done = False

    @workflow.run
    async def run(self, job_id: str) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal(name=contract.EXPLAIN_REASON)
    def explain_reason(self, why: WaitReason) -> None:
        self._explained.append(why.reason)
        self._codes.append(why.code.value)

    @workflow.signal(name=contract.PLACE)
    def place(self, placement: Placement) -> None:
        self._placed.append(placement.peer_id)

    @workflow.signal(name=contract.EXPIRE)
    def expire(self) -> None:
        self._done = True

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.query
    def explained(self) -> list[str]:
        return self._explained

    @workflow.query
    def codes(self) -> list[str]:
        return self._codes

    @workflow.query
    def placed(self) -> list[str]:
        return self._placed


@dataclass
class Jobs:
    """Stand-in job workflows on a worker of their own task queue."""

    client: Client
    task_queue: str

    async def start(self, job_id: str) -> WorkflowHandle[Any, Any]:
        handle: WorkflowHandle[Any, Any] = await self.client.start_workflow(
            StandInJob.run, job_id, id=contract.job_workflow_id(job_id), task_queue=self.task_queue
        )
        # Its first workflow task has completed (a reset needs one to go back to).
        await handle.query(StandInJob.explained)
        return handle

    def handle(self, job_id: str) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(contract.job_workflow_id(job_id))


def federation_config(peer_port: int, down_port: int) -> FederationConfig:
    """marin (home, CPU), cw-a (its controller served by the ``controller`` fixture) and cw-down
    (nothing listens on its port)."""
    return FederationConfig.model_validate(
        {
            "home": HOME,
            "stale_after_ms": STALE_AFTER_MS,
            "clusters": [
                {"name": HOME, "port": devstack.free_port(), "backends": [{"id": "cpu", "cpu_slots": 2}]},
                {
                    "name": PEER,
                    "port": peer_port,
                    "backends": [{"id": "cpu", "attributes": {"device-type": ["cpu"]}, "cpu_slots": 4}],
                    # Jobs as the test's user: this interpreter may sit where `nobody` cannot run it.
                    "run_as": pwd.getpwuid(os.geteuid()).pw_name,
                },
                {"name": DOWN, "port": down_port, "backends": [{"id": "cpu", "cpu_slots": 2}]},
            ],
        }
    )


@dataclass
class Controller:
    config: FederationConfig
    cluster: str

    def client(self) -> ControllerClient:
        return ControllerClient.for_cluster(self.config, self.cluster, timeout=10.0)


def in_activity(client: Client, fn: Callable[..., Awaitable[T]], *args: Any) -> Awaitable[T]:
    """Run one of the tick's coroutines as the worker would: in an activity, with the client."""
    result: Awaitable[T] = ActivityEnvironment(client=client).run(fn, *args)
    return result


def tick_activities(config: FederationConfig, store: FederationStore) -> PlacementActivities:
    # Closed workflows are looked for at every call (the tick's default is once a second).
    return PlacementActivities(config, store, reconcile_every_s=0.0)


# ---- the federation as the tick sees it -----------------------------------------------------------


def gpu_backend(free: int, *, epoch: int, held_batch: int = 0) -> BackendReport:
    held = [HeldByBand(band=Band.BATCH, amounts={"h100": held_batch})] if held_batch else []
    return BackendReport(
        backend_id=GPU_BACKEND,
        advertised_attributes=GPU_ATTRS,
        availability=Availability(
            observation_epoch_ms=epoch,
            amounts={"h100": free},
            total_amounts={"h100": max(16, free + held_batch)},
            held_by_band=held,
        ),
    )


def view(*peers: PeerReport) -> FederationView:
    now = int(time.time() * 1000)
    home = PeerReport(
        peer_id=HOME,
        last_contact_ms=now,
        backends=[BackendReport(backend_id="cpu", advertised_attributes={"device-type": ["cpu"]})],
    )
    return FederationView(home=HOME, stale_after_ms=STALE_AFTER_MS, reports=[home, *peers], fetched_ms=now)


def reachable(peer_id: str, *backends: BackendReport) -> PeerReport:
    return PeerReport(peer_id=peer_id, last_contact_ms=int(time.time() * 1000), backends=list(backends))


def unreachable(peer_id: str, error: str = "UNAVAILABLE: connect: refused") -> PeerReport:
    return PeerReport(peer_id=peer_id, reachable=False, error=error)


def gpu_job(job_id: str, gpus: int = 8) -> JobHandle:
    shape = JobShape(
        job_id=job_id,
        device=DeviceRequest(type="gpu", variant="h100", count=gpus),
        band=Band.INTERACTIVE,
        submit_ms=int(time.time() * 1000),
    )
    return JobHandle(job_id=job_id, incarnation="inc-1", state=HandleState.QUEUED_HANDOFF, shape=shape)


def new_job_id(name: str) -> str:
    return f"alice/{name}-{uuid.uuid4().hex[:8]}"


async def eventually(
    fn: Callable[[], Awaitable[T]], until: Callable[[T], bool], *, timeout: float = 15.0, what: str
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = await fn()
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(0.1)
