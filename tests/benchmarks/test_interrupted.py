"""A stack benchmark stopped by a signal leaves nothing running (benchmarks/harness.py, ``run_main``).

``uv run python -m benchmarks.X`` stopped by ``pkill -f benchmarks.X`` gets SIGTERM twice: ``uv``
passes its own on to the driver. Before ``run_main`` ignored the second one, it could cancel the
stack's stop halfway: three controllers, moto and fake-gcs-server were left with parent 1, still
holding their jobs' sandbox uids, and the next run on the machine found one uid short (1,999 of
2,000 jobs ran). A driver killed outright is covered by the watchdog of iris/reaper.py, which
each benchmark now starts beside itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from iris.reaper import ProcInfo, descendants, read_proc, snapshot

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = b"iris.controller"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(procs: list[ProcInfo]) -> list[ProcInfo]:
    return [p for p in procs if (now := read_proc(p.pid)) is not None and now.start == p.start]


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"never {what}")


STOP_IN_THREE_STEPS = """
import asyncio, os, signal
from benchmarks.harness import run_main

async def main() -> int:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)
    finally:
        for step in range(3):
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # as uv passes its own on, mid-stop
            await asyncio.sleep(0.1)
            print("stopped", step, flush=True)
    return 0

run_main(main)
"""


def test_a_second_sigterm_during_the_stop_does_not_cut_it_short() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STOP_IN_THREE_STEPS],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout.split("\n")[:3] == ["stopped 0", "stopped 1", "stopped 2"], done.stdout


def test_a_driver_killed_outright_leaves_no_service_running(tmp_path: Path) -> None:
    """SIGKILL skips the stop: the watchdog beside the driver ends what it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale", "--smoke", "--source", "worktree"],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # Its stack and worker are up once it submits its first jobs (the watchdog records the
        # driver's descendants every half second, so services seconds old are on its list). A run
        # that ends before that fails the count below; one that hangs, pytest-timeout.
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            if b"submitting" in line:
                break
        procs = snapshot()
        started = [procs[pid] for pid in descendants({proc.pid}, procs) if pid in procs]
        assert sum(CONTROLLER in cmdline(p.pid) for p in started) == 3, "its stack never came up"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for("stopped every service", lambda: not alive(started), timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
