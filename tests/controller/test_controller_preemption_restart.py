"""A controller killed (kill -9) while a preempted job is in its grace (docs/DESIGN.md,
"Preemption"): the preemption was stored before the first signal, so the restarted controller
settles the victim PREEMPTED, naming who preempted it, not WORKER_FAILED; home then re-queues it as
a preemption rather than counting a lost worker against its failure budget. The job it made room
for starts once the leftover victim is killed."""

from __future__ import annotations

import asyncio
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
    start_controller,
    wait_terminal,
    write_config,
)

from iris.controller.models import ControllerJobState as S
from iris.policy.models import Band

# A victim that ignores SIGTERM: it holds its chips for the whole grace.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(300)"
)


@pytest.mark.parametrize("sandbox", ["auto", "off"])
async def test_a_controller_killed_during_a_victims_grace_settles_it_preempted(
    tmp_path: Path, sandbox: str
) -> None:
    """In the sandbox (where the host allows it; the victim then ends with its controller) and
    without it (a leftover the restarted controller kills): the same settlement."""
    peer = cluster("peer", backends=[gpu_backend(slots=8)], sandbox=sandbox)
    peer["preempt_grace_s"] = 120  # far longer than the test: the restart falls inside the grace
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"])
    try:
        async with ctl.client() as c:
            await c.launch(request(py(STUBBORN), job_id="b/victim", gpus=8, band=Band.BATCH))
            await poll(lambda: c.logs("b/victim"), lambda ch: "up" in ch.data, what="victim up")
            first = await c.launch(
                request(py("print('reclaimed')"), job_id="p/first", gpus=8, band=Band.PRODUCTION)
            )
            # The victim ignores SIGTERM: the production job waits out the grace.
            assert first.state is S.PENDING
            assert (await c.status("b/victim")).state is S.RUNNING
        pids = job_pids("b/victim")  # as the host sees them
        assert pids

        def alive() -> bool:
            return any(process_alive(pid) for pid in pids)

        ctl.kill9()
        ctl = restart(ctl)
        async with ctl.client() as c:
            victim = await c.status("b/victim")
            assert victim.state is S.PREEMPTED, victim
            assert victim.error is not None
            assert victim.error.startswith("preempted by p/first at "), victim.error
            assert "the controller restarted during its grace" in victim.error
            await poll(lambda: asyncio.to_thread(alive), lambda up: not up, what="leftover killed")
            assert (await wait_terminal(c, "p/first")).state is S.SUCCEEDED
            assert await read_all_logs(c, "p/first") == "reclaimed\n"
    finally:
        ctl.stop()
