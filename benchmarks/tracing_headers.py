"""What tracing adds to one controller request, with ~2 MiB of hostile trace headers and without
(docs/SECURITY.md, "Tracing").

A real controller app (the demo topology's ``cw-rno2a``, authentication on, its lifespan run) is
built twice: traced (Iris's ``TraceparentPropagator``, an in-memory exporter) and untraced (the
FastAPI instrumentation removed). Both are reached in-process through httpx's ASGI transport, so
no network noise enters. ``--rounds`` interleaved rounds (the first 5 warm up) send
``GET /v1/health`` plain and with hostile ``traceparent``/``tracestate``/``baggage`` headers to
each app; the medians are printed, and what tracing adds is the traced median minus the untraced
one. ``--default-propagators`` measures the OpenTelemetry SDK's default propagators instead
(W3C trace context and baggage), which parse every hostile byte.

Not a test: the property it measures is pinned structurally by
``tests/tracing/test_tracing_hostile.py::test_the_propagator_reads_only_one_bounded_traceparent``
(one header looked up, at most 256 characters parsed). Timing belongs here, where a busy machine
makes a number noisy rather than a build red.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import pwd
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from benchmarks.smoke import parse_args
from iris import tracing
from iris.config import load_config
from iris.controller.app import create_app
from iris.keydirs import provision_key_dirs

PEER = "cw-rno2a"
BASE_URL = "http://cw-rno2a.bench"
VALID_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
WARMUP = 5

HOSTILE = {
    "traceparent": "01" + VALID_PARENT[2:] + "-" + "a" * 65536,
    "tracestate": ",".join(f"k{i}=v{i}" for i in range(100_000))[: 1 << 20],
    "baggage": ",".join(f"b{i}=v" for i in range(100_000)) + ",user=" + "x" * (1 << 19),
}


class _Counter(logging.Handler):
    """Counts what the instrumentation logs, instead of printing it (the default propagators
    log a warning quoting the whole hostile header on every request)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.chars = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.chars += len(record.getMessage())


async def measure(
    rounds: int, default_propagators: bool, work: Path, logged: _Counter
) -> dict[tuple[str, str], float]:
    otel_logger = logging.getLogger("opentelemetry")
    otel_logger.addHandler(logged)
    otel_logger.propagate = False
    tracing.install(tracing.provider_for("bench", InMemorySpanExporter(), batch=False))
    if default_propagators:
        propagate.set_global_textmap(
            CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
        )
    try:
        cfg = load_config()
        cfg.cluster(PEER).run_as = pwd.getpwuid(os.geteuid()).pw_name
        key_dirs = provision_key_dirs(cfg, work / "keys")
        traced = create_app(cfg, PEER, work / "traced", key_dir=key_dirs.of(PEER))
        untraced = create_app(cfg, PEER, work / "untraced", key_dir=key_dirs.of(PEER))
        FastAPIInstrumentor.uninstrument_app(untraced)
        times: dict[tuple[str, str], list[float]] = {}
        async with (
            traced.router.lifespan_context(traced),
            untraced.router.lifespan_context(untraced),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=traced), base_url=BASE_URL) as on,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=untraced), base_url=BASE_URL) as off,
        ):
            for round_ in range(rounds + WARMUP):
                for (which, http), (kind, headers) in itertools.product(
                    (("traced", on), ("untraced", off)), (("plain", {}), ("hostile", HOSTILE))
                ):
                    start = time.perf_counter()
                    reply = await http.get("/v1/health", headers=headers)
                    elapsed = time.perf_counter() - start
                    if reply.status_code != 200:
                        raise SystemExit(f"error: {which} {kind} request answered {reply.status_code}")
                    if round_ >= WARMUP:
                        times.setdefault((which, kind), []).append(elapsed)
        return {key: statistics.median(values) * 1000 for key, values in times.items()}
    finally:
        tracing.uninstall()
        otel_logger.removeHandler(logged)
        otel_logger.propagate = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=30, help="measured rounds (default 30)")
    parser.add_argument(
        "--default-propagators",
        action="store_true",
        help="measure the SDK's default W3C trace-context and baggage propagators instead of Iris's",
    )
    args = parse_args(parser, {"rounds": 2}, argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="iris-bench-tracing-") as work:
        logged = _Counter()
        ms = asyncio.run(measure(args.rounds, args.default_propagators, Path(work), logged))
    which = "the SDK's default propagators" if args.default_propagators else "Iris's TraceparentPropagator"
    print(f"{which}, medians of {args.rounds} interleaved rounds (ms):")
    for (app, kind), value in sorted(ms.items()):
        print(f"  {app:9} {kind:8} {value:7.2f}")
    plain = ms["traced", "plain"] - ms["untraced", "plain"]
    hostile = ms["traced", "hostile"] - ms["untraced", "hostile"]
    print(f"tracing adds {plain:.2f} ms to a plain request and {hostile:.2f} ms to a hostile one")
    print(f"the instrumentation logged {logged.count} warnings, {logged.chars} characters in all")


if __name__ == "__main__":
    main()
