"""A queued job from its placement to its end: the promotion CAS, the artifact check, staging the
workspace bundle (BUILDING), the launch, and the mirror of the job's state on its cluster."""

from __future__ import annotations

import pytest
from job_doubles import (
    BUNDLE,
    HOME,
    OTHER_BACKEND,
    OTHER_PEER,
    PEER,
    PEER_BACKEND,
    Accept,
    AlreadyHeld,
    Federation,
    LoseReply,
    Remote,
    gpu_spec,
    job_lost,
    messages,
    states,
    status,
    wait_for,
    wait_for_state,
)
from temporalio.exceptions import ApplicationError

from iris import contract
from iris.controller.models import ControllerJobState
from iris.jobs import JobState
from iris.policy import CANCELLED_BEFORE_HANDOFF, DEADLINE_PASSED, QUEUED_REASON
from iris.store.models import HandleState, PromoteOutcome


async def test_a_placed_job_is_promoted_staged_launched_and_mirrored_to_its_end(fed: Federation) -> None:
    """The whole path, with the ``status`` query read at each stage."""
    fake = fed.fake
    fake.mirror = []  # the remote job changes state only when the test says so
    spec = gpu_spec("train", fed.now_ms, bundle=BUNDLE, artifacts=["s3://ckpt/llama"])
    fake.hold(contract.FETCH_REPORTS)
    handle = await fed.start(spec)

    await fake.reached(contract.FETCH_REPORTS)
    st = await status(handle)
    assert (st.state, st.reason) == (
        JobState.CLASSIFYING,
        "Classifying against the federation's capacity reports",
    )
    fake.release(contract.FETCH_REPORTS)

    st = await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    assert (st.reason, st.cluster) == (QUEUED_REASON, None)
    fake.hold(contract.STAGE_BUNDLE)
    fake.hold(contract.LAUNCH_JOB)
    fake.launch = [Accept(ControllerJobState.PENDING)]

    await fed.place(handle)

    # The launch goes first (LAUNCH_FIRST_PATCH); the cluster answers that it lacks the bundle.
    await fake.reached(contract.LAUNCH_JOB)
    st = await status(handle)
    assert (st.state, st.reason) == (JobState.PENDING_HANDOFF, f"Awaiting acceptance by {PEER}")
    assert fake.artifact_checks == [(PEER, ["s3://ckpt/llama"])]
    fake.release_and_hold(contract.LAUNCH_JOB)

    await fake.reached(contract.STAGE_BUNDLE)
    st = await status(handle)
    assert (st.state, st.cluster, st.backend_id) == (JobState.BUILDING, PEER, PEER_BACKEND)
    assert st.reason == f"Staging workspace bundle {BUNDLE.describe()} on {PEER}"
    assert fake.deliveries == []
    fake.release(contract.STAGE_BUNDLE)

    await fake.reached(contract.LAUNCH_JOB)
    st = await status(handle)
    assert (st.state, st.reason) == (JobState.PENDING_HANDOFF, f"Awaiting acceptance by {PEER}")
    fake.release(contract.LAUNCH_JOB)

    st = await wait_for_state(handle, JobState.PENDING)
    assert st.reason == f"Waiting for devices on {PEER}"
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.RUNNING)
    st = await wait_for_state(handle, JobState.RUNNING)
    assert st.reason == f"Running on {PEER}"
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    st = await fed.result(handle)

    assert (st.state, st.reason, st.exit_code) == (JobState.SUCCEEDED, f"Succeeded on {PEER}", 0)
    assert states(st) == [
        JobState.CLASSIFYING,
        JobState.QUEUED_HANDOFF,
        JobState.PENDING_HANDOFF,
        JobState.BUILDING,
        JobState.PENDING_HANDOFF,
        JobState.HANDED_OFF,
        JobState.PENDING,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ]
    assert f"promoted to {PEER}/{PEER_BACKEND}: free capacity on {PEER}" in messages(st)
    assert f"workspace bundle {BUNDLE.short} uploaded to {PEER}" in messages(st)
    assert st.handoff_attempts == 1
    assert [t.state for t in st.tasks] == ["SUCCEEDED"]
    # Delivered exactly once, with the bundle's id and the incarnation's nonce: the request sent
    # again after staging is the same one.
    assert fake.deliveries == [(PEER, f"{spec.job_id}@{spec.submit_ms}")]
    first, second = fake.launch_requests
    assert first.request == second.request
    assert (first.stage_missing, second.stage_missing) == (False, True)
    request = first.request
    assert (request.bundle, request.backend_id, request.requester) == (BUNDLE, PEER_BACKEND, HOME)
    assert fake.relayed == [spec.job_id]
    assert fake.handle_ends == [HandleState.HANDED_OFF, HandleState.SUCCEEDED]


async def test_a_job_without_a_workspace_goes_straight_to_the_launch(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("nobundle", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert JobState.BUILDING not in states(st)
    assert fed.fake.stagings == [] and fed.fake.artifact_checks == []


async def test_a_bundle_the_destination_already_holds_is_not_staged_the_job_is_launched(
    fed: Federation,
) -> None:
    """A sweep's jobs after the first: one launch, no staging step, no BUILDING (issue 31)."""
    fake = fed.fake
    fake.bundles.add((PEER, BUNDLE.sha256))
    handle = await fed.queued(gpu_spec("held", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)
    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert JobState.BUILDING not in states(st)
    assert contract.STAGE_BUNDLE not in fake.calls and fake.launch_attempts == [PEER]
    assert fake.launch_requests[0].request.bundle == BUNDLE
    assert st.handoff_attempts == 1


async def test_a_bundle_another_job_staged_meanwhile_is_not_sent_again(fed: Federation) -> None:
    """The launch found the bundle missing; by the staging, another job had sent it."""
    fed.fake.stage = [AlreadyHeld()]
    handle = await fed.queued(gpu_spec("raced", fed.now_ms, bundle=BUNDLE))
    await fed.place(handle)
    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert f"workspace bundle {BUNDLE.short} already on {PEER}" in messages(st)
    assert fed.fake.delivered == 1


async def test_a_refused_promotion_leaves_the_job_queued_for_the_next_placement(fed: Federation) -> None:
    fake = fed.fake
    fake.promote = [PromoteOutcome.NO_CAPACITY, PromoteOutcome.PROMOTED]
    spec = gpu_spec("cas", fed.now_ms)
    handle = await fed.queued(spec)

    await fed.place(handle)
    st = await wait_for(handle, lambda st: st.reason.startswith("Waiting for the next tick"), "was refused")
    assert st.state is JobState.QUEUED_HANDOFF
    assert st.reason == "Waiting for the next tick: CAS answered NO_CAPACITY"
    assert f"promotion to {PEER}/{PEER_BACKEND} refused: CAS answered NO_CAPACITY" in messages(st)
    assert fake.delivered == 0

    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    st = await fed.result(handle)

    assert (st.state, st.cluster, st.backend_id) == (JobState.SUCCEEDED, OTHER_PEER, OTHER_BACKEND)
    assert [p.peer_id for p in fake.promotions] == [PEER, OTHER_PEER]
    assert fake.deliveries == [(OTHER_PEER, f"{spec.job_id}@{spec.submit_ms}")]


@pytest.mark.parametrize(
    ("outcome", "state", "reason"),
    [
        (PromoteOutcome.CANCELLED, JobState.KILLED, CANCELLED_BEFORE_HANDOFF),
        (PromoteOutcome.EXPIRED, JobState.UNSCHEDULABLE, DEADLINE_PASSED),
    ],
)
async def test_a_promotion_the_store_refuses_for_good_ends_the_job_undelivered(
    fed: Federation, outcome: PromoteOutcome, state: JobState, reason: str
) -> None:
    """The CAS says the handle was cancelled (KILLED) or expired (UNSCHEDULABLE) first."""
    fed.fake.promote = [outcome]
    handle = await fed.queued(gpu_spec("cas", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (state, reason)
    assert fed.fake.delivered == 0 and fed.fake.launch_attempts == []
    assert fed.fake.handle_ends == [HandleState(state.value)]


async def test_a_forced_placement_without_a_backend_launches_on_the_peers_best_backend(
    fed: Federation,
) -> None:
    """A pinned job force-routed to its peer (docs/DESIGN.md, "Pins and force-routing") names no
    backend: the report's match is used."""
    handle = await fed.queued(gpu_spec("forced", fed.now_ms, target_cluster=PEER))
    await fed.place(handle, PEER, "")
    st = await fed.result(handle)

    assert (st.state, st.backend_id) == (JobState.SUCCEEDED, PEER_BACKEND)
    assert fed.fake.launch_requests[0].request.backend_id == PEER_BACKEND


async def test_a_repeated_placement_signal_delivers_the_job_once(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("twice", fed.now_ms))
    await fed.place(handle)
    await fed.place(handle)
    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert fed.fake.delivered == 1
    assert len(fed.fake.promotions) == 1


async def test_a_job_that_fails_on_its_cluster_ends_failed_with_its_exit_code(fed: Federation) -> None:
    fed.fake.mirror = [ControllerJobState.RUNNING, ControllerJobState.FAILED]
    handle = await fed.queued(gpu_spec("crash", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason, st.exit_code) == (JobState.FAILED, f"Failed on {PEER} (exit code 3)", 3)
    assert states(st)[-2:] == [JobState.RUNNING, JobState.FAILED]
    assert fed.fake.handle_ends == [HandleState.HANDED_OFF, HandleState.FAILED]


LOST_PROCESS = "the controller restarted while the job was running; its processes and exit status were lost"


async def test_a_job_whose_cluster_lost_its_process_ends_failed_with_the_clusters_error(
    fed: Federation,
) -> None:
    fed.fake.mirror = [
        ControllerJobState.RUNNING,
        Remote(ControllerJobState.WORKER_FAILED, None, LOST_PROCESS),
    ]
    # No retry for a lost attempt (the default allows one: tests/workflows/test_job_attempts.py).
    handle = await fed.queued(gpu_spec("lost-process", fed.now_ms, max_retries_preemption=0))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.error) == (JobState.FAILED, LOST_PROCESS)
    assert st.reason.startswith(f"Failed on {PEER}") and st.reason.endswith(LOST_PROCESS)


async def test_a_job_whose_cluster_lost_its_process_does_not_claim_an_exit_code(fed: Federation) -> None:
    fed.fake.mirror = [Remote(ControllerJobState.WORKER_FAILED, None, LOST_PROCESS)]
    handle = await fed.queued(gpu_spec("lost-process", fed.now_ms, max_retries_preemption=0))
    await fed.place(handle)
    st = await fed.result(handle)

    assert st.state is JobState.FAILED
    assert "exit code None" not in st.reason


async def test_the_mirror_rides_out_transient_errors_with_backoff(fed: Federation) -> None:
    """Time skipping: the mirror's retries (1 s, 2 s, 4 s backoff) go by at once."""
    fed.fake.mirror = [
        ControllerJobState.RUNNING,
        ApplicationError("cw-a unavailable"),
        ApplicationError("cw-a unavailable"),
        ApplicationError("cw-a unavailable"),
        ControllerJobState.SUCCEEDED,
    ]
    handle = await fed.queued(gpu_spec("flaky", fed.now_ms))
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    assert [known for _, known in fed.fake.mirror_calls] == [
        "RUNNING",
        "RUNNING",
        "RUNNING",
        "RUNNING",
        "RUNNING",
    ]


async def test_a_job_its_cluster_no_longer_knows_ends_failed(fed: Federation) -> None:
    spec = gpu_spec("lost", fed.now_ms, max_retries_preemption=0)
    fed.fake.mirror = [job_lost(PEER, spec.job_id)]
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.FAILED, f"{PEER} no longer knows job {spec.job_id}")
    assert fed.fake.handle_ends == [HandleState.HANDED_OFF, HandleState.FAILED]


async def test_a_launch_whose_repeated_answer_is_already_terminal_still_relays_the_output(
    fed: Federation,
) -> None:
    """The first launch lands but its reply is lost; by the retry the job has ended there. The
    workflow still runs the final mirror (TERMINAL_LAUNCH_PATCH), which relays the output home."""
    fake = fed.fake
    fake.launch = [LoseReply(ControllerJobState.SUCCEEDED), Accept()]
    spec = gpu_spec("quick", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.reason) == (JobState.SUCCEEDED, f"Succeeded on {PEER}")
    assert fake.launch_attempts == [PEER, PEER]
    assert fake.delivered == 1
    assert fake.mirror_calls == [(PEER, None)]
    assert fake.relayed == [spec.job_id]


async def test_a_store_that_refuses_a_handle_transition_does_not_stop_the_job(fed: Federation) -> None:
    fed.fake.refused_handle_states = {HandleState.HANDED_OFF}
    handle = await fed.queued(gpu_spec("conflict", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert st.state is JobState.SUCCEEDED
    assert any(m.startswith("federation store kept its state: ") for m in messages(st))
    assert fed.fake.handle_ends == [HandleState.SUCCEEDED]


async def test_a_placement_arriving_after_promotion_is_ignored(fed: Federation) -> None:
    """A late tick's placement reaches a job already running: nothing is promoted or sent again."""
    fake = fed.fake
    fake.mirror = []
    spec = gpu_spec("late", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)

    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    st = await fed.result(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert len(fake.promotions) == 1 and fake.deliveries == [(PEER, f"{spec.job_id}@{spec.submit_ms}")]
