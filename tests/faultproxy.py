"""An HTTP fault injector in front of a real controller (in the spirit of toxiproxy).

Forwards every request to the controller unchanged, except that it can refuse the next N
launches with 503 UNAVAILABLE — a peer outage at the exact moment of handoff, which timing alone
cannot produce reliably —, lose the reply to a request the controller has acted on, or go down
right after a given request, or answer a request late (``delays``: a slow controller, whose
tardiness makes the other clusters' reports of the same poll older by as much). The controller
behind it stays the real one and counts its own launches.

Faults at the connection level, as a dead host or a broken network shows them (no HTTP answer at
all): ``cut(...)`` lets the next matching request reach the controller (or not), then closes the
caller's connection without a byte of reply and refuses every connection from then on (the port
is closed: ``connect`` fails), in-flight ones cut too; ``refuse()`` does the latter at once, and
``heal()`` listens again.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

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
        # "METHOD /path-prefix" -> seconds every matching request waits before it is forwarded.
        self.delays: dict[str, float] = {}
        # The next request matching this (``cut``) has its connection closed without a reply
        # (after reaching the controller if ``_cut_forwards``), then every connection is refused
        # until ``heal()``.
        self._cut: str | None = None
        self._cut_forwards = True
        # Requests whose connection was cut, as "METHOD /path" (forwarded to the controller or not).
        self.cut_requests: list[str] = []
        # While set, the port is closed: no connection is accepted (ECONNREFUSED).
        self.refusing = False
        self.port: int | None = None
        # The connection of each caller, by its (host, port): a cut closes it without a reply.
        self._connections: dict[tuple[str, int], asyncio.Transport] = {}
        # Connections accepted so far.
        self.connections_made = 0
        self._http = httpx.AsyncClient(timeout=30)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        # Servers stopped by ``refuse()``, still finishing their shutdown.
        self._stopping: list[asyncio.Task[None]] = []

    def cut(self, request: str = "POST /v1/jobs", *, forward: bool = True) -> None:
        """The next request ``request`` ("METHOD /path", or every path under it if it ends with
        "/") reaches the controller (unless ``forward`` is False), then its connection is closed
        without a byte of reply, and from then on every connection is refused, until ``heal()``:
        the caller cannot learn what became of it."""
        self._cut = request
        self._cut_forwards = forward

    def refuse(self) -> None:
        """The controller's host goes away: the port is closed, connections in flight are cut."""
        self.refusing = True
        server = self._server
        if server is not None:
            for listener in server.servers:
                listener.close()
            server.should_exit = True
        if self._task is not None:
            self._stopping.append(self._task)
        self._server, self._task = None, None
        for transport in list(self._connections.values()):
            transport.abort()

    async def heal(self) -> None:
        """Listen again, forwarding every request (a pending ``cut`` is dropped)."""
        self._cut = None
        stopping, self._stopping = self._stopping, []
        for task in stopping:
            with contextlib.suppress(Exception):
                await task
        self.refusing = False
        if self._server is None:
            assert self.port is not None, "the proxy was never started"
            await self.start(self.port)

    async def _cut_connection(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], body: bytes, request_line: str
    ) -> None:
        self._cut = None
        self.cut_requests.append(request_line)
        if self._cut_forwards:
            with contextlib.suppress(httpx.HTTPError):
                await self._forward(scope, body)
        client = scope.get("client")
        transport = self._connections.get(tuple(client)) if client else None
        self.refuse()
        if transport is not None:
            transport.abort()
        # The server notices the connection is gone: this request then ends without a reply.
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _forward(self, scope: Scope, body: bytes) -> httpx.Response:
        path = scope.get("raw_path") or scope["path"].encode()
        url = self.upstream + path.decode()
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        return await self._http.request(scope["method"], url, content=body, headers=headers)

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
        request_line = f"{scope['method']} {scope['path']}"
        self.requests[request_line] += 1
        if self._cut is not None and _matches(request_line, self._cut):
            await self._cut_connection(scope, receive, body, request_line)
            return
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
        delay = next((d for k, d in self.delays.items() if request_line.startswith(k)), 0.0)
        if delay > 0:
            await asyncio.sleep(delay)  # not a wait: the injected delay
        lose = next((k for k, n in self.lose_replies.items() if n > 0 and request_line.startswith(k)), None)
        try:
            resp = await self._forward(scope, body)
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
        self.port = port
        config = uvicorn.Config(
            self,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            http=_tracked_protocol(self),
        )
        # The socket is bound here, so a port another process took meanwhile is an OSError the stack's
        # start retries on fresh ports (uvicorn would say it with sys.exit, which ends the fixture).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                try:
                    self._task.result()
                except SystemExit as exc:  # uvicorn's failed start
                    raise OSError(f"the fault proxy could not start on port {port}") from exc
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Stop at once: uvicorn's graceful shutdown would wait for the requests in flight, and a
        watcher's long poll of the change feed (forwarded, and still waiting at the controller
        after the worker stopped) held every stack's teardown for ~18 s."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        for transport in list(self._connections.values()):
            transport.abort()
        for task in [*self._stopping, *([self._task] if self._task is not None else [])]:
            with contextlib.suppress(Exception):
                await task
        await self._http.aclose()


def _matches(request_line: str, pattern: str) -> bool:
    """``pattern`` names this request exactly, or a path prefix ending with "/" (a launch,
    ``POST /v1/jobs``, is not its terminates', ``POST /v1/jobs/<id>/terminate``)."""
    return request_line == pattern or (pattern.endswith("/") and request_line.startswith(pattern))


class _Server(uvicorn.Server):
    """A proxy stopped and started again by a test leaves the process's signal handlers alone
    (uvicorn's own would capture SIGINT and SIGTERM while it runs, and restore them out of order)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _tracked_protocol(proxy: FaultProxy) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, telling ``proxy`` each caller's connection (so a cut can close
    it without a reply) and closing at once any connection accepted while the proxy refuses."""

    class Tracked(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if proxy.refusing:
                transport.abort()
            elif self.client is not None:
                proxy.connections_made += 1
                proxy._connections[self.client] = transport

        def connection_lost(self, exc: Exception | None) -> None:
            if self.client is not None and proxy._connections.get(self.client) is self.transport:
                del proxy._connections[self.client]
            super().connection_lost(exc)

    return Tracked
