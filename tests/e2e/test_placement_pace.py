"""How fast the tick places a backlog (issue 9): an offered placement is not offered again while
its job has yet to answer, what it would reserve stays held meanwhile, and a tick that filled a
peer's per-tick cap is followed at once by another. Each test fails on the code before that change.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from stack import Stack, wait_until
from temporalio.testing import ActivityEnvironment

from activities.placement import PlacementActivities, TickInput, TickOutcome
from iris.client import AsyncIrisClient, build_spec
from iris.config import FederationConfig
from iris.contract import manager_workflow_id
from iris.jobs import JobState
from iris.reports import cluster_report
from iris.store import FederationStore
from iris.store.models import JobHandle
from worker.main import build_worker, ensure_manager


@pytest.fixture
def own_store(tmp_path: Path) -> FederationStore:
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    yield store  # type: ignore[misc]
    store.close()


def enqueue(store: FederationStore, name: str, **kw: object) -> str:
    """A handle in the queue of a store no workflow reads: the tick's offers go unanswered."""
    spec = build_spec(["true"], name=f"{name}-{uuid.uuid4().hex[:6]}", user="pace@example.com", **kw)  # type: ignore[arg-type]
    store.enqueue(JobHandle(job_id=spec.job_id, incarnation=f"{spec.job_id}@1", shape=spec.shape()))
    return spec.job_id


class WorkflowlessTick(PlacementActivities):
    """The real tick over handles this test enqueued without workflows: a signal to a missing
    workflow would abandon its handle (docs/DESIGN.md, "The tick"); here the signals go nowhere."""

    async def _signal(self, job_id: str, name: str, arg: object) -> bool:
        return False


async def tick(env: ActivityEnvironment, ticks: PlacementActivities) -> TickOutcome:
    return await env.run(ticks.placement_tick, TickInput())


def capped(config: FederationConfig, cap: int | None) -> FederationConfig:
    cfg = config.model_copy(deep=True)
    cfg.max_per_peer_per_tick = cap
    return cfg


async def test_an_unanswered_offer_is_not_repeated_until_its_lease_lapses(
    stack: Stack, own_store: FederationStore
) -> None:
    cfg = capped(stack.config, 1)
    ticks = WorkflowlessTick(cfg, own_store, offer_lease_s=2.0)
    env = ActivityEnvironment(client=stack.client)
    jobs = [enqueue(own_store, f"pace-{i}", target_cluster="cw-us-east-02a") for i in range(3)]
    first = await tick(env, ticks)
    assert first.placed == [jobs[0]] and first.saturated
    # The first job has not promoted yet: the next tick offers the second, not the first again.
    second = await tick(env, ticks)
    assert second.placed == [jobs[1]] and second.offered == 1
    third = await tick(env, ticks)
    assert third.placed == [jobs[2]] and third.offered == 2 and not third.saturated
    # The cap is the config's at each tick, not fixed when the tick's worker started.
    cfg.max_per_peer_per_tick = None
    # Unanswered past the lease: offered again (the job's promotion CAS absorbs a repeat), each
    # once its own lease has lapsed.
    started = time.monotonic()
    again: set[str] = set()

    async def reoffered() -> bool:
        again.update((await tick(env, ticks)).placed)
        return again == set(jobs)

    await wait_until(reoffered, timeout=20, interval=0.3, what="the lapsed offers to be made again")
    assert time.monotonic() - started >= 1.5


async def test_what_an_unanswered_offer_would_reserve_is_held_in_the_next_tick(
    stack: Stack, own_store: FederationStore
) -> None:
    async def rno2a_idle() -> bool:
        report = await cluster_report(stack.config, "cw-rno2a")
        block = report.backends[0].availability if report.backends else None
        return block is not None and block.amounts.get("h100") == 8

    await wait_until(rno2a_idle, timeout=60, what="cw-rno2a's 8 H100s to be free")
    ticks = WorkflowlessTick(capped(stack.config, None), own_store)
    env = ActivityEnvironment(client=stack.client)
    a = enqueue(own_store, "hold-a", target_cluster="cw-rno2a", device_type="h100", gpu_count=8)
    b = enqueue(own_store, "hold-b", target_cluster="cw-rno2a", device_type="h100", gpu_count=8)
    first = await tick(env, ticks)
    assert first.placed == [a]
    # Nothing changed on the peer (a's workflow never promoted): b must not get the same 8 chips.
    second = await tick(env, ticks)
    assert second.placed == [] and second.offered == 1, second
    assert b not in second.placed


@pytest.fixture
async def slow_ticking_federation(stack: Stack, tmp_path: Path) -> AsyncIterator[AsyncIrisClient]:
    """Its own worker and manager: one placement per peer per tick, and 30 s between ticks."""
    cfg: FederationConfig = stack.config.model_copy(deep=True)
    cfg.temporal.task_queue = f"iris-pace-{uuid.uuid4().hex[:8]}"
    cfg.max_per_peer_per_tick = 1
    cfg.tick_interval_s = 30
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        async with build_worker(stack.client, cfg, store):
            await ensure_manager(stack.client, cfg)
            try:
                yield AsyncIrisClient(stack.client, cfg)
            finally:
                await stack.client.get_workflow_handle(
                    manager_workflow_id(cfg.temporal.task_queue)
                ).terminate()
    finally:
        store.close()


async def test_a_tick_that_fills_the_cap_is_followed_at_once_by_another(
    slow_ticking_federation: AsyncIrisClient,
) -> None:
    iris = slow_ticking_federation
    jobs = list(
        await asyncio.gather(
            *(iris.submit(["true"], name=f"cap-{i}", target_cluster="cw-us-east-02a") for i in range(6))
        )
    )

    async def all_handed_off() -> bool:
        states = [(await iris.describe(j)).state for j in jobs]
        return all(s in (JobState.HANDED_OFF, JobState.RUNNING, JobState.SUCCEEDED) for s in states)

    # One placement per tick: without the immediate re-tick the last job would wait for the
    # 30 s interval (the submissions' wake-ups are spent by then).
    await wait_until(all_handed_off, timeout=20, what="all six jobs to be handed off, one per tick")


async def test_a_paced_cluster_is_sent_no_more_than_its_rate(
    stack: Stack, own_store: FederationStore
) -> None:
    """Handoff pacing (docs/DESIGN.md, "Handoff pacing"): with 2 handoffs a second and no cap per
    tick, the first tick sends the cluster its bucket (2), the jobs left wait on the pace (not
    "saturated": the next tick comes after the interval), and over the ticks that follow the
    cluster is never sent more than the burst plus the rate × the time gone by."""
    cfg = stack.config.model_copy(deep=True)
    cfg.handoffs_per_s = 2.0
    cfg.max_per_peer_per_tick = None
    ticks = WorkflowlessTick(cfg, own_store, offer_lease_s=600.0)
    env = ActivityEnvironment(client=stack.client)
    jobs = [enqueue(own_store, f"paced-{i}", target_cluster="cw-us-east-02a") for i in range(6)]
    started = time.monotonic()
    first = await tick(env, ticks)
    assert first.placed == jobs[:2] and not first.saturated, first
    waiting = {h.job_id: h.reason for h in own_store.queued()}
    assert all("paced" in (waiting[j] or "") for j in jobs[2:]), waiting
    placed = list(first.placed)

    async def all_placed() -> bool:
        placed.extend((await tick(env, ticks)).placed)
        elapsed = time.monotonic() - started
        assert len(placed) <= 2 + 2.0 * elapsed + 1e-6, (len(placed), elapsed)
        return len(placed) == len(jobs)

    await wait_until(all_placed, timeout=30, interval=0.2, what="the paced jobs to be offered")
    assert sorted(placed) == sorted(jobs)
