"""Connecting to Temporal the same way everywhere (CLI, SDK, worker, dev stack)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig

from iris.config import ConfigError, FederationConfig


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
    args.update({k: v for k, v in standard.items() if v})
    return args


async def connect(config: FederationConfig) -> Client:
    args = connect_args(config)
    return await Client.connect(args.pop("target_host"), data_converter=pydantic_data_converter, **args)
