"""A handoff that cannot complete (docs/DESIGN.md, "Errors, retries and parking"): a cluster's
refusal ends the job (HANDOFF_REJECTED); a missing artifact or bundle, or an outage past the
retries, parks it in HANDOFF_FAILED until an operator replays it (``replay_handoff``) or it is
cancelled."""

from __future__ import annotations

from typing import Any

import pytest
from job_doubles import (
    BUNDLE,
    HOME,
    OTHER_BACKEND,
    OTHER_PEER,
    PEER,
    PEER_BACKEND,
    Accept,
    Federation,
    Outage,
    Refuse,
    Unavailable,
    cpu_spec,
    gpu_spec,
    messages,
    states,
    wait_for_state,
)
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from iris.jobs import CancelRequest, JobState, JobStatus, ReplayRequest
from iris.store.models import HandleState
from workflows.job import CANCELLED_WHILE_PARKED, JobWorkflow

ARTIFACT = "s3://ckpt/llama-70b"
MISSING = f"Artifact {ARTIFACT} missing in {PEER}'s object store"


async def parked_on_missing_artifact(fed: Federation, **kw: Any) -> WorkflowHandle[Any, JobStatus]:
    """A queued job placed on cw-a, which lacks its artifact: parked in HANDOFF_FAILED."""
    fed.fake.missing = {PEER: {ARTIFACT}}
    handle = await fed.queued(gpu_spec("parked", fed.now_ms, artifacts=[ARTIFACT], **kw))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert (st.reason, st.cluster) == (MISSING, PEER)
    return handle


def why(refused: pytest.ExceptionInfo[WorkflowUpdateFailedError]) -> str:
    """The Update validator's refusal, as the operator's CLI shows it."""
    cause = refused.value.cause
    assert isinstance(cause, ApplicationError)
    return cause.message


async def test_a_missing_artifact_parks_the_job_until_an_operator_replays_it(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked_on_missing_artifact(fed)
    assert fake.handle_ends == [HandleState.HANDOFF_FAILED]
    assert fake.handle_states[-1] == (HandleState.HANDOFF_FAILED, MISSING)
    assert fake.launch_attempts == [] and fake.delivered == 0

    fake.missing = {}  # the operator uploads the artifact
    answer = await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(reason="uploaded"))
    st = await fed.result(handle)

    assert answer == "replay accepted: to the same cluster (uploaded)"
    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert "operator replay: to the same cluster (uploaded)" in messages(st)
    assert states(st)[3:6] == [JobState.HANDOFF_FAILED, JobState.PENDING_HANDOFF, JobState.HANDED_OFF]
    assert [c for c, _ in fake.artifact_checks] == [PEER, PEER]
    assert fake.delivered == 1 and st.handoff_attempts == 1


async def test_a_replay_back_to_the_queue_waits_for_a_new_placement(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked_on_missing_artifact(fed)

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(requeue=True))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    assert fake.requeued == [handle.id]
    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)  # cw-b has the artifact
    st = await fed.result(handle)

    assert (st.state, st.cluster, st.backend_id) == (JobState.SUCCEEDED, OTHER_PEER, OTHER_BACKEND)
    assert [p.peer_id for p in fake.promotions] == [PEER, OTHER_PEER]
    assert [c for c, _ in fake.deliveries] == [OTHER_PEER]


async def test_a_replay_to_another_peer_is_promoted_there_without_waiting_for_a_tick(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked_on_missing_artifact(fed)

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=OTHER_PEER))
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert fake.requeued == [handle.id]
    forced = fake.promotions[-1]
    assert (forced.peer_id, forced.forced) == (OTHER_PEER, True)
    # A forced placement names no backend: the peer's matching backend is used.
    assert fake.launch_requests[0].request.backend_id == OTHER_BACKEND


async def test_a_job_that_ran_at_home_can_be_replayed_to_a_peer_through_the_queue(fed: Federation) -> None:
    """Its home reservation's handle goes back to the queue, then is force-placed on the peer."""
    fake = fed.fake
    fake.missing = {HOME: {"gs://data/x"}}
    handle = await fed.start(cpu_spec("local", fed.now_ms, artifacts=["gs://data/x"]))
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert st.cluster == HOME and len(fake.enqueued) == 1

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=PEER))
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert len(fake.enqueued) == 1 and fake.requeued == [st.job_id]
    assert [c for c, _ in fake.deliveries] == [PEER]


async def test_replay_is_refused_unless_the_job_is_parked(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("queued", fed.now_ms))

    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())

    assert why(refused) == (
        f"job {handle.id} is QUEUED_HANDOFF: replay-handoff applies to jobs parked in HANDOFF_FAILED"
    )


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (ReplayRequest(peer="cw-nowhere"), "unknown cluster 'cw-nowhere' (known: marin, cw-a, cw-b)"),
        (ReplayRequest(peer=PEER, requeue=True), "choose --peer or --requeue, not both"),
    ],
    ids=["unknown-peer", "peer-and-requeue"],
)
async def test_replay_refuses_a_request_it_cannot_carry_out(
    fed: Federation, request_: ReplayRequest, message: str
) -> None:
    handle = await parked_on_missing_artifact(fed)

    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update(JobWorkflow.replay_handoff, request_)

    assert why(refused) == message
    # Refused in the validator: nothing recorded, still parked.
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert not any(m.startswith("operator replay") for m in messages(st))


async def test_a_job_pinned_to_a_peer_cannot_be_replayed_to_another(fed: Federation) -> None:
    handle = await parked_on_missing_artifact(fed, target_cluster=PEER)

    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=OTHER_PEER))

    assert why(refused) == f"job {handle.id} is pinned to {PEER}; it cannot be replayed to {OTHER_PEER}"


async def test_a_job_pinned_to_home_cannot_be_replayed_to_a_peer(fed: Federation) -> None:
    fed.fake.missing = {HOME: {"gs://data/x"}}
    handle = await fed.start(
        cpu_spec("home-pinned", fed.now_ms, target_cluster=HOME, artifacts=["gs://data/x"])
    )
    await wait_for_state(handle, JobState.HANDOFF_FAILED)

    try:
        await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=PEER))
    except WorkflowUpdateFailedError:
        refused = True
    else:
        refused = False
        await fed.result(handle)  # accepted: the job runs on the peer, against its pin

    assert refused
    assert fed.fake.deliveries == []


async def test_a_cancel_while_parked_kills_the_job_and_wins(fed: Federation) -> None:
    handle = await parked_on_missing_artifact(fed)

    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="give up"))
    st = await fed.result(handle)

    assert (outcome.won, outcome.state) == (True, JobState.KILLED)
    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_WHILE_PARKED)
    assert fed.fake.delivered == 0 and fed.fake.terminations == []
    assert fed.fake.handle_ends == [HandleState.HANDOFF_FAILED, HandleState.KILLED]


async def test_a_temporal_cancel_while_parked_kills_the_job(fed: Federation) -> None:
    handle = await parked_on_missing_artifact(fed)

    await handle.cancel()
    st = await fed.result(handle)

    assert st.state is JobState.KILLED
    assert fed.fake.delivered == 0


async def test_a_launch_the_cluster_refuses_ends_handoff_rejected_without_retrying(fed: Federation) -> None:
    fake = fed.fake
    fake.launch = [Refuse("cw-a refused the job: alice is not an allowed submitter")]
    handle = await fed.queued(gpu_spec("refused", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (
        JobState.HANDOFF_REJECTED,
        "cw-a refused the job: alice is not an allowed submitter",
    )
    assert fake.launch_attempts == [PEER] and fake.delivered == 0
    assert fake.handle_ends == [HandleState.HANDOFF_REJECTED]


async def test_a_launch_outage_past_the_retry_budget_parks_the_job_until_replayed(fed: Federation) -> None:
    """Time skipping: six attempts with 1-10 s backoff, in a fraction of a second."""
    fake = fed.fake
    fake.launch = [Outage("cw-a: 503 service unavailable")]
    handle = await fed.queued(gpu_spec("outage", fed.now_ms))
    await fed.place(handle)

    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    # The cluster answers the reconciliation: it never received the job (so a replay anywhere is safe).
    assert st.reason == (
        f"Handoff to {PEER} failed after retries: cw-a: 503 service unavailable; "
        f"{PEER} confirms it never received the job"
    )
    assert fake.launch_attempts == [PEER] * 6
    assert fake.handle_ends == [HandleState.HANDOFF_FAILED]

    fake.launch = [Accept()]  # the peer is back
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())
    st = await fed.result(handle)

    assert (st.state, st.cluster, st.handoff_attempts) == (JobState.SUCCEEDED, PEER, 2)
    assert fake.delivered == 1


async def test_a_bundle_the_cluster_refuses_ends_handoff_rejected_never_delivered(fed: Federation) -> None:
    fake = fed.fake
    fake.stage = [Refuse(f"cw-a refused workspace bundle {BUNDLE.short}: sha256 mismatch")]
    handle = await fed.queued(gpu_spec("bad-bundle", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (
        JobState.HANDOFF_REJECTED,
        f"cw-a refused workspace bundle {BUNDLE.short}: sha256 mismatch",
    )
    # The one launch was answered "no such bundle": nothing was received.
    assert fake.stagings == [PEER] and fake.launch_attempts == [PEER] and fake.deliveries == []


async def test_a_bundle_missing_from_the_home_store_parks_the_job_until_restored(fed: Federation) -> None:
    fake = fed.fake
    fake.stage = [Unavailable()]
    handle = await fed.queued(gpu_spec("no-bundle", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)

    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert st.reason == Unavailable().message
    assert fake.stagings == [PEER] and fake.launch_attempts == [PEER] and fake.deliveries == []

    fake.stage = [Accept()]  # the operator restores the bundle
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest())
    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert fake.stagings == [PEER, PEER] and fake.delivered == 1
    assert states(st).count(JobState.BUILDING) == 2


async def test_a_staging_outage_past_the_retry_budget_parks_the_job(fed: Federation) -> None:
    fake = fed.fake
    fake.stage = [Outage("cw-a: connection refused")]
    handle = await fed.queued(gpu_spec("stage-outage", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)

    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)

    assert st.reason == f"Cannot stage the workspace bundle on {PEER}: cw-a: connection refused"
    assert fake.stagings == [PEER] * 6 and fake.launch_attempts == [PEER] and fake.deliveries == []


async def test_a_parked_job_replayed_to_the_same_cluster_keeps_its_backend(fed: Federation) -> None:
    fake = fed.fake
    fake.stage = [Unavailable()]
    handle = await fed.queued(gpu_spec("same", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)
    await wait_for_state(handle, JobState.HANDOFF_FAILED)
    fake.stage = [Accept()]

    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=PEER))
    st = await fed.result(handle)

    assert (st.cluster, st.backend_id) == (PEER, PEER_BACKEND)
    # Not through the queue: the park freed its capacity, the replay took it again by the CAS.
    assert (
        fake.requeued == []
        and [(p.peer_id, p.backend_id) for p in fake.promotions] == [(PEER, PEER_BACKEND)] * 2
    )
    assert fake.retakes == fake.promotions[1:]
