"""Record the JSON histories the determinism test replays (tests/determinism/histories/).

Starts the same real stack the tests use (tests/stack.py: Temporal dev server, emulators, three
controllers behind fault proxies, an in-process worker), drives one job down each main path of
JobWorkflow, and writes each finished history as ``<scenario>.json`` (the format of
``temporal workflow show -o json``), plus the placement manager's history so far.

Regenerate after every change to workflows/ (one command, about a minute)::

    uv run python -m scripts.record_histories            # every scenario
    uv run python -m scripts.record_histories --only local rejected

Then commit the files: the test suite replays each against the workflow code it ships with. The
prefixed files (``v1-*``, recorded before ``local-store-steps-v1``; ``v2-*``, before
``job-baseline-2026-12``; ``v3-*``, before ``launch-before-staging-v1``; ``v4-*``, before
``job-baseline-2027-01``) keep the paths of runs begun by older code replayable; this script never
writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from determinism.history_files import load as load_history  # noqa: E402
from stack import WAITS, Stack, StackRunner, wait_until  # noqa: E402
from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import WorkflowHistory  # noqa: E402
from temporalio.runtime import Runtime, TelemetryConfig  # noqa: E402

from activities.watch import Observation  # noqa: E402
from cli.ops import DeterminismReport, replay_histories  # noqa: E402
from iris import contract  # noqa: E402
from iris.client import build_spec  # noqa: E402
from iris.contract import JOB_WORKFLOW, peer_watch_workflow_id  # noqa: E402
from iris.controller.models import ControllerJobState  # noqa: E402
from iris.controller.models import JobStatus as ControllerJobStatus  # noqa: E402
from iris.jobs import CancelRequest, JobSpec, JobState, JobStatus, start_search_attributes  # noqa: E402
from iris.policy.models import Band, DeviceRequest, Placement  # noqa: E402
from iris.policy.reasons import ReasonCode  # noqa: E402
from iris.userauth import Action  # noqa: E402

OUT_DIR = ROOT / "tests" / "determinism" / "histories"
USER = "recorder@example.com"
H100 = {"device_type": "h100", "gpu_count": 8}


async def _state(stack: Stack, job_id: str, *states: JobState, within: float = 90.0) -> JobStatus:
    deadline = time.monotonic() + within
    while True:
        status = await stack.iris.describe(job_id)
        if status.state in states:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job_id} is {status.state.value}, not in {states}: {status.reason}")
        await asyncio.sleep(0.2)


async def _closed(stack: Stack, job_id: str, within: float = 90.0) -> None:
    """Until the workflow itself has closed (not only reached a terminal job state)."""
    handle = stack.client.get_workflow_handle(job_id)
    deadline = time.monotonic() + within
    while (await handle.describe()).close_time is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"workflow {job_id} did not close within {within}s")
        await asyncio.sleep(0.2)


async def _start_raw(stack: Stack, spec: JobSpec) -> None:
    """Start the job workflow straight on Temporal, past the SDK's prechecks."""
    await stack.client.start_workflow(
        JOB_WORKFLOW,
        spec,
        id=spec.job_id,
        task_queue=stack.config.temporal.task_queue,
        search_attributes=start_search_attributes(spec),
    )


def _signed(stack: Stack, spec: JobSpec) -> JobSpec:
    """A raw-started spec signed by its user, as the SDK signs a submission."""
    signature = stack.iris.sign(Action.SUBMIT, spec.user, spec.job_id, spec)
    return spec.model_copy(update={"signature": signature})


# The scenario being recorded, when it reuses another's drive (its jobs then get names of their
# own: scenarios run side by side on one stack, and a job id is taken once).
_REUSED_BY: contextvars.ContextVar[str] = contextvars.ContextVar("reused_by", default="")


async def _submit(stack: Stack, name: str, command: list[str], **kw: Any) -> str:
    reused = _REUSED_BY.get()
    name = f"hist-{name}-{reused}" if reused else f"hist-{name}"
    return await stack.iris.submit(command, name=name.replace("_", "-"), user=USER, **kw)


def _scratch(stack: Stack) -> Path:
    """A directory a job's command may leave a marker in for its next attempt: the stack's shared
    directory, which a sandboxed job run as the controller's ``run_as`` user can write (a private
    temp directory of the recorder's it could not, and the sandbox's own /tmp is new each time)."""
    path = Path(tempfile.mkdtemp(prefix="iris-hist-", dir=stack.shared_dir))
    path.chmod(0o1777)  # as the shared directory itself: the jobs' pool uids write there
    return path


# ---- scenarios: each drives one job to the end of its path and returns its id ----------------


async def local(stack: Stack) -> str:
    job_id = await _submit(stack, "local", ["echo", "hello"])
    await _state(stack, job_id, JobState.SUCCEEDED)
    return job_id


async def queued_handed_off(stack: Stack) -> str:
    await asyncio.to_thread(stack.put_artifact, "cw-us-east-02a-artifacts", "hist/shard-0")
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "hist/shard-0")
    job_id = await _submit(
        stack,
        "queued-handed-off",
        ["echo", "on a peer"],
        artifacts=["s3://cw-rno2a-artifacts/hist/shard-0"],
        **H100,
    )
    await _state(stack, job_id, JobState.SUCCEEDED)
    return job_id


def held(drive: Callable[[Stack], Awaitable[str]]) -> Callable[[Stack], Awaitable[str]]:
    """A scenario whose job must wait in the queue (WAITS: 16 H100 on one backend) runs while a
    sleeper holds one H100 of cw-us-east-02a (``Stack.holding``): a job larger than every backend
    is rejected at submit instead (docs/DESIGN.md, "Never fits")."""

    async def run(stack: Stack) -> str:
        async with stack.holding():
            return await drive(stack)

    run.__name__ = drive.__name__
    run.__doc__ = drive.__doc__
    return run


async def followed_by_watcher(stack: Stack) -> str:
    """FEED_PATCH: a job running on a peer, followed through the peer's watcher (no poller)."""
    job_id = await _submit(stack, "followed-by-watcher", ["sleep", "3"], target_cluster="cw-us-east-02a")
    await _state(stack, job_id, JobState.SUCCEEDED)
    return job_id


@held
async def cancelled_while_queued(stack: Stack) -> str:
    job_id = await _submit(stack, "cancel-queued", ["true"], **WAITS)  # no room now: waits
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    outcome = await stack.iris.cancel_and_report(job_id)
    assert outcome.won, outcome
    return job_id


@held
async def cancelled_by_signal_while_queued(stack: Stack) -> str:
    job_id = await _submit(stack, "cancel-signal", ["true"], **WAITS)
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    await stack.iris.cancel(job_id)
    await _state(stack, job_id, JobState.KILLED)
    return job_id


@held
async def cancelled_through_temporal(stack: Stack) -> str:
    job_id = await _submit(stack, "cancel-temporal", ["true"], **WAITS)
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    await stack.client.get_workflow_handle(job_id).cancel()
    await _state(stack, job_id, JobState.KILLED)
    return job_id


@held
async def unsigned_cancel_ignored(stack: Stack) -> str:
    """AUTH_PATCH: a signed submission; a bare cancel signal (no signature) is recorded and ignored,
    the owner's signed cancel ends the job."""
    job_id = await _submit(stack, "unsigned-cancel", ["true"], **WAITS)
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    await stack.client.get_workflow_handle(job_id).signal(contract.CANCEL, CancelRequest(reason="bare"))
    deadline = time.monotonic() + 30
    while not any("cancel refused" in e.message for e in (await stack.iris.describe(job_id)).events):
        if time.monotonic() > deadline:
            raise RuntimeError("the bare cancel was not recorded")
        await asyncio.sleep(0.2)
    await stack.iris.cancel(job_id)
    await _state(stack, job_id, JobState.KILLED)
    return job_id


async def unsigned_submission_rejected(stack: Stack) -> str:
    """AUTH_PATCH: a workflow started without a signed statement ends REJECTED before classifying."""
    spec = build_spec(["true"], name="hist-unsigned", user=USER)
    await _start_raw(stack, spec)
    await _state(stack, spec.job_id, JobState.REJECTED)
    return spec.job_id


async def cancelled_while_running(stack: Stack) -> str:
    job_id = await _submit(stack, "cancel-running", ["sleep", "300"], target_cluster="cw-rno2a")
    await _state(stack, job_id, JobState.RUNNING)
    outcome = await stack.iris.cancel_and_report(job_id)
    assert not outcome.won, outcome
    await _state(stack, job_id, JobState.KILLED)
    return job_id


async def rejected(stack: Stack) -> str:
    # The SDK's precheck refuses this before anything starts, so the workflow is started directly:
    # the path exists for a federation whose live reports no longer match the configured shapes.
    spec = JobSpec(
        job_id="recorder/hist-rejected",
        name="hist-rejected",
        user=USER,
        command=["true"],
        device=DeviceRequest(type="tpu", variant="tpu-v9", count=4),
        submit_ms=int(time.time() * 1000),
    )
    spec = _signed(stack, spec)
    await _start_raw(stack, spec)
    await _state(stack, spec.job_id, JobState.REJECTED)
    return spec.job_id


async def handoff_rejected(stack: Stack) -> str:
    job_id = await _submit(
        stack, "handoff-rejected", ["true"], target_cluster="cw-rno2a", device_type="tpu-v9", gpu_count=4
    )
    await _state(stack, job_id, JobState.HANDOFF_REJECTED)
    return job_id


async def parked_missing_artifact_cancelled(stack: Stack) -> str:
    uri = "s3://cw-rno2a-artifacts/hist/missing.bin"
    job_id = await _submit(stack, "parked-cancelled", ["true"], target_cluster="cw-rno2a", artifacts=[uri])
    await _state(stack, job_id, JobState.HANDOFF_FAILED)
    outcome = await stack.iris.cancel_and_report(job_id)
    assert outcome.won, outcome
    return job_id


async def parked_replayed(stack: Stack) -> str:
    uri = "s3://cw-rno2a-artifacts/hist/late.bin"
    job_id = await _submit(
        stack, "parked-replayed", ["echo", "late"], target_cluster="cw-rno2a", artifacts=[uri]
    )
    await _state(stack, job_id, JobState.HANDOFF_FAILED)
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "hist/late.bin")
    await stack.iris.replay_handoff(job_id)
    await _state(stack, job_id, JobState.SUCCEEDED)
    return job_id


@held
async def deadline_unschedulable(stack: Stack) -> str:
    job_id = await _submit(stack, "deadline", ["true"], scheduling_timeout_s=2, **WAITS)
    await _state(stack, job_id, JobState.UNSCHEDULABLE)
    return job_id


async def outage_parked_cancelled(stack: Stack) -> str:
    # Every launch to the peer is refused as UNAVAILABLE: retried with backoff, then parked.
    proxy = stack.proxies["cw-us-east-02a"]
    proxy.fail_launches = 1000
    try:
        job_id = await _submit(stack, "outage", ["true"], target_cluster="cw-us-east-02a")
        await _state(stack, job_id, JobState.HANDOFF_FAILED, within=120)
    finally:
        proxy.fail_launches = 0
    await stack.iris.cancel(job_id)
    await _state(stack, job_id, JobState.KILLED)
    return job_id


def _workspace(loss: str) -> Path:
    workspace = Path(tempfile.mkdtemp(prefix="iris-hist-ws-"))
    (workspace / "train.py").write_text("import helper\nprint(helper.LOSS)\n")
    (workspace / "helper.py").write_text(f"LOSS = {loss}\n")
    return workspace


async def bundled_handed_off(stack: Stack) -> str:
    # A workspace bundle: stored at home; the launch finds the peer without it, so it is staged
    # there (BUILDING) and the launch sent again (LAUNCH_FIRST_PATCH).
    workspace = _workspace("2.31")
    try:
        job_id = await _submit(stack, "bundled", ["train.py"], workdir=workspace, **H100)
        await _state(stack, job_id, JobState.SUCCEEDED)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return job_id


async def bundle_already_held(stack: Stack) -> str:
    # Two jobs from one workspace on one peer: the second's launch is accepted at once, with no
    # staging and no BUILDING (LAUNCH_FIRST_PATCH). The second is recorded.
    workspace = _workspace("2.29")
    try:
        pinned: dict[str, Any] = {"target_cluster": "cw-rno2a", **H100}
        first = await _submit(stack, "bundle-first", ["train.py"], workdir=workspace, **pinned)
        await _state(stack, first, JobState.SUCCEEDED)
        job_id = await _submit(stack, "bundle-held", ["train.py"], workdir=workspace, **pinned)
        await _state(stack, job_id, JobState.SUCCEEDED)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return job_id


async def launch_reply_lost(stack: Stack) -> str:
    # The peer accepts the launch and runs the job; its reply is lost. The repeated launch finds the
    # job ended, and its output is relayed home before the job is reported (TERMINAL_LAUNCH_PATCH).
    proxy = stack.proxies["cw-rno2a"]
    proxy.lose_replies["POST /v1/jobs"] += 1
    try:
        job_id = await _submit(stack, "reply-lost", ["echo", "once"], target_cluster="cw-rno2a")
        await _state(stack, job_id, JobState.SUCCEEDED)
    finally:
        proxy.lose_replies.clear()
    return job_id


async def failure_retried(stack: Stack) -> str:
    # Attempt 1 exits 3; --max-retries-failure 1 sends the job back to the queue, and attempt 2 (a
    # new nonce) succeeds.
    marker = _scratch(stack) / "failed-once"
    spec = JobSpec(
        job_id="recorder/hist-failure-retried",
        name="hist-failure-retried",
        user=USER,
        command=["sh", "-c", f"test -e {marker} || {{ touch {marker}; exit 3; }}"],
        device=DeviceRequest(type="gpu", variant="h100", count=8),
        max_retries_failure=1,
        submit_ms=int(time.time() * 1000),
    )
    spec = _signed(stack, spec)
    await _start_raw(stack, spec)
    status = await _state(stack, spec.job_id, JobState.SUCCEEDED, within=120)
    assert [a.end for a in status.attempts] == ["FAILED", "SUCCEEDED"], status.attempts
    return spec.job_id


async def launch_replies_all_lost(stack: Stack) -> str:
    # Every reply to the launch is lost: the retries run out, the workflow asks the peer whether it
    # has the attempt (it does) and follows it there instead of parking.
    proxy = stack.proxies["cw-rno2a"]
    proxy.lose_replies["POST /v1/jobs"] += 20
    try:
        job_id = await _submit(stack, "replies-lost", ["echo", "once"], target_cluster="cw-rno2a")
        status = await _state(stack, job_id, JobState.SUCCEEDED, within=120)
        assert len(status.attempts) == 1 and status.handoff_attempts == 1, status
    finally:
        proxy.lose_replies.clear()
    return job_id


async def earlier_attempt_succeeded(stack: Stack) -> str:
    # A pinned job's peer goes silent past peer_lost_after while the job runs; it finishes there
    # meanwhile. Attempt 2 waits for the pinned peer; when the peer answers again, attempt 1's
    # success is the result and nothing runs twice (EARLIER_ATTEMPT_PATCH).
    proxy = stack.proxies["cw-rno2a"]
    saved = stack.config.peer_lost_after_s
    stack.config.peer_lost_after_s = 8.0
    try:
        await asyncio.sleep(0.6)  # the worker reuses a federation view for 0.5 s
        job_id = await _submit(
            stack, "won-while-lost", ["sh", "-c", "sleep 3; echo once"], target_cluster="cw-rno2a"
        )
        await _state(stack, job_id, JobState.RUNNING)
        proxy.refuse()
        deadline = time.monotonic() + 60
        while (await stack.iris.describe(job_id)).attempts[0].end is None:
            assert time.monotonic() < deadline, "attempt 1 was never lost"
            await asyncio.sleep(0.5)
        await proxy.heal()
        status = await _state(stack, job_id, JobState.SUCCEEDED, within=60)
        assert [a.end for a in status.attempts] == ["SUCCEEDED"], status.attempts
    finally:
        stack.config.peer_lost_after_s = saved
        await proxy.heal()
    return job_id


async def _code(stack: Stack, job_id: str, code: ReasonCode, within: float = 60.0) -> JobStatus:
    deadline = time.monotonic() + within
    while True:
        status = await stack.iris.describe(job_id)
        if status.reason_code is code:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job_id} shows {status.reason_code}, not {code}: {status.reason}")
        await asyncio.sleep(0.2)


@held
async def explained_then_cancelled(stack: Stack) -> str:
    """REASON_PATCH: the tick explains why the job waits, with its code (explain_reason; IrisReason
    NoCapacity: 16 chips, one of them held), then the owner's cancel ends it (Cancelled)."""
    job_id = await _submit(stack, "explained-cancelled", ["true"], **WAITS)
    await _code(stack, job_id, ReasonCode.NoCapacity)
    await stack.iris.cancel(job_id)
    await _state(stack, job_id, JobState.KILLED)
    return job_id


async def explained_then_run(stack: Stack) -> str:
    """REASON_PATCH: a job pinned to a peer that does not answer waits as PeerUnreachable; the peer
    comes back, and the job runs there (Pending, Running, Succeeded)."""
    proxy = stack.proxies["cw-rno2a"]
    proxy.refuse()
    try:
        job_id = await _submit(stack, "explained-run", ["echo", "back"], target_cluster="cw-rno2a")
        await _code(stack, job_id, ReasonCode.PeerUnreachable)
    finally:
        await proxy.heal()
    await _state(stack, job_id, JobState.SUCCEEDED, within=120)
    return job_id


async def preempted_requeued(stack: Stack) -> str:
    """PREEMPT_PATCH: a batch job holding cw-rno2a's 8 chips is preempted by an interactive job
    placed there by reclaim; it is queued again (code Preempted), and its second attempt succeeds."""
    marker = _scratch(stack) / "preempted-once"
    job_id = await _submit(
        stack,
        "preempted",
        ["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; sleep 120"],
        priority="batch",
        target_cluster="cw-rno2a",
        **H100,
    )
    await _state(stack, job_id, JobState.RUNNING)
    urgent = await _submit(stack, "preempting", ["sleep", "2"], target_cluster="cw-rno2a", **H100)
    status = await _state(stack, job_id, JobState.SUCCEEDED, within=180)
    assert [a.end for a in status.attempts] == ["PREEMPTED", "SUCCEEDED"], status.attempts
    assert (status.attempts[0].preempted or "").startswith(f"preempted by {urgent} at "), status.attempts
    return job_id


async def preempted_past_budget_requeued(stack: Stack) -> str:
    """REQUEUE_PATCH: a batch job with no retry left for a lost attempt (--max-retries-preemption 0)
    is preempted on cw-rno2a by an interactive job placed there by reclaim: it is queued again
    without spending a budget (before the patch it ended FAILED, Preempted), and its second attempt
    succeeds."""
    marker = _scratch(stack) / "preempted-past-budget"
    job_id = await _submit(
        stack,
        "preempted-past-budget",
        ["sh", "-c", f"test -e {marker} && exit 0; touch {marker}; sleep 120"],
        priority="batch",
        target_cluster="cw-rno2a",
        max_retries_preemption=0,
        **H100,
    )
    await _state(stack, job_id, JobState.RUNNING)
    await _submit(stack, "preempting-past-budget", ["sleep", "2"], target_cluster="cw-rno2a", **H100)
    status = await _state(stack, job_id, JobState.SUCCEEDED, within=180)
    assert [a.end for a in status.attempts] == ["PREEMPTED", "SUCCEEDED"], status.attempts
    return job_id


async def launch_unanswered_adopted(stack: Stack) -> str:
    """TIMERS_PATCH: the launch reaches cw-rno2a, whose answer is cut and which then refuses every
    connection: the launch's retries (on the stack's configured schedule) and the reconciliation go
    unanswered, and the job parks with the outcome unknown. The park probes the silent cluster (its
    configured first probe), then the cluster answers and the next probe adopts the attempt."""
    proxy = stack.proxies["cw-rno2a"]
    proxy.cut("POST /v1/jobs", forward=True)
    try:
        job_id = await _submit(stack, "unanswered", ["echo", "adopted"], target_cluster="cw-rno2a")
        status = await _state(stack, job_id, JobState.HANDOFF_FAILED, within=120)
        assert "the outcome is unknown" in status.reason, status.reason
        handle = stack.client.get_workflow_handle(job_id)
        deadline = time.monotonic() + 60
        # A probe timer has fired (and asked the silent cluster) before the cluster answers again.
        while not [
            e async for e in handle.fetch_history_events() if e.HasField("timer_fired_event_attributes")
        ]:
            if time.monotonic() > deadline:
                raise RuntimeError("the parked job never probed its cluster")
            await asyncio.sleep(0.2)
    finally:
        await proxy.heal()
    status = await _state(stack, job_id, JobState.SUCCEEDED, within=120)
    assert [a.end for a in status.attempts] == ["SUCCEEDED"], status.attempts
    return job_id


async def _event(stack: Stack, job_id: str, prefix: str, within: float = 60.0) -> JobStatus:
    deadline = time.monotonic() + within
    while True:
        status = await stack.iris.describe(job_id)
        if any(e.message.startswith(prefix) for e in status.events):
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"{job_id} never recorded {prefix!r}: {status.reason}")
        await asyncio.sleep(0.2)


@held
async def forged_place_and_expire_ignored(stack: Stack) -> str:
    """SIGNALS_PATCH: a queued `--zone us-east-02a --no-preemptible` job (16 chips, one of them held)
    gets a forged expire (it has no deadline) and a forged place to cw-rno2a (another zone,
    preemptible): both are recorded and ignored (the reports read again before the placement is
    refused); its owner then cancels it."""
    job_id = await _submit(stack, "forged-place", ["true"], zone="us-east-02a", preemptible=False, **WAITS)
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    handle = stack.client.get_workflow_handle(job_id)
    await handle.signal(contract.EXPIRE)
    await _event(stack, job_id, "ignored expiry")
    forged = Placement(job_id=job_id, peer_id="cw-rno2a", backend_id="h100-rno2a")
    await handle.signal(contract.PLACE, forged)
    await _event(stack, job_id, "ignored placement")
    await stack.iris.cancel(job_id)
    await _state(stack, job_id, JobState.KILLED)
    return job_id


async def forged_observe_ignored(stack: Stack) -> str:
    """SIGNALS_PATCH: a running job's watcher-followed attempt gets a forged SUCCEEDED for its nonce;
    the end is read back from its cluster (RUNNING), recorded and ignored; the job then ends as it
    would have."""
    job_id = await _submit(
        stack, "forged-observe", ["sh", "-c", "sleep 4; echo done"], target_cluster="cw-us-east-02a"
    )
    status = await _state(stack, job_id, JobState.RUNNING)
    attempt = status.attempts[-1]
    forged = Observation(
        cluster=attempt.cluster,
        status=ControllerJobStatus(
            job_id=job_id,
            state=ControllerJobState.SUCCEEDED,
            backend_id=attempt.backend_id,
            exit_code=0,
            created_ms=attempt.started_ms,
            band=Band.INTERACTIVE,
            user=USER,
            requester=stack.config.home,
            nonce=attempt.nonce,
            epoch="forged",
            version=2**62,
        ),
    )
    await stack.client.get_workflow_handle(job_id).signal(contract.OBSERVE, forged)
    await _event(stack, job_id, "ignored:")
    await _state(stack, job_id, JobState.SUCCEEDED, within=120)
    return job_id


async def malformed_start_rejected(stack: Stack) -> str:
    """SUBMISSION_PATCH: a raw start with `{}` ends REJECTED (InvalidSubmission) in its first task."""
    job_id = f"recorder/hist-malformed-{int(time.time() * 1000)}"
    await stack.client.start_workflow(
        JOB_WORKFLOW, {}, id=job_id, task_queue=stack.config.temporal.task_queue
    )
    await _code(stack, job_id, ReasonCode.InvalidSubmission)
    return job_id


async def foreign_name_rejected(stack: Stack) -> str:
    """SUBMISSION_PATCH: eve signs, as herself, a spec under recorder's name: her statement
    verifies, the name is not hers: REJECTED (SubmissionRefused), having started nothing."""
    spec = build_spec(["true"], name=f"hist-foreign-{int(time.time())}", user="eve@evil.example")
    spec = spec.model_copy(update={"job_id": spec.job_id.replace("eve/", "recorder/", 1)})
    await _start_raw(stack, _signed(stack, spec))
    await _code(stack, spec.job_id, ReasonCode.SubmissionRefused)
    return spec.job_id


async def too_large_rejected(stack: Stack) -> str:
    """SIZE_PATCH: 32 H100 on one backend, where the largest (cw-us-east-02a) has 16: REJECTED at
    classification (TooLarge), nothing enqueued. The SDK's precheck knows only the configured shapes
    (no totals), so the workflow is what rejects it."""
    job_id = await _submit(stack, "too-large", ["true"], device_type="h100", gpu_count=32)
    status = await _code(stack, job_id, ReasonCode.TooLarge)
    assert status.state is JobState.REJECTED, status
    return job_id


async def _parked_on_rno(stack: Stack, name: str, key: str) -> str:
    uri = f"s3://cw-rno2a-artifacts/{key}"
    job_id = await _submit(stack, name, ["echo", "late"], target_cluster="cw-rno2a", artifacts=[uri], **H100)
    await _state(stack, job_id, JobState.HANDOFF_FAILED)
    return job_id


async def parked_released_retaken(stack: Stack) -> str:
    """PARK_PATCH: an 8-GPU job parked on cw-rno2a (its artifact missing) releases its reservation
    at the park; replayed in place once the artifact is there, it takes the capacity again through
    the CAS (promote_job retake) and runs."""
    job_id = await _parked_on_rno(stack, "parked-retaken", "hist/retaken.bin")
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "hist/retaken.bin")
    await stack.iris.replay_handoff(job_id)
    await _state(stack, job_id, JobState.SUCCEEDED)
    return job_id


async def parked_retake_requeued(stack: Stack) -> str:
    """PARK_PATCH: the parked job's freed capacity goes to another 8-GPU job at once; the replay in
    place then finds it taken (the CAS refuses the retake), so the job waits in the queue, and the
    tick places it when the other job ends."""
    job_id = await _parked_on_rno(stack, "parked-requeued", "hist/requeued.bin")
    other = await _submit(stack, "took-it", ["sleep", "15"], target_cluster="cw-rno2a", **H100)
    await _state(stack, other, JobState.RUNNING)
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "hist/requeued.bin")
    await stack.iris.replay_handoff(job_id)
    await _state(stack, job_id, JobState.QUEUED_HANDOFF)
    await _state(stack, job_id, JobState.SUCCEEDED, within=120)
    return job_id


Drive = Callable[[Stack], Awaitable[str]]


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Drive
    alone: bool = False  # needs the stack to itself (fault injection on a shared peer)


SCENARIOS = [
    Scenario("local", local),
    Scenario("queued_handed_off", queued_handed_off),
    Scenario("cancelled_while_queued", cancelled_while_queued),
    Scenario("cancelled_by_signal_while_queued", cancelled_by_signal_while_queued),
    Scenario("cancelled_through_temporal", cancelled_through_temporal),
    Scenario("cancelled_while_running", cancelled_while_running),
    Scenario("rejected", rejected),
    Scenario("handoff_rejected", handoff_rejected),
    Scenario("parked_missing_artifact_cancelled", parked_missing_artifact_cancelled),
    Scenario("parked_replayed", parked_replayed),
    Scenario("deadline_unschedulable", deadline_unschedulable),
    Scenario("outage_parked_cancelled", outage_parked_cancelled, alone=True),
    Scenario("bundled_handed_off", bundled_handed_off),
    Scenario("launch_reply_lost", launch_reply_lost, alone=True),
    Scenario("failure_retried", failure_retried),
    Scenario("local_through_the_ledger", local),
    Scenario("launch_replies_all_lost", launch_replies_all_lost, alone=True),
    Scenario("earlier_attempt_succeeded", earlier_attempt_succeeded, alone=True),
    Scenario("unsigned_cancel_ignored", unsigned_cancel_ignored),
    Scenario("unsigned_submission_rejected", unsigned_submission_rejected),
    Scenario("followed_by_watcher", followed_by_watcher),
    Scenario("explained_then_cancelled", explained_then_cancelled),
    Scenario("explained_then_run", explained_then_run, alone=True),
    Scenario("preempted_requeued", preempted_requeued, alone=True),
    Scenario("preempted_past_budget_requeued", preempted_past_budget_requeued, alone=True),
    Scenario("launch_unanswered_adopted", launch_unanswered_adopted, alone=True),
    Scenario("forged_place_and_expire_ignored", forged_place_and_expire_ignored),
    Scenario("forged_observe_ignored", forged_observe_ignored),
    Scenario("malformed_start_rejected", malformed_start_rejected),
    Scenario("foreign_name_rejected", foreign_name_rejected),
    Scenario("too_large_rejected", too_large_rejected),
    Scenario("parked_released_retaken", parked_released_retaken, alone=True),
    Scenario("parked_retake_requeued", parked_retake_requeued, alone=True),
    # LOCAL_CONFIRM_PATCH: the same two, recorded once the reported end is confirmed by a local
    # activity (followed_by_watcher.json and forged_observe_ignored.json keep the regular one).
    Scenario("end_confirmed_locally", followed_by_watcher),
    Scenario("forged_observe_confirmed_locally", forged_observe_ignored),
    # LAUNCH_FIRST_PATCH: a bundle staged only when the launch finds it missing (bundled_handed_off
    # above), and a launch that finds it there. v3-bundled_handed_off.json keeps staging first.
    Scenario("bundle_already_held", bundle_already_held),
]
MANAGER = "placement_manager"
# Ticks (each followed by its wait) the manager's history holds at least when it is saved.
MANAGER_TICKS = 3
WATCHER = "peer_watch"


async def _ticked(stack: Stack, manager_id: str, ticks: int) -> None:
    """Until the manager's history holds ``ticks`` ticks and the waits between them (recorded
    alone, it would otherwise be saved before its first tick ended)."""
    handle = stack.client.get_workflow_handle(manager_id)

    async def enough() -> bool:
        kinds = [e.event_type for e in (await handle.fetch_history()).events]
        fired = kinds.count(EventType.EVENT_TYPE_TIMER_FIRED)
        waits = fired + kinds.count(EventType.EVENT_TYPE_TIMER_CANCELED)
        return kinds.count(EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED) >= ticks and waits >= ticks - 1

    await wait_until(enough, timeout=60, interval=0.2, what=f"the placement manager to tick {ticks} times")


async def _save(stack: Stack, workflow_id: str, out: Path) -> None:
    history = await stack.client.get_workflow_handle(workflow_id).fetch_history()
    # Pretty-printed so a regeneration shows up as a readable diff.
    text = json.dumps(history.to_json_dict(), indent=1, sort_keys=True) + "\n"
    await asyncio.to_thread(out.write_text, text)


async def record(names: set[str] | None, out_dir: Path) -> list[Path]:
    chosen = [s for s in SCENARIOS if names is None or s.name in names]
    root = Path(tempfile.mkdtemp(prefix="iris-histories-"))
    runner = StackRunner(root)
    written: list[Path] = []
    try:
        stack = await runner.start()

        async def one(scenario: Scenario) -> None:
            started = time.monotonic()
            _REUSED_BY.set(scenario.name if scenario.name != scenario.run.__name__ else "")
            job_id = await scenario.run(stack)
            await _closed(stack, job_id)
            path = out_dir / f"{scenario.name}.json"
            await _save(stack, job_id, path)
            written.append(path)
            print(f"  {scenario.name:<36} {job_id:<44} {time.monotonic() - started:5.1f}s", flush=True)

        await asyncio.gather(*(one(s) for s in chosen if not s.alone))
        for scenario in (s for s in chosen if s.alone):
            await one(scenario)
        if names is None or MANAGER in names:
            manager_id = f"iris-placement-manager/{stack.config.temporal.task_queue}"
            await _ticked(stack, manager_id, MANAGER_TICKS)
            path = out_dir / f"{MANAGER}.json"
            await _save(stack, manager_id, path)
            written.append(path)
            print(f"  {MANAGER:<36} {manager_id}", flush=True)
        if names is None or WATCHER in names:
            watcher_id = peer_watch_workflow_id(stack.config.temporal.task_queue, "cw-us-east-02a")
            path = out_dir / f"{WATCHER}.json"
            await _save(stack, watcher_id, path)
            written.append(path)
            print(f"  {WATCHER:<36} {watcher_id}", flush=True)
    finally:
        await runner.stop()
        shutil.rmtree(root, ignore_errors=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [s.name for s in SCENARIOS] + [MANAGER, WATCHER]
    parser.add_argument("--only", nargs="+", choices=names, help="record only these scenarios")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output directory (default {OUT_DIR})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Expected activity failures (outages, refusals) would otherwise print tracebacks.
    logging.getLogger("temporalio").setLevel(logging.CRITICAL)
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=None)), error_if_already_set=False)
    started = time.monotonic()
    print(f"recording into {args.out}", flush=True)
    written = asyncio.run(record(set(args.only) if args.only else None, args.out))
    print(f"wrote {len(written)} histories in {time.monotonic() - started:.0f}s", flush=True)
    report = asyncio.run(_replay(written))
    print(report.summary(), flush=True)
    for failure in report.failures:
        print(failure.line(), flush=True)
    return 0 if report.ok else 1


async def _replay(paths: list[Path]) -> DeterminismReport:
    """Check what was just written the way the test suite will."""

    async def histories() -> AsyncIterator[WorkflowHistory]:
        for path in sorted(paths):
            yield load_history(path)

    return await replay_histories(histories(), "freshly recorded histories")


if __name__ == "__main__":
    sys.exit(main())
