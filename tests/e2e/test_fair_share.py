"""Fair share between users within a band on the real stack (issue 29, acceptance 2 at a small
scale; docs/DESIGN.md, "Fair share and aging"): on cw-rno2a (8 × H100, four 2-chip slots) user A
submits five times as many ``batch`` jobs as user B, interleaved, all pinned there, while a holder
keeps the peer full; then the holder ends. While both have
jobs waiting, B gets at least 40% of the band's device-seconds there (FIFO would give B about a
sixth: its share of the submissions). Device-seconds are read off each job's attempts (``describe``:
each attempt's start and end, times its chips), counting every job the scheduler started while both
users had jobs waiting: from the first start after the holder to B's last start. (Counting only the
part of each run inside that window would leave out B's last job entirely and bias the share
against B by one job in B_JOBS: CI run I measured 37.9% with four.)
"""

from __future__ import annotations

import asyncio
import uuid

from stack import Stack, wait_until

from iris.jobs import JobState, JobStatus
from iris.policy.models import Band

RNO = "cw-rno2a"  # 8 × H100
CHIPS = 2
RUN_S = 4
A_JOBS, B_JOBS = 30, 6


def device_seconds(status: JobStatus, start_ms: int, end_ms: int) -> float:
    """The chips × seconds of the job's attempts that started within [start_ms, end_ms]: what the
    scheduler handed the job while both users waited."""
    held = 0.0
    for attempt in status.attempts:
        if start_ms <= attempt.started_ms <= end_ms and attempt.ended_ms is not None:
            held += CHIPS * (attempt.ended_ms - attempt.started_ms) / 1000
    return held


async def test_a_light_user_gets_its_share_while_a_heavy_one_waits(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    heavy, light = f"fs-heavy-{tag}@example.com", f"fs-light-{tag}@example.com"
    stack.add_user(heavy, ["user"])
    stack.add_user(light, ["user"])

    async def submit(user: str, i: int) -> str:
        return await stack.iris.submit(
            ["sleep", str(RUN_S)],
            name=f"fs-{tag}-{i}",
            user=user,
            priority=Band.BATCH,
            target_cluster=RNO,
            device_type="h100",
            gpu_count=CHIPS,
        )

    # Interleaved, five of A's for each of B's, while a holder keeps cw-rno2a full: when it ends,
    # the tick sees both users' whole queues at once.
    a_jobs: list[str] = []
    b_jobs: list[str] = []
    async with stack.holding(RNO, gpus=8):
        for i in range(B_JOBS):
            a_jobs += [await submit(heavy, i * 10 + k) for k in range(A_JOBS // B_JOBS)]
            b_jobs.append(await submit(light, i * 10 + 9))

        async def all_queued() -> bool:
            statuses = await asyncio.gather(*(stack.iris.describe(j) for j in [*a_jobs, *b_jobs]))
            return all(st.state is JobState.QUEUED_HANDOFF for st in statuses)

        await wait_until(all_queued, timeout=60, interval=0.5, what="every job to be queued")

    done = await asyncio.gather(*(stack.iris.wait(j, timeout_s=300) for j in [*a_jobs, *b_jobs]))
    assert all(st.state is JobState.SUCCEEDED for st in done), [
        (st.job_id, st.state, st.reason) for st in done
    ]
    by_id = {st.job_id: st for st in done}

    # The window: from the first start after the holder until B's last job started (B waits no
    # more after it); every job started in it counts whole.
    start_ms = min(st.attempts[0].started_ms for st in done)
    end_ms = max(by_id[j].attempts[0].started_ms for j in b_jobs)
    assert end_ms > start_ms
    a_held = sum(device_seconds(by_id[j], start_ms, end_ms) for j in a_jobs)
    b_held = sum(device_seconds(by_id[j], start_ms, end_ms) for j in b_jobs)
    # A still had jobs waiting all along: it submitted five times as many.
    assert any(by_id[j].attempts[0].started_ms > end_ms for j in a_jobs)
    print(f"\nfair share: B held {b_held:.1f} of {a_held + b_held:.1f} device-seconds")
    assert b_held >= 0.4 * (a_held + b_held), f"B held {b_held:.1f} of {a_held + b_held:.1f} device-seconds"
