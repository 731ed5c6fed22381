"""PlacementManager: the periodic placement tick (docs/DESIGN.md, "The tick") as an entity workflow.

Ticks every ``interval_s``, at once when a job enters the queue (signal ``wake``), and at once
again after a tick that filled some peer's per-tick cap with jobs left waiting; the tick itself is
one activity. Runs on its own task queue (``<queue>-placement``), so a backlog of job tasks never
delays a tick. Continues as new every ``ticks_per_run`` ticks so its history stays bounded.

It also answers what clients ask of the queue (docs/DESIGN.md, "Queue position and dry-run"): the
Updates ``queue_positions`` and ``dry_run`` each run one local activity that reads the store and
plans, writing nothing. They count towards continuing as new (``inquiries_per_run``, and a history
grown past ``INQUIRY_HISTORY_BYTES``), which waits for every handler to finish first.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.inquiry import (
        MAX_POSITION_IDS,
        DryRunRequest,
        InquiryActivities,
        PositionsAnswer,
        PositionsRequest,
    )
    from activities.placement import PlacementActivities, TickInput, TickOutcome
    from iris import contract
    from iris.policy.queue import DryRun

import workflows.versions as versions

TICK_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
INQUIRY_TIMEOUT = timedelta(seconds=20)
# A run that answered inquiries continues as new once its history is this large, whatever its tick
# count: each answer (a few KiB, up to a page of positions) is kept in the history twice.
INQUIRY_HISTORY_BYTES = 4_194_304  # 4 MiB


class ManagerInput(BaseModel):
    # The wait between ticks until a tick says its worker's own (TickOutcome.interval_s): the
    # settings are the ticking worker's config, read at every tick, since a running manager
    # outlives worker restarts and upgrades (docs/DESIGN.md, "Handoff pacing").
    # (An input from before also names a cap, ``max_per_peer``, which decoding ignores.)
    interval_s: float = 1.0
    ticks_per_run: int = 200
    # Updates answered per run (each adds ~6 events and its answer to the history).
    inquiries_per_run: int = 200


@workflow.defn(name=contract.PLACEMENT_MANAGER)
class PlacementManager:
    def __init__(self) -> None:
        self._wake = False
        self._last: TickOutcome | None = None
        self._ticks = 0
        self._failures = 0
        self._inquiries = 0

    @workflow.signal(name=contract.WAKE)
    def wake(self) -> None:
        self._wake = True

    @workflow.query(name=contract.LAST_TICK)
    def last_tick(self) -> TickOutcome | None:
        return self._last

    @workflow.update(name=contract.QUEUE_POSITIONS)
    async def queue_positions(self, request: PositionsRequest) -> PositionsAnswer:
        """Where the asked jobs stand in the queue (those not queued are left out)."""
        self._inquiries += 1
        return await workflow.execute_local_activity_method(
            InquiryActivities.read_queue_positions,
            request,
            start_to_close_timeout=INQUIRY_TIMEOUT,
            retry_policy=RetryPolicy(maximum_attempts=2),
        )

    @queue_positions.validator
    def _check_positions(self, request: PositionsRequest) -> None:
        # Refused before acceptance: nothing of a malformed question reaches the history.
        if len(request.job_ids) > MAX_POSITION_IDS:
            raise ValueError(f"at most {MAX_POSITION_IDS} job ids per question")

    @workflow.update(name=contract.DRY_RUN)
    async def dry_run(self, request: DryRunRequest) -> DryRun:
        """What a job submitted now would do: classification, position and each peer's verdict."""
        self._inquiries += 1
        return await workflow.execute_local_activity_method(
            InquiryActivities.plan_dry_run,
            request,
            start_to_close_timeout=INQUIRY_TIMEOUT,
            retry_policy=RetryPolicy(maximum_attempts=2),
        )

    def _inquired_enough(self, inp: ManagerInput) -> bool:
        """A run that answered many inquiries continues as new early (never one that answered
        none: older histories, which have no Updates, replay unchanged)."""
        if self._inquiries == 0:
            return False
        info = workflow.info()
        return (
            self._inquiries >= inp.inquiries_per_run
            or info.get_current_history_size() >= INQUIRY_HISTORY_BYTES
            or info.is_continue_as_new_suggested()
        )

    def _interval_s(self, inp: ManagerInput) -> float:
        """The last tick's word on the interval (its worker's config), else the input's. Taken
        from the recorded outcome, so a replay waits as the run did."""
        last = self._last.interval_s if self._last is not None else None
        return last if last is not None else inp.interval_s

    @workflow.run
    async def run(self, inp: ManagerInput) -> None:
        workflow.set_current_details("Placement tick: matching queued jobs against peer capacity")
        while self._ticks < inp.ticks_per_run and not self._inquired_enough(inp):
            self._wake = False
            try:
                self._last = await workflow.execute_activity_method(
                    PlacementActivities.placement_tick,
                    TickInput(),
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
            if self._last is not None and self._last.saturated and versions.retick_when_saturated():
                continue
            with contextlib.suppress(TimeoutError):
                # Enough inquiries end the wait too: the run continues as new without waiting for
                # the interval (a run with none waits exactly as before).
                await workflow.wait_condition(
                    lambda: self._wake or self._inquired_enough(inp),
                    timeout=timedelta(seconds=self._interval_s(inp)),
                )
        # Every Update accepted so far is answered first: none is lost to the continue-as-new.
        await workflow.wait_condition(workflow.all_handlers_finished)
        # A manager started on the jobs' queue (before it had its own) moves to its own here.
        workflow.continue_as_new(inp, task_queue=contract.placement_task_queue(workflow.info().task_queue))
