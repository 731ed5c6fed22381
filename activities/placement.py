"""The placement tick's I/O: poll every controller, expire, plan with the policy, signal the jobs.

One activity per tick keeps the manager's history small: the signals to the chosen job workflows
are sent from here, concurrently, instead of one workflow command each.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel
from temporalio import activity

from iris.config import FederationConfig
from iris.jobs import workflow_id
from iris.policy import plan_request
from iris.policy.models import PlanRequest
from iris.reports import gather_reports
from iris.store import FederationStore


class TickInput(BaseModel):
    max_per_peer: int | None = None


class TickOutcome(BaseModel):
    """What one tick did, for the manager's query and the benchmarks."""

    at_ms: int
    queued: int
    placed: list[str]
    expired: list[str]
    explained: int
    reachable: list[str]
    unreachable: list[str]
    plan_ms: float
    total_ms: float


class PlacementActivities:
    def __init__(self, config: FederationConfig, store: FederationStore) -> None:
        self._config = config
        self._store = store

    async def _signal(self, job_id: str, name: str, arg: object) -> None:
        handle = activity.client().get_workflow_handle(workflow_id(job_id))
        try:
            await (handle.signal(name) if arg is None else handle.signal(name, arg))
        except Exception as exc:  # a job that ended meanwhile; the next tick sees its handle
            activity.logger.info("signal %s to %s failed: %s", name, job_id, exc)

    @activity.defn
    async def placement_tick(self, inp: TickInput) -> TickOutcome:
        started = time.perf_counter()
        view = await gather_reports(self._config)
        store = self._store
        await asyncio.to_thread(store.save_reports, view.reports)
        now_ms = int(time.time() * 1000)
        expired = await asyncio.to_thread(store.expire_due, now_ms)
        reports = await asyncio.to_thread(store.load_reports)
        await asyncio.to_thread(store.prune_reservations, reports)
        queued = await asyncio.to_thread(store.queued)
        reservations = await asyncio.to_thread(store.reservations)
        t0 = time.perf_counter()
        result = plan_request(
            PlanRequest(
                home=view.home,
                jobs=[h.shape for h in queued],
                reports=reports,
                reservations=reservations,
                now_ms=now_ms,
                stale_after_ms=view.stale_after_ms,
                max_per_peer=inp.max_per_peer,
            )
        )
        plan_ms = (time.perf_counter() - t0) * 1000
        reasons = {job_id: group.summary for group in result.waiting for job_id in group.job_ids}
        changed = await asyncio.to_thread(store.update_reasons, reasons)
        sends: list[tuple[str, str, object]] = [(j, "expire", None) for j in [*expired, *result.expired]]
        sends += [(p.job_id, "place", p) for p in result.placements]
        sends += [(j, "explain", reasons[j]) for j in changed]
        await asyncio.gather(*(self._signal(j, name, arg) for j, name, arg in sends))
        return TickOutcome(
            at_ms=now_ms,
            queued=len(queued),
            placed=[p.job_id for p in result.placements],
            expired=sorted({*expired, *result.expired}),
            explained=len(changed),
            reachable=[r.peer_id for r in view.reports if r.reachable],
            unreachable=[r.peer_id for r in view.reports if not r.reachable],
            plan_ms=plan_ms,
            total_ms=(time.perf_counter() - started) * 1000,
        )
