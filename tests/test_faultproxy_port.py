"""A fault proxy whose port another process took raises OSError, which the stack's start retries on
fresh ports (tests/conftest.py, ``running_stack``); uvicorn alone said it with sys.exit(3), which the
retry did not catch and which broke the test process's stack for every later test."""

from __future__ import annotations

import socket

import pytest
from faultproxy import FaultProxy


async def test_a_taken_port_is_an_oserror_and_a_free_one_serves() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    proxy = FaultProxy("http://127.0.0.1:9")
    try:
        with pytest.raises(OSError):
            await proxy.start(port)
    finally:
        taken.close()
        await proxy.stop()
    again = FaultProxy("http://127.0.0.1:9")
    try:
        await again.start(port)  # free now: the same proxy class binds and serves
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        await again.stop()
