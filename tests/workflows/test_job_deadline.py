"""A queued job's scheduling deadline (docs/DESIGN.md, "Deadlines"): passed, the job is
UNSCHEDULABLE and never promoted. Time skipping: an hour-long deadline passes in simulated time
(in real time the test would outlive its 300 s timeout)."""

from __future__ import annotations

from job_doubles import Federation, gpu_spec, status, wait_for

from iris import contract
from iris.jobs import JobState
from iris.policy import DEADLINE_PASSED
from iris.store.models import HandleState
from workflows.job import JobWorkflow


async def test_a_queued_job_whose_deadline_passes_becomes_unschedulable(fed: Federation) -> None:
    spec = gpu_spec("deadline", fed.now_ms, scheduling_timeout_s=3600)
    handle = await fed.queued(spec)

    await fed.env.sleep(3601)  # the test server skips the hour
    st = await fed.result(handle)

    assert (st.state, st.reason) == (JobState.UNSCHEDULABLE, DEADLINE_PASSED)
    assert st.updated_ms >= spec.submit_ms + 3_600_000
    assert fed.fake.expired == [spec.job_id]
    assert fed.fake.handle_ends == [HandleState.UNSCHEDULABLE]
    assert fed.fake.promotions == [] and fed.fake.delivered == 0


async def test_the_deadline_does_not_pass_early(fed: Federation) -> None:
    """50 minutes into an hour's deadline, the job is still queued."""
    handle = await fed.queued(gpu_spec("deadline", fed.now_ms, scheduling_timeout_s=3600))
    await fed.env.sleep(3000)

    assert (await status(handle)).state is JobState.QUEUED_HANDOFF
    assert fed.fake.expired == []


async def test_the_ticks_expire_signal_ends_a_queued_job_only_past_its_deadline(fed: Federation) -> None:
    """Whoever sends it, an expiry before the job's own deadline is recorded and ignored
    (docs/SECURITY.md, "Internal signals"); the deadline then ends the job."""
    spec = gpu_spec("expire", fed.now_ms, scheduling_timeout_s=3600)
    handle = await fed.queued(spec)

    await handle.signal(JobWorkflow.expire)
    st = await wait_for(handle, lambda s: any("ignored expiry" in e.message for e in s.events), "ignored it")
    assert st.state is JobState.QUEUED_HANDOFF and fed.fake.expired == []

    await fed.env.sleep(3601)
    st = await fed.result(handle)
    assert (st.state, st.reason) == (JobState.UNSCHEDULABLE, DEADLINE_PASSED)
    assert fed.fake.expired == [spec.job_id]


async def test_a_placement_after_the_deadline_is_never_promoted(fed: Federation) -> None:
    """The tick's expiry, then (a late tick) a placement, both for a job past its deadline while it
    is still being classified: no CAS is attempted."""
    fed.fake.hold(contract.FETCH_REPORTS)
    handle = await fed.start(gpu_spec("both", fed.now_ms - 7_200_000, scheduling_timeout_s=3600))
    await fed.fake.reached(contract.FETCH_REPORTS)

    await handle.signal(JobWorkflow.expire)
    await fed.place(handle)
    fed.fake.release(contract.FETCH_REPORTS)
    st = await fed.result(handle)

    assert st.state is JobState.UNSCHEDULABLE
    assert fed.fake.promotions == []
