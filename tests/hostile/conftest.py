"""Fixtures of the hostile-input suite."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from hostile_peer import HostilePeer
from stack import Stack


@pytest.fixture(scope="module")
async def duplicate(stack: Stack) -> str:
    """A job that exists (and has ended), so submitting its name again is a duplicate."""
    job_id = await stack.iris.submit(
        ["true"], name=f"hostile-original-{uuid.uuid4().hex[:6]}", user="tester@example.com"
    )
    await stack.iris.wait(job_id, timeout_s=60)
    return job_id


@pytest.fixture(scope="module")
async def hostile_peer() -> AsyncIterator[HostilePeer]:
    peer = HostilePeer()
    await peer.start()
    try:
        yield peer
    finally:
        await peer.stop()
