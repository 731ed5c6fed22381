"""Verifying a submitter's signed statement (docs/DESIGN.md, "User → home").

The job workflow's first activity: a submission whose statement does not verify, or whose principal
may not do what it asks, ends REJECTED before classification; a cancel or replay that does not
verify is recorded and ignored. The check runs here, never in workflow code: the verifier reads
the users table (or, behind the same ``Verifier`` interface, an identity provider's keys).
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from iris import contract
from iris.config import FederationConfig
from iris.userauth import (
    Action,
    AuthError,
    Expectation,
    Principal,
    UserKeyVerifier,
    Verifier,
    audience,
    authorize,
)

__all__ = ["AuthActivities", "Principal", "VerifyInput"]


class VerifyInput(BaseModel):
    statement: str
    action: Action
    job_id: str
    # SHA-256 of the canonical request, computed by the workflow from what Temporal delivered.
    digest: str
    # The job's owner (its spec's user) and whether it asks for the production band.
    owner: str
    production: bool = False
    received_ms: int


class AuthActivities:
    def __init__(self, config: FederationConfig, verifier: Verifier | None = None) -> None:
        self._config = config
        self._verifier = verifier or UserKeyVerifier(lambda: config.users)

    @activity.defn(name=contract.VERIFY_REQUEST)
    async def verify_request(self, inp: VerifyInput) -> Principal:
        """The verified principal; a non-retryable ``Unauthenticated`` error with one line otherwise."""
        expect = Expectation(
            action=inp.action,
            job_id=inp.job_id,
            digest=inp.digest,
            audience=audience(self._config.home),
            received_ms=inp.received_ms,
        )
        try:
            principal = self._verifier.verify(inp.statement, expect)
            authorize(principal, inp.action, owner=inp.owner, production=inp.production)
        except AuthError as exc:
            raise ApplicationError(str(exc), type=contract.UNAUTHENTICATED, non_retryable=True) from None
        return principal
