"""Names and inputs (SUBMISSION_PATCH; docs/SECURITY.md, "Names and inputs"; issue 26, finding 6):
whatever a raw Temporal start holds, the job's workflow ends it REJECTED in its first task, having
verified, enqueued, reserved and launched nothing, or runs it; no input makes a workflow task fail
again and again. A signal that cannot be read is dropped, not a task failed for ever.

The name itself (a REJECTED job's id taken again by its owner's submission) needs the SDK and a
real server: tests/security/test_security_names.py."""

from __future__ import annotations

from typing import Any

import pytest
from job_doubles import Federation, cpu_spec, gpu_spec, status
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowHandle
from temporalio.common import RawValue

from iris import contract
from iris.jobs import CancelRequest, JobState, JobStatus
from iris.payloadcodec import Keyring
from iris.policy.reasons import ReasonCode
from iris.temporal import data_converter

Handle = WorkflowHandle[Any, JobStatus]


async def start_raw(fed: Federation, workflow_id: str, *inputs: Any) -> Handle:
    """``temporal workflow start --type JobWorkflow`` with these inputs, past the SDK."""
    handle: Handle = await fed.env.client.start_workflow(
        contract.JOB_WORKFLOW,
        args=list(inputs),
        id=workflow_id,
        task_queue=fed.task_queue,
        result_type=JobStatus,
    )
    fed.handles.append(handle)
    return handle


async def rejected(fed: Federation, handle: Handle, code: ReasonCode) -> JobStatus:
    st = await fed.result(handle)
    assert (st.state, st.reason_code) == (JobState.REJECTED, code), st.reason
    assert st.reason.startswith("submission refused: "), st.reason
    return st


def nothing_started(fed: Federation, *, verified: bool = False) -> None:
    # A verified statement was checked by the admission, which reads the reports with it (only
    # reads: nothing enqueued, promoted or delivered).
    assert fed.fake.calls == ([contract.VERIFY_REQUEST, contract.FETCH_REPORTS] if verified else [])
    assert fed.fake.enqueued == [] and fed.fake.promotions == [] and fed.fake.delivered == 0


async def test_another_users_job_id_is_refused_whoever_signed_it(fed: Federation) -> None:
    """Issue 26: eve signed a spec with job_id="bob/train"; it ran as bob/train, bob could not
    cancel it, nor reuse his name. Her statement verifies (she signed as herself), the name is not
    hers."""
    spec = gpu_spec("train", fed.now_ms).model_copy(
        update={"user": "eve@evil.example", "job_id": "bob/train"}
    )
    st = await rejected(fed, await fed.start(spec), ReasonCode.SubmissionRefused)
    assert "job id 'bob/train' is not under eve/, the job ids of its signer eve@evil.example" in st.reason
    nothing_started(fed, verified=True)


async def test_a_signed_spec_started_under_another_workflow_id_is_refused(fed: Federation) -> None:
    """Issue 26: a captured signed spec started under another id was accepted, then waited in
    QUEUED_HANDOFF for ever (the tick signals a job by its job id)."""
    spec = gpu_spec("captured", fed.now_ms)
    handle = await start_raw(fed, f"{spec.job_id}-copy", spec)
    st = await rejected(fed, handle, ReasonCode.SubmissionRefused)
    assert f"the signed spec is job {spec.job_id!r}, started as workflow '{spec.job_id}-copy'" in st.reason
    nothing_started(fed)


async def test_a_spec_a_clusters_launch_would_refuse_ends_rejected_in_its_first_task(fed: Federation) -> None:
    """Issue 26: env={"A=B": …} passed JobSpec and failed LaunchRequest inside the workflow task,
    which then failed for ever (cancel: exit 4), its reservation row kept."""
    spec = cpu_spec("env-key", fed.now_ms, env={"A=B": "x"})
    handle = await fed.start(spec)
    st = await rejected(fed, handle, ReasonCode.InvalidSubmission)
    assert st.reason == "submission refused: invalid job spec: invalid environment variable name 'A=B'"
    nothing_started(fed)
    # Ended in its first workflow task: no task failed, none retried.
    history = await handle.fetch_history()
    tasks = [e for e in history.events if e.HasField("workflow_task_completed_event_attributes")]
    failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    assert (len(tasks), failed) == (1, [])


async def _foreign_ciphertext() -> Payload:
    """A cancel encrypted under a key this worker does not hold."""
    (sealed,) = await data_converter(Keyring.generate()).encode([CancelRequest(reason="sealed")])
    return sealed


INPUTS: dict[str, tuple[list[Any], str]] = {
    "empty object": ([{}], "its input is not a job spec: job_id: Field required"),
    "not an object": (["train"], "its input is not a job spec"),
    "no input": ([], "a job's start holds one input, its signed spec, not 0"),
    "three inputs": ([{}, {}, {}], "a job's start holds one input, its signed spec, not 3"),
    "two bad inputs": ([{}, {}], "its input is not a job spec"),
    "not JSON": (
        [RawValue(Payload(metadata={"encoding": b"json/plain"}, data=b"{not json"))],
        "its input cannot be read (a payload with encoding 'json/plain' does not decode)",
    ),
    "unknown encoding": (
        [RawValue(Payload(metadata={"encoding": b"binary/zstd"}, data=b"\x28\xb5"))],
        "its input cannot be read (a payload with encoding 'binary/zstd' does not decode)",
    ),
}


@pytest.mark.parametrize("case", list(INPUTS))
async def test_an_input_that_is_not_a_spec_ends_rejected(fed: Federation, case: str) -> None:
    """Issue 26: a raw start with `{}` stayed UNKNOWN for ever (its first task failed at every
    retry); so did one that could not be decoded."""
    inputs, why = INPUTS[case]
    handle = await start_raw(fed, f"alice/raw-{case.replace(' ', '-')}", *inputs)
    st = await rejected(fed, handle, ReasonCode.InvalidSubmission)
    assert st.reason.startswith(f"submission refused: {why}"), st.reason
    assert st.spec is None
    nothing_started(fed)


async def test_a_start_encrypted_under_a_foreign_key_ends_rejected(fed: Federation) -> None:
    handle = await start_raw(fed, "alice/raw-sealed", RawValue(await _foreign_ciphertext()))
    st = await rejected(fed, handle, ReasonCode.InvalidSubmission)
    assert "which this process lacks" in st.reason
    nothing_started(fed)


async def test_a_raw_start_with_a_carry_is_refused(fed: Federation) -> None:
    """A Carry comes only from the run that continues as new: one given by a start would skip the
    signature check (its principal) and take a handoff without a CAS."""
    spec = gpu_spec("carried", fed.now_ms)
    forged = {
        "phase": "parked",
        "status": {"job_id": spec.job_id, "state": "HANDOFF_FAILED"},
        "view": fed.fake.view.model_dump(mode="json"),
        "cluster": "cw-a",
        "backend": "h100-a",
        "principal": "bob",
    }
    st = await rejected(fed, await start_raw(fed, spec.job_id, spec, forged), ReasonCode.InvalidSubmission)
    assert "a carry comes only from the run it continues" in st.reason
    nothing_started(fed)


async def test_a_signal_that_cannot_be_read_is_dropped_and_the_job_goes_on(fed: Federation) -> None:
    """A cancel encrypted under a foreign key, or not JSON: the worker drops it (it used to fail the
    job's workflow task at every retry, the job stuck for good)."""
    handle = await fed.queued(gpu_spec("unreadable-signal", fed.now_ms))
    for garbage in (await _foreign_ciphertext(), Payload(metadata={"encoding": b"json/plain"}, data=b"{")):
        await handle.signal(contract.CANCEL, RawValue(garbage))
    assert (await status(handle)).state is JobState.QUEUED_HANDOFF
    await fed.place(handle)
    st = await fed.result(handle)
    assert st.state is JobState.SUCCEEDED and not st.cancel_requested, [e.message for e in st.events]
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
