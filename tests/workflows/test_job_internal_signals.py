"""No internal message taken on trust (SIGNALS_PATCH; docs/SECURITY.md, "Internal signals"; issue
26, finding 4). The tick's ``place`` and ``expire`` and the watchers' ``observe`` can be sent by
anyone who reaches Temporal: each is re-checked against the job's own constraints, pin, ledger,
deadline, attempt and its cluster's word, and a forged one is recorded in the job's events and
ignored. The job then ends as it would have anyway.

Also issue 28's bug: an observation of attempt 1 kept until attempt 2 runs is never applied to
attempt 2 (signals are matched to attempts by nonce, not by arrival)."""

from __future__ import annotations

from typing import Any

from job_doubles import (
    OTHER_BACKEND,
    OTHER_PEER,
    PEER,
    PEER_BACKEND,
    Federation,
    federation_view,
    gpu_spec,
    status,
    wait_for,
    wait_for_state,
)
from temporalio.client import WorkflowHandle

from activities.watch import Observation
from iris import contract
from iris.controller.models import ControllerJobState, TaskStatus
from iris.jobs import AttemptEnd, JobSpec, JobState, JobStatus, attempt_nonce
from iris.policy.models import BackendReport, Constraint, Op, Placement
from workflows.job import JobWorkflow

Handle = WorkflowHandle[Any, JobStatus]
SAFETY_S = 180.0
# `--zone us-east-02a --no-preemptible`
ZONED = (
    Constraint(key="zone", op=Op.EQ, values=("us-east-02a",)),
    Constraint(key="preemptible", op=Op.EQ, values=("false",)),
)


def events(st: JobStatus) -> list[str]:
    return [e.message for e in st.events]


async def ignored(handle: Handle, what: str) -> JobStatus:
    return await wait_for(handle, lambda st: any(m.startswith(f"ignored{what}") for m in events(st)), what)


def refusals(st: JobStatus) -> int:
    return sum(m.startswith("ignored placement") for m in events(st))


def zoned_federation(fed: Federation) -> None:
    """cw-a's pool in zone us-east-02a, on-demand; cw-b's preemptible, in us-west-04a."""
    view = federation_view(fed.now_ms)

    def zoned(report_backend: BackendReport, zone: str, preemptible: str) -> BackendReport:
        attrs = {**report_backend.advertised_attributes, "zone": [zone], "preemptible": [preemptible]}
        return report_backend.model_copy(update={"advertised_attributes": attrs})

    reports = []
    for report in view.reports:
        if report.peer_id == PEER:
            report = report.model_copy(
                update={"backends": [zoned(report.backends[0], "us-east-02a", "false")]}
            )
        elif report.peer_id == OTHER_PEER:
            report = report.model_copy(
                update={"backends": [zoned(report.backends[0], "us-west-04a", "true")]}
            )
        reports.append(report)
    fed.fake.view = view.model_copy(update={"reports": reports})


# ---- place ----------------------------------------------------------------------------------------


async def test_a_forged_placement_that_breaks_the_jobs_constraints_is_ignored(fed: Federation) -> None:
    """Issue 26: `place` sent a `--zone us-east-02a --no-preemptible` job to cw-rno2a."""
    zoned_federation(fed)
    handle = await fed.queued(gpu_spec("zoned", fed.now_ms, constraints=ZONED))

    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    st = await ignored(handle, " placement")
    assert (
        f"ignored placement {OTHER_PEER}/{OTHER_BACKEND}: {OTHER_PEER}/{OTHER_BACKEND} does not satisfy "
        in (events(st)[-1])
    )
    assert st.state is JobState.QUEUED_HANDOFF
    # No CAS: nothing promoted, nothing reserved. The reports were read again before refusing.
    assert fed.fake.promotions == [] and fed.fake.calls.count(contract.FETCH_REPORTS) == 2

    # The tick's real placement runs it, with the job's own reservation through the CAS.
    await fed.place(handle)
    st = await fed.result(handle)
    assert (st.state, st.cluster) == (JobState.SUCCEEDED, PEER)
    assert [(p.peer_id, p.backend_id, p.reserved) for p in fed.fake.promotions] == [
        (PEER, PEER_BACKEND, {"h100": 8})
    ]


async def test_a_placement_that_reserves_less_than_the_job_needs_takes_the_jobs_reservation(
    fed: Federation,
) -> None:
    handle = await fed.queued(gpu_spec("cheap", fed.now_ms))
    cheap = Placement(job_id=handle.id, peer_id=PEER, backend_id=PEER_BACKEND, reserved={"h100": 1})
    await handle.signal(JobWorkflow.place, cheap)
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED
    assert [p.reserved for p in fed.fake.promotions] == [{"h100": 8}]


async def test_forged_placements_off_the_pin_or_for_another_job_are_ignored(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("pinned", fed.now_ms, target_cluster=PEER))
    # Off the pin: the store's CAS would refuse it with a StoreConflict, retried for ever.
    await fed.place(handle, OTHER_PEER, OTHER_BACKEND)
    await ignored(handle, " placement")
    other = Placement(job_id="bob/train", peer_id=PEER, backend_id=PEER_BACKEND)
    await handle.signal(JobWorkflow.place, other)
    st = await wait_for(
        handle, lambda st: sum(m.startswith("ignored placement") for m in events(st)) == 2, "both"
    )
    assert f"the job is pinned to {PEER}" in events(st)[-2] and "it is for job 'bob/train'" in events(st)[-1]
    assert fed.fake.promotions == []
    await fed.place(handle)
    assert (await fed.result(handle)).state is JobState.SUCCEEDED


async def test_a_forced_placement_of_an_unpinned_job_is_ignored(fed: Federation) -> None:
    handle = await fed.queued(gpu_spec("unpinned", fed.now_ms))
    forced = Placement(job_id=handle.id, peer_id=PEER, backend_id="", forced=True)
    await handle.signal(JobWorkflow.place, forced)
    st = await ignored(handle, " placement")
    assert "only for a job pinned to that cluster" in events(st)[-1] and fed.fake.promotions == []


# ---- expire ---------------------------------------------------------------------------------------


async def test_a_forged_expiry_of_a_job_without_a_deadline_is_ignored(fed: Federation) -> None:
    """Issue 26: `expire` ended a queued job UNSCHEDULABLE, though it had no deadline."""
    handle = await fed.queued(gpu_spec("no-deadline", fed.now_ms))
    await handle.signal(JobWorkflow.expire)
    st = await ignored(handle, " expiry")
    assert events(st)[-1] == "ignored expiry: the job has no scheduling deadline"
    assert st.state is JobState.QUEUED_HANDOFF and fed.fake.expired == []
    await fed.place(handle)
    assert (await fed.result(handle)).state is JobState.SUCCEEDED


async def test_an_expiry_of_a_job_that_is_not_queued_is_ignored(fed: Federation) -> None:
    fed.fake.mirror = []
    handle = await fed.queued(gpu_spec("running", fed.now_ms, scheduling_timeout_s=60))
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    await handle.signal(JobWorkflow.expire)
    st = await ignored(handle, " expiry")
    assert events(st)[-1] == "ignored expiry: the job is RUNNING, not queued"
    fed.fake.set_remote_state(PEER, handle.id, ControllerJobState.SUCCEEDED)
    assert (await fed.skip_to_end(handle)).state is JobState.SUCCEEDED


# ---- observe --------------------------------------------------------------------------------------


async def running_with_a_watcher(fed: Federation, spec: JobSpec) -> Handle:
    fed.fake.view = fed.fake.view.model_copy(update={"mirror_safety_poll_s": SAFETY_S})
    fed.fake.mirror = []
    handle = await fed.queued(spec)
    await fed.place(handle)
    await wait_for_state(handle, JobState.RUNNING)
    # The cluster's change feed numbers the record's changes (docs/DESIGN.md, "The change feed").
    key = (PEER, spec.job_id)
    fed.fake.remote[key] = fed.fake.remote[key].model_copy(update={"epoch": "e1", "version": 5})
    return handle


def observation(fed: Federation, spec: JobSpec, state: ControllerJobState, version: int) -> Observation:
    remote = fed.fake.remote[(PEER, spec.job_id)]
    code = {ControllerJobState.SUCCEEDED: 0}.get(state)
    changes = {
        "state": state,
        "exit_code": code,
        "epoch": "e1",
        "version": version,
        "tasks": [TaskStatus(index=0, state=state, exit_code=code)],
    }
    return Observation(cluster=PEER, status=remote.model_copy(update=changes))


async def test_a_forged_success_for_a_running_attempt_changes_nothing(fed: Federation) -> None:
    """Issue 26: `observe` carried a made-up SUCCEEDED for a running job's nonce (read from its
    status query); the job ended at home while its process ran on. Now the end is read back from
    the cluster first, and the job ends as it would have."""
    spec = gpu_spec("forged-end", fed.now_ms)
    handle = await running_with_a_watcher(fed, spec)
    nonce = (await status(handle)).attempts[0].nonce  # what anyone may read
    forged = observation(fed, spec, ControllerJobState.SUCCEEDED, version=10**12)
    assert forged.status is not None and forged.status.nonce == nonce
    await handle.signal(JobWorkflow.observe, forged)
    st = await ignored(handle, ":")
    assert (
        events(st)[-1]
        == f"ignored: an observation says attempt 1 on {PEER} is SUCCEEDED; {PEER} reports RUNNING"
    )
    assert st.state is JobState.RUNNING and st.attempts[0].end is None

    # The real end, with the feed's next version (below the forged one): taken, as the cluster says.
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.FAILED)
    await handle.signal(JobWorkflow.observe, observation(fed, spec, ControllerJobState.FAILED, version=6))
    st = await fed.result(handle)
    assert (st.state, st.exit_code) == (JobState.FAILED, 3)


async def test_a_forged_silence_notice_does_not_shorten_the_clusters_grace(fed: Federation) -> None:
    """A notice claiming its cluster silent for hours: the job asks the cluster itself, and the
    silence it measures (none) is what counts."""
    spec = gpu_spec("forged-silence", fed.now_ms)
    handle = await running_with_a_watcher(fed, spec)
    notice = Observation(cluster=PEER, silent_since_ms=fed.now_ms - 86_400_000, error="forged")
    await handle.signal(JobWorkflow.observe, notice)
    await wait_for(handle, lambda _: bool(fed.fake.follows), "asked its cluster")
    assert fed.fake.follows[0].report_unreachable_s > 0
    st = await status(handle)
    assert st.state is JobState.RUNNING and fed.fake.fences == []


async def test_an_earlier_attempts_observation_is_never_applied_to_the_next_attempt(fed: Federation) -> None:
    """Issue 28: the watcher's WORKER_FAILED for attempt 1 arrived while the job was asking the
    cluster itself; kept, it was applied to attempt 2, which ended FAILED at home while it ran on
    and SUCCEEDED on its cluster. Now it is dropped (recorded), and attempt 2 runs to its own end."""
    spec = gpu_spec("two-attempts", fed.now_ms, target_cluster=PEER)
    handle = await running_with_a_watcher(fed, spec)
    first = attempt_nonce(f"{spec.job_id}@{spec.submit_ms}", 1)

    # A silence notice: the job asks its cluster itself (held), and meanwhile the watcher reports
    # attempt 1 lost (its worker died with the controller).
    fed.fake.hold(contract.FOLLOW_JOB)
    await handle.signal(JobWorkflow.observe, Observation(cluster=PEER, silent_since_ms=fed.now_ms))
    await fed.fake.reached(contract.FOLLOW_JOB)
    lost = observation(fed, spec, ControllerJobState.WORKER_FAILED, version=9)
    await handle.signal(JobWorkflow.observe, lost)
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.WORKER_FAILED)
    fed.fake.release(contract.FOLLOW_JOB)

    # Attempt 1 ends (the cluster's own answer), and the job is queued again for attempt 2.
    await wait_for(handle, lambda st: st.state is JobState.QUEUED_HANDOFF, "queued again")
    await fed.place(handle)
    st = await wait_for(
        handle, lambda st: len(st.attempts) == 2 and st.state is JobState.RUNNING, "ran again"
    )
    second = st.attempts[1].nonce
    assert st.attempts[0].end == AttemptEnd.PREEMPTED.value and st.attempts[0].nonce == first
    st = await ignored(handle, " an observation")
    assert f"about '{first}' (WORKER_FAILED): attempt 2 is '{second}'" in events(st)[-1]
    assert st.state is JobState.RUNNING

    key = (PEER, spec.job_id)
    fed.fake.remote[key] = fed.fake.remote[key].model_copy(update={"epoch": "e1", "version": 20})
    fed.fake.set_remote_state(PEER, spec.job_id, ControllerJobState.SUCCEEDED)
    done = observation(fed, spec, ControllerJobState.SUCCEEDED, version=21)
    assert done.status is not None and done.status.nonce == second
    await handle.signal(JobWorkflow.observe, done)
    st = await fed.result(handle)
    assert (st.state, [a.end for a in st.attempts]) == (JobState.SUCCEEDED, ["PREEMPTED", "SUCCEEDED"])


async def test_a_force_routing_to_a_cluster_without_any_backend_parks_the_job(fed: Federation) -> None:
    """The tick force-routes a pinned job whose cluster advertises no backend of its shape; one that
    advertises none at all leaves no backend to name in the launch request, which a cluster would
    refuse: the job parks with the reason (it failed its workflow task for ever)."""
    view = fed.fake.view
    bare = [r.model_copy(update={"backends": []}) if r.peer_id == PEER else r for r in view.reports]
    fed.fake.view = view.model_copy(update={"reports": bare})
    handle = await fed.queued(gpu_spec("bare", fed.now_ms, target_cluster=PEER))
    await handle.signal(
        JobWorkflow.place, Placement(job_id=handle.id, peer_id=PEER, backend_id="", forced=True)
    )
    st = await wait_for_state(handle, JobState.HANDOFF_FAILED)
    assert st.reason.startswith(f"Cannot hand off to {PEER}: backend_id:"), st.reason
    assert fed.fake.launch_attempts == []
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
