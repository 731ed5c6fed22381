"""Preemption on the process backend (docs/DESIGN.md, "Preemption"), in process: a real Executor
with its SQLite store and real job processes. A job that waits for capacity lower-band runs hold
preempts the lowest-band ones that lose the least work, never one back from a preemption within
the cluster's preempt_exempt_s (SIGTERM, the cluster's grace, SIGKILL); they end PREEMPTED with
who preempted them and when, and the waiting job starts. ``held_by_band`` in the capacity report
matches the RUNNING jobs after every change the change feed shows."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from feedcheck import FeedChecked

from iris.config import BackendConfig, ClusterConfig
from iris.controller.executors.core import Executor
from iris.controller.models import ControllerJobState as S
from iris.controller.models import LaunchRequest
from iris.controller.state import StateStore, now_ms
from iris.policy.models import Band, DeviceRequest

GRACE_S = 1.0
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
# A job that ignores SIGTERM: only the SIGKILL after the grace stops it.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
    "time.sleep(120)",
]


class Checked(FeedChecked):
    """An Executor whose capacity report is compared with its RUNNING jobs after every change."""

    def held(self) -> dict[int, dict[str, int]]:
        (report,) = self.executor.availability()
        assert report.availability is not None
        return {int(h.band): dict(h.amounts) for h in report.availability.held_by_band}

    def check(self) -> None:
        """Read the feed since the last check; after it, the report must match the job table."""
        self.read_feed()
        held = self.held()
        assert held == self.expected()
        (report,) = self.executor.availability()
        assert report.availability is not None
        for token, total in report.availability.total_amounts.items():
            used = sum(a.get(token, 0) for a in held.values())
            assert report.availability.amounts[token] == max(0, total - used - self.promised(token))
        self.checks += 1

    def launch(
        self, job_id: str, band: Band, gpus: int, command: list[str] = SLEEP, *, preemptions: int = 0
    ) -> None:
        self.executor.launch(
            LaunchRequest(
                job_id=job_id,
                command=command,
                device=DeviceRequest(type="gpu", variant="h100", count=gpus),
                band=band,
                user="alice",
                requester="home",
                nonce=f"{job_id}-n1",
                backend_id="gpu",
                preemptions=preemptions,
            )
        )
        self.check()


@contextlib.asynccontextmanager
async def checked_executor(
    tmp_path: Path, grace_s: float = GRACE_S, exempt_s: float = 300.0
) -> AsyncIterator[Checked]:
    cluster = ClusterConfig(
        name="peer",
        port=1,
        run_as=pwd.getpwuid(os.geteuid()).pw_name,
        preempt_grace_s=grace_s,
        preempt_exempt_s=exempt_s,
        backends=[BackendConfig(id="gpu", devices={"h100": 8}, cpu_slots=2)],
    )
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    executor = Executor(cluster, state_dir, StateStore(state_dir), kill_grace_s=1.0)
    executor.recover()
    checked = Checked(executor, "gpu")
    watcher = asyncio.get_running_loop().create_task(checked.watch())
    try:
        yield checked
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await executor.shutdown()
        checked.check()
        executor.store.close()


async def _started(c: Checked, *job_ids: str) -> None:
    await c.until(f"{job_ids} running", lambda: all(c.state(j) is S.RUNNING for j in job_ids))
    # Distinct start times: the youngest is well defined (a later start is in a later millisecond).
    latest = max(c.executor.get(j).started_ms or 0 for j in job_ids)
    await c.until("the clock to pass their start", lambda: now_ms() > latest)


def _preempted(c: Checked) -> set[str]:
    """The jobs a preemption was decided for: the note is recorded before the first signal, at the
    launch that decides it (the executor schedules in launch; iris/controller/executors/process.py)."""
    return {j.job_id for j in c.executor.jobs.values() if j.preempted is not None}


async def test_interactive_job_preempts_every_batch_job_it_needs(tmp_path: Path) -> None:
    async with checked_executor(tmp_path) as c:
        for i in range(4):
            c.launch(f"batch/{i}", Band.BATCH, 2)
            await _started(c, f"batch/{i}")
        c.launch("urgent/train", Band.INTERACTIVE, 8)
        assert c.state("urgent/train") is S.PENDING
        await c.until("the interactive job runs", lambda: c.state("urgent/train") is S.RUNNING)
        for i in range(4):
            job = c.executor.get(f"batch/{i}")
            assert job.state is S.PREEMPTED
            assert job.error is not None and job.error.startswith("preempted by urgent/train at ")
            assert job.exit_code is None
            assert [t.state for t in job.tasks] == [S.PREEMPTED]
            # Stored as such: a restarted controller reports it the same.
            (stored,) = [j for j in c.executor.store.load_all() if j.job_id == job.job_id]
            assert stored.state is S.PREEMPTED and stored.error == job.error
        c.check()
        # The change feed carried each preemption, and the listing shows it.
        assert c.preemptions_seen == {f"batch/{i}" for i in range(4)}
        listed = c.executor.page(0, 100, lambda _: True).jobs
        assert sorted(j.job_id for j in listed if j.state is S.PREEMPTED) == [f"batch/{i}" for i in range(4)]
        assert c.held() == {2: {"h100": 8}}
        # The watcher looked all along, not once (how many changes the feed coalesces varies: runs
        # here saw 18 looks, others more than 20).
        assert c.checks >= 10


async def test_the_lowest_band_least_work_victims(tmp_path: Path) -> None:
    """4 chips wanted, none free: the two younger of three 2-chip batch jobs (the least work lost),
    never the interactive one (older than the youngest batch job, but of a higher band)."""
    async with checked_executor(tmp_path) as c:
        c.launch("old/2a", Band.BATCH, 2)
        await _started(c, "old/2a")
        c.launch("old/2b", Band.BATCH, 2)
        await _started(c, "old/2b")
        c.launch("mid/interactive", Band.INTERACTIVE, 2)
        await _started(c, "mid/interactive")
        c.launch("young/2c", Band.BATCH, 2)
        await _started(c, "young/2c")
        c.launch("prod/a", Band.PRODUCTION, 4)
        await c.until("prod/a runs", lambda: c.state("prod/a") is S.RUNNING)
        assert {j: c.state(j) for j in ("old/2a", "old/2b", "mid/interactive", "young/2c")} == {
            "old/2a": S.RUNNING,
            "old/2b": S.PREEMPTED,
            "mid/interactive": S.RUNNING,
            "young/2c": S.PREEMPTED,
        }
        # An interactive job never preempts interactive or production work, only batch: the one
        # batch job left (2 chips) cannot make room for 4, so nothing is preempted in vain.
        c.launch("inter/b", Band.INTERACTIVE, 4)
        assert _preempted(c) == {"old/2b", "young/2c"}
        assert c.state("inter/b") is S.PENDING and c.state("old/2a") is S.RUNNING
        assert c.state("mid/interactive") is S.RUNNING and c.state("prod/a") is S.RUNNING
        assert c.held() == {1: {"h100": 4}, 2: {"h100": 2}, 3: {"h100": 2}}


async def test_batch_preempts_nothing_and_equal_bands_do_not_preempt(tmp_path: Path) -> None:
    async with checked_executor(tmp_path) as c:
        c.launch("batch/a", Band.BATCH, 4)
        c.launch("batch/b", Band.BATCH, 4)
        await _started(c, "batch/a", "batch/b")
        c.launch("batch/c", Band.BATCH, 2)
        c.launch("inter/a", Band.INTERACTIVE, 8)
        await c.until("both batch jobs preempted", lambda: c.state("batch/b") is S.PREEMPTED)
        await c.until("inter/a runs", lambda: c.state("inter/a") is S.RUNNING)
        assert c.state("batch/a") is S.PREEMPTED
        # Another interactive job waits behind the first; neither batch job preempts anything.
        c.launch("inter/b", Band.INTERACTIVE, 2)
        assert _preempted(c) == {"batch/a", "batch/b"}
        assert c.state("inter/a") is S.RUNNING
        assert c.state("inter/b") is S.PENDING and c.state("batch/c") is S.PENDING
        assert c.held() == {2: {"h100": 8}}


async def test_a_victim_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    grace = 2.0
    async with checked_executor(tmp_path, grace_s=grace) as c:
        c.launch("batch/stubborn", Band.BATCH, 8, STUBBORN)
        await _started(c, "batch/stubborn")
        log = c.executor.backends["gpu"].log_path(c.executor.get("batch/stubborn"))
        await c.until("the SIGTERM handler is set", lambda: log.exists() and "up" in log.read_text())
        loop = asyncio.get_running_loop()
        asked = loop.time()
        c.launch("prod/now", Band.PRODUCTION, 8)
        await c.until("prod/now runs", lambda: c.state("prod/now") is S.RUNNING, timeout=grace + 10)
        waited = loop.time() - asked
        # SIGTERM was ignored: the capacity came back only with the SIGKILL after the grace.
        assert waited >= grace - 0.1
        victim = c.executor.get("batch/stubborn")
        assert victim.state is S.PREEMPTED and victim.tasks[0].exit_code == 128 + 9


@pytest.mark.parametrize("grace_s", [0.0])
async def test_preemption_with_no_grace_restarts_nothing_twice(tmp_path: Path, grace_s: float) -> None:
    """A zero grace: SIGKILL at once; the preempted job is not started again here (the home side
    re-queues it as a new attempt), and the capacity goes to the waiting job only."""
    async with checked_executor(tmp_path, grace_s=grace_s) as c:
        c.launch("batch/x", Band.BATCH, 8)
        await _started(c, "batch/x")
        c.launch("prod/y", Band.PRODUCTION, 8)
        await c.until("prod/y runs", lambda: c.state("prod/y") is S.RUNNING)
        assert c.state("batch/x") is S.PREEMPTED
        assert c.executor.get("batch/x").attempts == 1


async def test_cpu_slots_are_reclaimed_like_chips(tmp_path: Path) -> None:
    """CPU slots are a token like chips (docs/DESIGN.md, "Vocabulary"): a batch CPU job holding both
    slots is preempted for an interactive one; the report's ``cpu`` held by band follows."""
    async with checked_executor(tmp_path) as c:
        ex = c.executor

        def cpu_held() -> dict[int, int]:
            (report,) = ex.availability()
            assert report.availability is not None
            return {
                int(h.band): h.amounts["cpu"] for h in report.availability.held_by_band if "cpu" in h.amounts
            }

        def launch_cpu(job_id: str, band: Band, replicas: int) -> None:
            ex.launch(
                LaunchRequest(
                    job_id=job_id,
                    command=SLEEP,
                    device=DeviceRequest(replicas=replicas),
                    band=band,
                    user="alice",
                    requester="home",
                    nonce=f"{job_id}-n1",
                    backend_id="gpu",
                )
            )

        launch_cpu("cpu/batch", Band.BATCH, 2)
        await _started(c, "cpu/batch")
        assert cpu_held() == {3: 2}
        launch_cpu("cpu/inter", Band.INTERACTIVE, 1)
        await c.until("cpu/inter runs", lambda: c.state("cpu/inter") is S.RUNNING)
        assert c.state("cpu/batch") is S.PREEMPTED
        assert [t.state for t in ex.get("cpu/batch").tasks] == [S.PREEMPTED, S.PREEMPTED]
        assert cpu_held() == {2: 1}


async def test_a_preempted_job_stays_preempted_across_a_restart(tmp_path: Path) -> None:
    async with checked_executor(tmp_path) as c:
        c.launch("batch/r", Band.BATCH, 8)
        await _started(c, "batch/r")
        c.launch("prod/r", Band.PRODUCTION, 8)
        await c.until("prod/r runs", lambda: c.state("prod/r") is S.RUNNING)
        note = c.executor.get("batch/r").error
    state_dir = tmp_path / "state"
    cluster = c.executor.cluster
    again = Executor(cluster, state_dir, StateStore(state_dir), kill_grace_s=1.0)
    try:
        again.recover()
        job = again.get("batch/r")
        assert (job.state, job.error) == (S.PREEMPTED, note)
        assert again.changes(None, 100, lambda _: True).resync
        listed = {j.job_id: j.state for j in again.page(0, 100, lambda _: True).jobs}
        assert listed["batch/r"] is S.PREEMPTED
    finally:
        await again.shutdown()
        again.store.close()


@pytest.mark.parametrize(("exempt_s", "victim"), [(300.0, "batch/old"), (0.0, "batch/back")])
async def test_a_job_back_from_a_preemption_is_exempt(tmp_path: Path, exempt_s: float, victim: str) -> None:
    """The youngest batch job is an attempt that was preempted once already (its launch says so):
    within the cluster's preempt_exempt_s it is no victim, so the older batch job goes although it
    loses more work (docs/DESIGN.md, "Preemption": no churn). With no exemption, the least work
    lost: the younger one."""
    async with checked_executor(tmp_path, exempt_s=exempt_s) as c:
        c.launch("batch/old", Band.BATCH, 4)
        await _started(c, "batch/old")
        c.launch("batch/back", Band.BATCH, 4, preemptions=1)
        await _started(c, "batch/back")
        c.launch("prod/p", Band.PRODUCTION, 4)
        await c.until("prod/p runs", lambda: c.state("prod/p") is S.RUNNING)
        assert _preempted(c) == {victim}


async def test_a_head_waiting_for_an_exempt_run_preempts_it_when_the_exemption_ends(tmp_path: Path) -> None:
    """Only an exempt batch run holds what the interactive head needs: nothing is preempted, the
    report says the run's chips are exempt, and when the exemption ends (no other event) the head
    preempts it and starts."""
    exempt_s = 2.0
    async with checked_executor(tmp_path, exempt_s=exempt_s) as c:
        c.launch("batch/back", Band.BATCH, 8, preemptions=1)
        await _started(c, "batch/back")
        started = c.executor.get("batch/back").started_ms or 0
        c.launch("prod/p", Band.INTERACTIVE, 8)
        assert c.state("prod/p") is S.PENDING and not _preempted(c)
        (report,) = c.executor.availability()
        assert report.availability is not None
        assert [(int(h.band), h.amounts) for h in report.availability.exempt_by_band] == [(3, {"h100": 8})]
        await c.until("prod/p runs", lambda: c.state("prod/p") is S.RUNNING, timeout=exempt_s + 10)
        assert c.state("batch/back") is S.PREEMPTED
        # Decided once the exemption was over (the note's time, to the centisecond).
        note = c.executor.get("batch/back").preempted or ""
        at = datetime.strptime(note.split(" at ")[-1], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        assert at.timestamp() * 1000 >= started + exempt_s * 1000 - 10
        (report,) = c.executor.availability()
        assert report.availability is not None and report.availability.exempt_by_band == []


async def test_a_production_head_does_not_wait_for_an_exemption(tmp_path: Path) -> None:
    """The most protected band overrides the exemption (docs/DESIGN.md, "Preemption"): a
    production head preempts the exempt batch run at once, while a non-exempt batch run of the
    same size would have been taken first."""
    async with checked_executor(tmp_path, exempt_s=600.0) as c:
        c.launch("batch/back", Band.BATCH, 8, preemptions=1)
        await _started(c, "batch/back")
        c.launch("prod/p", Band.PRODUCTION, 8)
        await c.until("prod/p runs", lambda: c.state("prod/p") is S.RUNNING, timeout=20)
        assert c.state("batch/back") is S.PREEMPTED
