"""The cluster controller HTTP API (docs/DESIGN.md, "Capacity reports", "Handoff and admission",
"Mirroring, logs and cancellation"): FastAPI app over the executor and its backends.

Every error leaves as ``{"code", "message"}`` with one of six stable codes; request validation
errors are INVALID_ARGUMENT (400), never FastAPI's default 422 shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from iris import tracing
from iris.bundle import MAX_ARCHIVE_BYTES, BundleError, check_sha256, human_size
from iris.config import ClusterConfig, FederationConfig
from iris.controller.artifacts import ArtifactCheckRequest, ArtifactReport, check_artifacts
from iris.controller.bundles import BundleInfo
from iris.controller.errors import (
    AlreadyExists,
    ControllerError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from iris.controller.executors import MAX_LOG_CHUNK, Executor
from iris.controller.identity import LOCAL_ADMIN, Admission, Caller, body_sha256, default_key_dir
from iris.controller.metrics import CONTENT_TYPE, ControllerMetrics, route_template
from iris.controller.models import (
    BackendsResponse,
    ChangeList,
    ErrorBody,
    ErrorCode,
    HealthResponse,
    JobList,
    JobStatus,
    LaunchRequest,
    LogChunk,
    validate_job_id,
)
from iris.controller.retention import Retention, sweep_interval_s
from iris.controller.state import JobRecord, StateStore

log = logging.getLogger("iris.controller")
access_log = logging.getLogger("iris.controller.access")

MAX_BODY_BYTES = 1 << 20
MAX_FOLLOW_WAIT_S = 60.0
# A page of /v1/jobs and a reply of /v1/changes hold at most this many jobs (the default).
MAX_PAGE = 1000
BUNDLES_PATH = "/v1/bundles/"

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code.http_status: {"model": ErrorBody, "description": code.value} for code in ErrorCode
}


def _error(code: ErrorCode, message: str, status: int | None = None) -> JSONResponse:
    body = ErrorBody(code=code, message=message)
    return JSONResponse(status_code=status or code.http_status, content=body.model_dump(mode="json"))


def _validation_message(exc: RequestValidationError) -> str:
    # Field path and reason only: never echo the input, which may carry env values.
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


# Async dependencies run on the event loop, where all executor and store access happens.
async def executor_of(request: Request) -> Executor:
    executor: Executor = request.app.state.executor
    return executor


def _signed_target(request: Request) -> str:
    """The path and query string exactly as received, which the token's ``htp`` claim must equal
    (docs/DESIGN.md, "Identity tokens")."""
    raw: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
    query: bytes = request.scope.get("query_string", b"")
    return (raw + b"?" + query if query else raw).decode("latin-1")


async def _authenticate(request: Request, *, streamed: bool) -> Caller:
    admission: Admission = request.app.state.admission
    try:
        caller = await admission.authenticate(
            request.headers.get("authorization"),
            method=request.method,
            target=_signed_target(request),
            # Read only once the signature is good (a route with a JSON body has it read already);
            # a non-upload body is at most MAX_BODY_BYTES.
            read_body=None if streamed else request.body,
        )
    except Unauthenticated:
        metrics: ControllerMetrics = request.app.state.metrics
        metrics.refused("unauthenticated")
        raise
    request.state.caller = caller
    return caller


async def authenticate(request: Request) -> Caller:
    return await _authenticate(request, streamed=False)


async def authenticate_streamed(request: Request) -> Caller:
    """For an upload the route reads itself: the body hash is checked by the route, once read."""
    return await _authenticate(request, streamed=True)


ExecutorDep = Annotated[Executor, Depends(executor_of)]
CallerDep = Annotated[Caller, Depends(authenticate)]
StreamedCallerDep = Annotated[Caller, Depends(authenticate_streamed)]


def create_app(
    config: FederationConfig,
    cluster_name: str,
    state_dir: Path,
    *,
    key_dir: Path | None = None,
    kill_grace_s: float = 5.0,
) -> FastAPI:
    """Build the controller app of ``cluster_name``; state lives under ``state_dir``.

    ``key_dir`` resolves relative key paths of the auth config (default: ``$IRIS_KEY_DIR``, else the
    state dir's parent).
    Raises KeyError for an unknown cluster and ConfigError for unusable auth settings.
    """
    cluster: ClusterConfig = config.cluster(cluster_name)
    state_dir = Path(state_dir)
    admission = Admission.from_config(config, cluster, key_dir or default_key_dir(state_dir.resolve().parent))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = StateStore(state_dir)
        admission.attach_store(store)
        executor = Executor(cluster, state_dir, store, kill_grace_s=kill_grace_s)
        executor.recover()
        app.state.executor = executor
        # Once now, then periodically (docs/DESIGN.md, "Retention").
        retention = Retention(executor, retention_s=cluster.retention_s, interval_s=sweep_interval_s())
        retention.start()
        log.info(
            "controller %s ready: %d backend(s), %d known job(s), auth %s",
            cluster.name,
            len(cluster.backends),
            len(executor.jobs),
            "on" if admission.enabled else "OFF (no [clusters.auth] section)",
        )
        if not admission.enabled:
            # Once per start, at WARNING: the entry point refuses this on a non-loopback bind.
            log.warning(
                "controller %s admits every request unauthenticated (no [clusters.auth] section): "
                "for local experiments on a loopback address only",
                cluster.name,
            )
        try:
            yield
        finally:
            await retention.stop()
            await executor.shutdown()
            store.close()
            log.info("controller %s stopped", cluster.name)

    app = FastAPI(
        title=f"Iris cluster controller ({cluster.name})",
        version="1",
        description="Capacity reports, signed job handoff, job state, logs and termination.",
        lifespan=lifespan,
        responses=_ERROR_RESPONSES,
        # Every body is capped as it streams in, before any route or its authentication runs: a
        # chunked body has no length to refuse up front (docs/DESIGN.md, "Handoff and admission").
        # The bundle upload raises its own route's cap, and reads only once its caller is verified.
        max_body_size=MAX_BODY_BYTES,
        # No unauthenticated schema or docs pages; `api_docs = true` serves them behind auth.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.admission = admission
    # GET /metrics (docs/DESIGN.md, "Metrics"): this app's own registry.
    metrics = ControllerMetrics(cluster, lambda: getattr(app.state, "executor", None))
    app.state.metrics = metrics
    # Each request a span, the child of the caller's `traceparent`, when tracing is on
    # (docs/DESIGN.md, "Tracing"); nothing otherwise.
    tracing.configure(config, tracing.controller_service(cluster.name))
    tracing.instrument_app(app)

    @app.middleware("http")
    async def access_and_limits(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.monotonic()
        length = request.headers.get("content-length")
        limit = MAX_ARCHIVE_BYTES if request.url.path.startswith(BUNDLES_PATH) else MAX_BODY_BYTES
        if length is not None and (not length.isdigit() or int(length) > limit):
            response: Response = _error(
                ErrorCode.INVALID_ARGUMENT, f"request body larger than {limit} bytes", 413
            )
        else:
            response = await call_next(request)
        if response.status_code >= 400 and (
            request.headers.get("transfer-encoding") or length not in (None, "0")
        ):
            # A refused request's unread body is not drained to keep the connection alive: the
            # server hangs up after the answer (docs/DESIGN.md, "Handoff and admission").
            response.headers["connection"] = "close"
        metrics.request(
            request.method, route_template(request.scope, app.router.routes), response.status_code
        )
        caller = getattr(request.state, "caller", None)
        access_log.info(
            "%s %s -> %d in %.1fms caller=%s",
            request.method,
            request.url.path,
            response.status_code,
            (time.monotonic() - start) * 1000,
            caller.cluster if isinstance(caller, Caller) and caller.cluster else "-",
        )
        return response

    @app.exception_handler(ControllerError)
    async def _controller_error(request: Request, exc: ControllerError) -> JSONResponse:
        return _error(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(ErrorCode.INVALID_ARGUMENT, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(ErrorCode.NOT_FOUND, f"no such resource: {request.url.path}")
        code = ErrorCode.UNAVAILABLE if exc.status_code >= 500 else ErrorCode.INVALID_ARGUMENT
        return _error(code, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(ErrorCode.UNAVAILABLE, "internal error", 500)

    def owned(executor: Executor, caller: Caller, job_id: str) -> JobRecord:
        try:
            validate_job_id(job_id)
        except ValueError:
            raise NotFound(f"job {job_id} not found on cluster {cluster.name}") from None
        job = executor.get(job_id)
        if not caller.may_access(job.requester):
            raise PermissionDenied(f"job {job_id} was handed in by another requester")
        return job

    @app.get("/v1/health", response_model=HealthResponse, tags=["health"])
    async def health() -> HealthResponse:
        return HealthResponse(cluster=cluster.name)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus's text format, without a token like /v1/health: counts by bounded labels only,
        nothing that names a job, a user, a requester or a secret (docs/DESIGN.md, "Metrics")."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/backends", response_model=BackendsResponse, tags=["capacity"])
    async def backends(executor: ExecutorDep, caller: CallerDep) -> BackendsResponse:
        return BackendsResponse(cluster=cluster.name, backends=executor.availability())

    def admission_refusal(req: LaunchRequest, caller: Caller) -> tuple[str, str] | None:
        """Admission order (docs/DESIGN.md, "Admission order"): local_admin, requester == issuer,
        allowed submitters. The first refusal's reason (iris/metrics.py) and message, or None."""
        if req.user.strip().lower() == LOCAL_ADMIN:
            return "local_admin", "the local_admin submitter cannot hand off jobs"
        if caller.cluster is not None and req.requester != caller.cluster:
            return (
                "requester_mismatch",
                f"requester {req.requester!r} does not match the signed identity {caller.cluster!r}",
            )
        if not admission.may_submit(caller):
            return (
                "requester_not_trusted",
                f"cluster {caller.cluster!r} may not hand off jobs to {cluster.name}",
            )
        if not admission.submitter_allowed(req.user):
            return "submitter_not_allowed", f"user {req.user!r} may not submit to cluster {cluster.name}"
        return None

    @app.post("/v1/jobs", response_model=JobStatus, tags=["jobs"])
    async def launch(req: LaunchRequest, executor: ExecutorDep, caller: CallerDep) -> JobStatus:
        refusal = admission_refusal(req, caller)
        if refusal is not None:
            metrics.refused_launch(req.backend_id, refusal[0])
            raise PermissionDenied(refusal[1])
        try:
            job, created = executor.launch(req)
        except AlreadyExists:
            metrics.refused_launch(req.backend_id, "already_exists")
            raise
        except InvalidArgument:
            metrics.refused_launch(req.backend_id, "unsupported_demand")
            raise
        except NotFound:
            metrics.launched(req.backend_id, "bundle_missing")
            raise
        metrics.launched(req.backend_id, "accepted" if created else "replayed")
        return job.status()

    def bundle_id(sha256: str) -> str:
        try:
            return check_sha256(sha256)
        except BundleError as exc:
            raise InvalidArgument(str(exc)) from None

    @app.get(BUNDLES_PATH + "{sha256}", response_model=BundleInfo, tags=["bundles"])
    async def bundle_info(sha256: str, executor: ExecutorDep, caller: CallerDep) -> BundleInfo:
        """Whether this cluster holds the workspace bundle ``sha256`` (its bytes are never served)."""
        info = executor.bundles.info(bundle_id(sha256))
        if info is None:
            raise NotFound(f"bundle {sha256} is not stored on cluster {cluster.name}")
        return info

    @app.put(
        BUNDLES_PATH + "{sha256}",
        response_model=BundleInfo,
        tags=["bundles"],
        max_body_size=MAX_ARCHIVE_BYTES,
    )
    async def put_bundle(
        sha256: str, request: Request, executor: ExecutorDep, caller: StreamedCallerDep
    ) -> BundleInfo:
        """Store a workspace bundle under its sha256 (idempotent; refused unless the bytes hash to
        it and form an acceptable bundle). The caller is authenticated before the body is read, and
        the body checked against the token's body hash before it is stored."""
        if not admission.may_submit(caller):
            metrics.refused("requester_not_trusted")
            raise PermissionDenied(f"cluster {caller.cluster!r} may not hand off jobs to {cluster.name}")
        sha = bundle_id(sha256)
        existing = executor.bundles.info(sha)
        if existing is not None:
            return existing
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_ARCHIVE_BYTES:  # a chunked body has no length to refuse up front
                raise InvalidArgument(f"bundle larger than {human_size(MAX_ARCHIVE_BYTES)}")
        admission.check_body(caller, body_sha256(body))
        try:
            info = await asyncio.to_thread(executor.bundles.put, sha, bytes(body))
        except BundleError as exc:
            raise InvalidArgument(str(exc)) from None
        log.info("bundle %s stored (%d bytes) from %s", sha[:12], info.size, caller.cluster or "-")
        return info

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"])
    async def list_jobs(
        executor: ExecutorDep,
        caller: CallerDep,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    ) -> JobList:
        """The caller's jobs in launch order, a page at a time: ``after`` is the previous page's
        ``next_after``. ``cursor`` is the change feed's when the page was read."""
        return executor.page(after, limit, caller.may_access)

    @app.get("/v1/changes", response_model=ChangeList, tags=["jobs"])
    async def changes(
        executor: ExecutorDep,
        caller: CallerDep,
        since: Annotated[str | None, Query(max_length=64)] = None,
        wait: Annotated[float, Query(ge=0, le=MAX_FOLLOW_WAIT_S)] = 0.0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    ) -> ChangeList:
        """Every job of the caller's that changed after the cursor ``since`` (docs/DESIGN.md, "The
        change feed"): a long poll that answers as soon as something changed, or after ``wait``
        seconds with no change. A cursor from another start of this controller, or too old to
        answer exactly, gets ``resync``: list ``/v1/jobs`` and continue from its ``cursor``."""
        await executor.feed.wait(since, wait)
        return executor.changes(since, limit, caller.may_access)

    @app.get("/v1/jobs/{job_id:path}/logs", response_model=LogChunk, tags=["jobs"])
    async def logs(
        job_id: str,
        executor: ExecutorDep,
        caller: CallerDep,
        offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
        follow: bool = False,
        wait_s: Annotated[float, Query(gt=0, le=MAX_FOLLOW_WAIT_S)] = 20.0,
        limit: Annotated[int, Query(ge=1, le=MAX_LOG_CHUNK)] = MAX_LOG_CHUNK,
    ) -> LogChunk:
        owned(executor, caller, job_id)
        if follow:
            return await executor.follow_log(job_id, offset, wait_s, limit)
        return await executor.read_log(job_id, offset, limit)

    @app.post("/v1/jobs/{job_id:path}/terminate", response_model=JobStatus, tags=["jobs"])
    async def terminate(
        job_id: str,
        executor: ExecutorDep,
        caller: CallerDep,
        nonce: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    ) -> JobStatus:
        """Terminate the job; with ``nonce``, only the run of that attempt (a later attempt's run
        is never touched by fencing an earlier one: the answer then shows the current run)."""
        owned(executor, caller, job_id)
        job = await executor.terminate(job_id, nonce=nonce)
        return job.status()

    @app.get("/v1/jobs/{job_id:path}", response_model=JobStatus, tags=["jobs"])
    async def status(job_id: str, executor: ExecutorDep, caller: CallerDep) -> JobStatus:
        return owned(executor, caller, job_id).status()

    @app.post("/v1/artifacts/check", response_model=ArtifactReport, tags=["artifacts"])
    async def artifacts_check(req: ArtifactCheckRequest, caller: CallerDep) -> ArtifactReport:
        """Which of these artifacts this cluster cannot read in its own object store, checked with
        its own credentials (the handoff's artifact check; any verified caller may ask)."""
        return await check_artifacts(cluster, req.uris)

    if cluster.api_docs:
        # Off by default; when on, the schema and its pages need a verified caller like any route.
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_schema(caller: CallerDep) -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def swagger_docs(caller: CallerDep) -> Response:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

        @app.get("/redoc", include_in_schema=False)
        async def redoc_docs(caller: CallerDep) -> Response:
            return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    return app
