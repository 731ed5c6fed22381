"""What ended runs leave behind (docs/DESIGN.md, "Controller costs"): runs that end together share
one scan of the process table, and each still has exactly its own leftovers killed; a scan reads no
live main process of another run; and a sandboxed run's end needs no scan at all, its PID namespace
having taken every process of the job with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
from controller_harness import poll, process_alive

from iris.config import BackendConfig, ClusterConfig
from iris.controller.executors.core import Executor
from iris.controller.executors.process import RUN_ID_ENV, LeftoverSweeper, ProcessBackend, kill_leftovers
from iris.controller.models import ControllerJobState as S
from iris.controller.models import LaunchRequest
from iris.controller.state import StateStore


def _sleeper(run_id: str, *, session: bool = True) -> subprocess.Popen[bytes]:
    env = {**os.environ, RUN_ID_ENV: run_id}
    return subprocess.Popen(["sleep", "300"], env=env, start_new_session=session)


def _environ_shows(procs: list[subprocess.Popen[bytes]], run_id: str) -> bool:
    """Whether each process's /proc environ already carries the run id. Popen returns once the
    child's exec has begun, and the kernel sets the new environment's bounds a little later: a scan
    in between reads an empty environ (CI run DD, three test processes on two cores, missed one)."""
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    for p in procs:
        with open(f"/proc/{p.pid}/environ", "rb") as f:
            if marker not in f.read().split(b"\0"):
                return False
    return True


async def test_runs_ending_together_share_scans_and_each_gets_its_own_leftovers_killed() -> None:
    sweeper = LeftoverSweeper()
    runs = {f"{os.getpid()}-{i:04d}-leftover-test": 1 + i % 3 for i in range(12)}
    procs = {run_id: [_sleeper(run_id) for _ in range(n)] for run_id, n in runs.items()}
    bystander = _sleeper("still-running", session=False)
    try:
        for run_id, run_procs in procs.items():
            await poll(
                lambda r=run_id, ps=run_procs: asyncio.to_thread(_environ_shows, ps, r),
                bool,
                timeout=30,
                what=f"{run_id}'s environment in /proc",
            )
        ids = list(runs)
        # Half ask at once; the other half while the first scan runs (they wait for the next one).
        first = [asyncio.create_task(sweeper.kill(r)) for r in ids[:6]]
        await asyncio.sleep(0)  # not a wait: one turn of the loop, so the first six reach the sweeper first
        second = [asyncio.create_task(sweeper.kill(r)) for r in ids[6:]]
        again = asyncio.create_task(sweeper.kill(ids[0]))  # asked twice: one answer for both
        counts = await asyncio.gather(*first, *second)
        assert dict(zip(ids, counts, strict=True)) == runs
        assert await again in (runs[ids[0]], 0)
        for run_procs in procs.values():
            for p in run_procs:
                assert p.wait(timeout=10) == -9
        assert bystander.poll() is None, "another run's process is never touched"
        assert await sweeper.kill("no-such-run") == 0
    finally:
        for p in [bystander, *(p for ps in procs.values() for p in ps)]:
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_a_skipped_pid_is_not_read_even_when_it_carries_the_run_id() -> None:
    """``skip`` names pids known to be of no asked run (other runs' live main processes): their
    environment is not read, so not even a matching one is killed."""
    run_id = f"{os.getpid()}-skip-test"
    skipped, swept = _sleeper(run_id), _sleeper(run_id)
    try:
        await poll(
            lambda: asyncio.to_thread(_environ_shows, [skipped, swept], run_id),
            bool,
            timeout=30,
            what="the run id in /proc",
        )
        assert kill_leftovers({run_id}, skip={skipped.pid}) == {run_id: 1}
        assert swept.wait(timeout=10) == -9
        assert skipped.poll() is None
    finally:
        for p in (skipped, swept):
            if p.poll() is None:
                p.kill()
                p.wait()


def _carrying(run_id: str) -> list[int]:
    """Live processes whose environment carries ``run_id``."""
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0") and process_alive(int(name)):
                    found.append(int(name))
        except OSError:
            continue
    return found


# The job starts a child in a session of its own (out of its process group), carrying the job's
# environment and so its run id, and ends at once, leaving the child behind.
DAEMONIZES = ["/bin/sh", "-c", "setsid sleep 300 & echo spawned"]


@contextlib.asynccontextmanager
async def executor(tmp_path: Path, sandbox: Literal["auto", "off"]) -> AsyncIterator[Executor]:
    cluster = ClusterConfig(
        name="peer",
        port=1,
        run_as=pwd.getpwuid(os.geteuid()).pw_name,
        sandbox=sandbox,
        backends=[BackendConfig(id="cpu", cpu_slots=2)],
    )
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    ex = Executor(cluster, state_dir, StateStore(state_dir), kill_grace_s=1.0)
    ex.recover()
    try:
        yield ex
    finally:
        await ex.shutdown()
        ex.store.close()


async def _leaves_a_daemon(ex: Executor, job_id: str) -> tuple[LeftoverSweeper, str]:
    ex.launch(
        LaunchRequest(
            job_id=job_id, command=DAEMONIZES, user="alice", requester="home", nonce="n1", backend_id="cpu"
        )
    )

    async def state() -> S:
        return ex.get(job_id).state

    await poll(state, lambda s: s is S.SUCCEEDED, what="the job's end")
    backend = ex.backends["cpu"]
    assert isinstance(backend, ProcessBackend)
    return backend._leftovers, ex.get(job_id).run_id


async def test_an_unsandboxed_run_scans_for_what_it_left_and_kills_it(tmp_path: Path) -> None:
    async with executor(tmp_path, "off") as ex:
        sweeper, run_id = await _leaves_a_daemon(ex, "alice/daemon-unsandboxed")
        assert sweeper.asked == 1
        await poll(lambda: asyncio.to_thread(_carrying, run_id), lambda p: not p, what="the daemon's end")


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uid pool needs a root controller")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_a_sandboxed_run_needs_no_scan_its_pid_namespace_took_everything(tmp_path: Path) -> None:
    """No look through /proc at a sandboxed run's end (it costs O(processes on the host)), and
    still nothing of the job outlives it: the daemon died with the sandbox's PID namespace."""
    async with executor(tmp_path, "auto") as ex:
        backend = ex.backends["cpu"]
        assert isinstance(backend, ProcessBackend) and backend.sandbox.enabled
        sweeper, run_id = await _leaves_a_daemon(ex, "alice/daemon-sandboxed")
        assert "spawned" in (
            await asyncio.to_thread(backend.log_path(ex.get("alice/daemon-sandboxed")).read_text)
        )
        assert sweeper.asked == 0 and sweeper.scans == 0
        assert _carrying(run_id) == []
