"""ClientPool: the worker's activities share one controller client per cluster, so a burst of job
ends reuses open connections instead of connecting (and reading the signing key) per request
(docs/DESIGN.md, "Controller costs"). Against a real socket server that counts connections."""

from __future__ import annotations

import asyncio
import json

from iris.controller.client import ClientPool, ControllerClient


class CountingServer:
    """An HTTP/1.1 server on loopback answering ``GET /v1/health`` with keep-alive; counts the
    connections it accepted."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CountingServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        body = json.dumps({"status": "ok", "cluster": "c"}).encode()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"GET /v1/health "):
                    break
                self.requests += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def recording_pool(
    server: CountingServer, renew_s: float = 60.0
) -> tuple[ClientPool, list[ControllerClient]]:
    """A pool of clients of ``server``, and the list of every client it made."""
    made: list[ControllerClient] = []

    def make(cluster: str) -> ControllerClient:
        made.append(ControllerClient(server.url))
        return made[-1]

    return ClientPool(make, renew_s=renew_s), made


async def test_one_client_per_cluster_reuses_its_connection() -> None:
    async with CountingServer() as server:
        pool, made = recording_pool(server)
        for _ in range(20):
            async with pool.borrow("c") as client:
                assert (await client.health()).cluster == "c"
        # Twenty requests in turn: one client, one connection.
        assert (len(made), server.requests, server.connections) == (1, 20, 1)

        async def one() -> None:
            async with pool.borrow("c") as client:
                await client.health()

        await asyncio.gather(*(one() for _ in range(10)))
        assert len(made) == 1 and server.requests == 30
        await pool.aclose()
    assert made[0]._http.is_closed


async def test_without_the_pool_each_request_connects() -> None:
    """The figure the pool removes: a client per request is a connection per request."""
    async with CountingServer() as server:
        for _ in range(5):
            async with ControllerClient(server.url) as client:
                await client.health()
        assert server.connections == 5


async def test_a_renewed_client_closes_the_old_one_once_its_borrowers_return() -> None:
    async with CountingServer() as server:
        pool, made = recording_pool(server, renew_s=0.0)  # every borrow renews
        async with pool.borrow("c") as first:
            async with pool.borrow("c") as second:
                assert second is not first
                # Still lent: the old client stays open and usable.
                assert not first._http.is_closed
                await first.health()
            assert second._http.is_closed is False  # the newest is kept for the next borrower
        assert first._http.is_closed
        await pool.aclose()
        assert all(c._http.is_closed for c in made)


async def test_a_client_that_cannot_be_made_is_not_lent_and_is_tried_again() -> None:
    calls = 0

    def make(cluster: str) -> ControllerClient:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError(cluster)
        return ControllerClient("http://127.0.0.1:9")

    pool = ClientPool(make)
    try:
        async with pool.borrow("c"):
            raise AssertionError("lent a client that was never made")
    except KeyError:
        pass
    async with pool.borrow("c") as client:
        assert client.base_url == "http://127.0.0.1:9"
    assert calls == 2
    await pool.aclose()
