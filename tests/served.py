"""A controller app served by uvicorn in the test's own process and event loop, on a given port
(tests/placement/conftest.py, tests/metrics/test_controller_metrics.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


@contextlib.asynccontextmanager
async def served(app: Any, port: int, within_s: float = 20) -> AsyncIterator[None]:
    """Serve ``app`` on 127.0.0.1:``port`` (its lifespan run) until the block ends."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    )
    # Signals stay the test runner's.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + within_s
    while not server.started:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "the controller did not start"
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
