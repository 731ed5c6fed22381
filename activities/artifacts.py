"""Artifact presence in the destination cluster's own object store (SPEC §7).

Each cluster reads its store with its own credentials, named by environment variables in its
config; the values never leave this process (not in payloads, histories or logs).
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import urlparse

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from iris.config import FederationConfig, ObjectStoreConfig


class ArtifactInput(BaseModel):
    cluster: str
    uris: list[str]


class ArtifactReport(BaseModel):
    """Which artifacts the destination cannot read, each with a reason a human can act on."""

    missing: list[str]
    reasons: list[str]

    @property
    def ok(self) -> bool:
        return not self.missing


class _TransientStoreError(Exception):
    pass


def _exists_s3(store: ObjectStoreConfig, bucket: str, key: str) -> bool:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client(
        "s3",
        endpoint_url=store.endpoint or None,
        region_name="us-east-1",
        aws_access_key_id=os.environ.get(store.access_key_env) if store.access_key_env else None,
        aws_secret_access_key=os.environ.get(store.secret_key_env) if store.secret_key_env else None,
    )
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in {"404", "NoSuchKey", "NotFound", "NoSuchBucket", "403", "AccessDenied"}:
            return False
        raise _TransientStoreError(f"S3 {code}") from None
    except BotoCoreError as exc:
        raise _TransientStoreError(type(exc).__name__) from None
    return True


def _exists_gcs(store: ObjectStoreConfig, bucket: str, key: str) -> bool:
    from google.api_core import exceptions as gexc
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    options = {"api_endpoint": store.endpoint} if store.endpoint else None
    creds = AnonymousCredentials() if store.endpoint else None  # type: ignore[no-untyped-call]
    client = storage.Client(project="iris", credentials=creds, client_options=options)
    try:
        return bool(client.bucket(bucket).blob(key).exists())
    except (gexc.NotFound, gexc.Forbidden):
        return False
    except gexc.GoogleAPIError as exc:
        raise _TransientStoreError(type(exc).__name__) from None


def check_one(cluster: str, store: ObjectStoreConfig | None, uri: str) -> str | None:
    """None if the destination can read ``uri``, else why not."""
    parsed = urlparse(uri)
    scheme = {"gcs": "gs", "s3": "s3"}
    if store is None:
        return f"Artifact {uri} cannot be checked: {cluster} has no object store"
    if parsed.scheme != scheme[store.kind]:
        kind = store.kind.upper()
        return f"Artifact {uri} is not in {cluster}'s object store ({kind}; credentials never cross clusters)"
    exists = _exists_s3 if store.kind == "s3" else _exists_gcs
    if not exists(store, parsed.netloc, parsed.path.lstrip("/")):
        return f"Artifact {uri} missing in {cluster}'s object store"
    return None


class ArtifactActivities:
    def __init__(self, config: FederationConfig) -> None:
        self._config = config

    @activity.defn
    async def check_artifacts(self, inp: ArtifactInput) -> ArtifactReport:
        """Check every declared artifact in the destination's store; outages are retried."""
        try:
            store = self._config.cluster(inp.cluster).object_store
        except KeyError:
            raise ApplicationError(f"unknown cluster {inp.cluster!r}", non_retryable=True) from None
        missing: list[str] = []
        reasons: list[str] = []
        for uri in inp.uris:
            try:
                reason = await asyncio.to_thread(check_one, inp.cluster, store, uri)
            except _TransientStoreError as exc:
                raise ApplicationError(f"{inp.cluster}'s object store is unavailable: {exc}") from None
            if reason is not None:
                missing.append(uri)
                reasons.append(reason)
        return ArtifactReport(missing=missing, reasons=reasons)
