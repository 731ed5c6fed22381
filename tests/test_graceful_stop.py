"""SIGTERM to a test run tears its session fixtures down (tests/graceful.py): nothing is orphaned."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
from stack import wait_until

TESTS = Path(__file__).resolve().parent

SUBJECT = """
import asyncio
from pathlib import Path

import pytest

OUT = Path({out!r})


@pytest.fixture(scope="session")
async def child():
    proc = await asyncio.create_subprocess_exec("sleep", "1000")
    (OUT / "pid").write_text(str(proc.pid))
    yield proc
    proc.terminate()
    await proc.wait()
    (OUT / "torn-down").write_text("yes")


async def test_runs_until_stopped(child):
    await asyncio.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_sigterm_tears_session_fixtures_down(tmp_path: Path) -> None:
    subject = tmp_path / "test_subject.py"
    subject.write_text(SUBJECT.format(out=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-q", "-p", "graceful", "-p", "no:cacheprovider",
        "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=session",
        "-o", "asyncio_default_test_loop_scope=session", "--rootdir", str(tmp_path), str(subject),
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    pid_file = tmp_path / "pid"
    pid: int | None = None
    try:

        async def started() -> bool:
            return pid_file.exists() and pid_file.read_text() != ""

        await wait_until(started, timeout=60, what="the subject's fixture to start its child")
        pid = int(pid_file.read_text())
        run.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(run.communicate(), 60)
        assert (tmp_path / "torn-down").exists(), out.decode()
        assert not alive(pid)
        assert run.returncode != 0  # interrupted, not passed
    finally:
        if run.returncode is None:
            run.kill()
            await run.wait()
        if pid is not None and alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_suite_loads_the_plugin(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("graceful")
