"""The Slurm backend against a real single-node Slurm (issue 30; docs/DESIGN.md, "The Slurm backend").

Each test runs a real Executor in this process whose one backend has ``kind = "slurm"``, on the
session's Slurm (``slurm``, tests/slurm/conftest.py) in a GRES type of its own, and checks what the
executor says against what Slurm itself says (``squeue --json``). Jobs run as ``nobody``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from controller_harness import request
from slurm_harness import BACKEND, Checked, executor_on, gres_type, slurm_job_of, slurm_jobs
from stack import wait_until

from iris import slurmdev
from iris.controller.executors.core import Executor
from iris.controller.executors.slurm import SUBMIT_MARK, comment_of, engine_id
from iris.controller.models import TIMED_OUT, LaunchRequest
from iris.controller.models import ControllerJobState as S
from iris.controller.state import JobRecord, StateStore, now_ms
from iris.policy.models import Band, DeviceRequest

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("slurm")]


def shared_dir(slurm: slurmdev.SlurmCluster) -> Path:
    """A directory the jobs (as nobody) and the test both reach."""
    path = slurm.runtime / "shared" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True)
    for p in (path.parent, path):
        p.chmod(0o1777)
    return path


async def log_of(executor: Executor, job_id: str) -> str:
    return (await executor.read_log(job_id, 0)).data


async def test_jobs_run_as_the_slurm_user_with_slurm_s_gpus_and_only_their_environment(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    # A variable of the controller's own (where its credentials would be) never reaches a job.
    os.environ["IRIS_SLURMTEST_CONTROLLER_ONLY"] = "controller-secret"
    try:
        async with executor_on(slurm, tmp_path / "state", "jobs") as c:
            show = request(
                [
                    "sh",
                    "-c",
                    'echo "uid=$(id -u) cvd=$CUDA_VISIBLE_DEVICES slurm=$SLURM_JOB_GPUS job=$IRIS_JOB_ID"; '
                    'echo "home=$HOME pwd=$(pwd)"; printf "multi=%s|\\n" "$MULTI"; '
                    'echo "leak=${IRIS_SLURMTEST_CONTROLLER_ONLY:-none}"; python -c "print(6 * 7)"',
                ],
                job_id="slurm/show",
                gpus=3,
                env={"MULTI": "a 'b'\nc", "SBATCH_PARTITION": "no-such-partition"},
                backend_id=BACKEND,
            )
            gang = request(
                [
                    "sh",
                    "-c",
                    'echo "replica $IRIS_REPLICA_INDEX of $IRIS_NUM_REPLICAS cvd=$CUDA_VISIBLE_DEVICES"',
                ],
                job_id="slurm/gang",
                gpus=2,
                replicas=2,
                backend_id=BACKEND,
            )
            failing = request(
                ["sh", "-c", "echo about to fail; exit 3"], job_id="slurm/fail", backend_id=BACKEND
            )
            signalled = request(["sh", "-c", "kill -9 $$"], job_id="slurm/kill9", backend_id=BACKEND)
            missing = request(["no-such-program-here"], job_id="slurm/missing", backend_id=BACKEND)
            for r in (show, gang, failing, signalled, missing):
                c.executor.launch(r)
            ids = [r.job_id for r in (show, gang, failing, signalled, missing)]
            await c.ended(*ids)
            states = {j: (c.executor.get(j).state, c.executor.get(j).exit_code) for j in ids}
            assert states == {
                "slurm/show": (S.SUCCEEDED, 0),
                "slurm/gang": (S.SUCCEEDED, 0),
                "slurm/fail": (S.FAILED, 3),
                "slurm/kill9": (S.FAILED, 137),
                "slurm/missing": (S.FAILED, 127),
            }, {j: c.executor.get(j).error for j in ids}

            out = await log_of(c.executor, "slurm/show")
            # Three of Slurm's GPUs (of the job's GRES type), set by Slurm, as the unprivileged user.
            first = out.splitlines()[0]
            assert first.startswith("uid=65534 cvd=") and first.endswith(" job=slurm/show"), out
            cvd = first.split("cvd=")[1].split()[0]
            assert len(cvd.split(",")) == 3 and first.split("slurm=")[1].split()[0] == cvd, out
            (sj,) = slurm_job_of(slurm, c.executor, "slurm/show")
            assert sj.user == "nobody" and sj.partition == slurmdev.DEFAULT_PARTITION
            assert "multi=a 'b'\nc|" in out and "leak=none" in out and "\n42\n" in out
            home = out.split("home=", 1)[1].split()[0]
            assert out.split("pwd=", 1)[1].split()[0] == home and home.endswith("/work")
            # Each replica is an srun task with GPUs of its own.
            gang_out = await log_of(c.executor, "slurm/gang")
            lines = sorted(line for line in gang_out.splitlines() if line.startswith("replica"))
            assert (
                len(lines) == 2
                and lines[0].startswith("replica 0 of 2")
                and lines[1].startswith("replica 1 of 2")
            )
            devices = [set(line.split("cvd=")[1].split(",")) for line in lines]
            assert all(len(d) == 2 for d in devices) and not devices[0] & devices[1], lines
            assert "about to fail" in await log_of(c.executor, "slurm/fail")

            # Logs by offset: the same bytes, however they are split.
            chunk = await c.executor.read_log("slurm/show", 5, 7)
            assert chunk.data == out.encode()[5:12].decode() and chunk.next_offset == 12
            # The same launch again (a retried handoff) is the same run: nothing new reaches Slurm.
            again, created = c.executor.launch(show)
            assert not created and again.state is S.SUCCEEDED
            await c.quiet()
            assert len(slurm_job_of(slurm, c.executor, "slurm/show")) == 1
            # Its directory went with it (the output is in the controller's log).
            assert not any(
                p.name.endswith(c.executor.get("slurm/show").run_id) for p in c.backend.work_base.iterdir()
            )
    finally:
        del os.environ["IRIS_SLURMTEST_CONTROLLER_ONLY"]


async def test_terminate_and_timeout_end_the_slurm_job(slurm: slurmdev.SlurmCluster, tmp_path: Path) -> None:
    async with executor_on(slurm, tmp_path / "state", "stop") as c:
        c.executor.launch(
            request(
                ["sh", "-c", 'trap "echo got TERM; exit 0" TERM; echo up; while :; do sleep 0.1; done'],
                job_id="stop/term",
                gpus=2,
                backend_id=BACKEND,
            )
        )
        c.executor.launch(
            request(["sleep", "300"], job_id="stop/timeout", gpus=2, timeout_s=2, backend_id=BACKEND)
        )
        await c.started("stop/term")
        # Held by the controller (it does not fit beside the two): cancelled without Slurm.
        c.executor.launch(request(["true"], job_id="stop/held", gpus=8, backend_id=BACKEND))
        await c.quiet(2)
        assert c.state("stop/held") is S.PENDING and slurm_job_of(slurm, c.executor, "stop/held") == []
        held = await c.executor.terminate("stop/held")
        assert (held.state, held.error) == (S.KILLED, "terminated before it started")

        await wait_until(lambda: _log_has(c, "stop/term", "up"), timeout=30, what="the job to start")
        await c.executor.terminate("stop/term")
        await c.ended("stop/term", "stop/timeout")
        term = c.executor.get("stop/term")
        assert (term.state, term.error) == (S.KILLED, "terminated on request")
        assert "got TERM" in await log_of(c.executor, "stop/term")  # SIGTERM reached the job's own process
        timed = c.executor.get("stop/timeout")
        assert (timed.state, timed.error) == (S.FAILED, TIMED_OUT)
        # Slurm shows both gone.
        for job_id in ("stop/term", "stop/timeout"):
            (sj,) = slurm_job_of(slurm, c.executor, job_id)
            assert sj.terminal, sj


async def _log_has(c: Checked, job_id: str, text: str) -> bool:
    return text in await log_of(c.executor, job_id)


async def test_capacity_counts_every_job_on_slurm_and_nothing_is_placed_over_it(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """A job Iris did not submit holds GPUs like any other: the report's free amount excludes them
    (not held by any band: not reclaimable), and a job that does not fit beside it waits."""
    async with executor_on(slurm, tmp_path / "state", "cap") as c:
        assert c.report() == ({}, {"h100": 8}, {"h100": 8})
        outsider = slurm.run(
            "sbatch", "--parsable", "--ntasks=1", f"--gpus-per-task={gres_type('cap')}:5",
            "--output=/dev/null", "--wrap", "sleep 300", check=True,
        ).stdout.strip()  # fmt: skip
        try:
            await c.until(
                "the outsider's GPUs leave the free amount",
                lambda: c.report() == ({}, {"h100": 3}, {"h100": 8}),
            )
            c.executor.launch(
                request(["sleep", "300"], job_id="cap/small", gpus=3, band=Band.BATCH, backend_id=BACKEND)
            )
            await c.started("cap/small")
            c.executor.launch(request(["sleep", "300"], job_id="cap/big", gpus=4, backend_id=BACKEND))
            await c.quiet()
            # The 4-GPU job waits in the controller (it never reached Slurm), and preempted no one:
            # the outsider is no band's to reclaim, and the batch job alone would not make room.
            assert c.state("cap/big") is S.PENDING and slurm_job_of(slurm, c.executor, "cap/big") == []
            assert c.state("cap/small") is S.RUNNING
            assert c.held() == {3: {"h100": 3}}
            report = c.report()
            assert report is not None and report[1] == {"h100": 0}
        finally:
            slurm.run("scancel", outsider)
        await c.started("cap/big")
        assert c.held() == {2: {"h100": 4}, 3: {"h100": 3}}


async def test_a_restarted_controller_adopts_its_slurm_jobs_and_submits_nothing_twice(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    marks = shared_dir(slurm)
    gate = marks / "gate"
    waits = ["sh", "-c", f'echo first line; while [ ! -e {gate} ]; do sleep 0.1; done; echo "gate seen"']
    state = tmp_path / "state"
    async with executor_on(slurm, state, "restart", leave=True) as c:
        c.executor.launch(request(waits, job_id="restart/runs", gpus=4, backend_id=BACKEND))
        c.executor.launch(request(waits, job_id="restart/ends", gpus=2, backend_id=BACKEND))
        await c.started("restart/runs", "restart/ends")
        # Waits in the controller: it fits only once the others are gone.
        c.executor.launch(
            request(["sh", "-c", "echo all eight"], job_id="restart/held", gpus=8, backend_id=BACKEND)
        )
        await c.quiet(2)
        assert c.state("restart/held") is S.PENDING
        runs = {j: comment_of(c.executor.get(j)) for j in ("restart/runs", "restart/ends", "restart/held")}
    # The controller is gone; Slurm goes on. One job ends while nobody watches.
    gate.touch()
    await wait_until(
        lambda: asyncio.to_thread(_all_ended, slurm, {runs["restart/runs"], runs["restart/ends"]}),
        timeout=60,
        what="both Slurm jobs to end",
    )
    async with executor_on(slurm, state, "restart") as c:
        await c.ended("restart/runs", "restart/ends", "restart/held")
        for job_id in ("restart/runs", "restart/ends"):
            job = c.executor.get(job_id)
            assert job.state is S.SUCCEEDED, job.error
            out = await log_of(c.executor, job_id)
            assert out == "first line\ngate seen\n", out
        assert c.executor.get("restart/held").state is S.SUCCEEDED
        assert await log_of(c.executor, "restart/held") == "all eight\n"
        comments = [j.comment for j in slurm_jobs(slurm)]
        assert {comments.count(comment) for comment in runs.values()} == {1}  # each run once, no more


def _all_ended(slurm: slurmdev.SlurmCluster, comments: set[str]) -> bool:
    found = [j for j in slurm_jobs(slurm) if j.comment in comments]
    return len(found) == len(comments) and all(j.terminal for j in found)


def _left_by_a_crash(state: Path, job_id: str, handle: str | None, state_of: S = S.PENDING) -> str:
    """A job as a controller that died at a given moment left it in its store: accepted, its
    engine handle ``handle``. Returns its run's comment."""
    store = StateStore(state)
    try:
        req = LaunchRequest(
            job_id=job_id,
            command=["sh", "-c", f"echo ran {job_id}"],
            device=DeviceRequest(type="gpu", variant="h100", count=1),
            user="alice@example.com",
            requester="home",
            nonce="n1",
            backend_id=BACKEND,
        )
        job = JobRecord.new(req, seq=store.next_seq(), run_id=uuid.uuid4().hex, attempts=1)
        job.state = state_of
        for task in job.tasks:
            task.engine_id = handle
            task.state = state_of
        store.save(job)
        return comment_of(job)
    finally:
        store.close()


async def test_a_run_whose_sbatch_answer_was_lost_is_adopted_and_one_that_never_reached_slurm_runs_once(
    slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """The engine handle saved before sbatch says what a restarted controller may assume."""
    state = tmp_path / "state"
    async with executor_on(slurm, state, "unknown", leave=True) as c:
        c.executor.launch(
            request(
                ["sh", "-c", "sleep 1; echo adopted"],
                job_id="unknown/lost-answer",
                gpus=2,
                backend_id=BACKEND,
            )
        )
        await c.until("submitted", lambda: (engine_id(c.executor.get("unknown/lost-answer")) or "").isdigit())
    # As if sbatch's answer had been lost with the controller: only the marker was saved.
    store = StateStore(state)
    (job,) = [j for j in store.load_all() if j.job_id == "unknown/lost-answer"]
    slurm_id = engine_id(job)
    for task in job.tasks:
        task.engine_id = f"{SUBMIT_MARK}{now_ms()}"
    store.save(job)
    store.close()
    # One whose sbatch was about to be sent 40 s ago: Slurm shows no such job, and would (MinJobAge
    # is an hour), so it never had it.
    never = _left_by_a_crash(state, "unknown/never-sent", f"{SUBMIT_MARK}{now_ms() - 40_000}")
    # One whose sbatch was two hours ago: it may have run and been forgotten since.
    _left_by_a_crash(state, "unknown/too-old", f"{SUBMIT_MARK}{now_ms() - 2 * 3600_000}")
    # One Slurm ran, by its id, that Slurm no longer knows.
    _left_by_a_crash(state, "unknown/forgotten", "999999", S.RUNNING)

    async with executor_on(slurm, state, "unknown") as c:
        ids = ["unknown/lost-answer", "unknown/never-sent", "unknown/too-old", "unknown/forgotten"]
        await c.ended(*ids)
        adopted = c.executor.get("unknown/lost-answer")
        assert adopted.state is S.SUCCEEDED and engine_id(adopted) == slurm_id
        assert await log_of(c.executor, "unknown/lost-answer") == "adopted\n"
        assert c.executor.get("unknown/never-sent").state is S.SUCCEEDED
        assert await log_of(c.executor, "unknown/never-sent") == "ran unknown/never-sent\n"
        too_old = c.executor.get("unknown/too-old")
        assert too_old.state is S.WORKER_FAILED and "it may have run" in (too_old.error or "")
        forgotten = c.executor.get("unknown/forgotten")
        assert forgotten.state is S.WORKER_FAILED and "no longer knows job 999999" in (forgotten.error or "")
        comments = [j.comment for j in slurm_jobs(slurm)]
        assert comments.count(comment_of(adopted)) == 1 and comments.count(never) == 1


async def test_a_lost_node_fails_the_run_and_its_processes_end_when_the_node_returns(
    own_slurm: slurmdev.SlurmCluster, tmp_path: Path
) -> None:
    """kill -9 of slurmd: Slurm marks the node down and the job NODE_FAIL (SlurmdTimeout, 10 s
    here); the controller reports the run lost (WORKER_FAILED), and the node's capacity gone.
    The job's processes outlive slurmd (slurmstepd) until slurmd returns and ends them."""
    async with executor_on(own_slurm, tmp_path / "state", "own") as c:
        c.executor.launch(
            request(["sh", "-c", "echo up; exec sleep 300"], job_id="own/lost", gpus=2, backend_id=BACKEND)
        )
        await c.started("own/lost")
        (sj,) = slurm_job_of(own_slurm, c.executor, "own/lost")
        own_slurm.kill_slurmd()
        await c.until("the run is lost", lambda: c.state("own/lost").terminal, timeout=120)
        lost = c.executor.get("own/lost")
        assert lost.state is S.WORKER_FAILED and "NODE_FAIL" in (lost.error or ""), lost.error
        assert c.report() == ({}, {"h100": 0}, {"h100": 0})  # a down node offers nothing
        assert _job_processes(sj.job_id) != []  # still there, with slurmd gone
        await asyncio.to_thread(own_slurm.start_slurmd)
        await wait_until(
            lambda: asyncio.to_thread(lambda: _job_processes(sj.job_id) == []),
            timeout=60,
            what="the lost job's processes to end",
        )
        await c.until("the node's GPUs are back", lambda: c.report() == ({}, {"h100": 8}, {"h100": 8}))


def _job_processes(slurm_id: int) -> list[int]:
    marker = f"SLURM_JOB_ID={slurm_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found
