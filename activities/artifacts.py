"""Artifact presence in the destination cluster's own object store (docs/DESIGN.md, "Artifact check").

The destination's controller checks, with its own credentials (``POST /v1/artifacts/check``,
``iris/controller/artifacts.py``); this activity only asks it, signed as the home cluster. No
process on the home side holds another cluster's object-store credentials.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.peers import controller_client
from iris import contract
from iris.config import FederationConfig
from iris.controller.artifacts import ArtifactReport
from iris.controller.errors import ControllerError

__all__ = ["ArtifactActivities", "ArtifactInput", "ArtifactReport"]

_BATCH = 128


class ArtifactInput(BaseModel):
    cluster: str
    uris: list[str]


class ArtifactActivities:
    def __init__(self, config: FederationConfig, *, request_timeout_s: float = 10.0) -> None:
        self._config = config
        self._timeout = request_timeout_s

    @activity.defn(name=contract.CHECK_ARTIFACTS)
    async def check_artifacts(self, inp: ArtifactInput) -> ArtifactReport:
        """Ask the destination's controller which declared artifacts it cannot read.

        Its outages (and its store's) are raised and retried; a refusal is final.
        """
        missing: list[str] = []
        reasons: list[str] = []
        try:
            async with controller_client(self._config, inp.cluster, self._timeout) as client:
                # In batches: a job may declare 1024 URIs of 1024 characters, more than one request
                # body may carry.
                for start in range(0, len(inp.uris), _BATCH):
                    report = await client.check_artifacts(inp.uris[start : start + _BATCH])
                    missing += report.missing
                    reasons += report.reasons
        except ControllerError as exc:
            if exc.retryable:
                raise
            raise ApplicationError(
                f"{inp.cluster} refused the artifact check: {exc.message}", exc.code, non_retryable=True
            ) from None
        return ArtifactReport(missing=missing, reasons=reasons)
