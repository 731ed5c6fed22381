"""Artifact presence in the destination cluster's own object store (SPEC §7).

The destination's controller checks, with its own credentials (``POST /v1/artifacts/check``,
``iris/controller/artifacts.py``); this activity only asks it, signed as the home cluster. No
process on the home side holds another cluster's object-store credentials.
"""

from __future__ import annotations

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from iris.config import ConfigError, FederationConfig
from iris.controller.artifacts import ArtifactReport
from iris.controller.client import ControllerClient
from iris.controller.errors import ControllerError

__all__ = ["ArtifactActivities", "ArtifactInput", "ArtifactReport"]


class ArtifactInput(BaseModel):
    cluster: str
    uris: list[str]


class ArtifactActivities:
    def __init__(self, config: FederationConfig, *, request_timeout_s: float = 10.0) -> None:
        self._config = config
        self._timeout = request_timeout_s

    def _client(self, cluster: str) -> ControllerClient:
        try:
            # Signed as the home cluster when the destination requires it (SPEC §7).
            return ControllerClient.for_cluster(self._config, cluster, timeout=self._timeout)
        except KeyError:
            raise ApplicationError(f"unknown cluster {cluster!r}", non_retryable=True) from None
        except ConfigError as exc:
            raise ApplicationError(f"cannot sign requests to {cluster}: {exc}", non_retryable=True) from None

    @activity.defn
    async def check_artifacts(self, inp: ArtifactInput) -> ArtifactReport:
        """Ask the destination's controller which declared artifacts it cannot read.

        Its outages (and its store's) are raised and retried; a refusal is final.
        """
        try:
            async with self._client(inp.cluster) as client:
                return await client.check_artifacts(inp.uris)
        except ControllerError as exc:
            if exc.retryable:
                raise
            raise ApplicationError(
                f"{inp.cluster} refused the artifact check: {exc.message}", exc.code, non_retryable=True
            ) from None
