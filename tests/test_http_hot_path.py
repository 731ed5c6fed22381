"""Every async HTTP request (the worker to the controllers, the watcher's long polls) goes through
httpcore, which asks which async library runs it by ``import sniffio``. Without sniffio installed
that import fails, and a failed import is not cached: each request searched every ``sys.path``
entry again, ~30 µs a call and 5% of the worker's CPU in a burst of job ends (docs/BENCHMARKS.md,
"A burst of ends"). sniffio is therefore a dependency; this checks it stays one."""

from __future__ import annotations

import asyncio
import importlib.machinery
from typing import Any

import pytest
from httpcore._synchronization import current_async_library


def test_httpcore_never_searches_the_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    searched: list[str] = []
    original = importlib.machinery.PathFinder.find_spec

    def counting(name: str, path: Any = None, target: Any = None) -> Any:
        searched.append(name)
        return original(name, path, target)

    async def detect() -> list[str]:
        current_async_library()  # a first call may import sniffio itself
        searched.clear()
        monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", staticmethod(counting))
        try:
            return [current_async_library() for _ in range(50)]
        finally:
            monkeypatch.undo()

    assert asyncio.run(detect()) == ["asyncio"] * 50
    assert searched == []
