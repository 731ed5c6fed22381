"""A preempted attempt (docs/DESIGN.md, "Preemption"): its cluster reports it PREEMPTED ("preempted
by <job id> at <time>"); the attempt ends, the job is queued again as its next attempt under
--max-retries-preemption with the code Preempted, its history and attempts say who preempted it
and when, and it ends Preempted when no retry is left."""

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


async def test_a_preempted_job_out_of_retries_ends_preempted(fed: Federation) -> None:
    fake = fed.fake
    fake.mirror = [ControllerJobState.RUNNING, Remote(ControllerJobState.PREEMPTED, None, NOTE)]
    spec = gpu_spec("preempted-for-good", fed.now_ms, max_retries_preemption=0)
    handle = await fed.queued(spec)
    await fed.place(handle)
    st = await fed.skip_to_end(handle)

    assert st.state is JobState.FAILED
    assert st.reason == f"Preempted on {PEER}: {NOTE}"
    assert st.reason_code is ReasonCode.Preempted
    assert [(a.end, a.preempted) for a in st.attempts] == [(AttemptEnd.PREEMPTED.value, NOTE)]
    assert fake.requeued == []


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
