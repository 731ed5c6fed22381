"""The placement tick's I/O: poll every controller, expire, plan with the policy, signal the jobs.

One activity per tick keeps the manager's history small: the signals to the chosen job workflows
are sent from here, concurrently, instead of one workflow command each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import MetricGauge, MetricGaugeFloat, MetricMeter
from temporalio.service import RPCError, RPCStatusCode

from iris import contract, metrics
from iris.config import ConfigError, FederationConfig
from iris.controller.client import ControllerClient
from iris.controller.errors import ControllerError, NotFound
from iris.jobs import WaitReason
from iris.policy import HandoffPace, plan_request
from iris.policy.fairshare import Holdings
from iris.policy.models import (
    DeviceRequest,
    FairShare,
    Hold,
    JobShape,
    Placement,
    PlanRequest,
    RunningOn,
    WaitingGroup,
)
from iris.policy.pacing import held_by_cap
from iris.reports import FederationView, gather_reports
from iris.store.models import Fence

ABANDONED = "its workflow closed without ending the job (e.g. terminated from the Web UI)"
# Closed runs that did not end their job themselves (ContinuedAsNew has a successor; Completed did).
ABANDONING_STATUSES = ("Terminated", "Failed", "TimedOut", "Canceled")
# Each look at closed workflows starts a little before the last one ended (visibility lags).
RECONCILE_OVERLAP_S = 120.0
# Closed runs whose job still has a live handle checked per look (a describe and a store write
# each); more wait for the next look, so a mass termination never stalls the tick.
RECONCILE_PER_LOOK = 100
FENCES_PER_TICK = 50
# A held job is signalled again when its held start moves by this much (docs/DESIGN.md, "Backfill").
HOLD_DRIFT_MS = 60_000


def running_on(offer: Placement, now_ms: int) -> RunningOn | None:
    """Where an offered job will hold devices, reckoned from now; None if force-routed."""
    if not offer.backend_id:
        return None
    return RunningOn(peer_id=offer.peer_id, backend_id=offer.backend_id, since_ms=now_ms)


# The tick heartbeats this often; the manager's heartbeat timeout (a few of these) is how soon a
# tick lost with its worker is retried, instead of after the whole start-to-close timeout.
HEARTBEAT_EVERY_S = 1.0


@contextlib.asynccontextmanager
async def heartbeating(every_s: float = HEARTBEAT_EVERY_S) -> AsyncIterator[None]:
    """Heartbeat while the body runs (a tick waits on the store and on every controller)."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


if TYPE_CHECKING:
    from iris.store import FederationStore


# A worker whose ticks have stopped (another worker runs them, or none runs) zeroes its tick gauges
# after this many tick intervals, and never sooner than STALE_GAUGES_MIN_S.
STALE_GAUGES_TICKS = 10
STALE_GAUGES_MIN_S = 30.0

Labels = tuple[tuple[str, str], ...]
# The tick's gauges and their help texts (one text per name: the exporter keys on both).
_GAUGES = {
    metrics.QUEUED_JOBS: "Jobs in the federation queue, by why they wait",
    metrics.PEER_REACHABLE: "1 if the peer answered the last tick's poll",
    metrics.PEER_FREE_DEVICES: "Free devices in the peer's last report",
    metrics.USER_DEVICES: "Devices the user's jobs hold, by band",
    metrics.USER_SHARE: "The user's dominant share of the devices in use (0 to 1)",
}
# The float ones among them.
_FLOAT_GAUGES = frozenset({metrics.USER_SHARE})


def device_variant(device: DeviceRequest) -> str:
    """The ``device_variant`` label of a queued job, as its IrisDeviceVariant search attribute
    (iris/jobs.py, start_search_attributes)."""
    return device.variant if device.count else metrics.CPU_VARIANT


class TickMetrics:
    """What the tick exports through the worker's Prometheus endpoint (docs/DESIGN.md, "Metrics"):
    the queue by band, device variant and reason, each peer's reachability and free devices, and
    the tick's duration.

    A gauge series the last tick did not see (the queue emptied of that reason, a peer's backend
    went away or the peer stopped answering) is set to 0 rather than left at its last value; so is
    every series when this worker has not ticked for ``stale_after_s`` (another worker's ticks, or
    none, would otherwise leave its last view standing: the dashboard takes the max over workers).
    """

    def __init__(self, stale_after_s: float) -> None:
        self._stale_after_s = stale_after_s
        # Gauge name -> the label sets this worker last set non-zero.
        self._shown: dict[str, set[Labels]] = {}
        self._meter: MetricMeter | None = None
        self._expiry: asyncio.TimerHandle | None = None

    def record(
        self,
        meter: MetricMeter,
        *,
        queued: list[JobShape],
        waiting: list[WaitingGroup],
        view: FederationView,
        seconds: float,
        in_use: Sequence[JobShape] = (),
        fair_share: FairShare | None = None,
    ) -> None:
        """Export one tick: ``queued`` the shapes it planned, ``waiting`` why those it left queued
        wait (a job it placed or had already offered is on its way out of the queue: not counted);
        ``in_use`` the jobs holding devices, whose users' devices and shares it shows."""
        shapes = {shape.job_id: shape for shape in queued}
        counts: dict[Labels, int] = {}
        for group in waiting:
            for job_id in group.job_ids:
                shape = shapes.get(job_id)
                if shape is None:
                    continue
                key = (
                    ("band", shape.band.label),
                    ("device_variant", device_variant(shape.device)),
                    ("reason", group.code.value),
                )
                counts[key] = counts.get(key, 0) + 1
        reachable: dict[Labels, int] = {}
        free: dict[Labels, int] = {}
        for report in view.reports:
            reachable[(("peer", report.peer_id),)] = int(report.reachable)
            if not report.reachable:
                continue
            for backend in report.backends:
                amounts = backend.availability.amounts if backend.availability is not None else {}
                where = (("peer", report.peer_id), ("backend", backend.backend_id))
                for token, amount in amounts.items():
                    free[(*where, ("device", token))] = amount
        # Every running job, counted once for both (docs/DESIGN.md, "Fair share and aging").
        held = Holdings(in_use)
        per_user: dict[Labels, int] = {}
        for user, bands in held.devices().items():
            for band, n in bands.items():
                per_user[(("user", user), ("band", band.label))] = n
        share: dict[Labels, float] = {
            (("user", u),): s for u, s in held.shares(view.reports, fair_share or FairShare()).items()
        }
        self._meter = meter
        self._set(meter, metrics.QUEUED_JOBS, counts)
        self._set(meter, metrics.USER_DEVICES, per_user)
        self._set(meter, metrics.USER_SHARE, share)
        self._set(meter, metrics.PEER_REACHABLE, reachable)
        self._set(meter, metrics.PEER_FREE_DEVICES, free)
        meter.create_histogram_float(metrics.PLACEMENT_TICK, "One placement tick, whole", "s").record(seconds)
        self._rearm()

    def _gauge(self, meter: MetricMeter, name: str) -> MetricGauge | MetricGaugeFloat:
        if name in _FLOAT_GAUGES:
            return meter.create_gauge_float(name, _GAUGES[name])
        return meter.create_gauge(name, _GAUGES[name])

    def _set(
        self, meter: MetricMeter, name: str, values: Mapping[Labels, int] | Mapping[Labels, float]
    ) -> None:
        gauge = self._gauge(meter, name)
        for labels in self._shown.get(name, set()) - values.keys():
            gauge.set(0, dict(labels))
        for labels, value in values.items():
            if isinstance(gauge, MetricGaugeFloat):
                gauge.set(float(value), dict(labels))
            else:
                gauge.set(int(value), dict(labels))
        self._shown[name] = {labels for labels, value in values.items() if value}

    def _rearm(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_later(self._stale_after_s, self.expire)

    def expire(self) -> None:
        """Set every gauge series this worker shows to 0 (its view is stale)."""
        self._expiry = None
        if self._meter is None:
            return
        for name, shown in self._shown.items():
            gauge = self._gauge(self._meter, name)
            for labels in shown:
                gauge.set(0, dict(labels))
        self._shown = {}


class TickInput(BaseModel):
    """Nothing: every tick setting is the ticking worker's config, read at each tick (docs/DESIGN.md,
    "Handoff pacing"). A manager started before sends the cap it was started with
    (``max_per_peer``), which decoding ignores."""


class TickOutcome(BaseModel):
    """What one tick did, for the manager's query and the benchmarks."""

    at_ms: int
    queued: int
    # Queued jobs already offered a placement whose answer is awaited (not planned again).
    offered: int = 0
    placed: list[str]
    expired: list[str]
    explained: int
    reachable: list[str]
    unreachable: list[str]
    plan_ms: float
    total_ms: float
    # A waiting job was held back by a peer's per-tick cap, not its pace (iris/policy/pacing.py,
    # held_by_cap): the manager ticks again at once instead of after its interval.
    saturated: bool = False
    # Handles ended because their workflow had closed; attempts confirmed ended on clusters that
    # answer again.
    abandoned: int = 0
    fenced: int = 0
    # The ticking worker's ``tick_interval_s``: the manager waits this long before the next tick
    # (None from a worker before it: the manager's own input).
    interval_s: float | None = None


class PlacementActivities:
    def __init__(
        self,
        config: FederationConfig,
        store: FederationStore,
        *,
        offer_lease_s: float = 5.0,
        reconcile_every_s: float = 1.0,
    ) -> None:
        self._config = config
        self._store = store
        # Placements signalled but not yet answered by the job's promotion (its workflow task may
        # wait behind others): for ``offer_lease_s`` the job is not offered again, and what the
        # offer would reserve is held in the next ticks' plans, so a backlog neither burns the
        # per-peer cap on repeats nor lets one tick's capacity be offered twice. In memory only:
        # after a restart a job is at worst offered twice, which its promotion CAS absorbs.
        self._lease_s = offer_lease_s
        self._offers: dict[str, tuple[float, Placement]] = {}
        # Per job held for (backfill), the hold as last signalled: (peer, backend, start).
        self._holds_sent: dict[str, tuple[str, str, int]] = {}
        # Closed workflows are looked for every ``reconcile_every_s``, since the last look (the first
        # look after a start goes back a day).
        self._reconcile_every_s = reconcile_every_s
        self._reconciled_at = 0.0
        self._reconciled_to = time.time() - 24 * 3600
        # Closed runs already dealt with, (workflow id, run id) -> close time: the overlap lists them
        # again, and they are skipped until they fall out of the window.
        self._reconciled_runs: dict[tuple[str, str], float] = {}
        self.metrics = TickMetrics(max(STALE_GAUGES_MIN_S, STALE_GAUGES_TICKS * config.tick_interval_s))
        # Each cluster's handoff pace (docs/DESIGN.md, "Handoff pacing"), in this process: a tick
        # sends a cluster at most what its bucket holds. Several workers ticking in turn each pace
        # on their own, so the federation's bound is the rate × the workers that tick.
        self._pace = HandoffPace(config.handoffs_per_s) if config.handoffs_per_s is not None else None

    def _holds_moved(self, holds: list[Hold]) -> set[str]:
        """The jobs whose held devices moved since they were last signalled: held anew, on another
        backend, or from a start a minute or more off (a start drifts a little every tick)."""
        moved: set[str] = set()
        sent: dict[str, tuple[str, str, int]] = {}
        for h in holds:
            last = self._holds_sent.get(h.job_id)
            if (
                last is None
                or last[:2] != (h.peer_id, h.backend_id)
                or abs(last[2] - h.start_ms) >= HOLD_DRIFT_MS
            ):
                moved.add(h.job_id)
                last = (h.peer_id, h.backend_id, h.start_ms)
            sent[h.job_id] = last
        self._holds_sent = sent
        return moved

    def _outstanding(self, queued: list[str]) -> dict[str, Placement]:
        """Offers still awaiting their job's answer; answered (no longer queued) or lapsed ones go."""
        now = time.monotonic()
        waiting = set(queued)
        self._offers = {
            job_id: (at, p)
            for job_id, (at, p) in self._offers.items()
            if job_id in waiting and now - at < self._lease_s
        }
        return {job_id: p for job_id, (_, p) in self._offers.items()}

    async def _signal(self, job_id: str, name: str, arg: object) -> bool:
        """Signal the job's workflow; True if it had closed and its live handle was abandoned."""
        handle = activity.client().get_workflow_handle(contract.job_workflow_id(job_id))
        try:
            await (handle.signal(name) if arg is None else handle.signal(name, arg))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                # Its workflow has closed without ending its handle (terminated from the Web UI,
                # say): the handle would be offered capacity first at every tick, for ever.
                abandoned = await asyncio.to_thread(self._store.abandon, job_id, ABANDONED)
                if abandoned:
                    activity.logger.info("job %s: its workflow has closed; its handle is abandoned", job_id)
                return abandoned
            activity.logger.info("signal %s to %s failed: %s", name, job_id, exc)
        return False

    async def _reconcile(self) -> int:
        """End the live handles of jobs whose workflow has closed (docs/DESIGN.md, "The tick"):
        queued handles are caught by their signal; promoted or handed-off ones hold a reservation
        and are found by listing the job workflows closed since the last look.

        Each closed run is dealt with once: a run already seen is skipped while the overlap lists it
        again, a job without a live handle costs nothing more, and at most ``RECONCILE_PER_LOOK``
        runs are checked (described, abandoned) per look, the window moving on only when none is
        left, so that thousands of jobs terminated at once never hold up the tick."""
        now = time.time()
        if now - self._reconciled_at < self._reconcile_every_s:
            return 0
        since = self._reconciled_to - RECONCILE_OVERLAP_S
        stamp = datetime.fromtimestamp(since, UTC).isoformat().replace("+00:00", "Z")
        statuses = ", ".join(f"'{s}'" for s in ABANDONING_STATUSES)
        query = (
            f"WorkflowType = '{contract.JOB_WORKFLOW}' AND ExecutionStatus IN ({statuses})"
            f" AND CloseTime > '{stamp}'"
        )
        fresh: dict[tuple[str, str], float] = {}
        try:
            async for wf in activity.client().list_workflows(query):
                key = (wf.id, wf.run_id)
                if key not in self._reconciled_runs:
                    fresh[key] = wf.close_time.timestamp() if wf.close_time is not None else now
        except RPCError as exc:
            activity.logger.warning("reconcile: cannot list closed jobs: %s", exc.message)
            return 0
        live = await asyncio.to_thread(self._store.live_jobs, sorted({wf_id for wf_id, _ in fresh}))
        abandoned = checked = 0
        complete = True
        for (wf_id, run_id), closed_at in fresh.items():
            if wf_id in live:  # a handle already ended (or none) is left as it is
                if checked >= RECONCILE_PER_LOOK:
                    complete = False
                    continue
                checked += 1
                # Unless a later run of the job (a reset) owns the handle now.
                if not await self._runs(wf_id):
                    abandoned += await asyncio.to_thread(self._store.abandon, wf_id, ABANDONED)
                    live.discard(wf_id)
            self._reconciled_runs[(wf_id, run_id)] = closed_at
        self._reconciled_at = now
        if complete:
            self._reconciled_to = now
        horizon = self._reconciled_to - RECONCILE_OVERLAP_S
        self._reconciled_runs = {k: t for k, t in self._reconciled_runs.items() if t > horizon}
        return abandoned

    async def _runs(self, job_id: str) -> bool:
        """Whether the job's latest workflow run is still running."""
        try:
            desc = await activity.client().get_workflow_handle(contract.job_workflow_id(job_id)).describe()
        except RPCError:
            return False
        return desc.status == WorkflowExecutionStatus.RUNNING

    async def _fence(self, view: FederationView) -> int:
        """Terminate, by nonce, the attempts left on clusters that answer again; forget each one
        its cluster confirms ended (or never had)."""
        reachable = {r.peer_id for r in view.reports if r.reachable}
        due = [f for f in await asyncio.to_thread(self._store.fences) if f.cluster in reachable]

        async def one(fence: Fence) -> bool:
            try:
                async with ControllerClient.for_cluster(self._config, fence.cluster, timeout=5.0) as client:
                    status = await client.terminate(fence.job_id, nonce=fence.nonce)
            except NotFound:
                status = None
            except (ControllerError, ConfigError, KeyError) as exc:
                activity.logger.info("fence %s@%s: %s", fence.nonce, fence.cluster, exc)
                return False
            if status is not None and not status.terminal and status.nonce == fence.nonce:
                return False  # still stopping: again at the next tick
            await asyncio.to_thread(self._store.remove_fence, fence.job_id, fence.nonce)
            activity.logger.info("fence %s on %s: the attempt has ended there", fence.nonce, fence.cluster)
            return True

        done = await asyncio.gather(*(one(f) for f in due[:FENCES_PER_TICK]))
        return sum(done)

    @activity.defn(name=contract.PLACEMENT_TICK)
    async def placement_tick(self, inp: TickInput) -> TickOutcome:
        async with heartbeating():
            return await self._tick(inp)

    async def _tick(self, inp: TickInput) -> TickOutcome:
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
        # The jobs holding devices, whose users' fair share and caps the plan counts: promoted or
        # handed off, and those offered a placement not yet answered (still queued in the store).
        holding = await asyncio.to_thread(store.in_use)
        offered = self._outstanding([h.job_id for h in queued])
        held = [r for p in offered.values() if (r := p.reservation()) is not None]
        planned = [h.shape for h in queued if h.job_id not in offered]
        # An offered job counts where it was offered, from the offer (backfill: its devices'
        # return is reckoned from then).
        holding += [
            h.shape.model_copy(update={"running_on": running_on(offered[h.job_id], now_ms)})
            for h in queued
            if h.job_id in offered
        ]
        paced_at = time.monotonic()
        allowance = self._pace.allowance([r.peer_id for r in reports], paced_at) if self._pace else {}
        t0 = time.perf_counter()
        # In a thread, as the store reads are: with thousands of jobs held the plan takes tens of
        # ms, which on the event loop would hold up every other activity of this worker.
        result = await asyncio.to_thread(
            plan_request,
            PlanRequest(
                home=view.home,
                jobs=planned,
                reports=reports,
                reservations=[*reservations, *held],
                now_ms=now_ms,
                stale_after_ms=view.stale_after_ms,
                # The worker's config, not the manager's input: a manager outlives worker restarts
                # and upgrades (docs/DESIGN.md, "Handoff pacing").
                max_per_peer=self._config.max_per_peer_per_tick,
                allowance=allowance,
                in_use=holding,
                fair_share=self._config.fair_share(),
                backfill=self._config.backfill_policy(),
            ),
        )
        plan_ms = (time.perf_counter() - t0) * 1000
        offered_at = time.monotonic()
        sent: dict[str, int] = {}
        for p in result.placements:
            self._offers[p.job_id] = (offered_at, p)
            sent[p.peer_id] = sent.get(p.peer_id, 0) + 1
        if self._pace is not None:
            self._pace.spend(sent, paced_at)
        reasons = {job_id: group.summary for group in result.waiting for job_id in group.job_ids}
        codes = {job_id: group.code for group in result.waiting for job_id in group.job_ids}
        changed = await asyncio.to_thread(store.update_reasons, reasons, codes)
        sends: list[tuple[str, str, object]] = [
            (j, contract.EXPIRE, None) for j in [*expired, *result.expired]
        ]
        sends += [(p.job_id, contract.PLACE, p) for p in result.placements]
        # The reason with its code (docs/DESIGN.md, "Reason codes"), signalled when either changed,
        # or when the devices held for the job moved (another peer, or a start a minute off).
        moved = self._holds_moved(result.holds)
        hold_for = {h.job_id: h for h in result.holds}
        sends += [
            (
                j,
                contract.EXPLAIN_REASON,
                WaitReason(reason=reasons[j], code=codes[j], hold=hold_for.get(j)),
            )
            for j in sorted({*changed, *moved} & reasons.keys())
        ]
        gone = await asyncio.gather(*(self._signal(j, name, arg) for j, name, arg in sends))
        abandoned = sum(gone) + await self._reconcile()
        fenced = await self._fence(view)
        total_s = time.perf_counter() - started
        self.metrics.record(
            activity.metric_meter(),
            queued=planned,
            waiting=result.waiting,
            view=view,
            seconds=total_s,
            in_use=holding,
            fair_share=self._config.fair_share(),
        )
        return TickOutcome(
            abandoned=abandoned,
            fenced=fenced,
            saturated=held_by_cap(result),
            at_ms=now_ms,
            queued=len(queued),
            offered=len(offered),
            placed=[p.job_id for p in result.placements],
            expired=sorted({*expired, *result.expired}),
            explained=len(changed),
            reachable=[r.peer_id for r in view.reports if r.reachable],
            unreachable=[r.peer_id for r in view.reports if not r.reachable],
            plan_ms=plan_ms,
            total_ms=total_s * 1000,
            interval_s=self._config.tick_interval_s,
        )
