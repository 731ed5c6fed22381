"""The home-side copy of every job's output (SPEC §8), kept in the home cluster's object store.

The mirror activity copies each new piece of a job's log from the cluster that runs it into
immutable objects ``iris-logs/<job id>/<start>-<end>``, named by the controller's byte offsets,
so a retried copy rewrites the same object and readers never see a gap or a duplicate. `iris job
logs` reads them back, whether or not the peer still remembers the job.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

from iris.config import FederationConfig, ObjectStoreConfig

PREFIX = "iris-logs"
_NAME = re.compile(r"(\d{16})-(\d{16})$")


@dataclass(frozen=True)
class RelayedChunk:
    data: str
    next_offset: int


class _Objects(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def keys(self, prefix: str) -> list[str]: ...
    def get(self, key: str) -> bytes: ...


class _GcsObjects:
    def __init__(self, store: ObjectStoreConfig) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        options = {"api_endpoint": store.endpoint} if store.endpoint else None
        creds = AnonymousCredentials() if store.endpoint else None  # type: ignore[no-untyped-call]
        self._bucket = storage.Client(project="iris", credentials=creds, client_options=options).bucket(
            store.bucket
        )

    def put(self, key: str, data: bytes) -> None:
        self._bucket.blob(key).upload_from_string(data, content_type="text/plain; charset=utf-8")

    def keys(self, prefix: str) -> list[str]:
        return [b.name for b in self._bucket.client.list_blobs(self._bucket, prefix=prefix)]

    def get(self, key: str) -> bytes:
        return bytes(self._bucket.blob(key).download_as_bytes())


class _S3Objects:
    def __init__(self, store: ObjectStoreConfig) -> None:
        import boto3

        self._bucket = store.bucket
        self._s3: Any = boto3.client(
            "s3",
            endpoint_url=store.endpoint or None,
            region_name="us-east-1",
            aws_access_key_id=os.environ.get(store.access_key_env) if store.access_key_env else None,
            aws_secret_access_key=os.environ.get(store.secret_key_env) if store.secret_key_env else None,
        )

    def put(self, key: str, data: bytes) -> None:
        self._s3.put_object(Bucket=self._bucket, Key=key, Body=data)

    def keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def get(self, key: str) -> bytes:
        return bytes(self._s3.get_object(Bucket=self._bucket, Key=key)["Body"].read())


class LogRelay:
    """Append and read relayed logs in the home cluster's object store (synchronous I/O)."""

    def __init__(self, config: FederationConfig) -> None:
        store = config.home_cluster.object_store
        if store is None:
            raise ValueError(f"home cluster {config.home} has no object store to relay logs into")
        self._objects: _Objects = _GcsObjects(store) if store.kind == "gcs" else _S3Objects(store)

    @staticmethod
    def _prefix(job_id: str) -> str:
        return f"{PREFIX}/{job_id}/"

    def _ranges(self, job_id: str) -> list[tuple[int, int, str]]:
        out = []
        for key in self._objects.keys(self._prefix(job_id)):
            m = _NAME.search(key)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), key))
        return sorted(out)

    def relayed_offset(self, job_id: str) -> int:
        """How far (in the source's byte offsets) the copy reaches."""
        ranges = self._ranges(job_id)
        return ranges[-1][1] if ranges else 0

    def append(self, job_id: str, start: int, end: int, data: str) -> None:
        if end <= start:
            return
        self._objects.put(f"{self._prefix(job_id)}{start:016d}-{end:016d}", data.encode("utf-8"))

    def read(self, job_id: str, offset: int = 0) -> RelayedChunk:
        """Everything copied from ``offset`` on (``offset`` is a ``next_offset`` this returned)."""
        parts: list[str] = []
        next_offset = offset
        for start, end, key in self._ranges(job_id):
            if start < next_offset:
                continue
            if start > next_offset:
                break  # a piece still being copied: stop before the gap
            parts.append(self._objects.get(key).decode("utf-8", errors="replace"))
            next_offset = end
        return RelayedChunk(data="".join(parts), next_offset=next_offset)
