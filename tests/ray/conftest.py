"""The Ray backend tests run on the test process's one Ray head (``ray_head``, tests/conftest.py and
tests/rayhead.py), each scenario on a custom resource of its own (``t-<scenario>/h100``), so tests
sharing it never see each other's jobs in their capacity, like clusters sharing one head in
``iris dev --ray``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# The controller tests' harness (real controller processes, configs, polling) is shared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from ray_harness import TcpProxy

from iris import devstack


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
