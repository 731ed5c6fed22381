"""A fake cluster controller for the hostile-report tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from iris import devstack


class HostilePeer:
    """A fake cluster controller answering ``/v1/backends`` with whatever bytes a test sets."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        self.requests = 0
        self.port = devstack.free_port()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        self.requests += 1
        if scope["path"] == "/v1/health":
            status, body = 200, b'{"status":"ok","cluster":"cw-rno2a"}'
        else:
            status, body = self.status, self.body
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def start(self) -> None:
        config = uvicorn.Config(self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        async with asyncio.timeout(30):
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
