"""Preemption on the Slurm backend (issue 30; docs/DESIGN.md, "Preemption", "The Slurm backend"),
against the session's real single-node Slurm: a real Executor in this process whose backend runs its
jobs as Slurm jobs. A job that waits for GPUs lower-band jobs hold preempts the lowest-band ones
that lose the least work (``choose_victims``); the backend stops them in Slurm (SIGTERM to every process of
the job, then SIGKILL and ``scancel`` after the cluster's grace); they end PREEMPTED with who
preempted them and when, and the waiting job starts when Slurm shows their GPUs free.
``held_by_band`` in the capacity report matches the RUNNING jobs after every change the change feed
shows. Each test has a GRES type of its own on the session Slurm (tests/slurm/slurm_harness.py)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from controller_harness import request
from slurm_harness import BACKEND, Checked, executor_on, gres_type, slurm_job_of

from iris import slurmdev
from iris.controller.models import ControllerJobState as S
from iris.controller.state import StateStore
from iris.policy.models import Band

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("slurm")]

SLEEP = ["sleep", "300"]
# A job that takes most of a second to stop: still RUNNING (and holding its GPUs) for a few rounds
# of the backend's monitor after the SIGTERM; it then exits as a killed process would.
SLOW_TO_STOP = ["sh", "-c", "trap 'sleep 0.8; exit 143' TERM; while :; do sleep 0.1; done"]


def launch(c: Checked, job_id: str, band: Band, gpus: int, command: list[str] = SLEEP) -> None:
    c.executor.launch(request(command, job_id=job_id, gpus=gpus, band=band, backend_id=BACKEND))
    c.check()


def marks_dir(slurm: slurmdev.SlurmCluster) -> Path:
    """A directory the jobs (as nobody) and the test both reach."""
    path = slurm.runtime / "shared" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True)
    for p in (path.parent, path):
        p.chmod(0o1777)
    return path


def assert_preempted_by(c: Checked, job_id: str, by: str) -> None:
    job = c.executor.get(job_id)
    assert job.state is S.PREEMPTED, (job.state, job.error)
    assert job.error is not None and job.error.startswith(f"preempted by {by} at ")
    assert job.exit_code is None and [t.state for t in job.tasks] == [S.PREEMPTED]
    (stored,) = [j for j in c.executor.store.load_all() if j.job_id == job_id]
    assert stored.state is S.PREEMPTED and stored.error == job.error


async def test_an_interactive_job_preempts_the_youngest_batch_jobs_it_needs(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """Four 2-GPU batch jobs fill the backend; an interactive job needs 4: the two youngest end
    PREEMPTED, and no one else while they stop (they take most of a second)."""
    async with executor_on(slurm, tmp_path / "state", "youngest") as c:
        for i in range(4):
            launch(c, f"batch/{i}", Band.BATCH, 2, SLOW_TO_STOP)
            await c.started(f"batch/{i}")
            # Slurm records a start to the second: the next job starts in a later one, so the
            # youngest (least work lost) are never a tie the job ids break.
            next_second_ms = (c.executor.get(f"batch/{i}").started_ms or 0) + 1000
            await c.until("Slurm's next second", lambda t=next_second_ms: time.time() * 1000 >= t)
        assert c.held() == {3: {"h100": 8}}
        launch(c, "urgent/train", Band.INTERACTIVE, 4, ["sh", "-c", "echo trained"])
        assert c.state("urgent/train") is S.PENDING
        await c.ended("urgent/train")
        urgent = c.executor.get("urgent/train")
        assert urgent.state is S.SUCCEEDED, urgent.error
        for i in (2, 3):
            assert_preempted_by(c, f"batch/{i}", "urgent/train")
            (sj,) = slurm_job_of(slurm, c.executor, f"batch/{i}")
            assert sj.terminal  # ended in Slurm, not requeued there
        # The victims being stopped counted as free: the older two were never touched.
        assert c.state("batch/0") is S.RUNNING and c.state("batch/1") is S.RUNNING
        c.check()
        assert c.preemptions_seen == {"batch/2", "batch/3"}
        assert c.held() == {3: {"h100": 4}}
        assert c.checks >= 10  # the watcher looked all along, not once


async def test_the_fewest_victims_then_the_lowest_band_and_never_a_higher_one(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """4 GPUs wanted, none free: the 4-GPU batch job, the only batch work that makes room; never
    the interactive one, although with the younger 2-GPU batch job it would lose less work (an
    interactive victim only when batch work cannot make room). Then an interactive job that only
    interactive and production work could make room for preempts no one."""
    async with executor_on(slurm, tmp_path / "state", "fewest") as c:
        launch(c, "old/big", Band.BATCH, 4)
        await c.started("old/big")
        launch(c, "mid/interactive", Band.INTERACTIVE, 2)
        await c.started("mid/interactive")
        launch(c, "young/small", Band.BATCH, 2)
        await c.started("young/small")
        launch(c, "prod/a", Band.PRODUCTION, 4)
        await c.started("prod/a")
        assert {j: c.state(j) for j in ("old/big", "mid/interactive", "young/small")} == {
            "old/big": S.PREEMPTED,
            "mid/interactive": S.RUNNING,
            "young/small": S.RUNNING,
        }
        assert c.held() == {1: {"h100": 4}, 2: {"h100": 2}, 3: {"h100": 2}}
        launch(c, "inter/b", Band.INTERACTIVE, 4)
        await c.quiet()
        assert c.state("inter/b") is S.PENDING and slurm_job_of(slurm, c.executor, "inter/b") == []
        assert {c.state(j) for j in ("mid/interactive", "young/small", "prod/a")} == {S.RUNNING}
        assert c.preemptions_seen == {"old/big"}


async def test_batch_preempts_nothing_and_interactive_does_not_preempt_interactive(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    async with executor_on(slurm, tmp_path / "state", "bands") as c:
        launch(c, "batch/a", Band.BATCH, 4)
        await c.started("batch/a")
        launch(c, "batch/b", Band.BATCH, 4)
        await c.started("batch/b")
        launch(c, "batch/c", Band.BATCH, 2)
        await c.quiet()
        assert c.state("batch/c") is S.PENDING
        assert c.state("batch/a") is S.RUNNING and c.state("batch/b") is S.RUNNING
        # An interactive job takes the whole backend; the waiting batch job does not get in first.
        launch(c, "inter/a", Band.INTERACTIVE, 8)
        await c.started("inter/a")
        assert c.state("batch/a") is S.PREEMPTED and c.state("batch/b") is S.PREEMPTED
        assert c.state("batch/c") is S.PENDING
        launch(c, "inter/b", Band.INTERACTIVE, 2)
        await c.quiet()
        assert c.state("inter/a") is S.RUNNING
        assert c.state("inter/b") is S.PENDING and c.state("batch/c") is S.PENDING
        assert c.preemptions_seen == {"batch/a", "batch/b"}
        assert c.held() == {2: {"h100": 8}}


def stubborn_job(marks: Path) -> list[str]:
    """Records when the first SIGTERM came (and ignores it and any later one) and, every 0.05 s,
    that it is still alive."""
    script = (
        "import os, signal, time\n"
        f"marks = {str(marks)!r}\n"
        "def put(name, value):\n"
        "    open(os.path.join(marks, name + '.tmp'), 'w').write(value)\n"
        "    os.replace(os.path.join(marks, name + '.tmp'), os.path.join(marks, name))\n"
        "def term(*_):\n"
        "    if not os.path.exists(os.path.join(marks, 'term')):\n"
        "        put('term', repr(time.time()))\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "put('up', '')\n"
        "while True:\n"
        "    put('alive', repr(time.time()))\n"
        "    time.sleep(0.05)\n"
    )
    return ["python", "-c", script]


async def test_a_victim_that_ignores_sigterm_is_killed_after_the_grace(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """The backend waits the cluster's preempt_grace_s between its SIGTERM and its SIGKILL: a victim
    that ignores SIGTERM lives on for the grace, and the waiting job starts after it is gone."""
    grace = 5.0
    marks = marks_dir(slurm)
    starts = ["python", "-c", f"import time; open({str(marks / 'start')!r}, 'w').write(repr(time.time()))"]
    async with executor_on(slurm, tmp_path / "state", "grace", grace_s=grace) as c:
        launch(c, "batch/stubborn", Band.BATCH, 8, stubborn_job(marks))
        await c.started("batch/stubborn")
        await c.until("the SIGTERM handler is set", (marks / "up").exists)
        launch(c, "prod/now", Band.PRODUCTION, 8, starts)
        await c.ended("prod/now")
        assert c.state("prod/now") is S.SUCCEEDED, c.executor.get("prod/now").error
        assert_preempted_by(c, "batch/stubborn", "prod/now")
        # SIGTERM was caught and ignored: the victim lived on for the grace, and the GPUs came
        # back only after it. Lower bounds only: how much later depends on the machine.
        termed = float((marks / "term").read_text())
        last_alive = float((marks / "alive").read_text())
        started = float((marks / "start").read_text())
        print(f"SIGTERM handled to last sign of life: {last_alive - termed:.2f}s (grace {grace}s)")
        assert last_alive - termed >= grace - 0.25, (termed, last_alive)
        assert started > last_alive
        assert c.held() == {}


async def test_a_controller_restarted_during_the_grace_still_settles_the_victim_preempted(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """The preemption is stored before the SIGTERM: a controller that restarts while the victim is
    in its grace finds it by its comment, stops it, settles it PREEMPTED, and starts the waiting
    job once Slurm shows its GPUs free."""
    marks = marks_dir(slurm)
    state = tmp_path / "state"
    async with executor_on(slurm, state, "pregrace", grace_s=5.0, leave=True) as c:
        launch(c, "batch/left", Band.BATCH, 8, stubborn_job(marks))
        await c.started("batch/left")
        await c.until("the SIGTERM handler is set", (marks / "up").exists)
        launch(c, "prod/next", Band.PRODUCTION, 8, ["sh", "-c", "echo next"])
        await c.until("the SIGTERM reached the victim", (marks / "term").exists)
        assert c.state("batch/left") is S.RUNNING  # in its grace
    store = StateStore(state)
    (stored,) = [j for j in store.load_all() if j.job_id == "batch/left"]
    store.close()
    assert stored.preempted is not None and stored.preempted.startswith("preempted by prod/next at ")
    async with executor_on(slurm, state, "pregrace", grace_s=5.0) as c:
        await c.ended("prod/next")
        assert c.state("prod/next") is S.SUCCEEDED, c.executor.get("prod/next").error
        victim = c.executor.get("batch/left")
        assert (victim.state, victim.error, victim.exit_code) == (S.PREEMPTED, stored.preempted, None)
        assert c.held() == {}


async def test_an_outsider_s_gpus_are_not_reclaimable_so_nobody_is_preempted_in_vain(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """An 8-GPU interactive job, 4 GPUs held by a job Iris did not submit, 4 by Iris batch work:
    preempting the batch work would not make room, so nobody is preempted and the job waits; once
    the outsider ends, the batch work is preempted and the job runs."""
    async with executor_on(slurm, tmp_path / "state", "outsider") as c:
        outsider = slurm.run(
            "sbatch", "--parsable", "--ntasks=1", f"--gpus-per-task={gres_type('outsider')}:4",
            "--output=/dev/null", "--wrap", "sleep 300", check=True,
        ).stdout.strip()  # fmt: skip
        try:
            launch(c, "batch/x", Band.BATCH, 4)
            await c.started("batch/x")
            launch(c, "inter/all", Band.INTERACTIVE, 8)
            await c.quiet()
            assert c.state("inter/all") is S.PENDING and c.state("batch/x") is S.RUNNING
            assert c.preemptions_seen == set()
        finally:
            slurm.run("scancel", outsider)
        await c.started("inter/all")
        assert_preempted_by(c, "batch/x", "inter/all")
