"""Shared CLI plumbing: config lookup, running coroutines, one-line errors with stable exit codes.

Everything past typer is imported when a command runs, not when the CLI starts: `iris --help`
loads no pydantic model, Temporal SDK or store (tests/test_cli_imports.py pins it).
"""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer

if TYPE_CHECKING:
    from iris.client import AsyncIrisClient
    from iris.config import FederationConfig

T = TypeVar("T")

# Exit codes, documented in the README and `iris --help`.
EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_INVALID = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4
# `iris job run` (waiting): the job parked in HANDOFF_FAILED; `iris ops replay-handoff` moves it on.
EXIT_PARKED = 5
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
    from iris.config import ConfigError, load_config

    try:
        cfg = load_config(STATE.config_file)
        if STATE.cluster is not None:
            cfg.check_cluster(STATE.cluster)
    except ConfigError as exc:
        fail(str(exc), EXIT_INVALID)
    return cfg


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine; SDK errors become one line on stderr and their exit code."""
    import asyncio

    from iris.client import IrisError
    from iris.payloadcodec import PayloadKeyError

    try:
        return asyncio.run(coro)
    except IrisError as exc:
        fail(str(exc), exc.exit_code)
    except PayloadKeyError as exc:  # a history this CLI has no payload key for
        fail(str(exc), EXIT_INVALID)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


async def client() -> AsyncIrisClient:
    from iris.client import AsyncIrisClient

    return await AsyncIrisClient.connect(config())
