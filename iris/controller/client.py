"""Async client of the cluster controller API, mapping every failure to a typed ControllerError.

    async with ControllerClient(cluster.url, signer=signer, audience=cluster.name) as c:
        status = await c.launch(request)

Connection errors, timeouts, 408, 429 and 5xx answers raise Unavailable (retryable, whatever their
body); other error bodies raise the class of their code. An answer is read up to
MAX_RESPONSE_BYTES, never more (Unavailable beyond). With a ``signer`` each request carries a freshly
minted identity token bound to the target cluster (``audience``) and to the exact method, path,
query and body sent (docs/DESIGN.md, "Identity tokens"), so a retried call never replays a token id
and a captured token opens nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from iris import tracing
from iris.config import FederationConfig
from iris.controller.artifacts import ArtifactReport
from iris.controller.bundles import BundleInfo
from iris.controller.errors import ControllerError, Unavailable, error_for
from iris.controller.identity import TokenSigner
from iris.controller.models import (
    BackendsResponse,
    ChangeList,
    ErrorBody,
    HealthResponse,
    JobList,
    JobStatus,
    LaunchRequest,
    LogChunk,
)

M = TypeVar("M", bound=BaseModel)
# Idle connections kept open to one controller (in flight: no bound, as many as requests).
KEEPALIVE_CONNECTIONS = 64
# The slowest link an upload is given time for, beyond the client's own timeout (1 MiB/s).
UPLOAD_BYTES_PER_S = float(1 << 20)
# The largest answer read from a controller (a 1 MiB log chunk, JSON-escaped, fits many times);
# a larger one is refused while streaming, so a hostile peer cannot fill the caller's memory.
MAX_RESPONSE_BYTES = 16 << 20
# Of an error answer only a short message is kept.
MAX_ERROR_BYTES = 64 << 10
# Answers that mean "try again later", whatever their body (a proxy's HTML page, say).
TRANSIENT_STATUSES = frozenset({408, 429})


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # httpx builds (and loads the CA bundle into) a new context for every client unless given
    # one; a worker opens a client per activity, and that load was 40% of its CPU (issue 9).
    return httpx.create_ssl_context()


def _job_path(job_id: str) -> str:
    # Slashes stay: the server routes job ids as paths. Everything else is quoted.
    return "/v1/jobs/" + quote(job_id, safe="/")


class ControllerClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        signer: TokenSigner | None = None,
        audience: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        """``audience`` is the id of the cluster this controller serves: the tokens are addressed
        to it (required with a ``signer``)."""
        if signer is not None and not audience:
            raise ValueError("a signing ControllerClient needs the target cluster id (audience)")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._signer = signer
        self.audience = audience
        self.max_response_bytes = max_response_bytes
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            verify=_tls_context(),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS),
        )
        # Each request a span, its ``traceparent`` sent along, when tracing is on (docs/DESIGN.md,
        # "Tracing"); nothing otherwise.
        tracing.instrument_http(self._http)

    @classmethod
    def for_cluster(
        cls,
        config: FederationConfig,
        cluster: str,
        *,
        as_cluster: str | None = None,
        key_dir: Path | None = None,
        timeout: float = 10.0,
    ) -> ControllerClient:
        """A client of ``cluster``'s controller that signs as ``as_cluster`` (default: the home).

        Requests are signed when ``cluster`` has auth configured; the signing key is read as the
        config says, relative paths against ``key_dir`` (default ``$IRIS_KEY_DIR``). Raises KeyError
        for an unknown cluster and ConfigError for an unreadable key.
        """
        target = config.cluster(cluster)
        signer = None
        if target.auth is not None:
            signer = TokenSigner.from_config(config, as_cluster or config.home, key_dir)
        return cls(target.url, timeout=timeout, signer=signer, audience=target.name)

    async def __aenter__(self) -> ControllerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        model: type[M],
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        request_timeout: float | None = None,
    ) -> M:
        # identity: the cap counts the bytes as they will be parsed (no decompression bomb).
        headers = {"Accept-Encoding": "identity"}
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        req = self._http.build_request(
            method,
            path,
            json=json,
            content=content,
            params=params,
            headers=headers,
            timeout=request_timeout if request_timeout is not None else self.timeout,
        )
        if self._signer is not None:
            assert self.audience is not None  # checked in __init__
            # Bound to what goes on the wire: the encoded path and query, the exact body bytes.
            req.headers["Authorization"] = self._signer.authorization(
                self.audience, req.method, req.url.raw_path.decode("ascii"), req.content
            )
        try:
            resp = await self._http.send(req, stream=True)
            try:
                limit = self.max_response_bytes if resp.is_success else MAX_ERROR_BYTES
                body = await _read_capped(resp, limit)
            finally:
                await resp.aclose()
        except httpx.TimeoutException as exc:
            raise Unavailable(f"{self.base_url}: timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise Unavailable(f"{self.base_url}: {type(exc).__name__}: {exc}") from None
        if resp.is_success:
            if body is None:
                raise Unavailable(
                    f"{self.base_url}: the answer to {method} {path} is larger than "
                    f"{self.max_response_bytes} bytes; not read"
                )
            try:
                return model.model_validate_json(body)
            except ValidationError as exc:
                raise Unavailable(f"{self.base_url}: unexpected response to {method} {path}: {exc}") from None
        raise self._error(resp, body)

    def _error(self, resp: httpx.Response, body: bytes | None) -> ControllerError:
        message = _message(resp, body)
        if resp.status_code >= 500 or resp.status_code in TRANSIENT_STATUSES:
            # The service's trouble or "try later", whatever the body says: always worth a retry.
            return Unavailable(f"{self.base_url}: HTTP {resp.status_code}: {message}")
        try:
            parsed = ErrorBody.model_validate_json(body or b"")
        except ValidationError:
            return ControllerError("INVALID_ARGUMENT", f"HTTP {resp.status_code}: {message}")
        return error_for(parsed.code, parsed.message)

    async def health(self) -> HealthResponse:
        return await self._request("GET", "/v1/health", HealthResponse)

    async def backends(self) -> BackendsResponse:
        return await self._request("GET", "/v1/backends", BackendsResponse)

    async def launch(self, req: LaunchRequest) -> JobStatus:
        body = req.model_dump(mode="json")
        if not req.preemptions:
            del body["preemptions"]  # see LaunchRequest.preemptions
        return await self._request("POST", "/v1/jobs", JobStatus, json=body)

    async def status(self, job_id: str) -> JobStatus:
        return await self._request("GET", _job_path(job_id), JobStatus)

    async def list_jobs(self) -> list[JobStatus]:
        """Every job of the caller's, all pages."""
        jobs: list[JobStatus] = []
        after: int | None = 0
        while after is not None:
            page = await self.jobs_page(after)
            jobs += page.jobs
            after = page.next_after
        return jobs

    async def jobs_page(self, after: int = 0, limit: int | None = None) -> JobList:
        """One page of the caller's jobs in launch order (``after``: the last page's ``next_after``)."""
        params: dict[str, Any] = {"after": after}
        if limit is not None:
            params["limit"] = limit
        return await self._request("GET", "/v1/jobs", JobList, params=params)

    async def changes(
        self, since: str | None, *, wait_s: float = 0.0, limit: int | None = None
    ) -> ChangeList:
        """The change feed after ``since`` (docs/DESIGN.md, "The change feed"); with ``wait_s`` the
        controller holds the request until something changes, up to that long."""
        params: dict[str, Any] = {"wait": wait_s}
        if since is not None:
            params["since"] = since
        if limit is not None:
            params["limit"] = limit
        return await self._request(
            "GET", "/v1/changes", ChangeList, params=params, request_timeout=self.timeout + wait_s
        )

    async def logs(
        self,
        job_id: str,
        offset: int = 0,
        *,
        follow: bool = False,
        wait_s: float = 20.0,
        limit: int | None = None,
    ) -> LogChunk:
        """Log bytes from ``offset``; with ``follow`` the server waits up to ``wait_s`` for more."""
        params: dict[str, Any] = {"offset": offset}
        timeout = None
        if follow:
            params.update(follow="true", wait_s=wait_s)
            timeout = self.timeout + wait_s
        if limit is not None:
            params["limit"] = limit
        return await self._request(
            "GET", _job_path(job_id) + "/logs", LogChunk, params=params, request_timeout=timeout
        )

    async def bundle_info(self, sha256: str) -> BundleInfo:
        """The bundle ``sha256`` as the controller holds it; NotFound if it does not."""
        return await self._request("GET", f"/v1/bundles/{quote(sha256, safe='')}", BundleInfo)

    async def put_bundle(self, sha256: str, data: bytes) -> BundleInfo:
        """Upload a workspace bundle under its sha256 (idempotent; the controller verifies it)."""
        return await self._request(
            "PUT",
            f"/v1/bundles/{quote(sha256, safe='')}",
            BundleInfo,
            content=data,
            request_timeout=self.timeout + len(data) / UPLOAD_BYTES_PER_S,
        )

    async def terminate(self, job_id: str, nonce: str | None = None) -> JobStatus:
        """Terminate the job (with ``nonce``: only that attempt's run, see the API)."""
        return await self._request(
            "POST",
            _job_path(job_id) + "/terminate",
            JobStatus,
            params={"nonce": nonce} if nonce is not None else None,
            request_timeout=self.timeout + 10,
        )

    async def check_artifacts(self, uris: Sequence[str]) -> ArtifactReport:
        """Which of ``uris`` the cluster cannot read in its own object store, with its own
        credentials (at most 1024 URIs of at most 1024 characters); Unavailable if the store is down."""
        return await self._request(
            "POST",
            "/v1/artifacts/check",
            ArtifactReport,
            json={"uris": list(uris)},
            request_timeout=self.timeout + 20,
        )


async def _read_capped(resp: httpx.Response, limit: int) -> bytes | None:
    """The body of ``resp``, or None (having stopped reading) if it is longer than ``limit``."""
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return None
    if resp.headers.get("content-encoding", "identity").strip().lower() != "identity":
        raise httpx.DecodingError("a compressed answer was not asked for")
    body = bytearray()
    async for chunk in resp.aiter_raw():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _message(resp: httpx.Response, body: bytes | None) -> str:
    if body is None:
        return f"{resp.reason_phrase} (error body too large to show)"
    text = body.decode("utf-8", errors="replace").strip().replace("\n", " ")
    return text[:200] if text else resp.reason_phrase


@dataclass
class _Lent:
    client: ControllerClient
    made: float
    users: int = 0
    retired: bool = False


class ClientPool:
    """One ControllerClient per cluster, lent to every caller in this process, so requests to a
    controller reuse its open connections instead of connecting (and loading the signing key)
    anew for each (docs/DESIGN.md, "Controller costs"). A client is renewed after ``renew_s``, so
    a replaced key file or address takes effect within that time; the old one closes once its
    last borrower is done. For one event loop; ``make`` may raise, and then nothing is lent."""

    def __init__(self, make: Callable[[str], ControllerClient], *, renew_s: float = 60.0) -> None:
        self._make = make
        self._renew_s = renew_s
        self._lent: dict[str, _Lent] = {}

    @contextlib.asynccontextmanager
    async def borrow(self, cluster: str) -> AsyncIterator[ControllerClient]:
        lent = self._lent.get(cluster)
        now = time.monotonic()
        if lent is None or lent.retired or now - lent.made >= self._renew_s:
            fresh = _Lent(self._make(cluster), now)
            self._lent[cluster] = fresh
            if lent is not None:
                lent.retired = True
                if lent.users == 0:
                    await lent.client.aclose()
            lent = fresh
        lent.users += 1
        try:
            yield lent.client
        finally:
            lent.users -= 1
            if lent.retired and lent.users == 0:
                await lent.client.aclose()

    async def aclose(self) -> None:
        """Close every client (the worker's stop); one still lent closes when it is returned."""
        lent, self._lent = list(self._lent.values()), {}
        for entry in lent:
            entry.retired = True
            if entry.users == 0:
                await entry.client.aclose()
