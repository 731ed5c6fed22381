"""Tracing's configuration (iris/tracing.py; docs/DESIGN.md, "Tracing"): off by default at no
cost, the endpoint from the environment or ``[telemetry]``, bad values refused in one line that
never echoes them, and spans really exported over OTLP/HTTP when on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_collector import Collector, running_collector

from iris import tracing
from iris.config import ConfigError, FederationConfig, load_config
from iris.controller.client import ControllerClient

OTEL_ENVS = (
    tracing.TRACES_ENDPOINT_ENV,
    tracing.ENDPOINT_ENV,
    tracing.DISABLED_ENV,
    *tracing.TIMEOUT_ENVS,
)
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in OTEL_ENVS:
        monkeypatch.delenv(name, raising=False)
    tracing.uninstall()
    tracing._state.configured = False
    yield
    tracing.uninstall()
    tracing._state.configured = False


def config(endpoint: str = "") -> FederationConfig:
    cfg = load_config()
    cfg.telemetry.otlp_endpoint = endpoint
    return cfg


def test_off_by_default_imports_nothing_and_starts_nothing() -> None:
    """A process with nothing configured: configure says off, adds no interceptor, imports no
    OpenTelemetry module and starts no thread (no exporter, no network). That is what "no cost"
    means here; how long configure takes is a figure for benchmarks/, not an assertion."""
    probe = """
import json, sys, threading
from iris import tracing
from iris.config import load_config
from iris.controller.client import ControllerClient
import iris.temporal
cfg = load_config()
on = tracing.configure(cfg, tracing.CLIENT_SERVICE)
client = ControllerClient("http://127.0.0.1:1")
print(json.dumps({
    "on": on,
    "interceptors": len(tracing.client_interceptors()),
    "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
    "threads": threading.active_count(),
}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["on"] is False
    assert result["interceptors"] == 0
    assert result["otel"] == []
    assert result["threads"] == 1


def test_off_means_no_instrumentation() -> None:
    assert tracing.configure(config(), tracing.CLIENT_SERVICE) is False
    assert not tracing.enabled()
    assert tracing.client_interceptors() == []
    client = ControllerClient("http://127.0.0.1:1")
    assert not getattr(client._http, "_is_instrumented_by_opentelemetry", False)


def test_endpoint_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracing.endpoint(config()) is None
    assert tracing.endpoint(config("http://collector:4318/")) == "http://collector:4318/v1/traces"
    # The standard variables win over the file: the base URL, then the full traces URL.
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://env-collector:4318")
    assert tracing.endpoint(config("http://collector:4318")) == "http://env-collector:4318/v1/traces"
    monkeypatch.setenv(tracing.TRACES_ENDPOINT_ENV, "https://traces.example/custom/path")
    assert tracing.endpoint(config("http://collector:4318")) == "https://traces.example/custom/path"
    monkeypatch.setenv(tracing.DISABLED_ENV, "true")
    assert tracing.endpoint(config("http://collector:4318")) is None
    assert tracing.configure(config("http://collector:4318"), tracing.CLIENT_SERVICE) is False


@pytest.mark.parametrize(
    "value", ["collector:4318", "ftp://u:hunter2@collector", "http://c:99999", "http://"]
)
def test_a_bad_endpoint_variable_is_one_line_without_the_value(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(tracing.ENDPOINT_ENV, value)
    with pytest.raises(ConfigError) as bad:
        tracing.configure(config(), tracing.CLIENT_SERVICE)
    message = str(bad.value)
    assert message == f"{tracing.ENDPOINT_ENV} is not an http(s)://HOST[:PORT] URL"
    assert not tracing.enabled()


@pytest.mark.parametrize(
    "value",
    ["collector:4318", "http://user:hunter2@collector:4318", "http://c:4318?token=hunter2", "http://c:x"],
)
def test_a_bad_telemetry_table_is_one_line_without_the_value(tmp_path: Path, value: str) -> None:
    data = json.loads(load_config().model_dump_json())
    data["telemetry"] = {"otlp_endpoint": value}
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as bad:
        load_config(path)
    message = str(bad.value)
    assert "telemetry.otlp_endpoint" in message
    assert "\n" not in message
    assert "hunter2" not in message and value not in message


def test_unknown_telemetry_keys_are_refused(tmp_path: Path) -> None:
    data = json.loads(load_config().model_dump_json())
    data["telemetry"] = {"otlp_endpiont": "http://c:4318"}
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"telemetry\.otlp_endpiont"):
        load_config(path)


@pytest.fixture
def collector() -> Iterator[Collector]:
    with running_collector() as server:
        yield server


def test_on_from_the_telemetry_table_exports_over_otlp_http(collector: Collector) -> None:
    assert tracing.configure(config(collector.url), tracing.controller_service("cw-rno2a")) is True
    # Later calls in the process change nothing (the first decides, and names the process).
    assert tracing.configure(config(), tracing.WORKER_SERVICE) is True
    provider = tracing.tracer_provider()
    assert provider is not None
    with provider.get_tracer("probe").start_as_current_span("probe"):
        pass
    tracing.uninstall()  # shuts the provider down: the batch is exported first
    assert collector.spans() == [("/v1/traces", "iris-controller-cw-rno2a", "probe")]


def test_the_environment_endpoint_wins(collector: Collector, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tracing.ENDPOINT_ENV, collector.url)
    assert tracing.configure(config("http://127.0.0.1:9"), tracing.CLIENT_SERVICE) is True
    provider = tracing.tracer_provider()
    assert provider is not None
    with provider.get_tracer("probe").start_as_current_span("from-env"):
        pass
    tracing.uninstall()
    assert collector.spans() == [("/v1/traces", "iris-client", "from-env")]


def test_untraced_work_is_not_recorded() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    tracing.install(tracing.provider_for("test", spans, batch=False))
    provider = tracing.tracer_provider()
    assert provider is not None
    tracer = provider.get_tracer("probe")
    with tracing.untraced(), tracer.start_as_current_span("background") as span:
        assert not span.is_recording()
    with tracer.start_as_current_span("foreground"):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["foreground"]
