"""``POST /v1/artifacts/check``: a cluster checks declared artifacts in its OWN object store
(docs/DESIGN.md, "Artifact check").

The artifact check of a handoff runs on the destination's controller, with the destination's
credentials: the federation's worker asks (signed, like every other call) and gets back which URIs
the destination cannot read, each with a reason a human can act on. No credential ever leaves the
cluster that owns it (docs/DESIGN.md, "Credentials": "credentials are not transferred between
clouds").

The wire models and the check are importable without FastAPI (the worker and the CLI import the
client, which parses ``ArtifactReport``); the endpoint itself is the controller app's
(iris/controller/app.py).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from iris.config import ClusterConfig, ObjectStoreConfig
from iris.controller.errors import Unavailable
from iris.objectstore import SCHEMES, StoreUnavailable, open_store

MAX_ARTIFACTS = 1024
MAX_URI_CHARS = 1024
# Concurrent store requests of one check (each a blocking call on a worker thread).
_PARALLEL = 8
# A bucket name both services could hold (the SDK's rule); anything else names no object at all,
# and must not reach the client library, which would refuse it as if the store had failed.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,221}")


class ArtifactCheckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uris: list[Annotated[str, StringConstraints(max_length=MAX_URI_CHARS)]] = Field(max_length=MAX_ARTIFACTS)


class ArtifactReport(BaseModel):
    """Which artifacts the destination cannot read, each with a reason a human can act on."""

    missing: list[str]
    reasons: list[str]

    @property
    def ok(self) -> bool:
        return not self.missing


def check_one(cluster: str, store: ObjectStoreConfig | None, uri: str) -> str | None:
    """None if ``cluster`` can read ``uri`` with its own credentials, else why not.

    Blocking (a store request); raises StoreUnavailable when the store does not answer. A URI in
    another bucket of the same service is read with the same credentials.
    """
    if store is None:
        return f"Artifact {uri} cannot be checked: {cluster} has no object store"
    parsed = urlparse(uri)
    if parsed.scheme != SCHEMES[store.kind]:
        kind = store.kind.upper()
        return f"Artifact {uri} is not in {cluster}'s object store ({kind}; credentials never cross clusters)"
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    addressable = bool(_BUCKET_RE.fullmatch(bucket)) and bool(key)
    if not addressable or not open_store(store, bucket=bucket).exists(key):
        return f"Artifact {uri} missing in {cluster}'s object store"
    return None


async def check_artifacts(cluster: ClusterConfig, uris: list[str]) -> ArtifactReport:
    """Check every URI in ``cluster``'s own store; Unavailable (503) if the store does not answer."""
    gate = asyncio.Semaphore(_PARALLEL)

    async def one(uri: str) -> str | None:
        async with gate:
            return await asyncio.to_thread(check_one, cluster.name, cluster.object_store, uri)

    try:
        reasons = await asyncio.gather(*(one(uri) for uri in uris))
    except StoreUnavailable as exc:
        raise Unavailable(f"{cluster.name}'s object store is unavailable: {exc}") from None
    missing = [(uri, reason) for uri, reason in zip(uris, reasons, strict=True) if reason is not None]
    return ArtifactReport(missing=[uri for uri, _ in missing], reasons=[reason for _, reason in missing])
