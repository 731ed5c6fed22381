"""`iris`: the command line of the federated scheduler.

Starting it imports typer and the command modules only; each command imports what it needs when it
runs (cli/common.py), so `iris --help` answers at once (tests/test_cli_imports.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

# typer >= 0.2x vendors click: its parse errors are these classes, not the click package's.
from typer._click import exceptions as click_exceptions

from cli import common
from cli.dev import dev_command
from cli.doctor import doctor_command
from cli.job import job_app
from cli.keys import keys_app
from cli.ops_group import ops_app
from cli.peers import peers_command, rpc_app
from iris.defaults import DEFAULT_DATA_DIR

app = typer.Typer(
    rich_markup_mode=None,
    name="iris",
    help=(
        "Federated ML job scheduler on Temporal: submit once, run wherever capacity exists.\n\n"
        "Exit codes: 0 ok; 1 the job did not succeed; 2 invalid input or rejected job; "
        "3 not found; 4 a service is unavailable; 5 the job parked in HANDOFF_FAILED (iris job run: "
        "it prints the iris ops replay-handoff line to run); 130 interrupted."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(job_app, name="job")
app.add_typer(keys_app, name="keys")
app.add_typer(ops_app, name="ops")
app.add_typer(rpc_app, name="rpc")
app.command("peers")(peers_command)
app.command("dev")(dev_command)
app.command("doctor")(doctor_command)


@app.callback()
def root(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="IRIS_CONFIG",
            help="Federation config file (default: config/clusters.toml in the project).",
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="The cluster whose controller and federation to talk to (default: the config's home).",
        ),
    ] = None,
) -> None:
    common.STATE.config_file = config
    common.STATE.cluster = cluster
    if cluster is not None:
        common.config()  # an unknown cluster is refused before any command runs


@app.command("worker")
def worker_command(
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="Where the default SQLite federation store lives.")
    ] = DEFAULT_DATA_DIR,
    metrics_address: Annotated[
        str | None,
        typer.Option(
            "--metrics-address",
            envvar="IRIS_TEMPORAL_METRICS",
            metavar="HOST:PORT",
            help="Serve Prometheus metrics at http://HOST:PORT/metrics: the Temporal SDK's own "
            "(temporal_*) and Iris's (iris_*). Off by default. Bind 127.0.0.1 unless the scraper "
            "is elsewhere (the endpoint has no authentication); e.g. 0.0.0.0:9464 in a container.",
        ),
    ] = None,
) -> None:
    """Run a Temporal worker for the federation (workflows and activities) until interrupted."""
    from iris.config import ConfigError
    from iris.temporal import metrics_runtime
    from worker.main import run_worker

    cfg = common.config()
    try:
        metrics_runtime(metrics_address)  # a bad or busy address is refused before anything starts
    except ConfigError as exc:
        common.fail(str(exc), common.EXIT_INVALID)
    common.run(run_worker(cfg, data_dir, metrics_address=metrics_address))


def main() -> None:
    try:
        result = app(standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except click_exceptions.UsageError as exc:
        # One line, like every other refusal (not click's multi-line usage box). A bare group
        # (`iris job`) has already printed its help and has nothing to add.
        if exc.format_message():
            typer.secho(f"error: {exc.format_message()}", err=True, fg=typer.colors.RED)
        code = exc.exit_code
    except typer.Abort:
        code = common.EXIT_INTERRUPTED
    except click_exceptions.ClickException as exc:
        typer.secho(f"error: {exc.format_message()}", err=True, fg=typer.colors.RED)
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # Spans still pending (tracing on) are sent first: os._exit skips the exporter's atexit hook.
    # Tracing is configured only by a command that connected, which imported it.
    if "iris.tracing" in sys.modules:
        from iris import tracing

        tracing.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the Temporal SDK's runtime can crash at exit (sdk-python #300).
    os._exit(code)


if __name__ == "__main__":
    main()
