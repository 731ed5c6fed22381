"""Tracing, set up in one place (docs/DESIGN.md, "Tracing").

One trace runs from a client's ``StartWorkflow`` through the job's workflow, its activities and the
HTTP requests they make to a controller, to that controller's handler: Temporal's
``TracingInterceptor`` on the client and the worker, the httpx instrumentation on the controller
client (``traceparent`` on every request) and the FastAPI instrumentation on the controller app.

Off by default. ``configure(config, service)`` turns it on when an OTLP endpoint is configured:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL), else ``OTEL_EXPORTER_OTLP_ENDPOINT`` or the
config's ``[telemetry] otlp_endpoint`` (a base URL: spans go to ``<url>/v1/traces``);
``OTEL_SDK_DISABLED=true`` keeps it off. With none of them nothing of OpenTelemetry is imported, no
interceptor or middleware is added and nothing touches the network. The first call in a process
decides, and names the process: ``iris-client`` (CLI and SDK), ``iris-worker``,
``iris-controller-<cluster>``.

Iris's own tracer provider is used explicitly everywhere; the process's global one is left alone
(a program using the SDK keeps its own). What a trace may carry across a process boundary, over
HTTP or in Temporal's context header, is one bounded ``traceparent``: nothing else is read (no
``tracestate``, no baggage), a malformed one is ignored silently. Request and response headers are
never exported, so an identity token (``Authorization``) cannot reach a span. The OpenTelemetry
side of all this is iris/tracing_otel.py, imported once tracing is on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from iris.config import ConfigError, FederationConfig

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor

CLIENT_SERVICE = "iris-client"
WORKER_SERVICE = "iris-worker"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
DISABLED_ENV = "OTEL_SDK_DISABLED"
# How long one export may try (retries included) unless OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT says:
# a process exiting while its collector is down waits this long at most (the SDK's default, 10 s,
# held every CLI command for 8 s).
EXPORT_TIMEOUT_S = 2.0
TIMEOUT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


def controller_service(cluster: str) -> str:
    return f"iris-controller-{cluster}"


class _State:
    provider: TracerProvider | None = None
    configured = False
    interceptor: TracingInterceptor | None = None
    saved_textmap: Any = None


_state = _State()


def endpoint(config: FederationConfig) -> str | None:
    """Where this process's spans go (the OTLP/HTTP traces URL), or None: tracing is off.
    ConfigError (one line, never echoing the value) for an environment value that is no URL."""
    if os.environ.get(DISABLED_ENV, "").strip().lower() == "true":
        return None
    full = os.environ.get(TRACES_ENDPOINT_ENV, "").strip()
    if full:
        _check_url(TRACES_ENDPOINT_ENV, full)
        return full
    base = os.environ.get(ENDPOINT_ENV, "").strip()
    if base:
        _check_url(ENDPOINT_ENV, base)
    else:
        base = config.telemetry.otlp_endpoint  # validated with the config
    return base.rstrip("/") + "/v1/traces" if base else None


def _check_url(name: str, value: str) -> None:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{name} is not an http(s)://HOST[:PORT] URL")


def configure(config: FederationConfig, service: str) -> bool:
    """Turn tracing on for this process if an endpoint is configured (see the module docstring);
    whether it is on. The first call in a process decides; later ones only answer."""
    if _state.configured or _state.provider is not None:
        return enabled()
    url = endpoint(config)
    _state.configured = True
    if url is None:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    timeout = None if any(os.environ.get(v) for v in TIMEOUT_ENVS) else EXPORT_TIMEOUT_S
    install(provider_for(service, OTLPSpanExporter(endpoint=url, timeout=timeout)))
    return True


def enabled() -> bool:
    return _state.provider is not None


def tracer_provider() -> TracerProvider | None:
    return _state.provider


def provider_for(service: str, exporter: SpanExporter, *, batch: bool = True) -> TracerProvider:
    """A tracer provider naming ``service`` whose spans go to ``exporter`` without header
    attributes; batched in a background thread (``batch``), else exported as each span ends."""
    from iris import tracing_otel

    return tracing_otel.provider_for(service, exporter, batch=batch)


def install(provider: TracerProvider) -> None:
    """Trace with ``provider`` from now on (``configure`` does this; tests pass one whose exporter
    keeps spans in memory). Clients, workers and apps made before are not traced."""
    from opentelemetry import propagate

    from iris import tracing_otel

    if _state.provider is None:
        _state.saved_textmap = propagate.get_global_textmap()
    _state.provider = provider
    _state.interceptor = tracing_otel.IrisTracingInterceptor(provider.get_tracer("iris"))
    # The httpx and FastAPI instrumentations inject and extract with the global propagator.
    propagate.set_global_textmap(tracing_otel.PROPAGATOR)


def shutdown() -> None:
    """Export what is pending (within the export deadline) and stop tracing: for a process that
    exits without running its atexit handlers, as the CLI does (cli/app.py)."""
    if _state.provider is not None:
        _state.provider.shutdown()


def uninstall() -> None:
    """Back to no tracing (tests): the provider is shut down (its spans exported first)."""
    provider = _state.provider
    if provider is None:
        return
    from opentelemetry import propagate

    propagate.set_global_textmap(_state.saved_textmap)
    _state.provider = None
    _state.interceptor = None
    _state.configured = False
    provider.shutdown()


def client_interceptors() -> list[TracingInterceptor]:
    """For ``Client.connect``: the tracing interceptor when tracing is on (a worker built on the
    client runs it too), else none."""
    return [_state.interceptor] if _state.interceptor is not None else []


def worker_interceptors(client: Client) -> list[TracingInterceptor]:
    """For a ``Worker`` on ``client``: the tracing interceptor when tracing is on and the client
    does not carry one already (the SDK hands a client's interceptors to its workers)."""
    from temporalio.contrib.opentelemetry import TracingInterceptor

    if _state.interceptor is None:
        return []
    if any(isinstance(i, TracingInterceptor) for i in client.config()["interceptors"]):
        return []
    return [_state.interceptor]


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Run the block under a parent span the sampler drops: for starting the background workflows
    (the placement manager, the watchers), whose endless continue-as-new chains would otherwise be
    one trace each that never ends. Their work is still timed by the metrics."""
    if _state.provider is None:
        yield
        return
    from opentelemetry import context, trace

    parent = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=int.from_bytes(secrets.token_bytes(16), "big") or 1,
            span_id=int.from_bytes(secrets.token_bytes(8), "big") or 1,
            is_remote=False,
            trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT),
        )
    )
    token = context.attach(trace.set_span_in_context(parent))
    try:
        yield
    finally:
        context.detach(token)


def instrument_app(app: FastAPI) -> None:
    """Trace every request of a controller app, each a child of the caller's ``traceparent``
    (no-op when tracing is off). No ``send``/``receive`` spans, no metrics."""
    if _state.provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.metrics import NoOpMeterProvider

    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=_state.provider,
        meter_provider=NoOpMeterProvider(),
        exclude_spans=["receive", "send"],
        # Were header capture asked for in the environment, every value is redacted (and the
        # exporter drops the attributes anyway).
        http_capture_headers_sanitize_fields=[".*"],
    )


def instrument_http(client: httpx.AsyncClient) -> None:
    """Trace a controller client's requests and send ``traceparent`` with each (no-op when tracing
    is off). No metrics."""
    if _state.provider is None:
        return
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.metrics import NoOpMeterProvider

    HTTPXClientInstrumentor.instrument_client(
        client, tracer_provider=_state.provider, meter_provider=NoOpMeterProvider()
    )
