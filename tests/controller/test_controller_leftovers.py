"""What ended runs leave behind (docs/DESIGN.md, "Controller costs"): runs that end together share
one scan of the process table, and each still has exactly its own leftovers killed."""

from __future__ import annotations

import asyncio
import os
import subprocess

from controller_harness import poll

from iris.controller.executors.process import RUN_ID_ENV, LeftoverSweeper


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
