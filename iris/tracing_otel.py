"""Tracing's OpenTelemetry side: imported by iris/tracing.py only once tracing is on, so that a
process with tracing off imports nothing of OpenTelemetry (docs/DESIGN.md, "Tracing").

- ``TraceparentPropagator``: what crosses a process boundary is one bounded ``traceparent``.
- ``HeaderScrubber``: no request or response header leaves in an exported span.
- ``IrisTracingInterceptor``: Temporal's ``TracingInterceptor`` whose context header
  (``_tracer-data``) carries that one ``traceparent`` too, and which reads the header of a signal,
  query or Update defensively: anyone who may signal a job sets it, and the stock interceptor let a
  malformed one fail the job's workflow task on every retry (the job stalled for good).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import opentelemetry.trace
import temporalio.workflow
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio import worker
from temporalio.api.common.v1 import Payload
from temporalio.contrib.opentelemetry import TracingInterceptor, TracingWorkflowInboundInterceptor
from temporalio.converter import PayloadConverter

# Version 00 is 55 characters; a later version may append fields, within this.
MAX_TRACEPARENT = 256
# No attribute value is kept longer than this (a hostile caller's User-Agent or path, say).
MAX_ATTRIBUTE_LENGTH = 1024
# Attributes whose keys start with one of these hold request or response headers.
HEADER_ATTRIBUTE_PREFIXES = ("http.request.header.", "http.response.header.")
# Temporal's context header, and the largest one read (a traceparent, JSON-encoded, is ~90 bytes).
TRACER_HEADER = "_tracer-data"
MAX_TRACER_HEADER_BYTES = 1024
TRACEPARENT = "traceparent"


class TraceparentPropagator(TextMapPropagator):
    """W3C ``traceparent`` and nothing else: no ``tracestate``, no baggage. A ``traceparent`` that is
    repeated, not a string or longer than ``MAX_TRACEPARENT`` is ignored, without a log line (a
    caller's bad header is no reason to log; the SDK's own propagators log the header itself)."""

    def __init__(self) -> None:
        self._w3c = TraceContextTextMapPropagator()

    def extract(
        self, carrier: CarrierT, context: Context | None = None, getter: Getter[CarrierT] = default_getter
    ) -> Context:
        if context is None:
            context = Context()
        values = getter.get(carrier, TRACEPARENT)
        if not values or len(values) != 1:
            return context
        (value,) = values
        if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
            return context
        return self._w3c.extract({TRACEPARENT: value}, context)

    def inject(
        self, carrier: CarrierT, context: Context | None = None, setter: Setter[CarrierT] = default_setter
    ) -> None:
        inner: dict[str, str] = {}
        self._w3c.inject(inner, context)
        if TRACEPARENT in inner:
            setter.set(carrier, TRACEPARENT, inner[TRACEPARENT])

    @property
    def fields(self) -> set[str]:
        return {TRACEPARENT}


PROPAGATOR = TraceparentPropagator()


class HeaderScrubber(SpanExporter):
    """Passes every span on to ``inner`` without its header attributes, whatever the
    instrumentations were asked to capture (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*``)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([_scrub(s) for s in spans])

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _is_header(key: str) -> bool:
    return key.startswith(HEADER_ATTRIBUTE_PREFIXES)


def _scrub(span: ReadableSpan) -> ReadableSpan:
    attributes = span.attributes or {}
    if not any(_is_header(k) for k in attributes):
        return span
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={k: v for k, v in attributes.items() if not _is_header(k)},
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def provider_for(service: str, exporter: SpanExporter, *, batch: bool = True) -> TracerProvider:
    """A tracer provider naming ``service`` whose spans go to ``exporter`` without header
    attributes; batched in a background thread (``batch``), else exported as each span ends."""
    scrubbed = HeaderScrubber(exporter)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        span_limits=SpanLimits(max_span_attribute_length=MAX_ATTRIBUTE_LENGTH),
    )
    provider.add_span_processor(BatchSpanProcessor(scrubbed) if batch else SimpleSpanProcessor(scrubbed))
    return provider


# ---- Temporal ------------------------------------------------------------------------------

_CONVERTER = PayloadConverter.default


def tracer_carrier(payload: Payload | None) -> dict[str, str] | None:
    """The ``traceparent`` a ``_tracer-data`` header holds, or None for anything else: too large,
    not JSON, not an object, no string ``traceparent``. Pure and deterministic (it runs in
    workflow code, replays included)."""
    if payload is None or payload.ByteSize() > MAX_TRACER_HEADER_BYTES:
        return None
    try:
        (carrier,) = _CONVERTER.from_payloads([payload])
    except Exception:
        return None
    if not isinstance(carrier, dict):
        return None
    value = carrier.get(TRACEPARENT)
    if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
        return None
    return {TRACEPARENT: value}


def clean_headers(headers: Mapping[str, Payload]) -> Mapping[str, Payload]:
    """``headers`` with ``_tracer-data`` reduced to its ``traceparent``, or dropped."""
    if TRACER_HEADER not in headers:
        return headers
    carrier = tracer_carrier(headers[TRACER_HEADER])
    cleaned = {k: v for k, v in headers.items() if k != TRACER_HEADER}
    if carrier is not None:
        cleaned[TRACER_HEADER] = _CONVERTER.to_payloads([carrier])[0]
    return cleaned


class IrisTracingInterceptor(TracingInterceptor):
    """Temporal's tracing interceptor, its context header checked (see the module docstring)."""

    def __init__(self, tracer: opentelemetry.trace.Tracer) -> None:
        super().__init__(tracer)
        self.text_map_propagator = PROPAGATOR

    def workflow_interceptor_class(
        self, input: worker.WorkflowInterceptorClassInput
    ) -> type[TracingWorkflowInboundInterceptor]:
        super().workflow_interceptor_class(input)
        return _WorkflowInbound

    def _context_from_headers(self, headers: Mapping[str, Payload]) -> Context | None:
        carrier = tracer_carrier(headers.get(self.header_key))
        return None if carrier is None else self.text_map_propagator.extract(carrier)


class _WorkflowInbound(TracingWorkflowInboundInterceptor):
    """Every header a signal, query or Update brings is cleaned before the stock interceptor
    reads it; so is the header the workflow was started with."""

    def __init__(self, next: worker.WorkflowInboundInterceptor) -> None:
        super().__init__(next)
        self.text_map_propagator = PROPAGATOR

    def _load_workflow_context_carrier(self) -> dict[str, Any] | None:
        if self._workflow_context_carrier is None:
            carrier = tracer_carrier(temporalio.workflow.info().headers.get(self.header_key))
            self._workflow_context_carrier = dict(carrier) if carrier is not None else None
        return self._workflow_context_carrier

    async def handle_signal(self, input: worker.HandleSignalInput) -> None:
        await super().handle_signal(dataclasses.replace(input, headers=clean_headers(input.headers)))

    async def handle_query(self, input: worker.HandleQueryInput) -> Any:
        return await super().handle_query(dataclasses.replace(input, headers=clean_headers(input.headers)))

    def handle_update_validator(self, input: worker.HandleUpdateInput) -> None:
        super().handle_update_validator(dataclasses.replace(input, headers=clean_headers(input.headers)))

    async def handle_update_handler(self, input: worker.HandleUpdateInput) -> Any:
        return await super().handle_update_handler(
            dataclasses.replace(input, headers=clean_headers(input.headers))
        )
