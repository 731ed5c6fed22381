"""A test run stopped with SIGTERM ends like one stopped with Ctrl-C: pytest tears the fixtures
down, so the processes the session started (controllers, emulators, the Ray head) do not outlive
it as orphans. A second SIGTERM ends the run at once."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
