"""A test run ends without leaving anything behind.

Stopped with SIGTERM, it ends like one stopped with Ctrl-C: pytest tears the fixtures down, so the
processes the session started (controllers, emulators, the Ray head) stop in order. A second SIGTERM
ends the run at once. Killed outright (SIGKILL, a crash), its teardown never runs: the watchdog each
test process starts (iris/reaper.py) then kills every process it left behind within a second.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest

from iris import reaper


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    reaper.watch()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
