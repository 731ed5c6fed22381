"""``signal_sandbox`` walks a sandbox's own PID namespace only (docs/DESIGN.md, "Workspace
bundles": one mount namespace per sandboxed job). A job's process is first the shell that mounts
its overlay, whose child (``mount``) lives in the controller's PID namespace: a signal then must go
to that job's process group, never to every process of the controller's namespace."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from controller_harness import poll

from iris.controller.sandbox import _children, signal_sandbox


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_a_shell_with_a_child_in_our_namespace_is_signalled_as_a_group_and_nothing_else() -> None:
    bystander = await asyncio.create_subprocess_exec("sleep", "60")  # another process of this namespace
    # As the controller starts a job: its own session; a shell whose child runs in this namespace.
    job = await asyncio.create_subprocess_exec("sh", "-c", "sleep 60 & wait", start_new_session=True)
    try:
        await poll(lambda: asyncio.to_thread(_children, job.pid), bool, what="the shell's child")
        signal_sandbox(job.pid, signal.SIGTERM)
        assert await asyncio.wait_for(job.wait(), 10) == -signal.SIGTERM
        # Still running, not a zombie waiting to be reaped (the walk would have ended it too, and
        # this test's own process with it).
        assert _state(bystander.pid) in {"S", "R"}, "a process outside the job was signalled"
    finally:
        for proc in (job, bystander):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
