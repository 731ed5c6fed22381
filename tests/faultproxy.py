"""An HTTP fault injector in front of a real controller (in the spirit of toxiproxy).

Forwards every request to the controller unchanged, except that it can refuse the next N
launches with 503 UNAVAILABLE — a peer outage at the exact moment of handoff, which timing alone
cannot produce reliably —, lose the reply to a request the controller has acted on, or go down
right after a given request. The controller behind it stays the real one and counts its own launches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.fail_launches = 0
        # While set, every request is answered 503: the controller is down as the federation sees it.
        self.down = False
        self.refused_launches = 0
        self.forwarded_launches = 0
        # Requests seen, by "METHOD /path" (query string left out).
        self.requests: Counter[str] = Counter()
        # "METHOD /path-prefix" -> how many of the next matching requests reach the controller
        # and have their reply lost: the caller gets 502 after the controller has acted.
        self.lose_replies: Counter[str] = Counter()
        self.lost_replies = 0
        # After the first reply to a request matching this "METHOD /path-prefix", go down.
        self.down_after: str | None = None
        self._http = httpx.AsyncClient(timeout=30)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.requests[f"{scope['method']} {scope['path']}"] += 1
        is_launch = scope["method"] == "POST" and scope["path"] == "/v1/jobs"
        if self.down or (is_launch and self.fail_launches > 0):
            if is_launch and not self.down:
                self.fail_launches -= 1
                self.refused_launches += 1
            payload = b'{"code":"UNAVAILABLE","message":"injected outage"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        if is_launch:
            self.forwarded_launches += 1
        request_line = f"{scope['method']} {scope['path']}"
        lose = next((k for k, n in self.lose_replies.items() if n > 0 and request_line.startswith(k)), None)
        path = scope.get("raw_path") or scope["path"].encode()
        url = self.upstream + path.decode()
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        try:
            resp = await self._http.request(scope["method"], url, content=body, headers=headers)
        except httpx.HTTPError:
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if lose is not None:
            self.lose_replies[lose] -= 1
            self.lost_replies += 1
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if self.down_after is not None and request_line.startswith(self.down_after):
            self.down_after = None
            self.down = True
        out_headers = [
            (k.encode(), v.encode())
            for k, v in resp.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")
        ]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
        await send({"type": "http.response.body", "body": resp.content})

    async def start(self, port: int) -> None:
        config = uvicorn.Config(self, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
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
        await self._http.aclose()
