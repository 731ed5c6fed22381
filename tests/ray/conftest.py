"""A real local Ray head, started once per test session (see ray_harness.py for the helpers).

The head offers one custom resource per test scenario (``t-<scenario>/h100``), so tests sharing it
never see each other's jobs in their capacity, like clusters sharing one head in ``iris dev --ray``.
Only the head started here is stopped here: never ``ray stop``, which would end everyone's Ray.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# The controller tests' harness (real controller processes, configs, polling) is shared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from ray_harness import SCENARIOS, TcpProxy, local_head, resource

from iris import devstack


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devstack.RayHeadSpec]:
    resources = {resource(s): float(n) for s, n in SCENARIOS.items()}
    with local_head(resources, 4, tmp_path_factory.mktemp("ray")) as spec:
        yield spec


@pytest.fixture
async def ray_proxies(ray_head: devstack.RayHeadSpec) -> AsyncIterator[tuple[TcpProxy, TcpProxy]]:
    """(Jobs API proxy, GCS proxy) in front of the session head."""
    jobs, gcs = TcpProxy(ray_head.dashboard_port), TcpProxy(ray_head.gcs_port)
    await jobs.start()
    await gcs.start()
    try:
        yield jobs, gcs
    finally:
        await jobs.cut()
        await gcs.cut()
