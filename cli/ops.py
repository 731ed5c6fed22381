"""`iris ops check-determinism`: replay live histories against this code (docs/DESIGN.md,
"Operations").

The command is registered on ``determinism_app``, which the `iris ops` group (cli/ops_group.py)
loads only when `iris ops` lists or runs its commands; the logic it needs lives next to it so tests
can call it without a subprocess.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import typer
from temporalio.client import Client, WorkflowHistory
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from cli import common
from iris import contract
from iris.client import InvalidJob, Unavailable
from iris.config import ConfigError
from iris.contract import JOB_WORKFLOW
from iris.payloadcodec import load_keyring
from iris.temporal import connect, data_converter

determinism_app = typer.Typer(rich_markup_mode=None, add_completion=False)


# ---- check-determinism -----------------------------------------------------------------------

DEFAULT_DETERMINISM_QUERY = f"WorkflowType = '{JOB_WORKFLOW}'"
# Exit code when some history does not replay (a deploy of this code would break those runs).
EXIT_NOT_REPLAYABLE = 1


def replayer() -> Replayer:
    """A replayer of every workflow the worker runs, with the worker's data converter (and this
    process's payload key ring: live histories are encrypted).

    Its own runtime logs nothing: the SDK core would print each nondeterminism as a warning on
    stdout, and the report already says it once, in one line.
    """
    from worker.main import WORKFLOWS
    from workflows.runner import workflow_runner

    quiet = Runtime(telemetry=TelemetryConfig(logging=None))
    return Replayer(
        workflows=list(WORKFLOWS),
        data_converter=data_converter(load_keyring()),
        runtime=quiet,
        workflow_runner=workflow_runner(),
    )


def workflow_type_of(history: WorkflowHistory) -> str:
    for event in history.events:
        if event.HasField("workflow_execution_started_event_attributes"):
            return str(event.workflow_execution_started_event_attributes.workflow_type.name)
    return ""


@dataclass
class ReplayFailure:
    workflow_id: str
    run_id: str
    workflow_type: str
    nondeterministic: bool
    message: str

    def line(self) -> str:
        kind = "nondeterministic" if self.nondeterministic else "replay failed"
        return f"FAIL {self.workflow_id} (run {self.run_id}, {self.workflow_type}): {kind}: {self.message}"


@dataclass
class DeterminismReport:
    """What one determinism check replayed and what did not replay cleanly."""

    query: str
    replayed: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    failures: list[ReplayFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        total = sum(self.replayed.values())
        by_type = ", ".join(f"{name} {n}" for name, n in sorted(self.replayed.items()))
        line = f"replayed {total} execution(s)" + (f" ({by_type})" if by_type else "")
        line += f" against the current worker code: {len(self.failures)} failed"
        if self.skipped:
            names = ", ".join(f"{name} {n}" for name, n in sorted(self.skipped.items()))
            skipped = sum(self.skipped.values())
            line += f"; skipped {skipped} of workflow types this worker does not run ({names})"
        return line + f"  [query: {self.query}]"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


async def replay_histories(histories: AsyncIterator[WorkflowHistory], query: str) -> DeterminismReport:
    """Replay every history; workflow types the worker does not register are skipped and counted."""
    known = set(contract.WORKFLOW_TYPES)
    report = DeterminismReport(query=query)

    async def registered() -> AsyncIterator[WorkflowHistory]:
        async for history in histories:
            wf_type = workflow_type_of(history)
            if wf_type in known:
                report.replayed[wf_type] += 1
                yield history
            else:
                report.skipped[wf_type or "?"] += 1

    async with replayer().workflow_replay_iterator(registered()) as results:
        async for result in results:
            failure = result.replay_failure
            if failure is None:
                continue
            history = result.history
            report.failures.append(
                ReplayFailure(
                    workflow_id=history.workflow_id,
                    run_id=history.run_id,
                    workflow_type=workflow_type_of(history),
                    nondeterministic=isinstance(failure, NondeterminismError),
                    message=_first_line(failure),
                )
            )
    return report


async def check_determinism(client: Client, query: str, limit: int | None = None) -> DeterminismReport:
    """Fetch the histories of every execution ``query`` matches and replay them against this code."""
    try:
        executions = client.list_workflows(query, limit=limit)
        return await replay_histories(executions.map_histories(), query)
    except RPCError as exc:
        if exc.status == RPCStatusCode.INVALID_ARGUMENT:
            raise InvalidJob(f"invalid query {query!r}: {exc.message}") from None
        raise Unavailable(f"cannot read workflow histories: {exc.message}") from None


def print_report(report: DeterminismReport) -> None:
    typer.echo(report.summary())
    for failure in report.failures:
        typer.echo(failure.line())


@determinism_app.command("check-determinism")
def check_determinism_command(
    query: Annotated[
        str,
        typer.Option("--query", help="Temporal visibility query selecting the executions to replay."),
    ] = DEFAULT_DETERMINISM_QUERY,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Replay at most this many executions.")
    ] = None,
) -> None:
    """Replay live workflow histories against the current worker code (run before a deploy).

    Prints one summary line and one line per execution that does not replay; exits 1 if any.
    """

    async def go() -> int:
        cfg = common.config()
        try:
            client = await connect(cfg)
        except ConfigError as exc:  # e.g. an unreadable payload key ring
            raise InvalidJob(str(exc)) from None
        except RuntimeError as exc:
            raise Unavailable(f"cannot reach Temporal at {cfg.temporal.address}: {exc}") from None
        report = await check_determinism(client, query, limit)
        print_report(report)
        return common.EXIT_OK if report.ok else EXIT_NOT_REPLAYABLE

    raise typer.Exit(common.run(go()))
