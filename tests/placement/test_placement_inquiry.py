"""Queue positions and dry-runs (docs/DESIGN.md, "Queue position and dry-run").

The pure functions (iris/policy/queue.py) against the planner they describe, then the placement
manager's Updates on a Temporal dev server: a real manager run, its local activities reading a real
SQLite federation store, asked through the SDK as `iris job list`, `describe` and `run --dry-run` do.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from placement_harness import GPU_ATTRS, HOME, eventually, unreachable
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from activities.inquiry import InquiryActivities
from activities.placement import PlacementActivities
from iris import contract
from iris.client import AsyncIrisClient, build_spec
from iris.config import FederationConfig
from iris.policy import plan
from iris.policy.models import (
    Availability,
    BackendReport,
    Band,
    Constraint,
    DeviceRequest,
    Disposition,
    JobShape,
    Op,
    PeerReport,
)
from iris.policy.queue import DryRun, Outlook, dry_run, queue_positions
from iris.policy.reasons import ReasonCode
from iris.store import FederationStore, HandleState, JobHandle
from iris.temporal import data_converter
from workflows.placement import ManagerInput, PlacementManager
from workflows.runner import workflow_runner

NOW = 1_800_000_000_000
STALE = 30_000
H100 = DeviceRequest(type="gpu", variant="h100", count=8)


def shape(
    job_id: str, *, device: DeviceRequest = H100, band: Band = Band.INTERACTIVE, at: int = 0, **kw: object
) -> JobShape:
    return JobShape(job_id=job_id, device=device, band=band, submit_ms=NOW - 100_000 + at, **kw)


def gpu_peer(peer_id: str, free: int, *, total: int = 16, last_contact_ms: int = NOW) -> PeerReport:
    backend = BackendReport(
        backend_id=f"h100-{peer_id}",
        advertised_attributes=GPU_ATTRS,
        availability=Availability(
            observation_epoch_ms=1, amounts={"h100": free}, total_amounts={"h100": total}
        ),
    )
    return PeerReport(peer_id=peer_id, last_contact_ms=last_contact_ms, backends=[backend])


def cpu_peer(peer_id: str, free: int = 4) -> PeerReport:
    backend = BackendReport(
        backend_id="cpu",
        advertised_attributes={"device-type": ["cpu"]},
        availability=Availability(observation_epoch_ms=1, amounts={"cpu": free}, total_amounts={"cpu": free}),
    )
    return PeerReport(peer_id=peer_id, last_contact_ms=NOW, backends=[backend])


# marin: CPU only; cw-a 8 free H100, cw-b 16; cw-down unreachable; cw-old last heard from long ago.
FEDERATION = [
    cpu_peer(HOME),
    gpu_peer("cw-a", 8),
    gpu_peer("cw-b", 16),
    unreachable("cw-down"),
    gpu_peer("cw-old", 16, last_contact_ms=NOW - 10 * STALE),
]


def judge(
    job: JobShape, queue: list[JobShape] | None = None, reports: list[PeerReport] | None = None
) -> DryRun:
    return dry_run(
        job, home=HOME, reports=reports or FEDERATION, queue=queue or [], now_ms=NOW, stale_after_ms=STALE
    )


def where(report: DryRun) -> str | None:
    return report.placement.peer_id if report.placement is not None else None


def pos(report: DryRun) -> tuple[int, int]:
    assert report.position is not None
    return report.position.position, report.position.of


def verdicts(report: DryRun) -> dict[str, tuple[str, ...]]:
    """The peers of each verdict (over all its groups: their messages may differ)."""
    out: dict[str, tuple[str, ...]] = {}
    for v in report.verdicts:
        out[v.outlook.value] = out.get(v.outlook.value, ()) + tuple(v.peer_ids)
    return out


# ---- positions -------------------------------------------------------------------------------------


def test_positions_follow_the_planners_order_within_the_jobs_competing_for_a_shape() -> None:
    queue = [
        shape("alice/interactive-early", at=1),
        shape("alice/batch-earliest", band=Band.BATCH, at=0),
        shape("alice/production-late", band=Band.PRODUCTION, at=5),
        shape("alice/cpu", device=DeviceRequest(type="cpu"), at=0),
        shape("alice/pinned", at=2, target_cluster="cw-a"),
        shape("alice/a100", device=DeviceRequest(type="gpu", variant="a100", count=1), at=0),
        shape("alice/h100-in-us", at=0, constraints=(Constraint(key="region", op=Op.EQ, values=("us",)),)),
    ]
    got = queue_positions(queue)
    h100 = {
        j: (p.position, p.of, p.ahead_in_higher_bands) for j, p in got.items() if p.shape.endswith("h100")
    }
    # Band first, then submit time; a pin or a count does not make another shape, a constraint does.
    assert h100 == {
        "alice/production-late": (1, 4, 0),
        "alice/interactive-early": (2, 4, 1),
        "alice/pinned": (3, 4, 1),
        "alice/batch-earliest": (4, 4, 3),
    }
    assert (got["alice/cpu"].position, got["alice/cpu"].of) == (1, 1)
    assert (got["alice/a100"].position, got["alice/a100"].of) == (1, 1)
    assert (got["alice/h100-in-us"].position, got["alice/h100-in-us"].of) == (1, 1)
    assert got["alice/h100-in-us"].shape == "device-type=gpu, device-variant=h100, region=us"
    assert {p.queued for p in got.values()} == {7}
    assert got["alice/pinned"].describe() == (
        "3 of 4 waiting for device-type=gpu, device-variant=h100 (1 ahead in a higher band)"
    )
    # Asked for some: only those, and a job not queued is left out.
    assert set(queue_positions(queue, ["alice/cpu", "alice/gone"])) == {"alice/cpu"}


@pytest.mark.parametrize("seed", range(20))
def test_with_room_for_k_the_planner_places_exactly_positions_1_to_k(seed: int) -> None:
    """The position is the planner's order: with room for k one-chip jobs of a shape, the tick
    places exactly the jobs at positions 1..k (whatever their bands, submit times and ids)."""
    rng = random.Random(seed)
    one_chip = DeviceRequest(type="gpu", variant="h100", count=1)
    queue = [
        shape(
            f"u{rng.randrange(5)}/job-{i}",
            device=one_chip,
            band=rng.choice(list(Band)),
            at=rng.randrange(50),
        )
        for i in range(rng.randrange(5, 40))
    ]
    room = rng.randrange(0, len(queue) + 2)
    reports = [cpu_peer(HOME), gpu_peer("cw-a", room, total=max(room, 1))]
    placed = {
        p.job_id for p in plan(queue, home=HOME, reports=reports, now_ms=NOW, stale_after_ms=STALE).placements
    }
    # Fair share reads the federation's totals from the reports, as the tick does.
    positions = queue_positions(queue, reports=reports)
    assert placed == {j for j, p in positions.items() if p.position <= room}


# ---- dry-run -----------------------------------------------------------------------------------------


def test_dry_run_names_the_chosen_peer_and_every_others_verdict() -> None:
    report = judge(shape("alice/new", at=50))
    assert report.disposition is Disposition.QUEUE
    # The tightest fit is cw-a (8 free for 8); cw-b has room too.
    assert where(report) == "cw-a"
    assert verdicts(report) == {
        Outlook.CHOSEN.value: ("cw-a",),
        Outlook.FITS.value: ("cw-b",),
        Outlook.NO_SHAPE.value: (HOME,),
        Outlook.UNREACHABLE.value: ("cw-down",),
        Outlook.STALE.value: ("cw-old",),
    }
    assert pos(report)[0] == 1


def test_dry_run_counts_the_jobs_ahead_and_not_those_behind() -> None:
    ahead = shape("alice/ahead", at=1)
    behind = shape("alice/behind", at=90)
    report = judge(shape("alice/new", at=50), queue=[ahead, behind])
    # The job ahead takes cw-a; the new one goes to cw-b; the one behind changes nothing.
    assert where(report) == "cw-b"
    assert verdicts(report)[Outlook.FULL.value] == ("cw-a",)
    full = next(v for v in report.verdicts if v.outlook is Outlook.FULL)
    assert full.message == "full: needs 8 h100 at band interactive, 0 available"
    assert pos(report) == (2, 3)  # the job behind still competes for the shape
    assert report.queued == 2

    # Three ahead fill both peers: it would wait, and says why, with the tick's code.
    queue = [shape(f"alice/ahead-{i}", at=i) for i in range(3)]
    waiting = judge(shape("alice/new", at=50), queue=queue)
    assert waiting.placement is None
    assert waiting.waiting is not None and "full on cw-a, cw-b" in waiting.waiting
    assert waiting.code is not None and waiting.code.waiting
    assert verdicts(waiting)[Outlook.FULL.value] == ("cw-a", "cw-b")
    assert pos(waiting)[0] == 4

    # A production job goes ahead of them all.
    urgent = judge(shape("alice/urgent", band=Band.PRODUCTION, at=50), queue=queue)
    assert where(urgent) == "cw-a" and pos(urgent)[0] == 1


def test_dry_run_of_a_shape_nobody_has_is_a_rejection_with_each_peers_reason() -> None:
    report = judge(shape("alice/b200", device=DeviceRequest(type="gpu", variant="b200", count=1)))
    assert report.rejected
    assert report.placement is None
    assert verdicts(report)[Outlook.NO_SHAPE.value] == (HOME, "cw-a", "cw-b")
    messages = {v.message for v in report.verdicts if v.outlook is Outlook.NO_SHAPE}
    assert messages == {"no backend with device-type=gpu", "no backend with device-variant=b200"}


def test_dry_run_of_pinned_and_local_jobs() -> None:
    pinned = judge(shape("alice/pinned", target_cluster="CW-B"))
    assert pinned.disposition is Disposition.QUEUE and pinned.pinned_cluster == "cw-b"
    assert verdicts(pinned) == {Outlook.CHOSEN.value: ("cw-b",)}

    unknown = judge(shape("alice/pinned", target_cluster="cw-nowhere"))
    assert unknown.rejected
    assert verdicts(unknown) == {Outlook.UNKNOWN_PEER.value: ("cw-nowhere",)}

    local = judge(shape("alice/cpu", device=DeviceRequest(type="cpu")))
    assert local.disposition is Disposition.LOCAL
    assert where(local) == HOME
    assert verdicts(local)[Outlook.CHOSEN.value] == (HOME,)


# ---- through the placement manager ------------------------------------------------------------------


@pytest.fixture
async def manager(
    temporal: WorkflowEnvironment, store: FederationStore, config: FederationConfig
) -> AsyncIterator[tuple[Client, FederationConfig, str]]:
    """A placement manager of its own task queue, ticking once (at start), then only asked."""
    cfg = config.model_copy(deep=True)
    cfg.temporal.task_queue = f"inquiry-{uuid.uuid4().hex[:8]}"
    cfg.tick_interval_s = 60  # the ticks' own word on the interval (at most a minute)
    queue = contract.placement_task_queue(cfg.temporal.task_queue)
    inquiry = InquiryActivities(cfg, store)
    worker = Worker(
        temporal.client,
        task_queue=queue,
        workflows=[PlacementManager],
        activities=[
            PlacementActivities(cfg, store).placement_tick,
            inquiry.read_queue_positions,
            inquiry.plan_dry_run,
        ],
        workflow_runner=workflow_runner(),
    )
    async with worker:
        handle = await temporal.client.start_workflow(
            PlacementManager.run,
            ManagerInput(interval_s=3600, inquiries_per_run=3),
            id=contract.manager_workflow_id(cfg.temporal.task_queue),
            task_queue=queue,
        )
        await eventually(
            lambda: handle.query(PlacementManager.last_tick), lambda t: t is not None, what="a tick"
        )
        try:
            yield temporal.client, cfg, handle.id
        finally:
            await temporal.client.get_workflow_handle(handle.id).terminate()


def handle_of(job: JobShape) -> JobHandle:
    return JobHandle(job_id=job.job_id, incarnation="inc-1", state=HandleState.QUEUED_HANDOFF, shape=job)


async def test_the_manager_answers_positions_and_dry_runs_from_the_store(
    manager: tuple[Client, FederationConfig, str], store: FederationStore
) -> None:
    client, cfg, _ = manager
    now = int(time.time() * 1000)
    jobs = [
        shape("alice/first", at=0).model_copy(update={"submit_ms": now - 3000}),
        shape("alice/second", at=0).model_copy(update={"submit_ms": now - 2000}),
        shape("bob/batch", band=Band.BATCH).model_copy(update={"submit_ms": now - 5000}),
        shape("bob/cpu", device=DeviceRequest(type="cpu")).model_copy(update={"submit_ms": now - 1000}),
    ]
    for job in jobs:
        store.enqueue(handle_of(job))
    # One peer with room for one 8-chip job: the dry-run judges the stored reports, not live ones.
    fresh = [r.model_copy(update={"last_contact_ms": now}) for r in (cpu_peer(HOME), gpu_peer("cw-a", 8))]
    store.save_reports([*fresh, unreachable("cw-down")])

    iris = AsyncIrisClient(client, cfg, principal="alice")
    positions = await iris.queue_positions(["first", "second", "bob/batch", "bob/cpu", "alice/not-queued"])
    assert {j: (p.position, p.of) for j, p in positions.items()} == {
        "alice/first": (1, 3),
        "alice/second": (2, 3),
        "bob/batch": (3, 3),
        "bob/cpu": (1, 1),
    }
    assert await iris.position("second") == positions["alice/second"]

    spec = build_spec(["python", "train.py"], name="new", user="alice", device_type="h100", gpu_count=8)
    report = await iris.dry_run(spec)
    assert report.job_id == "alice/new" and report.disposition is Disposition.QUEUE
    # alice/first takes cw-a's 8 chips before it; alice/second too is ahead of it.
    assert report.placement is None and report.code is not None
    assert {v.outlook: tuple(v.peer_ids) for v in report.verdicts} == {
        Outlook.FULL: ("cw-a",),
        Outlook.NO_SHAPE: (HOME,),
        Outlook.UNREACHABLE: ("cw-down",),
    }
    assert pos(report) == (3, 4)
    assert report.queued == 4
    # Nothing was started or stored: the queue is as it was.
    assert sorted(h.job_id for h in store.queued()) == sorted(j.job_id for j in jobs)

    rejected = await iris.dry_run(
        build_spec(["true"], name="b200", user="alice", device_type="b200", gpu_count=1)
    )
    assert rejected.rejected and ReasonCode.ShapeMismatch.value not in (rejected.waiting or "")


async def test_the_manager_continues_as_new_after_its_inquiries_with_every_one_answered(
    manager: tuple[Client, FederationConfig, str], store: FederationStore
) -> None:
    client, cfg, manager_id = manager
    first_run = (await client.get_workflow_handle(manager_id).describe()).run_id
    store.enqueue(handle_of(shape("alice/only")))
    # The job's workflow stands in as a run no worker polls: each new manager run ticks at its
    # start, and a tick that signals a job whose workflow does not exist abandons its handle.
    await client.start_workflow(
        contract.JOB_WORKFLOW,
        id=contract.job_workflow_id("alice/only"),
        task_queue=f"nobody-polls-{uuid.uuid4().hex[:8]}",
        execution_timeout=timedelta(minutes=2),
    )
    iris = AsyncIrisClient(client, cfg, principal="alice")
    # inquiries_per_run is 3: eight questions at once span at least two runs, none is lost.
    answers = await asyncio.gather(*(iris.queue_positions(["alice/only"]) for _ in range(8)))
    assert all(a["alice/only"].position == 1 for a in answers)
    old = client.get_workflow_handle(manager_id, run_id=first_run)
    await eventually(
        old.describe,
        lambda d: d.status == WorkflowExecutionStatus.CONTINUED_AS_NEW,
        what="the manager's first run to continue as new",
    )
    history = await old.fetch_history()
    accepted = [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
    ]
    completed = [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED
    ]
    # Every Update the run accepted, it answered before continuing as new.
    assert len(accepted) >= 3 and len(completed) == len(accepted)
    # The run's history, Updates and local activities included, replays against the code.
    replayer = Replayer(
        workflows=[PlacementManager],
        workflow_runner=workflow_runner(),
        data_converter=data_converter(),
    )
    await replayer.replay_workflow(history, raise_on_replay_failure=True)
    # And the new run answers too.
    assert (await iris.position("only")) is not None
