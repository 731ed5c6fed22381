"""Attempts under faults (docs/DESIGN.md, "Attempts"): a launch whose every answer was lost, a
cluster that stops answering for longer than peer_lost_after, a task its cluster lost, a failed
attempt retried within its budget, and a --timeout. The cluster, not a guess, says whether an
attempt started; no attempt ever runs on two clusters at once."""

from __future__ import annotations

from typing import Any

import pytest
from job_doubles import (
    OTHER_BACKEND,
    OTHER_PEER,
    PEER,
    Accept,
    Federation,
    LoseReply,
    Outage,
    Remote,
    gpu_spec,
    messages,
    wait_for,
    wait_for_state,
)
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from iris import contract
from iris.controller.models import TIMED_OUT, ControllerJobState
from iris.jobs import AttemptEnd, CancelRequest, JobSpec, JobState, JobStatus, ReplayRequest, attempt_nonce
from iris.policy import CANCELLED_BEFORE_HANDOFF
from iris.policy.reasons import ReasonCode
from iris.store.models import HandleState
from workflows.job import CANCELLED_WHILE_PARKED, JobWorkflow

LOST_AFTER_S = 600.0


def nonce(spec_job: JobStatus | Any, n: int) -> str:
    return attempt_nonce(f"{spec_job.job_id}@{spec_job.submit_ms}", n)


def refusal(refused: pytest.ExceptionInfo[WorkflowUpdateFailedError]) -> str:
    cause = refused.value.cause
    assert isinstance(cause, ApplicationError)
    return cause.message


async def parked_with_unknown_outcome(fed: Federation, name: str) -> WorkflowHandle[Any, JobStatus]:
    """The launch reaches cw-a and the job starts there, but the reply is lost and cw-a then stops
    answering: every retry and the reconciliation go unanswered, and the job parks saying so."""
    fed.fake.launch = [LoseReply(ControllerJobState.RUNNING, then_silent=True)]
    handle = await fed.queued(gpu_spec(name, fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    assert "the outcome is unknown" in st.reason and f"{PEER} does not answer" in st.reason
    assert fed.fake.remote_state(PEER, st.job_id) is ControllerJobState.RUNNING  # it did land
    assert fed.fake.finds == [(PEER, nonce(st, 1))]
    return handle


async def queued_again(
    fed: Federation, handle: WorkflowHandle[Any, JobStatus], skip_s: float = 5.0
) -> JobStatus:
    """Wait until the job's second attempt waits in the queue."""
    return await wait_for(
        handle,
        lambda st: st.state is JobState.QUEUED_HANDOFF and st.reason.startswith("Attempt 2 queued"),
        "queued its second attempt",
        env=fed.env,
        skip_s=skip_s,
        timeout=20,
    )


async def running_on_peer(fed: Federation, spec: JobSpec) -> WorkflowHandle[Any, JobStatus]:
    """The job placed on cw-a and running there, its mirror waiting for a change."""
    fed.fake.mirror = []
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    return handle


# ---- a launch whose answer was lost ---------------------------------------------------------------


async def test_a_lost_launch_reply_is_reconciled_with_the_cluster_before_any_park(fed: Federation) -> None:
    """The reply is lost on every retry, but the cluster answers a status query: it has the job,
    which is followed there (one delivery, no park)."""
    fake = fed.fake
    fake.launch = [LoseReply(ControllerJobState.RUNNING)]
    spec = gpu_spec("lost-replies", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert fake.delivered == 1 and len(fake.launch_attempts) == 6
    assert f"{PEER} has the job although its answer was lost" in messages(st)
    assert JobState.HANDOFF_FAILED not in [e.state for e in st.events]


async def test_a_park_with_an_unknown_outcome_names_the_cluster_and_refuses_a_replay_elsewhere(
    fed: Federation,
) -> None:
    handle = await parked_with_unknown_outcome(fed, "ghost")

    for request in (ReplayRequest(peer=OTHER_PEER), ReplayRequest(requeue=True)):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(JobWorkflow.replay_handoff, request)
        assert f"may be running on {PEER}" in refusal(refused)
        assert "--force" in refusal(refused)
    assert fed.fake.delivered == 1
    fed.fake.silent.clear()  # so the test's leftover cancel is confirmed at once


async def test_a_parked_job_whose_cluster_answers_again_is_adopted_not_run_twice(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked_with_unknown_outcome(fed, "adopted")
    fake.silent.clear()  # the partition heals: the next probe finds the attempt running
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert fake.delivered == 1
    assert f"{PEER} answers: it has the job; following it there" in messages(st)
    assert [a.end for a in st.attempts] == [AttemptEnd.SUCCEEDED.value]


async def test_a_parked_job_whose_cluster_confirms_it_never_ran_may_be_replayed_elsewhere(
    fed: Federation,
) -> None:
    """The launch never reached the cluster (an outage), which then stops answering: the outcome is
    unknown until the cluster answers that it has no such attempt."""
    fake = fed.fake
    fake.launch = [Outage("connection reset")]
    fake.silent.add(PEER)
    handle = await fed.queued(gpu_spec("absent", fed.now_ms))
    await fed.place(handle)
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED, env=fed.env, skip_s=5.0)
    assert "the outcome is unknown" in st.reason
    fake.silent.clear()
    st = await wait_for(
        handle, lambda s: "confirms it never received" in s.reason, "was cleared", env=fed.env, skip_s=5.0
    )
    fake.launch = [Accept()]
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=OTHER_PEER))
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert fake.deliveries == [(OTHER_PEER, nonce(st, 1))]
    assert fake.fences == []


async def test_a_cancel_of_a_job_that_may_run_terminates_it_there_and_waits_for_the_cluster(
    fed: Federation,
) -> None:
    fake = fed.fake
    handle = await parked_with_unknown_outcome(fed, "cancel-ghost")
    job_id = handle.id

    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="stop"))
    assert outcome.won is False
    await fed.env.sleep(60)  # still silent: the terminate is re-sent, the job is not KILLED yet
    assert (await handle.query(JobWorkflow.status)).state is JobState.HANDOFF_FAILED
    fake.silent.clear()
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.KILLED
    assert st.reason == f"{CANCELLED_WHILE_PARKED}; {PEER} confirms the job is not running there"
    assert fake.terminations == [PEER]
    assert fake.remote_state(PEER, job_id) is ControllerJobState.KILLED
    assert fake.fences == []


async def test_a_cancel_of_a_job_on_a_cluster_lost_for_good_fences_the_attempt(fed: Federation) -> None:
    fake = fed.fake
    handle = await parked_with_unknown_outcome(fed, "cancel-lost")

    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="stop"))
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.KILLED
    assert "the attempt is fenced there" in st.reason
    assert fake.fences == [(PEER, nonce(st, 1))]


async def test_a_forced_replay_elsewhere_fences_the_attempt_the_silent_cluster_may_run(
    fed: Federation,
) -> None:
    fake = fed.fake
    handle = await parked_with_unknown_outcome(fed, "forced")
    fake.launch = [Accept()]
    await handle.execute_update(JobWorkflow.replay_handoff, ReplayRequest(peer=OTHER_PEER, force=True))
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert fake.fences == [(PEER, nonce(st, 1))]
    assert [c for c, _ in fake.deliveries] == [PEER, OTHER_PEER]


# ---- a cluster lost while the attempt runs ---------------------------------------------------------


async def test_a_cluster_silent_past_peer_lost_after_loses_the_attempt_which_runs_again_elsewhere(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec = gpu_spec("peer-lost", fed.now_ms)
    handle = await running_on_peer(fed, spec)
    fake.silent.add(PEER)  # lost for good

    st = await queued_again(fed, handle, skip_s=30.0)
    assert st.reason == f"Attempt 2 queued: attempt 1 on {PEER} preempted"
    assert fake.fences == [(PEER, nonce(spec, 1))]
    # Lost after peer_lost_after of silence, not before.
    lost = next(a for a in st.attempts if a.number == 1)
    assert lost.end == AttemptEnd.PREEMPTED.value and lost.ended_ms is not None
    assert lost.reason is not None and lost.reason.startswith(f"{PEER} did not answer for")
    assert float(lost.reason.split("for ")[1].rstrip("s")) >= LOST_AFTER_S

    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, OTHER_PEER)
    assert fake.deliveries == [(PEER, nonce(spec, 1)), (OTHER_PEER, nonce(spec, 2))]
    assert [(a.number, a.cluster, a.end) for a in st.attempts] == [
        (1, PEER, AttemptEnd.PREEMPTED.value),
        (2, OTHER_PEER, AttemptEnd.SUCCEEDED.value),
    ]
    assert fake.requeued == [spec.job_id]


async def test_a_job_out_of_preemption_retries_fails_with_a_reason_naming_the_cause(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec = gpu_spec("no-retries", fed.now_ms, max_retries_preemption=0)
    handle = await running_on_peer(fed, spec)
    fake.silent.add(PEER)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.FAILED
    assert st.reason.startswith(f"{PEER} did not answer for")
    assert fake.handle_ends == [HandleState.HANDED_OFF, HandleState.FAILED]


async def test_a_task_its_cluster_lost_is_retried_under_the_preemption_budget(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.WORKER_FAILED, None, "node lost")]
    spec = gpu_spec("worker-failed", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await queued_again(fed, handle)
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    assert [(a.number, a.end) for a in st.attempts] == [
        (1, AttemptEnd.PREEMPTED.value),
        (2, AttemptEnd.SUCCEEDED.value),
    ]
    assert fake.deliveries == [(PEER, nonce(spec, 1)), (PEER, nonce(spec, 2))]


# ---- failures, retries and the timeout -------------------------------------------------------------


async def test_a_failed_attempt_is_retried_within_max_retries_failure(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [Remote(ControllerJobState.FAILED, -9, None)]
    spec = gpu_spec("flaky-task", fed.now_ms, max_retries_failure=1)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await queued_again(fed, handle)
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    # Between the attempts the job never showed as ended.
    assert JobState.FAILED not in [e.state for e in st.events]
    assert [(a.end, a.exit_code) for a in st.attempts] == [
        (AttemptEnd.FAILED.value, -9),
        (AttemptEnd.SUCCEEDED.value, 0),
    ]


async def test_a_job_out_of_failure_retries_says_so(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    spec = gpu_spec("always-fails", fed.now_ms, max_retries_failure=1)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await queued_again(fed, handle)
    fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.FAILED
    assert st.reason == f"Failed on {PEER} (exit code 3); no retries left (--max-retries-failure 1)"
    assert len(st.attempts) == 2


async def test_a_failure_is_not_retried_by_default(fed: Federation) -> None:
    fed.fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    handle = await fed.queued(gpu_spec("fails-once", fed.now_ms))
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.FAILED, f"Failed on {PEER} (exit code 3)")
    assert len(st.attempts) == 1


async def test_a_job_past_its_timeout_fails_with_reason_timeout_and_is_not_retried(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [Remote(ControllerJobState.FAILED, -15, TIMED_OUT)]
    spec = gpu_spec("too-long", fed.now_ms, timeout_s=30.0, max_retries_failure=3)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.FAILED, f"Failed on {PEER}: timeout (30s)")
    assert [a.end for a in st.attempts] == [AttemptEnd.TIMEOUT.value]
    assert fake.launch_requests[0].request.timeout_s == 30.0


async def test_a_cancel_while_its_cluster_is_silent_is_not_reported_before_the_cluster_confirms(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec = gpu_spec("cancel-silent", fed.now_ms)
    handle = await running_on_peer(fed, spec)
    fake.silent.add(PEER)
    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="stop"))
    await fed.env.sleep(60)
    assert not (await handle.query(JobWorkflow.status)).terminal
    fake.silent.clear()
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.KILLED
    assert fake.remote_state(PEER, spec.job_id) is ControllerJobState.KILLED
    assert fake.fences == []


# ---- a cluster that comes back after it lost an attempt ---------------------------------------------


async def lost_then_queued_again(
    fed: Federation, name: str, **kw: Any
) -> tuple[Any, WorkflowHandle[Any, JobStatus]]:
    """A job pinned to cw-a runs there; cw-a goes silent past peer_lost_after, so attempt 1 is
    lost (fenced) and attempt 2 waits in the queue for cw-a."""
    fake = fed.fake
    spec = gpu_spec(name, fed.now_ms, target_cluster=PEER, **kw)
    handle = await running_on_peer(fed, spec)
    fake.silent.add(PEER)
    await queued_again(fed, handle, skip_s=30.0)
    return spec, handle


async def test_an_attempt_that_succeeded_while_its_cluster_was_silent_is_the_result_not_run_again(
    fed: Federation,
) -> None:
    """The cluster ran attempt 1 to success during its silence: when attempt 2 is placed there,
    the cluster's answer for attempt 1 is the job's result. No second run; attempt 1's output is
    relayed under its own number."""
    fake = fed.fake
    spec, handle = await lost_then_queued_again(fed, "won-while-silent")
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    fake.silent.discard(PEER)
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.cluster, st.reason) == (JobState.SUCCEEDED, PEER, f"Succeeded on {PEER}")
    assert fake.deliveries == [(PEER, nonce(spec, 1))]
    assert [(a.number, a.end, a.exit_code) for a in st.attempts] == [(1, AttemptEnd.SUCCEEDED.value, 0)]
    assert fake.relayed_keys == [spec.job_id]  # attempt 1's log key
    assert fake.handle_ends[-1] is HandleState.SUCCEEDED
    assert any(f"attempt 1 succeeded on {PEER} while {PEER} was silent" in m for m in messages(st))


async def test_an_attempt_that_failed_while_its_cluster_was_silent_is_followed_by_the_new_run(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec, handle = await lost_then_queued_again(fed, "failed-while-silent")
    fake.set_remote_state(PEER, spec.job_id, ControllerJobState.FAILED)
    fake.silent.discard(PEER)
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    assert fake.deliveries == [(PEER, nonce(spec, 1)), (PEER, nonce(spec, 2))]
    assert [(a.number, a.end) for a in st.attempts] == [
        (1, AttemptEnd.PREEMPTED.value),
        (2, AttemptEnd.SUCCEEDED.value),
    ]
    assert any(f"attempt 1 had ended on {PEER} while {PEER} was silent (failed)" in m for m in messages(st))


async def test_an_attempt_still_running_on_the_returning_cluster_is_terminated_before_the_new_run(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec, handle = await lost_then_queued_again(fed, "ran-on-while-silent")
    fake.silent.discard(PEER)
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    assert fake.deliveries == [(PEER, nonce(spec, 1)), (PEER, nonce(spec, 2))]
    assert fake.terminations == [PEER]  # attempt 1, by its nonce, before attempt 2 launched


# ---- a cluster lost right after it reported the end -------------------------------------------------


async def test_an_end_whose_output_cannot_be_read_stands_once_the_cluster_is_lost(fed: Federation) -> None:
    """The launch answers that the job has ended (a repeated launch after a lost reply finds it
    so), and the cluster is lost before the output is read: the relay gives up after
    peer_lost_after, and the cluster's word on the end stands."""
    fake = fed.fake
    fake.launch = [Accept(ControllerJobState.SUCCEEDED)]
    fake.hold(contract.MIRROR_JOB)
    spec = gpu_spec("ended-then-lost", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await fake.reached(contract.MIRROR_JOB)
    fake.silent.add(PEER)
    fake.release(contract.MIRROR_JOB)
    st = await wait_for(handle, lambda s: s.terminal, "ended", env=fed.env, skip_s=30.0, timeout=20)

    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert [(a.number, a.end) for a in st.attempts] == [(1, AttemptEnd.SUCCEEDED.value)]
    assert any("its output was not relayed home" in m for m in messages(st))
    assert fake.relayed == []


async def test_a_temporal_cancel_while_the_cluster_is_lost_fences_the_attempt_and_ends_killed(
    fed: Federation,
) -> None:
    fake = fed.fake
    spec = gpu_spec("cancel-lost-cluster", fed.now_ms)
    handle = await running_on_peer(fed, spec)
    fake.silent.add(PEER)
    await handle.cancel()
    st = await wait_for(handle, lambda s: s.terminal, "ended", env=fed.env, skip_s=30.0, timeout=20)

    assert st.state is JobState.KILLED
    assert st.reason == f"Cancelled; {PEER} is silent: the job is fenced there"
    assert fake.fences == [(PEER, nonce(spec, 1))]


async def test_a_cancelled_job_whose_attempt_is_lost_meanwhile_ends_killed_not_failed(
    fed: Federation,
) -> None:
    """The terminate is on its way when the cluster reports the task lost (WORKER_FAILED, e.g. its
    controller restarted): the user cancelled the job, and it ends KILLED saying both."""
    fake = fed.fake
    spec = gpu_spec("cancel-then-lost", fed.now_ms)
    handle = await running_on_peer(fed, spec)
    fake.hold(contract.TERMINATE_JOB)
    await handle.signal(JobWorkflow.cancel, CancelRequest(reason="stop"))
    await fake.reached(contract.TERMINATE_JOB)
    fake._set_remote((PEER, spec.job_id), Remote(ControllerJobState.WORKER_FAILED, None, "node lost"))
    fake.release(contract.TERMINATE_JOB)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.KILLED, st.reason
    assert st.reason.startswith("Cancelled: stop; the attempt was lost"), st.reason
    assert [(a.number, a.end) for a in st.attempts] == [(1, AttemptEnd.PREEMPTED.value)]
    assert fake.deliveries == [(PEER, nonce(spec, 1))]


async def test_a_temporal_cancel_while_queued_for_a_retry_kills_the_job_not_its_last_attempts_end(
    fed: Federation,
) -> None:
    """Attempt 1 failed and the job waits in the queue for attempt 2 when Temporal's own cancel
    arrives (the Web UI's, say): no attempt runs, so the job ends KILLED before the next handoff,
    its handle records the cancel, and nothing is delivered again. (Before REQUEUE_PATCH the
    workflow took it for a cancel of a delivered job, read attempt 1 back from its cluster, and
    ended the job with that attempt's end: FAILED.)"""
    fake = fed.fake
    fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    spec = gpu_spec("cancel-between-attempts", fed.now_ms, max_retries_failure=1)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await queued_again(fed, handle)
    await handle.cancel()
    st = await fed.result(handle)

    assert (st.state, st.reason, st.reason_code) == (
        JobState.KILLED,
        CANCELLED_BEFORE_HANDOFF,
        ReasonCode.Cancelled,
    )
    assert fake.cancels == ["Cancelled through Temporal"]
    assert fake.delivered == 1
    assert [(a.end, a.exit_code) for a in st.attempts] == [(AttemptEnd.FAILED, 3)]


async def test_the_cancel_update_while_queued_for_a_retry_says_no_attempt_runs(fed: Federation) -> None:
    """The SDK's cancel_and_report between attempts: the cancel wins (no later attempt is ever
    delivered), and says which handoff it came before."""
    fake = fed.fake
    fake.mirror = [Remote(ControllerJobState.FAILED, 3, None)]
    spec = gpu_spec("update-between-attempts", fed.now_ms, max_retries_failure=1)
    handle = await fed.queued(spec)
    await fed.place(handle)
    await queued_again(fed, handle)
    outcome = await handle.execute_update(JobWorkflow.cancel_job, CancelRequest(reason="enough"))
    st = await fed.result(handle)

    assert (outcome.won, outcome.message) == (True, "cancelled before attempt 2's handoff; no attempt runs")
    assert (st.state, st.reason) == (JobState.KILLED, CANCELLED_BEFORE_HANDOFF)
    assert fake.delivered == 1
