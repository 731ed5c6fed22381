"""The federation with its GPU peers on Slurm, end to end (issue 30, acceptance 1-5).

``slurm_stack`` (tests/slurm/conftest.py) is the whole stack of config/clusters-slurm.toml: Temporal,
the emulators, a worker and the three controllers, the CoreWeave peers' H100 backends on the session's
single-node Slurm (each its own GRES type), their jobs run as ``nobody`` by slurmd. What the tests
check is what Slurm itself says (``squeue --json``), beside what the federation says.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from slurm_harness import slurm_jobs
from stack import Stack, wait_until

from iris import slurmdev
from iris.config import PROJECT_ROOT
from iris.controller.client import ControllerClient
from iris.controller.executors.slurm import SlurmJob
from iris.controller.identity import TokenSigner
from iris.controller.models import ControllerJobState, JobStatus
from iris.jobs import JobState
from iris.policy.models import Band

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(600)]

SEED = PROJECT_ROOT / "examples" / "seed"
RNO = "cw-rno2a"  # 8 x H100 on Slurm
RNO_BACKEND = "h100-rno2a"
EAST = "cw-us-east-02a"  # 16 x H100 on Slurm


@pytest.fixture(scope="module")
def stack(slurm_stack: Stack) -> Stack:
    return slurm_stack


def shared_dir(slurm: slurmdev.SlurmCluster) -> Path:
    """A directory the jobs (as nobody) and the test both reach."""
    path = slurm.runtime / "shared" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True)
    for p in (path.parent, path):
        p.chmod(0o1777)
    return path


def slurm_runs(slurm: slurmdev.SlurmCluster, job_id: str) -> list[SlurmJob]:
    """Every Slurm job of any attempt of ``job_id`` (the backend names each ``iris:<job id>``)."""
    return [j for j in slurm_jobs(slurm) if j.name == f"iris:{job_id}"]


async def in_slurm(slurm: slurmdev.SlurmCluster, job_id: str) -> list[SlurmJob]:
    return await asyncio.to_thread(slurm_runs, slurm, job_id)


async def state_is(stack: Stack, job_id: str, *states: JobState) -> bool:
    st = await stack.iris.describe(job_id)
    if st.terminal and st.state not in states:
        raise AssertionError(f"{job_id} ended {st.state.value}: {st.reason}")
    return st.state in states


async def slurm_running(slurm: slurmdev.SlurmCluster, job_id: str) -> bool:
    return any(j.started and not j.terminal for j in await in_slurm(slurm, job_id))


async def slurm_gone(slurm: slurmdev.SlurmCluster, job_id: str) -> bool:
    runs = await in_slurm(slurm, job_id)
    return bool(runs) and all(j.terminal for j in runs)


@contextlib.asynccontextmanager
async def direct(stack: Stack, cluster: str) -> AsyncIterator[ControllerClient]:
    """A peer's controller itself (behind its fault proxy), signed as the home cluster."""
    signer = TokenSigner.from_config(stack.config, stack.config.home, stack.key_dir)
    async with ControllerClient(stack.proxies[cluster].upstream, signer=signer, audience=cluster) as client:
        yield client


async def test_the_seeds_examples_run_on_slurm_peers_and_see_slurm_s_gpus(
    stack: Stack, slurm: slurmdev.SlurmCluster
) -> None:
    """Acceptance 1: the seed's commands, verbatim from its workspace, on Slurm-backed peers."""
    for args in (
        ["job", "run", "--device-type=h100", "--gpu-count=8", "my_training_script.py"],
        [
            "job",
            "run",
            "--target-cluster=cw-us-east-02a",
            "--device-type=h100",
            "--gpu-count=8",
            "my_training_script.py",
        ],
    ):
        res = await stack.cli(*args, cwd=SEED)
        assert res.code == 0, res.stderr
        assert "step 1: loss" in res.stdout and "step 3: loss" in res.stdout, res.stdout
        line = next(x for x in res.stdout.splitlines() if x.startswith("trained on "))
        cluster = line.split()[2]
        assert cluster in (RNO, EAST), line
        # CUDA_VISIBLE_DEVICES as Slurm set it: eight devices of the peer's own GRES type.
        devices = line.rsplit("devices ", 1)[1].rstrip(")").split(",")
        assert len(devices) == 8 and all(d.isdigit() for d in devices), line
        job_id = res.stdout.splitlines()[0].strip()
        (run,) = await in_slurm(slurm, job_id)
        assert run.state == "COMPLETED" and run.user == "nobody", run
    assert cluster == EAST  # the pinned one


async def test_a_temporal_cancel_an_iris_cancel_and_a_timeout_each_end_the_slurm_job(
    stack: Stack, slurm: slurmdev.SlurmCluster
) -> None:
    """Acceptance 2: squeue shows each Slurm job ended."""
    tag = uuid.uuid4().hex[:6]
    ids = {}
    for how in ("temporal", "cli"):
        ids[how] = await stack.iris.submit(
            ["sleep", "600"],
            name=f"slurm-cancel-{how}-{tag}",
            device_type="h100",
            gpu_count=2,
            target_cluster=RNO,
        )
    for job_id in ids.values():
        await wait_until(
            lambda j=job_id: slurm_running(slurm, j), timeout=90, what=f"{job_id} running in Slurm"
        )
    await stack.client.get_workflow_handle(ids["temporal"]).cancel()
    res = await stack.cli("job", "cancel", ids["cli"])
    assert res.code == 0, res.stderr
    res = await stack.cli(
        "job", "run", "--no-wait", "--timeout", "3s", "--target-cluster", RNO, "--device-type=h100",
        "--gpu-count=2", "--job-name", f"slurm-timeout-{tag}", "--", "sleep", "600",
    )  # fmt: skip
    assert res.code == 0, res.stderr
    ids["timeout"] = res.stdout.splitlines()[0].strip()
    for how, job_id in ids.items():
        await wait_until(
            lambda j=job_id: slurm_gone(slurm, j), timeout=90, what=f"{how}: {job_id} gone from Slurm"
        )
        final = await stack.iris.wait(job_id, timeout_s=90)
        expected = JobState.FAILED if how == "timeout" else JobState.KILLED
        assert final.state is expected, (how, final.state, final.reason)
    (timed,) = await in_slurm(slurm, ids["timeout"])
    assert timed.terminal


async def test_an_interactive_job_reclaims_a_slurm_peer_full_of_batch_jobs(
    stack: Stack, slurm: slurmdev.SlurmCluster
) -> None:
    """Acceptance 3: cw-rno2a's 8 GPUs held by four batch jobs; an interactive 8-GPU job placed by
    reclaim starts within 2 ticks plus the grace; the batch jobs end PREEMPTED, come back as their
    second attempt and succeed."""
    tick_s = stack.config.tick_interval_s
    grace_s = stack.config.cluster(RNO).preempt_grace_s
    tag = uuid.uuid4().hex[:6]
    markers = shared_dir(slurm)
    batch = []
    for i in range(4):
        marker = markers / f"b{i}"
        batch.append(
            await stack.iris.submit(
                ["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; exec sleep 300"],
                name=f"slurm-pre-batch-{i}-{tag}",
                device_type="h100",
                gpu_count=2,
                priority=Band.BATCH,
                target_cluster=RNO,
            )
        )
    for job_id in batch:
        await wait_until(
            lambda j=job_id: state_is(stack, j, JobState.RUNNING), timeout=90, what=f"{job_id} runs"
        )
    submitted = time.time()
    urgent = await stack.iris.submit(
        ["sh", "-c", "echo reclaimed"],
        name=f"slurm-pre-urgent-{tag}",
        device_type="h100",
        gpu_count=8,
        priority=Band.INTERACTIVE,
        target_cluster=RNO,
    )
    final = await stack.iris.wait(urgent, timeout_s=120 + grace_s)
    assert final.state is JobState.SUCCEEDED, final.reason
    async with direct(stack, RNO) as ctl:
        started = (await ctl.status(urgent)).started_ms
        assert started is not None
        print(
            f"interactive 8xH100 started {started / 1000 - submitted:.2f}s after submission (tick {tick_s}s)"
        )
        for job_id in batch:
            # The first attempt ended PREEMPTED on the peer; each run is a Slurm job of its own.
            runs = await in_slurm(slurm, job_id)
            assert len(runs) >= 1 and all(r.terminal for r in runs[:1])
    assert "reclaimed" in (await stack.iris.logs(urgent)).data
    for job_id in batch:
        done = await stack.iris.wait(job_id, timeout_s=180)
        assert done.state is JobState.SUCCEEDED, (job_id, done.reason)
        assert len(done.attempts) == 2, done.attempts
        first = done.attempts[0]
        assert first.preempted is not None and first.preempted.startswith(f"preempted by {urgent} at "), first
        runs = await in_slurm(slurm, job_id)
        assert len(runs) == 2 and all(r.terminal for r in runs), runs  # one Slurm job per attempt


async def _rno_free(stack: Stack) -> int | None:
    view = await stack.iris.peers()
    report = view.report(RNO)
    if report is None or not report.backends:
        return None
    (block,) = [b.availability for b in report.backends if b.backend_id == RNO_BACKEND]
    return None if block is None else block.amounts.get("h100")


async def test_a_job_submitted_to_slurm_outside_iris_reduces_the_peer_s_capacity(
    stack: Stack, slurm: slurmdev.SlurmCluster
) -> None:
    """Acceptance 4: an outsider's GPUs leave the peer's free amount; Iris places nothing over them."""
    argv = ["--ntasks=1", "--gpus-per-task=cw-rno2a-h100:6", "--output=/dev/null", "--wrap", "sleep 600"]
    done = await asyncio.to_thread(slurm.run, "sbatch", "--parsable", *argv, check=True)
    outsider = done.stdout.strip()
    tag = uuid.uuid4().hex[:6]
    try:
        await wait_until(lambda: _rno_free_is(stack, 2), timeout=60, what="cw-rno2a to report 2 free")
        big = await stack.iris.submit(
            ["sh", "-c", "echo big"],
            name=f"slurm-out-big-{tag}",
            device_type="h100",
            gpu_count=4,
            target_cluster=RNO,
        )
        small = await stack.iris.submit(
            ["sh", "-c", "echo small"],
            name=f"slurm-out-small-{tag}",
            device_type="h100",
            gpu_count=2,
            target_cluster=RNO,
        )
        assert (await stack.iris.wait(small, timeout_s=90)).state is JobState.SUCCEEDED
        # The big one is still queued at home: never placed over the outsider's GPUs.
        st = await stack.iris.describe(big)
        assert st.state is JobState.QUEUED_HANDOFF, (st.state, st.reason)
        assert await in_slurm(slurm, big) == []
    finally:
        await asyncio.to_thread(slurm.run, "scancel", outsider)
    assert (await stack.iris.wait(big, timeout_s=90)).state is JobState.SUCCEEDED


async def _rno_free_is(stack: Stack, free: int) -> bool:
    return await _rno_free(stack) == free


async def test_a_killed_controller_adopts_its_slurm_jobs_and_a_lost_slurmd_loses_the_attempt(
    stack: Stack, slurm: slurmdev.SlurmCluster
) -> None:
    """Acceptance 5: kill -9 of the controller while Slurm jobs run, then a restart: each job is
    adopted, none runs twice, each ends with its logs home. kill -9 of slurmd: the attempt is
    reported lost and the federation runs the job again."""
    tag = uuid.uuid4().hex[:6]
    gate = shared_dir(slurm) / "gate"
    jobs = [
        await stack.iris.submit(
            [
                "sh",
                "-c",
                f'echo "attempt on $IRIS_CLUSTER"; while [ ! -e {gate} ]; do sleep 0.2; done; echo done',
            ],
            name=f"slurm-adopt-{i}-{tag}",
            device_type="h100",
            gpu_count=2,
            target_cluster=RNO,
        )
        for i in range(2)
    ]
    for job_id in jobs:
        await wait_until(
            lambda j=job_id: slurm_running(slurm, j), timeout=90, what=f"{job_id} running in Slurm"
        )
    controller = stack.services[f"controller {RNO}"]
    await asyncio.to_thread(controller.kill)
    gate.touch()  # the jobs end while their controller is gone
    await asyncio.to_thread(controller.start)
    await asyncio.to_thread(controller.wait_ready, 60)
    for job_id in jobs:
        final = await stack.iris.wait(job_id, timeout_s=120)
        assert final.state is JobState.SUCCEEDED, final.reason
        assert len(final.attempts) == 1
        assert (await stack.iris.logs(job_id)).data == f"attempt on {RNO}\ndone\n"
        assert len(await in_slurm(slurm, job_id)) == 1  # adopted, never submitted again

    lost_gate = shared_dir(slurm) / "gate"
    lost = await stack.iris.submit(
        ["sh", "-c", f"test -e {lost_gate} && echo second && exit 0; touch {lost_gate}; exec sleep 600"],
        name=f"slurm-lost-{tag}",
        device_type="h100",
        gpu_count=2,
        target_cluster=RNO,
    )
    await wait_until(lambda: slurm_running(slurm, lost), timeout=90, what="the job running in Slurm")
    await asyncio.to_thread(slurm.kill_slurmd)
    try:
        async with direct(stack, RNO) as ctl:

            async def lost_there() -> bool:
                st: JobStatus = await ctl.status(lost)
                return st.state is ControllerJobState.WORKER_FAILED

            await wait_until(lost_there, timeout=120, what="the peer to report the attempt lost")
    finally:
        await asyncio.to_thread(slurm.start_slurmd)
    final = await stack.iris.wait(lost, timeout_s=180)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert len(final.attempts) == 2 and "second" in (await stack.iris.logs(lost)).data
    assert len(await in_slurm(slurm, lost)) == 2
