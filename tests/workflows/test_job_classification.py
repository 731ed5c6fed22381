"""JobWorkflow's first decision (docs/DESIGN.md, "Classification"): run at home now, queue for the
federation, or reject."""

from __future__ import annotations

from job_doubles import (
    HOME,
    HOME_BACKEND,
    OTHER_PEER,
    PEER,
    PEER_BACKEND,
    Federation,
    cpu_spec,
    gpu_spec,
    messages,
    states,
    status,
    wait_for,
    wait_for_state,
)

from iris.jobs import JobState
from iris.policy import QUEUED_REASON, queued_for_peer_reason
from iris.policy.models import DeviceRequest
from iris.store.models import HandleState, PromoteOutcome
from workflows.job import JobWorkflow


async def test_a_job_home_can_run_now_runs_at_home_with_its_capacity_reserved_by_the_cas(
    fed: Federation,
) -> None:
    spec = cpu_spec("hello", fed.now_ms)
    handle = await fed.start(spec)

    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert st.reason == f"Succeeded on {HOME}"
    assert (st.disposition, st.classification_reason) == ("local", f"Runs at home on {HOME}/{HOME_BACKEND}")
    assert (st.cluster, st.backend_id) == (HOME, HOME_BACKEND)
    assert states(st) == [
        JobState.CLASSIFYING,
        JobState.PENDING_HANDOFF,
        JobState.HANDED_OFF,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ]
    assert f"Accepted by the home cluster {HOME}" in messages(st)
    # Home's capacity is taken through the queue's CAS, as a promotion by the tick does: a burst
    # of submits never runs more at home than home has room for (docs/DESIGN.md, "The ledger").
    fake = fed.fake
    assert [e.shape.job_id for e in fake.enqueued] == [spec.job_id]
    assert [(p.peer_id, p.backend_id) for p in fake.promotions] == [(HOME, HOME_BACKEND)]
    assert fake.handle_ends == [HandleState.HANDED_OFF, HandleState.SUCCEEDED]
    assert fake.deliveries == [(HOME, f"{spec.job_id}@{spec.submit_ms}")]
    request = fake.launch_requests[0].request
    assert (request.requester, request.backend_id, request.command) == (HOME, HOME_BACKEND, spec.command)


async def test_a_job_only_a_peer_can_run_waits_in_the_queue_until_placed(fed: Federation) -> None:
    spec = gpu_spec("train", fed.now_ms, scheduling_timeout_s=600)
    handle = await fed.queued(spec)

    st = await status(handle)
    assert (st.state, st.reason) == (JobState.QUEUED_HANDOFF, QUEUED_REASON)
    assert st.disposition == "queue"
    assert st.cluster is None
    (enqueued,) = fed.fake.enqueued
    assert enqueued.incarnation == f"{spec.job_id}@{spec.submit_ms}"
    assert enqueued.shape == spec.shape()
    # Nothing happens until the placement tick answers.
    assert fed.fake.promotions == [] and fed.fake.delivered == 0


async def test_a_job_no_backend_can_host_is_rejected_without_touching_the_queue(fed: Federation) -> None:
    spec = gpu_spec("tpu", fed.now_ms, device=DeviceRequest(type="tpu", variant="v5e", count=4))
    handle = await fed.start(spec)

    st = await fed.result(handle)

    assert st.state is JobState.REJECTED
    assert st.reason.startswith("no backend in the federation satisfies device-type")
    assert st.disposition == "reject"
    assert states(st) == [JobState.CLASSIFYING, JobState.REJECTED]
    assert fed.fake.enqueued == [] and fed.fake.launch_attempts == []


async def test_a_job_pinned_to_an_unknown_cluster_is_rejected(fed: Federation) -> None:
    spec = gpu_spec("pinned", fed.now_ms, target_cluster="cw-nowhere")
    st = await fed.result(await fed.start(spec))

    assert st.state is JobState.REJECTED
    assert st.reason.startswith("unknown cluster 'cw-nowhere' (known: ")
    assert fed.fake.enqueued == []


async def test_a_job_pinned_to_a_peer_queues_for_that_peer_even_if_home_could_run_it(fed: Federation) -> None:
    spec = cpu_spec("pinned", fed.now_ms, target_cluster=OTHER_PEER.upper())
    handle = await fed.queued(spec)

    st = await status(handle)
    assert st.reason == queued_for_peer_reason(OTHER_PEER)
    # The queue holds the resolved pin, whatever case the user typed.
    assert fed.fake.enqueued[0].shape.target_cluster == OTHER_PEER


async def test_a_job_pinned_to_home_runs_at_home(fed: Federation) -> None:
    st = await fed.result(await fed.start(cpu_spec("home", fed.now_ms, target_cluster=HOME)))

    assert (st.state, st.cluster, st.disposition) == (JobState.SUCCEEDED, HOME, "local")
    assert st.classification_reason == f"Pinned to the home cluster {HOME}"
    assert [e.shape.target_cluster for e in fed.fake.enqueued] == [HOME]
    assert [p.peer_id for p in fed.fake.promotions] == [HOME]


async def test_a_local_job_the_cas_refuses_at_home_waits_in_the_queue_and_runs_where_placed(
    fed: Federation,
) -> None:
    """Home filled up between the reports and the promotion: the job is queued, home a candidate."""
    fake = fed.fake
    fake.promote = [PromoteOutcome.NO_CAPACITY, PromoteOutcome.PROMOTED]
    spec = cpu_spec("burst", fed.now_ms)
    handle = await fed.start(spec)
    st = await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    assert st.reason.endswith("(home filled up since the reports were read)")
    assert st.disposition == "queue"
    assert fake.launch_attempts == []

    await fed.place(handle, PEER, PEER_BACKEND)
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert [p.peer_id for p in fake.promotions] == [HOME, PEER]
    assert fake.deliveries == [(PEER, f"{spec.job_id}@{spec.submit_ms}")]


async def test_the_ticks_explanation_becomes_the_pending_reason_without_a_new_event(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("train", fed.now_ms))
    before = await status(handle)
    why = "Queued for a federation peer to report free capacity: cw-a has 4 of the 8 h100 needed free"

    await handle.signal(JobWorkflow.explain, why)

    st = await wait_for(handle, lambda st: st.reason == why, "took the explanation")
    assert st.state is JobState.QUEUED_HANDOFF
    assert st.events == before.events
