"""How much a randomized test runs: everything it states in `uv run pytest`, a quarter in the fast
loop (`uv run pytest -m "not e2e"`, for which tests/conftest.py sets FAST before collection)."""

from __future__ import annotations

FAST = False


def scaled(stated: int) -> int:
    """Hypothesis examples or race iterations: ``stated`` in the full suite."""
    return max(10, stated // 4) if FAST else stated
