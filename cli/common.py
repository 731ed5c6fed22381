"""Shared CLI plumbing: config lookup, running coroutines, one-line errors with stable exit codes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer

from iris.client import AsyncIrisClient, IrisError
from iris.config import ConfigError, FederationConfig, load_config

T = TypeVar("T")

# Exit codes, documented in the README and `iris --help`.
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_INVALID = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130


class State:
    config_file: Path | None = None
    # The seed's `iris --cluster=NAME`; checked against the config on first use.
    cluster: str | None = None


STATE = State()


def fail(message: str, code: int) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def config() -> FederationConfig:
    try:
        cfg = load_config(STATE.config_file)
        if STATE.cluster is not None:
            cfg.check_cluster(STATE.cluster)
    except ConfigError as exc:
        fail(str(exc), EXIT_INVALID)
    return cfg


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine; SDK errors become one line on stderr and their exit code."""
    try:
        return asyncio.run(coro)
    except IrisError as exc:
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


async def client() -> AsyncIrisClient:
    return await AsyncIrisClient.connect(config())
