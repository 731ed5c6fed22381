"""PlacementManager: the periodic placement tick (docs/DESIGN.md, "The tick") as an entity workflow.

Ticks every ``interval_s``, at once when a job enters the queue (signal ``wake``), and at once
again after a tick that filled some peer's per-tick cap with jobs left waiting; the tick itself is
one activity. Runs on its own task queue (``<queue>-placement``), so a backlog of job tasks never
delays a tick. Continues as new every ``ticks_per_run`` ticks so its history stays bounded.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.placement import PlacementActivities, TickInput, TickOutcome
    from iris import contract

# A tick that hit the per-peer cap with jobs left waiting is followed at once by another.
RETICK_PATCH = "retick-when-saturated-v1"
TICK_HEARTBEAT_TIMEOUT = timedelta(seconds=5)


class ManagerInput(BaseModel):
    interval_s: float = 1.0
    max_per_peer: int | None = None
    ticks_per_run: int = 200


@workflow.defn(name=contract.PLACEMENT_MANAGER)
class PlacementManager:
    def __init__(self) -> None:
        self._wake = False
        self._last: TickOutcome | None = None
        self._ticks = 0
        self._failures = 0

    @workflow.signal(name=contract.WAKE)
    def wake(self) -> None:
        self._wake = True

    @workflow.query(name=contract.LAST_TICK)
    def last_tick(self) -> TickOutcome | None:
        return self._last

    @workflow.run
    async def run(self, inp: ManagerInput) -> None:
        workflow.set_current_details("Placement tick: matching queued jobs against peer capacity")
        while self._ticks < inp.ticks_per_run:
            self._wake = False
            try:
                self._last = await workflow.execute_activity_method(
                    PlacementActivities.placement_tick,
                    TickInput(max_per_peer=inp.max_per_peer),
                    start_to_close_timeout=timedelta(seconds=30),
                    # A tick lost with its worker is retried after this, not after 30 s.
                    heartbeat_timeout=TICK_HEARTBEAT_TIMEOUT,
                    retry_policy=RetryPolicy(maximum_attempts=2),
                )
            except ActivityError as exc:
                # A failed tick is skipped, never fatal: the next one re-reads everything.
                self._failures += 1
                workflow.logger.warning("placement tick failed: %s", exc.cause or exc)
            self._ticks += 1
            if self._last is not None and self._last.saturated and workflow.patched(RETICK_PATCH):
                continue
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._wake, timeout=timedelta(seconds=inp.interval_s))
        await workflow.wait_condition(workflow.all_handlers_finished)
        # A manager started on the jobs' queue (before it had its own) moves to its own here.
        workflow.continue_as_new(inp, task_queue=contract.placement_task_queue(workflow.info().task_queue))
