"""Nothing a test process started outlives it, however it ends (issue 25; tests/graceful.py,
iris/reaper.py): a pytest process that holds a running stack (the Temporal server, both emulators,
three controllers, a Ray head, a job running at home as a process and one running on Ray) is killed
with SIGKILL, so no teardown runs; 30 s later, none of the processes it had started is alive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from stack import PROJECT_ROOT, wait_until

from iris import reaper

SUBJECT = Path(__file__).with_name("subject_holds_a_stack.py")


def tree_of(pid: int) -> dict[int, tuple[int, str]]:
    """Every process below ``pid``: pid -> (start time, command line)."""
    procs = reaper.snapshot()
    found: dict[int, tuple[int, str]] = {}
    for p in reaper.descendants({pid}, procs):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[p] = (procs[p].start, cmd.strip())
    return found


def still_alive(tree: dict[int, tuple[int, str]]) -> dict[int, str]:
    procs = reaper.snapshot()
    return {pid: cmd for pid, (start, cmd) in tree.items() if pid in procs and procs[pid].start == start}


async def test_a_killed_test_process_leaves_no_service_or_job_running(tmp_path: Path) -> None:
    marker = tmp_path / "held"
    env = {**os.environ, "IRIS_HOLD_MARKER": str(marker)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subject = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
        "--basetemp", str(tmp_path / "subject"), str(SUBJECT),
        cwd=PROJECT_ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    tree: dict[int, tuple[int, str]] = {}
    try:

        async def holding() -> bool:
            if subject.returncode is not None:
                out = await subject.stdout.read() if subject.stdout else b""
                raise AssertionError(f"the subject ended ({subject.returncode}):\n{out.decode()}")
            return marker.exists() and marker.read_text() != ""

        await wait_until(holding, timeout=240, interval=0.5, what="the subject to hold its stack")
        tree = tree_of(subject.pid)
        commands = " ".join(cmd for _, cmd in tree.values())
        # What it holds: the Temporal server, both emulators, three controllers, a Ray head (its
        # raylet), and the two jobs' processes.
        for part in ("temporal", "moto.server", "fake-gcs-server", "raylet", "time.sleep(3600)"):
            assert part in commands, f"{part} not among the subject's processes"
        assert commands.count("-m iris.controller") >= 3
        assert commands.count("time.sleep(3600)") >= 2, "both jobs' processes"

        subject.kill()  # SIGKILL: no fixture teardown, no atexit
        await subject.wait()

        async def none_left() -> bool:
            return not still_alive(tree)

        await wait_until(none_left, timeout=30, interval=0.5, what="every process of the subject to end")
    finally:
        if subject.returncode is None:
            subject.kill()
            await subject.wait()
        for pid in still_alive(tree):  # a failure must not leave them to the rest of the suite
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
