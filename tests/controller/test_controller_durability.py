"""Slot exclusivity under concurrent launches, and honest state across a kill -9 restart."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from controller_harness import (
    cluster,
    federation,
    gpu_backend,
    job_pids,
    poll,
    process_alive,
    py,
    read_all_logs,
    request,
    restart,
    sandboxed,
    shared_dir,
    start_controller,
    wait_terminal,
    write_config,
)

from iris.controller.client import ControllerClient
from iris.controller.models import ControllerJobState as S
from iris.controller.models import JobStatus
from iris.policy.models import Band

TOTAL_SLOTS = 16
# CPU slots of controller_harness.gpu_backend (reported as the ``cpu`` token); these jobs use GPUs.
CPU_SLOTS = 4

# Each job claims its slots as exclusive marker files (a clash is recorded as a violation), reports
# that it runs, then holds its slots until the test releases it.
HOLDER = """
import os, sys, time, pathlib
d, name = pathlib.Path(sys.argv[1]), sys.argv[2]
slots = os.environ["IRIS_DEVICE_SLOTS"].split(",")
for s in slots:
    try:
        os.close(os.open(d / f"slot-{s}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        (d / f"violation-{name}-{s}").touch()
marker = d / f"running-{name}-{os.environ['IRIS_REPLICA_INDEX']}"
tmp = d / f"tmp-{name}-{os.environ['IRIS_REPLICA_INDEX']}"
tmp.write_text(",".join(slots))
tmp.rename(marker)  # atomic: a reader never sees a half-written marker
while not (d / f"release-{name}").exists():
    time.sleep(0.05)
for s in slots:
    (d / f"slot-{s}").unlink()
marker.unlink()
"""


def held_by_processes(d: Path) -> set[int]:
    return {int(p.name.removeprefix("slot-")) for p in d.glob("slot-*")}


def running_markers(d: Path) -> dict[str, list[int]]:
    return {
        p.name.removeprefix("running-"): [int(s) for s in p.read_text().split(",")]
        for p in d.glob("running-*")
    }


async def check_consistent(c: ControllerClient, d: Path) -> list[JobStatus]:
    """With every job blocked, the report, the job list and the processes must agree exactly."""
    jobs = await c.list_jobs()
    running = [j for j in jobs if j.state is S.RUNNING]
    assigned = [s for j in running for t in j.tasks for s in t.slots]
    assert len(assigned) == len(set(assigned)) <= TOTAL_SLOTS, assigned
    # Wait for every running job's process to have claimed its slots.
    names = {f"{j.job_id.rsplit('/', 1)[1]}-{t.index}" for j in running for t in j.tasks}
    await poll(
        lambda: asyncio.to_thread(running_markers, d),
        lambda m: set(m) == names,
        what="every running job's process up",
    )
    assert await asyncio.to_thread(held_by_processes, d) == set(assigned)
    report = (await c.backends()).backends[0].availability
    assert report is not None
    assert report.total_amounts == {"h100": TOTAL_SLOTS, "cpu": CPU_SLOTS}
    # Idle chips promised to jobs waiting here are not offered as free.
    if any(j.state is S.PENDING for j in jobs):
        assert 0 <= report.amounts["h100"] <= TOTAL_SLOTS - len(assigned)
    else:
        assert report.amounts == {"h100": TOTAL_SLOTS - len(assigned), "cpu": CPU_SLOTS}
    held: dict[int, int] = {}
    for j in running:
        held[int(j.band)] = held.get(int(j.band), 0) + sum(len(t.slots) for t in j.tasks)
    assert {int(h.band): h.amounts["h100"] for h in report.held_by_band} == held
    assert not await asyncio.to_thread(lambda: list(d.glob("violation-*")))
    return jobs


async def test_fifty_concurrent_launches_never_overcommit(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The slot files: in a directory the jobs (sandboxed, each its own pool uid) share with the test.
    d = shared_dir(tmp_path_factory.mktemp("slots"))
    peer = cluster("peer", backends=[gpu_backend(slots=TOTAL_SLOTS)], rw_paths=[d])
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    rng = random.Random(4)
    reqs = []
    for i in range(50):
        gpus, replicas = rng.choice([(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (1, 3), (16, 1)])
        reqs.append(
            request(
                [*py(HOLDER), str(d), f"j{i}"],
                job_id=f"load/j{i}",
                gpus=gpus,
                replicas=replicas,
                # One band: a higher one waiting would preempt (docs/DESIGN.md, "Preemption";
                # tests/preemption checks the same accounting through preemptions).
                band=Band.BATCH,
            )
        )
    try:
        async with ctl.client(timeout=30) as c:

            async def watch(stop: asyncio.Event) -> int:
                # While launches race, every report must be self-consistent and within capacity.
                seen = 0
                while not stop.is_set():
                    a = (await c.backends()).backends[0].availability
                    assert a is not None
                    used = sum(h.amounts.get("h100", 0) for h in a.held_by_band)
                    assert a.amounts["h100"] >= 0 and a.amounts["h100"] + used <= TOTAL_SLOTS
                    assert len(held_by_processes(d)) <= TOTAL_SLOTS
                    seen += 1
                return seen

            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            launched = await asyncio.gather(*(c.launch(r) for r in reqs))
            stop.set()
            assert await watcher > 0
            assert {s.job_id for s in launched} == {r.job_id for r in reqs}
            jobs = await check_consistent(c, d)
            assert any(j.state is S.PENDING for j in jobs)

            # Release one running job at a time; after each exit the report must match again.
            finished: set[str] = set()
            while len(finished) < len(reqs):
                running = [j for j in jobs if j.state is S.RUNNING]
                assert running, "jobs are pending but nothing runs"
                victim = rng.choice(running)
                name = victim.job_id.rsplit("/", 1)[1]
                (d / f"release-{name}").touch()
                assert (await wait_terminal(c, victim.job_id)).state is S.SUCCEEDED
                finished.add(victim.job_id)
                jobs = await check_consistent(c, d)
            assert all(j.state is S.SUCCEEDED for j in jobs)
            report = (await c.backends()).backends[0].availability
            assert (
                report is not None
                and report.amounts == {"h100": TOTAL_SLOTS, "cpu": CPU_SLOTS}
                and report.held_by_band == []
            )
    finally:
        for i in range(50):
            (d / f"release-j{i}").touch()
        ctl.stop()


@pytest.mark.parametrize("sandbox", ["auto", "off"])
async def test_kill9_restart_reports_every_job_honestly(tmp_path: Path, sandbox: str) -> None:
    """In the sandbox (where the host allows it) and without it: the two lose a running job's
    processes differently (with its controller; or later, to the restarted one), and report alike."""
    peer = cluster("peer", backends=[gpu_backend(slots=8)], sandbox=sandbox)
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    long_job = py("import time; print('up', flush=True); time.sleep(300)")
    try:
        async with ctl.client() as c:
            await c.launch(request(py("print('done')"), job_id="r/ok"))
            await c.launch(request(py("import sys; sys.exit(7)"), job_id="r/fail"))
            await c.launch(request(py("import time; time.sleep(300)"), job_id="r/killed"))
            assert (await c.terminate("r/killed")).state is S.KILLED
            assert (await wait_terminal(c, "r/ok")).state is S.SUCCEEDED
            assert (await wait_terminal(c, "r/fail")).state is S.FAILED
            await c.launch(request(long_job, job_id="r/running", gpus=8))
            pending = await c.launch(request(py("print('finally')"), job_id="r/pending", gpus=1))
            assert pending.state is S.PENDING
            await poll(lambda: c.logs("r/running"), lambda ch: "up" in ch.data, what="running job up")
        pids = job_pids("r/running")  # as the host sees them
        assert pids
        in_sandbox = await sandboxed(ctl)
        assert not (in_sandbox and sandbox == "off")

        def alive() -> bool:
            return any(process_alive(pid) for pid in pids)

        ctl.kill9()
        if in_sandbox:
            # bwrap --die-with-parent: the sandbox, and every process in it, ends with its controller.
            await poll(
                lambda: asyncio.to_thread(alive), lambda up: not up, what="the job ends with its controller"
            )
        else:
            assert alive(), "a job's process outlives its controller (own session)"

        ctl = restart(ctl)
        async with ctl.client() as c:
            jobs = {j.job_id: j for j in await c.list_jobs()}
            assert set(jobs) == {"r/ok", "r/fail", "r/killed", "r/running", "r/pending"}
            assert jobs["r/ok"].state is S.SUCCEEDED and jobs["r/ok"].exit_code == 0
            assert jobs["r/fail"].state is S.FAILED and jobs["r/fail"].exit_code == 7
            assert jobs["r/killed"].state is S.KILLED
            lost = jobs["r/running"]
            assert lost.state is S.WORKER_FAILED
            assert lost.error is not None and "restarted" in lost.error
            if not in_sandbox:
                assert "killed" in lost.error  # the leftover found by its run id
            # The leftover process was found and killed, so its slots are really free.
            await poll(lambda: asyncio.to_thread(alive), lambda up: not up, what="leftover killed")
            # The pending job was started again and runs to completion.
            assert (await wait_terminal(c, "r/pending")).state is S.SUCCEEDED
            assert await read_all_logs(c, "r/pending") == "finally\n"
            assert await read_all_logs(c, "r/ok") == "done\n"
            assert "up" in await read_all_logs(c, "r/running")
            report = (await c.backends()).backends[0].availability
            assert report is not None and report.amounts == {"h100": 8, "cpu": CPU_SLOTS}
            # The old job id keeps its idempotency: same nonce is a replay, no new run.
            replay = await c.launch(request(py("print('done')"), job_id="r/ok"))
            assert replay.state is S.SUCCEEDED and replay.attempts == 1
    finally:
        ctl.stop()
