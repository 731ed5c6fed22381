"""The opt-in Prometheus endpoint of the Temporal SDK (``IRIS_TEMPORAL_METRICS``, iris/temporal.py).

A process connected through ``iris.temporal.connect`` with the variable set serves the SDK's own
metrics; benchmarks/running.py reads the worker's activity slot gauges from it (docs/BENCHMARKS.md,
"Running jobs (issue 17)"). Here a real dev server and a real worker hold three activities in five
slots, and the endpoint must say so; an unusable address is a one-line ConfigError.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stack import wait_until
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from iris import devstack
from iris.config import ConfigError, load_config
from iris.temporal import connect

METRICS_ENV = "IRIS_TEMPORAL_METRICS"
RELEASE = asyncio.Event()


@activity.defn(name="metrics_test_hold")
async def hold() -> None:
    await RELEASE.wait()


@workflow.defn(name="MetricsTestWorkflow")
class HoldWorkflow:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(hold, start_to_close_timeout=timedelta(minutes=2))


@pytest.fixture(scope="module")
async def dev_server() -> AsyncIterator[str]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        yield env.client.service_client.config.target_host
    finally:
        await env.shutdown()


def slot_gauges(text: str, task_queue: str) -> dict[tuple[str, str], float]:
    """(metric, worker_type) -> value of the slot gauges of ``task_queue``."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("temporal_worker_task_slots_") and (
                sample.labels.get("task_queue") == task_queue
            ):
                out[(sample.name, sample.labels["worker_type"])] = sample.value
    return out


async def test_worker_serves_its_activity_slots(dev_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = devstack.free_port()
    monkeypatch.setenv(METRICS_ENV, f"127.0.0.1:{port}")
    cfg = load_config()
    cfg.temporal.address = dev_server
    client = await connect(cfg)
    queue = f"metrics-{uuid.uuid4().hex[:8]}"
    RELEASE.clear()
    async with Worker(
        client,
        task_queue=queue,
        workflows=[HoldWorkflow],
        activities=[hold],
        max_concurrent_activities=5,
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        handles = [
            await client.start_workflow(HoldWorkflow.run, id=f"{queue}-{i}", task_queue=queue)
            for i in range(3)
        ]
        url = f"http://127.0.0.1:{port}/metrics"
        used_key = ("temporal_worker_task_slots_used", "ActivityWorker")
        free_key = ("temporal_worker_task_slots_available", "ActivityWorker")
        gauges: dict[tuple[str, str], float] = {}
        async with httpx.AsyncClient(timeout=5) as http:

            async def used(n: int) -> bool:
                nonlocal gauges
                gauges = slot_gauges((await http.get(url)).text, queue)
                return gauges.get(used_key) == n

            await wait_until(lambda: used(3), timeout=30, what="three activity slots used")
            assert gauges.get(free_key) == 2, gauges
            RELEASE.set()
            await asyncio.gather(*(h.result() for h in handles))
            await wait_until(lambda: used(0), timeout=30, what="every activity slot free again")
            assert gauges.get(free_key) == 5, gauges


async def test_unusable_metrics_address_is_one_line(dev_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config()
    cfg.temporal.address = dev_server
    monkeypatch.setenv(METRICS_ENV, "not-an-address")
    with pytest.raises(ConfigError, match=f"^{METRICS_ENV}=not-an-address: .*address") as bad:
        await connect(cfg)
    assert "\n" not in str(bad.value)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        monkeypatch.setenv(METRICS_ENV, taken)
        with pytest.raises(ConfigError, match=f"^{METRICS_ENV}={taken}: .*in use"):
            await connect(cfg)
