"""Authenticated submitters, end to end (issue 16, acceptance 1; docs/DESIGN.md, "User → home").

On the real stack (Temporal, worker, controllers): a submission with a forged, missing, expired or
another user's statement ends REJECTED at home having reached no cluster; the CLI refuses an
unsigned submission, and a cancel by someone who is neither the owner nor an admin, in one line
with a non-zero exit; a peer's ``allowed_submitters`` judges the verified principal: a registered
user outside ``*@allowed.example`` is admitted by cw-us-east-02a and refused by the restricted
cw-rno2a, and claiming an allowed identity with one's own key is refused before any handoff.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from security_support import RESTRICTED_DOMAIN, Restricted
from stack import Stack

from iris.client import AsyncIrisClient, InvalidJob, JobNotFound, build_spec
from iris.contract import job_workflow_id, manager_workflow_id
from iris.jobs import JobSpec, JobState, JobStatus
from iris.store import FederationStore
from iris.userauth import Action, audience, load_user_key, request_digest, sign_request, user_key_path
from worker.main import build_worker, ensure_manager
from workflows.job import JobWorkflow

pytestmark = pytest.mark.e2e

EVE = "eve@evil.example"
ALICE = f"alice@{RESTRICTED_DOMAIN}"


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def nothing_started(st: JobStatus) -> None:
    """The job ended at home before classification: no cluster, no handoff, no queue."""
    assert st.state is JobState.REJECTED, st.reason
    assert st.reason.startswith("submission refused:"), st.reason
    assert st.cluster is None and st.handoff_attempts == 0 and not st.attempts
    assert not any(e.message.startswith("classified") for e in st.events), st.events


def signed_with(
    spec: JobSpec, key: Ed25519PrivateKey, *, age_s: float = 0.0, as_: str | None = None
) -> JobSpec:
    sig = sign_request(
        key,
        principal=as_ or spec.user,
        action=Action.SUBMIT,
        job_id=spec.job_id,
        digest=request_digest(spec),
        aud=audience("marin"),
        now=time.time() - age_s,
    )
    return spec.model_copy(update={"signature": sig})


def key_of(user: str) -> Ed25519PrivateKey:
    return load_user_key(user_key_path(user))


async def test_forged_missing_expired_and_other_users_submissions_start_nothing(stack: Stack) -> None:
    iris = stack.iris
    spec = build_spec(["true"], name=name("sec-sub"), user=ALICE)
    cases = {
        "forged": signed_with(spec, Ed25519PrivateKey.generate()),
        "expired": signed_with(
            spec.model_copy(update={"job_id": spec.job_id + "-x"}), key_of(ALICE), age_s=900
        ),
        # Eve's own, valid key, over a job that says it is alice's.
        "other-user": signed_with(
            spec.model_copy(update={"job_id": spec.job_id + "-y"}), key_of(EVE), as_=EVE
        ),
    }
    # No statement at all: what a raw Temporal start (not the SDK, which signs) sends.
    cases["missing"] = spec.model_copy(update={"job_id": spec.job_id + "-z"})
    for case, job in cases.items():
        if case == "missing":
            await stack.client.start_workflow(
                JobWorkflow.run,
                job,
                id=job_workflow_id(job.job_id),
                task_queue=stack.config.temporal.task_queue,
            )
        else:
            await iris.submit_spec(job)
        st = await iris.wait(job.job_id, timeout_s=60)
        nothing_started(st)
        assert {
            "forged": "does not match the user's registered keys",
            "expired": "had expired",
            "other-user": f"signed by {EVE}, but the job is submitted as {ALICE}",
            "missing": "unsigned submit",
        }[case] in st.reason, (case, st.reason)


async def test_a_non_admins_production_job_is_refused(stack: Stack) -> None:
    job_id = await stack.iris.submit(["true"], name=name("sec-prod"), user=EVE, priority="production")
    st = await stack.iris.wait(job_id, timeout_s=60)
    nothing_started(st)
    assert "the production band is for admins" in st.reason


async def test_the_sdk_without_a_user_key_refuses_in_one_line_and_starts_nothing(stack: Stack) -> None:
    job = name("sec-nokey")
    with pytest.raises(InvalidJob) as refused:
        await stack.iris.submit(["true"], name=job, user="nokey@example.com")
    assert "no user key at" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(JobNotFound):
        await stack.iris.describe(f"nokey/{job}")


async def test_the_cli_refuses_an_unsigned_submission_and_a_foreign_cancel(stack: Stack) -> None:
    env_user = "tester@example.com"
    key = user_key_path(env_user)
    aside = key.with_name(key.name + ".aside")
    key.rename(aside)
    try:
        res = await stack.cli("job", "run", "--no-wait", "--job-name", name("sec-cli"), "--", "true")
    finally:
        aside.rename(key)
    assert res.code != 0 and "no user key at" in res.stderr, res
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr

    # A job of eve's (a plain user), cancelled by alice (another plain user): refused, still there.
    job_id = await stack.iris.submit(["sleep", "30"], name=name("sec-own"), user=EVE)
    other = stack.iris.as_user(ALICE)
    with pytest.raises(InvalidJob) as refused:
        await other.cancel_and_report(job_id)
    assert f"{ALICE} may not cancel {EVE}'s job" in str(refused.value)
    assert not (await stack.iris.describe(job_id)).cancel_requested
    # The owner may.
    outcome = await stack.iris.as_user(EVE).cancel_and_report(job_id)
    assert outcome.state is not None
    assert (await stack.iris.wait(job_id, timeout_s=60)).state is JobState.KILLED


@pytest.fixture
async def restricted_iris(
    stack: Stack, restricted: Restricted, tmp_path: Path
) -> AsyncIterator[AsyncIrisClient]:
    """A worker of the federation whose cw-rno2a admits only ``*@allowed.example``."""
    cfg = restricted.config.model_copy(deep=True)
    cfg.temporal.task_queue = f"iris-submitters-{uuid.uuid4().hex[:8]}"
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        async with build_worker(stack.client, cfg, store):
            await ensure_manager(stack.client, cfg)
            yield AsyncIrisClient(stack.client, cfg)
            await stack.client.get_workflow_handle(manager_workflow_id(cfg.temporal.task_queue)).terminate()
    finally:
        store.close()


async def test_the_peer_judges_the_verified_principal(restricted_iris: AsyncIrisClient) -> None:
    iris = restricted_iris
    # Eve, verified, is allowed at cw-us-east-02a ("*") ...
    ok = await iris.submit(["true"], name=name("sec-eve-east"), user=EVE, target_cluster="cw-us-east-02a")
    assert (await iris.wait(ok, timeout_s=90)).state is JobState.SUCCEEDED
    # ... and refused by cw-rno2a, which sees her verified name.
    no = await iris.submit(["true"], name=name("sec-eve-rno"), user=EVE, target_cluster="cw-rno2a")
    st = await iris.wait(no, timeout_s=90)
    assert st.state is JobState.HANDOFF_REJECTED and "may not submit to cluster cw-rno2a" in st.reason, (
        st.reason
    )
    # Claiming an allowed identity with her own key gets her nowhere: refused at home.
    spec = build_spec(["true"], name=name("sec-eve-claims"), user=ALICE, target_cluster="cw-rno2a")
    await iris.submit_spec(signed_with(spec, key_of(EVE), as_=EVE))
    nothing_started(await iris.wait(spec.job_id, timeout_s=60))
    # The real alice is admitted there.
    real = await iris.submit(["true"], name=name("sec-alice-rno"), user=ALICE, target_cluster="cw-rno2a")
    assert (await iris.wait(real, timeout_s=90)).state is JobState.SUCCEEDED
