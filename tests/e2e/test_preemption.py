"""Preemption on the real stack (issue 19, acceptance 1-3; docs/DESIGN.md, "Preemption"), once with
cw-rno2a's backend on processes and once on a real Ray head (``stack_per_backend``): the peer
cw-rno2a (8 × H100) full of ``batch`` jobs gets an ``interactive`` 8-chip job
placed by reclaim. It starts within 2 ticks plus the peer's grace; the batch jobs show PREEMPTED,
are queued again as their next attempt and finish later. A ``batch`` job never preempts, an
``interactive`` one never preempts ``interactive``. Throughout, a sampler follows the peer's change
feed and, after each change it sees, compares the capacity report's ``held_by_band`` with the
RUNNING jobs the controller lists (a sample counts only if the report's observation did not move
while the listing was read).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from stack import Stack, wait_until

from iris.controller.client import ControllerClient
from iris.controller.identity import TokenSigner
from iris.controller.models import ControllerJobState, JobStatus
from iris.jobs import AttemptEnd, JobState
from iris.policy.models import Band
from iris.policy.reasons import WAITING_CODES, ReasonCode

RNO = "cw-rno2a"  # 8 × H100: processes, or the stack's Ray head
BACKEND = "h100-rno2a"


@pytest.fixture(scope="module")
def stack(stack_per_backend: Stack) -> Stack:
    return stack_per_backend


@contextlib.asynccontextmanager
async def direct(stack: Stack) -> AsyncIterator[ControllerClient]:
    """cw-rno2a's controller itself (behind its fault proxy), signed as the home cluster."""
    signer = TokenSigner.from_config(stack.config, stack.config.home, stack.key_dir)
    async with ControllerClient(stack.proxies[RNO].upstream, signer=signer, audience=RNO) as client:
        yield client


@dataclass
class Sampler:
    """``held_by_band`` against the RUNNING jobs, after each change of the peer's change feed."""

    # Each job's chips, as the test submitted it (a Ray backend's tasks hold no numbered slots).
    chips: dict[str, int] = field(default_factory=dict)
    checked: int = 0
    held_seen: list[dict[int, int]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    states: dict[str, set[ControllerJobState]] = field(default_factory=dict)

    async def run(self, ctl: ControllerClient) -> None:
        cursor: str | None = None
        while True:
            found = await ctl.changes(cursor, wait_s=2.0)
            cursor = found.cursor
            for st in found.jobs:
                self.states.setdefault(st.job_id, set()).add(st.state)
            await self.check(ctl)

    async def check(self, ctl: ControllerClient) -> None:
        for _ in range(20):
            before = await self._block(ctl)
            jobs = await ctl.list_jobs()
            after = await self._block(ctl)
            if before[0] != after[0]:
                continue  # the slots moved while the jobs were read: sample again
            held = after[1]
            running: dict[int, int] = {}
            for job in jobs:
                if job.backend_id == BACKEND and job.state is ControllerJobState.RUNNING:
                    running[int(job.band)] = running.get(int(job.band), 0) + self.chips.get(job.job_id, 0)
            if held != running:
                self.mismatches.append(f"held_by_band {held} != running {running}")
            free = after[2]
            if free + sum(held.values()) > 8:
                self.mismatches.append(f"free {free} + held {held} > 8")
            self.checked += 1
            if not self.held_seen or self.held_seen[-1] != held:
                self.held_seen.append(held)
            return

    @staticmethod
    async def _block(ctl: ControllerClient) -> tuple[int, dict[int, int], int]:
        (report,) = [b for b in (await ctl.backends()).backends if b.backend_id == BACKEND]
        a = report.availability
        assert a is not None
        held = {int(h.band): h.amounts.get("h100", 0) for h in a.held_by_band if h.amounts.get("h100")}
        return a.observation_epoch_ms, held, a.amounts.get("h100", 0)


async def controller_status(ctl: ControllerClient, job_id: str) -> JobStatus:
    return await ctl.status(job_id)


async def test_an_interactive_job_reclaims_a_peer_full_of_batch_jobs(stack: Stack) -> None:
    tick_s = stack.config.tick_interval_s
    grace_s = stack.config.cluster(RNO).preempt_grace_s
    tag = uuid.uuid4().hex[:6]
    # In the stack's shared directory (each job's sandbox sees it; a re-queued attempt may run
    # as another pool uid, and only tests a marker's existence).
    markers = stack.shared_dir
    sampler = Sampler()
    async with direct(stack) as ctl:
        sampling = asyncio.create_task(sampler.run(ctl))
        try:
            # Four batch jobs of 2 chips fill cw-rno2a. Each runs long the first time, briefly the
            # next (a marker file tells the attempts apart).
            batch = []
            for i in range(4):
                marker = markers / f"preempt-{tag}-b{i}"
                job_id = await stack.iris.submit(
                    ["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; sleep 120"],
                    name=f"pre-batch-{i}-{tag}",
                    device_type="h100",
                    gpu_count=2,
                    priority=Band.BATCH,
                    target_cluster=RNO,
                )
                sampler.chips[job_id] = 2
                batch.append(job_id)
            for job_id in batch:
                await wait_until(
                    lambda j=job_id: _state_is(stack, j, JobState.RUNNING), timeout=60, what=f"{job_id} runs"
                )
            # A batch job placed now waits: batch preempts nothing.
            waiting_batch = await stack.iris.submit(
                ["true"],
                name=f"pre-batch-late-{tag}",
                device_type="h100",
                gpu_count=2,
                priority=Band.BATCH,
                target_cluster=RNO,
            )
            sampler.chips[waiting_batch] = 2

            async def explained() -> bool:
                code = (await stack.iris.describe(waiting_batch)).reason_code
                return code in WAITING_CODES and code is not ReasonCode.Pending

            # A tick has looked at it (it explains the wait) and left it queued.
            await wait_until(explained, timeout=60, what=f"a tick to explain why {waiting_batch} waits")
            assert (await stack.iris.describe(waiting_batch)).state is JobState.QUEUED_HANDOFF
            for job_id in batch:
                st = await controller_status(ctl, job_id)
                assert st.state is ControllerJobState.RUNNING, f"a batch job preempted another: {st}"

            # `iris peers` (list-peers) reports the same: cw-rno2a's chips held by batch.
            await wait_until(lambda: _peers_held(stack, {3: 8}), timeout=15, what="iris peers shows batch 8")

            submitted = time.time()
            urgent = await stack.iris.submit(
                ["sh", "-c", "sleep 3; echo reclaimed"],
                name=f"pre-urgent-{tag}",
                device_type="h100",
                gpu_count=8,
                priority=Band.INTERACTIVE,
                target_cluster=RNO,
            )
            sampler.chips[urgent] = 8
            await wait_until(
                lambda: _state_is(stack, urgent, JobState.RUNNING, JobState.SUCCEEDED),
                timeout=60 + grace_s,
                what="the interactive job runs",
            )
            started = (await controller_status(ctl, urgent)).started_ms
            assert started is not None
            # How soon is a figure for benchmarks/, not an assertion (a loaded machine is slower).
            waited = started / 1000 - submitted
            print(f"interactive 8xH100 started {waited:.2f}s after submission (tick {tick_s}s)")

            # Each batch job's first attempt ended PREEMPTED, naming who and when.
            for job_id in batch:
                st = await controller_status(ctl, job_id)
                assert st.state is ControllerJobState.PREEMPTED, st
                assert st.error is not None and st.error.startswith(f"preempted by {urgent} at ")
            # An interactive job never preempts interactive work: a second one waits.
            second = await stack.iris.submit(
                ["true"],
                name=f"pre-urgent-2-{tag}",
                device_type="h100",
                gpu_count=8,
                priority=Band.INTERACTIVE,
                target_cluster=RNO,
            )
            sampler.chips[second] = 8
            await wait_until(
                lambda: _state_is(stack, urgent, JobState.SUCCEEDED), timeout=60, what="urgent ends"
            )
            assert (await controller_status(ctl, urgent)).state is ControllerJobState.SUCCEEDED

            # The victims were queued again as their next attempt and finish.
            for job_id in [*batch, waiting_batch, second]:
                await wait_until(
                    lambda j=job_id: _state_is(stack, j, JobState.SUCCEEDED),
                    timeout=120,
                    what=f"{job_id} succeeds",
                )
            for job_id in batch:
                st = await stack.iris.describe(job_id)
                first, last = st.attempts[0], st.attempts[-1]
                assert first.end == AttemptEnd.PREEMPTED.value and first.preempted is not None
                assert first.preempted.startswith(f"preempted by {urgent} at "), first
                assert last.end == AttemptEnd.SUCCEEDED.value and len(st.attempts) == 2
                assert any(
                    e.message.startswith("attempt 1 ended (PREEMPTED): Preempted on cw-rno2a: preempted by")
                    for e in st.events
                ), [e.message for e in st.events]
                assert any(
                    e.state is JobState.QUEUED_HANDOFF and "was preempted by" in e.message for e in st.events
                )
            # The feed carried PREEMPTED for every victim.
            for job_id in batch:
                assert ControllerJobState.PREEMPTED in sampler.states.get(job_id, set()), job_id
            await sampler.check(ctl)
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
    assert not sampler.mismatches, sampler.mismatches
    # It saw the peer full of batch work, then held by the interactive job, then empty again.
    assert {3: 8} in sampler.held_seen and {2: 8} in sampler.held_seen, sampler.held_seen
    assert sampler.held_seen.index({3: 8}) < sampler.held_seen.index({2: 8})
    print(f"held_by_band checked {sampler.checked} times: {sampler.held_seen}")


async def _peers_held(stack: Stack, held: dict[int, int]) -> bool:
    view = await stack.iris.peers()
    report = view.report(RNO)
    assert report is not None
    (block,) = [b.availability for b in report.backends if b.backend_id == BACKEND]
    assert block is not None
    return {int(h.band): h.amounts.get("h100", 0) for h in block.held_by_band} == held


async def _state_is(stack: Stack, job_id: str, *states: JobState) -> bool:
    st = await stack.iris.describe(job_id)
    if st.terminal and st.state not in states:
        raise AssertionError(f"{job_id} ended {st.state.value}: {st.reason}")
    return st.state in states
