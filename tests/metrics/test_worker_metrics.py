"""The worker's iris_* metrics outside the tick (docs/DESIGN.md, "Metrics"): handoffs by outcome from
the launch activity, the mirror's propagation lag, a stale worker's tick gauges. Each through the
worker's real Prometheus exporter (iris/temporal.py), scraped over HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from exposition import exposition
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import watch
from activities.peers import LaunchInput, PeerActivities, handoff_outcome
from activities.placement import TickMetrics
from activities.watch import MirrorLag, change_time_ms
from iris import devstack, metrics
from iris.config import FederationConfig
from iris.controller.errors import (
    AlreadyExists,
    ControllerError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from iris.controller.models import ControllerJobState, LaunchRequest
from iris.controller.models import JobStatus as ControllerJobStatus
from iris.policy.models import Band, DeviceRequest, JobShape, PeerReport, WaitingGroup
from iris.policy.reasons import ReasonCode
from iris.reports import FederationView
from iris.temporal import metrics_runtime


class Exporter:
    """A real SDK runtime serving Prometheus on a free port, as `iris worker --metrics-address`."""

    def __init__(self) -> None:
        self.port = devstack.free_port()
        runtime = metrics_runtime(f"127.0.0.1:{self.port}")
        assert runtime is not None
        self.meter: MetricMeter = runtime.metric_meter

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        return {labels: value for (n, labels), value in exposition(text).items() if n == name}


@pytest.fixture
def exporter() -> Exporter:
    return Exporter()


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


# ---- handoffs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (Unavailable("connect: refused"), "unreachable"),
        (InvalidArgument("no such backend"), "refused"),
        (PermissionDenied("not allowed"), "refused"),
        (AlreadyExists("another requester"), "refused"),
        (Unauthenticated("token refused"), "error"),
    ],
)
def test_each_launch_error_has_its_outcome(error: ControllerError, outcome: str) -> None:
    assert handoff_outcome(error) == outcome
    assert outcome in metrics.HANDOFF_OUTCOMES


def _config(down_port: int) -> FederationConfig:
    return FederationConfig.model_validate(
        {
            "home": "marin",
            "clusters": [
                {"name": "marin", "port": devstack.free_port(), "backends": [{"id": "cpu", "cpu_slots": 1}]},
                # Nothing listens there.
                {"name": "cw-down", "port": down_port, "backends": [{"id": "cpu", "cpu_slots": 1}]},
            ],
        }
    )


def _launch(cluster: str) -> LaunchInput:
    request = LaunchRequest(
        job_id="alice/metrics",
        requester="marin",
        nonce="n-1",
        user="alice",
        band=Band.INTERACTIVE,
        backend_id="cpu",
        command=["true"],
    )
    return LaunchInput(cluster=cluster, request=request)


async def test_the_launch_activity_counts_each_request_by_peer_and_outcome(exporter: Exporter) -> None:
    acts = PeerActivities(_config(devstack.free_port()), request_timeout_s=1.0)
    env = ActivityEnvironment()
    env.metric_meter = exporter.meter
    for _ in range(2):
        with pytest.raises(ControllerError):
            await env.run(acts.launch_job, _launch("cw-down"))
    with pytest.raises(ApplicationError, match="unknown cluster"):
        await env.run(acts.launch_job, _launch("cw-nowhere"))
    assert exporter.series(metrics.HANDOFFS) == {
        labels(peer="cw-down", outcome="unreachable"): 2,
        labels(peer="cw-nowhere", outcome="error"): 1,
    }


# ---- the mirror's propagation lag ----------------------------------------------------------------


def _status(job_id: str, state: ControllerJobState, **times: int) -> ControllerJobStatus:
    return ControllerJobStatus(
        job_id=job_id,
        state=state,
        backend_id="cpu",
        band=Band.INTERACTIVE,
        user="alice",
        requester="marin",
        nonce="n-1",
        created_ms=times.pop("created_ms", 1),
        **times,
    )


def test_a_change_dates_from_when_its_state_began() -> None:
    assert change_time_ms(_status("a", ControllerJobState.PENDING, created_ms=10)) == 10
    assert change_time_ms(_status("a", ControllerJobState.RUNNING, started_ms=20)) == 20
    assert change_time_ms(_status("a", ControllerJobState.SUCCEEDED, started_ms=20, finished_ms=30)) == 30


class FrozenClock:
    """``activities.watch``'s ``time`` module with ``time()`` stopped at ``now_ms``: a lag is then
    exactly what the test states, however long the test takes."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def time(self) -> float:
        return self.now_ms / 1000

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


async def test_only_new_changes_are_measured(exporter: Exporter, monkeypatch: pytest.MonkeyPatch) -> None:
    lag = MirrorLag(exporter.meter, "cw-a")
    now = int(time.time() * 1000)
    monkeypatch.setattr(watch, "time", FrozenClock(now))
    # The listing: what each job already was (not a change).
    lag.known([_status("listed", ControllerJobState.RUNNING, started_ms=now - 60_000)])
    same = _status("listed", ControllerJobState.RUNNING, started_ms=now - 60_000)
    assert lag.changed_at(same) is None  # a task's change: the same state since the same time
    ended = _status("listed", ControllerJobState.SUCCEEDED, started_ms=now - 60_000, finished_ms=now - 2_000)
    assert lag.changed_at(ended) == now - 2_000
    assert lag.changed_at(ended) is None  # brought again
    fresh = _status("fresh", ControllerJobState.PENDING, created_ms=now - 500)
    assert lag.changed_at(fresh) == now - 500
    lag.forget(["fresh"])
    assert lag.changed_at(fresh) == now - 500  # removed, then seen again: new to this watcher
    lag.record(now - 2_000)
    lag.record(now + 5_000)  # a controller clock ahead of ours: 0, not negative
    assert exporter.series(metrics.MIRROR_LAG + "_count") == {labels(peer="cw-a"): 2}
    assert exporter.series(metrics.MIRROR_LAG + "_sum") == {labels(peer="cw-a"): 2.0}
    buckets = exporter.series(metrics.MIRROR_LAG + "_bucket")
    assert buckets[labels(peer="cw-a", le="1")] == 1  # the clock-ahead one, at 0
    assert buckets[labels(peer="cw-a", le="2.5")] == 2


# ---- a stale worker's tick gauges ----------------------------------------------------------------


def _tick_view(*peers: PeerReport) -> FederationView:
    return FederationView(home="marin", stale_after_ms=30_000, reports=list(peers))


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock the test sets: TickMetrics arms its staleness timer on the running
    loop, so the test moves time past a deadline instead of sleeping until it (a loaded machine
    would let a real sleep overshoot the bound the test means to stay within)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def at(self, now: float) -> None:
        """Move the clock to ``now`` and run what is due (timers included)."""
        self.now = now
        self.run_until_complete(asyncio.sleep(0))  # not a wait: one turn runs what is due


def test_a_worker_that_stops_ticking_zeroes_its_gauges(exporter: Exporter) -> None:
    tick = TickMetrics(stale_after_s=0.5)
    shape = JobShape(job_id="alice/cpu", device=DeviceRequest(), band=Band.BATCH)
    waiting = [WaitingGroup(job_ids=["alice/cpu"], summary="full", code=ReasonCode.NoCapacity)]

    async def ticked() -> None:
        tick.record(
            exporter.meter,
            queued=[shape],
            waiting=waiting,
            view=_tick_view(PeerReport(peer_id="cw-a")),
            seconds=0.01,
        )

    queued = labels(band="batch", device_variant="cpu", reason="NoCapacity")
    loop = ClockLoop()
    try:
        loop.run_until_complete(ticked())  # at 0: stale at 0.5 unless it ticks again
        assert exporter.series(metrics.QUEUED_JOBS) == {queued: 1}
        assert exporter.series(metrics.PEER_REACHABLE) == {labels(peer="cw-a"): 1}
        # Ticking again within the bound keeps them: past the first tick's bound, within the second's.
        loop.at(0.3)
        loop.run_until_complete(ticked())
        loop.at(0.6)
        assert exporter.series(metrics.QUEUED_JOBS) == {queued: 1}
        # No tick for the whole bound: every series it showed is 0.
        loop.at(0.8)
        assert exporter.series(metrics.QUEUED_JOBS) == {queued: 0}
        assert exporter.series(metrics.PEER_REACHABLE) == {labels(peer="cw-a"): 0}
    finally:
        loop.close()


def test_a_tick_shows_each_users_devices_by_band_and_dominant_share(exporter: Exporter) -> None:
    """Fair share at the metrics endpoint (docs/DESIGN.md, "Fair share and aging"): what each user's
    jobs hold, by band, and the share that orders them; a user whose jobs ended drops to 0."""
    tick = TickMetrics(stale_after_s=60)
    h100 = PeerReport.model_validate(
        {
            "peer_id": "cw-a",
            "backends": [
                {
                    "backend_id": "b",
                    "advertised_attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
                    "availability": {
                        "observation_epoch_ms": 1,
                        "amounts": {"h100": 4},
                        "total_amounts": {"h100": 16},
                    },
                }
            ],
        }
    )

    def gpu(job_id: str, count: int, band: Band) -> JobShape:
        return JobShape(
            job_id=job_id, device=DeviceRequest(type="gpu", variant="h100", count=count), band=band
        )

    async def ticked(in_use: list[JobShape]) -> None:
        tick.record(exporter.meter, queued=[], waiting=[], view=_tick_view(h100), seconds=0.01, in_use=in_use)

    loop = ClockLoop()
    try:
        loop.run_until_complete(
            ticked(
                [
                    gpu("alice/a", 8, Band.BATCH),
                    gpu("alice/b", 2, Band.INTERACTIVE),
                    gpu("bob/c", 2, Band.BATCH),
                ]
            )
        )
        assert exporter.series(metrics.USER_DEVICES) == {
            labels(user="alice", band="batch"): 8,
            labels(user="alice", band="interactive"): 2,
            labels(user="bob", band="batch"): 2,
        }
        assert exporter.series(metrics.USER_SHARE) == {labels(user="alice"): 0.625, labels(user="bob"): 0.125}
        loop.run_until_complete(ticked([gpu("bob/c", 2, Band.BATCH)]))
        assert exporter.series(metrics.USER_DEVICES)[labels(user="alice", band="batch")] == 0
        assert exporter.series(metrics.USER_SHARE) == {labels(user="alice"): 0.0, labels(user="bob"): 0.125}
    finally:
        loop.close()
