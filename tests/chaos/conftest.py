"""The chaos directory: the 1000-iteration cancel race (always run) and the chaos suite (opt-in).

The chaos suite takes several minutes on a 2-core machine, so ``uv run pytest`` skips it unless
``IRIS_CHAOS=1``; ``uv run python -m scripts.chaos`` runs the same thing standalone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The chaos engine lives in scripts/ (runnable on its own); make the project root importable.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHAOS_ENABLED = os.environ.get("IRIS_CHAOS") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: the multi-minute chaos suite; runs only with IRIS_CHAOS=1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CHAOS_ENABLED:
        return
    skip = pytest.mark.skip(
        reason="opt-in: the chaos suite takes minutes: run it with IRIS_CHAOS=1 (docs/RELIABILITY.md)"
    )
    for item in items:
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)
