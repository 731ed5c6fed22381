"""Connecting to Temporal the same way everywhere (CLI, SDK, worker, dev stack)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig
from temporalio.service import TLSConfig

from iris.config import ConfigError, FederationConfig, TemporalTLSConfig


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


async def connect(config: FederationConfig) -> Client:
    args = connect_args(config)
    return await Client.connect(args.pop("target_host"), data_converter=pydantic_data_converter, **args)
