"""Cancellation at every stage (docs/DESIGN.md, "Cancellation"): by signal, by the ``cancel_job``
Update (which says whether the cancel won), and by Temporal's own cancel. Before delivery the job is
never delivered; after, the cancel becomes a termination on the cluster that has the job."""

from __future__ import annotations

import pytest
from job_doubles import (
    BUNDLE,
    PEER,
    Federation,
    cpu_spec,
    gpu_spec,
    messages,
    status,
    wait_for_state,
)
from temporalio.client import WorkflowUpdateStage

from iris import contract
from iris.controller.models import ControllerJobState
from iris.jobs import CancelRequest, JobState
from iris.policy import CANCELLED_BEFORE_HANDOFF
from iris.store.models import HandleState
from workflows.job import JobWorkflow


async def test_a_cancel_signal_while_queued_kills_the_job_before_any_delivery(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("queued", fed.now_ms))

    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="changed my mind"))
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    assert st.cancel_requested
    assert "cancel requested: changed my mind" in messages(st)
    # The intent is recorded in the store (it races the promotion CAS there), then the handle ends.
    assert fed.fake.cancels == ["changed my mind"]
    assert fed.fake.handle_ends == [HandleState.KILLED]
    assert fed.fake.delivered == 0 and fed.fake.promotions == []


async def test_the_cancel_update_while_queued_answers_that_the_cancel_won(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("queued", fed.now_ms))

    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="stop"))

    assert (outcome.won, outcome.state) == (True, JobState.KILLED)
    assert outcome.message == "cancelled before handoff; never delivered"
    st = await fed.result(handle)
    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    assert fed.fake.delivered == 0


async def test_the_cancel_update_right_after_submit_wins(fed: Federation) -> None:
    """The Update can arrive in the workflow's very first task, before the classification. Its
    signature is checked while the job is admitted (one activity since the 2027-01 baseline), so
    the job may enter the queue first: then the cancel is recorded against its handle (no zombie in
    the queue), and nothing is ever delivered."""
    handle = await fed.start(gpu_spec("instant", fed.now_ms))

    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="oops"))

    assert (outcome.won, outcome.state) == (True, JobState.KILLED)
    st = await fed.result(handle)
    assert st.reason == CANCELLED_BEFORE_HANDOFF
    assert fed.fake.delivered == 0
    assert not fed.fake.enqueued or fed.fake.cancels == ["oops"], (fed.fake.enqueued, fed.fake.cancels)


async def test_a_temporal_cancel_while_queued_kills_the_job_before_any_delivery(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("queued", fed.now_ms))

    await handle.cancel()
    st = await fed.result(handle)

    # The workflow itself completes: its result is the job's end, like the signal's.
    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    assert fed.fake.cancels == ["Cancelled through Temporal"]
    assert fed.fake.delivered == 0


async def test_a_cancel_that_loses_the_race_to_promotion_goes_through_the_pending_path(
    dev_fed: Federation,
) -> None:
    """The cancel arrives while the CAS runs, and the store says the promotion committed first:
    whichever commits first wins, and a job promoted first is cancelled through the pending path
    (docs/DESIGN.md, "Promotion (the CAS)"). The CAS is a local activity in the task that took the
    placement (job-baseline-2027-02), so that task schedules the launch before the cancel reaches
    the workflow: the job is handed off, then terminated on its cluster, and ends KILLED; it is
    never left running. On the dev server: the time-skipping one counts a task held by a local
    activity as idle and times it out."""
    fed = dev_fed
    fake = fed.fake
    fake.cancel_wins = False
    fake.mirror = []  # the job runs until something stops it
    spec = gpu_spec("race", fed.now_ms)
    handle = await fed.queued(spec)
    fake.hold(contract.PROMOTE_JOB)
    await fed.place(handle)
    await fake.reached(contract.PROMOTE_JOB)

    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="too late?"))
    fake.release(contract.PROMOTE_JOB)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, f"Cancelled on {PEER}: too late?")
    assert fake.delivered == 1 and fake.terminations == [PEER]
    assert fake.remote_state(PEER, spec.job_id) is ControllerJobState.KILLED
    assert fake.handle_ends[-1] is HandleState.KILLED


@pytest.mark.parametrize("step", [contract.CHECK_ARTIFACTS, contract.STAGE_BUNDLE])
async def test_a_cancel_while_the_handoff_is_prepared_never_delivers(fed: Federation, step: str) -> None:
    fake = fed.fake
    handle = await fed.queued(gpu_spec("prep", fed.now_ms, bundle=BUNDLE, artifacts=["s3://data/x"]))
    fake.hold(step)
    await fed.place(handle)
    await fake.reached(step)

    # The Update answers once the job has ended: accepted now, answered after the step returns.
    update = await handle.start_update(
        JobWorkflow.cancel_job, CancelRequest(reason="stop"), wait_for_stage=WorkflowUpdateStage.ACCEPTED
    )
    fake.release(step)
    outcome = await update.result()

    assert (outcome.won, outcome.state) == (True, JobState.KILLED)
    st = await fed.result(handle)
    assert (st.state, st.reason, st.handoff_attempts) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF, 0)
    # Staging comes after a launch the cluster answered it lacks the bundle for: never received.
    assert fake.launch_attempts == ([] if step == contract.CHECK_ARTIFACTS else [PEER])
    assert fake.deliveries == []


async def test_a_cancel_of_a_job_running_at_home_before_its_launch_never_delivers(fed: Federation) -> None:
    """Its home reservation is a queue handle: the cancel is recorded there (releasing it)."""
    fake = fed.fake
    handle = await fed.start(cpu_spec("local", fed.now_ms, artifacts=["gs://data/x"]))
    fake.hold(contract.CHECK_ARTIFACTS)
    await fake.reached(contract.CHECK_ARTIFACTS)

    await handle.signal(JobWorkflow.cancel, CancelRequest())
    fake.release(contract.CHECK_ARTIFACTS)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    assert fake.cancels == ["Cancelled by user"] and fake.launch_attempts == []


async def test_a_cancel_after_delivery_terminates_the_job_on_its_cluster(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = []  # the job runs until something stops it
    spec = gpu_spec("running", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)

    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="enough"))
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, f"Cancelled on {PEER}: enough")
    assert f"terminating on {PEER}" in messages(st)
    assert fake.terminations == [PEER]
    assert fake.remote_state(PEER, spec.job_id) is ControllerJobState.KILLED
    assert fake.delivered == 1
    assert fake.handle_ends == [HandleState.HANDED_OFF, HandleState.KILLED]


async def test_the_cancel_update_after_delivery_answers_lost_and_terminates(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = []
    handle = await fed.queued(gpu_spec("running", fed.now_ms))
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)

    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="enough"))

    assert outcome.won is False
    assert outcome.message == f"job was already handed to {PEER}; termination requested there"
    st = await fed.result(handle)
    assert (st.state, st.reason) == (JobState.KILLED, f"Cancelled on {PEER}: enough")
    assert fake.terminations == [PEER]


async def test_a_temporal_cancel_after_delivery_terminates_the_job_on_its_cluster(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = []
    handle = await fed.queued(gpu_spec("running", fed.now_ms))
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)

    await handle.cancel()
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, f"Cancelled on {PEER}: Cancelled through Temporal")
    assert fake.terminations == [PEER] and fake.delivered == 1


async def test_a_temporal_cancel_during_the_launch_lets_it_land_then_terminates_it(fed: Federation) -> None:
    """The launch is shielded: abandoning it half-way could leave the job running unseen."""
    fake = fed.fake
    fake.mirror = []
    spec = gpu_spec("launching", fed.now_ms)
    handle = await fed.queued(spec)
    fake.hold(contract.LAUNCH_JOB)
    await fed.place(handle)
    await fake.reached(contract.LAUNCH_JOB)

    await handle.cancel()
    fake.release(contract.LAUNCH_JOB)
    st = await fed.result(handle)

    assert st.state is JobState.KILLED
    assert fake.delivered == 1 and fake.terminations == [PEER]
    assert fake.remote_state(PEER, spec.job_id) is ControllerJobState.KILLED


async def test_a_job_its_cluster_forgets_after_the_termination_ends_killed(fed: Federation) -> None:
    """A cluster answering "not found" to the mirror after a termination satisfies the cancel."""
    fake = fed.fake
    fake.mirror = []
    spec = gpu_spec("forgotten", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    fake.hold(contract.TERMINATE_JOB)

    await handle.signal(JobWorkflow.cancel, CancelRequest())
    await fake.reached(contract.TERMINATE_JOB)
    fake.forget(PEER, spec.job_id)
    fake.release(contract.TERMINATE_JOB)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, f"Killed; {PEER} no longer knows the job")


async def test_a_temporal_cancel_of_a_job_its_cluster_has_forgotten_ends_killed(fed: Federation) -> None:
    """The cluster lost the job (a restart without its state, say) and then the Web UI cancels it:
    nothing is left to terminate, and the workflow ends the job instead of failing."""
    fake = fed.fake
    fake.mirror = []
    spec = gpu_spec("forgotten-then-cancelled", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    fake.hold(contract.MIRROR_JOB)  # the read that follows a Temporal cancel

    await handle.cancel()
    await fake.reached(contract.MIRROR_JOB)
    fake.forget(PEER, spec.job_id)
    fake.release(contract.MIRROR_JOB)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.KILLED, f"Killed; {PEER} no longer knows the job")
    assert [a.end for a in st.attempts] == ["KILLED"]


async def test_the_status_query_says_a_cancel_was_requested_while_it_is_carried_out(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = []
    handle = await fed.queued(gpu_spec("running", fed.now_ms))
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    fake.hold(contract.TERMINATE_JOB)

    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="enough"))
    await fake.reached(contract.TERMINATE_JOB)

    st = await status(handle)
    assert (st.state, st.cancel_requested) == (JobState.RUNNING, True)
    fake.release(contract.TERMINATE_JOB)
    assert (await fed.result(handle)).state is JobState.KILLED
