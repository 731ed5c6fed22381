"""Session fixtures: the real stack, started once (see tests/stack.py).

``stack`` is the stack whose GPU peers run their jobs as processes (``config/clusters.toml``); every
test module uses it. ``ray_stack`` is the same federation with those peers' backends on a real local
Ray head (``config/clusters-ray.toml``); it starts only when a test asks for it. A module whose
scheduling tests must pass whichever backend a peer uses (issue 6) overrides ``stack`` with
``stack_per_backend``: each of its tests then runs as ``test_x[process]`` and ``test_x[ray]``. Both
stacks share one key directory: the worker's activities find it through ``$IRIS_KEY_DIR``, one
value per test process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import budget
import pytest
from isolation import isolation_violations
from stack import Backend, Stack, StackRunner

pytest_plugins = ["graceful"]


def pytest_configure(config: pytest.Config) -> None:
    # Randomized tests run everything they state in `uv run pytest`, a quarter of it in the fast
    # loop (tests/budget.py), which then stays under a minute on two cores.
    if config.getoption("markexpr") == "not e2e":
        budget.FAST = True


# The `e2e` marker: the tests that need real services. `uv run pytest -m "not e2e"` is the fast,
# service-free subset (unit, property and workflow tests: tests/workflows runs JobWorkflow on
# Temporal's own test servers), `-m e2e` the rest; plain `uv run pytest` runs both. A test is e2e if
# - it uses (directly or through another fixture, e.g. `keys`, `restricted`, `duplicate`) a fixture
#   that starts real services: E2E_FIXTURES;
# - it is a store test on PostgreSQL (`stores[postgresql]`): it needs that server;
# - it lives in a directory of E2E_DIRS, whose tests start services in their own body or module
#   fixtures (`iris dev`, controller processes, the chaos stack) rather than through those fixtures.
E2E_FIXTURES = frozenset(
    {
        "stack",  # the whole federation: Temporal, emulators, controllers, a worker
        "process_stack",
        "ray_stack",  # the same, its GPU peers on a real Ray head
        "stack_per_backend",
        "open_controller",  # a controller process
        "ray_head",  # a local Ray head
        "ray_proxies",
        "postgres_admin",  # a PostgreSQL server
    }
)
E2E_DIRS = frozenset({"e2e", "controller", "chaos"})
TESTS_DIR = Path(__file__).resolve().parent


def needs_services(item: pytest.Item) -> bool:
    if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("stores") == "postgresql":
        return True
    path = item.path.resolve()
    if not path.is_relative_to(TESTS_DIR):
        return False
    relative = path.relative_to(TESTS_DIR)
    return len(relative.parts) > 1 and relative.parts[0] in E2E_DIRS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if needs_services(item):
            item.add_marker(pytest.mark.e2e)
        # Service-free but minutes long (months of simulated history): the full suite runs them.
        if budget.FAST and item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason="long: runs in the full suite (uv run pytest)"))


@pytest.fixture(scope="session")
def stack_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


async def running_stack(root: Path, backend: Backend, key_dir: Path) -> AsyncIterator[Stack]:
    runner = StackRunner(root, backend, key_dir=key_dir)
    try:
        stack = await runner.start()
        yield stack
        # After every test that used it: no process took another cluster's secret (acceptance 3 of
        # issue 16, tests/e2e/test_credential_isolation.py checks it mid-suite too).
        assert isolation_violations(stack) == []
    finally:
        await runner.stop()


@pytest.fixture(scope="session")
async def process_stack(tmp_path_factory: pytest.TempPathFactory, stack_keys: Path) -> AsyncIterator[Stack]:
    async for s in running_stack(tmp_path_factory.mktemp("stack"), "process", stack_keys):
        yield s


@pytest.fixture(scope="session")
async def ray_stack(tmp_path_factory: pytest.TempPathFactory, stack_keys: Path) -> AsyncIterator[Stack]:
    async for s in running_stack(tmp_path_factory.mktemp("stack-ray"), "ray", stack_keys):
        yield s


@pytest.fixture(scope="session")
def stack(process_stack: Stack) -> Stack:
    return process_stack


@pytest.fixture(scope="module", params=["process", "ray"])
def stack_per_backend(request: pytest.FixtureRequest) -> Stack:
    """Each backend's session stack in turn. Module-scoped, so a module's tests run in order on one
    backend, then on the other; sync, because getfixturevalue cannot run while the event loop does
    (async fixtures run inside it)."""
    backend_stack: Stack = request.getfixturevalue(f"{request.param}_stack")
    return backend_stack
