"""What one job costs the engine (issue 9): the store writes other than the promotion CAS are
local activities, search attributes are upserted only when they change, and a burst of submissions
shares one capacity read. Each test fails on the code before that change.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path

from stack import Stack
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.testing import ActivityEnvironment

from activities.peers import MirrorInput, PeerActivities
from iris.contract import job_workflow_id
from iris.jobs import JobState
from iris.policy.models import Availability, BackendReport, DeviceRequest, JobShape, PeerReport, Placement
from iris.store import FederationStore, JobHandle
from workflows.job import BASELINE_2027_02_PATCH

H100 = {"device_type": "h100", "gpu_count": 8}
BACKENDS = "GET /v1/backends"


async def history_of(stack: Stack, job_id: str) -> WorkflowHistory:
    """The closed run's whole history (the status turns terminal before the last store write)."""
    handle = stack.client.get_workflow_handle(job_workflow_id(job_id))
    await handle.result()
    return await handle.fetch_history()


def decoded(payloads: object) -> list[object]:
    return [json.loads(p.data) for p in getattr(payloads, "payloads", [])]


async def test_a_queued_jobs_store_writes_are_local_activities(
    stack: Stack,
) -> None:
    job_id = await stack.iris.submit(["true"], name="cost-queued", target_cluster="cw-rno2a", **H100)
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    history = await history_of(stack, job_id)
    scheduled = Counter(
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    )
    # The capacity read keeps the first workflow task free of local activities (an Update accepted
    # there); the promotion CAS is a local activity in the task that took the placement and
    # schedules the launch (job-baseline-2027-02; docs/DESIGN.md, "Promotion (the CAS)").
    # The attempt is followed through its cluster's watcher, with no activity while it runs; one
    # mirror_job reads its end and relays its output, a local activity in the task that took the
    # watcher's signal (docs/DESIGN.md, "The change feed": local-end-confirm-v1). The submitter's
    # signature is checked first, on the queue, in the same activity as the capacity read
    # (admit_submission, the job-baseline-2027-01 baseline; docs/DESIGN.md, "User → home").
    expected = {"admit_submission": 1, "launch_job": 1}
    assert scheduled == Counter(expected), scheduled
    markers = [
        e.marker_recorded_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
    ]
    local_types = Counter(
        decoded(m.details["data"])[0]["activity_type"]  # type: ignore[index]
        for m in markers
        if m.marker_name == "core_local_activity"
    )
    # The enqueue, the promotion, the store's HANDED_OFF and SUCCEEDED, and the read of the end.
    expected_local = {"enqueue_job": 1, "promote_job": 1, "set_handle_state": 2, "mirror_job": 1}
    assert local_types == Counter(expected_local), local_types
    # One patch marker for the whole run: every earlier patch comes through the baseline (docs/
    # DESIGN.md, "One marker per run"), so one TemporalChangeVersion upsert, not one per patch.
    taken = [decoded(m.details["patch-data"])[0] for m in markers if m.marker_name == "core_patch"]
    assert taken == [{"id": BASELINE_2027_02_PATCH, "deprecated": False}], taken
    change_versions = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
        and "TemporalChangeVersion"
        in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    ]
    assert len(change_versions) == 1


async def test_the_state_search_attribute_is_upserted_only_when_it_changes(stack: Stack) -> None:
    job_id = await stack.iris.submit(["true"], name="cost-upserts", target_cluster="cw-rno2a", **H100)
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    history = await history_of(stack, job_id)
    states: list[str] = []
    for e in history.events:
        if e.event_type != EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            continue
        fields = e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        if "IrisState" in fields:
            states.append(json.loads(fields["IrisState"].data))
    # CLASSIFYING is set by the client at start; every upsert after that is a new state.
    assert states, "no state upserts"
    assert states[0] != JobState.CLASSIFYING.value
    assert all(a != b for a, b in itertools.pairwise(states)), states
    assert states[-1] == JobState.SUCCEEDED.value


async def test_a_burst_of_classifications_shares_one_capacity_read(stack: Stack) -> None:
    activities = PeerActivities(stack.config, reports_reuse_s=0.5)
    env = ActivityEnvironment()
    proxy = stack.proxies["cw-rno2a"]
    before = proxy.requests[BACKENDS]
    views = await asyncio.gather(*(env.run(activities.fetch_reports) for _ in range(30)))
    burst = proxy.requests[BACKENDS] - before
    assert len({v.fetched_ms for v in views}) == 1  # one read answered all 30
    # One read from the burst; the stack's placement tick may poll once or twice meanwhile.
    assert burst <= 3, burst
    # Past the reuse window the next caller reads again.
    await asyncio.sleep(0.6)  # not a wait: real time must pass the 0.5 s reuse window
    later = await env.run(activities.fetch_reports)
    assert later.fetched_ms is not None and views[0].fetched_ms is not None
    assert later.fetched_ms > views[0].fetched_ms


async def test_the_worker_reuses_its_connections_to_a_controller(stack: Stack) -> None:
    """A job's end is read with requests to its cluster (status, log): the worker's activities share
    one client per cluster, so a burst of ends reuses open connections (docs/DESIGN.md,
    "Controller costs"); before, each read connected anew."""
    job_id = await stack.iris.submit(["true"], name="cost-conns", target_cluster="cw-rno2a", **H100)
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    activities = PeerActivities(stack.config)
    env = ActivityEnvironment()
    proxy = stack.proxies["cw-rno2a"]
    before = proxy.connections_made
    for _ in range(10):
        seen = await env.run(activities.mirror_job, MirrorInput(cluster="cw-rno2a", job_id=job_id))
        assert seen.state.value == "SUCCEEDED"
    await activities.aclose()
    # Ten reads in turn: one connection (the stack's own worker may open one meanwhile).
    assert proxy.connections_made - before <= 2, proxy.connections_made - before


async def test_a_jobs_view_carries_the_home_ledger_only(stack: Stack, tmp_path: Path) -> None:
    """Classification counts home's capacity net of the ledger, and nothing else's; every job's
    history keeps the view it was classified with. So the view carries home's reservations only:
    a sweep's charges on the peers would otherwise ride in every job's history, each history
    growing with the number of jobs placed at the time (26 KiB a job in a 1,000-job sweep)."""
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        home = stack.config.home
        block = Availability(
            version=1, observation_epoch_ms=1, amounts={"h100": 8}, total_amounts={"h100": 8}
        )
        gpu = {"device-type": ["gpu"], "device-variant": ["h100"]}
        stored = [
            PeerReport(
                peer_id=cluster,
                last_contact_ms=1,
                backends=[BackendReport(backend_id=backend, advertised_attributes=gpu, availability=block)],
            )
            for cluster, backend in ((home, "h100-home"), ("cw-rno2a", "h100-rno2a"))
        ]
        store.save_reports(stored)
        for job_id, report in (("at-home", stored[0]), ("on-a-peer", stored[1])):
            device = DeviceRequest(type="gpu", variant="h100", count=1)
            store.enqueue(
                JobHandle(job_id=job_id, incarnation="i", shape=JobShape(job_id=job_id, device=device))
            )
            offer = Placement(
                job_id=job_id,
                peer_id=report.peer_id,
                backend_id=report.backends[0].backend_id,
                observation_epoch_ms=1,
                reserved={"h100": 1},
                verified=True,
            )
            assert store.promote(job_id, "i", offer, 2).promoted
        assert {r.job_id for r in store.reservations()} == {"at-home", "on-a-peer"}
        activities = PeerActivities(stack.config, store=store)
        view = await ActivityEnvironment().run(activities.fetch_reports)
        await activities.aclose()
        assert [r.job_id for r in view.reservations] == ["at-home"]
    finally:
        store.close()
