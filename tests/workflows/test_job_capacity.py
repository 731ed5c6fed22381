"""What a job holds of the federation's capacity, and whether it can ever have it (issue 27,
points 3 and 4): a job no backend of its shape can ever hold is REJECTED at classification
(``TooLarge``, SIZE_PATCH; docs/DESIGN.md, "Classification": "Never fits"), and a parked job frees
its reservation at once when it is known not to run, taking it again through the CAS when an
operator replays it in place (PARK_PATCH; docs/DESIGN.md, "Errors, retries and parking").

The fake federation: marin (home, CPU only), cw-a (16 H100 in all), cw-b (8 H100 in all).
"""

from __future__ import annotations

from typing import Any

from job_doubles import (
    HOME,
    OTHER_BACKEND,
    OTHER_PEER,
    PEER,
    PEER_BACKEND,
    Accept,
    Federation,
    LoseReply,
    Outage,
    gpu_spec,
    messages,
    states,
    wait_for,
    wait_for_state,
)
from temporalio.client import WorkflowHandle

from iris.controller.models import ControllerJobState
from iris.jobs import JobState, JobStatus, ReplayRequest
from iris.policy.models import BackendReport, DeviceRequest, PeerReport
from iris.policy.reasons import ReasonCode
from iris.store.models import HandleState, PromoteOutcome
from workflows.job import BASELINE_2027_02_PATCH, JobWorkflow

ARTIFACT = "s3://ckpt/llama-70b"
MISSING = f"Artifact {ARTIFACT} missing in {PEER}'s object store"
GPU_ATTRS = {"device-type": ["gpu"], "device-variant": ["h100"]}


def h100(count: int, replicas: int = 1) -> DeviceRequest:
    return DeviceRequest(type="gpu", variant="h100", count=count, replicas=replicas)


async def rejected(fed: Federation, handle: WorkflowHandle[Any, JobStatus]) -> JobStatus:
    st = await fed.result(handle)
    assert (st.state, st.reason_code) == (JobState.REJECTED, ReasonCode.TooLarge), st.reason
    # Rejected at classification: nothing enqueued, reserved or launched.
    assert fed.fake.enqueued == [] and fed.fake.promotions == [] and fed.fake.launch_attempts == []
    return st


# ---- never fits (SIZE_PATCH) ------------------------------------------------------------------------


async def test_a_gang_larger_than_every_backend_is_rejected_naming_the_largest(fed: Federation) -> None:
    st = await rejected(fed, await fed.start(gpu_spec("huge", fed.now_ms, device=h100(32))))

    assert st.reason == (
        f"no backend can ever hold it: needs 32 h100 on one backend; the largest matching is "
        f"{PEER}/{PEER_BACKEND} with 16"
    )
    assert st.classification_reason == st.reason and st.disposition == "reject"


async def test_three_replicas_of_eight_are_one_gang_of_24(fed: Federation) -> None:
    st = await rejected(fed, await fed.start(gpu_spec("gang", fed.now_ms, device=h100(8, replicas=3))))

    assert "needs 24 h100 on one backend (3 replicas × 8)" in st.reason
    assert st.reason.endswith(f"the largest matching is {PEER}/{PEER_BACKEND} with 16")


async def test_a_pinned_job_is_measured_against_its_cluster(fed: Federation) -> None:
    st = await rejected(
        fed, await fed.start(gpu_spec("pinned", fed.now_ms, device=h100(16), target_cluster=OTHER_PEER))
    )
    assert st.reason.endswith(f"the largest matching is {OTHER_PEER}/{OTHER_BACKEND} with 8")


async def test_what_the_largest_backend_holds_is_queued(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("sixteen", fed.now_ms, device=h100(8, replicas=2)))
    assert (await handle.query(JobWorkflow.status)).disposition == "queue"


async def test_a_peer_that_never_reported_is_unknown_and_the_job_queues(fed: Federation) -> None:
    """cw-a has never reported (its shapes as configured, no totals): it might hold 32 H100, so the
    job waits for it instead of being rejected on cw-b's 8."""
    view = fed.fake.view
    never = PeerReport(peer_id=PEER, reachable=True, last_contact_ms=None)
    fed.fake.view = view.model_copy(
        update={
            "reports": [never if r.peer_id == PEER else r for r in view.reports],
            "configured": {PEER: [BackendReport(backend_id=PEER_BACKEND, advertised_attributes=GPU_ATTRS)]},
        }
    )
    handle = await fed.queued(gpu_spec("unknown", fed.now_ms, device=h100(32)))

    st = await handle.query(JobWorkflow.status)
    assert (st.state, st.disposition) == (JobState.QUEUED_HANDOFF, "queue")
    assert st.reason_code is not ReasonCode.TooLarge
    assert [e.shape.job_id for e in fed.fake.enqueued] == [st.job_id]


async def test_the_rejection_is_recorded_behind_its_patch(fed: Federation) -> None:
    handle = await fed.start(gpu_spec("marked", fed.now_ms, device=h100(32)))
    await rejected(fed, handle)
    markers = [
        e.marker_recorded_event_attributes.details["patch-data"].payloads[0].data
        async for e in handle.fetch_history_events()
        if e.HasField("marker_recorded_event_attributes")
    ]
    # A new run takes SIZE_PATCH and PARK_PATCH through the baseline (BASELINE_2027_02_PATCH), its one
    # marker.
    assert len(markers) == 1 and BASELINE_2027_02_PATCH.encode() in markers[0], markers


# ---- a parked job frees its capacity (PARK_PATCH) -----------------------------------------------


async def parked(fed: Federation, name: str, **kw: Any) -> WorkflowHandle[Any, JobStatus]:
    """A queued job placed on cw-a, which lacks its artifact: parked in HANDOFF_FAILED."""
    fed.fake.missing = {PEER: {ARTIFACT}}
    handle = await fed.queued(gpu_spec(name, fed.now_ms, artifacts=[ARTIFACT], **kw))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert (st.reason, st.cluster) == (MISSING, PEER)
    return handle


async def test_a_park_before_the_launch_releases_the_reservation_at_once(fed: Federation) -> None:
    await parked(fed, "frees")

    # One write: the handle parked and its reservation deleted, with the park's reason.
    assert fed.fake.handle_states[-1] == (HandleState.HANDOFF_FAILED, MISSING)
    assert fed.fake.releases == [MISSING]
    assert fed.fake.launch_attempts == []


async def test_a_replay_in_place_takes_the_capacity_again_through_the_cas(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked(fed, "retaken")
    fake.missing = {}  # the operator uploads the artifact

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(reason="uploaded"))
    st = await fed.result(handle)

    assert (st.state, st.cluster, st.backend_id) == (JobState.SUCCEEDED, PEER, PEER_BACKEND)
    # The same placement, promoted again as a retake, before the second artifact check.
    assert [(p.peer_id, p.backend_id) for p in fake.promotions] == [(PEER, PEER_BACKEND)] * 2
    assert fake.retakes == fake.promotions[1:] and fake.requeued == []
    assert f"promoted to {PEER}/{PEER_BACKEND}: operator replay in place: capacity taken again" in messages(
        st
    )
    # Straight from the park to the handoff: it never went back through the queue.
    assert states(st)[3:6] == [JobState.HANDOFF_FAILED, JobState.PENDING_HANDOFF, JobState.HANDED_OFF]
    assert fake.delivered == 1


async def test_a_replay_in_place_whose_capacity_was_taken_waits_in_the_queue(fed: Federation) -> None:
    """Another job took cw-a's capacity while this one was parked: the CAS refuses the retake (no
    over-commit), and the job goes back to the queue until the tick places it."""
    fake = fed.fake
    handle = await parked(fed, "taken")
    fake.missing = {}
    fake.promote = [PromoteOutcome.NO_CAPACITY, PromoteOutcome.PROMOTED]

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())
    st = await wait_for_state(handle, JobState.QUEUED_HANDOFF)

    assert st.reason_code is ReasonCode.NoCapacity
    assert fake.retakes == [fake.promotions[1]] and fake.requeued == [st.job_id]
    assert fake.delivered == 0  # nothing launched on the capacity it no longer holds
    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)  # the tick finds room on cw-b
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert [c for c, _ in fake.deliveries] == [OTHER_PEER]


async def test_a_replay_elsewhere_goes_through_the_queue_as_before(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked(fed, "elsewhere")

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=OTHER_PEER))
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert fake.retakes == [] and fake.requeued == [st.job_id]


async def test_a_park_whose_launch_outcome_is_unknown_keeps_its_reservation_until_reconciled(
    fed: Federation,
) -> None:
    """Exactly once first: the launch went unanswered and cw-a is silent, so the job may be running
    there on the capacity it reserved; the park keeps it. Once cw-a answers that it never received
    the job, the reservation is released."""
    fake = fed.fake
    fake.launch = [Outage("connection reset")]
    fake.silent.add(PEER)
    handle = await fed.queued(gpu_spec("unknown-outcome", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    assert "the outcome is unknown" in st.reason
    assert fake.handle_ends[-1] is HandleState.HANDOFF_FAILED and fake.releases == []

    fake.silent.clear()
    await wait_for(
        handle, lambda s: "confirms it never received" in s.reason, "reconciled", env=fed.env, skip_s=5.0
    )
    await wait_for(handle, lambda _: bool(fake.releases), "released", env=fed.env, skip_s=1.0)

    assert fake.releases == [
        f"Handoff to {PEER} failed after retries; {PEER} confirms it never received the job"
    ]
    fake.launch = [Accept()]
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())
    st = await fed.skip_to_end(handle)
    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert fake.retakes == fake.promotions[1:2] and fake.delivered == 1


async def test_a_launch_that_may_have_landed_is_never_released_while_its_cluster_is_silent(
    fed: Federation,
) -> None:
    """The launch landed (the job runs on cw-a) and the reply was lost; cw-a then stays silent: the
    reservation stays, and a replay in place repeats the launch without a retake (same nonce)."""
    fake = fed.fake
    fake.launch = [LoseReply(ControllerJobState.RUNNING, then_silent=True)]
    handle = await fed.queued(gpu_spec("landed", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    await fed.env.sleep(120)  # probes go unanswered

    assert "the outcome is unknown" in st.reason
    assert fake.releases == [] and fake.retakes == []
    assert fake.remote_state(PEER, st.job_id) is ControllerJobState.RUNNING
    fake.silent.clear()  # so the test's leftover cancel is confirmed at once


async def test_a_job_at_home_frees_home_s_capacity_when_it_parks(fed: Federation) -> None:
    fake = fed.fake
    fake.missing = {HOME: {"gs://data/x"}}
    spec = gpu_spec("home", fed.now_ms, device=DeviceRequest(), artifacts=["gs://data/x"])
    handle = await fed.start(spec)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)

    assert st.cluster == HOME and fake.releases == [st.reason]
    fake.missing = {}
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())
    st = await fed.result(handle)
    assert (st.state, st.cluster) == (JobState.SUCCEEDED, HOME)
    assert [p.peer_id for p in fake.retakes] == [HOME]
