"""The placement tick's activity against real services: a Temporal dev server, a controller app
served by uvicorn in this process, and a SQLite federation store (helpers: placement_harness.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from placement_harness import PEER, Controller, Jobs, StandInJob, federation_config
from served import served
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from iris import devstack
from iris.config import FederationConfig
from iris.contract import SEARCH_ATTRIBUTE_KEYS
from iris.controller.app import create_app
from iris.store import FederationStore
from iris.temporal import data_converter


@pytest.fixture(scope="package")
async def temporal() -> AsyncIterator[WorkflowEnvironment]:
    """A Temporal dev server (visibility queries: the test server has none) for this directory's
    tests, stopped after them."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        search_attributes=SEARCH_ATTRIBUTE_KEYS,
        data_converter=data_converter(),
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def jobs(temporal: WorkflowEnvironment) -> AsyncIterator[Jobs]:
    queue = f"standin-{uuid.uuid4().hex}"
    async with Worker(temporal.client, task_queue=queue, workflows=[StandInJob]):
        yield Jobs(temporal.client, queue)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FederationStore]:
    s = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def config() -> FederationConfig:
    return federation_config(devstack.free_port(), devstack.free_port())


@pytest.fixture
async def controller(config: FederationConfig, tmp_path: Path) -> AsyncIterator[Controller]:
    """cw-a's controller app, served by uvicorn in this process on its configured port."""
    port = config.cluster(PEER).port
    app = create_app(config, PEER, tmp_path / "cw-a-state", key_dir=tmp_path / "keys", kill_grace_s=0.5)
    async with served(app, port):
        yield Controller(config, PEER)
