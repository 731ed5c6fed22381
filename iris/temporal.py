"""Connecting to Temporal the same way everywhere (CLI, SDK, worker, dev stack)."""

from __future__ import annotations

import os

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from iris.config import FederationConfig


def temporal_target(config: FederationConfig) -> tuple[str, str]:
    """Address and namespace: Temporal's standard env variables override the federation config."""
    address = os.environ.get("TEMPORAL_ADDRESS") or config.temporal.address
    namespace = os.environ.get("TEMPORAL_NAMESPACE") or config.temporal.namespace
    return address, namespace


async def connect(config: FederationConfig) -> Client:
    address, namespace = temporal_target(config)
    return await Client.connect(address, namespace=namespace, data_converter=pydantic_data_converter)
