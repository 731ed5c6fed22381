"""Operators replay failed handoffs (docs/DESIGN.md, "Replaying a failed handoff"): in place, to
another peer, back to the queue, or by reset."""

from __future__ import annotations

import asyncio

import pytest
from stack import Stack, wait_until
from test_lifecycle import remote, wait_state, where

from iris.client import InvalidJob
from iris.jobs import JobState


async def test_parked_job_is_replayed_in_place_once_its_artifact_exists(stack: Stack) -> None:
    uri = "s3://cw-rno2a-artifacts/late/arrival.bin"
    job_id = await stack.iris.submit(
        ["echo", "replayed"], name="replay-same", target_cluster="cw-rno2a", artifacts=[uri]
    )
    await wait_state(stack, job_id, JobState.HANDOFF_FAILED)
    await asyncio.to_thread(stack.put_artifact, "cw-rno2a-artifacts", "late/arrival.bin")
    message = await stack.iris.replay_handoff(job_id)
    assert "replay accepted" in message
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert any(e.message.startswith("operator replay") for e in final.events)
    assert await where(stack, job_id) == ["cw-rno2a"]


async def test_parked_job_is_replayed_to_another_peer_through_the_cas(stack: Stack) -> None:
    await asyncio.to_thread(stack.put_artifact, "cw-us-east-02a-artifacts", "only-east/data")
    uri = "s3://cw-us-east-02a-artifacts/only-east/data"
    # Local job whose artifact is in S3: home (GCS) cannot read it, so it parks at home.
    job_id = await stack.iris.submit(["echo", "moved"], name="replay-peer", artifacts=[uri])
    parked = await wait_state(stack, job_id, JobState.HANDOFF_FAILED)
    assert parked.cluster == "marin"
    res = await stack.cli("ops", "replay-handoff", job_id, "--peer", "cw-us-east-02a")
    assert res.code == 0, res.stderr
    final = await stack.iris.wait(job_id, timeout_s=60)
    assert final.state is JobState.SUCCEEDED, final.reason
    assert final.cluster == "cw-us-east-02a"
    assert await where(stack, job_id) == ["cw-us-east-02a"]


async def test_requeue_sends_a_parked_job_back_through_the_tick(stack: Stack) -> None:
    uri = "s3://cw-us-east-02a-artifacts/only-east/data"
    job_id = await stack.iris.submit(["true"], name="replay-requeue", artifacts=[uri])
    await wait_state(stack, job_id, JobState.HANDOFF_FAILED)
    await stack.iris.replay_handoff(job_id, requeue=True)
    # Back in the queue, placed by the tick (home again: it still cannot read S3, so it parks again).

    async def parked_again() -> bool:
        st = await stack.iris.describe(job_id)
        requeued = [i for i, e in enumerate(st.events) if e.state is JobState.QUEUED_HANDOFF]
        return st.state is JobState.HANDOFF_FAILED and bool(requeued) and requeued[-1] < len(st.events) - 1

    await wait_until(parked_again, timeout=60, what="the requeued job to be placed and park again")
    st = await stack.iris.describe(job_id)
    assert any("promoted to" in e.message for e in st.events)
    await stack.iris.cancel(job_id)
    assert (await stack.iris.wait(job_id, timeout_s=30)).state is JobState.KILLED


async def test_replay_is_refused_for_other_states_with_a_clear_message(stack: Stack) -> None:
    job_id = await stack.iris.submit(["true"], name="replay-refused")
    await stack.iris.wait(job_id, timeout_s=60)
    res = await stack.cli("ops", "replay-handoff", job_id)
    assert res.code == 2
    assert res.stderr.strip().splitlines() == [
        f"error: job {job_id} ended as SUCCEEDED: replay-handoff applies to jobs parked in HANDOFF_FAILED "
        "or closed as HANDOFF_REJECTED"
    ]
    uri = "s3://cw-rno2a-artifacts/never/there"
    pinned = await stack.iris.submit(
        ["true"], name="replay-pinned", target_cluster="cw-rno2a", artifacts=[uri]
    )
    await wait_state(stack, pinned, JobState.HANDOFF_FAILED)
    with pytest.raises(InvalidJob, match="pinned to cw-rno2a"):
        await stack.iris.replay_handoff(pinned, peer="cw-us-east-02a")
    with pytest.raises(InvalidJob, match="unknown cluster"):
        await stack.iris.replay_handoff(pinned, peer="nowhere")
    await stack.iris.cancel(pinned)
    await stack.iris.wait(pinned, timeout_s=30)


async def test_closed_rejected_run_is_reset_to_before_its_handoff(stack: Stack) -> None:
    # The peer refuses a TPU job (force-routed pin); the operator fixes nothing and replays: the
    # reset re-runs the handoff, the refusal is recorded again, and the history shows the reset.
    job_id = await stack.iris.submit(
        ["true"], name="replay-reset", target_cluster="cw-rno2a", device_type="tpu-v9", gpu_count=4
    )
    first = await stack.iris.wait(job_id, timeout_s=60)
    assert first.state is JobState.HANDOFF_REJECTED
    handle = stack.client.get_workflow_handle(job_id)
    old_run = (await handle.describe()).run_id
    message = await stack.iris.replay_handoff(job_id)
    assert "reset to event" in message

    async def new_run_done() -> bool:
        desc = await stack.client.get_workflow_handle(job_id).describe()
        return desc.run_id != old_run and desc.close_time is not None

    await wait_until(new_run_done, timeout=60, what="the reset run to finish")
    again = await stack.iris.describe(job_id)
    assert again.state is JobState.HANDOFF_REJECTED
    assert await remote(stack, "cw-rno2a", job_id) is None  # refused twice, never run
