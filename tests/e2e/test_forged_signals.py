"""Forged internal signals change nothing (issue 26, finding 4 and acceptance 4; docs/SECURITY.md,
"Internal signals"): sent as a plain user would, with the official ``temporal`` CLI binary
(``temporal workflow signal``) against a job on the real stack, a forged ``expire``, ``place`` and
``observe`` are each recorded in the job's events (``iris job describe``) and ignored. The job ends
as it would have ended anyway, and nothing is reserved for a placement that was refused.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from stack import WAITS, Stack, wait_until

from iris import devstack
from iris.jobs import JobState, JobStatus
from iris.store.models import HandleState

pytestmark = pytest.mark.e2e

H100 = {"device_type": "h100", "gpu_count": 8}
USER = "tester@example.com"


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def temporal_signal(stack: Stack, job_id: str, signal: str, payload: object | None = None) -> None:
    """`temporal workflow signal` as anyone who reaches Temporal would send it (no SDK, no key)."""
    args = ["workflow", "signal", "--address", stack.config.temporal.address, "-w", job_id, "--name", signal]
    if payload is not None:
        args += ["--input", json.dumps(payload)]
    proc = await asyncio.create_subprocess_exec(
        str(devstack.venv_bin("temporal")),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (out + err).decode()


async def event(stack: Stack, job_id: str, prefix: str) -> JobStatus:
    """The job once its events (what `iris job describe` lists) hold one starting with ``prefix``."""

    async def recorded() -> bool:
        return any(e.message.startswith(prefix) for e in (await stack.iris.describe(job_id)).events)

    await wait_until(recorded, timeout=60, what=f"{job_id}: an event {prefix!r}")
    return await stack.iris.describe(job_id)


async def state(stack: Stack, job_id: str, *states: JobState, timeout: float = 90) -> JobStatus:
    async def reached() -> bool:
        return (await stack.iris.describe(job_id)).state in states

    await wait_until(reached, timeout=timeout, what=f"{job_id} in {states}")
    return await stack.iris.describe(job_id)


async def test_a_forged_expiry_and_placement_leave_a_queued_job_waiting(stack: Stack) -> None:
    """`expire` ended a queued job without a deadline; `place` sent a `--zone us-east-02a
    --no-preemptible` job to cw-rno2a (another zone, preemptible) without a reservation."""
    async with stack.holding():
        await _forged_place(stack)


async def _forged_place(stack: Stack) -> None:
    job_id = await stack.iris.submit(
        ["true"], name=name("forged-place"), user=USER, zone="us-east-02a", preemptible=False, **WAITS
    )
    await state(stack, job_id, JobState.QUEUED_HANDOFF)  # no room in us-east-02a now: it waits

    await temporal_signal(stack, job_id, "expire")
    st = await event(stack, job_id, "ignored expiry")
    assert "ignored expiry: the job has no scheduling deadline" in [e.message for e in st.events]

    placement = {"job_id": job_id, "peer_id": "cw-rno2a", "backend_id": "h100-rno2a", "reason": "forged"}
    await temporal_signal(stack, job_id, "place", placement)
    st = await event(stack, job_id, "ignored placement")
    refused = next(e.message for e in st.events if e.message.startswith("ignored placement"))
    assert refused.startswith(
        "ignored placement cw-rno2a/h100-rno2a: cw-rno2a/h100-rno2a does not satisfy zone="
    )

    # It waits as it would have: queued, its handle queued, nothing reserved, never handed off.
    assert st.state is JobState.QUEUED_HANDOFF and st.cluster is None and not st.attempts
    handle = await asyncio.to_thread(stack.store.get, job_id)
    assert handle is not None and handle.state is HandleState.QUEUED_HANDOFF and handle.assigned_peer is None
    reservations = await asyncio.to_thread(stack.store.reservations)
    assert not [r for r in reservations if r.job_id == job_id]
    await stack.iris.cancel(job_id)
    assert (await state(stack, job_id, JobState.KILLED)).handoff_attempts == 0


async def test_a_forged_success_for_a_running_jobs_nonce_changes_nothing(stack: Stack) -> None:
    """`observe` carried a made-up SUCCEEDED for a running job's nonce (read from its status
    query); the job ended at home while its process kept running. Now the end is read back from
    the cluster first: still RUNNING there, the claim is recorded and ignored, and the job ends
    when its process does, with its own exit code and output."""
    # The process runs until released (a fixed sleep ended before a loaded CI machine handled the
    # forged signal, and the claim was then checked against a real end).
    release = stack.shared_dir / f"forged-observe-release-{uuid.uuid4().hex}"
    job_id = await stack.iris.submit(
        ["sh", "-c", f"until [ -e {release} ]; do sleep 0.1; done; echo finished; exit 3"],
        name=name("forged-observe"),
        user=USER,
        target_cluster="cw-us-east-02a",
    )
    st = await state(stack, job_id, JobState.RUNNING)
    attempt = st.attempts[-1]  # what anyone who may query the job reads
    forged = {
        "cluster": attempt.cluster,
        "status": {
            "job_id": job_id,
            "state": "SUCCEEDED",
            "backend_id": attempt.backend_id,
            "exit_code": 0,
            "created_ms": attempt.started_ms,
            "band": 2,
            "user": USER,
            "requester": stack.config.home,
            "nonce": attempt.nonce,
            "epoch": "forged",
            "version": 2**62,
        },
    }
    await temporal_signal(stack, job_id, "observe", forged)
    st = await event(stack, job_id, "ignored:")
    said = f"ignored: an observation says attempt 1 on {attempt.cluster} is SUCCEEDED"
    assert f"{said}; {attempt.cluster} reports RUNNING" in [e.message for e in st.events]
    assert st.state is JobState.RUNNING

    release.touch()
    st = await state(stack, job_id, *(s for s in JobState if s.terminal))
    assert (st.state, st.exit_code) == (JobState.FAILED, 3), st.reason
    assert "finished" in (await stack.iris.logs(job_id)).data
