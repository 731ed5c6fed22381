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
from controller_harness import job_pids, poll, process_alive

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


# The job starts a child in a session of its own (out of its process group), carrying the job's
# environment, says where it runs, and ends once released, leaving the child behind.
DAEMONIZES = [
    "/bin/sh",
    "-c",
    'setsid sleep 300 & echo "spawned in $PWD"; until [ -e release ]; do sleep 0.05; done',
]


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


async def _leaves_a_daemon(ex: Executor, job_id: str) -> tuple[LeftoverSweeper, set[int]]:
    """Run DAEMONIZES to its end; the sweeper of its backend, and the job's processes seen alive on
    the host before its end (its shell and the daemon)."""
    ex.launch(
        LaunchRequest(
            job_id=job_id, command=DAEMONIZES, user="alice", requester="home", nonce="n1", backend_id="cpu"
        )
    )
    backend = ex.backends["cpu"]
    assert isinstance(backend, ProcessBackend)
    log = backend.log_path(ex.get(job_id))

    async def logged() -> str:
        return await asyncio.to_thread(lambda: log.read_text() if log.exists() else "")

    text = await poll(logged, lambda t: "spawned in " in t, what="the job to start its daemon")
    # Both the shell and the daemon, seen from the host (a sandboxed job's pids are its namespace's).
    alive = await poll(lambda: asyncio.to_thread(job_pids, job_id), lambda p: len(p) >= 2, what="the daemon")
    (Path(text.split("spawned in ", 1)[1].splitlines()[0]) / "release").touch()

    async def state() -> S:
        return ex.get(job_id).state

    await poll(state, lambda s: s is S.SUCCEEDED, what="the job's end")
    return backend._leftovers, alive


def _still_alive(pids: set[int]) -> set[int]:
    return {p for p in pids if process_alive(p)}


async def test_an_unsandboxed_run_scans_for_what_it_left_and_kills_it(tmp_path: Path) -> None:
    async with executor(tmp_path, "off") as ex:
        sweeper, pids = await _leaves_a_daemon(ex, "alice/daemon-unsandboxed")
        assert sweeper.asked == 1
        await poll(lambda: asyncio.to_thread(_still_alive, pids), lambda p: not p, what="the daemon's end")


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uid pool needs a root controller")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_a_sandboxed_run_needs_no_scan_its_pid_namespace_took_everything(tmp_path: Path) -> None:
    """No look through /proc at a sandboxed run's end (it costs O(processes on the host)), and
    still nothing of the job outlives it: the daemon died with the sandbox's PID namespace."""
    async with executor(tmp_path, "auto") as ex:
        backend = ex.backends["cpu"]
        assert isinstance(backend, ProcessBackend) and backend.sandbox.enabled
        sweeper, pids = await _leaves_a_daemon(ex, "alice/daemon-sandboxed")
        assert sweeper.asked == 0 and sweeper.scans == 0
        assert _still_alive(pids) == set()
