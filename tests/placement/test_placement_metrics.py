"""What a real tick exports (docs/DESIGN.md, "Metrics"): the queue by band, device variant and reason,
each peer's reachability and free devices, the tick's duration; a label set the next tick does not
see goes to 0. Real ticks (store, planner, signals to a stand-in job on a Temporal dev server) with
the activity's metric meter on the worker's real Prometheus exporter (iris/temporal.py), scraped
over HTTP."""

from __future__ import annotations

import httpx
import pytest
from exposition import Series, exposition
from placement_harness import (
    GPU_BACKEND,
    OTHER,
    PEER,
    Jobs,
    gpu_backend,
    gpu_job,
    new_job_id,
    reachable,
    tick_activities,
    unreachable,
    view,
)
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

import activities.placement as placement_module
from activities.placement import TickInput, TickOutcome
from iris import devstack, metrics
from iris.config import FederationConfig
from iris.policy.reasons import ReasonCode
from iris.reports import FederationView
from iris.store import FederationStore
from iris.temporal import metrics_runtime

# The meter's own labels (iris/metrics.py): left out of the comparisons.


def scrape(port: int) -> Series:
    """Every sample under the name it is exported with (as the Prometheus server stores it)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return exposition(text)


def of(series: Series, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: value for (n, labels), value in series.items() if n == name}


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


async def test_a_tick_exports_the_queue_the_peers_and_its_duration(
    temporal: WorkflowEnvironment,
    jobs: Jobs,
    store: FederationStore,
    config: FederationConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = devstack.free_port()
    runtime = metrics_runtime(f"127.0.0.1:{port}")
    assert runtime is not None
    env = ActivityEnvironment(client=temporal.client)
    env.metric_meter = runtime.metric_meter

    job_id = new_job_id("metrics")
    store.enqueue(gpu_job(job_id, gpus=8))
    await jobs.start(job_id)
    views = iter(
        [
            # cw-a has 4 chips free: the 8-chip job waits; cw-b does not answer.
            view(reachable(PEER, gpu_backend(4, epoch=1)), unreachable(OTHER)),
            # cw-a has room: the job is placed (offered, on its way out of the queue); cw-a then
            # answers no more, cw-b does.
            view(reachable(PEER, gpu_backend(16, epoch=2)), reachable(OTHER)),
            view(unreachable(PEER), reachable(OTHER)),
        ]
    )
    real_gather = placement_module.gather_reports

    async def federation(asked: object, **kw: object) -> FederationView:
        if asked is not config:  # another tick in this process (a session stack's worker)
            return await real_gather(asked, **kw)  # type: ignore[arg-type]
        return next(views)

    monkeypatch.setattr(placement_module, "gather_reports", federation)
    acts = tick_activities(config, store)

    async def tick() -> TickOutcome:
        outcome: TickOutcome = await env.run(acts._tick, TickInput())
        return outcome

    first = await tick()
    assert first.queued == 1 and first.placed == []
    seen = scrape(port)
    queued = of(seen, metrics.QUEUED_JOBS)
    assert len(queued) == 1, queued
    ((waiting, count),) = queued.items()
    assert count == 1
    reason = dict(waiting).pop("reason")
    assert reason in {c.value for c in ReasonCode if c.waiting}
    assert dict(waiting) == {"band": "interactive", "device_variant": "h100", "reason": reason}
    assert of(seen, metrics.PEER_REACHABLE) == {
        labels(peer="marin"): 1,
        labels(peer=PEER): 1,
        labels(peer=OTHER): 0,
    }
    assert of(seen, metrics.PEER_FREE_DEVICES) == {labels(peer=PEER, backend=GPU_BACKEND, device="h100"): 4}
    assert of(seen, metrics.PLACEMENT_TICK + "_count") == {labels(): 1}
    # Buckets in seconds (iris/metrics.py HISTOGRAM_BUCKETS), not the SDK's milliseconds.
    buckets = {float(dict(k)["le"]) for k in of(seen, metrics.PLACEMENT_TICK + "_bucket")}
    assert buckets == {*metrics.HISTOGRAM_BUCKETS[metrics.PLACEMENT_TICK], float("inf")}

    second = await tick()
    assert second.placed == [job_id]
    seen = scrape(port)
    # The waiting label set vanished with the placement: 0, not its last value.
    assert of(seen, metrics.QUEUED_JOBS) == {waiting: 0}
    assert of(seen, metrics.PEER_REACHABLE)[labels(peer=OTHER)] == 1
    assert of(seen, metrics.PEER_FREE_DEVICES) == {labels(peer=PEER, backend=GPU_BACKEND, device="h100"): 16}

    third = await tick()
    assert third.offered == 1  # still offered: not planned, not counted
    seen = scrape(port)
    assert of(seen, metrics.QUEUED_JOBS) == {waiting: 0}
    assert of(seen, metrics.PEER_REACHABLE)[labels(peer=PEER)] == 0
    # A peer that stops answering has its free devices at 0, not at its last report's.
    assert of(seen, metrics.PEER_FREE_DEVICES) == {labels(peer=PEER, backend=GPU_BACKEND, device="h100"): 0}
    assert of(seen, metrics.PLACEMENT_TICK + "_count") == {labels(): 3}

    # A worker whose ticks stopped zeroes what it shows (docs/DESIGN.md, "Metrics").
    acts.metrics.expire()
    seen = scrape(port)
    assert set(of(seen, metrics.PEER_REACHABLE).values()) == {0}
    await jobs.handle(job_id).signal("finish")
