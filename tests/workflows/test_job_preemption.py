"""A preempted attempt (docs/DESIGN.md, "Preemption"): its cluster reports it PREEMPTED ("preempted
by <job id> at <time>"); the attempt ends, the job is queued again as its next attempt with the
code Preempted, spending no retry budget (issue 29: a preemption never fails a job), and its
history and attempts say who preempted it and when. A run that predates REQUEUE_PATCH spent
--max-retries-preemption on it (its recorded histories replay that path)."""

from __future__ import annotations

from job_doubles import PEER, Federation, Remote, gpu_spec, wait_for

from iris.controller.models import ControllerJobState
from iris.jobs import AttemptEnd, JobState
from iris.policy.reasons import ReasonCode

NOTE = "preempted by alice/urgent at 2026-12-02T03:00:00.000Z"


async def test_a_preempted_attempt_is_queued_again_and_says_who_preempted_it(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.PREEMPTED, None, NOTE)]
    spec = gpu_spec("preempted-once", fed.now_ms)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await wait_for(
        handle,
        lambda st: st.state is JobState.QUEUED_HANDOFF and st.reason.startswith("Attempt 2 queued"),
        "queued its second attempt",
        env=fed.env,
        skip_s=5.0,
        timeout=20,
    )
    assert st.reason == f"Attempt 2 queued: attempt 1 on {PEER} was {NOTE}"
    assert st.reason_code is ReasonCode.Preempted
    assert fake.requeued == [spec.job_id]
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.SUCCEEDED
    first, second = st.attempts
    assert (first.number, first.end, first.preempted) == (1, AttemptEnd.PREEMPTED.value, NOTE)
    assert first.reason == f"Preempted on {PEER}: {NOTE}"
    assert (second.number, second.end, second.preempted) == (2, AttemptEnd.SUCCEEDED.value, None)
    # The history (describe's events) names who preempted it and when; it never showed as ended.
    assert f"attempt 1 ended (PREEMPTED): Preempted on {PEER}: {NOTE}" in [e.message for e in st.events]
    assert JobState.FAILED not in [e.state for e in st.events]
    # Its cluster ended the attempt for good: the next one there asks nothing about it first.
    assert fake.finds == []
    assert [n for _, n in fake.deliveries] == [st.attempts[0].nonce, st.attempts[1].nonce]
    # The second launch tells the cluster this job was preempted once already: its backend then
    # preempts it after the fresh jobs of its band (docs/DESIGN.md, "Preemption").
    assert [inp.request.preemptions for inp in fake.launch_requests] == [0, 1]


async def test_a_lost_attempt_is_still_peer_lost(fed: Federation) -> None:
    """WORKER_FAILED is not a preemption: code PeerLost, no ``preempted`` note."""
    fake = fed.fake
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.WORKER_FAILED, None, "node lost")]
    spec = gpu_spec("lost-for-good", fed.now_ms, max_retries_preemption=0)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.reason_code) == (JobState.FAILED, ReasonCode.PeerLost)
    assert [(a.end, a.preempted) for a in st.attempts] == [(AttemptEnd.PREEMPTED.value, None)]


async def test_a_band_preemption_spends_no_budget_and_never_fails_the_job(fed: Federation) -> None:
    """Issue 29: a preemption is the scheduler's decision, not the job's fault. A job with no retry
    left for a lost attempt (--max-retries-preemption 0) is preempted three times: each time it is
    queued again (Preempted), and its fourth attempt succeeds. Each later launch tells the cluster
    how many earlier attempts were preempted (its victim choice and exemption use it)."""
    fake = fed.fake
    spec = gpu_spec("preempted-thrice", fed.now_ms, max_retries_preemption=0)
    handle = await fed.queued(spec)
    for n in (1, 2, 3):
        fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.PREEMPTED, None, NOTE)]
        await fed.place(handle)
        st = await wait_for(
            handle,
            lambda st, n=n: (
                st.state is JobState.QUEUED_HANDOFF and st.reason.startswith(f"Attempt {n + 1} queued")
            ),
            f"queued attempt {n + 1}",
            env=fed.env,
            skip_s=5.0,
            timeout=20,
        )
        assert st.reason_code is ReasonCode.Preempted
    fake.mirror = [ControllerJobState.SUCCEEDED]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.reason_code) == (JobState.SUCCEEDED, ReasonCode.Succeeded)
    assert [a.end for a in st.attempts] == [AttemptEnd.PREEMPTED] * 3 + [AttemptEnd.SUCCEEDED]
    assert JobState.FAILED not in [e.state for e in st.events]
    assert fake.requeued == [spec.job_id] * 3
    assert [inp.request.preemptions for inp in fake.launch_requests] == [0, 1, 2, 3]


async def test_a_lost_attempt_still_spends_the_preemption_budget_after_a_band_preemption(
    fed: Federation,
) -> None:
    """A band preemption spends nothing, but a cluster losing the job still draws on
    --max-retries-preemption: with 0 left, a lost attempt after a preemption fails the job."""
    fake = fed.fake
    spec = gpu_spec("preempted-then-lost", fed.now_ms, max_retries_preemption=0)
    handle = await fed.queued(spec)
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.PREEMPTED, None, NOTE)]
    await fed.place(handle)
    await wait_for(
        handle,
        lambda st: st.state is JobState.QUEUED_HANDOFF and st.reason.startswith("Attempt 2 queued"),
        "queued attempt 2",
        env=fed.env,
        skip_s=5.0,
        timeout=20,
    )
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.WORKER_FAILED, None, "node lost")]
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert (st.state, st.reason_code) == (JobState.FAILED, ReasonCode.PeerLost)
    assert [(a.end, a.preempted) for a in st.attempts] == [
        (AttemptEnd.PREEMPTED, NOTE),
        (AttemptEnd.PREEMPTED, None),
    ]
