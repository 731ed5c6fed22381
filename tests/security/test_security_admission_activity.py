"""admit_submission (activities/admission.py): the submitter's signature checked, then the capacity
reports read, in one activity. A statement that does not verify is refused before anything is
read; an outage of the check fails the activity (retried), never refuses a valid job."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.admission import AdmissionActivities
from activities.auth import AuthActivities, VerifyInput
from activities.peers import PeerActivities
from iris.config import BackendConfig, ClusterConfig, FederationConfig, UserConfig
from iris.reports import FederationView
from iris.userauth import Action, Principal, Verifier, audience, public_key_text, sign_request

HOME = "marin"
ALICE = Ed25519PrivateKey.generate()
DIGEST = "0" * 64


class CountingReports(PeerActivities):
    """The capacity read, counted (no controller is asked)."""

    def __init__(self, config: FederationConfig) -> None:
        super().__init__(config)
        self.reads = 0

    async def fetch_reports(self) -> FederationView:
        self.reads += 1
        return FederationView(home=HOME, reports=[], stale_after_ms=1_000)


class DownVerifier(Verifier):
    def verify(self, statement: str, expect: object) -> Principal:  # type: ignore[override]
        raise RuntimeError("the users table cannot be read")


def config() -> FederationConfig:
    return FederationConfig(
        home=HOME,
        clusters=[ClusterConfig(name=HOME, port=1, backends=[BackendConfig(id="cpu-1")])],
        users={"alice": UserConfig(public_keys=[public_key_text(ALICE.public_key())], roles=["user"])},
    )


def request(key: Ed25519PrivateKey, job_id: str = "alice/job") -> VerifyInput:
    now = time.time()
    statement = sign_request(
        key,
        principal="alice",
        action=Action.SUBMIT,
        job_id=job_id,
        digest=DIGEST,
        aud=audience(HOME),
        now=now,
    )
    return VerifyInput(
        statement=statement,
        action=Action.SUBMIT,
        job_id=job_id,
        digest=DIGEST,
        owner="alice",
        received_ms=int(now * 1000),
    )


async def test_a_verified_submission_comes_back_with_its_principal_and_the_view() -> None:
    cfg = config()
    reports = CountingReports(cfg)
    admission = await ActivityEnvironment().run(
        AdmissionActivities(AuthActivities(cfg), reports).admit_submission, request(ALICE)
    )
    assert admission.refusal is None
    assert admission.principal is not None and admission.principal.name == "alice"
    assert admission.view is not None and admission.view.home == HOME
    assert reports.reads == 1


async def test_a_forged_statement_is_refused_before_anything_is_read() -> None:
    cfg = config()
    reports = CountingReports(cfg)
    mallory = Ed25519PrivateKey.generate()  # signs as alice with a key that is not hers
    admission = await ActivityEnvironment().run(
        AdmissionActivities(AuthActivities(cfg), reports).admit_submission, request(mallory)
    )
    assert admission.principal is None and admission.view is None
    assert admission.refusal and "signature" in admission.refusal.lower(), admission.refusal
    assert reports.reads == 0


async def test_an_outage_of_the_check_fails_the_activity_and_refuses_nothing() -> None:
    cfg = config()
    reports = CountingReports(cfg)
    activities = AdmissionActivities(AuthActivities(cfg, verifier=DownVerifier()), reports)
    with pytest.raises(RuntimeError, match="users table"):
        await ActivityEnvironment().run(activities.admit_submission, request(ALICE))
    assert reports.reads == 0


async def test_an_unauthenticated_answer_is_the_only_refusal() -> None:
    """Any other ApplicationError (say, a retryable one) propagates: the activity is retried."""
    cfg = config()

    class Flaky(AuthActivities):
        async def verify_request(self, inp: VerifyInput) -> Principal:
            raise ApplicationError("try again", type="Transient")

    with pytest.raises(ApplicationError, match="try again"):
        await ActivityEnvironment().run(
            AdmissionActivities(Flaky(cfg), CountingReports(cfg)).admit_submission, request(ALICE)
        )
