"""Connecting to Temporal the same way everywhere (CLI, SDK, worker, dev stack).

A process's Temporal SDK serves its own metrics in the Prometheus text format at
``http://HOST:PORT/metrics`` when given an address (opt-in, per process): ``iris worker
--metrics-address HOST:PORT`` (or ``IRIS_TEMPORAL_METRICS=HOST:PORT`` for any process), and ``iris
dev``'s worker by default. Among them, for a worker: ``temporal_worker_task_slots_used`` and
``temporal_worker_task_slots_available`` (labels ``task_queue`` and ``worker_type``:
``WorkflowWorker``, ``ActivityWorker``, ``LocalActivityWorker``), ``temporal_request`` (the client's
calls to the server, by ``operation``), and Iris's own ``iris_*`` (iris/metrics.py; docs/DESIGN.md,
"Metrics"), whose histograms get buckets in seconds here. Two processes cannot bind the same port,
and a process that cannot is refused with a one-line ConfigError. No address: no endpoint, the
SDK's default runtime. benchmarks/running.py reads the slot gauges this way (docs/BENCHMARKS.md,
"Running jobs (issue 17)").

Every client and worker converts payloads with ``data_converter``: Pydantic models as JSON, then
encrypted by the payload codec when the process holds the payload key ring (iris/payloadcodec.py;
docs/DESIGN.md, "Payload encryption"). Tests, benchmarks and scripts that build a client, a test
environment or a replayer use it too, so every process reads what the others write.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverter,
    DefaultFailureConverterWithEncodedAttributes,
)
from temporalio.envconfig import ClientConfig
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.service import TLSConfig

from iris import tracing
from iris.config import ConfigError, FederationConfig, TemporalTLSConfig
from iris.metrics import HISTOGRAM_BUCKETS
from iris.payloadcodec import EncryptionCodec, Keyring, load_keyring
from iris.payloadconverter import IrisPayloadConverter


def data_converter(keyring: Keyring | None = None) -> DataConverter:
    """The project's one data converter: Pydantic payloads, encrypted with ``keyring``'s current
    key and decrypted with any of its keys (``load_keyring()`` is this process's own ring).
    Without a ring nothing is encrypted, payloads without the codec's encoding pass through
    (histories recorded before encryption keep replaying), and an encrypted payload is refused
    with a line naming its key. With a ring, failure messages and stack traces are encrypted too
    (they may quote a job's input)."""
    return DataConverter(
        # Never a workflow task failed for ever on one unreadable payload (iris/payloadconverter.py).
        payload_converter_class=IrisPayloadConverter,
        payload_codec=EncryptionCodec(keyring, keep_undecryptable=True),
        failure_converter_class=(
            DefaultFailureConverterWithEncodedAttributes if keyring is not None else DefaultFailureConverter
        ),
    )


def connect_args(config: FederationConfig) -> dict[str, Any]:
    """The federation file's address and namespace, overridden by Temporal's standard client
    configuration when present: ``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``,
    TLS settings, and profiles (``TEMPORAL_PROFILE``, ``TEMPORAL_CONFIG_FILE``), as the ``temporal``
    CLI reads them."""
    try:
        standard = dict(ClientConfig.load_client_connect_config())
    except Exception as exc:  # a malformed profile file is the user's to fix: say which
        raise ConfigError(f"Temporal client configuration is invalid: {exc}") from None
    args: dict[str, Any] = {"target_host": config.temporal.address, "namespace": config.temporal.namespace}
    if config.temporal.tls is not None:
        args["tls"] = tls_config(config.temporal.tls)
    args.update({k: v for k, v in standard.items() if v})
    return args


def _pem(kind: str, path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"temporal.tls: cannot read the {kind} {path}: {exc.strerror}") from None


def tls_config(tls: TemporalTLSConfig) -> TLSConfig:
    """The config's ``[temporal.tls]`` as the SDK's TLS settings (docs/DESIGN.md, "Where secrets
    live"): the CA the server must chain to, and the client's own certificate for mutual TLS."""
    return TLSConfig(
        server_root_ca_cert=_pem("server CA", tls.server_ca),
        client_cert=_pem("client certificate", tls.client_cert),
        client_private_key=_pem("client key", tls.client_key),
        domain=tls.server_name or None,
    )


METRICS_ENV = "IRIS_TEMPORAL_METRICS"


@functools.cache
def _prometheus_runtime(bind_address: str) -> Runtime:
    # One runtime per address and process: the exporter binds its port once, every client shares it.
    # The SDK exporter's defaults otherwise (iris/metrics.py says what they make of the names).
    buckets = {name: list(bounds) for name, bounds in HISTOGRAM_BUCKETS.items()}
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=bind_address, histogram_bucket_overrides=buckets)
        )
    )


def metrics_address(explicit: str | None = None) -> str | None:
    """The address to serve the SDK's metrics at: ``explicit`` if given, else
    ``$IRIS_TEMPORAL_METRICS``; None when both are unset or empty."""
    address = (explicit if explicit is not None else os.environ.get(METRICS_ENV, "")).strip()
    return address or None


def metrics_runtime(address: str | None = None) -> Runtime | None:
    """The SDK runtime serving Prometheus metrics at ``address`` (default ``$IRIS_TEMPORAL_METRICS``,
    see the module docstring), or None when there is none. ConfigError (one line) for an address
    that is not ``HOST:PORT`` or cannot be bound."""
    where = metrics_address(address)
    if where is None:
        return None
    try:
        return _prometheus_runtime(where)
    except ValueError as exc:
        named = f"metrics address {where}" if address else f"{METRICS_ENV}={where}"
        raise ConfigError(f"{named}: {exc}") from None


def payload_encryption(client: Client) -> str | None:
    """One line saying how ``client`` (and every worker built on it) encrypts payloads, or None
    when it does not: no payload key ring (docs/SECURITY.md, "Payload encryption")."""
    codec = client.data_converter.payload_codec
    ring = codec.keyring if isinstance(codec, EncryptionCodec) else None
    if ring is None:
        return None
    return f"payloads encrypted with key {ring.current} ({len(ring.ids)} key(s) decrypt)"


async def connect(
    config: FederationConfig, *, metrics: str | None = None, service: str = tracing.CLIENT_SERVICE
) -> Client:
    """A client of the config's Temporal; with ``metrics`` (``HOST:PORT``, else
    ``$IRIS_TEMPORAL_METRICS``) its runtime serves the SDK's Prometheus metrics there, and so does
    every worker built on the client. If tracing is on (iris/tracing.py), the client and its
    workers trace, and ``service`` names this process in the traces (its first connect decides).
    Payloads are encrypted with this process's payload key ring, if it has one (``load_keyring``:
    ``$IRIS_PAYLOAD_KEYS``, else the user's copy); a bad ring is a ConfigError."""
    args = connect_args(config)
    runtime = metrics_runtime(metrics)
    if runtime is not None:
        args["runtime"] = runtime
    tracing.configure(config, service)
    interceptors = tracing.client_interceptors()
    if interceptors:
        args["interceptors"] = interceptors
    converter = data_converter(load_keyring())
    return await Client.connect(args.pop("target_host"), data_converter=converter, **args)
