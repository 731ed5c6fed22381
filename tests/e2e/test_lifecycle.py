"""The durable lifecycle on the real stack (docs/DESIGN.md, "Data flow"): queue → tick → CAS promotion →
artifact check → handoff → mirror, with refusals, outages, deadlines, contention and cancels.

Every test runs twice, once per backend of the GPU peers (issue 6: the same scheduling tests pass
whichever backend a peer uses): ``[process]`` on the session stack, ``[ray]`` on the same federation
with those backends on a real local Ray head (``config/clusters-ray.toml``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from stack import WAITS, Stack, wait_until
from temporalio.api.enums.v1 import WorkflowTaskFailedCause

from iris.client import JobNotFound
from iris.controller.client import ControllerClient
from iris.controller.errors import NotFound
from iris.controller.models import JobStatus as ControllerJobStatus
from iris.jobs import JobState, JobStatus
from iris.store.models import CancelResult, HandleState
from workflows.job import JobWorkflow

H100 = {"device_type": "h100", "gpu_count": 8}


@pytest.fixture(scope="module")
def stack(stack_per_backend: Stack) -> Stack:
    """Every test here runs on both backends of the GPU peers (see tests/conftest.py)."""
    return stack_per_backend


async def remote(stack: Stack, cluster: str, job_id: str) -> ControllerJobStatus | None:
    async with ControllerClient.for_cluster(stack.config, cluster) as ctl:
        try:
            return await ctl.status(job_id)
        except NotFound:
            return None


async def where(stack: Stack, job_id: str) -> list[str]:
    """Every cluster that ever received the job (the peers' own record)."""
    found = []
    for name in stack.config.cluster_names:
        if await remote(stack, name, job_id) is not None:
            found.append(name)
    return found


async def wait_state(stack: Stack, job_id: str, *states: JobState, timeout: float = 60) -> JobStatus:
    async def reached() -> bool:
        return (await stack.iris.describe(job_id)).state in states

    await wait_until(reached, timeout=timeout, what=f"{job_id} in {states}")
    return await stack.iris.describe(job_id)


def put_gcs(stack: Stack, bucket: str, key: str) -> None:
    client = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        client_options={"api_endpoint": f"http://127.0.0.1:{stack.config.gcs_port}"},
    )
    client.bucket(bucket).blob(key).upload_from_string(b"shard")


async def test_queued_job_is_placed_promoted_checked_handed_off_and_mirrored(stack: Stack) -> None:
    for bucket in ("cw-us-east-02a-artifacts", "cw-rno2a-artifacts"):
        await asyncio.to_thread(stack.put_artifact, bucket, "data/shard-0")
    job_id = await stack.iris.submit(
        ["sh", "-c", "echo training on $IRIS_CLUSTER with $CUDA_VISIBLE_DEVICES"],
        name="spill",
        artifacts=["s3://cw-rno2a-artifacts/data/shard-0"],
        **H100,
    )
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.disposition == "queue"
    assert final.cluster in {"cw-us-east-02a", "cw-rno2a"}
    states = [e.state for e in final.events]
    for expected in (
        JobState.QUEUED_HANDOFF,
        JobState.PENDING_HANDOFF,
        JobState.HANDED_OFF,
        JobState.SUCCEEDED,
    ):
        assert expected in states, states
    assert any("promoted to" in e.message for e in final.events)
    assert any("Checking 1 artifact" in e.message for e in final.events)
    # Handed off exactly once, to exactly one cluster.
    assert await where(stack, job_id) == [final.cluster]
    peer_view = await remote(stack, final.cluster, job_id)
    assert peer_view is not None and peer_view.attempts == 1
    handle = await asyncio.to_thread(stack.store.get, job_id)
    assert handle is not None and handle.state is HandleState.SUCCEEDED
    logs = await stack.iris.logs(job_id)
    # A backend fact: the process backend hands out chip slots and sets CUDA_VISIBLE_DEVICES to
    # them; Ray counts a custom resource but assigns no chip indices, so it sets none (making them
    # up would give two jobs on one 16-chip node the same chips). IRIS_CLUSTER is the same on both.
    devices = "0,1,2,3,4,5,6,7" if stack.backend == "process" else ""
    assert logs.data == f"training on {final.cluster} with {devices}".rstrip() + "\n"


async def test_missing_artifact_parks_the_job_with_its_name(stack: Stack) -> None:
    uri = "s3://cw-rno2a-artifacts/nope/missing.bin"
    job_id = await stack.iris.submit(["true"], name="no-artifact", target_cluster="cw-rno2a", artifacts=[uri])
    st = await wait_state(stack, job_id, JobState.HANDOFF_FAILED)
    assert uri in st.reason and "missing in cw-rno2a's object store" in st.reason
    assert await where(stack, job_id) == []
    outcome = await stack.iris.cancel_and_report(job_id)
    final = await stack.iris.wait(job_id, timeout_s=30)
    assert final.state is JobState.KILLED
    assert outcome.won  # never delivered
    assert await where(stack, job_id) == []


async def test_a_parked_job_frees_its_reservation_for_the_next_job(stack: Stack) -> None:
    """Issue 27: an 8-GPU job parked on cw-rno2a (its artifact missing) held the peer's reservation,
    and the next 8-GPU job there waited until the parked one was cancelled. Now the park releases
    it: the next job runs while the parked one still waits for its artifact; the parked one's
    replay in place then finds the capacity taken and waits in the queue for it."""
    key = f"nope/parked-{random.randrange(1 << 30)}.bin"
    uri = f"s3://cw-rno2a-artifacts/{key}"
    parked = await stack.iris.submit(
        ["echo", "late"], name="parked-holds-nothing", target_cluster="cw-rno2a", artifacts=[uri], **H100
    )
    next_job = ""
    try:
        await wait_state(stack, parked, JobState.HANDOFF_FAILED)
        reservations = await asyncio.to_thread(stack.store.reservations)
        assert not [r for r in reservations if r.job_id == parked], reservations
        next_job = await stack.iris.submit(
            ["sleep", "30"], name="after-parked", target_cluster="cw-rno2a", **H100
        )
        await wait_state(stack, next_job, JobState.RUNNING)
        assert (await stack.iris.describe(parked)).state is JobState.HANDOFF_FAILED
        # The artifact arrives; the replay in place finds cw-rno2a taken, and waits in the queue.
        await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", key)
        await stack.iris.replay_handoff(parked)
        await wait_state(stack, parked, JobState.QUEUED_HANDOFF)
        assert await where(stack, parked) == []
        await stack.iris.cancel(next_job)
        final = await stack.iris.wait(parked, timeout_s=90)
        assert final.state is JobState.SUCCEEDED, final.reason
        assert await where(stack, parked) == ["cw-rno2a"]
    finally:
        for job in (parked, next_job):
            if job:
                await stack.iris.cancel(job)


async def test_home_reads_gcs_artifacts_and_refuses_s3_ones(stack: Stack) -> None:
    await asyncio.to_thread(put_gcs, stack, "marin-artifacts", "ckpt/step-100")
    ok = await stack.iris.submit(["true"], name="gcs-ok", artifacts=["gs://marin-artifacts/ckpt/step-100"])
    assert (await stack.iris.wait(ok, timeout_s=60)).state is JobState.SUCCEEDED
    wrong = await stack.iris.submit(
        ["true"], name="gcs-wrong", artifacts=["s3://cw-rno2a-artifacts/data/shard-0"]
    )
    st = await wait_state(stack, wrong, JobState.HANDOFF_FAILED)
    assert "not in marin's object store" in st.reason
    await stack.iris.cancel(wrong)
    assert (await stack.iris.wait(wrong, timeout_s=30)).state is JobState.KILLED


async def test_refusal_by_the_peer_is_handoff_rejected_with_its_message(stack: Stack) -> None:
    # Pinned to a peer with no TPU: force-routed (docs/DESIGN.md, "Pins and force-routing"), and the
    # peer refuses it.
    job_id = await stack.iris.submit(
        ["true"], name="tpu-forced", target_cluster="cw-rno2a", device_type="tpu-v9", gpu_count=4
    )
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.HANDOFF_REJECTED
    assert "cw-rno2a refused the job" in final.reason
    assert "tpu" in final.reason
    handle = await asyncio.to_thread(stack.store.get, job_id)
    assert handle is not None and handle.state is HandleState.HANDOFF_REJECTED


async def test_peer_down_during_handoff_is_retried_and_delivered_exactly_once(stack: Stack) -> None:
    proxy = stack.proxies["cw-us-east-02a"]
    proxy.fail_launches = 2
    refused_before = proxy.refused_launches
    job_id = await stack.iris.submit(["echo", "once"], name="outage", target_cluster="cw-us-east-02a")
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert proxy.refused_launches - refused_before == 2
    peer_view = await remote(stack, "cw-us-east-02a", job_id)
    assert peer_view is not None and peer_view.attempts == 1
    assert [e.state for e in final.events].count(JobState.HANDED_OFF) == 1


async def test_a_job_only_unreachable_peers_can_run_waits_for_them_instead_of_being_rejected(
    stack: Stack,
) -> None:
    """Both GPU peers' controllers down at submit: their backends still exist (docs/DESIGN.md,
    "Classification")."""
    gpu_peers = ("cw-rno2a", "cw-us-east-02a")

    async def both_down() -> bool:
        view = await stack.iris.peers()
        return all(not r.reachable for r in view.reports if r.peer_id in gpu_peers)

    try:
        for name in gpu_peers:
            stack.proxies[name].down = True
        await wait_until(both_down, timeout=30, what="both GPU peers to be reported unreachable")
        job_id = await stack.iris.submit(
            ["echo", "waited"], name="peers-down", device_type="h100", gpu_count=8
        )
        queued = await wait_state(stack, job_id, JobState.QUEUED_HANDOFF)
        assert queued.disposition == "queue"
        assert (
            "only cw-rno2a unreachable, cw-us-east-02a unreachable can run it" in queued.classification_reason
        )
    finally:
        for name in gpu_peers:
            stack.proxies[name].down = False
    final = await stack.iris.wait(job_id, timeout_s=90)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.cluster in gpu_peers


async def test_deadline_makes_a_job_unschedulable_and_it_is_never_promoted(stack: Stack) -> None:
    # 16 H100 on one backend while one of cw-us-east-02a's is held: it can only wait, until its deadline.
    async with stack.holding():
        job_id = await stack.iris.submit(["true"], name="deadline-wait", scheduling_timeout_s=2, **WAITS)
        final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.UNSCHEDULABLE
    assert final.reason == "Scheduling timeout passed before any cluster had room"
    assert not any("promoted to" in e.message for e in final.events)
    assert await where(stack, job_id) == []
    handle = await asyncio.to_thread(stack.store.get, job_id)
    assert handle is not None and handle.state is HandleState.UNSCHEDULABLE


async def test_a_job_no_backend_can_ever_hold_is_rejected_at_submit(stack: Stack) -> None:
    """3 × 8 H100 on one backend, where the largest has 16: REJECTED at classification (issue 27;
    docs/DESIGN.md, "Never fits"), never queued, never promoted, nothing reserved."""
    from iris.policy.reasons import ReasonCode

    job_id = await stack.iris.submit(["true"], name="never-fits", replicas=3, **H100)
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert (final.state, final.reason_code) == (JobState.REJECTED, ReasonCode.TooLarge), final.reason
    assert "needs 24 h100 on one backend" in final.reason
    assert "cw-us-east-02a/h100-us-east-02a with 16" in final.reason
    assert JobState.QUEUED_HANDOFF not in [e.state for e in final.events]
    assert await where(stack, job_id) == []
    handle = await asyncio.to_thread(stack.store.get, job_id)
    assert handle is None, handle  # never enqueued


async def test_two_jobs_competing_for_8_free_gpus_one_runs_the_other_waits(stack: Stack) -> None:
    a = await stack.iris.submit(["sleep", "300"], name="compete-a", target_cluster="cw-rno2a", **H100)
    b = await stack.iris.submit(["sleep", "300"], name="compete-b", target_cluster="cw-rno2a", **H100)
    # Either may win: each is queued once its own classification ends, and a tick can run between.
    started = (JobState.RUNNING, JobState.PENDING)

    async def one_started() -> bool:
        return any([(await stack.iris.describe(j)).state in started for j in (a, b)])

    await wait_until(one_started, timeout=60, what="one of the two jobs to start on cw-rno2a")
    first, second = (a, b) if (await stack.iris.describe(a)).state in started else (b, a)
    assert (await stack.iris.describe(first)).cluster == "cw-rno2a"

    async def explained() -> bool:
        st = await stack.iris.describe(second)
        return st.state is JobState.QUEUED_HANDOFF and "h100" in st.reason

    try:
        await wait_until(explained, timeout=30, what="the other job to wait with a capacity reason")
        waiting = await stack.iris.describe(second)
        assert await where(stack, second) == []
        assert "cw-rno2a" in waiting.reason
        # When the first ends, the second gets the capacity.
        await stack.iris.cancel(first)
        assert (await stack.iris.wait(first, timeout_s=30)).state is JobState.KILLED
        await wait_state(stack, second, JobState.RUNNING, timeout=60)
    finally:  # never leave 8 H100s held for the tests after this one
        for job in (a, b):
            with contextlib.suppress(JobNotFound):  # already ended
                await stack.iris.cancel(job)
    assert (await stack.iris.wait(second, timeout_s=30)).state is JobState.KILLED


async def test_cancel_racing_promotion_never_delivers_a_cancelled_job(stack: Stack) -> None:
    """Cancels at random moments around placement: a cancel that won means never delivered."""
    rng = random.Random(20261130)
    outcomes = {"won": 0, "lost": 0}
    for i in range(12):
        job_id = await stack.iris.submit(["sleep", "30"], name=f"race-{i}", target_cluster="cw-us-east-02a")
        await asyncio.sleep(rng.uniform(0, 0.4))  # not a wait: the race's jitter, the cancel lands anywhere
        outcome = await stack.iris.cancel_and_report(job_id)
        final = await stack.iris.wait(job_id, timeout_s=60)
        assert final.terminal
        delivered = await where(stack, job_id)
        if outcome.won:
            outcomes["won"] += 1
            assert delivered == [], (job_id, final.events)
            assert final.state is JobState.KILLED
        else:
            outcomes["lost"] += 1
            peer_view = await remote(stack, "cw-us-east-02a", job_id)
            if final.state is JobState.KILLED and peer_view is not None:
                assert peer_view.terminal and peer_view.attempts == 1
    assert outcomes["won"] > 0


async def test_a_cancel_whose_workflow_task_the_server_failed_is_sent_again(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal landing while the task carrying the cancel Update completes the run makes the server
    fail that task (UNHANDLED_COMMAND) and drop the Update unaccepted; the client sends it again."""
    async with stack.holding():
        await _cancel_unhandled(stack, monkeypatch)


async def _cancel_unhandled(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = await stack.iris.submit(["true"], name="cancel-unhandled", **WAITS)  # waits
    await wait_state(stack, job_id, JobState.QUEUED_HANDOFF)
    entered, release = threading.Event(), threading.Event()
    record_cancel = stack.store.record_cancel

    def held_first_time(job: str, reason: str) -> CancelResult:
        if job == job_id and not entered.is_set():
            entered.set()  # the task carrying the Update is open, running this step
            release.wait(30)
        return record_cancel(job, reason)

    async def step_started() -> bool:
        return entered.is_set()

    monkeypatch.setattr(stack.store, "record_cancel", held_first_time)
    cancel = asyncio.create_task(stack.iris.cancel_and_report(job_id))
    try:
        await wait_until(step_started, what="the cancel step to start")
        await stack.client.get_workflow_handle(job_id).signal(
            JobWorkflow.explain, "a tick's reason, mid-task"
        )
    finally:
        release.set()
    outcome = await asyncio.wait_for(cancel, 60)
    assert outcome.won and outcome.state is JobState.KILLED, outcome
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    assert [e.workflow_task_failed_event_attributes.cause for e in failed] == [
        WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND
    ]
    assert await where(stack, job_id) == []
    # Asked again once the job has ended, the answer is the same: never delivered.
    await stack.iris.wait(job_id, timeout_s=30)
    again = await stack.iris.cancel_and_report(job_id)
    assert again.won and again.state is JobState.KILLED and "never delivered" in again.message


async def test_cancelling_a_job_that_ran_reports_it_lost(stack: Stack) -> None:
    job_id = await stack.iris.submit(["true"], name="ran-then-cancelled", target_cluster="cw-rno2a")
    assert (await stack.iris.wait(job_id, timeout_s=60)).state is JobState.SUCCEEDED
    outcome = await stack.iris.cancel_and_report(job_id)
    assert not outcome.won and outcome.state is JobState.SUCCEEDED, outcome


async def test_cancel_recorded_in_the_store_before_promotion_wins_the_cas(stack: Stack) -> None:
    """The CAS itself: the store already holds the cancel intent when the placement arrives."""
    from iris.policy.models import Placement

    async with stack.holding():
        job_id = await stack.iris.submit(["true"], name="cas-guard", **WAITS)  # no room now: waits
        await wait_state(stack, job_id, JobState.QUEUED_HANDOFF)
        result = await asyncio.to_thread(stack.store.record_cancel, job_id, "operator")
        assert result.won
        placement = Placement(job_id=job_id, peer_id="cw-us-east-02a", backend_id="h100-us-east-02a")
        await stack.client.get_workflow_handle(job_id).signal(JobWorkflow.place, placement)
        final = await stack.iris.wait(job_id, timeout_s=30)
    assert final.state is JobState.KILLED
    assert final.reason == "Cancelled before handoff"
    assert any("refused" in e.message or "Cancelled" in e.message for e in final.events)
    assert await where(stack, job_id) == []


async def test_logs_are_relayed_home_and_outlive_the_peer(stack: Stack) -> None:
    job_id = await stack.iris.submit(
        ["sh", "-c", "for i in 1 2 3; do echo line-$i; done; echo err >&2"],
        name="relay",
        target_cluster="cw-rno2a",
    )
    assert (await stack.iris.wait(job_id, timeout_s=60)).state is JobState.SUCCEEDED
    peer = stack.services["controller cw-rno2a"]
    await asyncio.to_thread(peer.stop)
    try:
        res = await stack.cli("job", "logs", job_id)
        assert res.code == 0, res.stderr
        assert sorted(res.stdout.splitlines()) == ["err", "line-1", "line-2", "line-3"]
    finally:
        peer.start()
        await asyncio.to_thread(peer.wait_ready, 60)


async def test_logs_follow_streams_until_the_job_ends(stack: Stack) -> None:
    job_id = await stack.iris.submit(
        ["sh", "-c", "echo first; sleep 2; echo second"], name="follow", target_cluster="cw-us-east-02a"
    )
    res = await stack.cli("job", "logs", "-f", job_id)
    assert res.code == 0, res.stderr
    assert res.stdout.splitlines() == ["first", "second"]
    assert (await stack.iris.describe(job_id)).state is JobState.SUCCEEDED


async def test_the_logs_of_a_running_job_are_current_without_following(stack: Stack) -> None:
    """A running job's home copy is refreshed only every few minutes (docs/DESIGN.md, "The change
    feed"); `iris job logs` asks for a refresh first, so it shows what the job has written."""
    job_id = await stack.iris.submit(
        ["sh", "-c", "echo early; sleep 1; echo later; sleep 300"],
        name="current",
        target_cluster="cw-us-east-02a",
    )
    try:
        await wait_state(stack, job_id, JobState.RUNNING)

        async def both_lines_on_the_peer() -> bool:
            async with ControllerClient.for_cluster(stack.config, "cw-us-east-02a") as peer:
                return "later\n" in (await peer.logs(job_id)).data

        await wait_until(both_lines_on_the_peer, timeout=60, what="both lines written on the peer")
        res = await stack.cli("job", "logs", job_id)
        assert res.code == 0, res.stderr
        assert res.stdout.splitlines() == ["early", "later"]
    finally:
        await stack.iris.cancel(job_id, "test over")


async def test_the_stacks_controllers_admit_only_signed_requests(stack: Stack) -> None:
    """docs/DESIGN.md, "Handoff and admission", in the running stack: handoffs above were signed; an
    unsigned caller is refused."""
    from iris.controller.errors import Unauthenticated

    for cluster in stack.config.cluster_names:
        async with ControllerClient(stack.config.cluster(cluster).url) as anonymous:
            try:
                await anonymous.backends()
            except Unauthenticated:
                continue
            raise AssertionError(f"{cluster} answered an unsigned request")


async def test_cancel_and_query_in_the_first_instant_after_submit(stack: Stack) -> None:
    """An Update or query can reach the workflow before run() starts; both must be answered."""
    for i in range(3):
        job_id = await stack.iris.submit(
            ["sleep", "60"], name=f"instant-{i}", device_type="h100", gpu_count=8
        )
        status, outcome = await asyncio.gather(
            stack.iris.describe(job_id), stack.iris.cancel_and_report(job_id)
        )
        assert status.job_id == job_id
        final = await stack.iris.wait(job_id, timeout_s=30)
        assert final.state is JobState.KILLED
        if outcome.won:
            assert await where(stack, job_id) == []
