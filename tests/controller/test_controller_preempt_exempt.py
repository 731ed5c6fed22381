"""``preempt_exempt_s`` on a real controller process (docs/DESIGN.md, "Preemption", "Capacity
reports"): a job back from a preemption (its launch says ``preemptions`` > 0) is exempt from
another one for the cluster's ``preempt_exempt_s`` from its start. Its chips are reported in
``exempt_by_band``, so home's planner does not count them as reclaimable but for production (the
most protected band overrides the exemption); an interactive job that needs them waits, and the
backend preempts a job that is not exempt instead, even one that loses more work. When the
exemption ends, the waiting job preempts it and starts."""

from __future__ import annotations

import time
from pathlib import Path

from controller_harness import (
    cluster,
    federation,
    gpu_backend,
    poll,
    py,
    request,
    start_controller,
    write_config,
)

from iris.controller.client import ControllerClient
from iris.controller.models import ControllerJobState as S
from iris.policy import Band
from iris.policy.availability import Capacity, effective_capacity
from iris.policy.models import Availability, BackendReport, HeldByBand

EXEMPT_S = 10.0
SLEEP = py("import time; time.sleep(120)")


async def _gpu(c: ControllerClient) -> tuple[BackendReport, Availability]:
    report = next(b for b in (await c.backends()).backends if b.backend_id == "gpu")
    assert report.availability is not None
    return report, report.availability


def _by_band(entries: list[HeldByBand]) -> dict[int, int]:
    return {int(h.band): h.amounts.get("h100", 0) for h in entries if h.amounts.get("h100")}


async def test_an_exempt_job_is_not_reported_reclaimable_and_not_preempted(tmp_path: Path) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=8)])
    peer["preempt_exempt_s"] = EXEMPT_S
    peer["preempt_grace_s"] = 1
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    ctl = start_controller(cfg, "peer", tmp_path / "state", port=peer["port"], kill_grace=1.0)
    try:
        async with ctl.client() as c:
            fresh = request(SLEEP, job_id="batch/fresh", gpus=4, band=Band.BATCH)
            assert (await c.launch(fresh)).state is S.RUNNING
            back = request(SLEEP, job_id="batch/back", gpus=4, band=Band.BATCH).model_copy(
                update={"preemptions": 1}
            )
            assert (await c.launch(back)).state is S.RUNNING
            back_started = time.time()

            # Both hold their chips; only the fresh job's are reclaimable by interactive work,
            # production may take both.
            report, block = await _gpu(c)
            assert _by_band(block.held_by_band) == {3: 8}
            assert _by_band(block.exempt_by_band) == {3: 4}
            assert Capacity.from_block(block).reclaimable("h100", Band.INTERACTIVE) == 4
            assert Capacity.from_block(block).reclaimable("h100", Band.PRODUCTION) == 8
            assert effective_capacity("peer", report, "h100", Band.INTERACTIVE) == 4

            # An interactive job of 4: the fresh job goes, although the job back from a preemption
            # started later (it would lose less work).
            small = request(SLEEP, job_id="inter/small", gpus=4, band=Band.INTERACTIVE)
            await c.launch(small)
            await poll(
                lambda: c.status("inter/small"), lambda s: s.state is S.RUNNING, what="inter/small runs"
            )
            assert (await c.status("batch/fresh")).state is S.PREEMPTED
            assert (await c.status("batch/back")).state is S.RUNNING

            # Nothing is reclaimable now by interactive work: the exempt job's chips are not offered.
            report, block = await _gpu(c)
            assert _by_band(block.held_by_band) == {2: 4, 3: 4}
            assert _by_band(block.exempt_by_band) == {3: 4}
            assert effective_capacity("peer", report, "h100", Band.INTERACTIVE) == 0

            # An interactive job placed anyway waits; the exempt job is not preempted.
            waiting = request(SLEEP, job_id="inter/waiting", gpus=4, band=Band.INTERACTIVE)
            assert (await c.launch(waiting)).state is S.PENDING
            still = await c.status("batch/back")
            # (Should this fail on a very slow machine, the message says whether the exemption had
            # simply ended by then.)
            since = time.time() - back_started
            assert still.state is S.RUNNING, f"{still.state} {since:.1f}s after start (exempt {EXEMPT_S}s)"

            # When the exemption ends, the waiting job preempts it (no other event needed).
            done = await poll(
                lambda: c.status("inter/waiting"),
                lambda s: s.state is S.RUNNING,
                what="inter/waiting runs after the exemption",
                timeout=EXEMPT_S + 20,
            )
            assert done.state is S.RUNNING
            assert time.time() - back_started >= EXEMPT_S - 0.5
            victim = await c.status("batch/back")
            assert victim.state is S.PREEMPTED
            assert victim.error is not None and victim.error.startswith("preempted by inter/waiting at ")
            _, block = await _gpu(c)
            assert block.exempt_by_band == [] and _by_band(block.held_by_band) == {2: 8}
            for job_id in ("inter/small", "inter/waiting"):
                await c.terminate(job_id)
    finally:
        ctl.stop()
