"""The subject of tests/e2e/test_nothing_left_behind.py, run in a pytest process of its own (not
collected by the suite: its name does not start with ``test_``). It holds a whole stack with a Ray
head, a job running at home as a process and one running on a Ray-backed peer, says so in the file
``$IRIS_HOLD_MARKER``, and waits to be killed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from stack import Stack, wait_until

from iris.jobs import JobState

MARKER = os.environ.get("IRIS_HOLD_MARKER")


@pytest.mark.skipif(MARKER is None, reason="opt-in: run by tests/e2e/test_nothing_left_behind.py")
async def test_hold_a_stack_until_killed(ray_stack: Stack) -> None:
    assert MARKER is not None
    sleeper = ["python", "-c", "import time; time.sleep(3600)"]
    jobs = [
        await ray_stack.iris.submit(sleeper, name="held-at-home"),
        await ray_stack.iris.submit(
            sleeper, name="held-on-ray", device_type="h100", gpu_count=1, target_cluster="cw-rno2a"
        ),
    ]

    async def running() -> bool:
        states = [(await ray_stack.iris.describe(j)).state for j in jobs]
        return all(s is JobState.RUNNING for s in states)

    await wait_until(running, timeout=120, what="both jobs RUNNING")
    await asyncio.to_thread(Path(MARKER).write_text, " ".join(jobs))
    await asyncio.Event().wait()  # until this process is killed
