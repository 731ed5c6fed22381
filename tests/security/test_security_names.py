"""Names and poison, end to end (issue 26, finding 6 and acceptance 5; docs/SECURITY.md, "Names and
inputs"). On the real stack, each way a raw Temporal start (the official ``temporal`` CLI, or a
client past the SDK) used to take a name or poison a job ends REJECTED in the job's first workflow
task, holds no name (its owner's submission of that id then runs), and leaves nothing in the
federation store (no handle, no reservation):

- eve signs a spec with job_id ``bob/…`` and starts it;
- a submission REJECTED for a bad signature;
- a captured signed spec started under another workflow id;
- a signed spec with ``env={"A=B": …}`` (it passed JobSpec, failed LaunchRequest in the task);
- a raw start with ``{}``.

A job that ran (SUCCEEDED) keeps its name.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from stack import Stack, wait_until

from iris import devstack
from iris.client import JobAlreadyExists, build_spec
from iris.jobs import JobSpec, JobState, JobStatus
from iris.policy.reasons import ReasonCode
from iris.userauth import Action, audience, request_digest, sign_request

pytestmark = pytest.mark.e2e

EVE = "eve@evil.example"
BOB = "bob@example.com"
ALICE = "alice@example.com"


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def signed(stack: Stack, spec: JobSpec, as_: str | None = None) -> JobSpec:
    return spec.model_copy(
        update={"signature": stack.iris.sign(Action.SUBMIT, as_ or spec.user, spec.job_id, spec)}
    )


async def temporal_start(stack: Stack, workflow_id: str, payload: object) -> None:
    """`temporal workflow start` of a JobWorkflow, as anyone who reaches Temporal could."""
    proc = await asyncio.create_subprocess_exec(
        str(devstack.venv_bin("temporal")),
        "workflow",
        "start",
        "--address",
        stack.config.temporal.address,
        "--task-queue",
        stack.config.temporal.task_queue,
        "--type",
        "JobWorkflow",
        "-w",
        workflow_id,
        "--input",
        json.dumps(payload),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (out + err).decode()


async def refused(stack: Stack, job_id: str, code: ReasonCode) -> JobStatus:
    """REJECTED with ``code``, in its first workflow task, having left nothing in the store."""

    async def ended() -> bool:
        return (await stack.iris.describe(job_id)).state.terminal

    await wait_until(ended, timeout=60, what=f"{job_id} ended")
    st = await stack.iris.describe(job_id)
    assert (st.state, st.reason_code) == (JobState.REJECTED, code), st.reason
    assert st.cluster is None and st.handoff_attempts == 0 and not st.attempts
    history = await stack.client.get_workflow_handle(job_id).fetch_history()
    completed = [e for e in history.events if e.HasField("workflow_task_completed_event_attributes")]
    failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    assert not failed and len(completed) <= 2  # its first task (and the signature check's, if any)
    assert await asyncio.to_thread(stack.store.get, job_id) is None
    assert not [r for r in await asyncio.to_thread(stack.store.reservations) if r.job_id == job_id]
    return st


async def runs_as_its_owner(stack: Stack, job_id: str, user: str) -> None:
    """The owner's own submission of that id starts and runs: the refused start held no name."""
    job_name = job_id.split("/", 1)[1]
    assert await stack.iris.submit(["true"], name=job_name, user=user) == job_id
    assert (await stack.iris.wait(job_id, timeout_s=90)).state is JobState.SUCCEEDED


async def test_eves_spec_under_bobs_name_is_refused_and_bob_keeps_his_name(stack: Stack) -> None:
    stack.add_user(BOB, ["user"])
    spec = build_spec(["true"], name=name("train"), user=EVE)
    bobs = spec.job_id.replace("eve/", "bob/", 1)
    forged = signed(stack, spec.model_copy(update={"job_id": bobs}))  # eve signs, as herself
    await temporal_start(stack, bobs, forged.model_dump(mode="json"))
    st = await refused(stack, bobs, ReasonCode.SubmissionRefused)
    assert f"job id {bobs!r} is not under eve/, the job ids of its signer {EVE}" in st.reason
    await runs_as_its_owner(stack, bobs, BOB)
    # A job that ran keeps its name.
    with pytest.raises(JobAlreadyExists):
        await stack.iris.submit(["true"], name=bobs.split("/", 1)[1], user=BOB)


async def test_a_submission_refused_for_its_signature_holds_no_name(stack: Stack) -> None:
    spec = build_spec(["true"], name=name("badsig"), user=ALICE)
    sig = sign_request(
        Ed25519PrivateKey.generate(),
        principal=ALICE,
        action=Action.SUBMIT,
        job_id=spec.job_id,
        digest=request_digest(spec),
        aud=audience(stack.config.home),
    )
    await temporal_start(
        stack, spec.job_id, spec.model_copy(update={"signature": sig}).model_dump(mode="json")
    )
    st = await refused(stack, spec.job_id, ReasonCode.SubmissionRefused)
    assert "does not match the user's registered keys" in st.reason
    await runs_as_its_owner(stack, spec.job_id, ALICE)


async def test_a_captured_spec_started_under_another_id_is_refused(stack: Stack) -> None:
    captured = signed(stack, build_spec(["true"], name=name("captured"), user=ALICE))
    elsewhere = f"{captured.job_id}-copy"
    await temporal_start(stack, elsewhere, captured.model_dump(mode="json"))
    st = await refused(stack, elsewhere, ReasonCode.SubmissionRefused)
    assert f"the signed spec is job {captured.job_id!r}, started as workflow {elsewhere!r}" in st.reason
    await runs_as_its_owner(stack, elsewhere, ALICE)


async def test_a_spec_a_launch_would_refuse_ends_rejected_in_its_first_task(stack: Stack) -> None:
    spec = build_spec(["true"], name=name("envkey"), user=ALICE)
    bad = signed(stack, spec.model_copy(update={"env": {"A=B": "x"}}))
    await temporal_start(stack, bad.job_id, bad.model_dump(mode="json"))
    st = await refused(stack, bad.job_id, ReasonCode.InvalidSubmission)
    assert st.reason == "submission refused: invalid job spec: invalid environment variable name 'A=B'"
    await runs_as_its_owner(stack, bad.job_id, ALICE)


async def test_a_raw_start_with_an_empty_object_ends_rejected(stack: Stack) -> None:
    job_id = f"alice/{name('raw')}"
    await temporal_start(stack, job_id, {})
    st = await refused(stack, job_id, ReasonCode.InvalidSubmission)
    assert st.reason.startswith("submission refused: its input is not a job spec"), st.reason
    await runs_as_its_owner(stack, job_id, ALICE)
