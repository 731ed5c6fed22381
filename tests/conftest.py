"""Session fixtures: the real stack, started once (see tests/stack.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from stack import Stack, StackRunner


@pytest.fixture(scope="session")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    runner = StackRunner(tmp_path_factory.mktemp("stack"))
    try:
        yield await runner.start()
    finally:
        await runner.stop()
