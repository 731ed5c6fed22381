"""One cluster's object store (GCS or S3), opened with that cluster's own credentials.

The only place the project builds an object-store client. A process opens the stores of the
clusters it belongs to and no other (docs/DESIGN.md, "Credentials"): the home side its own store
(relayed logs, workspace bundles), each controller its own (artifact checks). Credentials are read
from the environment variables the config names; their values never appear in payloads, histories
or logs. Clients are cached per store, so a process holds one per store, not one per call.

All calls are synchronous (the client libraries are); async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlparse

from iris.config import ObjectStoreConfig

SCHEMES = {"gcs": "gs", "s3": "s3"}
# One request's time limit, and how long a call keeps retrying transient errors.
_TIMEOUT_S = 30
_RETRY_S = 20.0


class StoreError(Exception):
    """The store refused (no such bucket, no permission); one line, never a credential."""


class StoreUnavailable(StoreError):
    """The store did not answer as a store should (outage, throttling): worth a retry."""


class ObjectStore(Protocol):
    """The few operations the federation needs of a bucket."""

    bucket: str

    def exists(self, key: str) -> bool:
        """True if the object exists and is readable; False if absent or not ours to read."""

    def get(self, key: str) -> bytes:
        """The object's bytes; KeyError if there is none."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write ``data``; with ``if_absent`` an existing object is left alone. True if written."""

    def keys(self, prefix: str) -> list[str]: ...

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (the dev stack's emulators)."""


class _Gcs:
    def __init__(self, store: ObjectStoreConfig) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        options = {"api_endpoint": store.endpoint} if store.endpoint else None
        # An emulator endpoint takes no credentials; otherwise the process's own service account.
        creds = AnonymousCredentials() if store.endpoint else None  # type: ignore[no-untyped-call]
        self.bucket = store.bucket
        # Bounded: the library's default retries for up to 120 s, which a CLI must not hang for.
        self._opts: dict[str, Any] = {"timeout": _TIMEOUT_S, "retry": DEFAULT_RETRY.with_timeout(_RETRY_S)}
        self._bucket = storage.Client(project="iris", credentials=creds, client_options=options).bucket(
            store.bucket
        )

    def _call(self, fn: Any) -> Any:
        from google.api_core import exceptions as gexc

        try:
            return fn()
        except (gexc.NotFound, gexc.Forbidden, gexc.PreconditionFailed):
            # Answers, not outages (PreconditionFailed: a create-if-absent lost to a writer of the
            # same key, e.g. two submits of one workspace at once).
            raise
        except gexc.GoogleAPIError as exc:
            raise StoreUnavailable(f"GCS {type(exc).__name__}") from None
        except OSError as exc:  # connection refused, reset: requests' errors are OSErrors
            raise StoreUnavailable(f"GCS {type(exc).__name__}") from None

    def exists(self, key: str) -> bool:
        from google.api_core import exceptions as gexc

        try:
            return bool(self._call(lambda: self._bucket.blob(key).exists(**self._opts)))
        except (gexc.NotFound, gexc.Forbidden):
            return False

    def get(self, key: str) -> bytes:
        from google.api_core import exceptions as gexc

        try:
            return bytes(self._call(lambda: self._bucket.blob(key).download_as_bytes(**self._opts)))
        except gexc.NotFound:
            raise KeyError(key) from None

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        from google.api_core import exceptions as gexc

        blob = self._bucket.blob(key)
        try:
            # Generation 0 = "only if no live object": GCS's own create-if-absent.
            kwargs = {"if_generation_match": 0} if if_absent else {}
            self._call(lambda: blob.upload_from_string(data, **kwargs, **self._opts))
        except gexc.PreconditionFailed:
            return False
        except (gexc.NotFound, gexc.Forbidden) as exc:
            raise StoreError(f"GCS bucket {self.bucket}: {exc.code} {type(exc).__name__}") from None
        return True

    def keys(self, prefix: str) -> list[str]:
        from google.api_core import exceptions as gexc

        try:
            blobs = self._call(
                lambda: list(self._bucket.client.list_blobs(self.bucket, prefix=prefix, **self._opts))
            )
        except (gexc.NotFound, gexc.Forbidden) as exc:
            raise StoreError(f"GCS bucket {self.bucket}: {exc.code} {type(exc).__name__}") from None
        return [b.name for b in blobs]

    def ensure_bucket(self) -> None:
        client = self._bucket.client
        if self._call(lambda: client.lookup_bucket(self.bucket, **self._opts)) is None:
            self._call(lambda: client.create_bucket(self.bucket, **self._opts))


class _S3:
    def __init__(self, store: ObjectStoreConfig, environ: Mapping[str, str]) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = store.bucket
        self._s3: Any = boto3.client(
            "s3",
            endpoint_url=store.endpoint or None,
            region_name="us-east-1",
            config=Config(
                connect_timeout=5, read_timeout=_TIMEOUT_S, retries={"max_attempts": 3, "mode": "standard"}
            ),
            aws_access_key_id=environ.get(store.access_key_env) if store.access_key_env else None,
            aws_secret_access_key=environ.get(store.secret_key_env) if store.secret_key_env else None,
        )

    def _call(self, fn: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500 or code in {"SlowDown", "RequestTimeout", "ServiceUnavailable"}:
                raise StoreUnavailable(f"S3 {code or status}") from None
            raise
        except BotoCoreError as exc:
            raise StoreUnavailable(f"S3 {type(exc).__name__}") from None

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._call(lambda: self._s3.head_object(Bucket=self.bucket, Key=key))
        except ClientError:
            # 404 absent, 403 not ours to read, NoSuchBucket: the object is not there for us.
            return False
        return True

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            return bytes(self._call(lambda: self._s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()))
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in {"NoSuchKey", "404", "NoSuchBucket"}:
                raise KeyError(key) from None
            raise

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        from botocore.exceptions import ClientError

        kwargs = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._call(lambda: self._s3.put_object(Bucket=self.bucket, Key=key, Body=data, **kwargs))
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in {"PreconditionFailed", "412"}:
                return False
            raise StoreError(f"S3 bucket {self.bucket}: {code}") from None
        return True

    def keys(self, prefix: str) -> list[str]:
        def listing() -> list[str]:
            keys: list[str] = []
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys += [o["Key"] for o in page.get("Contents", [])]
            return keys

        result: list[str] = self._call(listing)
        return result

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call(lambda: self._s3.head_bucket(Bucket=self.bucket))
        except ClientError:
            self._call(lambda: self._s3.create_bucket(Bucket=self.bucket))


def _build(store: ObjectStoreConfig, environ: Mapping[str, str]) -> ObjectStore:
    return _Gcs(store) if store.kind == "gcs" else _S3(store, environ)


@functools.cache
def _open(kind: str, bucket: str, endpoint: str, access_key_env: str, secret_key_env: str) -> ObjectStore:
    store = ObjectStoreConfig(
        kind=kind,
        bucket=bucket,
        endpoint=endpoint,
        access_key_env=access_key_env,
        secret_key_env=secret_key_env,
    )
    return _build(store, os.environ)


def open_store(
    store: ObjectStoreConfig, *, bucket: str | None = None, environ: Mapping[str, str] | None = None
) -> ObjectStore:
    """The client of ``store`` (one per process and store), on its bucket or on ``bucket`` (another
    bucket of the same service, read with the same credentials). Credentials come from the process's
    environment, or from ``environ`` (a client of its own, not shared)."""
    if environ is not None:
        return _build(store.model_copy(update={"bucket": bucket or store.bucket}), environ)
    return _open(
        store.kind, bucket or store.bucket, store.endpoint, store.access_key_env, store.secret_key_env
    )


def split_uri(uri: str) -> tuple[str, str, str]:
    """``gs://bucket/key`` → ``("gcs", "bucket", "key")``; ValueError for anything else."""
    parsed = urlparse(uri)
    kind = {v: k for k, v in SCHEMES.items()}.get(parsed.scheme)
    if kind is None or not parsed.netloc or not parsed.path.lstrip("/"):
        raise ValueError(f"not a gs:// or s3:// object URI: {uri[:80]!r}")
    return kind, parsed.netloc, parsed.path.lstrip("/")
