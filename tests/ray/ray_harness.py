"""Helpers for the Ray tests: backend entries on the session head (tests/rayhead.py) and a TCP proxy
to cut Ray off."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from rayhead import SCENARIOS, resource

from iris import devstack


def ray_backend(
    spec: devstack.RayHeadSpec,
    scenario: str,
    *,
    id: str = "ray-h100",
    address: str | None = None,
    gcs_address: str | None = None,
) -> dict[str, Any]:
    """A controller backend entry on the session head, using the scenario's own resource."""
    return {
        "id": id,
        "kind": "ray",
        "address": address or spec.address,
        "gcs_address": gcs_address or spec.gcs_address,
        "attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
        "devices": {"h100": SCENARIOS[scenario]},
        "ray_resources": {"h100": resource(scenario)},
        "cpu_slots": 4,
    }


class TcpProxy:
    """Forwards a loopback port to another; ``cut`` makes the target vanish (refused connections,
    live ones dropped) and ``restore`` brings it back on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = devstack.free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
