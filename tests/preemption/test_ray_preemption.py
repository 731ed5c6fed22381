"""Preemption on the Ray backend (docs/DESIGN.md, "Preemption"), against a real local Ray head: a real
Executor (in this process, with its SQLite store) whose backend runs its jobs as Ray jobs. A job
that waits for devices lower-band jobs hold preempts the lowest-band ones that lose the least work;
Ray stops them (SIGTERM, then SIGKILL after the cluster's grace); they end PREEMPTED with who preempted
them and when, and the waiting job starts when their devices return. ``held_by_band`` in the
capacity report matches the RUNNING jobs after every change the change feed shows.

The head is the test process's one Ray head (``ray_head``, tests/rayhead.py), each test on a custom
resource of its own, so a test never sees another's jobs; each test stops what it left in Ray, and
only that. Job ids are unique across the session's Ray users: Ray keeps every submission id it was
given."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

# The Ray tests' helpers and the controller tests' harness are shared.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ray"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "controller"))

from controller_harness import cluster, federation, py, request
from feedcheck import FeedChecked
from ray.job_submission import JobStatus as RayStatus
from ray.job_submission import JobSubmissionClient
from ray_harness import ray_backend
from rayhead import PREEMPT_CHIPS, preempt_resource

from iris import devstack
from iris.config import FederationConfig
from iris.controller.errors import Unavailable
from iris.controller.executors.core import Executor
from iris.controller.executors.ray_jobs import RayBackend, submission_id
from iris.controller.models import ControllerJobState as S
from iris.controller.state import StateStore
from iris.policy.models import Band

BACKEND = "ray-h100"
# One Ray resource per test (tests/rayhead.py, ``preempt_resource``), CHIPS of each on the head.
CHIPS = PREEMPT_CHIPS
GRACE_S = 1.0
SLEEP = ["sleep", "120"]
# A job that takes most of the grace to stop: it is still RUNNING (and holding its chips) for a few
# rounds of the backend's monitor after Ray's SIGTERM.
SLOW_TO_STOP = py(
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(0.8)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "time.sleep(120)\n"
)


class Checked(FeedChecked):
    """An Executor on one Ray backend whose capacity report is compared with its RUNNING jobs after
    every change."""

    timeout_s = 60.0

    def report(self) -> tuple[dict[int, dict[str, int]], dict[str, int], dict[str, int]] | None:
        """(held by band, free, totals); None until the backend has read Ray once."""
        try:
            (report,) = self.executor.availability()
        except Unavailable:
            return None
        block = report.availability
        assert block is not None
        held = {int(h.band): dict(h.amounts) for h in block.held_by_band}
        return held, dict(block.amounts), dict(block.total_amounts)

    def held(self) -> dict[int, dict[str, int]]:
        report = self.report()
        assert report is not None
        return report[0]

    def check(self) -> None:
        """Read the feed since the last check; after it, the report must match the job table."""
        self.read_feed()
        report = self.report()
        if report is None:
            return
        assert report[0] == self.expected()
        self.checks += 1

    def settled(self) -> bool:
        """Ray's free amount agrees with the job table: free = total − held − promised."""
        report = self.report()
        if report is None:
            return False
        held, free, totals = report
        used = sum(a.get("h100", 0) for a in held.values())
        return free.get("h100") == max(0, totals.get("h100", 0) - used - self.promised("h100"))

    def launch(self, job_id: str, band: Band, gpus: int, command: list[str] = SLEEP) -> None:
        self.executor.launch(request(command, job_id=job_id, gpus=gpus, band=band, backend_id=BACKEND))
        self.check()

    async def started(self, *job_ids: str) -> None:
        await self.until(f"{job_ids} running", lambda: all(self.state(j) is S.RUNNING for j in job_ids))

    async def quiet(self, rounds: int = 6) -> None:
        """Let the backend's monitor complete ``rounds`` more rounds (one every 0.5 s): time for it
        to act wrongly."""
        backend = self.executor.backends[self.backend_id]
        assert isinstance(backend, RayBackend)
        done = backend.rounds + rounds
        await self.until(f"{rounds} rounds of the Ray monitor", lambda: backend.rounds >= done)


def _stop_all(spec: devstack.RayHeadSpec, job_ids: set[str]) -> None:
    """Stop every unfinished Ray job of ``job_ids`` on the head (the executor's shutdown leaves
    them running); other users' jobs on the shared head are left alone."""
    client = JobSubmissionClient(spec.address)
    deadline = time.monotonic() + 60
    while True:
        live = [
            j
            for j in client.list_jobs()
            if not j.status.is_terminal() and (j.metadata or {}).get("iris_job_id") in job_ids
        ]
        if not live:
            return
        assert time.monotonic() < deadline, f"Ray jobs still live: {[j.submission_id for j in live]}"
        for job in live:
            if job.submission_id is not None:
                with contextlib.suppress(RuntimeError):
                    client.stop_job(job.submission_id)
        time.sleep(0.5)  # not a wait: the round of a stop loop that checks the jobs' state each time


@contextlib.asynccontextmanager
async def checked_executor(
    spec: devstack.RayHeadSpec, tmp_path: Path, test: str, grace_s: float = GRACE_S, *, leave: bool = False
) -> AsyncIterator[Checked]:
    """An executor on the test's resource, its state in ``tmp_path/state`` (kept: a second one on
    the same path is a restarted controller). Leaving it stops its jobs in Ray unless ``leave``."""
    backend: dict[str, Any] = {
        **ray_backend(spec, "e2e", id=BACKEND),
        "devices": {"h100": CHIPS},
        "ray_resources": {"h100": preempt_resource(test)},
    }
    peer = {**cluster("peer", backends=[backend]), "preempt_grace_s": grace_s}
    config = FederationConfig.model_validate(federation(cluster("home"), peer))
    state_dir = tmp_path / "state"
    state_dir.mkdir(exist_ok=True)
    store = StateStore(state_dir)
    executor = Executor(config.cluster("peer"), state_dir, store, kill_grace_s=1.0)
    executor.recover()
    checked = Checked(executor, BACKEND)
    watcher = asyncio.get_running_loop().create_task(checked.watch())
    try:
        await checked.until("the first read of Ray", lambda: checked.report() is not None)
        yield checked
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        checked.check()
        await executor.shutdown()
        store.close()
        if not leave:
            await asyncio.to_thread(_stop_all, spec, set(executor.jobs))


def ray_status(spec: devstack.RayHeadSpec, job_id: str) -> RayStatus:
    return JobSubmissionClient(spec.address).get_job_status(submission_id(job_id, 1))


async def test_an_interactive_job_preempts_the_youngest_batch_jobs_it_needs(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    """Four 2-chip batch jobs fill the backend; an interactive job needs 4 chips: the two youngest
    end PREEMPTED, and no one else while they stop (they take most of the grace)."""
    async with checked_executor(ray_head, tmp_path, "youngest") as c:
        for i in range(4):
            c.launch(f"batch/{i}", Band.BATCH, 2, SLOW_TO_STOP)
            await c.started(f"batch/{i}")
        assert c.held() == {3: {"h100": 8}}
        c.launch("urgent/train", Band.INTERACTIVE, 4, ["sh", "-c", "echo trained"])
        assert c.state("urgent/train") is S.PENDING
        await c.until("the interactive job ends", lambda: c.state("urgent/train").terminal)
        urgent = c.executor.get("urgent/train")
        assert urgent.state is S.SUCCEEDED, urgent.error
        for i in (2, 3):
            job = c.executor.get(f"batch/{i}")
            assert job.state is S.PREEMPTED
            assert job.error is not None and job.error.startswith("preempted by urgent/train at ")
            assert job.exit_code is None
            assert [t.state for t in job.tasks] == [S.PREEMPTED]
            # Stored as such: a restarted controller reports it the same.
            (stored,) = [j for j in c.executor.store.load_all() if j.job_id == job.job_id]
            assert stored.state is S.PREEMPTED and stored.error == job.error
            # Ray stopped it.
            assert await asyncio.to_thread(ray_status, ray_head, job.job_id) == RayStatus.STOPPED
        # The victims being stopped counted as free: the older two were never touched.
        assert c.state("batch/0") is S.RUNNING and c.state("batch/1") is S.RUNNING
        c.check()
        assert c.preemptions_seen == {"batch/2", "batch/3"}
        assert c.held() == {3: {"h100": 4}}
        await c.until("Ray's free amount agrees with the jobs", c.settled)
        # The watcher looked all along, not once.
        assert c.checks >= 10


async def test_the_fewest_victims_then_the_lowest_band_and_never_a_higher_one(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    """4 chips wanted, none free: the 4-chip batch job, the only batch work that makes room; never
    the interactive one, although with the younger 2-chip batch job it would lose less work (an
    interactive victim only when batch work cannot make room). Then an interactive job that only
    interactive and production work could make room for preempts no one."""
    async with checked_executor(ray_head, tmp_path, "fewest") as c:
        c.launch("old/big", Band.BATCH, 4)
        await c.started("old/big")
        c.launch("mid/interactive", Band.INTERACTIVE, 2)
        await c.started("mid/interactive")
        c.launch("young/small", Band.BATCH, 2)
        await c.started("young/small")
        c.launch("prod/a", Band.PRODUCTION, 4)
        await c.started("prod/a")
        assert {j: c.state(j) for j in ("old/big", "mid/interactive", "young/small")} == {
            "old/big": S.PREEMPTED,
            "mid/interactive": S.RUNNING,
            "young/small": S.RUNNING,
        }
        assert c.held() == {1: {"h100": 4}, 2: {"h100": 2}, 3: {"h100": 2}}
        # The one batch job left (2 chips) cannot make room for 4: nothing is preempted in vain,
        # and neither the interactive nor the production job is a victim.
        c.launch("inter/b", Band.INTERACTIVE, 4)
        await c.quiet()
        assert c.state("inter/b") is S.PENDING
        assert {j: c.state(j) for j in ("mid/interactive", "young/small", "prod/a")} == dict.fromkeys(
            ("mid/interactive", "young/small", "prod/a"), S.RUNNING
        )
        assert c.preemptions_seen == {"old/big"}
        assert c.held() == {1: {"h100": 4}, 2: {"h100": 2}, 3: {"h100": 2}}
        await c.until("Ray's free amount agrees with the jobs", c.settled)


async def test_batch_preempts_nothing_and_interactive_does_not_preempt_interactive(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    async with checked_executor(ray_head, tmp_path, "bands") as c:
        c.launch("batch/a", Band.BATCH, 4)
        await c.started("batch/a")
        c.launch("batch/b", Band.BATCH, 4)
        await c.started("batch/b")
        # A batch job waits: batch preempts nothing.
        c.launch("batch/c", Band.BATCH, 2)
        await c.quiet()
        assert c.state("batch/c") is S.PENDING
        assert c.state("batch/a") is S.RUNNING and c.state("batch/b") is S.RUNNING
        # An interactive job takes the whole backend; the waiting batch job does not get in first.
        c.launch("inter/a", Band.INTERACTIVE, 8)
        await c.started("inter/a")
        assert c.state("batch/a") is S.PREEMPTED and c.state("batch/b") is S.PREEMPTED
        assert c.state("batch/c") is S.PENDING
        # Another interactive job waits behind the first: an equal band is never preempted.
        c.launch("inter/b", Band.INTERACTIVE, 2)
        await c.quiet()
        assert c.state("inter/a") is S.RUNNING
        assert c.state("inter/b") is S.PENDING and c.state("batch/c") is S.PENDING
        assert c.preemptions_seen == {"batch/a", "batch/b"}
        assert c.held() == {2: {"h100": 8}}
        await c.until("Ray's free amount agrees with the jobs", c.settled)


def stubborn_job(marks: Path) -> list[str]:
    """Records when SIGTERM came (and ignores it) and, every 0.05 s, that it is still alive."""
    return py(
        "import os, signal, time\n"
        f"marks = {str(marks)!r}\n"
        "def put(name, value):\n"
        "    open(os.path.join(marks, name + '.tmp'), 'w').write(value)\n"
        "    os.replace(os.path.join(marks, name + '.tmp'), os.path.join(marks, name))\n"
        "signal.signal(signal.SIGTERM, lambda *_: put('term', repr(time.time())))\n"
        "put('up', '')\n"
        "while True:\n"
        "    put('alive', repr(time.time()))\n"
        "    time.sleep(0.05)\n"
    )


async def test_a_victim_that_ignores_sigterm_is_killed_after_the_grace(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    """Ray's stop waits the cluster's preempt_grace_s (here 5 s, more than Ray's own default of 3 s)
    between its SIGTERM and its SIGKILL: a victim that ignores SIGTERM lives on for the grace, and
    the waiting job starts after it is gone."""
    grace = 5.0
    marks = tmp_path / "marks"
    marks.mkdir()
    stubborn = stubborn_job(marks)
    starts = py(f"import time; open({str(marks / 'start')!r}, 'w').write(repr(time.time()))")
    async with checked_executor(ray_head, tmp_path, "grace", grace_s=grace) as c:
        c.launch("batch/stubborn", Band.BATCH, 8, stubborn)
        await c.started("batch/stubborn")
        await c.until("the SIGTERM handler is set", (marks / "up").exists)
        c.launch("prod/now", Band.PRODUCTION, 8, starts)
        await c.until("prod/now ends", lambda: c.state("prod/now").terminal)
        assert c.state("prod/now") is S.SUCCEEDED, c.executor.get("prod/now").error
        victim = c.executor.get("batch/stubborn")
        assert victim.state is S.PREEMPTED
        assert victim.error is not None and victim.error.startswith("preempted by prod/now at ")
        # SIGTERM was caught and ignored: the victim lived on for the grace (its last sign of life
        # at most one 0.05 s beat before Ray's SIGKILL), and the devices came back only after it.
        # Lower bounds only: how much later things happened depends on the machine.
        termed = float((marks / "term").read_text())
        last_alive = float((marks / "alive").read_text())
        started = float((marks / "start").read_text())
        assert last_alive - termed >= grace - 0.25, (termed, last_alive)
        assert started > last_alive
        assert c.held() == {}


async def test_a_controller_restarted_during_the_grace_still_settles_the_victim_preempted(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    """The preemption is stored before Ray's stop: a controller that restarts while the victim is in
    its grace re-attaches to it, settles it PREEMPTED when Ray reports it stopped, and starts the
    waiting job (recovered as not yet in Ray) once its devices are back."""
    marks = tmp_path / "marks"
    marks.mkdir()
    async with checked_executor(ray_head, tmp_path, "restart", grace_s=5.0, leave=True) as c:
        c.launch("batch/left", Band.BATCH, 8, stubborn_job(marks))
        await c.started("batch/left")
        await c.until("the SIGTERM handler is set", (marks / "up").exists)
        c.launch("prod/next", Band.PRODUCTION, 8, ["sh", "-c", "echo next"])
        await c.until("Ray's SIGTERM reached the victim", (marks / "term").exists)
        assert c.state("batch/left") is S.RUNNING  # in its grace
        (stored,) = [j for j in c.executor.store.load_all() if j.job_id == "batch/left"]
        assert stored.preempted is not None and stored.preempted.startswith("preempted by prod/next at ")
        note = stored.preempted
    # The controller is gone; Ray goes on stopping the victim.
    async with checked_executor(ray_head, tmp_path, "restart", grace_s=5.0) as c:
        await c.until("prod/next ends", lambda: c.state("prod/next").terminal)
        assert c.state("prod/next") is S.SUCCEEDED, c.executor.get("prod/next").error
        victim = c.executor.get("batch/left")
        assert (victim.state, victim.error, victim.exit_code) == (S.PREEMPTED, note, None)
        assert c.held() == {}
