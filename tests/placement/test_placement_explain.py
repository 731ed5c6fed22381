"""Bounded histories: the tick signals ``explain`` to a waiting job only when the reason it waits
changes in substance, not when free counts, observations or a peer's error text move (docs/DESIGN.md,
"The tick"). Real ticks (store, planner, signals) against a stand-in job on a Temporal dev server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from placement_harness import (
    OTHER,
    PEER,
    Jobs,
    gpu_backend,
    gpu_job,
    in_activity,
    new_job_id,
    reachable,
    tick_activities,
    unreachable,
    view,
)
from temporalio.testing import WorkflowEnvironment

import activities.placement as placement_module
from activities.placement import TickInput
from iris.config import FederationConfig
from iris.reports import FederationView
from iris.store import FederationStore


async def test_fluctuating_capacity_sends_one_explain_per_change_of_substance(
    temporal: WorkflowEnvironment,
    jobs: Jobs,
    store: FederationStore,
    config: FederationConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = temporal.client
    job_id = new_job_id("waiting")
    store.enqueue(gpu_job(job_id, gpus=8))
    await jobs.start(job_id)

    # Whatever the numbers, the 8-GPU interactive job fits nowhere: cw-a's free chips plus the batch
    # work it could reclaim stay below 8, on a new observation every tick; cw-b fails with a new
    # error text every tick.
    fluctuating = [(0, 0), (3, 2), (7, 0), (1, 6), (5, 1), (2, 2), (0, 7), (6, 0)]

    def cw_a(i: int) -> Any:
        free, batch = fluctuating[i % len(fluctuating)]
        return reachable(PEER, gpu_backend(free, held_batch=batch, epoch=1_000 + i))

    def cw_b_full(i: int) -> Any:
        free, batch = fluctuating[(i + 3) % len(fluctuating)]
        return reachable(OTHER, gpu_backend(free, held_batch=batch, epoch=5_000 + i))

    def cw_b_down(i: int) -> Any:
        return unreachable(OTHER, f"UNAVAILABLE: connect timed out after {5 + i / 100:.2f}s")

    def cw_a_down(i: int) -> Any:
        return unreachable(PEER, f"UNAVAILABLE: {i} connection attempts refused")

    # (what the job waits for, the views of its ticks)
    schedule: list[tuple[str, Callable[[], FederationView]]] = []
    for substance, peers, ticks in [
        ("cw-a full, cw-b down", (cw_a, cw_b_down), range(8)),
        ("both full", (cw_a, cw_b_full), range(8, 16)),
        ("cw-a down, cw-b full", (cw_a_down, cw_b_full), range(16, 22)),
        ("both full again", (cw_a, cw_b_full), range(22, 28)),
    ]:
        schedule += [(substance, lambda i=i, p=peers: view(*(f(i) for f in p))) for i in ticks]
    step = iter(schedule)

    real_gather = placement_module.gather_reports

    async def federation(asked: Any, **kw: Any) -> FederationView:
        if asked is not config:  # another tick in this process (a session stack's worker)
            return await real_gather(asked, **kw)
        _, make = next(step)
        built: FederationView = make()
        return built

    monkeypatch.setattr(placement_module, "gather_reports", federation)
    acts = tick_activities(config, store)
    explained_per_tick: list[tuple[str, int]] = []
    for substance, _ in schedule:
        outcome = await in_activity(client, acts._tick, TickInput())
        assert outcome.placed == [] and outcome.queued == 1
        explained_per_tick.append((substance, outcome.explained))

    # One explain at the first tick of each phase, none at the others.
    firsts = {i for i, (s, _) in enumerate(explained_per_tick) if i == 0 or explained_per_tick[i - 1][0] != s}
    assert [n for _, n in explained_per_tick] == [int(i in firsts) for i in range(len(explained_per_tick))]

    received = await jobs.handle(job_id).query("explained")
    queued = "Queued for a federation peer to report free capacity: "
    home = "no matching backend on marin"  # the home cluster has CPUs only
    assert received == [
        f"{queued}full on cw-a (needs 8 h100); {home}; cw-b unreachable",
        f"{queued}full on cw-a, cw-b (needs 8 h100); {home}",
        f"{queued}full on cw-b (needs 8 h100); {home}; cw-a unreachable",
        f"{queued}full on cw-a, cw-b (needs 8 h100); {home}",
    ]
    # Each with its code: a peer answers full in every phase, so NoCapacity throughout.
    assert await jobs.handle(job_id).query("codes") == ["NoCapacity"] * 4
    handle = store.get(job_id)
    assert handle is not None and handle.reason == received[-1]
    await jobs.handle(job_id).signal("finish")
