"""A new job's admission in one activity: its submitter's signature checked, then the capacity
reports read (docs/DESIGN.md, "User → home", "Classification").

Runs begun with the baseline ``job-baseline-2027-01`` ask this instead of ``verify_request`` then
``fetch_reports``: one activity and one workflow task fewer per job. A statement that does not
verify is an answer, not a failure: it comes back as the refusal (the job ends REJECTED), the
reports unread. Anything else (the verifier or the store out) fails the activity, which is
retried like the check alone.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.auth import VerifyInput
from iris import contract
from iris.reports import FederationView
from iris.userauth import Principal


class Admission(BaseModel):
    """The verified principal and the view the job is classified with; or why it is refused."""

    principal: Principal | None = None
    view: FederationView | None = None
    refusal: str | None = None


class RequestVerifier(Protocol):
    """What checks a signed statement (activities/auth.py, ``AuthActivities``)."""

    async def verify_request(self, inp: VerifyInput) -> Principal: ...


class ReportsReader(Protocol):
    """What reads the capacity reports (activities/peers.py, ``PeerActivities``)."""

    async def fetch_reports(self) -> FederationView: ...


class AdmissionActivities:
    def __init__(self, auth: RequestVerifier, peers: ReportsReader) -> None:
        self._auth = auth
        self._peers = peers

    @activity.defn(name=contract.ADMIT_SUBMISSION)
    async def admit_submission(self, inp: VerifyInput) -> Admission:
        try:
            principal = await self._auth.verify_request(inp)
        except ApplicationError as exc:
            if exc.type != contract.UNAUTHENTICATED:
                raise
            return Admission(refusal=exc.message)
        return Admission(principal=principal, view=await self._peers.fetch_reports())
