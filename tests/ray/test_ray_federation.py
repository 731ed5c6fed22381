"""End to end: a federated job handed off to a peer whose backend is Ray runs to SUCCEEDED.

A small federation of its own (the session stack belongs to the lifecycle tests): a real Temporal
dev server, the S3 emulator for the home cluster's log relay, two real controller processes — the
home with a CPU process backend, the peer "raypeer" whose only backend is Ray — and a worker
running the real JobWorkflow and placement manager. The job asks for H100s, which only the Ray
peer has: it is queued, placed by the tick from Ray's own capacity report, promoted, handed off,
run by Ray, and mirrored back.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from ray.job_submission import JobStatus as RayStatus
from ray.job_submission import JobSubmissionClient
from ray_harness import ray_backend
from temporalio.testing import WorkflowEnvironment

from iris import devstack
from iris.client import AsyncIrisClient, current_user
from iris.config import (
    BackendConfig,
    ClusterConfig,
    FederationConfig,
    ObjectStoreConfig,
    TemporalConfig,
)
from iris.contract import SEARCH_ATTRIBUTE_KEYS
from iris.controller.executors.ray_jobs import submission_id
from iris.jobs import JobState
from iris.store import FederationStore
from iris.temporal import data_converter
from iris.userauth import USER_KEY_DIR_ENV, register_user
from worker.main import build_worker, ensure_manager


@dataclass
class RayFederation:
    config: FederationConfig
    iris: AsyncIrisClient


def _s3(cluster: str, port: int) -> ObjectStoreConfig:
    var = cluster.upper().replace("-", "_")
    return ObjectStoreConfig(
        kind="s3",
        bucket=f"{cluster}-artifacts",
        endpoint=f"http://127.0.0.1:{port}",
        access_key_env=f"IRIS_RAYTEST_{var}_KEY",
        secret_key_env=f"IRIS_RAYTEST_{var}_SECRET",
    )


def federation_config(ray_head: devstack.RayHeadSpec, temporal_address: str) -> FederationConfig:
    s3_port = devstack.free_port()
    return FederationConfig(
        home="home",
        temporal=TemporalConfig(
            address=temporal_address, task_queue="iris-ray-test", ui_port=devstack.free_port()
        ),
        s3_port=s3_port,
        gcs_port=devstack.free_port(),
        tick_interval_s=0.5,
        clusters=[
            ClusterConfig(
                name="home",
                port=devstack.free_port(),
                object_store=_s3("home", s3_port),
                backends=[BackendConfig(id="cpu", attributes={"device-type": ["cpu"]}, cpu_slots=2)],
            ),
            ClusterConfig(
                name="raypeer",
                port=devstack.free_port(),
                object_store=_s3("raypeer", s3_port),
                backends=[BackendConfig.model_validate(ray_backend(ray_head, "e2e"))],
            ),
        ],
    )


@pytest.fixture(scope="module")
async def ray_federation(
    ray_head: devstack.RayHeadSpec, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RayFederation]:
    root: Path = tmp_path_factory.mktemp("rayfed")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        search_attributes=SEARCH_ATTRIBUTE_KEYS,
        data_converter=data_converter(),
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    services: list[devstack.ManagedProcess] = []
    store: FederationStore | None = None
    worker = None
    worker_task: asyncio.Task[None] | None = None
    try:
        cfg = federation_config(ray_head, env.client.service_client.config.target_host)
        # The submitter signs with its key, registered here (docs/DESIGN.md, "User → home"); the
        # session's user key directory if a stack set one, never the real ~/.config.
        os.environ.setdefault(USER_KEY_DIR_ENV, str(root / "users"))
        register_user(cfg, current_user(), ["admin"])
        config_file = root / "clusters.json"
        config_file.write_text(cfg.model_dump_json(indent=2))
        # The worker here relays logs to the home's S3: the home's credentials only.
        os.environ.update(devstack.store_credentials(cfg, cfg.home))
        services = [
            devstack.s3_server(cfg, root),
            *(devstack.controller(config_file, cfg, c.name, root) for c in cfg.clusters),
        ]
        for svc in services:
            svc.start()
        for svc in services:
            await asyncio.to_thread(svc.wait_ready, 60)
        await asyncio.to_thread(devstack.ensure_buckets, cfg)
        # Its own SQLite store, whatever IRIS_STORE_URL says: this federation shares nothing.
        store = FederationStore(f"sqlite:///{root / 'federation.db'}")
        worker = build_worker(env.client, cfg, store)
        worker_task = asyncio.create_task(worker.run())
        await ensure_manager(env.client, cfg)
        yield RayFederation(config=cfg, iris=AsyncIrisClient(env.client, cfg))
    finally:
        if worker is not None:
            await worker.shutdown()
        if worker_task is not None:
            await asyncio.gather(worker_task, return_exceptions=True)
        for svc in reversed(services):
            await asyncio.to_thread(svc.stop)
        if store is not None:
            store.close()
        await env.shutdown()


async def test_a_federated_job_handed_off_to_a_ray_peer_runs_to_succeeded(
    ray_federation: RayFederation, ray_head: devstack.RayHeadSpec
) -> None:
    iris = ray_federation.iris
    job_id = await iris.submit(
        ["sh", "-c", 'echo "trained on $IRIS_CLUSTER ($IRIS_BACKEND_ID)"'],
        name="ray-e2e",
        device_type="h100",
        gpu_count=4,
    )
    final = await iris.wait(job_id, timeout_s=120)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.disposition == "queue" and final.cluster == "raypeer"
    states = [e.state for e in final.events]
    for expected in (JobState.QUEUED_HANDOFF, JobState.PENDING_HANDOFF, JobState.HANDED_OFF):
        assert expected in states, states
    logs = await iris.logs(job_id)
    assert "trained on raypeer (ray-h100)" in logs.data
    # Ray ran it exactly once, under the job's own id.
    ray = JobSubmissionClient(ray_head.address)
    sid = submission_id(job_id, 1)
    assert (await asyncio.to_thread(ray.get_job_info, sid)).status == RayStatus.SUCCEEDED
    assert [j.submission_id for j in await asyncio.to_thread(ray.list_jobs)].count(sid) == 1
