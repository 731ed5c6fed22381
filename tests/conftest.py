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

import pytest
from stack import Backend, Stack, StackRunner

pytest_plugins = ["graceful"]


@pytest.fixture(scope="session")
def stack_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keys")


async def running_stack(root: Path, backend: Backend, key_dir: Path) -> AsyncIterator[Stack]:
    runner = StackRunner(root, backend, key_dir=key_dir)
    try:
        yield await runner.start()
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
